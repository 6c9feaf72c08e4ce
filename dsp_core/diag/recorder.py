"""The recorder: a lock-protected ring of events, aggregates that survive wrap-around, terminal records."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from dsp_core.diag.events import Category, Event

RING_CAPACITY = 65_536
MAX_TERMINAL_RECORDS = 64


@dataclass
class Aggregate:
    """Count, sum, min and max of the payloads of every event of one category ever recorded."""

    count: int = 0
    total: float = 0.0
    minimum: float = float("inf")
    maximum: float = float("-inf")

    def add(self, value: float) -> None:
        """Fold one payload in."""
        self.count += 1
        self.total += value
        if value < self.minimum:
            self.minimum = value
        if value > self.maximum:
            self.maximum = value

    def as_dict(self) -> dict[str, float]:
        """JSON-able form (min/max are 0 while the count is 0)."""
        empty = self.count == 0
        return {
            "count": self.count,
            "sum": self.total,
            "min": 0.0 if empty else self.minimum,
            "max": 0.0 if empty else self.maximum,
        }


@dataclass(frozen=True)
class TerminalRecord:
    """Why one segment (segment -1: the plan itself) ended in its final state."""

    plan: int
    segment: int
    what: str  # "segment 3 (emulated_replay)", "plan"
    state: str  # FAILED, REPLAYING, OOM_DEFERRED, REPLAY_BLOCKED
    reason: str
    execution: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


class Recorder:
    """Events in a fixed ring (oldest overwritten), plus exact per-category and per-code counts."""

    def __init__(self, capacity: int = RING_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Forget every event, aggregate and terminal record."""
        with self._lock:
            self._ring: list[Event | None] = [None] * self.capacity
            self._written = 0
            self._aggregates = {c: Aggregate() for c in Category}
            self._codes: dict[tuple[Category, str], int] = {}
            self._ops: dict[str, Aggregate] = {}
            self._terminal: OrderedDict[tuple[int, int], TerminalRecord] = OrderedDict()

    def add(self, event: Event) -> None:
        """Record one event (any thread)."""
        with self._lock:
            self._ring[self._written % self.capacity] = event
            self._written += 1
            self._aggregates[event.category].add(event.payload)
            key = (event.category, event.code)
            self._codes[key] = self._codes.get(key, 0) + 1
            if event.category is Category.TIMING and event.slot >= 0:
                self._ops.setdefault(event.code, Aggregate()).add(event.payload)

    def terminal(self, record: TerminalRecord) -> None:
        """Keep ``record`` as the segment's latest end state (at most MAX_TERMINAL_RECORDS, oldest dropped)."""
        key = (record.plan, record.segment)
        with self._lock:
            self._terminal.pop(key, None)
            self._terminal[key] = record
            while len(self._terminal) > MAX_TERMINAL_RECORDS:
                self._terminal.popitem(last=False)

    @property
    def written(self) -> int:
        """Events recorded since the last clear (including those the ring overwrote)."""
        return self._written

    def events(self, last: int | None = None) -> list[Event]:
        """The events still in the ring, oldest first (only the ``last`` ones if given)."""
        with self._lock:
            n = min(self._written, self.capacity)
            if last is not None:
                n = min(n, last)
            start = self._written - n
            out = [self._ring[i % self.capacity] for i in range(start, self._written)]
        return [e for e in out if e is not None]

    def terminal_records(self) -> list[TerminalRecord]:
        """The kept terminal records, oldest first."""
        with self._lock:
            return list(self._terminal.values())

    def aggregates(self) -> dict[str, dict[str, float]]:
        """Per category: count, sum, min, max of every event ever recorded."""
        with self._lock:
            return {c.name: a.as_dict() for c, a in self._aggregates.items()}

    def code_counts(self) -> dict[str, int]:
        """'CATEGORY.code' -> count of every event ever recorded."""
        with self._lock:
            return {f"{c.name}.{code}": n for (c, code), n in sorted(self._codes.items())}

    def op_totals(self) -> dict[str, dict[str, float]]:
        """Per op: count and total nanoseconds of every timed slot ever recorded."""
        with self._lock:
            return {op: a.as_dict() for op, a in self._ops.items()}
