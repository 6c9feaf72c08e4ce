"""Conversions to and from the storage-only dtypes: float8, float8e8m0, float4, int4, int2.

Cast, CastLike, QuantizeLinear and DequantizeLinear share these. The dtypes come from
``ml_dtypes``, which only numpy knows: cupy has none of them, so every conversion that
touches one runs on the host with numpy, and a result in an ordinary dtype goes back to
the kernel's ``xp``. Semantics are ONNX Cast's (opset 25): float8 targets clamp to their
largest finite value when ``saturate`` is set and follow the format's own overflow
rules (inf or NaN) when not; float8e8m0 rounds by ``round_mode``; float4 has neither
inf nor NaN, so it always clamps; integer targets wrap, as every ONNX integer cast does.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from dsp_core.ir import dtypes

Array = Any

# Compared by numpy dtype: the kernels see arrays, not DSP names.
_STORAGE_ONLY = frozenset(dtypes.to_numpy(name) for name in dtypes.STORAGE_ONLY_DTYPES)
_FLOAT8 = frozenset(dtypes.to_numpy(name) for name in dtypes.FLOAT8_DTYPES)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

# float8e8m0 is a bare biased exponent: code c means 2**(c - 127); 0xFF is NaN.
_E8M0_BIAS = 127
_E8M0_MAX_CODE = 0xFE
_E8M0_NAN = 0xFF
ROUND_MODES = ("up", "down", "nearest")


def is_storage_only(dtype: Any) -> bool:
    """True for a numpy dtype that DSP stores and converts but does not compute with."""
    return np.dtype(dtype) in _STORAGE_ONLY


def to_host(a: Array) -> np.ndarray:
    """A numpy view or copy of a numpy or cupy array."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def convert(xp: Any, x: Array, target: Any, *, saturate: bool = True, round_mode: str = "up") -> Array:
    """``x`` cast to ``target`` with ONNX Cast semantics, storage-only dtypes included."""
    target = np.dtype(target)
    if not (is_storage_only(target) or is_storage_only(x.dtype)):
        return x.astype(target, copy=False)
    host = to_host(x)  # ml_dtypes' types exist in numpy only
    if target == _E8M0:
        y = to_e8m0(host, saturate=saturate, round_mode=round_mode)
    elif target in _FLOAT8 and saturate:
        y = _clamped(host, target).astype(target)
    else:
        y = host.astype(target)
    return y if is_storage_only(target) else xp.asarray(y)


def _clamped(x: np.ndarray, target: np.dtype[Any]) -> np.ndarray:
    """``x`` clipped to the finite range of float ``target`` (NaN stays NaN)."""
    info = ml_dtypes.finfo(target)
    if x.dtype.kind not in "f":  # integers, bfloat16, other low-bit floats: clip exactly in float64
        x = x.astype(np.float64)
    return np.clip(x, float(info.min), float(info.max))


def to_e8m0(x: np.ndarray, *, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """``x`` rounded to a power of two, as float8e8m0 (the sign is ignored: negatives are undefined).

    ``round_mode`` picks the power below ("down"), above ("up") or the nearer one, ties
    going up ("nearest"). Zero and values that round below 2**-127 underflow; values that
    round above 2**127 and infinities overflow: both clamp when ``saturate`` is set and
    give NaN when not (the spec's table; onnx's reference maps infinity to NaN always).
    """
    if round_mode not in ROUND_MODES:
        raise ValueError(f"Cast round_mode must be one of {', '.join(ROUND_MODES)}, got {round_mode!r}")
    # float64 holds every value of the narrower types exactly, subnormal float32 included.
    mag = np.abs(np.asarray(x).astype(np.float64))
    with np.errstate(invalid="ignore"):
        frac, exp = np.frexp(mag)  # mag = frac * 2**exp with frac in [0.5, 1)
    significand = 2.0 * frac  # mag = significand * 2**(exp - 1), significand in [1, 2)
    code = exp.astype(np.int64) - 1 + _E8M0_BIAS
    if round_mode == "up":
        # The power above a positive value under 2**-127 is 2**-127 itself: no underflow.
        code = np.maximum(code + (significand > 1.0), 0)
    elif round_mode == "nearest":
        code += significand >= 1.5
    over = (code > _E8M0_MAX_CODE) | np.isinf(mag)
    under = (code < 0) | (mag == 0.0)
    code = np.where(under, 0, np.where(over, _E8M0_MAX_CODE, code))
    if not saturate:
        code = np.where(over | under, _E8M0_NAN, code)
    code = np.where(np.isnan(mag), _E8M0_NAN, code)
    return code.astype(np.uint8).view(_E8M0)
