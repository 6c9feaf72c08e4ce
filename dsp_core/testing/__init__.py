"""Plan assertions for tests: each raises AssertionError with a dump of the live plan's state.

from dsp_core.testing import assert_fully_replaying, assert_pointers_stable
for _ in range(6):
    model.run(feeds)
assert_fully_replaying(model)
assert_pointers_stable(model, feeds)

The dump is ``model.dsp.json_report()`` (phase, units with their identity keys and
counters, recent transitions), so a failing test says where the plan stands without a
debugger. The backend conformance kit lives in ``dsp_core.testing.conformance``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dsp_core.errors import DSPError
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.units import UnitKind

if TYPE_CHECKING:
    from dsp_core.runtime.handle import SegmentView
    from dsp_core.runtime.model import CompiledModel

__all__ = [
    "assert_fully_replaying",
    "assert_no_address_drift",
    "assert_no_capture_failures",
    "assert_phase_reached",
    "assert_pointers_stable",
    "assert_segment_replay_mode",
    "plan_dump",
]

# Forward order of the plan phases; REPLAY_BLOCKED is frozen but never replays.
_RANK = {PlanPhase.SLOT_BY_SLOT: 0, PlanPhase.SHAPES_FROZEN: 1, PlanPhase.REPLAYING: 2, PlanPhase.REPLAY_BLOCKED: 1}
_KINDS = frozenset({k.value for k in UnitKind} | {"segment"})  # "segment": an auction segment before freezing
_DRIFT_COUNTERS = ("refreshes", "recaptures", "stale_redispatches")
_MAX_TRANSITIONS = 24  # the dump keeps the most recent ones
_MAX_DUMP_CHARS = 8000


def plan_dump(model: CompiledModel) -> str:
    """The live plan's JSON report, trimmed for an assertion message."""
    try:
        report = model.dsp.json_report()
    except DSPError as exc:
        return f"(no plan state: {exc})"
    transitions = report.get("transitions", [])
    if len(transitions) > _MAX_TRANSITIONS:
        dropped = len(transitions) - _MAX_TRANSITIONS
        report["transitions"] = [f"... {dropped} earlier transitions"] + transitions[-_MAX_TRANSITIONS:]
    text = json.dumps(report, indent=1, default=str)
    if len(text) > _MAX_DUMP_CHARS:
        text = text[:_MAX_DUMP_CHARS] + f"\n... ({len(text) - _MAX_DUMP_CHARS} more characters)"
    return text


def _fail(model: CompiledModel, message: str) -> AssertionError:
    return AssertionError(f"{message}\nplan state:\n{plan_dump(model)}")


def _phase_of(model: CompiledModel) -> PlanPhase:
    try:
        return model.dsp.phase
    except DSPError as exc:
        raise _fail(model, f"the model has no live plan: {exc}") from None


def _parse_plan_phase(phase: PlanPhase | str) -> PlanPhase:
    if isinstance(phase, PlanPhase):
        return phase
    try:
        return PlanPhase[str(phase).strip().upper()]
    except KeyError:
        allowed = ", ".join(p.name for p in PlanPhase)
        raise ValueError(f"unknown plan phase {phase!r}; allowed: {allowed}") from None


def _islands(model: CompiledModel) -> list[SegmentView]:
    return [s for s in model.dsp.segments if s.kind == UnitKind.ISLAND.value]


def assert_phase_reached(model: CompiledModel, phase: PlanPhase | str) -> None:
    """Assert the plan is at ``phase`` or a later forward phase (REPLAY_BLOCKED reaches SHAPES_FROZEN only)."""
    want = _parse_plan_phase(phase)
    now = _phase_of(model)
    if want is PlanPhase.REPLAY_BLOCKED:
        reached = now is PlanPhase.REPLAY_BLOCKED
    elif now is PlanPhase.REPLAY_BLOCKED:
        reached = _RANK[want] <= _RANK[PlanPhase.SHAPES_FROZEN]
    else:
        reached = _RANK[now] >= _RANK[want]
    if not reached:
        raise _fail(model, f"plan phase {now.name} has not reached {want.name}")


def assert_fully_replaying(model: CompiledModel) -> None:
    """Assert the plan is REPLAYING and every island unit replays."""
    now = _phase_of(model)
    if now is not PlanPhase.REPLAYING:
        raise _fail(model, f"plan phase is {now.name}, not REPLAYING")
    stuck = [s for s in _islands(model) if not s.replaying]
    if stuck:
        detail = "; ".join(
            f"unit {s.index} ({s.backend}) is {s.phase.name if s.phase else None}"
            + (f": {s.reason}" if s.reason else "")
            for s in stuck
        )
        raise _fail(model, f"{len(stuck)} island(s) not replaying: {detail}")


