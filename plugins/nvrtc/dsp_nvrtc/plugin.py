"""The plugin module named by the entry point: NVRTC_JIT and PTX_JIT, their contracts, profiles, policy."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dsp_cuda_graphs import device
from dsp_cuda_graphs.plugin import DTYPES, HOST_READING_OPS, CudaGraphsBackend

from dsp_core import config, hookimpl
from dsp_core.backends.base import Availability, Backend, CaptureProfile, CompiledSegment, ModeContract
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.plan.fusion import VIEW_OPS, FusionLimits, Group, GroupView, PatternKind, ReferencePolicy, SlotPattern
from dsp_core.plan.plan import Plan, Segment
from dsp_nvrtc import codegen, compiler

# Fused kernels accumulate reductions in fp32 (the reference rounds a half row's sum per
# op): half-precision results differ by an ulp or two of the reference's rounding.
TOLERANCE = 5e-3


def _contract(tolerance: float) -> ModeContract:
    tf32 = bool(config.get("cublas_tf32"))
    return ModeContract(
        deterministic=not tf32,  # no atomics in the kernels; cuBLAS with fixed algorithms
        needs_stable_addresses=True,  # a graph bakes every buffer address in
        can_update_in_place=True,
        tf32=tf32,
        dtypes=DTYPES,
        tolerance=max(tolerance, 1e-2 if tf32 else 0.0),
    )


class NvrtcPolicy(ReferencePolicy):
    """The reference templates (pointwise, row reduction, copy), limited to the ops the generator takes."""

    name = "nvrtc"
    limits = FusionLimits(max_nodes=64, max_inputs=16)

    def __init__(self) -> None:
        self._ops: dict[int, str] = {}

    def seed(self, plan: Plan, s: int, pattern: SlotPattern) -> str:
        template = super().seed(plan, s, pattern)
        if template in ("pointwise", "row_reduction", "copy") and not _generated(plan, s):
            return "opaque"  # no template generates it: alone, on the reference kernels
        return template

    def merge_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        if pattern.kind not in (PatternKind.MATMUL, PatternKind.ATTENTION, PatternKind.OPAQUE) and not _generated(
            plan, s
        ):
            return f"{plan.slots[s].op} has no CUDA C template (dsp-nvrtc generates {len(codegen.SUPPORTED_OPS)} ops)"
        self._ops[s] = plan.slots[s].op
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            return None  # a transpose, slice, concat or gather of a pointwise group's values: index arithmetic
        return super().merge_ok(plan, group, s, pattern)

    def joined(self, group: GroupView, s: int, pattern: SlotPattern) -> str:
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            return group.template if self._ops.get(s) in VIEW_OPS else "copy"
        return super().joined(group, s, pattern)

    def kernels(self, plan: Plan, template: str, slots: Sequence[int]) -> int:
        if template == "view" or all(plan.slots[s].op in codegen.VIEW_ON_CUPY for s in slots):
            return 0  # views on the reference kernels
        return 1

    def unfused(self, plan: Plan, group: Group) -> str | None:
        from dsp_nvrtc.segment import unfused_reason

        return unfused_reason(plan, group)


def _generated(plan: Plan, s: int) -> bool:
    slot = plan.slots[s]
    return slot.domain in ("", "ai.onnx") and slot.op in codegen.SUPPORTED_OPS


def nvrtc_probe() -> str | None:
    """Why NVRTC_JIT cannot run here (None: it can): no CUDA device or driver, or no NVRTC."""
    reason = device.probe()
    if reason is not None:
        return reason
    return compiler.available()


class NvrtcBackend(CudaGraphsBackend):
    """CUDA_GRAPHS' runtime layer with each fusion group run as one generated CUDA C kernel."""

    name = "nvrtc_jit"
    mode = GraphExecutionMode.NVRTC_JIT
    platform = "cuda"
    captures = True
    contract = _contract(TOLERANCE)
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)
    _policy = NvrtcPolicy()

    def _availability_probe(self) -> Availability:
        reason = nvrtc_probe()
        return Availability.yes() if reason is None else Availability.no(reason)

    def fusion_policy(self) -> NvrtcPolicy:
        return self._policy

    def cost(self, segment: Segment, plan: Plan) -> float:
        return float(math.ceil(len(segment.slots) / 2))  # fused: fewer launches than CUDA_GRAPHS

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_nvrtc.segment import NvrtcSegment

        return NvrtcSegment(self, plan, segment, self.contract.tf32, self.contract.tolerance)


class PtxBackend(CudaGraphsBackend):
    """CUDA_GRAPHS with LayerNormalization and Softmax on PTX committed with the plugin (no NVRTC needed)."""

    name = "ptx_jit"
    mode = GraphExecutionMode.PTX_JIT
    platform = "cuda"
    captures = True
    contract = _contract(2e-3)
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)

    def _availability_probe(self) -> Availability:
        from dsp_nvrtc import rowwise

        reason = device.probe()
        if reason is None and not rowwise.PTX.is_file():
            reason = f"the plugin's PTX is missing ({rowwise.PTX}): reinstall dsp-nvrtc"
        return Availability.yes() if reason is None else Availability.no(reason)

    def cost(self, segment: Segment, plan: Plan) -> float:
        return float(len(segment.slots)) * 0.9  # a few ops in one kernel each, the rest as CUDA_GRAPHS

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_nvrtc.segment import PtxSegment

        return PtxSegment(self, plan, segment, self.contract.tf32)


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """dsp-nvrtc's two backends."""
    return [NvrtcBackend(), PtxBackend()]
