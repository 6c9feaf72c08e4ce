"""DspHandle (``model.dsp``): the live plan of the last executed shape signature, inspected and steered.

model.run(feeds)
model.dsp.phase                 # PlanPhase.SLOT_BY_SLOT / SHAPES_FROZEN / REPLAYING / REPLAY_BLOCKED
model.dsp.segments              # per unit: backend, kind, phase, identity keys, counters
model.dsp.freeze()              # freeze now (or, before any run, as soon as a plan is built)
model.dsp.mark_variable(["past_key_values.0.key"])   # read in place, never sealed or staged
model.dsp.json_report(); model.dsp.to_dot()
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsp_core.devices.placement import Placement, Strategy, place
from dsp_core.devices.topology import host_topology
from dsp_core.devices.transfers import StepTransfers, TransferRecorder
from dsp_core.errors import DSPError, InputError
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase, SlotPhase
from dsp_core.runtime.units import Unit, UnitKind

if TYPE_CHECKING:
    from dsp_core.cache.memory import LivePlan
    from dsp_core.runtime.model import CompiledModel
    from dsp_core.runtime.plan_runtime import PlanRuntime


@dataclass(frozen=True)
class SegmentView:
    """What a report shows of one unit of the frozen plan (or of one auction segment before)."""

    index: int
    backend: str
    mode: str
    kind: str  # "island", "gap", "eager", or "segment" before freezing
    phase: SegmentPhase | None
    slots: tuple[int, ...]
    replaying: bool
    keys: dict[str, Any] | None
    counters: dict[str, int]
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "index": self.index,
            "backend": self.backend,
            "mode": self.mode,
            "kind": self.kind,
            "phase": self.phase.name if self.phase else None,
            "slots": [self.slots[0], self.slots[-1]] if self.slots else [],
            "n_slots": len(self.slots),
            "replaying": self.replaying,
            "identity_keys": self.keys,
            "counters": self.counters,
            "reason": self.reason,
        }


class DspHandle:
    """Inspect and steer the live plan of a compiled model's last executed shape signature."""

    def __init__(self, model: CompiledModel) -> None:
        self._model = model

    # -- the live plan -----------------------------------------------------------------
    @property
    def live(self) -> LivePlan:
        """The live plan of the last ``run``; DSPError before the first run."""
        live = self._model.last_live
        if live is None:
            raise DSPError("no plan has run yet: call model.run(feeds) first")
        return live

    @property
    def runtime(self) -> PlanRuntime:
        """The lifecycle state of the live plan."""
        runtime: PlanRuntime = self.live.runtime
        return runtime

    @property
    def phase(self) -> PlanPhase:
        """The plan phase."""
        return self.runtime.phase

    @property
    def segments(self) -> list[SegmentView]:
        """The units of the frozen plan, or the auction's segments before freezing."""
        runtime = self.runtime
        if runtime.units:
            return [_unit_view(u) for u in runtime.units]
        part = runtime.executor.partition
        return [
            SegmentView(s.index, s.backend, s.mode, "segment", None, s.slots, False, None, {}, "not frozen yet")
            for s in part.segments
        ]

    @property
    def slots(self) -> list[dict[str, Any]]:
        """Every slot: index, op, name, phase (BUILDING or SEALED), owning unit."""
        runtime = self.runtime
        owner = {s: u.index for u in runtime.units for s in u.segment.slots}
        return [
            {
                "index": slot.index,
                "op": slot.op,
                "name": slot.name,
                "phase": runtime.slot_machines[slot.index].state.name,
                "unit": owner.get(slot.index),
            }
            for slot in runtime.plan.slots
        ]

    @property
    def external_inputs(self) -> list[dict[str, Any]]:
        """Every external input with its class (a marked variable shows as variable)."""
        runtime = self.runtime
        return [
            {
                "name": e.name,
                "class": "variable" if e.name in runtime.variables else e.cls.value,
                "dtype": e.dtype,
                "shape": list(e.shape) if e.shape is not None else None,
            }
            for e in runtime.plan.externals
        ]

    @property
    def transitions(self) -> list[dict[str, Any]]:
        """Every recorded move of the plan and its units, in order."""
        runtime = self.runtime
        out = [{"machine": "plan", **t.__dict__} for t in runtime.machine.history]
        for unit in runtime.units:
            out += [{"machine": f"segment {unit.index}", **t.__dict__} for t in unit.machine.history]
        return sorted(out, key=lambda t: t["at"])

    # -- devices (dsp_core.devices, docs/devices.md) --------------------------------------
    @property
    def placement(self) -> Placement:
        """Slot index -> device index of the default plan (all on device 0 when not placed)."""
        model = self._model
        plan = model.plan()
        if plan is None:
            raise DSPError(f"the graph was declined ({model.declined}): it runs on the legacy interpreter, unplaced")
        placed = model.placements.get(plan.output_names)
        if placed is None:
            placed = place(plan, Strategy.SINGLE_DEVICE, host_topology())
        return placed

    def transfers(self) -> list[StepTransfers]:
        """Per-step records of every cross-device copy and device switch (the last KEEP_STEPS steps)."""
        plan = self._model.plan()
        return plan.placement.recorder.records() if plan is not None and plan.placement is not None else []

    def transfer_summary(self) -> dict[str, Any]:
        """Totals over every step: copies, bytes and modelled seconds per reason, device switches."""
        plan = self._model.plan()
        if plan is None or plan.placement is None:
            return TransferRecorder().summary()
        return plan.placement.recorder.summary()

    # -- steering ----------------------------------------------------------------------
    def freeze(self) -> None:
        """Freeze the live plan now; before any run, the first plan built freezes at once."""
        if self._model.last_live is None:
            self._model.freeze_on_build = True
            return
        self.runtime.request_freeze()

    def mark_variable(self, names: Iterable[str]) -> None:
        """Class inputs as VARIABLE: read in place (not staged), never sealed; re-runs the detection."""
        names = list(names)
        unknown = [n for n in names if n not in self._model.input_names]
        if unknown:
            raise InputError(f"mark_variable: {unknown[0]!r} is not an input; inputs are {self._model.input_names}")
        self._model.mark_variable(names)

    def verify_constants(self) -> None:
        """DSPError if a weight was replaced or modified in place since the plan froze."""
        runtime = self.runtime
        if runtime.snapshot is not None:
            runtime.snapshot.check_content(
                runtime.plan.constants, {k: e.name for k, e in enumerate(runtime.plan.externals)}
            )

    # -- reports -----------------------------------------------------------------------
    def json_report(self) -> dict[str, Any]:
        """The live plan's state as a JSON-able dict."""
        runtime = self.runtime
        return {
            "signature": {
                "outputs": list(self.live.signature.outputs),
                "feeds": {
                    n: {"shape": list(s), "dtype": str(d)}
                    for n, (s, d) in zip(self.live.signature.feed_names, self.live.signature.feeds)
                },
                "mode": self.live.signature.mode,
                "plan_hash": self.live.signature.plan_hash,
            },
            "phase": runtime.phase.name,
            "executions": runtime.executions,
            "sealed_slots": len(runtime.sealed),
            "segments": [s.as_dict() for s in self.segments],
            "counters": runtime.counters(),
            "flags": list(runtime.flags),
            "transitions": [{k: v for k, v in t.items() if k != "at"} for t in self.transitions],
            "cache": self._model.stats.as_dict(),
            "devices": {**self.placement.as_dict(runtime.plan), "transfers": self.transfer_summary()},
        }

    def diag_report(self) -> dict[str, Any]:
        """dsp_core.diag's report narrowed to this model's live plans (counts stay process-wide)."""
        from dsp_core import diag

        ids = [int(getattr(p.runtime, "diag_id", -1)) for p in self._model.cache.live_plans()]
        return diag.report(plan_ids=ids)

    def to_dot(self) -> str:
        """Graphviz source of the plan, slots coloured by unit (sealed slots grey)."""
        runtime = self.runtime
        plan = runtime.plan
        colours = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"]
        owner = {s: u for u in runtime.units for s in u.segment.slots}
        seg_of = {s: seg.index for seg in runtime.executor.partition.segments for s in seg.slots}
        lines = ["digraph plan {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];']
        producer = {v: slot.index for slot in plan.slots for v in slot.outputs if v is not None}
        devices = self.placement
        placed = devices.multi_device
        crossing = {(c.src, c.dst): c.nbytes for c in devices.cuts}
        for k, ext in enumerate(plan.externals):
            if ext.cls.value != "constant":
                lines.append(
                    f'  e{k} [label="{_esc(ext.name)}\\n{ext.cls.value}", shape=ellipse, fillcolor="#ffffff"];'
                )
        for slot in plan.slots:
            unit = owner.get(slot.index)
            if runtime.slot_machines[slot.index].state is SlotPhase.SEALED:
                fill, where = "#dddddd", "sealed"
            elif unit is not None:
                fill, where = colours[unit.index % len(colours)], f"{unit.kind.value} {unit.index}"
            else:
                fill, where = colours[seg_of.get(slot.index, 0) % len(colours)], f"segment {seg_of.get(slot.index)}"
            if placed:
                where += f"\\ndevice {devices[slot.index]}"
            lines.append(f'  s{slot.index} [label="{slot.index}: {_esc(slot.op)}\\n{where}", fillcolor="{fill}"];')
            for r in slot.inputs:
                if r is None:
                    continue
                if r >= 0:
                    src, dst = devices[producer[r]], devices[slot.index]
                    if placed and src != dst:  # a value crossing devices: red, with the cut's modelled bytes
                        label = f"{src}->{dst} {crossing.get((src, dst), 0)} B"
                        lines.append(
                            f'  s{producer[r]} -> s{slot.index} [color="#d62728", penwidth=2, label="{label}"];'
                        )
                    else:
                        lines.append(f"  s{producer[r]} -> s{slot.index};")
                elif plan.externals[-r - 1].cls.value != "constant":
                    lines.append(f"  e{-r - 1} -> s{slot.index};")
        lines.append("}")
        return "\n".join(lines) + "\n"


def _unit_view(unit: Unit) -> SegmentView:
    return SegmentView(
        index=unit.index,
        backend=unit.backend.name,
        mode=unit.backend.mode.name,
        kind=unit.kind.value,
        phase=unit.phase,
        slots=unit.segment.slots,
        replaying=unit.kind is UnitKind.ISLAND and unit.phase is SegmentPhase.REPLAYING,
        keys=unit.keys.as_dict() if unit.keys is not None else None,
        counters=unit.counters.as_dict(),
        reason=unit.reason,
    )


def _esc(text: str) -> str:
    return html.escape(text).replace('"', "&quot;")
