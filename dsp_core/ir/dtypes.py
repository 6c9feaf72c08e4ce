"""The dtypes DSP knows, and their mapping to numpy and to ONNX's TensorProto enum.

A dtype is named by its numpy string ("float32", "bfloat16", "float8_e4m3fn", ...).
bfloat16 and the low-precision types come from ``ml_dtypes``, which registers them as
numpy dtypes. The low-precision ones (float8, float4, 4- and 2-bit integers) are
storage-only: DSP stores, casts, quantizes and dequantizes them, and compute ops do not
claim them (see ``STORAGE_ONLY_DTYPES``).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from dsp_core.errors import DTypeError

# name -> (numpy dtype, ONNX TensorProto.DataType value)
_TABLE: dict[str, tuple[np.dtype[Any], int]] = {
    "float32": (np.dtype(np.float32), 1),
    "uint8": (np.dtype(np.uint8), 2),
    "int8": (np.dtype(np.int8), 3),
    "uint16": (np.dtype(np.uint16), 4),
    "int16": (np.dtype(np.int16), 5),
    "int32": (np.dtype(np.int32), 6),
    "int64": (np.dtype(np.int64), 7),
    "bool": (np.dtype(np.bool_), 9),
    "float16": (np.dtype(np.float16), 10),
    "float64": (np.dtype(np.float64), 11),
    "uint32": (np.dtype(np.uint32), 12),
    "uint64": (np.dtype(np.uint64), 13),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), 16),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), 17),
    "float8_e4m3fnuz": (np.dtype(ml_dtypes.float8_e4m3fnuz), 18),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 19),
    "float8_e5m2fnuz": (np.dtype(ml_dtypes.float8_e5m2fnuz), 20),
    "uint4": (np.dtype(ml_dtypes.uint4), 21),
    "int4": (np.dtype(ml_dtypes.int4), 22),
    "float4_e2m1fn": (np.dtype(ml_dtypes.float4_e2m1fn), 23),
    "float8_e8m0fnu": (np.dtype(ml_dtypes.float8_e8m0fnu), 24),
    "uint2": (np.dtype(ml_dtypes.uint2), 25),
    "int2": (np.dtype(ml_dtypes.int2), 26),
}

DTYPE_NAMES: tuple[str, ...] = tuple(_TABLE)
_BY_ONNX: dict[int, str] = {code: name for name, (_, code) in _TABLE.items()}
_BY_NUMPY: dict[np.dtype[Any], str] = {dt: name for name, (dt, _) in _TABLE.items()}

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
# Low-precision dtypes DSP only stores, casts, quantizes and dequantizes; no compute op claims them.
FLOAT8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})
LOW_BIT_INT_DTYPES = frozenset({"int4", "uint4", "int2", "uint2"})
STORAGE_ONLY_DTYPES = FLOAT8_DTYPES | LOW_BIT_INT_DTYPES | {"float8_e8m0fnu", "float4_e2m1fn"}

# ONNX TensorProto codes that DSP does not compute with, for clear messages.
_UNSUPPORTED_ONNX = {
    0: "undefined",
    8: "string",
    14: "complex64",
    15: "complex128",
}


def normalize(dtype: Any) -> str:
    """Return DSP's name for a dtype given as a name, a numpy dtype or an ONNX enum."""
    if isinstance(dtype, str) and dtype in _TABLE:
        return dtype
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        return from_onnx(int(dtype))
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"unknown dtype {dtype!r}; DSP supports {', '.join(DTYPE_NAMES)}") from exc
    name = _BY_NUMPY.get(np_dtype)
    if name is None:
        raise DTypeError(f"dtype {np_dtype} is not supported; DSP supports {', '.join(DTYPE_NAMES)}")
    return name


def to_numpy(name: str) -> np.dtype[Any]:
    """The numpy dtype of a DSP dtype name."""
    return _TABLE[normalize(name)][0]


def to_onnx(name: str) -> int:
    """The ONNX TensorProto enum value of a DSP dtype name."""
    return _TABLE[normalize(name)][1]


def from_onnx(code: int) -> str:
    """DSP's dtype name for an ONNX TensorProto enum value."""
    name = _BY_ONNX.get(code)
    if name is None:
        what = _UNSUPPORTED_ONNX.get(code, f"code {code}")
        raise DTypeError(f"ONNX element type {what} is not supported; DSP supports {', '.join(DTYPE_NAMES)}")
    return name


def numpy_from_onnx(code: int) -> np.dtype[Any]:
    """The numpy dtype for an ONNX TensorProto enum value (used by Cast-like kernels)."""
    return to_numpy(from_onnx(code))
