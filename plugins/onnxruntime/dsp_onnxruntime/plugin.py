"""The plugin module named by the entry point: the ONNXRUNTIME backend's record, capability and hook.

onnxruntime is imported by the availability probe, not at import time: without it the
backend still registers and lists as unavailable, with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

from dsp_core import hookimpl
from dsp_core.backends.base import (
    Availability,
    Backend,
    CaptureProfile,
    CompiledSegment,
    Decline,
    DeclineReason,
    ModeContract,
    SlotView,
)
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.backends.whole import common_decline, written_view
from dsp_core.ops.llm import is_kv_store
from dsp_core.plan.plan import Plan, Segment

log = logging.getLogger(__name__)

# DSP's dtype table for this backend: what its CPU kernels compute and IOBinding binds.
# Not float16: the CPU provider has few float16 kernels (no Add, Mul, ...).
DTYPES = frozenset({"float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"})
_ONNX_TYPE = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "int8": "tensor(int8)",
    "uint8": "tensor(uint8)",
    "int16": "tensor(int16)",
    "int32": "tensor(int32)",
    "int64": "tensor(int64)",
    "bool": "tensor(bool)",
}
PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
_SHORT = {PROVIDER: "CPU", CUDA_PROVIDER: "CUDA"}
# The CUDA provider computes float16 and bfloat16 as well (the CPU provider has few such kernels).
CUDA_DTYPES = DTYPES | {"float16", "bfloat16"}
_ONNX_TYPE.update({"float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"})
# Domains of ops it takes: ONNX's, and ONNX Runtime's own contrib ops.
DOMAINS = frozenset({"", "com.microsoft"})


Table = dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]]
TABLE_FORMAT = 1  # the layout of the kernel table's file


@functools.lru_cache(maxsize=2)
def kernel_table(provider: str = PROVIDER) -> Table:
    """(op, domain) -> [(first opset, last opset, tensor types)] of ``provider``'s kernels.

    Asking ONNX Runtime costs its import and a walk of every kernel definition (about 55 ms,
    paid by every process that discovers the backends, even where AUTO leaves this one out),
    so the table is kept under DSP's cache directory per installed onnxruntime version. A
    file that does not read back whole is made again.
    """
    path = _table_file(provider)
    if path is not None:
        got = _read_table(path)
        if got is not None:
            return got
    table = _table_from_onnxruntime(provider)
    if path is not None:
        _write_table(path, table)
    return table


def kernel_rows() -> list[list[Any]]:
    """Every kernel definition of the installed onnxruntime: [provider, op, domain, first, last, [types]]."""
    from onnxruntime.capi import _pybind_state as C

    return [
        [
            k.provider,
            k.op_name,
            k.domain,
            *k.version_range,
            sorted({t for ts in k.type_constraints.values() for t in ts}),
        ]
        for k in C.get_all_opkernel_def()
    ]


# What a child process runs to list them (see _table_from_onnxruntime).
_KERNELS_AS_JSON = "import json; from dsp_onnxruntime.plugin import kernel_rows; print(json.dumps(kernel_rows()))"


def _table_from_onnxruntime(provider: str = PROVIDER) -> Table:
    """``provider``'s kernel table, from ONNX Runtime's kernel definitions.

    A build with providers beyond the CPU's (onnxruntime-gpu) is asked in a child process:
    onnxruntime-gpu 1.31's ``get_all_opkernel_def`` loads every provider it was built with and
    crashes the process (SIGSEGV, after "Failed to load library ...tensorrt.so") where TensorRT
    is not installed, the usual case. Where the child dies, the table is the ops' schemas
    (``_schema_table``): no dtype is declined, and a node neither provider can run fails the
    session's creation, which the core meets as a fault of this backend (the next one runs it).
    """
    import onnxruntime

    rows: list[Any] | None
    if set(onnxruntime.get_available_providers()) <= {PROVIDER}:
        rows = kernel_rows()
    else:
        rows = _rows_in_a_child()
        if rows is None:
            return _schema_table()
    table: Table = {}
    for prov, op, domain, lo, hi, types in rows:
        if prov != provider:
            continue
        key = (str(op), "" if domain == "ai.onnx" else str(domain))
        table.setdefault(key, []).append((int(lo), int(hi), frozenset(map(str, types))))
    return table


def _rows_in_a_child() -> list[Any] | None:
    """The kernel rows as a child process prints them; None where it fails (see above)."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", _KERNELS_AS_JSON], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode == 0:
            return list(json.loads(done.stdout.strip().splitlines()[-1]))
        log.info(
            "DSP onnxruntime: listing the kernels failed (exit %s: %s); the ops' schemas stand in",
            done.returncode,
            done.stderr.strip()[-300:],
        )
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        log.info("DSP onnxruntime: listing the kernels failed (%s); the ops' schemas stand in", exc)
    return None


