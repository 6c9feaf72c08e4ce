"""The three state machines every plan goes through, identical for every backend.

- Plan phase: SLOT_BY_SLOT -> SHAPES_FROZEN -> REPLAYING, or SHAPES_FROZEN -> REPLAY_BLOCKED.
- Segment lifecycle: NEEDS_WARMUP -> NEEDS_COMPILE -> CAPTURE_PENDING -> REPLAYING, with
  FAILED (eager for good, reason kept) and OOM_DEFERRED (capture retried later).
- Slot phase: BUILDING -> SEALED (a frozen constant: computed once, then skipped).

Moves follow the transition tables below; anything else raises LifecycleError. The one
way back is ``demote(target, reason)``, for error recovery, and it is recorded like
every other move.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dsp_core import diag
from dsp_core.errors import DSPError


class LifecycleError(DSPError):
    """An illegal state transition: a bug in a backend or in the core, never ignored."""


class PlanPhase(enum.Enum):
    """Where a live plan stands."""

    SLOT_BY_SLOT = "slot_by_slot"  # shapes may still change; every slot runs
    SHAPES_FROZEN = "shapes_frozen"  # shapes fixed, constants sealed, segments warming/capturing
    REPLAYING = "replaying"  # every capturable segment replays, addresses stable
    REPLAY_BLOCKED = "replay_blocked"  # frozen, but no segment could capture


class SegmentPhase(enum.Enum):
    """Where one segment (an island of a capturing backend, or an eager segment) stands."""

    NEEDS_WARMUP = "needs_warmup"
    NEEDS_COMPILE = "needs_compile"
    CAPTURE_PENDING = "capture_pending"
    REPLAYING = "replaying"
    FAILED = "failed"  # runs eagerly for good; the reason is kept
    OOM_DEFERRED = "oom_deferred"  # capture ran out of memory; retried every M executions, N times


class SlotPhase(enum.Enum):
    """Whether a slot still runs every step."""

    BUILDING = "building"
    SEALED = "sealed"  # a frozen constant: computed once after freezing, skipped afterwards


P, S, L = PlanPhase, SegmentPhase, SlotPhase

PLAN_TRANSITIONS: dict[enum.Enum, frozenset[enum.Enum]] = {
    P.SLOT_BY_SLOT: frozenset({P.SHAPES_FROZEN}),
    P.SHAPES_FROZEN: frozenset({P.REPLAYING, P.REPLAY_BLOCKED}),
    P.REPLAYING: frozenset(),
    P.REPLAY_BLOCKED: frozenset(),
}

SEGMENT_TRANSITIONS: dict[enum.Enum, frozenset[enum.Enum]] = {
    S.NEEDS_WARMUP: frozenset({S.NEEDS_COMPILE, S.FAILED}),
    S.NEEDS_COMPILE: frozenset({S.CAPTURE_PENDING, S.FAILED, S.OOM_DEFERRED}),
    S.CAPTURE_PENDING: frozenset({S.REPLAYING, S.FAILED, S.OOM_DEFERRED}),
    S.REPLAYING: frozenset({S.FAILED}),  # drift goes back through demote (recorded)
    S.OOM_DEFERRED: frozenset({S.NEEDS_COMPILE, S.FAILED}),
    S.FAILED: frozenset(),
}

SLOT_TRANSITIONS: dict[enum.Enum, frozenset[enum.Enum]] = {
    L.BUILDING: frozenset({L.SEALED}),
    L.SEALED: frozenset(),
}

# How far along each state is, for demotions: a demotion must go to a lower rank.
# Terminal failure states have no rank: nothing demotes out of them.
RANKS: dict[enum.Enum, int] = {
    P.SLOT_BY_SLOT: 0,
    P.SHAPES_FROZEN: 1,
    P.REPLAYING: 2,
    P.REPLAY_BLOCKED: 2,
    S.NEEDS_WARMUP: 0,
    S.NEEDS_COMPILE: 1,
    S.CAPTURE_PENDING: 2,
    S.OOM_DEFERRED: 2,
    S.REPLAYING: 3,
    L.BUILDING: 0,
    L.SEALED: 1,
}

E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True)
class Transition:
    """One recorded move: from, to, why, at which execution, and whether it was a demotion."""

    source: str
    target: str
    reason: str
    execution: int
    demotion: bool = False
    at: float = field(default_factory=time.monotonic)


class StateMachine(Generic[E]):
    """A state, its transition table and the history of every move."""

    def __init__(
        self,
        what: str,
        initial: E,
        table: dict[enum.Enum, frozenset[enum.Enum]],
        owner: tuple[int, int, int] = (-1, -1, -1),
    ) -> None:
        self.what = what
        self.state: E = initial
        self._table = table
        self.history: list[Transition] = []
        self.owner = owner  # diag: (plan id, segment, slot) the moves are reported under; -1 = none

    def can(self, target: E) -> bool:
        """True when ``target`` is a legal forward move from the current state."""
        return target in self._table[self.state]

    def move(self, target: E, reason: str = "", execution: int = 0) -> None:
        """Move forward to ``target``; LifecycleError when the table forbids it."""
        if not self.can(target):
            allowed = ", ".join(sorted(s.name for s in self._table[self.state])) or "none (terminal)"
            raise LifecycleError(
                f"{self.what}: illegal transition {self.state.name} -> {target.name} (allowed: {allowed})"
            )
        self._record(Transition(self.state.name, target.name, reason, execution), target)

    def demote(self, target: E, reason: str, execution: int = 0) -> None:
        """Go back to an earlier state for error recovery; the reason is required and recorded."""
        if not reason:
            raise LifecycleError(f"{self.what}: a demotion needs a reason")
        here, there = RANKS.get(self.state), RANKS.get(target)
        if here is None or there is None or there >= here:
            raise LifecycleError(f"{self.what}: demote {self.state.name} -> {target.name} is not backwards")
        self._record(Transition(self.state.name, target.name, reason, execution, demotion=True), target)

    def _record(self, move: Transition, target: E) -> None:
        """Keep the move in the history, take the new state, and report it (diag: always kept, rare)."""
        self.history.append(move)
        self.state = target
        diag.transition(self.owner, self.what, move.source, move.target, move.reason, move.execution, move.demotion)
