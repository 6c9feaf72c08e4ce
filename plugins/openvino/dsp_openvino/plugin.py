"""The plugin module named by the entry point: the OPENVINO backend's record, capability and hook.

openvino is imported by the availability probe, not at import time: without it the
backend still registers and lists as unavailable, with the reason.

Capability has two parts. DSP's own table: the dtypes OpenVINO's CPU plugin computes
exactly, the traits a bound-buffer replay cannot hold, and the ONNX ops its frontend
converts (``dsp_openvino.ops.CONVERTS``, written by scripts/openvino_op_table.py, which
probes each op in a child process: a probe can crash the frontend, so none runs here).
Then OpenVINO's own answer: a segment's model, with static shapes, is checked with
``Core.query_model`` before it is compiled; a node the CPU plugin does not take fails
that compile, and the reference runs the segment (the reason is kept in the plan's faults).
"""

from __future__ import annotations

from typing import Any

from dsp_core import config, hookimpl
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
from dsp_openvino.ops import CONVERTS

# DSP's dtype table for this backend. Not float64: the CPU plugin computes it in float32;
# not float16: it computes float16 graphs in float32 and rounds once, which differs from
# ONNX's per-op float16 rounding by more than the tolerance.
DTYPES = frozenset({"float32", "int8", "uint8", "int32", "int64", "bool"})
# Ops worth a call of their own: a segment without one and shorter than MIN_SLOTS costs
# more in OpenVINO's per-call overhead (~13 us) than it saves; the auction is told so.
HEAVY_OPS = frozenset(
    {"MatMul", "Gemm", "MergedMatMul", "Conv", "ConvTranspose", "Attention", "LSTM", "GRU", "RNN", "Einsum"}
    | {"MatMulInteger"}
)
MIN_SLOTS = 8

_core: Any = None


def core() -> Any:
    """The process's one ``openvino.Core`` (made on first use)."""
    global _core
    if _core is None:
        import openvino

        _core = openvino.Core()
    return _core


def compile_config(threads: int | None = None) -> dict[str, Any]:
    """The CPU plugin's settings: DSP's precision and threads (``threads``, else DSP_CPU_THREADS; 0: the
    plugin's default), latency-first, one stream, DSP's cache."""
    from dsp_core.backends.whole import cpu_threads, runtime_cache_dir

    precision = "bf16" if config.get("cpu_precision") == "bf16" and OpenVinoBackend.allows_bf16 else "f32"
    settings: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": precision,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }
    if threads is None:
        threads = cpu_threads()
    if threads > 0:
        settings["INFERENCE_NUM_THREADS"] = threads
    folder = runtime_cache_dir("openvino")
    if folder is not None:
        settings["CACHE_DIR"] = str(folder)
    return settings


class OpenVinoBackend(Backend):
    """A segment = one compiled OpenVINO model; its tensors are DSP's buffers; replay = infer()."""

    name = "openvino"
    mode = GraphExecutionMode.OPENVINO
    platform = "cpu"
    threads_variants = True  # its segments run on Segment.threads: the auction times a short one at fewer
    captures = True
    contract = ModeContract(
        deterministic=True,  # one stream, fixed threads: same inputs, same outputs
        needs_stable_addresses=True,  # tensors are made once over DSP's buffers
        can_update_in_place=True,  # a moved input gets a new tensor, not a recompile
        tf32=False,
        dtypes=DTYPES,
        tolerance=1e-4,  # f32 inference; fused kernels reassociate sums
    )
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=frozenset())
    # bf16 execution (DSP_CPU_PRECISION=bf16) changes results by ~1e-2: more than the
    # contract's tolerance, so this backend keeps f32 whatever the option says.
    allows_bf16 = contract.tolerance >= 1e-2

    def _availability_probe(self) -> Availability:
        try:
            import openvino
        except ImportError as exc:
            return Availability.no(f"openvino is not installed ({exc}): pip install 'openvino>=2025.0,<2027'")
        if "CPU" not in core().available_devices:
            return Availability.no(f"openvino {openvino.__version__} sees no CPU device")
        return Availability.yes()

    def _supports(self, slot: SlotView) -> Decline | None:
        slot = written_view(slot)  # a merged product as its MatMul/Gemm, a KV store as ScatterElements
        common = common_decline(self, slot)
        if common is not None:
            return common
        if slot.op not in CONVERTS:
            detail = f"OpenVINO's ONNX frontend has no conversion rule for {slot.op}"
            return Decline(DeclineReason.UNSUPPORTED_OP, detail)
        return None

    def segment_decline(self, segment: Segment, plan: Plan) -> Decline | None:
        """Declines a short segment without a heavy op: the call overhead exceeds what it saves."""
        if len(segment.slots) >= MIN_SLOTS or any(plan.slots[s].op in HEAVY_OPS for s in segment.slots):
            return None
        return Decline(
            DeclineReason.OTHER,
            f"a segment of {len(segment.slots)} light slots costs more in OpenVINO's call overhead "
            f"(~13 us) than it saves (it takes segments of >= {MIN_SLOTS} slots or with a "
            f"{'/'.join(sorted(HEAVY_OPS)[:3])}/... op)",
        )

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_openvino.segment import OpenVinoSegment

        return OpenVinoSegment(self, plan, segment)


@hookimpl
def dsp_register_backends() -> list[Any]:
    """dsp-openvino's backend."""
    return [OpenVinoBackend()]
