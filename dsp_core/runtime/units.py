"""Units: the pieces of a frozen plan that the lifecycle drives one by one.

After freezing, each segment of the auction is cut into units. For a backend that
captures, its CaptureProfile splits the segment into *islands* (captured, replayed) and
*gaps* (run eagerly between them): ops it excludes, ops whose output size is known only
after running (a host sync), control flow and random ops are gaps, and an island holds
at most ``max_island_nodes`` slots. A backend that does not capture gives one *eager*
unit per segment. Each unit knows its inputs (flat indexes it reads that others write)
and its outputs (flat indexes it writes that others read).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.counters import Counters
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Plan, Segment
from dsp_core.runtime.lifecycle import SEGMENT_TRANSITIONS, SegmentPhase, StateMachine

# Slots a capture can never hold: their output size is known only on the host, they run
# subgraphs, or they draw random numbers that a replay would repeat.
UNCAPTURABLE = Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW | Trait.RANDOM


class UnitKind(enum.Enum):
    """How a unit runs once the plan is frozen."""

    ISLAND = "island"  # captured and replayed
    GAP = "gap"  # run eagerly between islands of a capturing backend
    EAGER = "eager"  # a segment of a backend that does not capture


@dataclass
class IdentityKeys:
    """What a capture baked in; a replay is only valid while these still hold."""

    output_shapes: tuple[tuple[int, ...], ...]
    input_addresses: tuple[int, ...]
    constant_ids: tuple[int, ...]
    slot_address_hash: int
    generation: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for reports."""
        return {
            "output_shapes": [list(s) for s in self.output_shapes],
            "input_addresses": [hex(a) for a in self.input_addresses],
            "constant_ids": len(self.constant_ids),
            "slot_address_hash": hex(self.slot_address_hash & 0xFFFFFFFFFFFFFFFF),
            "generation": self.generation,
        }


@dataclass
class UnitCounters(Counters):
    """Lifecycle events of one unit."""

    warmups: int = 0
    compiles: int = 0
    captures: int = 0
    replays: int = 0
    eager_runs: int = 0
    refreshes: int = 0
    recaptures: int = 0
    stale_redispatches: int = 0
    oom_retries: int = 0


@dataclass
class Unit:
    """One island, gap or eager piece of a frozen plan, with its lifecycle state."""

    index: int
    kind: UnitKind
    segment: Segment  # the unit's slots (frozen constants removed)
    backend: Backend
    compiled: CompiledSegment
    inputs: tuple[int, ...]  # flat indexes read from outside the unit
    outputs: tuple[int, ...]  # flat indexes written for readers outside the unit
    constants: tuple[int, ...]  # flat indexes of constants (and sealed values) it reads
    machine: StateMachine[SegmentPhase] = field(init=False)
    keys: IdentityKeys | None = None
    counters: UnitCounters = field(default_factory=UnitCounters)
    reason: str = ""
    oom_deferred_at: int = 0

    def __post_init__(self) -> None:
        self.machine = StateMachine(
            f"segment {self.index} ({self.backend.name})", SegmentPhase.NEEDS_WARMUP, SEGMENT_TRANSITIONS
        )

    @property
    def phase(self) -> SegmentPhase:
        """The unit's lifecycle phase."""
        return self.machine.state


def split_units(plan: Plan, segment: Segment, backend: Backend) -> list[tuple[UnitKind, tuple[int, ...]]]:
    """Cut one segment's (unsealed) slots into islands and gaps by the backend's profile."""
    if not segment.slots:
        return []
    if not backend.captures:
        return [(UnitKind.EAGER, segment.slots)]
    pieces: list[tuple[UnitKind, list[int]]] = []
    limit = backend.profile.max_island_nodes
    for s in segment.slots:
        slot = plan.slots[s]
        kind = (
            UnitKind.GAP if (slot.traits & UNCAPTURABLE or slot.op in backend.profile.excluded_ops) else UnitKind.ISLAND
        )
        last = pieces[-1] if pieces else None
        full = last is not None and kind is UnitKind.ISLAND and limit is not None and len(last[1]) >= limit
        if last is None or last[0] is not kind or full:
            pieces.append((kind, [s]))
        else:
            last[1].append(s)
    return [(kind, tuple(slots)) for kind, slots in pieces]


def unit_io(
    plan: Plan, slots: tuple[int, ...], sealed: frozenset[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(inputs, outputs, constants) of a unit as flat indexes.

    Inputs: refs its slots read that it does not produce, excluding constants and values
    of sealed slots (listed as constants: they never change once frozen). Outputs: its
    values read by a later slot outside it, or requested as plan outputs.
    """
    inside = set(slots)
    produced = {v for s in slots for v in plan.slots[s].outputs if v is not None}
    const_flat = {plan.flat(plan.external_ref(k)) for k in plan.constants}
    sealed_values = {v for s in sealed for v in plan.slots[s].outputs if v is not None}
    inputs: list[int] = []
    constants: list[int] = []
    for s in slots:
        for r in plan.slots[s].inputs:
            if r is None or (r >= 0 and r in produced):
                continue
            flat = plan.flat(r)
            bucket = constants if (flat in const_flat or (r >= 0 and r in sealed_values)) else inputs
            if flat not in bucket:
                bucket.append(flat)
    readers_outside = {
        r for i, slot in enumerate(plan.slots) if i not in inside for r in slot.inputs if r is not None and r >= 0
    }
    outputs = [plan.flat(v) for v in sorted(produced) if v in readers_outside or v in plan.outputs]
    return tuple(inputs), tuple(outputs), tuple(constants)


def buffer_address(x: Any) -> int:
    """The data address of an array (numpy, cupy, anything with DLPack-style pointers)."""
    if x is None:
        return 0
    iface = getattr(x, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    cuda = getattr(x, "__cuda_array_interface__", None)
    if cuda is not None:
        return int(cuda["data"][0])
    ptr = getattr(x, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    return id(x)
