"""The op table's traits checked against what each kernel actually does.

A trait is a promise the plan compiler and the backends rely on (a fusing backend takes
ELEMENTWISE slots, a capturable segment ends at a DYNAMIC_OUTPUT_SIZE slot, ...). Each
test here calls reference kernels directly and checks one promise, parametrized over
the ops that make it so that a failure names the op. Where a promise cannot be checked
by running a kernel (CONTROL_FLOW, RANDOM) the table is checked against ONNX's schemas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dsp_core.ir import dtypes
from dsp_core.ops.registry import KernelContext, OpDef, Trait, all_ops, lookup

onnx_defs = pytest.importorskip("onnx.defs")

OPSET = 24  # a recent opset; an op newer than it runs at its own first opset

# ONNX type strings of the dtypes DSP computes with, in the order an input dtype is picked.
_PREFERRED = ["float32", "int32", "int64", "bool", "float64", "float16", "int8", "uint8", "uint32", "uint64"]
_ONNX_TYPE = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
    "bool": "tensor(bool)",
    **{f"{k}{w}": f"tensor({k}{w})" for k in ("int", "uint") for w in (8, 16, 32, 64)},
}


# ---------------------------------------------------------------------------
# Helpers


def _ops_with(trait: Trait) -> list[OpDef]:
    return [o for o in all_ops() if o.has(trait)]


def _op_id(opdef: OpDef) -> str:
    return f"{opdef.domain}::{opdef.name}" if opdef.domain else opdef.name


def _run(op: str | OpDef, *inputs: Any, n_outputs: int = 1, opset: int | None = None, **attrs: Any) -> Any:
    """Call the reference kernel of ``op`` (a default-domain name or an OpDef) as the executor does."""
    opdef = lookup(op) if isinstance(op, str) else op
    ctx = KernelContext(np, opset if opset is not None else max(OPSET, opdef.since), len(inputs), n_outputs)
    with np.errstate(all="ignore"):
        return opdef.kernel(ctx, *inputs, **attrs)


def _outputs(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)


def _shape_of(value: Any) -> Any:
    """An array's shape; a sequence's (a list's) length and element shapes."""
    if isinstance(value, list):
        return ("sequence", len(value), tuple(np.shape(v) for v in value))
    return np.shape(value)


def _shapes(result: Any) -> tuple[Any, ...]:
    return tuple(_shape_of(r) for r in _outputs(result))


def _schema(opdef: OpDef) -> Any | None:
    """ONNX's latest schema of the op, or None when this onnx package has none."""
    try:
        return onnx_defs.get_schema(opdef.name, domain=opdef.domain)
    except Exception:  # onnx.defs.SchemaError: an op newer than the installed onnx
        return None


def _allowed_dtypes(opdef: OpDef, input_index: int = 0) -> list[str]:
    """DSP dtypes that ONNX allows for one input of the op (float32 when unknown)."""
    schema = _schema(opdef)
    if schema is None or input_index >= len(schema.inputs):
        return ["float32"]
    type_str = schema.inputs[input_index].type_str
    allowed = next((set(c.allowed_type_strs) for c in schema.type_constraints if c.type_param_str == type_str), None)
    if allowed is None:  # a concrete type such as "tensor(int64)"
        allowed = {type_str}
    return [d for d in dtypes.DTYPE_NAMES if _ONNX_TYPE.get(d, f"tensor({d})") in allowed]


def _pick_dtype(opdef: OpDef, input_index: int = 0) -> str:
    allowed = _allowed_dtypes(opdef, input_index)
    return next((d for d in _PREFERRED if d in allowed), allowed[0])


def _random(rng: np.random.Generator, shape: Sequence[int], dtype: str, *, nonzero: bool = False) -> np.ndarray:
    """Random values of a dtype: floats in [-3, 3], ints in a small range, bools; 0 or 1 in a low-bit dtype."""
    np_dtype = dtypes.to_numpy(dtype)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in dtypes.FLOAT_DTYPES:
        return rng.uniform(-3.0, 3.0, size=shape).astype(np_dtype)
    if dtype not in dtypes.INT_DTYPES:  # float8, int4, ...: values every such dtype holds
        return rng.integers(0, 2, size=shape).astype(np_dtype)
    lo = 0 if dtype.startswith("u") else -20
    x = rng.integers(lo, 21, size=shape).astype(np_dtype)
    if nonzero:
        x[x == 0] = 1
    return x


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def _f32(*v: float) -> np.ndarray:
    return np.array(v, np.float32)


def _x(*shape: int) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


def _assert_same(actual: Any, expected: Any, *, ulps: int = 0) -> None:
    """Equal dtype, shape and values (NaNs equal); float values within ``ulps`` units."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if ulps and (actual.dtype.kind == "f" or actual.dtype == ml_dtypes.bfloat16):
        eps = float(ml_dtypes.finfo(actual.dtype).eps)
        np.testing.assert_allclose(
            actual.astype(np.float64), expected.astype(np.float64), rtol=ulps * eps, atol=ulps * eps, equal_nan=True
        )
    else:
        np.testing.assert_array_equal(actual, expected)


# ---------------------------------------------------------------------------
# SHAPE_ONLY_OUTPUT: two inputs of one shape and different values give one output.

SHAPE_ONLY = _ops_with(Trait.SHAPE_ONLY_OUTPUT)


def test_shape_only_ops_are_the_shape_queries() -> None:
    assert {o.name for o in SHAPE_ONLY} >= {"Shape", "Size"}


@pytest.mark.parametrize("opdef", SHAPE_ONLY, ids=_op_id)
@pytest.mark.parametrize("seed", range(8))
def test_shape_only_output_ignores_values(opdef: OpDef, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtype = str(rng.choice(dtypes.DTYPE_NAMES))
    rank = 2 if opdef.name == "EyeLike" else rng.integers(0, 5)  # EyeLike takes 2-D inputs only
    shape = tuple(int(d) for d in rng.integers(0, 5, size=rank))
    a, b = _random(rng, shape, dtype), _random(rng, shape, dtype)
    attrs: dict[str, Any] = {}
    if "start" in opdef.attrs:  # Shape's slice of the dims
        attrs = {"start": int(rng.integers(-3, 3)), "end": int(rng.integers(-3, 4))}
    _assert_same(_run(opdef, a, **attrs), _run(opdef, b, **attrs))
    # ... while a different shape (one more element along the last axis) changes it.
    if len(shape) and 0 not in shape[:-1] and opdef.name in ("Shape", "Size"):
        bigger = _random(rng, (*shape[:-1], shape[-1] + 1), dtype)
        assert not np.array_equal(_run(opdef, bigger), _run(opdef, a))


# ---------------------------------------------------------------------------
# ELEMENTWISE: output[i] depends on input[i] only, after numpy broadcasting.

ELEMENTWISE = _ops_with(Trait.ELEMENTWISE)

# Attributes an op needs to run (required ones, or ones that pick a well-defined case).
_EW_ATTRS: dict[str, dict[str, Any]] = {
    "Cast": {"to": 11},  # to float64
    "BitCast": {"to": 6},  # float32 bytes read as int32
    "BitShift": {"direction": "LEFT"},
    "LabelEncoder": {"keys_int64s": [-3, 0, 5, 7], "values_int64s": [1, 2, 3, 4]},
}
# Ops whose inputs are not all broadcast against each other.
_NOT_BROADCASTING = {
    "SwiGLU": "ONNX SwiGLU takes two inputs of one shape, no broadcasting",
    "CastLike": "the second input gives only a dtype; the output has the first input's shape",
    "PRelu": "slope broadcasts one way, to X (checked separately)",
}


def _is_unary(opdef: OpDef) -> bool:
    return opdef.inputs[0] <= 1


def _ew_inputs(opdef: OpDef, shapes: Sequence[Sequence[int]], rng: np.random.Generator) -> list[np.ndarray]:
    """Inputs of the op's dtype (from ONNX's schema), legal values for its kernel."""
    name = opdef.name
    if name == "Where":
        cond = _random(rng, shapes[0], "bool")
        return [cond, _random(rng, shapes[1], "float32"), _random(rng, shapes[2], "float32")]
    if name == "CastLike":
        return [_random(rng, shapes[0], "float32"), _random(rng, shapes[1], "float64")]
    dtype = "int64" if name == "LabelEncoder" else _pick_dtype(opdef)
    arrays = [_random(rng, s, dtype, nonzero=i > 0 and name in ("Div", "Mod")) for i, s in enumerate(shapes)]
    if name == "BitShift":
        arrays[1] = rng.integers(0, 8, size=shapes[1]).astype(arrays[0].dtype)
    if name == "Pow" and dtype not in dtypes.FLOAT_DTYPES:
        arrays[1] = rng.integers(0, 4, size=shapes[1]).astype(arrays[0].dtype)
    return arrays


UNARY_EW = [o for o in ELEMENTWISE if _is_unary(o)]
NARY_EW = [o for o in ELEMENTWISE if o.inputs[1] == -1 or o.inputs[0] >= 2]


def test_elementwise_families_are_classified() -> None:
    names = {o.name for o in ELEMENTWISE}
    assert {"Add", "Relu", "Where", "Max", "Cast"} <= names
    assert {o.name for o in UNARY_EW} | {o.name for o in NARY_EW} == names
    # Clip's bounds and Dropout's ratio are scalars: they are unary ops with options.
    assert {"Clip", "Dropout"} <= {o.name for o in UNARY_EW} - {o.name for o in NARY_EW}


@pytest.mark.parametrize("opdef", UNARY_EW, ids=_op_id)
def test_unary_elementwise_applies_per_element(opdef: OpDef) -> None:
    rng = np.random.default_rng(0)
    shape = (3, 4, 5)
    (x,) = _ew_inputs(opdef, [shape], rng)
    attrs = _EW_ATTRS.get(opdef.name, {})
    whole = _outputs(_run(opdef, x, **attrs))
    for out in whole:
        assert out.shape == shape, f"{opdef.name}: output shape {out.shape} != input shape {shape}"
    for flat in rng.choice(x.size, size=6, replace=False):
        idx = np.unravel_index(flat, shape)
        one = tuple(slice(i, i + 1) for i in idx)
        alone = _outputs(_run(opdef, x[one], **attrs))
        for out_whole, out_alone in zip(whole, alone):
            # A lone element may take a ufunc's scalar loop rather than its SIMD loop.
            _assert_same(out_alone, out_whole[one], ulps=4)


@pytest.mark.parametrize("opdef", ELEMENTWISE, ids=_op_id)
def test_elementwise_output_ignores_other_elements(opdef: OpDef) -> None:
    """Changing every element but one leaves that element's output exactly as it was."""
    rng = np.random.default_rng(1)
    n_inputs = 2 if opdef.inputs[1] == -1 else max(opdef.inputs[0], 1)
    shape = (4, 6)
    attrs = _EW_ATTRS.get(opdef.name, {})
    inputs = _ew_inputs(opdef, [shape] * n_inputs, rng)
    others = _ew_inputs(opdef, [shape] * n_inputs, rng)
    before = _outputs(_run(opdef, *inputs, **attrs))
    for flat in (0, 7, 23):
        idx = np.unravel_index(flat, shape)
        changed = [o.copy() for o in others]
        for c, x in zip(changed, inputs):
            c[idx] = x[idx]
        after = _outputs(_run(opdef, *changed, **attrs))
        for b, a in zip(before, after):
            _assert_same(a[idx], b[idx])


