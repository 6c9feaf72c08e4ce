"""PTX_JIT's LayerNormalization and Softmax kernels (committed PTX) against the reference kernels."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, lookup


def _reference(op: str, n_outputs: int, opset: int = 17, **attrs):
    import cupy as cp

    ctx = KernelContext(cp, opset, 3, n_outputs)
    return functools.partial(lookup(op).kernel, ctx, **attrs)


@pytest.fixture(scope="module")
def st():
    from dsp_cuda_graphs import device

    return device.state(False)


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("float16", 2e-3)])
@pytest.mark.parametrize("shape", [(3, 1), (2, 7), (4, 64), (1, 12, 300), (5, 1280), (2, 2049)])
def test_layer_norm_matches_reference(st, shape, dtype: str, tol: float) -> None:
    import cupy as cp
    from dsp_nvrtc.rowwise import layer_norm_kernel

    rng = np.random.default_rng(sum(shape))
    x = cp.asarray(rng.standard_normal(shape).astype(dtype) * 3 + 1)
    scale = cp.asarray(rng.standard_normal(shape[-1]).astype(dtype))
    bias = cp.asarray(rng.standard_normal(shape[-1]).astype(dtype))
    ref = _reference("LayerNormalization", 1, epsilon=1e-5)
    fused = layer_norm_kernel(st, ref, 1, epsilon=1e-5)
    for b in (bias, None):
        want = cp.asnumpy(ref(x, scale, b)[0]).astype(np.float64)
        got = fused(x, scale, b)[0]
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-6), ("float16", 1e-3)])
@pytest.mark.parametrize("shape", [(3, 1), (2, 7), (1, 12, 1, 160), (4, 1000), (2, 3000)])
def test_softmax_matches_reference(st, shape, dtype: str, tol: float) -> None:
    import cupy as cp
    from dsp_nvrtc.rowwise import softmax_kernel

    rng = np.random.default_rng(len(shape) * 7 + shape[-1])
    x = cp.asarray((rng.standard_normal(shape) * 4).astype(dtype))
    ref = _reference("Softmax", 1, opset=13)
    fused = softmax_kernel(st, ref, 13)
    got = fused(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_allclose(
        cp.asnumpy(got).astype(np.float64), cp.asnumpy(ref(x)).astype(np.float64), rtol=tol, atol=tol
    )


def test_other_axes_and_outputs_fall_back_to_the_reference(st) -> None:
    import cupy as cp
    from dsp_nvrtc.rowwise import layer_norm_kernel, softmax_kernel

    x = cp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32))
    ref_sm = _reference("Softmax", 1, opset=13, axis=1)
    np.testing.assert_array_equal(cp.asnumpy(softmax_kernel(st, ref_sm, 13, axis=1)(x)), cp.asnumpy(ref_sm(x)))
    ref_ln = _reference("LayerNormalization", 3, axis=1)
    scale = cp.ones((3, 4), np.float32)
    got = layer_norm_kernel(st, ref_ln, 3, axis=1)(x, scale)
    assert got[1] is not None  # Mean and InvStdDev computed by the reference
