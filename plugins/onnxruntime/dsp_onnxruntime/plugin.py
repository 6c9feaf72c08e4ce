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
# Domains of ops it takes: ONNX's, and ONNX Runtime's own contrib ops.
DOMAINS = frozenset({"", "com.microsoft"})


Table = dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]]
TABLE_FORMAT = 1  # the layout of the kernel table's file


@functools.lru_cache(maxsize=1)
def kernel_table() -> Table:
    """(op, domain) -> [(first opset, last opset, tensor types)] of the CPU provider's kernels.

    Asking ONNX Runtime costs its import and a walk of every kernel definition (about 55 ms,
    paid by every process that discovers the backends, even where AUTO leaves this one out),
    so the table is kept under DSP's cache directory per installed onnxruntime version. A
    file that does not read back whole is made again.
    """
    path = _table_file()
    if path is not None:
        got = _read_table(path)
        if got is not None:
            return got
    table = _table_from_onnxruntime()
    if path is not None:
        _write_table(path, table)
    return table


def _table_from_onnxruntime() -> Table:
    from onnxruntime.capi import _pybind_state as C

    table: Table = {}
    for k in C.get_all_opkernel_def():
        if k.provider != PROVIDER:
            continue
        domain = "" if k.domain == "ai.onnx" else k.domain
        types = frozenset(t for ts in k.type_constraints.values() for t in ts)
        lo, hi = k.version_range
        table.setdefault((k.op_name, domain), []).append((int(lo), int(hi), types))
    return table


def _table_file() -> Path | None:
    """Where the table of the installed onnxruntime is kept; None without a disk cache or a version."""
    from dsp_core import config
    from dsp_core.cache.disk import default_cache_dir

    if not config.get("disk_cache"):
        return None
    try:
        version = importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        return None  # a build without its metadata: ask it every time
    root = config.get("cache_dir")
    base = Path(root).expanduser() if root else default_cache_dir(os.environ)
    safe = "".join(c if c.isalnum() or c in ".-_+" else "_" for c in version)
    return base / "onnxruntime" / f"kernels-{safe}-{PROVIDER}.json"


def _read_table(path: Path) -> Table | None:
    try:
        doc = json.loads(path.read_bytes())
        if doc.get("format") != TABLE_FORMAT:
            return None
        table: Table = {}
        for op, domain, lo, hi, types in doc["kernels"]:
            table.setdefault((str(op), str(domain)), []).append((int(lo), int(hi), frozenset(map(str, types))))
        return table if table else None
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


def _kernel_decline(slot: SlotView, opset: int) -> Decline | None:
    """A decline unless the CPU provider registers a kernel for the op, its opset and the slot's dtypes."""
    kernels = kernel_table().get((slot.op, slot.domain))
    if not kernels:
        return Decline(DeclineReason.UNSUPPORTED_OP, f"ONNX Runtime's CPU provider has no {slot.op} kernel")
    if opset:
        kernels = [k for k in kernels if k[0] <= opset <= k[1]]
        if not kernels:
            return Decline(
                DeclineReason.UNSUPPORTED_OP, f"ONNX Runtime's CPU provider has no {slot.op} kernel for opset {opset}"
            )
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


@hookimpl
def dsp_register_backends() -> list[Any]:
    """dsp-onnxruntime's backend."""
    return [OnnxRuntimeBackend()]