# Mutually broadcastable shapes, including 0-d, size-1 and empty dims.
_BROADCAST_CASES = [
    [(3, 4), (3, 4)],
    [(3, 1), (1, 4)],
    [(), (2, 3)],
    [(2, 1, 4), (3, 1)],
    [(5,), (2, 3, 5)],
    [(1, 1), (4,)],
    [(2, 0, 3), (1, 3)],
]


@pytest.mark.parametrize("opdef", [o for o in NARY_EW if o.name not in _NOT_BROADCASTING], ids=_op_id)
@pytest.mark.parametrize("case", range(len(_BROADCAST_CASES)))
def test_nary_elementwise_broadcasts_like_numpy(opdef: OpDef, case: int) -> None:
    rng = np.random.default_rng(case)
    shapes = list(_BROADCAST_CASES[case])
    if opdef.inputs[0] == 3:  # Where: the condition broadcasts too
        shapes = [shapes[1][-1:], *shapes]
    inputs = _ew_inputs(opdef, shapes, rng)
    attrs = _EW_ATTRS.get(opdef.name, {})
    expected_shape = np.broadcast_shapes(*shapes)
    got = _outputs(_run(opdef, *inputs, **attrs))
    assert got[0].shape == expected_shape
    # The same as running on inputs materialized at the broadcast shape.
    full = [np.broadcast_to(x, expected_shape).copy() for x in inputs]
    _assert_same(got[0], _outputs(_run(opdef, *full, **attrs))[0])


