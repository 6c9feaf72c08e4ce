"""Loss kernels against onnxruntime on cases the node suite leaves out (half precision, 2-D, sum)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, lookup

ort = pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402


def _run_ort(op: str, args: list[Any], attrs: dict[str, Any], n_out: int) -> list[Any]:
    names = [f"in{i}" for i in range(len(args))]
    outs = [f"out{i}" for i in range(n_out)]
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, args)
    ]
    elem = helper.np_dtype_to_tensor_dtype(args[0].dtype)
    outputs = [helper.make_tensor_value_info(o, elem, None) for o in outs]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, args)))


def _run_dsp(op: str, args: list[Any], attrs: dict[str, Any], n_out: int) -> Any:
    out = lookup(op).kernel(KernelContext(np, 13, len(args), n_out), *args, **attrs)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy_matches_onnxruntime(reduction: str, dtype: Any, weighted: bool) -> None:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((4, 5, 3)).astype(dtype)
    labels = rng.integers(0, 5, (4, 3)).astype(np.int64)
    labels[0, 0] = -1
    args = [scores, labels] + ([rng.random(5).astype(dtype)] if weighted else [])
    attrs = {"reduction": reduction, "ignore_index": -1}
    tol = 2e-3 if dtype == np.float16 else 1e-5
    for e, g in zip(
        _run_ort("SoftmaxCrossEntropyLoss", args, attrs, 2), _run_dsp("SoftmaxCrossEntropyLoss", args, attrs, 2)
    ):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_2d_input(reduction: str) -> None:
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32)]
    (expected,) = _run_ort("NegativeLogLikelihoodLoss", args, {"reduction": reduction}, 1)
    (got,) = _run_dsp("NegativeLogLikelihoodLoss", args, {"reduction": reduction}, 1)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6)


class _DeviceScalar(np.ndarray):
    """A scalar that, like a CuPy array inside a capture, must not be read back on the host."""

    def __float__(self) -> float:
        raise AssertionError("read on the host")

    def __bool__(self) -> bool:
        raise AssertionError("read on the host")

    def item(self, *args: Any) -> Any:
        raise AssertionError("read on the host")


@pytest.mark.parametrize("t", [0, 3])
def test_momentum_and_adam_decide_their_first_step_without_reading_t_back(t: int) -> None:
    """The step count T picks the first step's special case on the array's own side (a device
    segment never copies it to the host), with the values of the host arithmetic."""
    rng = np.random.default_rng(t)
    x, g, v, h = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4))
    h = np.abs(h)  # a sum of squares
    r = np.asarray(0.1, np.float32)
    step = np.asarray(t, np.int64).view(_DeviceScalar)
    ctx = KernelContext(np, 1, 5, 2)
    training = "ai.onnx.preview.training"
    got = lookup("Momentum", training).kernel(
        ctx, r, step, x, g, v, alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.01
    )
    beta = 0.1 if t > 0 else 1.0
    v_new = 0.9 * v + beta * (0.01 * x + g)
    np.testing.assert_array_equal(got[1], v_new.astype(np.float32))
    np.testing.assert_array_equal(got[0], (x - r * v_new).astype(np.float32))
    adam = lookup("Adam", training).kernel(KernelContext(np, 1, 6, 3), r, step, x, g, v, h, alpha=0.9, beta=0.999)
    rate = r * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) if t > 0 else r
    v2 = 0.9 * v + 0.1 * g
    h2 = 0.999 * h + 0.001 * g * g
    np.testing.assert_allclose(adam[0], x - rate * v2 / (np.sqrt(h2) + 1e-6), rtol=1e-6)
