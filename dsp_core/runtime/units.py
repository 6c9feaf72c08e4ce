"""Units: the pieces of a frozen plan that the lifecycle drives one by one.

After freezing, each segment of the auction is cut into units. For a backend that
captures, its CaptureProfile splits the segment into *islands* (captured, replayed) and
*gaps* (run eagerly between them): ops it excludes, ops whose output size is known only
after running (a host sync), control flow and random ops are gaps, and an island holds
at most ``max_island_nodes`` slots. A backend that does not capture gives one *eager*
unit per segment. Each unit knows its inputs (flat indexes it reads that others write)
and its outputs (flat indexes it writes that others read).

Output checks: before a non-reference backend's outputs are trusted, each is compared
with what the plan declares for it (dtype; rank, static dims and dims bound by the
feeds' symbols); a mismatch is a BackendFault naming the backend, the node and expected
vs got, and the core then runs the unit on the reference. Shapes are frozen per live
plan, so a unit is checked on its first CHECKED_RUNS runs and after each (re)capture,
not on every replay.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.backends.guard import BackendFault
from dsp_core.counters import Counters
from dsp_core.ir import dtypes
from dsp_core.ops.registry import TensorInfo, Trait, lookup
from dsp_core.plan.plan import Dim, Plan, Segment
from dsp_core.runtime.lifecycle import SEGMENT_TRANSITIONS, SegmentPhase, StateMachine

# Slots a capture can never hold: their output size is known only on the host, they run
# subgraphs, or they draw random numbers that a replay would repeat.
UNCAPTURABLE = Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW | Trait.RANDOM

# Runs of a unit whose outputs are checked against the plan's declarations (then again
# after every capture). Shapes cannot change within a live plan, and a backend whose
# contract says ``deterministic`` computes the same outputs from the same inputs, so
# later runs of the same code or recording need no check: the hot path pays one integer
# test per unit. A non-deterministic backend is checked on every run.
CHECKED_RUNS = 2
ALWAYS = 1 << 62


def check_budget(backend: Backend) -> int:
    """How many runs of a unit of ``backend`` get their outputs checked."""
    return CHECKED_RUNS if backend.contract.deterministic else ALWAYS


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
    origin: int = -1  # the auction segment this unit was cut from
    checks: tuple[OutputSpec, ...] = ()  # what its outputs must be (empty: the reference, never checked)
    unchecked: int = 0  # runs left whose outputs are checked
    # the replay contest with the auction's runner-up (dsp_core.runtime.contest), once made; False: none to make
    contest: Any = None

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
        kind = UnitKind.GAP if why_gap(plan, s, backend) is not None else UnitKind.ISLAND
        last = pieces[-1] if pieces else None
        full = last is not None and kind is UnitKind.ISLAND and limit is not None and len(last[1]) >= limit
        if last is None or last[0] is not kind or full:
            pieces.append((kind, [s]))
        else:
            last[1].append(s)
    return [(kind, tuple(slots)) for kind, slots in pieces]


def why_gap(plan: Plan, s: int, backend: Backend) -> str | None:
    """Why slot ``s`` runs in a gap of capturing ``backend`` (None: it can be captured)."""
    slot = plan.slots[s]
    if slot.op in backend.profile.excluded_ops:
        return f"{slot.op} is excluded from capture by {backend.name}'s profile"
    uncapturable = slot.traits & UNCAPTURABLE
    if uncapturable:
        names = "/".join(t.name.lower() for t in Trait if t & uncapturable and t.name)
        return f"{slot.op} cannot be captured ({names})"
    learned = plan.capture_gaps.get(backend.name, {}).get(s)
    if learned is not None:
        return f"{slot.op} failed to capture: {learned}"
    return None


def gap_reasons(plan: Plan, slots: Iterable[int], backend: Backend) -> str:
    """The reasons of a gap's slots, each once, for reports."""
    seen: list[str] = []
    for s in slots:
        why = why_gap(plan, s, backend)
        if why is not None and why not in seen:
            seen.append(why)
    return "gap: " + "; ".join(seen) if seen else "gap"


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


@dataclass(frozen=True)
class OutputSpec:
    """What the plan declares for one output a unit publishes."""

    flat: int
    slot: int
    name: str
    dtype: np.dtype[Any] | None
    shape: tuple[Dim, ...] | None


