"""LSTM, GRU and RNN kernels against onnxruntime on the attributes the node suite leaves out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, lookup

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6


def _inputs(op: str, n_dirs: int, rng: np.random.Generator, lens: list[int] | None) -> list[Any]:
    g = GATES[op]
    x = rng.standard_normal((SEQ, BATCH, INPUT)).astype(np.float32)
    w = rng.standard_normal((n_dirs, g * HIDDEN, INPUT)).astype(np.float32) * 0.5
    r = rng.standard_normal((n_dirs, g * HIDDEN, HIDDEN)).astype(np.float32) * 0.5
    b = rng.standard_normal((n_dirs, 2 * g * HIDDEN)).astype(np.float32)
    seq_lens = None if lens is None else np.array(lens, np.int32)
    h0 = rng.standard_normal((n_dirs, BATCH, HIDDEN)).astype(np.float32)
    args = [x, w, r, b, seq_lens, h0]
    if op == "LSTM":
        args += [rng.standard_normal((n_dirs, BATCH, HIDDEN)).astype(np.float32)]
        args += [rng.standard_normal((n_dirs, 3 * HIDDEN)).astype(np.float32)]
    return args


def _run_ort(op: str, args: list[Any], attrs: dict[str, Any], n_out: int) -> list[Any]:
    names = [f"in{i}" if a is not None else "" for i, a in enumerate(args)]
    outs = [f"out{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, args)
        if a is not None
    ]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: a for n, a in zip(names, args) if a is not None})


def _run_dsp(op: str, args: list[Any], attrs: dict[str, Any], n_out: int) -> tuple[Any, ...]:
    ctx = KernelContext(np, 22, len(args), n_out)
    return lookup(op).kernel(ctx, *args, **attrs)


CASES = [
    ("forward", None, {}),
    ("reverse", [5, 2, 3], {}),
    ("bidirectional", [1, 5, 4], {}),
    ("forward", [3, 0, 5], {"clip": 0.7}),
    ("bidirectional", None, {"activation_alpha": [0.3, 0.2], "activation_beta": [0.4]}),
]


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction,lens,extra", CASES)
def test_matches_onnxruntime(op: str, direction: str, lens: list[int] | None, extra: dict[str, Any]) -> None:
    n_dirs = 2 if direction == "bidirectional" else 1
    args = _inputs(op, n_dirs, np.random.default_rng(0), lens)
    attrs: dict[str, Any] = {"hidden_size": HIDDEN, "direction": direction, **extra}
    if "activation_alpha" in extra:
        per_dir = {"LSTM": ["HardSigmoid", "LeakyRelu", "Softsign"], "GRU": ["HardSigmoid", "Elu"]}
        attrs["activations"] = per_dir.get(op, ["LeakyRelu"]) * n_dirs
        if op == "RNN":
            attrs["activations"] = ["LeakyRelu", "ScaledTanh"]
    n_out = 3 if op == "LSTM" else 2
    expected = _run_ort(op, args, attrs, n_out)
    got = _run_dsp(op, args, attrs, n_out)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_op_specific_attributes(op: str) -> None:
    args = _inputs(op, 1, np.random.default_rng(1), None)
    extra = {"input_forget": 1} if op == "LSTM" else {"linear_before_reset": 1}
    attrs = {"hidden_size": HIDDEN, **extra}
    n_out = 3 if op == "LSTM" else 2
    for e, g in zip(_run_ort(op, args, attrs, n_out), _run_dsp(op, args, attrs, n_out)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_layout_1_is_layout_0_transposed() -> None:
    args = _inputs("LSTM", 2, np.random.default_rng(2), [5, 3, 1])
    y, y_h, y_c = _run_dsp("LSTM", args, {"direction": "bidirectional"}, 3)
    x, w, r, b, lens, h0, c0, p = args
    batchwise = [x.transpose(1, 0, 2), w, r, b, lens, h0.transpose(1, 0, 2), c0.transpose(1, 0, 2), p]
    y1, y_h1, y_c1 = _run_dsp("LSTM", batchwise, {"direction": "bidirectional", "layout": 1}, 3)
    np.testing.assert_allclose(y1, y.transpose(2, 0, 1, 3))
    np.testing.assert_allclose(y_h1, y_h.transpose(1, 0, 2))
    np.testing.assert_allclose(y_c1, y_c.transpose(1, 0, 2))


def test_inputs_not_written() -> None:
    args = _inputs("GRU", 1, np.random.default_rng(3), [2, 5, 4])
    copies = [None if a is None else a.copy() for a in args]
    _run_dsp("GRU", args, {"clip": 0.5}, 2)
    for a, c in zip(args, copies):
        if a is not None:
            np.testing.assert_array_equal(a, c)
