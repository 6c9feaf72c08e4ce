"""Memory of a captured island: one device block, laid out before capture.

A CUDA graph bakes in every address its kernels touch, so nothing it uses may be freed
and handed out again while the graph lives (CuPy's pool would do exactly that with a
temporary freed after capture). The island therefore runs its warm-up under a
*tracing* allocator that records every allocation its kernels make (size, when made,
when freed); ``plan_intervals`` lays those lifetimes out in one block, reusing memory
between allocations whose lifetimes do not overlap (greedy by size, the classic
interval-packing heuristic); the capture then runs under a *replaying* allocator that
hands out the planned offsets in the same order. The block is allocated before capture
and lives as long as the graph.

``plan_intervals`` and ``AllocationTrace`` are pure Python (unit-tested on the CPU);
``TracingAllocator`` and ``PlannedAllocator`` need CuPy.
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, field
from typing import Any

ALIGN = 256  # cudaMalloc's alignment; vectorised kernels rely on it


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Interval:
    """One buffer's lifetime in allocation-event order: live in [start, end)."""

    size: int
    start: int
    end: int  # exclusive; a buffer never freed ends at the trace's length


def overlaps(a: Interval, b: Interval) -> bool:
    """True when the two lifetimes share an instant."""
    return a.start < b.end and b.start < a.end


def plan_intervals(intervals: list[Interval], alignment: int = ALIGN) -> tuple[list[int], int]:
    """Offsets for ``intervals`` in one block, and the block's size.

    Greedy by size: the largest buffer is placed first, each at the lowest offset where it
    overlaps no buffer already placed that is alive at the same time. Two buffers share
    memory only when their lifetimes do not overlap.
    """
    order = sorted(range(len(intervals)), key=lambda i: (-intervals[i].size, intervals[i].start))
    offsets = [0] * len(intervals)
    placed: list[int] = []
    total = 0
    for i in order:
        me = intervals[i]
        size = align(max(me.size, 1), alignment)
        busy = sorted(
            (offsets[j], align(max(intervals[j].size, 1), alignment)) for j in placed if overlaps(me, intervals[j])
        )
        offset = 0
        for start, length in busy:
            if offset + size <= start:
                break
            offset = max(offset, start + length)
        offsets[i] = offset
        placed.append(i)
        total = max(total, offset + size)
    return offsets, total


@dataclass
class AllocationTrace:
    """Allocations in the order a run made them, with when each was freed."""

    sizes: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int | None] = field(default_factory=list)
    clock: int = 0

    def alloc(self, size: int) -> int:
        """Record an allocation; returns its index."""
        self.sizes.append(size)
        self.starts.append(self.clock)
        self.ends.append(None)
        self.clock += 1
        return len(self.sizes) - 1

    def free(self, index: int) -> None:
        """Record that allocation ``index`` was freed."""
        self.ends[index] = self.clock
        self.clock += 1

    def intervals(self) -> list[Interval]:
        """Lifetimes; what was never freed lives to the end (it is still held after the run)."""
        end = self.clock + 1
        return [Interval(s, a, e if e is not None else end) for s, a, e in zip(self.sizes, self.starts, self.ends)]


# Every free callback handed to CuPy stays reachable from here while any memory may call it. A
# callback reachable only from garbage (an allocator and its arrays in a reference cycle) is
# cleared by the garbage collector like the rest (a function loses its closure), and a memory
# object of the same cycle freed after that called it: SIGSEGV in ``free`` while collecting, on
# the H200 (tests/gpu/test_nvrtc_gpu.py). Pruned when a new one comes: a callback that only
# this list and the call to ``getrefcount`` refer to has no memory left to call it.
_CALLBACKS: list[Any] = []
# Let go at exit, before the modules are torn down: a callback held here past CuPy's teardown freed
# its traced memory then (SIGSEGV at exit in a TRITON pipeline's process, on the H200); released
# at atexit, the callbacks die with the last memory that refers to them, as CuPy's own do.
atexit.register(_CALLBACKS.clear)