def output_specs(plan: Plan, slots: Iterable[int], outputs: Iterable[int]) -> tuple[OutputSpec, ...]:
    """Specs of the flat indexes ``outputs`` written by ``slots``.

    The expectation is what the reference computes: the op's dtype/shape rule applied to
    the inputs' static info, where the rule concludes; the plan's declaration otherwise
    (a declaration can be wrong: a builder's guess, a model's stale value_info).
    """
    wanted = set(outputs)
    specs = []
    for s in slots:
        ruled = _rule_infos(plan, s)
        for j, v in enumerate(plan.slots[s].outputs):
            if v is None or plan.flat(v) not in wanted:
                continue
            name, shape = plan.ref_info(v)
            rule = ruled[j] if j < len(ruled) else None
            if rule is not None:
                name = rule.dtype or name
                shape = rule.shape if rule.shape is not None else shape
            try:
                np_dtype = dtypes.to_numpy(name) if name is not None else None
            except Exception:  # noqa: BLE001  (an opaque type: sequences, optionals; not checked)
                np_dtype = None
            specs.append(OutputSpec(plan.flat(v), s, plan.ref_name(v), np_dtype, shape))
    return tuple(specs)


def _rule_infos(plan: Plan, s: int) -> list[TensorInfo | None]:
    """The op's shape rule for slot ``s`` (empty when there is none or it cannot conclude)."""
    slot = plan.slots[s]
    try:
        rule = lookup(slot.op, slot.domain).shape_rule
        if rule is None:
            return []
        infos = [TensorInfo(*plan.ref_info(r)) if r is not None else None for r in slot.inputs]
        if any(i is not None and i.dtype is None for i in infos):
            return []
        return list(rule(dict(slot.attrs), *infos))
    except Exception:  # noqa: BLE001  (a rule that cannot conclude: the declaration stands)
        return []


def bind_symbols(plan: Plan, feeds: Iterable[tuple[int, Any]]) -> dict[str, int]:
    """Symbolic dims of the plan's inputs bound to this call's feeds ('batch' -> 2)."""
    symbols: dict[str, int] = {}
    n_ext = len(plan.externals)
    for flat, array in feeds:
        shape = getattr(array, "shape", None)
        if shape is None or not 1 <= flat <= n_ext:
            continue
        declared = plan.externals[flat - 1].shape
        if declared is None or len(declared) != len(shape):
            continue
        for want, got in zip(declared, shape):
            if isinstance(want, str):
                symbols.setdefault(want, int(got))
    return symbols


def check_published(
    backend: Backend, plan: Plan, specs: tuple[OutputSpec, ...], values: list[Any], symbols: dict[str, int]
) -> None:
    """BackendFault when an output in ``values`` is not what the plan declares for it."""
    for spec in specs:
        value = values[spec.flat]
        if spec.dtype is None or isinstance(value, list):
            continue
        got_dtype = getattr(value, "dtype", None)
        got_shape = getattr(value, "shape", None)
        if value is None or got_dtype is None or got_shape is None:
            _mismatch(backend, plan, spec, f"an array of dtype {spec.dtype}", type(value).__name__)
        if got_dtype != spec.dtype:
            _mismatch(backend, plan, spec, f"dtype {spec.dtype}", f"dtype {np.dtype(got_dtype)}")
        if spec.shape is None:
            continue
        shape = tuple(int(d) for d in got_shape)
        bad = len(shape) != len(spec.shape) or any(
            (isinstance(want, int) and want >= 0 and want != got)
            or (isinstance(want, str) and symbols.get(want, got) != got)
            for want, got in zip(spec.shape, shape)
        )
        if bad:
            declared = "[" + ", ".join("?" if d is None else str(d) for d in spec.shape) + "]"
            bound = {d: symbols[d] for d in spec.shape if isinstance(d, str) and d in symbols}
            _mismatch(backend, plan, spec, f"shape {declared}{f' with {bound}' if bound else ''}", f"shape {shape}")


def _mismatch(backend: Backend, plan: Plan, spec: OutputSpec, expected: str, got: str) -> NoReturn:
    slot = plan.slots[spec.slot]
    raise BackendFault(
        f"backend {backend.name} wrote a wrong output {spec.name!r} for {slot.op} node {slot.name!r} "
        f"(slot {spec.slot}): expected {expected}, got {got}"
    )