@pytest.mark.parametrize("slope_shape", [(), (1,), (4,), (3, 1), (3, 4)])
def test_prelu_broadcasts_slope_to_x(slope_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = _random(rng, (2, 3, 4), "float32")
    slope = rng.uniform(0.1, 0.5, size=slope_shape).astype(np.float32)
    y = _run("PRelu", x, slope)
    assert y.shape == x.shape
    full = np.broadcast_to(slope, x.shape).copy()
    _assert_same(y, _run("PRelu", x, full))


def test_cast_like_output_has_the_first_inputs_shape() -> None:
    rng = np.random.default_rng(0)
    x = _random(rng, (2, 3), "float32")
    for like_shape in [(), (5,), (2, 3), (4, 2, 3)]:
        y = _run("CastLike", x, np.zeros(like_shape, np.float16))
        assert y.shape == x.shape and y.dtype == np.float16


# ---------------------------------------------------------------------------
# REDUCTION: the output has no more dims than the input; keepdims keeps them all.

REDUCTIONS = _ops_with(Trait.REDUCTION)


def test_no_op_is_both_elementwise_and_reduction() -> None:
    both = [o.name for o in all_ops() if o.has(Trait.ELEMENTWISE) and o.has(Trait.REDUCTION)]
    assert both == []


@pytest.mark.parametrize("opdef", REDUCTIONS, ids=_op_id)
def test_reduction_reduces(opdef: OpDef) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, size=(2, 3, 4, 5)).astype(np.float32)  # positive: ReduceLogSum is defined
    y = _run(opdef, x)
    assert y.ndim <= x.ndim
    assert y.size < x.size, f"{opdef.name} reduced nothing: {x.shape} -> {y.shape}"
    if "keepdims" in opdef.attrs:
        kept = _run(opdef, x, keepdims=1)
        dropped = _run(opdef, x, keepdims=0)
        assert kept.ndim == x.ndim
        assert dropped.ndim < x.ndim
        assert kept.size == dropped.size
    else:  # the global pools keep every axis, reduced to size 1
        assert y.ndim == x.ndim


