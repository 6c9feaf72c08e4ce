"""Conv-family kernels against naive loop implementations on random shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, TensorInfo, lookup


def _ctx(opset: int = 22, n_outputs: int = 1) -> KernelContext:
    return KernelContext(np, opset, 3, n_outputs)


def _naive_conv(x, w, b, strides, pads, dilations, group):
    """Direct N-D convolution, one output element at a time."""
    nd = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + nd]) for i in range(nd)])
    m, cg = w.shape[:2]
    kernel = w.shape[2:]
    out = [(xp.shape[2 + i] - (kernel[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(nd)]
    y = np.zeros((x.shape[0], m, *out))
    for n, oc in itertools.product(range(x.shape[0]), range(m)):
        g = oc // (m // group)
        for pos in itertools.product(*(range(o) for o in out)):
            acc = 0.0
            for ic, kk in itertools.product(range(cg), itertools.product(*(range(k) for k in kernel))):
                src = tuple(p * s + k * d for p, s, k, d in zip(pos, strides, kk, dilations))
                acc += xp[(n, g * cg + ic, *src)] * w[(oc, ic, *kk)]
            y[(n, oc, *pos)] = acc + (b[oc] if b is not None else 0.0)
    return y


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("group", [1, 2])
def test_conv_matches_naive(nd: int, group: int) -> None:
    rng = np.random.default_rng(nd * 10 + group)
    x = rng.standard_normal((2, 4, *([6] * nd))).astype(np.float32)
    w = rng.standard_normal((6, 4 // group, *([3] * nd))).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    strides, dilations = [2] + [1] * (nd - 1), [1] * (nd - 1) + [2]
    pads = list(rng.integers(0, 2, 2 * nd))
    y = lookup("Conv").kernel(_ctx(), x, w, b, strides=strides, pads=pads, dilations=dilations, group=group)
    expected = _naive_conv(x, w, b, strides, pads, dilations, group)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


def test_conv_float16_keeps_dtype() -> None:
    x = np.ones((1, 2, 5, 5), np.float16)
    w = np.ones((3, 2, 3, 3), np.float16)
    y = lookup("Conv").kernel(_ctx(), x, w, auto_pad="SAME_UPPER")
    assert y.dtype == np.float16 and y.shape == (1, 3, 5, 5)
    assert y[0, 0, 2, 2] == 18 and y[0, 0, 0, 0] == 8


def test_conv_transpose_is_adjoint_of_conv() -> None:
    """<conv(x), y> == <x, conv_transpose(y)> for the same weights and geometry."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 7, 6))
    w = rng.standard_normal((6, 2, 3, 2))  # Conv: M=6, C/group=2, group=2
    attrs = dict(strides=[2, 1], pads=[1, 0, 1, 1], dilations=[1, 2], group=2)
    y = lookup("Conv").kernel(_ctx(), x, w, **attrs)
    r = rng.standard_normal(y.shape)
    # ConvTranspose reads the same weights as (C_in=6, C_out/group=2, k...)
    back = lookup("ConvTranspose").kernel(_ctx(), r, w, **attrs)
    assert back.shape == x.shape
    np.testing.assert_allclose((y * r).sum(), (x * back).sum(), rtol=1e-9)


def _naive_pool(x, kernel, strides, pads, reduce):
    nd = len(kernel)
    out = [(x.shape[2 + i] + pads[i] + pads[i + nd] - kernel[i]) // strides[i] + 1 for i in range(nd)]
    y = np.zeros((*x.shape[:2], *out), x.dtype)
    for pos in itertools.product(*(range(o) for o in out)):
        lo = [max(p * s - pads[i], 0) for i, (p, s) in enumerate(zip(pos, strides))]
        hi = [min(p * s - pads[i] + kernel[i], x.shape[2 + i]) for i, (p, s) in enumerate(zip(pos, strides))]
        win = x[(slice(None), slice(None), *(slice(a, b) for a, b in zip(lo, hi)))]
        axes = tuple(range(2, 2 + nd))
        y[(slice(None), slice(None), *pos)] = win.max(axis=axes) if reduce == "max" else win.mean(axis=axes)
    return y


@pytest.mark.parametrize("reduce", ["max", "avg"])
def test_pools_match_naive(reduce: str) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 8)).astype(np.float32)
    attrs = dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1])
    name = "MaxPool" if reduce == "max" else "AveragePool"
    y = lookup(name).kernel(_ctx(), x, **attrs)
    y = y[0] if isinstance(y, tuple) else y
    np.testing.assert_allclose(y, _naive_pool(x, [3, 2], [2, 2], [1, 0, 1, 1], reduce), rtol=1e-5, atol=1e-6)


def test_maxpool_indices_point_at_the_max() -> None:
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 5)).astype(np.float32)
    y, idx = lookup("MaxPool").kernel(_ctx(n_outputs=2), x, kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 0, 1])
    np.testing.assert_array_equal(x.reshape(-1)[idx], y)


def test_resize_linear_identity_and_nearest_repeat() -> None:
    x = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    resize = lookup("Resize").kernel
    same = resize(_ctx(19), x, None, np.array([1, 1, 1, 1], np.float32), mode="linear")
    np.testing.assert_array_equal(same, x)
    scales = np.array([1, 1, 2, 2], np.float32)
    up = resize(_ctx(19), x, None, scales, nearest_mode="floor", coordinate_transformation_mode="asymmetric")
    np.testing.assert_array_equal(up, x.repeat(2, axis=2).repeat(2, axis=3))


def test_shape_rules() -> None:
    x = TensorInfo("float32", (1, 3, 224, 224))
    w = TensorInfo("float32", (64, 3, 7, 7))
    (y,) = lookup("Conv").shape_rule({"strides": [2, 2], "pads": [3, 3, 3, 3]}, x, w)
    assert y.shape == (1, 64, 112, 112)
    y, _ = lookup("MaxPool").shape_rule({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, x)
    assert y.shape == (1, 3, 112, 112)
    (y,) = lookup("ConvTranspose").shape_rule({"strides": [2, 2]}, x, TensorInfo("float32", (3, 8, 2, 2)))
    assert y.shape == (1, 8, 448, 448)
