"""PTX_JIT's kernels for the two row-wise ops that dominate a transformer step's launch count.

The reference LayerNormalization and Softmax are written with array ops: about twenty
and six kernel launches each (widening fp16, two means, the normalisation, narrowing).
Inside a CUDA graph every launch costs GPU time, so PTX_JIT swaps them, where it can, for
one kernel per op, loaded from PTX committed with the plugin (no NVRTC needed at run time):
one thread block per row, the reductions in shared memory (warp shuffles), float
accumulation (as the reference: stash type float32), the result written in the input's
dtype. Anything else (other axes, dtypes, the optional Mean/InvStdDev outputs) falls
back to the reference kernel, so results never depend on which path ran.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

_BLOCK = 256  # threads per row
_HERE = Path(__file__).parent / "ptx"
SOURCE = _HERE / "rowwise.cu"  # the kernels' CUDA C (after codegen.DEVICE_PRELUDE)
PTX = _HERE / "rowwise.ptx"  # what PTX_JIT loads: SOURCE compiled by scripts/build_ptx.py
ARCH = "compute_75"  # the oldest architecture CUDA 13 targets: the driver JITs it for the GPU at load
NAMES = ("ln_float32", "ln_float16", "softmax_float32", "softmax_float16")
_modules: dict[int, Any] = {}  # device -> loaded module, for the process (graphs launch its functions)
_lock = threading.Lock()


def translation_unit() -> str:
    """What NVRTC compiles into ``PTX``: the generator's prelude, then the kernels."""
    from dsp_nvrtc.codegen import DEVICE_PRELUDE

    return DEVICE_PRELUDE + SOURCE.read_text()


FUSED_DTYPES = frozenset({"float16", "float32"})


def _module(st: dict[str, Any]) -> Any:
    """The committed PTX, loaded once per device and process (cuModuleLoadData), before any capture."""
    with _lock:
        mod = _modules.get(st["device"])
        if mod is None:
            mod = st["cupy"].cuda.function.Module()
            mod.load(PTX.read_bytes() + b"\0")
            _modules[st["device"]] = mod
    return mod


def _rows(x: Any) -> tuple[int, int]:
    n = x.shape[-1] if x.ndim else 1
    return (x.size // n if n else 0), n


def layer_norm_kernel(
    st: dict[str, Any], reference: Any, n_outputs: int, axis: int = -1, epsilon: float = 1e-5, **_: Any
) -> Any:
    """A LayerNormalization slot kernel: fused over the last axis when it can, else ``reference``."""

    def kernel(x: Any, scale: Any, b: Any = None) -> Any:
        dtype = str(x.dtype)
        last = axis in (-1, x.ndim - 1)
        same = scale.dtype == x.dtype and (b is None or b.dtype == x.dtype)
        if n_outputs != 1 or not last or dtype not in FUSED_DTYPES or not same or scale.size != x.shape[-1]:
            return reference(x, scale, b)
        cp = st["cupy"]
        rows, n = _rows(x)
        xc = cp.ascontiguousarray(x)
        sc = cp.ascontiguousarray(scale.reshape(-1))
        bc = cp.ascontiguousarray(b.reshape(-1)) if b is not None and b.size == n else None
        if b is not None and bc is None:
            return reference(x, scale, b)
        y = cp.empty_like(xc)
        if rows:
            fn = _module(st).get_function(f"ln_{dtype}")
            fn(
                (rows,),
                (_BLOCK,),
                (xc, sc, bc if bc is not None else sc, y, np.int32(n), np.float32(epsilon), np.int32(bc is not None)),
            )
        return (y, None, None)

    return kernel


def softmax_kernel(st: dict[str, Any], reference: Any, opset: int, axis: int | None = None) -> Any:
    """A Softmax slot kernel: fused over the last axis (opset >= 13 semantics), else ``reference``."""

    def kernel(x: Any) -> Any:
        dtype = str(x.dtype)
        ax = (-1 if opset >= 13 else 1) if axis is None else axis
        last = x.ndim >= 1 and ax in (-1, x.ndim - 1) and (opset >= 13 or x.ndim - 1 == ax % max(x.ndim, 1))
        if not last or dtype not in FUSED_DTYPES:
            return reference(x)
        cp = st["cupy"]
        rows, n = _rows(x)
        xc = cp.ascontiguousarray(x)
        y = cp.empty_like(xc)
        if rows and n:
            _module(st).get_function(f"softmax_{dtype}")((rows,), (_BLOCK,), (xc, y, np.int32(n)))
        return y

    return kernel


def row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length) of a row-wise op over the last axis (pure Python, for tests)."""
    n = shape[-1] if shape else 1
    total = int(np.prod(shape)) if shape else 1
    return (total // n if n else 0), n