_REDUCE_AXES = [o for o in REDUCTIONS if "axes" in o.attrs]


@pytest.mark.parametrize("opdef", _REDUCE_AXES, ids=_op_id)
@pytest.mark.parametrize("axes", [[0], [1, 3], [-1], [0, 1, 2, 3]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduction_over_axes_has_numpys_shape(opdef: OpDef, axes: list[int], keepdims: int) -> None:
    x = np.random.default_rng(0).uniform(0.5, 2.0, size=(2, 3, 4, 5)).astype(np.float32)
    expected = np.sum(x, axis=tuple(axes), keepdims=bool(keepdims)).shape
    as_input = _run(opdef, x, np.array(axes, np.int64), keepdims=keepdims)
    as_attr = _run(opdef, x, axes=axes, keepdims=keepdims, opset=11)
    assert as_input.shape == expected
    assert as_attr.shape == expected


# ---------------------------------------------------------------------------
# DYNAMIC_OUTPUT_SIZE: two inputs of one shape whose outputs differ in shape.


def _nms_inputs(second_box: list[float]) -> tuple[np.ndarray, ...]:
    boxes = np.array([[[0, 0, 1, 1], second_box, [5, 5, 6, 6]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    return boxes, scores, np.array([3], np.int64), np.array([0.5], np.float32)


# name -> (inputs A, inputs B, attributes, n_outputs): same shapes, different values.
_DYNAMIC_CASES: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any], int]] = {
    "NonZero": ((np.array([1, 0, 0, 2], np.int32),), (np.array([1, 3, 5, 2], np.int32),), {}, 1),
    "Unique": ((np.array([1, 1, 2, 2], np.int64),), (np.array([1, 2, 3, 4], np.int64),), {}, 4),
    "Compress": (
        (np.arange(4, dtype=np.float32), np.array([True, False, False, False])),
        (np.arange(4, dtype=np.float32), np.array([True, True, True, False])),
        {"axis": 0},
        1,
    ),
    "NonMaxSuppression": (_nms_inputs([0, 0.05, 1, 1.05]), _nms_inputs([2, 2, 3, 3]), {}, 1),
    # Sequence (list) outputs: the position or split values decide element order and count.
    "SequenceInsert": (([np.zeros(2)], np.zeros(3), _i64(0)), ([np.zeros(2)], np.zeros(3), _i64(1)), {}, 1),
    "SequenceErase": (([np.zeros(2), np.zeros(3)], _i64(0)), ([np.zeros(2), np.zeros(3)], _i64(1)), {}, 1),
    "SplitToSequence": ((np.zeros(6), _i64(2)[0]), (np.zeros(6), _i64(3)[0]), {}, 1),
}


# Sequence ops are DYNAMIC_OUTPUT_SIZE by the sequence module's convention (a list is
# no buffer a backend can size), not because an input's values change an output's shape.
_DYNAMIC_BY_CONVENTION = {
    "SequenceEmpty": "no inputs: it always gives an empty sequence",
    "SequenceConstruct": "its output is fixed by its inputs' count and shapes",
    "ConcatFromSequence": "its input is a sequence, whose length is not a tensor shape",
}


@pytest.mark.parametrize("opdef", _ops_with(Trait.DYNAMIC_OUTPUT_SIZE), ids=_op_id)
def test_dynamic_output_size_is_real(opdef: OpDef) -> None:
    if opdef.name in _DYNAMIC_BY_CONVENTION:
        pytest.skip(f"{opdef.name} is a sequence op; {_DYNAMIC_BY_CONVENTION[opdef.name]}")
    if opdef.name not in _DYNAMIC_CASES:
        pytest.skip(f"no constructed input pair for {opdef.name} yet")
    a, b, attrs, n_outputs = _DYNAMIC_CASES[opdef.name]
    assert _input_shapes(a) == _input_shapes(b)
    assert _shapes(_run(opdef, *a, n_outputs=n_outputs, **attrs)) != _shapes(
        _run(opdef, *b, n_outputs=n_outputs, **attrs)
    )


# ---------------------------------------------------------------------------
# VALUE_DEPENDENT_SHAPE: a value-bearing input changed at a fixed shape changes the
# output shape. Each case: (inputs A, inputs B, attributes, n_outputs, opset or None).


_ValueCase = tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any], int, int | None]


