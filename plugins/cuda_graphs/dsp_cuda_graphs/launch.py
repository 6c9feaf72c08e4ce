"""Kernel launches through the CUDA driver's ``cuLaunchKernelEx``, by ctypes: the runtime layer's one launcher.

CuPy's kernel call takes no launch attributes; a generated kernel that waits for the one
before it (PTX ``griddepcontrol.wait``) is launched with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, so inside a replayed graph its
launch and its loads of constant weights overlap the previous kernel's work. dsp-nvrtc's
CUDA C kernels and dsp-triton's cubins (loaded without Triton's own launcher) go through
here; every parameter they take is a device pointer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_driver: Any = None
_driver_lock = threading.Lock()


def launch_ex() -> Any:
    """``cuLaunchKernelEx`` of the loaded CUDA driver, or None (no driver, or one older than CUDA 12)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            fn: Any = False
            try:
                fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            except (OSError, AttributeError):
                pass
            else:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _driver = fn
    return _driver or None


def launch_pointers(
    function: Any,
    grid: tuple[int, int, int],
    threads: int,
    pointers: Sequence[int],
    stream: int,
    *,
    shared: int = 0,
    dependent: bool = False,
) -> None:
    """``function`` (a loaded CuPy ``Function``) over ``grid`` blocks of ``threads`` on ``stream``, its
    parameters the device addresses ``pointers`` (0 passes NULL); a programmatic dependent of the
    kernel before it when ``dependent``. Raises RuntimeError when the driver refuses the launch."""
    fn = launch_ex()
    if fn is None:
        raise RuntimeError("the CUDA driver has no cuLaunchKernelEx (CUDA 12 or newer is needed)")
    values = (ctypes.c_uint64 * len(pointers))(*(int(p) for p in pointers))
    params = (ctypes.c_void_p * len(pointers))(*(ctypes.addressof(values) + 8 * k for k in range(len(pointers))))
    attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1
    gx, gy, gz = grid
    config = _Config(gx, gy, gz, threads, 1, 1, shared, stream, ctypes.pointer(attribute), 1 if dependent else 0)
    status = fn(ctypes.byref(config), function.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx of {getattr(function, 'name', 'a kernel')} failed: CUresult {status}")
