"""NVRTC_JIT and PTX_JIT segments: the CUDA_GRAPHS segment with some steps swapped for own kernels.

Everything else is dsp-cuda-graphs' runtime layer, reused as it is: device buffers and
staging, the owned cuBLAS binding for products, the traced and planned allocators, the
capture lock and the replay. An NVRTC_JIT segment replaces each fusion group's slots with
one ``NvrtcGroup`` step (built on the first eager run, outside any capture), its kernel from
the segment cache or NVRTC. A PTX_JIT segment is the same, its kernels' PTX from the PTX
bundle (a group whose PTX is not there runs its reference kernels), and runs the
LayerNormalization and Softmax slots outside its groups on the committed PTX.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from dsp_cpu_ref.slot_by_slot import run_order
from dsp_cuda_graphs import fusion
from dsp_cuda_graphs.fusion import GroupReport, GroupStep, Step, fused_steps
from dsp_cuda_graphs.greedy import greedy_pick
from dsp_cuda_graphs.segment import CudaGraphSegment

from dsp_core.errors import KernelError
from dsp_core.plan.fusion import Group, propose_groups
from dsp_core.plan.kernelspec import node_specs
from dsp_core.plan.plan import Plan, Segment
from dsp_nvrtc import codegen, rowwise
from dsp_nvrtc.kernels import KernelSource, NvrtcGreedyPick, NvrtcGroup, NvrtcKVStore, NvrtcSource, PtxSource

# the templates with a CUDA C kernel
FUSED_TEMPLATES = frozenset({"pointwise", "row_reduction", "copy", "product", "decode_attention"})
GENERATED = FUSED_TEMPLATES | {"store"}  # and the KV store's kernel (NvrtcKVStore)
MAX_CONSTANT_ELEMENTS = 4096  # constant inputs read on the host by the generator (slice bounds, exponents)


def unfused_reason(plan: Plan, group: Group) -> str | None:
    """Why a group runs its reference kernels rather than a generated one (None: it is generated)."""
    return fusion.unfused_reason(plan, group, GENERATED, codegen.VIEW_ON_CUPY)


class NvrtcSegment(CudaGraphSegment):
    """One segment (or island) on the GPU with a generated CUDA C kernel per fusion group."""

    def __init__(
        self,
        backend: Any,
        plan: Plan,
        segment: Segment,
        tf32: bool,
        tolerance: float,
        source: KernelSource | None = None,
    ) -> None:
        super().__init__(backend, plan, segment, tf32)
        self._tolerance = tolerance
        self.groups: list[GroupStep] = []  # fusion groups (NvrtcGroup) and greedy picks (NvrtcGreedyPick)
        self.reports: list[GroupReport] = []
        self._step_slots: list[tuple[int, ...]] = []
        self._source: KernelSource = source if source is not None else NvrtcSource()

    def _fuse(self, st: dict[str, Any], bound: list[Any]) -> list[Any]:
        plan, seg = self._plan, self.segment
        order = run_order(seg)
        self._step_slots = [(s,) for s in order]
        if not seg.groups:
            return bound
        result = propose_groups(plan, seg.slots, self.backend.fusion_policy())
        if result.slot_groups() != seg.groups:
            return bound  # grouped by another policy: run as bound (still correct)

        def make(g: Group, mine: list[Step], ins: tuple[int, ...], outs: tuple[int, ...]) -> GroupStep | None:
            report = GroupReport(g.index, g.template, g.slots)
            self.reports.append(report)
            pick = greedy_pick(plan.slots[g.slots[0]]) if len(g.slots) == 1 else None
            if pick is not None and tuple(mine[0][1]) == ins:
                report.template = "greedy_pick"
                greedy = NvrtcGreedyPick(
                    report, mine, ins, outs, pick, st["cupy"], lambda: self._capturing, self._source
                )
                self.groups.append(greedy)
                return greedy
            why = unfused_reason(plan, g)
            if why is not None:
                report.status, report.reason = "reference", why
                return None
            nodes = node_specs(plan, g.slots)
            step: GroupStep
            if g.template == "store":
                step = NvrtcKVStore(
                    report, mine, ins, outs, nodes[0], st["cupy"], lambda: self._capturing, self._source
                )
            else:
                step = NvrtcGroup(
                    report,
                    mine,
                    ins,
                    outs,
                    nodes,
                    self._constant,
                    st["cupy"],
                    lambda: self._capturing,
                    self._tolerance,
                    self._source,
                    fixed=lambda flat: flat not in self._tainted,
                )
            self.groups.append(step)
            return step

        steps, self._step_slots = fused_steps(plan, bound, order, result, make)
        return steps

    def _constant(self, flat: int, value: Any) -> np.ndarray | None:
        """A host copy of a small input that does not change between steps (None: it does, or it is big)."""
        if flat in self._tainted or value is None or getattr(value, "size", MAX_CONSTANT_ELEMENTS + 1) > 4096:
            return None
        return np.asarray(value) if isinstance(value, np.ndarray | np.generic) else self._cp.asnumpy(value)

    def _line_slots(self) -> list[tuple[int, ...]]:
        return self._step_slots or super()._line_slots()

    def _error(self, exc: Exception) -> KernelError:
        slots = self._failing_line(exc) or self._line_slots()[0]
        slot = self._plan.slots[slots[0]]
        what = f'{slot.op} node "{slot.name}" (slot {slot.index})'
        if len(slots) > 1:
            what = f"fusion group of slots {list(slots)} starting at {what}"
        return KernelError(f"{what} failed on CUDA ({self._source.backend_name}): {type(exc).__name__}: {exc}")

    # -- the first runs compile: say so on stderr (dsp_core.progress) ---------------------
    def run(self, values: list[Any]) -> None:
        with self._compiling():
            super().run(values)

    def _warm(self, values: list[Any]) -> None:
        with self._compiling():
            super()._warm(values)

    def _compiling(self) -> Any:
        self._ensure()
        pending = [g for g in self.groups if g.report.status == "pending"]
        if not pending:
            return contextlib.nullcontext()
        name, verb = ("ptx", "load") if isinstance(self._source, PtxSource) else ("nvrtc", "compile")
        return fusion.BuildProgress(pending, f"{name}: generate, {verb} and check {len(pending)} fused kernels")

    def fusion_report(self) -> list[dict[str, Any]]:
        """Per group: its CUDA C kernel, or why it runs its reference kernels."""
        return [r.as_dict() for r in self.reports]


class PtxSegment(NvrtcSegment):
    """An NVRTC_JIT segment whose kernels come from the PTX bundle; LayerNormalization and Softmax
    slots outside its fused groups run the committed PTX kernels."""

    def __init__(self, backend: Any, plan: Plan, segment: Segment, tf32: bool, tolerance: float) -> None:
        super().__init__(backend, plan, segment, tf32, tolerance, PtxSource())

    def _slot_kernel(self, st: dict[str, Any], slot: Any, kernel: Any) -> Any:
        if slot.domain not in ("", "ai.onnx"):
            return kernel
        if slot.op == "LayerNormalization":
            only_y = slot.outputs[0] is not None and all(v is None for v in slot.outputs[1:])
            return rowwise.layer_norm_kernel(st, kernel, 1 if only_y else len(slot.outputs), **slot.attrs)
        if slot.op == "Softmax":
            return rowwise.softmax_kernel(st, kernel, slot.opset, **slot.attrs)
        return kernel