def _reduce_case() -> _ValueCase:
    return (_x(2, 3, 4), _i64(0)), (_x(2, 3, 4), _i64(2)), {"keepdims": 0}, 1, None


def _window_case() -> _ValueCase:
    return (_i64(4),), (_i64(6),), {}, 1, None


def _mel_inputs(bins: int) -> tuple[Any, ...]:
    return _i64(bins), _i64(16), _i64(8000), _f32(0.0), _f32(4000.0)


_VALUE_CASES: dict[str, _ValueCase] = {
    "Reshape": ((_x(2, 6), _i64(3, 4)), (_x(2, 6), _i64(4, 3)), {}, 1, None),
    "Expand": ((_x(3, 1), _i64(3, 4)), (_x(3, 1), _i64(3, 5)), {}, 1, None),
    "Range": ((_f32(0)[0], _f32(5)[0], _f32(1)[0]), (_f32(0)[0], _f32(7)[0], _f32(1)[0]), {}, 1, None),
    "ConstantOfShape": ((_i64(2, 3),), (_i64(3, 2),), {}, 1, None),
    "Tile": ((_x(2, 3), _i64(1, 2)), (_x(2, 3), _i64(2, 1)), {}, 1, None),
    "Slice": ((_x(5, 6), _i64(0), _i64(2), _i64(0)), (_x(5, 6), _i64(0), _i64(4), _i64(1)), {}, 1, None),
    "OneHot": ((_i64(0, 2), _i64(3), _f32(0, 1)), (_i64(0, 2), _i64(5), _f32(0, 1)), {}, 1, None),
    "TopK": ((_x(2, 6), _i64(2)), (_x(2, 6), _i64(4)), {}, 2, None),
    "Squeeze": ((_x(1, 3, 1), _i64(0)), (_x(1, 3, 1), _i64(2)), {}, 1, None),
    "Unsqueeze": ((_x(3, 4), _i64(0)), (_x(3, 4), _i64(2)), {}, 1, None),
    "Split": ((_x(6), _i64(2, 4)), (_x(6), _i64(3, 3)), {}, 2, None),
    "SplitToSequence": ((_x(6), _i64(2, 4)), (_x(6), _i64(3, 3)), {}, 1, None),
    "SequenceAt": (([_x(2), _x(3)], _i64(0)[0]), ([_x(2), _x(3)], _i64(1)[0]), {}, 1, None),
    "Pad": ((_x(2, 3), _i64(0, 1, 0, 1)), (_x(2, 3), _i64(1, 0, 1, 0)), {}, 1, None),
    "CenterCropPad": ((_x(4, 4), _i64(2, 6)), (_x(4, 4), _i64(6, 2)), {}, 1, None),
    "Resize": (
        (_x(1, 1, 2, 2), None, _f32(1, 1, 2, 2)),
        (_x(1, 1, 2, 2), None, _f32(1, 1, 3, 3)),
        {},
        1,
        None,
    ),
    "Upsample": ((_x(1, 1, 2, 2), _f32(1, 1, 2, 2)), (_x(1, 1, 2, 2), _f32(1, 1, 2, 3)), {}, 1, 9),
    "DFT": ((_x(1, 8, 1), _i64(8), _i64(1)), (_x(1, 8, 1), _i64(4), _i64(1)), {}, 1, 20),
    "STFT": ((_x(1, 16, 1), _i64(4), None, _i64(8)), (_x(1, 16, 1), _i64(2), None, _i64(8)), {}, 1, None),
    "MelWeightMatrix": (_mel_inputs(4), _mel_inputs(6), {}, 1, None),
    "AffineGrid": (
        (np.eye(2, 3, dtype=np.float32)[None], _i64(1, 1, 4, 5)),
        (np.eye(2, 3, dtype=np.float32)[None], _i64(1, 1, 5, 4)),
        {},
        1,
        None,
    ),
    **{f"{w}Window": _window_case() for w in ("Hann", "Hamming", "Blackman")},
    **{o.name: _reduce_case() for o in all_ops() if o.name.startswith("Reduce") and not o.domain},
    # Ops that once did not declare it: Col2Im's image_shape, MaxUnpool's output_shape.
    "Col2Im": (
        (_x(1, 4, 3), _i64(2, 4), _i64(2, 2)),
        (_x(1, 4, 3), _i64(4, 2), _i64(2, 2)),
        {},
        1,
        None,
    ),
    "MaxUnpool": (
        (_x(1, 1, 2, 2), np.array([[[[5, 7], [13, 15]]]], np.int64), _i64(1, 1, 4, 4)),
        (_x(1, 1, 2, 2), np.array([[[[5, 7], [13, 15]]]], np.int64), _i64(1, 1, 5, 5)),
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        1,
        None,
    ),
}


