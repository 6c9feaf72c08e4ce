"""A TRITON segment: the CUDA_GRAPHS segment with each fusion group run as one generated kernel.

Everything else is dsp-cuda-graphs' runtime layer, reused as it is: device buffers and
staging, the owned cuBLAS binding for products (they are gaps of the fusion, launched in
the same captured graph), the traced and planned allocators, the capture lock and the
replay. The one difference is the steps the segment's code is generated from: a group's
slots are replaced by one ``FusedGroup`` step (kernels.py), which compiles, tunes and
checks its Triton kernel on the first eager run and launches it from then on; warm-up,
capture and replay see one kernel per group.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from dsp_cpu_ref.slot_by_slot import run_order
from dsp_cuda_graphs import device
from dsp_cuda_graphs.fusion import BuildProgress
from dsp_cuda_graphs.greedy import greedy_pick
from dsp_cuda_graphs.segment import CudaGraphSegment

from dsp_core.errors import KernelError
from dsp_core.plan.fusion import propose_groups
from dsp_core.plan.kernelspec import node_specs
from dsp_core.plan.plan import Plan, Segment
from dsp_triton import codegen
from dsp_triton.codegen import VIEW_ON_CUPY
from dsp_triton.kernels import FusedGroup, GreedyPick, GroupReport, KVStore

# Templates that have a Triton kernel; "view" groups cost no kernel, the rest run alone.
FUSED_TEMPLATES = frozenset({"pointwise", "row_reduction", "copy", "product", "decode_attention", "conv"})
MAX_CONSTANT_ELEMENTS = 4096  # constant inputs read on the host by the generator (slice bounds, exponents)


def unfused_reason(plan: Plan, group: Any) -> str | None:
    """Why a group runs its reference kernels rather than a generated one (None: it is generated)."""
    if group.template not in FUSED_TEMPLATES:
        return f"a {group.template} group runs alone"
    if not group.outputs:
        return "nothing it computes is read"
    if group.template == "conv" and len(group.slots) == 1:
        return "a convolution with no pointwise op after it in its group: cuDNN adds its bias"
    if all(plan.slots[s].op in VIEW_ON_CUPY for s in group.slots):
        ops = "+".join(dict.fromkeys(plan.slots[s].op for s in group.slots))
        # Its readers (generated kernels, products, the KV store) read a view by its strides;
        # where CuPy cannot make one (a reshape of a broadcast) it copies, one kernel as ours.
        return f"{ops} only: views on the reference kernels, no kernel to save"
    return None


class TritonSegment(CudaGraphSegment):
    """One segment (or island) on the GPU with fused Triton kernels for its groups."""

    def __init__(self, backend: Any, plan: Plan, segment: Segment, tf32: bool, tolerance: float) -> None:
        super().__init__(backend, plan, segment, tf32)
        self._tolerance = tolerance
        self.groups: list[FusedGroup] = []
        self.kv_stores: list[KVStore] = []
        self.picks: list[GreedyPick] = []
        self.reports: list[GroupReport] = []
        self._step_slots: list[tuple[int, ...]] = []

    def _fuse(self, st: dict[str, Any], bound: list[Any]) -> list[Any]:
        plan, seg = self._plan, self.segment
        order = run_order(seg)
        self._step_slots = [(s,) for s in order]
        if not seg.groups:
            return bound
        policy = self.backend.fusion_policy()
        result = propose_groups(plan, seg.slots, policy)
        if result.slot_groups() != seg.groups:
            return bound  # grouped by another policy: run as bound (still correct)
        step_of = dict(zip(order, bound))
        steps: list[Any] = []
        step_slots: list[tuple[int, ...]] = []
        for g in result.groups:
            mine = [step_of[s] for s in g.slots]
            report = GroupReport(g.index, g.template, g.slots)
            self.reports.append(report)
            first = plan.slots[g.slots[0]]
            if len(g.slots) == 1 and first.domain == "dsp" and first.op == "KVScatter":
                kernel, step_ins, step_outs, step_rel = mine[0]
                report.template = "kv_store"
                store = KVStore(report, kernel, int(first.attrs.get("axis", -2)), st["cupy"], lambda: self._capturing)
                self.kv_stores.append(store)
                steps.append((store, step_ins, step_outs, step_rel))
                step_slots.append(g.slots)
                continue
            pick = greedy_pick(first) if len(g.slots) == 1 else None
            if pick is not None:
                kernel, step_ins, step_outs, step_rel = mine[0]
                report.template = "greedy_pick"
                greedy = GreedyPick(report, kernel, st["cupy"], lambda: self._capturing, pick)
                self.picks.append(greedy)
                steps.append((greedy, step_ins, step_outs, step_rel))
                step_slots.append(g.slots)
                continue
            why = unfused_reason(plan, g)
            if why is not None:
                report.status, report.reason = "reference", why
                steps.extend(mine)
                step_slots.extend((s,) for s in g.slots)
                continue
            produced = {o for _, _, outs, _ in mine for o in ((outs,) if isinstance(outs, int) else outs)}
            ins: list[int] = []
            for _, step_ins, _, _ in mine:
                for i in step_ins:
                    if i not in produced and i not in ins:
                        ins.append(i)
            outs = tuple(plan.flat(v) for v in g.outputs)
            releases = tuple(dict.fromkeys(r for *_, rel in mine for r in rel if r not in outs))
            fg = self._group(st, report, mine, tuple(ins), outs, node_specs(plan, g.slots))
            steps.append((fg, tuple(ins), outs if len(outs) > 1 else outs[0], releases))
            step_slots.append(g.slots)
        self._step_slots = step_slots
        return steps

    def _group(
        self,
        st: dict[str, Any],
        report: GroupReport,
        steps: list[Any],
        ins: tuple[int, ...],
        outs: tuple[int, ...],
        nodes: list[codegen.NodeSpec],
    ) -> FusedGroup:
        """A fusion group's step (kept in ``self.groups``): its kernel compiled on first use."""
        fg = FusedGroup(
            report,
            steps,
            ins,
            outs,
            nodes,
            self._constant,
            self._tolerance,
            st["cupy"],
            lambda: self._capturing,
            fixed=lambda flat: flat not in self._tainted,
        )
        self.groups.append(fg)
        return fg

    def _constant(self, flat: int, value: Any) -> np.ndarray | None:
        """A host copy of a small input that does not change between steps (None: it does, or it is big)."""
        if (
            flat in self._tainted
            or value is None
            or getattr(value, "size", MAX_CONSTANT_ELEMENTS + 1) > MAX_CONSTANT_ELEMENTS
        ):
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
        return KernelError(f"{what} failed on CUDA (TRITON): {type(exc).__name__}: {exc}")

    # -- the first runs compile: say so on stderr (dsp_core.progress) ---------------------
    def run(self, values: list[Any]) -> None:
        with self._compiling():
            super().run(values)

    def _warm(self, values: list[Any]) -> None:
        with self._compiling():
            super()._warm(values)

    def _compiling(self) -> Any:
        """A progress step while groups still have to be compiled, tuned and checked (else nothing)."""
        self._ensure()
        stages: list[Any] = [*self.groups, *self.kv_stores, *self.picks]
        pending = [g for g in stages if g.report.status == "pending"]
        if not pending:
            return contextlib.nullcontext()
        return BuildProgress(pending, f"triton: compile, tune and check {len(pending)} fused kernels")

    def fusion_report(self) -> list[dict[str, Any]]:
        """Per group: fused into a Triton kernel, or why it runs its reference kernels."""
        return [r.as_dict() for r in self.reports]

    @property
    def stream(self) -> Any:
        return device.state(self._tf32)["stream"]
