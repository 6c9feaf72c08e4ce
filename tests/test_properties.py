"""Property tests: broadcasting and dtypes of the elementwise family against numpy.

For random mutually broadcastable shapes and every dtype ONNX allows an op (the same on
both sides, as ONNX requires), DSP's output has numpy's broadcast shape, the input's
dtype (bool for comparisons and logic) and numpy's values; integer Div truncates toward
zero and Mod follows the sign rules of its ``fmod`` attribute, as ONNX specifies. Each
property runs the reference kernel directly; a subset also runs through
``dsp.compile(graph).run`` so the plan path (and its per-dtype kernel specialization)
is covered.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dsp_core as dsp
from dsp_core.ir import dtypes
from dsp_core.ops.registry import KernelContext, TensorInfo, lookup

onnx_defs = pytest.importorskip("onnx.defs")

OPSET = 24
# database=None: no .hypothesis folder in the working tree; deadline=None: the first call
# of a kernel may import or warm caches.
PROPERTY = settings(max_examples=40, deadline=None, database=None)
PLAN_PROPERTY = settings(max_examples=15, deadline=None, database=None)

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
ALL = ["bool", *INTS, *FLOATS]
_ONNX_TYPE = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    **{d: f"tensor({d})" for d in ["bool", "float16", "bfloat16", *INTS]},
}


def _np_dtype(name: str) -> np.dtype[Any]:
    return BF16 if name == "bfloat16" else np.dtype(name)


def _onnx_dtypes(op: str, input_index: int = 0) -> list[str]:
    """The dtypes (among DSP's) ONNX's latest schema allows for one input of ``op``."""
    schema = onnx_defs.get_schema(op)
    type_str = schema.inputs[input_index].type_str
    allowed = next(set(c.allowed_type_strs) for c in schema.type_constraints if c.type_param_str == type_str)
    return [d for d in ALL if _ONNX_TYPE[d] in allowed]


def _run(op: str, *inputs: Any, **attrs: Any) -> Any:
    """The reference kernel of ``op`` called directly, as the executor calls it."""
    opdef = lookup(op)
    ctx = KernelContext(np, max(OPSET, opdef.since), len(inputs), 1)
    with np.errstate(all="ignore"):
        out = opdef.kernel(ctx, *inputs, **attrs)
    return out[0] if isinstance(out, tuple) else out


def _run_plan(op: str, *inputs: np.ndarray, **attrs: Any) -> np.ndarray:
    """``op`` as a one-node graph built with GraphBuilder, compiled and run as a plan."""
    g = dsp.GraphBuilder(f"prop_{op}", opset=OPSET)
    names = [f"x{i}" for i in range(len(inputs))]
    tensors = [g.placeholder(n, x.dtype, list(x.shape)) for n, x in zip(names, inputs)]
    g.output(g.op(op, *tensors, **attrs), "y")
    model = dsp.compile(g.build())
    assert model.declined is None, model.declined
    with np.errstate(all="ignore"):
        return model.run(dict(zip(names, inputs)))["y"]


def _check_shape_rule(op: str, got: np.ndarray, *inputs: np.ndarray, **attrs: Any) -> None:
    """The op's shape rule, given only the inputs' dtypes and shapes, predicts ``got``."""
    rule = lookup(op).shape_rule
    assert rule is not None, f"{op} has no shape rule"
    infos = [TensorInfo(dtypes.normalize(x.dtype), tuple(x.shape)) for x in inputs]
    predicted = rule(attrs, *infos)[0]
    assert predicted == TensorInfo(dtypes.normalize(got.dtype), tuple(got.shape))


def _assert_equal(got: np.ndarray, expected: np.ndarray) -> None:
    """Same shape, dtype and values; NaNs equal, -0.0 equal to 0.0."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype, f"dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    if got.dtype == BF16:  # compared exactly in float32, which holds every bfloat16
        got, expected = got.astype(np.float32), expected.astype(np.float32)
    np.testing.assert_array_equal(got, expected)


def _assert_close(got: np.ndarray, expected: np.ndarray, *, ulps: float, atol: float = 0.0) -> None:
    """Same shape and dtype; values within ``ulps`` units of the dtype (NaNs and infinities equal)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype, f"dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    np.testing.assert_allclose(
        got.astype(np.float64), expected.astype(np.float64), rtol=ulps * eps, atol=atol, equal_nan=True
    )


# ---------------------------------------------------------------------------
# Strategies


def _elements(dtype: str, lo: float | None = None, hi: float | None = None) -> st.SearchStrategy[Any]:
    """Scalars of ``dtype``: the whole range (NaN and infinities too) unless bounded."""
    if dtype == "bfloat16":
        if lo is None:
            return st.floats(width=32).map(lambda v: float(np.float32(v).astype(BF16)))
        return st.floats(lo, hi, width=32).map(lambda v: float(np.float32(v).astype(BF16)))
    if lo is None:
        return hnp.from_dtype(np.dtype(dtype))
    if dtype in FLOATS:
        return st.floats(lo, hi, width=np.dtype(dtype).itemsize * 8)
    info = np.iinfo(dtype)
    return st.integers(max(int(lo), int(info.min)), min(int(hi), int(info.max)))


def _array(draw: Any, dtype: str, shape: tuple[int, ...], lo: float | None = None, hi: float | None = None) -> Any:
    # bfloat16 is drawn as float32 values exactly representable in it, then cast.
    store = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    return draw(hnp.arrays(store, shape, elements=_elements(dtype, lo, hi))).astype(_np_dtype(dtype))


def _shapes(draw: Any, n: int, *, min_side: int = 1) -> tuple[tuple[int, ...], ...]:
    return draw(hnp.mutually_broadcastable_shapes(num_shapes=n, min_dims=0, max_dims=4, min_side=min_side, max_side=4))[
        0
    ]


# ---------------------------------------------------------------------------
# Numpy references


def _int_objects(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both operands broadcast and held as Python ints (no overflow in the reference)."""
    a_, b_ = np.broadcast_arrays(a, b)
    return a_.astype(object), b_.astype(object)


def _trunc_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX integer Div: the quotient truncated toward zero."""
    x, y = _int_objects(a, b)
    q = [abs(u) // abs(v) * (1 if (u < 0) == (v < 0) else -1) for u, v in zip(x.ravel(), y.ravel())]
    return np.array(q, dtype=object).reshape(x.shape).astype(a.dtype)


def _int_mod(a: np.ndarray, b: np.ndarray, fmod: int) -> np.ndarray:
    """ONNX integer Mod: sign of the divisor (fmod=0) or of the dividend (fmod=1)."""
    x, y = _int_objects(a, b)
    if fmod:
        r = [abs(u) % abs(v) * (-1 if u < 0 else 1) for u, v in zip(x.ravel(), y.ravel())]
    else:
        r = [u % v for u, v in zip(x.ravel(), y.ravel())]
    return np.array(r, dtype=object).reshape(x.shape).astype(a.dtype)


def _div_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _trunc_div(a, b) if a.dtype.kind in "iu" else np.divide(a, b)


# name: (numpy reference, bool output)
BINARY: dict[str, tuple[Callable[..., Any], bool]] = {
    "Add": (np.add, False),
    "Sub": (np.subtract, False),
    "Mul": (np.multiply, False),
    "Div": (_div_ref, False),
    "Pow": (np.power, False),
    "Max": (np.maximum, False),
    "Min": (np.minimum, False),
    "Equal": (np.equal, True),
    "Greater": (np.greater, True),
    "GreaterOrEqual": (np.greater_equal, True),
    "Less": (np.less, True),
    "LessOrEqual": (np.less_equal, True),
    "And": (np.logical_and, True),
    "Or": (np.logical_or, True),
    "Xor": (np.logical_xor, True),
    "BitwiseAnd": (np.bitwise_and, False),
    "BitwiseOr": (np.bitwise_or, False),
    "BitwiseXor": (np.bitwise_xor, False),
}
# The ops also run through dsp.compile(...).run.
PLAN_SUBSET = ["Add", "Sub", "Div", "Pow", "Max", "Equal", "Less", "Xor", "BitwiseAnd"]


@st.composite
def binary_case(draw: Any, op: str, min_side: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Two operands of one ONNX-allowed dtype, of mutually broadcastable shapes, legal for ``op``."""
    dtype = draw(st.sampled_from(_onnx_dtypes(op)))
    sa, sb = _shapes(draw, 2, min_side=min_side)
    if op == "Pow" and dtype in INTS:  # small bases, exponents >= 0: no overflow, no int ** -n
        return _array(draw, dtype, sa, -6, 6), _array(draw, dtype, sb, 0, 6)
    a, b = _array(draw, dtype, sa), _array(draw, dtype, sb)
    if op in ("Div", "Mod") and dtype in INTS:
        b = np.where(b == 0, np.ones_like(b), b)  # integer division by zero is undefined
        if dtype.startswith("int"):  # so is MIN / -1, which overflows
            a = np.where((a == np.iinfo(dtype).min) & (b == -1), np.zeros_like(a), a)
    return a, b


def _expected(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ref, boolean = BINARY[op]
    with np.errstate(all="ignore"):
        y = np.asarray(ref(a, b))
    return y.astype(bool) if boolean else y.astype(a.dtype)


def _check_binary(op: str, got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    ref, boolean = BINARY[op]
    assert got.shape == np.broadcast_shapes(a.shape, b.shape)
    assert got.dtype == (np.dtype(bool) if boolean else a.dtype)
    _assert_equal(got, _expected(op, a, b))


@pytest.mark.parametrize("op", sorted(BINARY))
@PROPERTY
@given(data=st.data())
def test_binary_kernel_matches_numpy(op: str, data: st.DataObject) -> None:
    a, b = data.draw(binary_case(op))
    got = _run(op, a, b)
    _check_binary(op, got, a, b)
    _check_shape_rule(op, got, a, b)


@pytest.mark.parametrize("op", PLAN_SUBSET)
@PLAN_PROPERTY
@given(data=st.data())
def test_binary_plan_matches_numpy(op: str, data: st.DataObject) -> None:
    a, b = data.draw(binary_case(op, min_side=0))  # empty dims too
    _check_binary(op, _run_plan(op, a, b), a, b)


def test_integer_div_truncates_toward_zero() -> None:
    """ONNX's Div doc says so; numpy's floor_divide would give -4 and 3 here."""
    assert "truncating division" in onnx_defs.get_schema("Div").doc
    a = np.array([-7, 7, -7, 7], np.int32)
    b = np.array([2, 2, -2, -2], np.int32)
    np.testing.assert_array_equal(_run("Div", a, b), [-3, 3, 3, -3])


# ---------------------------------------------------------------------------
# Mod: numpy's remainder (fmod=0) or fmod (fmod=1), with ONNX's sign rules.


@pytest.mark.parametrize("fmod", [0, 1])
@PROPERTY
@given(data=st.data())
def test_mod_matches_numpy_and_sign_rules(fmod: int, data: st.DataObject) -> None:
    a, b = data.draw(binary_case("Mod"))
    got = _run("Mod", a, b, fmod=fmod)
    _check_shape_rule("Mod", got, a, b, fmod=fmod)
    assert got.shape == np.broadcast_shapes(a.shape, b.shape) and got.dtype == a.dtype
    if a.dtype.kind in "iu":
        expected = _int_mod(a, b, fmod)
    else:
        with np.errstate(all="ignore"):
            expected = (np.fmod if fmod else np.remainder)(a, b).astype(a.dtype)
    _assert_equal(got, expected)
    # The sign follows the dividend (fmod=1) or the divisor (fmod=0) wherever it is defined.
    x, y = np.broadcast_arrays(a.astype(np.float64), b.astype(np.float64))
    r = got.astype(np.float64)
    defined = np.isfinite(r) & (r != 0) & np.isfinite(x)
    follows = x if fmod else y
    assert (np.sign(r[defined]) == np.sign(follows[defined])).all()
    finite_y = defined & np.isfinite(y)
    assert (np.abs(r[finite_y]) <= np.abs(y[finite_y])).all()


@pytest.mark.parametrize("fmod", [0, 1])
@PLAN_PROPERTY
@given(data=st.data())
def test_mod_plan_matches_kernel(fmod: int, data: st.DataObject) -> None:
    a, b = data.draw(binary_case("Mod"))
    _assert_equal(_run_plan("Mod", a, b, fmod=fmod), _run("Mod", a, b, fmod=fmod))


# ---------------------------------------------------------------------------
# BitShift: numpy's shifts for in-range shift amounts.


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@PROPERTY
@given(data=st.data())
def test_bitshift_matches_numpy(direction: str, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(_onnx_dtypes("BitShift")))
    sa, sb = _shapes(data.draw, 2)
    x = _array(data.draw, dtype, sa)
    y = _array(data.draw, dtype, sb, 0, np.dtype(dtype).itemsize * 8 - 1)
    got = _run("BitShift", x, y, direction=direction)
    expected = (np.left_shift if direction == "LEFT" else np.right_shift)(x, y)
    _assert_equal(got, expected.astype(x.dtype))


# ---------------------------------------------------------------------------
# Pow with a base and an exponent of different dtypes (ONNX's T and T1): base's dtype.


@PROPERTY
@given(data=st.data())
def test_pow_mixed_dtypes_keeps_the_base_dtype(data: st.DataObject) -> None:
    base_dtype = data.draw(st.sampled_from([d for d in _onnx_dtypes("Pow", 0) if d in FLOATS]))
    exp_dtype = data.draw(st.sampled_from(_onnx_dtypes("Pow", 1)))
    sa, sb = _shapes(data.draw, 2)
    a = _array(data.draw, base_dtype, sa, 0.0, 8.0)
    b = _array(data.draw, exp_dtype, sb, 0, 3)
    got = _run("Pow", a, b)
    with np.errstate(all="ignore"):
        expected = np.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)
    _assert_close(got, expected, ulps=1)


# ---------------------------------------------------------------------------
# Variadic Sum, Max, Min, Mean with 1-4 inputs.

VARIADIC = ["Sum", "Max", "Min", "Mean"]


@st.composite
def variadic_case(draw: Any, op: str) -> list[np.ndarray]:
    dtype = draw(st.sampled_from(_onnx_dtypes(op)))
    n = draw(st.integers(1, 4))
    bounded = op in ("Sum", "Mean")  # finite values, far from overflow
    lo, hi = (-100.0, 100.0) if bounded else (None, None)
    return [_array(draw, dtype, s, lo, hi) for s in _shapes(draw, n)]


def _check_variadic(op: str, got: np.ndarray, xs: list[np.ndarray]) -> None:
    shape = np.broadcast_shapes(*(x.shape for x in xs))
    dtype = xs[0].dtype
    if op in ("Max", "Min"):  # exact, NaN propagating
        with np.errstate(all="ignore"):
            expected = reduce(np.maximum if op == "Max" else np.minimum, xs)
        _assert_equal(got, np.broadcast_to(expected, shape).astype(dtype))
        return
    wide = reduce(np.add, [x.astype(np.float64) for x in xs])
    if op == "Mean":
        wide = wide / len(xs)
    # Half precision sums in float32 and rounds once; float32 and wider sum in their dtype.
    eps = float(ml_dtypes.finfo(dtype).eps)
    scale = max((float(np.abs(x.astype(np.float64)).max(initial=0.0)) for x in xs), default=0.0)
    _assert_close(got, np.broadcast_to(wide, shape).astype(dtype), ulps=1, atol=len(xs) * eps * scale)


@pytest.mark.parametrize("op", VARIADIC)
@PROPERTY
@given(data=st.data())
def test_variadic_kernel_broadcasts_like_numpy(op: str, data: st.DataObject) -> None:
    xs = data.draw(variadic_case(op))
    got = _run(op, *xs)
    _check_variadic(op, got, xs)
    _check_shape_rule(op, got, *xs)


@pytest.mark.parametrize("op", VARIADIC)
@PLAN_PROPERTY
@given(data=st.data())
def test_variadic_plan_broadcasts_like_numpy(op: str, data: st.DataObject) -> None:
    xs = data.draw(variadic_case(op))
    _check_variadic(op, _run_plan(op, *xs), xs)


# ---------------------------------------------------------------------------
# Unary ops keep the dtype and shape of a float input; values agree with float64.


def _unary_float_ops() -> list[tuple[str, str]]:
    """(op, output kind) for every default-domain unary ELEMENTWISE op taking floats."""
    from dsp_core.ops.registry import Trait, all_ops

    found = []
    for o in all_ops():
        if o.domain or not o.has(Trait.ELEMENTWISE) or o.inputs[0] != 1 or o.inputs[1] == -1:
            continue
        if "to" in o.attrs:  # Cast and BitCast choose their output dtype
            continue
        try:
            schema = onnx_defs.get_schema(o.name)
        except Exception:  # newer than the installed onnx
            continue
        if not set(_onnx_dtypes(o.name)) & set(FLOATS):
            continue
        same = schema.outputs[0].type_str == schema.inputs[0].type_str
        found.append((o.name, "same" if same else "bool"))
    return found


UNARY = _unary_float_ops()
PLAN_UNARY = ["Relu", "Exp", "Sigmoid", "Sqrt", "Neg", "Erf", "Gelu", "IsNaN"]


def test_unary_family_is_found() -> None:
    names = {n for n, _ in UNARY}
    assert {"Abs", "Exp", "Relu", "Sigmoid", "Gelu", "IsNaN", "IsInf", "Identity", "Dropout"} <= names
    assert set(PLAN_UNARY) <= names


@st.composite
def unary_case(draw: Any, op: str) -> np.ndarray:
    dtype = draw(st.sampled_from([d for d in _onnx_dtypes(op) if d in FLOATS]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    special = draw(st.booleans())  # half the time any value: NaN, infinities, huge, subnormal
    return _array(draw, dtype, shape) if special else _array(draw, dtype, shape, -10.0, 10.0)


def _check_unary(op: str, kind: str, got: np.ndarray, x: np.ndarray) -> None:
    assert got.shape == x.shape
    assert got.dtype == (x.dtype if kind == "same" else np.dtype(bool))
    if x.dtype == np.float64:
        return  # the float64 result is the reference below
    wide = _run(op, x.astype(np.float64))
    if kind == "bool":
        _assert_equal(got, wide)
        return
    # Half precision: one rounding of a float32 result; float32: numpy's float32 loops are
    # within a few units. Subnormal results have fewer digits: two of the smallest steps.
    ulps = 2 if x.dtype != np.float32 else 8
    tiny = float(ml_dtypes.finfo(x.dtype).smallest_subnormal)
    with np.errstate(over="ignore"):  # a float64 result beyond the dtype's range rounds to inf
        expected = wide.astype(x.dtype)
    if op in AFFINE:
        _assert_affine_close(got, expected, x, ulps=ulps)
        return
    _assert_close(got, expected, ulps=ulps, atol=2 * tiny)


# Ops that add a constant to alpha * x in the input's dtype (ONNX's HardSigmoid, and HardSwish
# through it): near the sum's zero the result is small while its rounding error is that of the
# operands (beta = 0.5, alpha * x), so it is bounded relative to them, not to the result
# (HardSigmoid(-2.4375) in float32 is 0.0125 - 1.2e-8: 0.25 ulp of 0.5, 1e-6 of 0.0125).
AFFINE = {"HardSigmoid", "HardSwish"}


def _assert_affine_close(got: np.ndarray, expected: np.ndarray, x: np.ndarray, *, ulps: float) -> None:
    """``got`` within ``ulps`` units of max(0.5, |x|) of ``expected`` (NaNs and infinities equal)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    g, e = got.astype(np.float64), expected.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = ulps * eps * np.maximum(0.5, np.abs(x.astype(np.float64)))
        ok = (g == e) | (np.isnan(g) & np.isnan(e)) | (np.abs(g - e) <= bound)
    assert ok.all(), f"{got[~ok]} against {expected[~ok]} for x = {x[~ok]}"


@pytest.mark.parametrize(("op", "kind"), UNARY, ids=[n for n, _ in UNARY])
@PROPERTY
@given(data=st.data())
def test_unary_kernel_keeps_dtype_and_shape(op: str, kind: str, data: st.DataObject) -> None:
    x = data.draw(unary_case(op))
    got = _run(op, x)
    _check_unary(op, kind, got, x)
    _check_shape_rule(op, got, x)


@pytest.mark.parametrize("op", PLAN_UNARY)
@PLAN_PROPERTY
@given(data=st.data())
def test_unary_plan_keeps_dtype_and_shape(op: str, data: st.DataObject) -> None:
    kind = dict(UNARY)[op]
    x = data.draw(unary_case(op))
    _check_unary(op, kind, _run_plan(op, x), x)
