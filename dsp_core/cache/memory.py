"""The in-memory plan cache: one live plan per shape signature, LRU with pins and budgets.

A *shape signature* is the explicit, hashable key of a live plan: the requested outputs,
each fed input's shape and dtype, the execution mode and the plan's content hash. A run
with a signature seen before gets the same live plan object; a new one builds a plan.
Eviction is least-recently-used, skips pinned plans (a plan is pinned while it runs),
and keeps both the count and the estimated bytes under their bounds. ``clear()`` empties
the cache and is meant for explicit boundaries only (a model reload, a test's teardown).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

from dsp_core import diag
from dsp_core.counters import Counters
from dsp_core.diag import Category, Level

log = logging.getLogger("dsp.cache")


@dataclass(frozen=True, slots=True)
class ShapeSignature:
    """What makes two runs share a plan: outputs, feed shapes and dtypes, mode, plan hash."""

    outputs: tuple[str, ...]
    feed_names: tuple[str, ...]  # the fed inputs, in input order
    feeds: tuple[tuple[tuple[int, ...], Any], ...]  # (shape, numpy dtype) of each fed input
    mode: str
    plan_hash: str
    thread: int | None = None  # set only where a backend's executors are thread-local
    # computed once: a replay looks its plan up every call (never persisted: str hashes are per process)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = (self.outputs, self.feed_names, self.feeds, self.mode, self.plan_hash, self.thread)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    def differences(self, other: ShapeSignature) -> list[str]:
        """Human-readable differences from ``other`` ('placeholder x: shape (1, 7) vs cached (1, 1)')."""
        out: list[str] = []
        mine = dict(zip(self.feed_names, self.feeds))
        theirs = dict(zip(other.feed_names, other.feeds))
        for name in mine.keys() | theirs.keys():
            a, b = mine.get(name), theirs.get(name)
            if a is None or b is None:
                out.append(
                    f"placeholder {name}: {'absent' if a is None else 'present'} vs cached "
                    f"{'absent' if b is None else 'present'}"
                )
                continue
            if a[0] != b[0]:
                out.append(f"placeholder {name}: shape {a[0]} vs cached {b[0]}")
            if a[1] != b[1]:
                out.append(f"placeholder {name}: dtype {a[1]} vs cached {b[1]}")
        for f in fields(self):
            if f.compare and f.name not in ("feeds", "feed_names") and getattr(self, f.name) != getattr(other, f.name):
                out.append(f"{f.name}: {getattr(self, f.name)!r} vs cached {getattr(other, f.name)!r}")
        return sorted(out)


@dataclass
class LivePlan:
    """A plan made live for one shape signature: what runs, how often, how big, who holds it."""

    signature: ShapeSignature
    executor: Any  # runtime.model.Executor: the base plan's partition and eager segments (shared)
    runtime: Any = None  # runtime.plan_runtime.PlanRuntime: this signature's lifecycle
    nbytes: int = 0  # estimated bytes this signature holds beyond the shared base plan
    pins: int = 0
    runs: int = 0
    created: float = field(default_factory=time.monotonic)


@dataclass
class CacheStats(Counters):
    """Counters of one model's plan caches, for tests, reports and `dsp plan show`."""

    plan_builds: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    evictions: int = 0
    quarantines: int = 0