def _refcounts(items: list[Any]) -> list[int]:
    return [sys.getrefcount(c) for c in items]


# What _refcounts gives for an item only its list refers to (the list, the loop's name, the call's
# argument: 3 on CPython 3.11-3.13), measured rather than assumed
_UNREFERENCED = _refcounts([lambda: None])[0]


def _keep(callback: Any) -> Any:
    """``callback``, kept reachable from the module (see _CALLBACKS), the unreferenced ones pruned."""
    _CALLBACKS[:] = [c for c, n in zip(_CALLBACKS, _refcounts(_CALLBACKS)) if n > _UNREFERENCED]
    _CALLBACKS.append(callback)
    return callback


def _free_callback(live: dict[int, tuple[int, Any]], trace: AllocationTrace) -> Any:
    """The free callback of a TracingAllocator: records the free of a traced allocation.

    An array outliving its warm-up is freed whenever it dies, at the latest when the
    interpreter exits, after the modules and even the builtins are torn down: a callback
    that then looks up a global or a builtin, or raises (and so has ``except`` look up the
    exception class), crashes the process (SIGSEGV at exit on the H200, in a cold TRITON
    pipeline's process). So it holds what it needs in its closure, never touches the
    allocator object (whose attributes a garbage collector may have cleared), calls no
    builtin and cannot raise: ``ptr`` comes as an int, ``pop`` has a default. While the
    process runs it is kept reachable (``_keep``), so a collection never clears its closure.
    """

    def free(ptr: int, *_device: Any) -> None:
        entry = live.pop(ptr, None)
        if entry is not None:
            trace.free(entry[0])

    return _keep(free)


def _ignore_free(ptr: int, *_device: Any) -> None:
    """The PlannedAllocator's free: planned memory is reused by plan only, unplanned memory is held
    until release. A module function: reachable while the process runs (see _CALLBACKS)."""


class TracingAllocator:
    """A CuPy allocator (for ``cupy.cuda.using_allocator``) that records an AllocationTrace."""

    def __init__(self, cupy: Any) -> None:
        self.trace = AllocationTrace()
        self._pool = cupy.cuda.MemoryPool()  # private: the warm-up's memory goes back here
        self._live: dict[int, tuple[int, Any]] = {}
        self.allocator = cupy.cuda.memory.PythonFunctionAllocator(self._malloc, _free_callback(self._live, self.trace))

    def _malloc(self, size: int, *_device: Any) -> int:
        mem = self._pool.malloc(size)
        self._live[int(mem.ptr)] = (self.trace.alloc(size), mem)
        return int(mem.ptr)

    def close(self) -> None:
        """Give the warm-up's memory back (the arrays still alive keep theirs until they die)."""
        self._live.clear()
        self._pool.free_all_blocks()


class PlannedAllocator:
    """A CuPy allocator that replays a trace: the k-th allocation gets the k-th planned offset.

    An allocation the trace did not foresee (other size, or more of them) is served from a
    private pool and kept until release, so the graph's memory is never handed out again;
    ``unplanned`` counts those.
    """

    def __init__(self, cupy: Any, trace: AllocationTrace) -> None:
        self.sizes = list(trace.sizes)
        self.offsets, self.nbytes = plan_intervals(trace.intervals())
        self.block = cupy.cuda.alloc(max(self.nbytes, ALIGN))  # before capture; lives with the graph
        self._cupy = cupy
        self._next = 0
        self.unplanned: list[Any] = []
        self.allocator = cupy.cuda.memory.PythonFunctionAllocator(self._malloc, _ignore_free)

    def rewind(self) -> None:
        """Start handing out offsets from the first again (a new capture)."""
        self._next = 0

    def _malloc(self, size: int, *_device: Any) -> int:
        k = self._next
        self._next += 1
        if k < len(self.sizes) and self.sizes[k] == size:
            return int(self.block.ptr) + self.offsets[k]
        mem = self._cupy.cuda.alloc(size)  # not foreseen: kept alive until release, never reused
        self.unplanned.append(mem)
        return int(mem.ptr)
