"""Elementwise kernels on what the ONNX node suite leaves out: dtypes, shape rules, edge cases."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dsp_core.errors import DTypeError
from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, lookup

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

UNARY_FLOAT = [
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cos", "Cosh", "Sin", "Sinh", "Tan",
    "Tanh", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Floor", "Ceil", "Round", "Sign", "Erf",
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "HardSigmoid", "HardSwish",
    "Sigmoid", "Softplus", "Softsign", "Gelu", "Mish", "Swish", "Shrink",
]  # fmt: skip
FLOATS = [np.float16, np.float32, np.float64]


def _ctx(opset: int = 28, n_inputs: int = 1, n_outputs: int = 1) -> KernelContext:
    return KernelContext(np, opset, n_inputs, n_outputs)


def _run(name: str, *inputs: Any, opset: int = 28, n_outputs: int = 1, **attrs: Any) -> Any:
    kernel = lookup(name).kernel
    return kernel(_ctx(opset, len(inputs), n_outputs), *inputs, **attrs)


def _domain_input(name: str, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Random values inside the op's domain (Acosh needs x >= 1, Atanh |x| < 1, ...)."""
    x = rng.uniform(-3.0, 3.0, size=(4, 5))
    if name in ("Acos", "Asin", "Atanh"):
        x = np.clip(x / 3.5, -0.99, 0.99)
    elif name == "Acosh":
        x = 1.0 + np.abs(x)
    elif name in ("Log", "Sqrt", "Reciprocal"):
        x = 0.1 + np.abs(x)
    return x.astype(dtype)


def _onnx_reference(name: str, inputs: list[np.ndarray], attrs: dict[str, Any], opset: int = 24) -> np.ndarray:
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(name, names, ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in zip(names, inputs)
        ],
        [helper.make_tensor_value_info("y", 0, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, inputs)))[0]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", UNARY_FLOAT)
def test_unary_float_matches_onnx_reference(name: str, dtype: Any) -> None:
    x = _domain_input(name, dtype, np.random.default_rng(0))
    got = _run(name, x)
    expected = _onnx_reference(name, [x], {})
    assert got.dtype == x.dtype
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", UNARY_FLOAT)
def test_unary_bfloat16_keeps_dtype(name: str) -> None:
    x32 = _domain_input(name, np.float32, np.random.default_rng(1))
    x = x32.astype(ml_dtypes.bfloat16)
    got = _run(name, x)
    assert got.dtype == x.dtype
    want = _run(name, x.astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_erf_is_accurate_everywhere() -> None:
    x = np.concatenate([np.linspace(-7.0, 7.0, 20001), [2.9999999, 3.0, 3.0000001, 1e-300, -1e-8]])
    got = _run("Erf", x)
    want = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(got - want)) < 1e-13
    special = _run("Erf", np.array([np.inf, -np.inf, np.nan, 0.0]))
    np.testing.assert_array_equal(special[:2], [1.0, -1.0])
    assert np.isnan(special[2]) and special[3] == 0.0


def test_kernels_never_write_into_inputs() -> None:
    rng = np.random.default_rng(2)
    for name in UNARY_FLOAT:
        x = _domain_input(name, np.float32, rng)
        before = x.copy()
        _run(name, x)
        np.testing.assert_array_equal(x, before, err_msg=name)


def test_div_truncates_integers_toward_zero() -> None:
    a = np.array([7, -7, 7, -7, 6, -6, 2**62 + 1], np.int64)
    b = np.array([2, 2, -2, -2, 3, 3, 1], np.int64)
    np.testing.assert_array_equal(_run("Div", a, b), [3, -3, -3, 3, 2, -2, 2**62 + 1])
    assert _run("Div", a.astype(np.int8)[:6], b.astype(np.int8)[:6]).dtype == np.int8


def test_mod_sign_rules() -> None:
    a = np.array([-7, 7, -7, 7], np.int32)
    b = np.array([3, -3, -3, 3], np.int32)
    np.testing.assert_array_equal(_run("Mod", a, b), [2, -2, -1, 1])  # sign of the divisor
    np.testing.assert_array_equal(_run("Mod", a, b, fmod=1), [-1, 1, -1, 1])  # sign of the dividend


def test_pow_keeps_base_dtype() -> None:
    assert _run("Pow", np.array([2.0], np.float16), np.array([3], np.int64)).dtype == np.float16
    assert _run("Pow", np.array([2], np.int32), np.array([0.5], np.float32)).dtype == np.int32


def test_round_is_half_to_even() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 2.3, -2.7], np.float32)
    np.testing.assert_array_equal(_run("Round", x), [0, 2, 2, -0, -2, 2, -3])


def test_clip_attributes_before_opset_11() -> None:
    x = np.array([-2.0, 0.5, 2.0], np.float32)
    np.testing.assert_array_equal(_run("Clip", x, opset=6, min=-1.0, max=1.0), [-1.0, 0.5, 1.0])
    np.testing.assert_array_equal(_run("Clip", x, opset=6), x)
    lo, hi = np.float32(-1.0), np.float32(1.0)
    np.testing.assert_array_equal(_run("Clip", x, None, hi, opset=13), [-2.0, 0.5, 1.0])
    np.testing.assert_array_equal(_run("Clip", x, hi, lo, opset=13), [-1.0, -1.0, -1.0])  # min > max: max