def _schema_table() -> Table:
    """Every op ONNX Runtime has a schema for (ONNX's and its contrib ops), each version of it up
    to the next, with no dtype constraint: what stands in where the kernels cannot be listed."""
    from onnxruntime.capi import _pybind_state as C

    versions: dict[tuple[str, str], set[int]] = {}
    for schema in C.get_all_operator_schema():
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        versions.setdefault((schema.name, domain), set()).add(int(schema.since_version))
    table: Table = {}
    for key, since in versions.items():
        starts = sorted(since)
        ends = [s - 1 for s in starts[1:]] + [2**31 - 1]
        table[key] = [(lo, hi, frozenset()) for lo, hi in zip(starts, ends)]
    return table


def kernels_at(ops: set[str], opset: int, provider: str = PROVIDER) -> bool:
    """True when ``provider`` has a kernel of each ONNX op of ``ops`` at ``opset``."""
    table = kernel_table(provider)
    return all(any(lo <= opset <= hi for lo, hi, _ in table.get((op, ""), ())) for op in ops)


def _installed_version() -> str | None:
    """The installed onnxruntime distribution's version: the GPU build's where it is installed (it
    provides the same module and is meant to replace the CPU build), else the CPU build's."""
    for dist in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _table_file(provider: str = PROVIDER) -> Path | None:
    """Where the table of the installed onnxruntime is kept; None without a disk cache or a version."""
    from dsp_core import config
    from dsp_core.cache.disk import default_cache_dir

    if not config.get("disk_cache"):
        return None
    version = _installed_version()
    if version is None:
        return None  # a build without its metadata: ask it every time
    root = config.get("cache_dir")
    base = Path(root).expanduser() if root else default_cache_dir(os.environ)
    safe = "".join(c if c.isalnum() or c in ".-_+" else "_" for c in version)
    return base / "onnxruntime" / f"kernels-{safe}-{provider}.json"


def _read_table(path: Path) -> Table | None:
    try:
        doc = json.loads(path.read_bytes())
        if doc.get("format") != TABLE_FORMAT:
            return None
        table: Table = {}
        for op, domain, lo, hi, types in doc["kernels"]:
            table.setdefault((str(op), str(domain)), []).append((int(lo), int(hi), frozenset(map(str, types))))
        return table  # empty for a provider the installed build lacks (the CPU build's CUDA table)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent or damaged: asked again and written anew


def _write_table(path: Path, table: Table) -> None:
    from dsp_core.cache.disk import atomic_write

    rows = [[op, domain, lo, hi, sorted(types)] for (op, domain), ks in table.items() for lo, hi, types in ks]
    try:
        atomic_write(path, json.dumps({"format": TABLE_FORMAT, "kernels": rows}).encode())
    except OSError as exc:
        log.debug("DSP onnxruntime: cannot keep the kernel table at %s (%s)", path, exc)


class OnnxRuntimeBackend(Backend):
    """A segment = one InferenceSession over the segment's ONNX model, replayed through IOBinding."""

    name = "onnxruntime"
    mode = GraphExecutionMode.ONNXRUNTIME
    platform = "cpu"
    threads_variants = True  # its segments run on Segment.threads: the auction times a short one at fewer
    captures = True
    contract = ModeContract(
        deterministic=True,  # the CPU provider with fixed threads: same inputs, same outputs
        needs_stable_addresses=True,  # IOBinding binds buffer addresses once
        can_update_in_place=True,  # a moved input is re-bound, not recompiled
        tf32=False,
        dtypes=DTYPES,
        tolerance=1e-4,  # fused kernels (Gelu, LayerNorm, attention) reassociate float32 sums
    )
    # One island per segment: the whole segment is one session (no node limit).
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=frozenset())

    def _availability_probe(self) -> Availability:
        try:
            import onnxruntime
        except ImportError as exc:
            return Availability.no(f"onnxruntime is not installed ({exc}): pip install 'onnxruntime>=1.20,<1.33'")
        if PROVIDER not in onnxruntime.get_available_providers():
            return Availability.no(f"onnxruntime {onnxruntime.__version__} has no {PROVIDER}")
        return Availability.yes()

    def _supports(self, slot: SlotView) -> Decline | None:
        slot = written_view(slot)  # a merged product as its MatMul/Gemm, a KV store as ScatterElements
        common = common_decline(self, slot, DOMAINS)
        if common is not None:
            return common
        return _kernel_decline(slot, slot.opset)

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_onnxruntime.segment import OnnxRuntimeSegment

        return OnnxRuntimeSegment(self, plan, segment)


