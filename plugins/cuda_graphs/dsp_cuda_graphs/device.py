"""The CUDA side: the availability probe, one stream and cuBLAS handle per device, the capture lock.

Everything the backend does on a GPU runs on that device's one non-blocking CuPy stream:
eager gaps, staging copies, captures and replays, so they are ordered among themselves
without synchronising. Work the caller issues on the device's legacy default stream is
ordered against it with two events per segment call (``fence_in`` / ``fence_out``); a
plan placed over several devices (dsp_core.devices) orders its cross-device copies on
those legacy streams too. ``state`` answers for the current CuPy device (the core enters
each segment's device before calling it). Captures are serialised by a process-wide lock
with a timeout (one capture at a time).
"""

from __future__ import annotations

import threading
from typing import Any

CAPTURE_LOCK_TIMEOUT_S = 120.0
_capture_lock = threading.Lock()
_states: dict[int, dict[str, Any]] = {}  # CUDA device id -> its stream, events, cuBLAS handle
_state_lock = threading.Lock()


def probe() -> str | None:
    """None when CuPy imports and sees a usable CUDA device, else the reason a user should read."""
    try:
        import cupy
    except ImportError:
        return "cupy not installed (pip install cupy-cuda13x, or dsp-cuda-graphs[cuda13])"
    except Exception as exc:  # noqa: BLE001  (a broken CUDA install raises anything)
        return f"cupy failed to import: {type(exc).__name__}: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "no CUDA device"
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
        runtime = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:  # noqa: BLE001
        return f"CUDA driver unusable: {exc}"
    if driver // 1000 < runtime // 1000:  # minor versions are compatible within a major
        return f"driver supports CUDA {_ver(driver)} < CuPy's runtime {_ver(runtime)}: update the driver"
    try:
        from dsp_cuda_graphs.cublas import load_library

        load_library()
    except OSError as exc:
        return str(exc)
    return None


def _ver(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def cupy_module() -> Any:
    """CuPy (imported on first use: the plugin must import without it)."""
    import cupy

    return cupy


def sm_count(cp: Any) -> int | None:
    """The current device's streaming multiprocessors (``cp``: CuPy), None where it cannot say."""
    try:
        return int(cp.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # noqa: BLE001  (no device, a stand-in module: the caller's rule has a default)
        return None


def state(tf32: bool) -> dict[str, Any]:
    """The current device's stream, events and cuBLAS handle (made once per device, outside any capture)."""
    cp = cupy_module()
    device_id = int(cp.cuda.runtime.getDevice())
    with _state_lock:
        st = _states.get(device_id)
        if st is None:
            stream = cp.cuda.Stream(non_blocking=True)
            from dsp_cuda_graphs.cublas import WORKSPACE_BYTES, Cublas

            workspace = cp.cuda.alloc(WORKSPACE_BYTES)
            st = _states[device_id] = {
                "cupy": cp,
                "device": device_id,
                "stream": stream,
                "cublas": Cublas(stream.ptr, workspace, tf32),
                "ev_in": cp.cuda.Event(disable_timing=True),
                "ev_out": cp.cuda.Event(disable_timing=True),
                "null": cp.cuda.Stream.null,
            }
        return st


def fence_in(st: dict[str, Any]) -> None:
    """Our stream waits for what the caller queued on the legacy default stream."""
    st["ev_in"].record(st["null"])
    st["stream"].wait_event(st["ev_in"])


def fence_out(st: dict[str, Any]) -> None:
    """The legacy default stream waits for what we queued (outputs read there are complete)."""
    st["ev_out"].record(st["stream"])
    st["null"].wait_event(st["ev_out"])


class CaptureLock:
    """One capture at a time in this process (the device's capture state is global)."""

    def __enter__(self) -> None:
        if not _capture_lock.acquire(timeout=CAPTURE_LOCK_TIMEOUT_S):
            raise TimeoutError(f"waited {CAPTURE_LOCK_TIMEOUT_S:.0f} s for another capture to finish")

    def __exit__(self, *exc: Any) -> None:
        _capture_lock.release()
