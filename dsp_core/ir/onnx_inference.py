"""ONNX's static shape inference, run where it cannot take DSP down.

ONNX's C++ inference is an optimisation for DSP (it fills value_info with the dtypes and
static shapes it can prove), but on a hostile model it can crash the process (out-of-
range attribute indexes), spin forever, or allocate without bound (a declared dim of
2**63-1 materialised by data propagation). So it runs in a sandbox: a server process forked once
(and again after it dies), under an address-space cap, that receives the model's
*skeleton* (large initializers replaced by typed inputs) over a pipe and answers with
the inferred model; the parent waits at most a timeout and keeps only the value_info. A
sandbox that crashes, hangs or blows its cap is killed and means "no inferred shapes" for
that model: DSP's own shape rules and the run-time shapes still apply. Where ``fork``
does not exist, inference is not run at all.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import select
import signal
import struct
import threading
import time
import warnings

import onnx
from onnx.onnx_cpp2py_export import shape_inference as _cpp_inference

from dsp_core.ir.external_data import declared_bytes

log = logging.getLogger("dsp.import")

_SMALL_INITIALIZER = 4096  # bytes: initializers up to this size stay (data propagation reads them)
_LEN = struct.Struct("<Q")
_MAX_FD = max(os.sysconf("SC_OPEN_MAX"), 256)  # os.closerange closes up to here (close_range(2) where there is one)


def infer(model: onnx.ModelProto, timeout: float, memory_mb: int) -> onnx.ModelProto | None:
    """The model's skeleton with value_info inferred by ONNX, or None when inference failed."""
    if timeout <= 0 or not hasattr(os, "fork"):
        return None
    data = skeleton(model).SerializeToString()
    limit = 64 * len(data) + (16 << 20)  # value_info grows with the node count, never with weights
    started = time.monotonic()
    with _lock:
        out = _ask(data, timeout, memory_mb, limit)
    if out is None:
        return None
    inferred = onnx.ModelProto()
    try:
        inferred.ParseFromString(out)
    except Exception:  # noqa: BLE001  (an unreadable answer is no answer)
        return None
    log.debug("ONNX shape inference took %.3f s in its sandbox", time.monotonic() - started)
    return inferred


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its large initializers: each becomes a typed graph input."""
    skel = onnx.ModelProto()
    skel.ir_version = model.ir_version
    skel.opset_import.extend(model.opset_import)
    src, g = model.graph, skel.graph
    g.name = src.name
    g.node.extend(src.node)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    big = {}
    for t in src.initializer:
        # By its declared size too: an initializer whose bytes were read straight into an
        # array (onnx_scan) is in the proto without them, and must not pass for a small one.
        if t.ByteSize() <= _SMALL_INITIALIZER and (declared_bytes(t) or 0) <= _SMALL_INITIALIZER:
            g.initializer.append(t)
        else:
            big[t.name] = onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
    g.input.extend(big.get(v.name, v) for v in src.input)
    listed = {v.name for v in src.input}
    g.input.extend(info for name, info in big.items() if name not in listed)
    return skel


class _Sandbox:
    """A forked server process that runs ONNX's inference on the skeletons it is sent."""

    def __init__(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb
        self.owner = os.getpid()  # a process forked from the owner must start its own sandbox
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork in a multi-threaded process"
            self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                _close_all_but(req_r, resp_w)
                _serve(req_r, resp_w, memory_mb)
                code = 0
            finally:
                os._exit(code)  # never run the parent's cleanup (atexit, pytest, buffers) here
        os.close(req_r)
        os.close(resp_w)

    def close(self) -> None:
        """Kill the server (when this process started it) and release its pipes."""
        for fd in (self.req_w, self.resp_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.owner != os.getpid():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


_lock = threading.Lock()
_sandbox: _Sandbox | None = None


def _ask(data: bytes, timeout: float, memory_mb: int, limit: int) -> bytes | None:
    """Send one skeleton to the sandbox; its answer, or None (and a fresh sandbox next time)."""
    global _sandbox
    if _sandbox is not None and (_sandbox.memory_mb != memory_mb or _sandbox.owner != os.getpid()):
        _drop()
    if _sandbox is None:
        _sandbox = _Sandbox(memory_mb)
    try:
        _write_all(_sandbox.req_w, _LEN.pack(len(data)) + data)
        answer = _read_answer(_sandbox.resp_r, timeout, limit)
    except OSError:
        answer = None
    if answer is None:
        _drop()
        return None
    ok, payload = answer
    return payload if ok else None


def _drop() -> None:
    global _sandbox
    if _sandbox is not None:
        _sandbox.close()
        _sandbox = None


atexit.register(_drop)


def _close_all_but(*keep: int) -> None:
    """In the forked server: close every descriptor the parent had except stdio and ``keep``.

    A fork holds the parent's descriptors open for as long as it lives: a pipe to one of the
    user's own subprocesses, or a socket, would never see its end while the sandbox kept a copy.
    """
    start = 3
    for fd in sorted(set(keep)):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, _MAX_FD)


def _serve(req_r: int, resp_w: int, memory_mb: int) -> None:
    """The sandbox's loop: read a skeleton, answer (status, inferred model); end at EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    faulthandler.disable()  # a crash here is expected and handled: no stack dump on the parent's stderr
    _cap_address_space(memory_mb)
    while True:
        head = _read_exact(req_r, _LEN.size)
        if head is None:
            return
        (n,) = _LEN.unpack(head)
        data = _read_exact(req_r, n)
        if data is None:
            return
        try:
            answer, status = _cpp_inference.infer_shapes(data, False, False, True), b"\x01"
        except Exception as exc:  # noqa: BLE001  (inference failed: say so, keep serving)
            answer, status = str(exc).encode(errors="replace")[:4096], b"\x00"
        _write_all(resp_w, status + _LEN.pack(len(answer)) + answer)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_answer(fd: int, timeout: float, limit: int) -> tuple[bool, bytes] | None:
    """(ok, payload) from the sandbox, or None when it died, overran ``limit`` or timed out."""
    deadline = time.monotonic() + timeout
    buf = bytearray()
    need = 1 + _LEN.size
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0:
            log.info("ONNX shape inference did not finish within %.1f s; going on without it", timeout)
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, min(need - len(buf), 1 << 20))
        if not chunk:
            return None  # the sandbox died (a crash, its memory cap)
        buf += chunk
        if len(buf) == 1 + _LEN.size:
            (n,) = _LEN.unpack_from(buf, 1)
            if n > limit:
                return None
            need += n
    return buf[0] == 1, bytes(buf[1 + _LEN.size :])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _cap_address_space(memory_mb: int) -> None:
    """Limit this process to its present address space plus ``memory_mb`` (Linux; elsewhere no cap)."""
    try:
        import resource

        with open("/proc/self/status") as fh:
            vm_kb = next(int(line.split()[1]) for line in fh if line.startswith("VmSize:"))
        cap = vm_kb * 1024 + (memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError, StopIteration, ImportError):
        pass