def _kernel_decline(slot: SlotView, opset: int, providers: tuple[str, ...] = (PROVIDER,)) -> Decline | None:
    """A decline unless one of ``providers`` registers a kernel for the op, its opset and the slot's
    dtypes (a session places each node on the first provider that has its kernel)."""
    where = " or ".join(_SHORT.get(p, p) for p in providers)
    kernels = [k for p in providers for k in kernel_table(p).get((slot.op, slot.domain), ())]
    if not kernels:
        return Decline(DeclineReason.UNSUPPORTED_OP, f"ONNX Runtime's {where} provider has no {slot.op} kernel")
    if opset:
        kernels = [k for k in kernels if k[0] <= opset <= k[1]]
        if not kernels:
            detail = f"ONNX Runtime's {where} provider has no {slot.op} kernel for opset {opset}"
            return Decline(DeclineReason.UNSUPPORTED_OP, detail)
    types: set[str] = set()
    for _, _, ts in kernels:
        types |= ts
    # A kernel's type constraints list its type parameters only (Where's bool condition is
    # fixed, not listed): the slot is declined when none of its dtypes is among them.
    used = {_ONNX_TYPE.get(d, d) for d in slot.input_dtypes + slot.output_dtypes if d is not None}
    if types and used and not used & types:
        return Decline(
            DeclineReason.UNSUPPORTED_DTYPE, f"ONNX Runtime's {slot.op} kernels do not take {', '.join(sorted(used))}"
        )
    return None


class OnnxRuntimeCudaBackend(OnnxRuntimeBackend):
    """The same pattern on ONNX Runtime's CUDA provider (onnxruntime-gpu): a segment is one session
    whose nodes run on the GPU, its inputs and outputs bound once to CuPy device buffers.

    Mode ONNXRUNTIME, platform ``cuda``: ``mode="onnxruntime"`` on a machine where this backend is
    available runs on it (it is listed before the CPU one); AUTO's CUDA chain leaves it out (its
    own backends fuse and capture). Nodes the CUDA provider has no kernel for run on ONNX Runtime's
    CPU provider inside the same session, as ONNX Runtime places them.
    """

    name = "onnxruntime-cuda"
    platform = "cuda"
    threads_variants = False  # the CUDA provider: threads are not what its call costs
    contract = ModeContract(
        deterministic=True,  # sessions use ONNX Runtime's deterministic compute (cuDNN's deterministic algorithms)
        needs_stable_addresses=True,
        can_update_in_place=True,
        tf32=False,  # the provider's use_tf32 is turned off: float32 products stay float32
        dtypes=CUDA_DTYPES,
        tolerance=1e-4,
    )

    def _availability_probe(self) -> Availability:
        try:
            import cupy
        except ImportError:
            return Availability.no("cupy is not installed (its buffers are CuPy arrays): pip install cupy-cuda13x")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return Availability.no("CuPy sees no CUDA device")
        except Exception as exc:  # noqa: BLE001  (no cupy, no driver, no device: all mean "no GPU here")
            return Availability.no(f"no CUDA device through CuPy ({type(exc).__name__}: {exc})")
        try:
            import onnxruntime
        except ImportError as exc:
            return Availability.no(f"onnxruntime is not installed ({exc}): pip install onnxruntime-gpu")
        if CUDA_PROVIDER not in onnxruntime.get_available_providers():
            return Availability.no(
                f"onnxruntime {onnxruntime.__version__} is the CPU build (no {CUDA_PROVIDER}): "
                "pip uninstall onnxruntime && pip install onnxruntime-gpu (the build for this machine's CUDA)"
            )
        from dsp_onnxruntime.segment import cuda_probe

        problem = cuda_probe()
        return Availability.no(problem) if problem else Availability.yes()

    def _supports(self, slot: SlotView) -> Decline | None:
        if is_kv_store(slot):
            # The KV store writes a DSP buffer in place after the runtime's call; on the device that
            # is the GPU backends' kernel (or the reference's), not a session's.
            return Decline(DeclineReason.UNSUPPORTED_OP, "a KV store runs outside ONNX Runtime's CUDA session")
        slot = written_view(slot)
        common = common_decline(self, slot, DOMAINS)
        if common is not None:
            return common
        return _kernel_decline(slot, slot.opset, (CUDA_PROVIDER, PROVIDER))

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_onnxruntime.segment import OnnxRuntimeCudaSegment

        return OnnxRuntimeCudaSegment(self, plan, segment)

    # Fed arrays that only this backend's segments read are staged on the device by the core.
    def stage_buffer(self, value: Any) -> Any | None:
        """A device buffer for a fed array this backend's segments read."""
        import cupy

        return cupy.empty(value.shape, dtype=value.dtype)

    def stage_into(self, buffer: Any, value: Any) -> None:
        """Copy a fed array (host or device) into its device buffer."""
        import numpy as np

        if isinstance(value, np.ndarray):
            buffer.set(np.ascontiguousarray(value))
        else:
            buffer[...] = value


@hookimpl
def dsp_register_backends() -> list[Any]:
    """dsp-onnxruntime's backends: the CUDA provider's first, so ``mode="onnxruntime"`` takes the GPU
    where it is there (unavailable, with its reason, everywhere else), then the CPU provider's."""
    return [OnnxRuntimeCudaBackend(), OnnxRuntimeBackend()]
