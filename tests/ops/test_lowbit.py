"""Storage-only dtypes (float8, float8e8m0, float4, int4, int2): Cast, CastLike and (De)QuantizeLinear."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest

from dsp_core.ir import dtypes
from dsp_core.ops import lowbit
from dsp_core.ops.registry import KernelContext, lookup

TP = onnx.TensorProto


def _run(op: str, *args: Any, opset: int = 25, **attrs: Any) -> Any:
    ctx = KernelContext(np, opset, len(args), 1)
    return lookup(op).kernel(ctx, *args, **attrs)


def _codes(a: np.ndarray) -> list[int]:
    return a.view(np.uint8).tolist()


def test_table_knows_the_low_bit_types_as_storage_only() -> None:
    for code, name in [(17, "float8_e4m3fn"), (21, "uint4"), (23, "float4_e2m1fn"), (24, "float8_e8m0fnu")]:
        assert dtypes.from_onnx(code) == name
        assert dtypes.to_onnx(name) == code
        assert name in dtypes.STORAGE_ONLY_DTYPES
    assert dtypes.normalize(ml_dtypes.int2) == "int2"
    assert not dtypes.STORAGE_ONLY_DTYPES & (dtypes.FLOAT_DTYPES | dtypes.INT_DTYPES)


@pytest.mark.parametrize(
    ("to", "saturated", "unsaturated"),
    [
        (TP.FLOAT8E4M3FN, 448.0, np.nan),
        (TP.FLOAT8E4M3FNUZ, 240.0, np.nan),
        (TP.FLOAT8E5M2, 57344.0, np.inf),
        (TP.FLOAT8E5M2FNUZ, 57344.0, np.nan),
    ],
)
def test_float8_overflow_clamps_only_when_saturating(to: int, saturated: float, unsaturated: float) -> None:
    x = np.array([1e6, np.inf, 0.5, np.nan], np.float32)
    sat = _run("Cast", x, to=to).astype(np.float64)
    np.testing.assert_array_equal(sat, [saturated, saturated, 0.5, np.nan])
    raw = _run("Cast", x, to=to, saturate=0).astype(np.float64)
    np.testing.assert_array_equal(raw[:2], [unsaturated, unsaturated])
    assert raw[2] == 0.5


def test_float8_rounds_to_nearest_even_and_round_trips() -> None:
    # e4m3fn has 3 mantissa bits: between 1.0 and 1.125, 1.0625 is a tie that goes to even (1.0)
    x = np.array([1.0625, 1.0626, -3.3], np.float32)
    y = _run("Cast", x, to=TP.FLOAT8E4M3FN)
    assert y.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(y.astype(np.float32), [1.0, 1.125, -3.25])
    back = _run("Cast", y, to=TP.FLOAT)
    np.testing.assert_array_equal(_run("Cast", back, to=TP.FLOAT8E4M3FN).view(np.uint8), y.view(np.uint8))


def test_castlike_uses_the_dtype_and_attributes_of_its_second_input() -> None:
    x = np.array([65000.0, -65000.0], np.float16)  # beyond 61440, the midpoint to e5m2 inf
    like = np.zeros(1, ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(_run("CastLike", x, like).astype(np.float32), [57344.0, -57344.0])
    np.testing.assert_array_equal(_run("CastLike", x, like, saturate=0).astype(np.float32), [np.inf, -np.inf])


def test_e8m0_round_modes() -> None:
    x = np.array([1.0, 1.4, 1.5, 3.0, 0.3], np.float32)
    expected = {"down": [0, 0, 0, 1, -2], "up": [0, 1, 1, 2, -1], "nearest": [0, 0, 1, 2, -2]}
    for mode, exponents in expected.items():
        y = _run("Cast", x, to=TP.FLOAT8E8M0, round_mode=mode)
        assert y.dtype == ml_dtypes.float8_e8m0fnu
        np.testing.assert_array_equal(y.astype(np.float32), np.exp2(exponents), err_msg=mode)
    with pytest.raises(ValueError, match="round_mode"):
        _run("Cast", x, to=TP.FLOAT8E8M0, round_mode="zero")


def test_e8m0_special_values_saturate_or_give_nan() -> None:
    x = np.array([0.0, np.inf, 3e38, 1e-40, np.nan], np.float32)
    # saturating: zero to the smallest code, overflow to the largest; 1e-40 rounds up to 2**-127
    assert _codes(lowbit.to_e8m0(x)) == [0, 0xFE, 0xFE, 0, 0xFF]
    assert _codes(lowbit.to_e8m0(x, saturate=False, round_mode="nearest")) == [0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    # the exponent is exact for float64 inputs too, below float32's range
    assert _codes(lowbit.to_e8m0(np.array([2.0**-127, 2.0**127]), round_mode="down")) == [0, 0xFE]


def test_low_bit_integers_wrap_like_every_onnx_integer_cast() -> None:
    x = np.array([-9, -8, 7, 8, 15], np.float32)
    np.testing.assert_array_equal(_run("Cast", x, to=TP.INT4).astype(np.int8), [7, -8, 7, -8, -1])
    np.testing.assert_array_equal(_run("Cast", x, to=TP.UINT4).astype(np.int8), [7, 8, 7, 8, 15])
    two = _run("Cast", np.arange(-3, 4, dtype=np.int32), to=TP.INT2)
    np.testing.assert_array_equal(two.astype(np.int8), [1, -2, -1, 0, 1, -2, -1])
    assert _run("Cast", two, to=TP.INT8).dtype == np.int8


def test_float4_has_no_inf_or_nan_so_it_clamps() -> None:
    x = np.array([0.25, 0.75, 5.0, 1e6, -np.inf], np.float32)
    y = _run("Cast", x, to=TP.FLOAT4E2M1)
    np.testing.assert_array_equal(y.astype(np.float32), [0.0, 1.0, 4.0, 6.0, -6.0])


def test_quantize_to_int4_and_back_per_axis() -> None:
    x = np.array([[-20.0, -2.0, 3.0], [1.0, 13.0, 100.0]], np.float32)
    scale = np.array([2.0, 1.0], np.float32)
    zp = np.array([0, 3], ml_dtypes.int4)
    q = _run("QuantizeLinear", x, scale, zp, axis=0)
    assert q.dtype == ml_dtypes.int4
    np.testing.assert_array_equal(q.astype(np.int8), [[-8, -1, 2], [4, 7, 7]])  # -1 and 2: half to even
    back = _run("DequantizeLinear", q, scale, zp, axis=0)
    np.testing.assert_array_equal(back, [[-16.0, -2.0, 4.0], [1.0, 4.0, 4.0]])


def test_quantize_blocked_to_uint2_saturates() -> None:
    x = np.array([[0.0, 1.0, 2.0, 9.0]], np.float32)
    scale = np.array([[1.0, 2.0]], np.float32)
    q = _run("QuantizeLinear", x, scale, axis=1, block_size=2, output_dtype=TP.UINT2)
    assert q.dtype == ml_dtypes.uint2
    np.testing.assert_array_equal(q.astype(np.uint8), [[0, 1, 1, 3]])


def test_quantize_to_float8_saturates_by_attribute() -> None:
    x = np.array([2.0, 1000.0, -1e9], np.float32)
    zp = np.zeros((), ml_dtypes.float8_e4m3fn)
    sat = _run("QuantizeLinear", x, np.float32(2.0), zp)
    np.testing.assert_array_equal(sat.astype(np.float32), [1.0, 448.0, -448.0])
    raw = _run("QuantizeLinear", x, np.float32(2.0), zp, saturate=0)
    assert np.isnan(raw.astype(np.float32)[1:]).all()


def test_dequantize_float8_and_float4_to_the_requested_dtype() -> None:
    x = np.array([0.5, -6.0, 3.0], np.float32).astype(ml_dtypes.float4_e2m1fn)
    got = _run("DequantizeLinear", x, np.float32(2.0), output_dtype=TP.FLOAT16)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, [1.0, -12.0, 6.0])
    f8 = np.array([448.0, -0.5], np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(_run("DequantizeLinear", f8, np.float16(0.5)), np.array([224.0, -0.25], np.float16))