def available_host_bytes() -> int:
    """Memory the OS says is available (MemAvailable), or total physical memory as a fallback."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class PlanCache:
    """Shape signature -> LivePlan, least-recently-used, bounded by count and bytes."""

    def __init__(
        self, capacity: int, budget_bytes: int, stats: CacheStats | None = None, explain_misses: bool = False
    ) -> None:
        if capacity < 1:
            raise ValueError("plan cache capacity must be at least 1")
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self.stats = stats if stats is not None else CacheStats()
        self.explain_misses = explain_misses
        self.last_miss: list[str] = []
        self._plans: OrderedDict[ShapeSignature, LivePlan] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, signature: ShapeSignature) -> bool:
        return signature in self._plans

    @property
    def nbytes(self) -> int:
        """Estimated bytes held by every cached live plan."""
        return sum(p.nbytes for p in self._plans.values())

    def acquire(self, signature: ShapeSignature) -> LivePlan | None:
        """The live plan for ``signature``, pinned and made most recent; None on a miss."""
        with self._lock:
            live = self._plans.get(signature)
            if live is None:
                self.last_miss = self._explain(signature)
                if self.explain_misses:
                    log.warning("DSP plan cache miss: %s", "; ".join(self.last_miss) or "cache empty")
                if diag.ON:
                    diag.emit(Category.CACHE, Level.SUMMARY, "miss", "; ".join(self.last_miss) or "cache empty")
                return None
            self._plans.move_to_end(signature)
            live.pins += 1
            self.stats.memory_hits += 1
            if diag.ON:
                diag.emit(Category.CACHE, Level.DETAILED, "hit", "", self.stats.memory_hits, _plan_id(live))
            return live

    def insert(self, live: LivePlan) -> LivePlan:
        """Add a freshly built live plan (pinned for the caller); evicts to stay in bounds.

        When another thread inserted the same signature first, that plan is returned
        (pinned) instead, so one signature never has two live plans.
        """
        with self._lock:
            existing = self._plans.get(live.signature)
            if existing is not None:
                existing.pins += 1
                return existing
            live.pins += 1
            self._plans[live.signature] = live
            self.stats.plan_builds += 1
            if diag.ON:
                message = _describe(live.signature)
                diag.emit(Category.CACHE, Level.SUMMARY, "build", message, live.nbytes, _plan_id(live))
            self._evict()
            return live

    def release(self, live: LivePlan) -> None:
        """Unpin a plan acquired or inserted by the caller."""
        with self._lock:
            live.pins -= 1
            live.runs += 1

    def _evict(self) -> None:
        for sig in list(self._plans):
            if len(self._plans) <= self.capacity and self.nbytes <= self.budget_bytes:
                return
            if self._plans[sig].pins == 0:
                evicted = self._plans.pop(sig)
                if evicted.runtime is not None:
                    evicted.runtime.release()
                self.stats.evictions += 1
                if diag.ON:
                    diag.emit(Category.CACHE, Level.SUMMARY, "evict", _describe(sig), evicted.nbytes, _plan_id(evicted))

    def clear(self) -> None:
        """Drop every unpinned plan, releasing its runtime. Call only at explicit boundaries (reload, teardown)."""
        with self._lock:
            for sig in [s for s, p in self._plans.items() if p.pins == 0]:
                dropped = self._plans.pop(sig)
                if dropped.runtime is not None:  # free buffers and recordings, as eviction does
                    dropped.runtime.release()

    def signatures(self) -> list[ShapeSignature]:
        """Cached signatures, least recent first."""
        with self._lock:
            return list(self._plans)

    def live_plans(self) -> list[LivePlan]:
        """Cached live plans, least recent first (not pinned: for reports only)."""
        with self._lock:
            return list(self._plans.values())

    def _explain(self, signature: ShapeSignature) -> list[str]:
        """Differences from the nearest cached signature (fewest differing parts)."""
        best: list[str] | None = None
        for cached in self._plans:
            diff = signature.differences(cached)
            if best is None or len(diff) < len(best):
                best = diff
        return best or []


# -- diagnostics (dsp_core.diag) -------------------------------------------------------------
def _plan_id(live: LivePlan) -> int:
    """The diag id of a live plan's runtime (-1 before it has one)."""
    return int(getattr(live.runtime, "diag_id", -1))


def _describe(signature: ShapeSignature) -> str:
    """A signature in one line, for cache events."""
    feeds = ", ".join(f"{n}{list(shape)}:{dtype}" for n, (shape, dtype) in zip(signature.feed_names, signature.feeds))
    return f"plan {signature.plan_hash[:12]} mode {signature.mode}: {feeds}"
