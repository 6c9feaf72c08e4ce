"""Launching dsp-nvrtc's kernels: as programmatic dependents on sm_90+ GPUs, else plainly.

A kernel launched with the driver's ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
may start while the kernel before it on the stream is still running; every kernel dsp-nvrtc
generates waits for that kernel's completion and memory flush (``DSP_WAIT()``: PTX
``griddepcontrol.wait``) before it touches memory the kernel may write, then lets the next
kernel launch. Inside a replayed CUDA graph (stream capture records the attribute as a
programmatic edge) the next kernel's launch and its loads of constant weights overlap this
one's work, where a graph otherwise pays about a microsecond per node. Without the
attribute the wait is a no-op, so the same binary serves both launches (one cache entry).

The launch goes through ``cuLaunchKernelEx`` of the CUDA driver (``libcuda``), by ctypes:
CuPy's kernel call takes no launch attributes. ``DSP_NVRTC_PDL=0`` launches plainly.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from dsp_core import config as dsp_config

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


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
_DEPENDENT: dict[int, bool] = {}  # device -> whether its launches are programmatic dependents


def _launch_ex() -> Any:
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


def dependent_launch(cp: Any) -> bool:
    """Whether kernels on the current device launch as programmatic dependents (DSP_NVRTC_PDL, sm_90+,
    a driver with ``cuLaunchKernelEx``); decided once per device for the process."""
    dev = cp.cuda.Device()
    got = _DEPENDENT.get(dev.id)
    if got is None:
        got = bool(dsp_config.get("nvrtc_pdl")) and int(dev.compute_capability) >= 90 and _launch_ex() is not None
        _DEPENDENT[dev.id] = got
    return got


def launch(cp: Any, function: Any, grid: int, threads: int, args: Sequence[Any]) -> None:
    """``function`` (a loaded CuPy ``Function``) over ``grid`` blocks of ``threads`` on the current
    stream, its arguments device arrays (every generated kernel's parameters are pointers)."""
    if not dependent_launch(cp):
        function((grid,), (threads,), tuple(args))
        return
    pointers = (ctypes.c_uint64 * len(args))(*(int(x.data.ptr) for x in args))
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(pointers) + 8 * k for k in range(len(args))))
    attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1
    config = _Config(grid, 1, 1, threads, 1, 1, 0, cp.cuda.get_current_stream().ptr, ctypes.pointer(attribute), 1)
    status = _launch_ex()(ctypes.byref(config), function.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx of {getattr(function, 'name', 'a kernel')} failed: CUresult {status}")
