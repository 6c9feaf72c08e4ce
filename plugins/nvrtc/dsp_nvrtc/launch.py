"""Launching dsp-nvrtc's kernels: as programmatic dependents on sm_90+ GPUs, else plainly.

A kernel launched with the driver's ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
may start while the kernel before it on the stream is still running; every kernel dsp-nvrtc
generates waits for that kernel's completion and memory flush (``DSP_WAIT()``: PTX
``griddepcontrol.wait``) before it touches memory the kernel may write, then lets the next
kernel launch. Inside a replayed CUDA graph (stream capture records the attribute as a
programmatic edge) the next kernel's launch and its loads of constant weights overlap this
one's work, where a graph otherwise pays about a microsecond per node. Without the
attribute the wait is a no-op, so the same binary serves both launches (one cache entry).

The launch goes through ``cuLaunchKernelEx`` of the CUDA driver (dsp-cuda-graphs' ``launch``):
CuPy's kernel call takes no launch attributes. ``DSP_NVRTC_PDL=0`` launches plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsp_cuda_graphs.launch import launch_ex, launch_pointers

from dsp_core import config as dsp_config

_DEPENDENT: dict[int, bool] = {}  # device -> whether its launches are programmatic dependents


def dependent_launch(cp: Any) -> bool:
    """Whether kernels on the current device launch as programmatic dependents (DSP_NVRTC_PDL, sm_90+,
    a driver with ``cuLaunchKernelEx``); decided once per device for the process."""
    dev = cp.cuda.Device()
    got = _DEPENDENT.get(dev.id)
    if got is None:
        got = bool(dsp_config.get("nvrtc_pdl")) and int(dev.compute_capability) >= 90 and launch_ex() is not None
        _DEPENDENT[dev.id] = got
    return got


def launch(cp: Any, function: Any, grid: int, threads: int, args: Sequence[Any]) -> None:
    """``function`` (a loaded CuPy ``Function``) over ``grid`` blocks of ``threads`` on the current
    stream, its arguments device arrays (every generated kernel's parameters are pointers)."""
    if not dependent_launch(cp):
        function((grid,), (threads,), tuple(args))
        return
    pointers = [int(x.data.ptr) for x in args]
    launch_pointers(function, (grid, 1, 1), threads, pointers, cp.cuda.get_current_stream().ptr, dependent=True)