def test_dropout_inference_and_seeded_training() -> None:
    x = np.arange(1.0, 61.0, dtype=np.float32).reshape(3, 4, 5)
    y, mask = _run("Dropout", x, n_outputs=2)
    assert y is x and mask.dtype == np.bool_ and mask.all()
    r, t = np.float32(0.75), np.bool_(True)
    y1, m1 = _run("Dropout", x, r, t, n_outputs=2, seed=3)
    y2, _ = _run("Dropout", x, r, t, n_outputs=2, seed=3)
    np.testing.assert_array_equal(y1, y2)
    assert y1.dtype == np.float32 and m1.dtype == np.bool_ and 0 < m1.sum() < m1.size
    np.testing.assert_allclose(y1[m1], x[m1] * 4.0)
    assert (y1[~m1] == 0).all()
    y0, m0 = _run("Dropout", x, np.float32(0.0), t, n_outputs=2, seed=3)
    assert y0 is x and m0.all()


def test_bitshift_edges() -> None:
    x = np.array([-128, -1, 64, 1], np.int8)
    np.testing.assert_array_equal(
        _run("BitShift", x, np.array([1, 8, 1, 7], np.int8), direction="LEFT"), [0, 0, -128, -128]
    )
    np.testing.assert_array_equal(
        _run("BitShift", x, np.array([7, 9, -1, 0], np.int8), direction="RIGHT"), [-1, -1, 0, 1]
    )
    with pytest.raises(ValueError, match="direction"):
        _run("BitShift", x, x, direction="UP")


def test_bitcast_reinterprets_bytes_of_any_layout() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3).T  # not contiguous
    got = _run("BitCast", x, to=onnx.TensorProto.INT32)
    np.testing.assert_array_equal(got, x.copy().view(np.int32))
    with pytest.raises(ValueError, match="width"):
        _run("BitCast", x, to=onnx.TensorProto.INT64)


def test_cast_and_castlike() -> None:
    x = np.array([0.0, -0.0, 1.5, np.nan, -3.7], np.float32)
    np.testing.assert_array_equal(_run("Cast", x, to=onnx.TensorProto.BOOL), [False, False, True, True, True])
    assert _run("Cast", x, to=onnx.TensorProto.BFLOAT16).dtype == ml_dtypes.bfloat16
    assert _run("CastLike", x, np.zeros(1, np.float16)).dtype == np.float16
    np.testing.assert_array_equal(_run("Cast", np.array([200], np.int16), to=onnx.TensorProto.INT8), [-56])
    with pytest.raises(DTypeError, match="complex64"):
        _run("Cast", x, to=onnx.TensorProto.COMPLEX64)


def test_swiglu_rejects_broadcasting() -> None:
    with pytest.raises(ValueError, match="one shape"):
        _run("SwiGLU", np.ones((2, 3), np.float32), np.ones((3,), np.float32))


def test_shape_rules() -> None:
    a = TensorInfo("float32", ("N", 1, 4))
    b = TensorInfo("float32", (3, 1))
    assert lookup("Add").shape_rule({}, a, b) == [TensorInfo("float32", ("N", 3, 4))]
    assert lookup("Less").shape_rule({}, a, b) == [TensorInfo("bool", ("N", 3, 4))]
    assert lookup("IsNaN").shape_rule({}, a) == [TensorInfo("bool", a.shape)]
    cond = TensorInfo("bool", (2, 1, 1))
    assert lookup("Where").shape_rule({}, cond, TensorInfo("int64", (4,)), TensorInfo("int64", (1,))) == [
        TensorInfo("int64", (2, 1, 4))
    ]
    assert lookup("Cast").shape_rule({"to": 10}, a) == [TensorInfo("float16", a.shape)]
    assert lookup("CastLike").shape_rule({}, a, TensorInfo("int8", (1,))) == [TensorInfo("int8", a.shape)]
    assert lookup("Dropout").shape_rule({}, a) == [a, TensorInfo("bool", a.shape)]
    assert lookup("Sum").shape_rule({}, a, b, TensorInfo("float32", (5, 1, 1, 1))) == [
        TensorInfo("float32", (5, "N", 3, 4))
    ]


def test_table_entries_are_complete() -> None:
    names = UNARY_FLOAT + ["IsNaN", "IsInf", "Not", "And", "Or", "Xor", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
                           "BitwiseNot", "BitShift", "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Greater",
                           "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Min", "Sum", "Mean", "Where", "Clip",
                           "PRelu", "Identity", "Dropout", "Cast", "CastLike", "BitCast", "SwiGLU"]  # fmt: skip
    for name in names:
        opdef = lookup(name)
        assert opdef.has(Trait.ELEMENTWISE), name
        assert opdef.shape_rule is not None, name
        assert opdef.doc, name
    assert lookup("Max").inputs == (1, -1)
    assert lookup("Dropout").outputs == (1, 2)
    assert lookup("Clip").inputs == (1, 3)
