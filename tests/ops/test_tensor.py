"""Tensor-family kernels on what the node suite leaves out: old-opset attribute forms,
edge cases (clamping, empty reductions, ties), shape rules and traits.

The oracle is onnxruntime, run on a one-node model at the given opset (onnx's own
ReferenceEvaluator departs from the spec on some of these: Slice clamping with negative
steps, negative Pad pads, Unique with sorted=0).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, lookup

ort = pytest.importorskip("onnxruntime")
from onnx import helper, shape_inference  # noqa: E402


def _reference(op: str, args: list[Any], attrs: dict[str, Any], n_out: int, opset: int) -> list[Any]:
    names = [f"in{i}" if a is not None else "" for i, a in enumerate(args)]
    outs = [f"out{i}" for i in range(n_out)]
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, args)
        if a is not None
    ]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], "g", inputs, [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    typed = {v.name: v for v in shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.extend(typed[o] for o in outs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, {n: a for n, a in zip(names, args) if a is not None}))


def _dsp(op: str, args: list[Any], attrs: dict[str, Any], n_out: int, opset: int) -> list[Any]:
    out = lookup(op).kernel(KernelContext(np, opset, len(args), n_out), *args, **attrs)
    return list(out[:n_out]) if isinstance(out, tuple) else [out]


def _check(op: str, args: list[Any], attrs: dict[str, Any] | None = None, n_out: int = 1, opset: int = 21) -> None:
    attrs = attrs or {}
    expected = _reference(op, args, attrs, n_out, opset)
    got = _dsp(op, args, attrs, n_out, opset)
    for e, g in zip(expected, got):
        e = np.asarray(e)
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


X = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)


# Attribute forms of older opsets.


def test_slice_opset1_attributes() -> None:
    _check("Slice", [X], {"starts": [0, 1], "ends": [1, 100], "axes": [0, 2]}, opset=9)


def test_split_opset2_split_attribute() -> None:
    _check("Split", [X], {"axis": 2, "split": [1, 3]}, n_out=2, opset=11)


def test_pad_opset2_pads_and_value_attributes() -> None:
    _check("Pad", [X], {"pads": [0, 1, 0, 0, 2, 1], "value": 7.0}, opset=2)


def test_topk_opset1_k_attribute() -> None:
    _check("TopK", [X], {"k": 2, "axis": 1}, n_out=2, opset=1)


@pytest.mark.parametrize("op", ["Squeeze", "Unsqueeze"])
def test_squeeze_unsqueeze_axes_attribute(op: str) -> None:
    data = X.reshape(2, 1, 12)
    _check(op, [data], {"axes": [1]}, opset=11)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceLogSumExp", "ReduceL2"])
def test_reduce_axes_attribute(op: str) -> None:
    _check(op, [X], {"axes": [0, -1], "keepdims": 0}, opset=11)


# Edge cases.


@pytest.mark.parametrize(
    ("starts", "ends", "steps"),
    [((-100,), (-200,), (-1,)), ((100,), (-100,), (-2,)), ((-1,), (0,), (-1,)), ((2,), (2**62,), (1,))],
)
def test_slice_clamping(starts: tuple[int, ...], ends: tuple[int, ...], steps: tuple[int, ...]) -> None:
    _check("Slice", [X, _i64(*starts), _i64(*ends), _i64(2), _i64(*steps)])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_negative_pads_and_axes(mode: str) -> None:
    _check("Pad", [X, _i64(1, -1, 2, 0), None, _i64(1, -1)], {"mode": mode})


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceLogSumExp", "ReduceSum", "ReduceProd"])
def test_reduce_over_empty_axis(op: str) -> None:
    _check(op, [np.zeros((2, 0, 3), np.float32), _i64(1)])


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_int_empty_gives_dtype_limit(op: str) -> None:
    _check(op, [np.zeros((0, 3), np.int32), _i64(0)], {"keepdims": 0})


def test_reduce_noop_with_empty_axes() -> None:
    _check("ReduceSum", [X, np.zeros(0, np.int64)], {"noop_with_empty_axes": 1})


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float32])
def test_topk_ties_take_lower_index(largest: int, dtype: Any) -> None:
    data = np.array([[3, 1, 3, 0, 1, 3]], dtype=dtype)
    got = _dsp("TopK", [data, _i64(4)], {"largest": largest}, 2, 21)
    order = [0, 2, 5, 1] if largest else [3, 1, 4, 0]
    np.testing.assert_array_equal(got[1], [order])
    np.testing.assert_array_equal(got[0], data[:, order])


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("is_sorted", [0, 1])
def test_unique(axis: int | None, is_sorted: int) -> None:
    data = np.array([[2, 1, 2], [0, 5, 0], [2, 1, 2]], dtype=np.float32)
    attrs = {"sorted": is_sorted} | ({} if axis is None else {"axis": axis})
    _check("Unique", [data], attrs, n_out=4)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd_reduction_does_not_touch_input(reduction: str) -> None:
    data = X.copy()
    indices, updates = _i64(1, 0, -1).reshape(3, 1), np.ones((3, 3, 4), np.float32) * 2
    if reduction == "none":
        indices = _i64(1, 0).reshape(2, 1)
        updates = updates[:2]
    _check("ScatterND", [data, indices, updates], {"reduction": reduction}, opset=18)
    np.testing.assert_array_equal(data, X)


@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_int32_keeps_dtype(exclusive: int, reverse: int) -> None:
    _check("CumSum", [X.astype(np.int32), np.array(1, np.int64)], {"exclusive": exclusive, "reverse": reverse})


def test_gather_nd_batch_dims() -> None:
    indices = np.array([[[1, 0]], [[0, -1]]], dtype=np.int64)
    _check("GatherND", [X, indices], {"batch_dims": 1})


def test_reverse_sequence_batch_first() -> None:
    _check("ReverseSequence", [X, _i64(3, 1)], {"batch_axis": 0, "time_axis": 1})


def test_one_hot_negative_axis_and_indices() -> None:
    _check("OneHot", [_i64(0, -1, 5, 2), _i64(4), np.array([0, 9], np.float32)], {"axis": 0})


# Shape rules and traits.


def _rule(op: str, attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    rule = lookup(op).shape_rule
    assert rule is not None, f"{op} has no shape rule"
    return list(rule(attrs, *inputs))


F = TensorInfo("float32", ("N", 3, 4))


@pytest.mark.parametrize(
    ("op", "attrs", "inputs", "expected"),
    [
        ("Shape", {"start": 1}, (F,), TensorInfo("int64", (2,))),
        ("Size", {}, (F,), TensorInfo("int64", ())),
        ("Transpose", {}, (F,), TensorInfo("float32", (4, 3, "N"))),
        ("Flatten", {"axis": 1}, (F,), TensorInfo("float32", ("N", 12))),
        ("Flatten", {"axis": -1}, (F,), TensorInfo("float32", (None, 4))),
        ("Concat", {"axis": 1}, (F, F), TensorInfo("float32", ("N", 6, 4))),
        ("Concat", {"axis": 0}, (F, F), TensorInfo("float32", (None, 3, 4))),
        ("Gather", {"axis": 1}, (F, TensorInfo("int64", (5, 6))), TensorInfo("float32", ("N", 5, 6, 4))),
        ("GatherND", {"batch_dims": 1}, (F, TensorInfo("int64", ("N", 2, 1))), TensorInfo("float32", ("N", 2, 4))),
        ("ArgMax", {"axis": 1, "keepdims": 0}, (F,), TensorInfo("int64", ("N", 4))),
        (
            "SpaceToDepth",
            {"blocksize": 2},
            (TensorInfo("float32", (1, 3, 4, 6)),),
            TensorInfo("float32", (1, 12, 2, 3)),
        ),
        ("EyeLike", {"dtype": 7}, (TensorInfo("float32", (3, 4)),), TensorInfo("int64", (3, 4))),
        ("Constant", {"value_ints": [1, 2]}, (), TensorInfo("int64", (2,))),
    ],
)
def test_shape_rules(op: str, attrs: dict[str, Any], inputs: tuple[TensorInfo, ...], expected: TensorInfo) -> None:
    assert _rule(op, attrs, *inputs) == [expected]


@pytest.mark.parametrize(
    ("op", "trait"),
    [
        ("Shape", Trait.SHAPE_ONLY_OUTPUT),
        ("Size", Trait.SHAPE_ONLY_OUTPUT),
        ("Reshape", Trait.VALUE_DEPENDENT_SHAPE),
        ("Slice", Trait.VALUE_DEPENDENT_SHAPE),
        ("TopK", Trait.VALUE_DEPENDENT_SHAPE),
        ("ReduceSum", Trait.VALUE_DEPENDENT_SHAPE | Trait.REDUCTION),
        ("ArgMin", Trait.REDUCTION),
        ("NonZero", Trait.DYNAMIC_OUTPUT_SIZE),
        ("Unique", Trait.DYNAMIC_OUTPUT_SIZE),
        ("Compress", Trait.DYNAMIC_OUTPUT_SIZE),
        ("Transpose", Trait.FULLY_WRITING),
    ],
)
def test_traits(op: str, trait: Trait) -> None:
    assert lookup(op).has(trait) and (lookup(op).traits & trait) == trait


def test_reduce_family_registers_axes_attribute_and_docstring() -> None:
    for name in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2"):
        opdef = lookup(name)
        assert {"axes", "keepdims", "noop_with_empty_axes"} <= set(opdef.attrs)
        assert opdef.inputs == (1, 2) and opdef.doc


_R = np.random.default_rng(0)
_CASES: list[tuple[str, list[Any], dict[str, Any], int, int]] = [
    ("ReduceMean", [X.astype(np.int32), _i64(1)], {}, 1, 18),
    ("ReduceLogSumExp", [X.astype(np.float16) / 4, _i64(-1)], {"keepdims": 0}, 1, 18),
    ("ReduceMax", [np.array([[True, False], [False, False]]), _i64(1)], {}, 1, 20),
    ("ArgMax", [np.array([[1, 3, 3], [2, 2, 0]], np.float32)], {"axis": 1, "select_last_index": 1}, 1, 13),
    ("ArgMin", [np.array([[1, 0, 0], [2, 2, 0]], np.int64)], {"axis": -1, "keepdims": 0}, 1, 13),
    ("Range", [np.array(1.5, np.float32), np.array(-2, np.float32), np.array(-0.7, np.float32)], {}, 1, 11),
    ("Range", [np.array(10, np.int32), np.array(3, np.int32), np.array(2, np.int32)], {}, 1, 11),
    ("Expand", [X[:, :1, :], _i64(3, 2, 1, 1)], {}, 1, 13),
    ("Tile", [X, _i64(1, 2, 3)], {}, 1, 13),
    ("Trilu", [X, np.array(-1, np.int64)], {"upper": 0}, 1, 14),
    ("Gather", [X, np.array([[-1, 0]], np.int64)], {"axis": 2}, 1, 13),
    ("GatherElements", [X, _R.integers(-3, 3, (2, 2, 4))], {"axis": 1}, 1, 13),
    ("Compress", [X, np.array([True, False, True])], {}, 1, 11),
    ("EyeLike", [np.zeros((3, 5), np.int32)], {"k": 2, "dtype": 1}, 1, 9),
    (
        "ScatterElements",
        [X, np.zeros((2, 2, 4), np.int64), np.ones((2, 2, 4), np.float32)],
        {"reduction": "add"},
        1,
        18,
    ),
    ("ScatterElements", [X, np.array([[[0, 2, 1, 0]]]), -np.ones((1, 1, 4), np.float32)], {"axis": 1}, 1, 16),
    ("Split", [X[:, :, :3].copy()], {"axis": -1, "num_outputs": 2}, 2, 18),
    ("Split", [X, _i64(1, 2)], {"axis": 1}, 2, 13),
    ("Flatten", [X], {"axis": -2}, 1, 13),
    ("Transpose", [X], {"perm": [1, 0, 2]}, 1, 13),
    ("Shape", [X], {"start": -2, "end": 10}, 1, 15),
    ("CumProd", [X + 1, np.array(-1, np.int64)], {"exclusive": 1, "reverse": 1}, 1, 26),
    ("NonZero", [np.array([[0, 1], [2, 0]], np.float32)], {}, 1, 13),
    (
        "OneHot",
        [np.array([[1.7, -2.0]], np.float32), np.array(3.0, np.float32), np.array([-5, 5], np.float32)],
        {},
        1,
        11,
    ),
    ("DepthToSpace", [_R.random((1, 8, 2, 3)).astype(np.float32)], {"blocksize": 2, "mode": "CRD"}, 1, 13),
    ("SpaceToDepth", [_R.random((1, 2, 4, 6)).astype(np.float32)], {"blocksize": 2}, 1, 13),
    ("ConstantOfShape", [_i64(2, 0, 3)], {}, 1, 20),
    ("Reshape", [X, _i64(0, -1, 2)], {}, 1, 14),
    ("Reshape", [np.zeros((0, 3), np.float32), _i64(3, 0)], {"allowzero": 1}, 1, 14),
    ("Concat", [X, X[:, :1]], {"axis": -2}, 1, 13),
]


@pytest.mark.parametrize(("op", "args", "attrs", "n_out", "opset"), _CASES, ids=[c[0] for c in _CASES])
def test_matches_onnxruntime(op: str, args: list[Any], attrs: dict[str, Any], n_out: int, opset: int) -> None:
    _check(op, args, attrs, n_out=n_out, opset=opset)


@pytest.mark.parametrize(("mode", "last"), [("linear", 3), ("circular", 4)])
def test_tensor_scatter_writes_each_batch_from_its_index(mode: str, last: int) -> None:
    cache = np.zeros((2, 3, 5, 2), np.float32)
    update = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2) + 1
    out = _dsp("TensorScatter", [cache, update, _i64(1, last)], {"mode": mode}, 1, 24)[0]
    expected = cache.copy()
    expected[0, :, 1:3] = update[0]
    expected[1, :, [3, 4] if mode == "linear" else [4, 0]] = update[1].transpose(1, 0, 2)
    np.testing.assert_array_equal(out, expected)
    assert not cache.any()


def test_center_crop_pad_odd_differences() -> None:
    data = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    out = _dsp("CenterCropPad", [data, _i64(2, 7)], {}, 1, 18)[0]
    assert out.shape == (2, 7)
    np.testing.assert_array_equal(out[:, 1:5], data[1:3])
    assert not out[:, [0, 5, 6]].any()


def test_shape_inference_only_with_axes_inputs() -> None:
    """Ops taking axes as an input must not have a rule that cannot answer without values."""
    from onnx import TensorProto

    from dsp_core.onnx_backend import DSPBackend

    nodes = [
        helper.make_node("Unsqueeze", ["x", "a0"], ["u"]),
        helper.make_node("Squeeze", ["u", "a0"], ["s"]),
        helper.make_node("ReduceMax", ["s", "a1"], ["y"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
        helper.make_tensor_value_info("a0", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("a1", TensorProto.INT64, [1]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rep = DSPBackend.prepare(model, mode="shape_inference_only")
    x = np.broadcast_to(np.zeros((), np.float32), (3, 4))  # an abstract value, as that mode makes them
    (y,) = rep.run([x, _i64(0), _i64(-1)])
    assert y.shape == (3,) and y.dtype == np.float32
