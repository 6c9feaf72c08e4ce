"""NVRTC, driven through ctypes: CUDA C to PTX or CUBIN in process, with or without a GPU.

The library comes from the ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu13/lib``, the
``dsp-nvrtc[nvrtc]`` extra), a CUDA install or the loader's path. NVRTC needs no device:
on a CPU machine it compiles generated kernels to PTX for a virtual architecture, which is
how CI checks every generated kernel. Errors name the kernel and quote the generated
source's lines NVRTC points at.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsp_cuda_graphs.cublas import library_candidates

_WHEEL_DIRS = ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None


class NvrtcUnavailable(RuntimeError):
    """No loadable libnvrtc (the message lists what was tried)."""


class NvrtcError(RuntimeError):
    """A generated kernel NVRTC refused: the log, and the source lines it names."""

    def __init__(self, name: str, log: str, source: str) -> None:
        self.name = name
        self.log = log
        self.lines = [int(n) for n in re.findall(rf"{re.escape(name)}\.cu\((\d+)\)", log)]
        text = source.splitlines()
        quoted = [f"  line {n}: {text[n - 1].strip()}" for n in dict.fromkeys(self.lines) if 0 < n <= len(text)]
        super().__init__(
            f"NVRTC could not compile {name}:\n{log.strip()}" + ("\n" + "\n".join(quoted) if quoted else "")
        )


def _load() -> ctypes.CDLL:
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error is not None:
            raise NvrtcUnavailable(_load_error)
        errors: list[str] = []
        for path in library_candidates("nvrtc", _WHEEL_DIRS) + ["libnvrtc.so.13", "libnvrtc.so.12"]:
            if "builtins" in os.path.basename(path) or ".alt." in os.path.basename(path):
                continue
            try:
                _preload_builtins(path)
                lib = ctypes.CDLL(path)
            except OSError as exc:
                errors.append(f"{path}: {exc}")
                continue
            _declare(lib)
            _lib = lib
            return lib
        _load_error = "libnvrtc not found (pip install nvidia-cuda-nvrtc, or dsp-nvrtc[nvrtc]); tried " + "; ".join(
            errors[:4]
        )
        raise NvrtcUnavailable(_load_error)


def _preload_builtins(path: str) -> None:
    """libnvrtc opens libnvrtc-builtins by soname: load the one beside it first, so it is found."""
    folder = os.path.dirname(path)
    if not folder:
        return
    for name in sorted(os.listdir(folder)):
        if name.startswith("libnvrtc-builtins.so") and ".alt." not in name:
            ctypes.CDLL(os.path.join(folder, name), mode=ctypes.RTLD_GLOBAL)
            return


def _declare(lib: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcCreateProgram.argtypes = [
        ctypes.POINTER(p),
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for fn in ("nvrtcGetProgramLogSize", "nvrtcGetPTXSize", "nvrtcGetCUBINSize"):
        getattr(lib, fn).argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    for fn in ("nvrtcGetProgramLog", "nvrtcGetPTX", "nvrtcGetCUBIN"):
        getattr(lib, fn).argtypes = [p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]


def _cupy_nvrtc() -> Any | None:
    """CuPy's own NVRTC binding (a GPU image may have NVRTC only through CuPy), or None."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception:  # noqa: BLE001  (no CuPy, or a broken one)
        return None
    return nvrtc


def _binding() -> tuple[ctypes.CDLL | None, Any]:
    """(libnvrtc, None), or (None, CuPy's NVRTC binding) when only CuPy has NVRTC; NvrtcUnavailable: neither."""
    try:
        return _load(), None
    except NvrtcUnavailable:
        cnv = _cupy_nvrtc()
        if cnv is None:
            raise
        return None, cnv


def available() -> str | None:
    """None when libnvrtc loads (or CuPy's NVRTC does), else why not."""
    try:
        _binding()
    except NvrtcUnavailable as exc:
        return str(exc)
    return None


def version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    lib, cnv = _binding()
    if lib is None:
        major_minor = cnv.getVersion()
        return int(major_minor[0]), int(major_minor[1])
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@dataclass(frozen=True)
class Target:
    """What to compile for: ``compute_XY`` gives PTX (any later GPU), ``sm_XY`` a CUBIN for that GPU."""

    arch: str  # "compute_75", "sm_90"

    @property
    def binary(self) -> str:
        return "cubin" if self.arch.startswith("sm_") else "ptx"


OPTIONS = ("--std=c++17", "-default-device")  # every kernel's; a caller adds --use_fast_math and such


def compile_source(source: str, name: str, target: Target, options: Sequence[str] = ()) -> bytes:
    """``source`` compiled for ``target``: PTX text (NUL-terminated) or CUBIN bytes; NvrtcError on refusal."""
    opts = [f"--gpu-architecture={target.arch}", *OPTIONS, *options]
    lib, cnv = _binding()
    if lib is None:
        return _compile_with_cupy(cnv, source, name, target, opts)
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if status != 0:
            raise NvrtcError(name, _log(lib, prog) or _message(lib, status), source)
        size = ctypes.c_size_t()
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if target.binary == "cubin"
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, buf))
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _compile_with_cupy(cnv: Any, source: str, name: str, target: Target, opts: list[str]) -> bytes:
    prog = cnv.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            cnv.compileProgram(prog, opts)
        except cnv.NVRTCError as exc:
            try:
                log = cnv.getProgramLog(prog)
            except Exception:  # noqa: BLE001
                log = str(exc)
            raise NvrtcError(name, log.decode() if isinstance(log, bytes) else str(log), source) from exc
        out = cnv.getCUBIN(prog) if target.binary == "cubin" else cnv.getPTX(prog)
        data = out if isinstance(out, bytes) else str(out).encode()
        return data if target.binary == "cubin" or data.endswith(b"\0") else data + b"\0"
    finally:
        cnv.destroyProgram(prog)


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def _message(lib: ctypes.CDLL, status: int) -> str:
    got = lib.nvrtcGetErrorString(status)
    return got.decode() if got else f"NVRTC status {status}"


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        raise RuntimeError(_message(lib, status))