def _run_case(name: str, inputs: tuple[Any, ...], attrs: dict[str, Any], n_outputs: int, opset: int | None) -> Any:
    return _run(name, *inputs, n_outputs=n_outputs, opset=opset, **attrs)


def _input_shapes(inputs: tuple[Any, ...]) -> list[Any]:
    return [None if x is None else _shape_of(x) for x in inputs]


@pytest.mark.parametrize("opdef", _ops_with(Trait.VALUE_DEPENDENT_SHAPE), ids=_op_id)
def test_value_dependent_shape_is_real(opdef: OpDef) -> None:
    if opdef.name not in _VALUE_CASES:
        pytest.skip(f"no constructed input pair for {opdef.name} yet")
    a, b, attrs, n_outputs, opset = _VALUE_CASES[opdef.name]
    assert _input_shapes(a) == _input_shapes(b)
    assert _shapes(_run_case(opdef.name, a, attrs, n_outputs, opset)) != _shapes(
        _run_case(opdef.name, b, attrs, n_outputs, opset)
    )


@pytest.mark.parametrize("name", sorted(_VALUE_CASES))
def test_value_dependent_shape_is_declared(name: str) -> None:
    """Every op whose constructed case shows a value-dependent shape carries a trait saying so."""
    a, b, attrs, n_outputs, opset = _VALUE_CASES[name]
    assert _shapes(_run_case(name, a, attrs, n_outputs, opset)) != _shapes(_run_case(name, b, attrs, n_outputs, opset))
    declared = Trait.VALUE_DEPENDENT_SHAPE | Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW
    assert lookup(name).traits & declared, f"{name}: output shape depends on input values, trait not declared"