def _island_state(model: CompiledModel) -> tuple[Any, dict[int, dict[str, Any]]]:
    """(live plan object, per island: identity keys and drift counters), for before/after comparisons."""
    live = model.last_live
    if live is None:
        return None, {}
    state = {}
    for s in _islands(model):
        keys = s.keys or {}
        state[s.index] = {
            "phase": s.phase,
            "input_addresses": keys.get("input_addresses"),
            "slot_address_hash": keys.get("slot_address_hash"),
            "generation": keys.get("generation"),
            **{c: s.counters.get(c, 0) for c in _DRIFT_COUNTERS},
        }
    return live, state


def assert_pointers_stable(model: CompiledModel, feeds: Mapping[str, Any], runs: int = 3) -> None:
    """Run ``feeds`` ``runs`` times; assert no island's identity keys change and no refresh/recapture happens."""
    before_live, before = _island_state(model)
    for run in range(1, runs + 1):
        model.run(feeds)
        live, after = _island_state(model)
        if live is before_live:  # a different signature's plan is not comparable
            changes = []
            for index, old in before.items():
                new = after.get(index)
                if new is None:
                    continue
                for name in _DRIFT_COUNTERS:
                    if new[name] != old[name]:
                        changes.append(f"unit {index}: {name} {old[name]} -> {new[name]}")
                if old["phase"] is SegmentPhase.REPLAYING and new["phase"] is SegmentPhase.REPLAYING:
                    for name in ("input_addresses", "slot_address_hash", "generation"):
                        if new[name] != old[name]:
                            changes.append(f"unit {index}: {name} {old[name]} -> {new[name]}")
            if changes:
                raise _fail(model, f"pointers moved at run {run} of {runs} on the same feeds: " + "; ".join(changes))
        before_live, before = live, after


def assert_no_capture_failures(model: CompiledModel) -> None:
    """Assert no island unit is FAILED or OOM_DEFERRED and no slot became a gap by failing to capture.

    Eager units and the gaps a backend's profile asks for are fine.
    """
    _phase_of(model)
    bad = [s for s in _islands(model) if s.phase in (SegmentPhase.FAILED, SegmentPhase.OOM_DEFERRED)]
    if bad:
        detail = "; ".join(f"unit {s.index} ({s.backend}) {s.phase.name if s.phase else None}: {s.reason}" for s in bad)
        raise _fail(model, f"{len(bad)} island(s) could not capture: {detail}")
    learned = model.dsp.runtime.plan.capture_gaps
    if any(learned.values()):
        detail = "; ".join(f"{b} slot {slot}: {why}" for b, gaps in learned.items() for slot, why in gaps.items())
        raise _fail(model, f"{sum(len(g) for g in learned.values())} slot(s) failed to capture: {detail}")


def assert_no_address_drift(model: CompiledModel) -> None:
    """Assert no unit ever refreshed or recaptured (recaptures == refreshes == 0)."""
    _phase_of(model)
    moved = [
        f"unit {s.index} ({s.backend}): refreshes={s.counters.get('refreshes', 0)}, "
        f"recaptures={s.counters.get('recaptures', 0)}"
        for s in model.dsp.segments
        if s.counters.get("refreshes", 0) or s.counters.get("recaptures", 0)
    ]
    if moved:
        raise _fail(model, "address drift: " + "; ".join(moved))


def assert_segment_replay_mode(model: CompiledModel, index: int, kind_or_phase: str | UnitKind | SegmentPhase) -> None:
    """Assert unit ``index`` has the kind ("island", "gap", "eager") or the SegmentPhase given."""
    _phase_of(model)
    views = model.dsp.segments
    if not 0 <= index < len(views):
        raise _fail(model, f"no unit {index}: the plan has {len(views)} unit(s)")
    view = views[index]
    if isinstance(kind_or_phase, UnitKind):
        kind_or_phase = kind_or_phase.value
    if isinstance(kind_or_phase, str) and kind_or_phase.strip().lower() in _KINDS:
        want_kind = kind_or_phase.strip().lower()
        if view.kind != want_kind:
            raise _fail(model, f"unit {index} ({view.backend}) is {view.kind!r}, expected {want_kind!r}")
        return
    want = _parse_segment_phase(kind_or_phase)
    if view.phase is not want:
        got = view.phase.name if view.phase is not None else "not frozen yet"
        why = f" ({view.reason})" if view.reason else ""
        raise _fail(model, f"unit {index} ({view.backend}, {view.kind}) is {got}{why}, expected {want.name}")


def _parse_segment_phase(value: str | SegmentPhase) -> SegmentPhase:
    if isinstance(value, SegmentPhase):
        return value
    try:
        return SegmentPhase[str(value).strip().upper()]
    except KeyError:
        allowed = ", ".join(sorted(_KINDS) + [p.name for p in SegmentPhase])
        raise ValueError(f"{value!r} is neither a unit kind nor a segment phase; allowed: {allowed}") from None