# ---------------------------------------------------------------------------
# CONTROL_FLOW: exactly the ops with subgraph attributes.

_GRAPH_TYPES = (onnx_defs.OpSchema.AttrType.GRAPH, onnx_defs.OpSchema.AttrType.GRAPHS)


def _graph_attrs(schema: Any) -> set[str]:
    return {name for name, a in schema.attributes.items() if a.type in _GRAPH_TYPES}


_WITH_SCHEMA = [o for o in all_ops() if _schema(o) is not None]


@pytest.mark.parametrize("opdef", _WITH_SCHEMA, ids=_op_id)
def test_control_flow_iff_subgraph_attribute(opdef: OpDef) -> None:
    graph_attrs = _graph_attrs(_schema(opdef))
    assert opdef.has(Trait.CONTROL_FLOW) == bool(graph_attrs), f"{opdef.name}: graph attributes {graph_attrs}"
    # The kernel takes every subgraph attribute by name.
    assert graph_attrs <= set(opdef.attrs)


def test_every_onnx_op_with_a_subgraph_is_control_flow() -> None:
    """Every ONNX op with a GRAPH attribute that DSP implements (If, Loop, Scan, SequenceMap...)."""
    with_graphs = {(s.domain, s.name) for s in onnx_defs.get_all_schemas() if _graph_attrs(s)}
    assert ("", "If") in with_graphs and ("", "Loop") in with_graphs
    implemented = {(o.domain, o.name): o for o in all_ops()}
    missing = sorted(n for key, n in ((k, k[1]) for k in with_graphs) if key in implemented
                     and not implemented[key].has(Trait.CONTROL_FLOW))  # fmt: skip
    assert missing == []
    for name in ("If", "Loop", "Scan"):
        assert lookup(name).has(Trait.CONTROL_FLOW)


def test_control_flow_ops_all_have_an_onnx_schema() -> None:
    """A CONTROL_FLOW op unknown to ONNX could not be checked above; there is none."""
    assert [o.name for o in _ops_with(Trait.CONTROL_FLOW) if _schema(o) is None] == []


# ---------------------------------------------------------------------------
# RANDOM: exactly the generators; Dropout is deterministic in inference.

_RANDOM_PREFIXES = ("Random", "Bernoulli", "Multinomial")


@pytest.mark.parametrize("opdef", all_ops(), ids=_op_id)
def test_random_iff_generator(opdef: OpDef) -> None:
    assert opdef.has(Trait.RANDOM) == opdef.name.startswith(_RANDOM_PREFIXES)


def test_every_op_named_random_is_random() -> None:
    named = [o for o in all_ops() if "Random" in o.name]
    assert named and all(o.has(Trait.RANDOM) for o in named)
    assert not lookup("Dropout").has(Trait.RANDOM)


_RANDOM_CALLS: dict[str, Callable[[float], Any]] = {
    "RandomUniform": lambda seed: _run("RandomUniform", shape=[64], seed=seed),
    "RandomNormal": lambda seed: _run("RandomNormal", shape=[64], seed=seed),
    "RandomUniformLike": lambda seed: _run("RandomUniformLike", _x(64), seed=seed),
    "RandomNormalLike": lambda seed: _run("RandomNormalLike", _x(64), seed=seed),
    "Bernoulli": lambda seed: _run("Bernoulli", np.full(64, 0.5, np.float32), seed=seed),
    "Multinomial": lambda seed: _run("Multinomial", np.zeros((1, 8), np.float32), sample_size=64, seed=seed),
}


@pytest.mark.parametrize("opdef", _ops_with(Trait.RANDOM), ids=_op_id)
def test_random_output_follows_the_seed(opdef: OpDef) -> None:
    if opdef.name not in _RANDOM_CALLS:
        pytest.skip(f"no call constructed for {opdef.name} yet")
    call = _RANDOM_CALLS[opdef.name]
    np.testing.assert_array_equal(call(1.0), call(1.0))
    assert not np.array_equal(call(1.0), call(2.0))


def test_dropout_in_inference_is_deterministic_identity() -> None:
    x = _x(4, 5)
    for _ in range(3):
        y, mask = _run("Dropout", x, _f32(0.5)[0], n_outputs=2)
        np.testing.assert_array_equal(y, x)
        assert mask.dtype == np.bool_ and mask.all()
