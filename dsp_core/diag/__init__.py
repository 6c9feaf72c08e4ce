"""DSP diagnostics: a ring of events by category and level, terminal records, a flight recorder.

    from dsp_core import diag
    diag.enable(categories="CACHE,SEGMENT", level="detailed")   # or DSP_DIAGNOSTICS=CACHE,SEGMENT
    model.run(feeds)
    diag.report(); diag.events(); diag.dump("diag.json"); diag.disable()

Emission points in the core test one module attribute first, so diagnostics that are
off cost one attribute load and branch per point (measured by benchmarks/diag_overhead.py)::

    if diag.ON:
        diag.emit(Category.CACHE, Level.SUMMARY, "miss", explanation)

Read ``diag.ON`` / ``diag.TIMED`` through the module at the point of use, never import
the names (``enable`` rebinds them). Lifecycle transitions and errors are rare and always
kept in a small flight ring, so a failure can be explained even with diagnostics off.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dsp_core.diag.events import (
    TERMINAL_STATES,
    Category,
    Event,
    Level,
    parse_categories,
    parse_level,
)
from dsp_core.diag.recorder import Recorder, TerminalRecord
from dsp_core.runtime import epoch

FORMAT = "dsp-diag/1"

ON: bool = False  # some category is on: emission points test this first
TIMED: bool = False  # TIMING is on at full level (or a trace was asked): slot-by-slot code runs timed

RECORDER = Recorder()
_levels: list[int] = [Level.OFF] * len(Category)  # per category: the most detailed level recorded
_flight: deque[Event] = deque(maxlen=2000)  # always on: lifecycle moves, errors, disk cache events
_plan_ids = itertools.count(1)
_state: dict[str, Any] = {"configured": False, "explicit": False, "file": "", "atexit": False}


# -- switching on and off ---------------------------------------------------------------
def enable(
    categories: str | Iterable[Category | str] = "ALL", level: str | Level = Level.SUMMARY, file: str | None = None
) -> None:
    """Record ``categories`` (names, 'ALL', members) at ``level``, the rest off; wins over DSP_DIAGNOSTICS*."""
    _state["explicit"] = True
    _apply(categories, level, file)


def _apply(categories: str | Iterable[Category | str], level: str | Level, file: str | None) -> None:
    chosen = _categories(categories)
    lvl = parse_level(level)
    for c in Category:
        _levels[c] = lvl if c in chosen else Level.OFF
    if file:
        _state["file"] = file
        _register_exit_dump()
    _refresh_flags()


def enable_timing() -> None:
    """Record per-slot timings (TIMING at full level) in addition to whatever is on."""
    _levels[Category.TIMING] = Level.FULL
    _refresh_flags()


def disable() -> None:
    """Record nothing more (the flight ring keeps its rare events); the ring keeps what it has."""
    for c in Category:
        _levels[c] = Level.OFF
    _refresh_flags()


def enabled(category: Category, level: Level = Level.SUMMARY) -> bool:
    """True when ``category`` is recorded at ``level``."""
    return level <= _levels[category]


def configure_from_env() -> None:
    """Apply DSP_DIAGNOSTICS, DSP_DIAGNOSTICS_LEVEL, DSP_DIAGNOSTICS_FILE, DSP_FLIGHT_EVENTS (once)."""
    if _state["configured"]:
        return
    from dsp_core import config

    global _flight
    _flight = deque(_flight, maxlen=int(config.get("flight_events")))
    names = str(config.get("diagnostics"))
    level_source = config.source("diagnostics_level")
    level = parse_level(config.get("diagnostics_level"))
    wanted = names.strip() or (level_source == "environment" and level is not Level.OFF)
    if wanted and not _state["explicit"]:
        _apply(names or "ALL", level, str(config.get("diagnostics_file")) or None)
    _state["configured"] = True  # only once valid: a bad value fails every compile, never silently


def _categories(categories: str | Iterable[Category | str]) -> frozenset[Category]:
    if isinstance(categories, str):
        return parse_categories(categories, "categories")
    chosen: set[Category] = set()
    for c in categories:
        chosen |= {c} if isinstance(c, Category) else parse_categories(c, "categories")
    return frozenset(chosen)


def _refresh_flags() -> None:
    global ON, TIMED
    ON = any(_levels)
    TIMED = _levels[Category.TIMING] >= Level.FULL
    epoch.bump()  # a bound step (IO binding) checks no flag: diagnostics on, it must take the full path


# -- emission ---------------------------------------------------------------------------
def emit(
    category: Category,
    level: Level,
    code: str,
    message: str = "",
    payload: float = 0.0,
    plan: int = -1,
    segment: int = -1,
    slot: int = -1,
    ts: int = 0,
) -> None:
    """Record one event if ``category`` is on at ``level`` (callers test ``diag.ON`` first)."""
    if level > _levels[category]:
        return
    now = ts or time.perf_counter_ns()
    RECORDER.add(Event(now, threading.get_ident(), category, level, plan, segment, slot, code, message, payload))


def _rare(category: Category, code: str, message: str, payload: float, owner: tuple[int, int, int]) -> Event:
    """An always-kept event (flight ring), also recorded when its category is on."""
    event = Event(
        time.perf_counter_ns(), threading.get_ident(), category, Level.SUMMARY, *owner, code, message, payload
    )
    _flight.append(event)
    if Level.SUMMARY <= _levels[category]:
        RECORDER.add(event)
    return event


def transition(
    owner: tuple[int, int, int], what: str, source: str, target: str, reason: str, execution: int, demotion: bool
) -> None:
    """A lifecycle move (plan, segment or slot): always kept; may write a terminal record."""
    plan, segment, slot = owner
    category = Category.GRAPH_REPLAY if segment < 0 and slot < 0 else Category.SEGMENT
    message = f"{what}: {source} -> {target}" + (f" ({reason})" if reason else "")
    _rare(category, "demote" if demotion else "move", message, execution, owner)
    plan_replaying = segment < 0 and target == "REPLAYING"  # the plan's success is not a segment's end
    if target in TERMINAL_STATES and slot < 0 and not plan_replaying:
        RECORDER.terminal(TerminalRecord(plan, segment, what, target, _why(target, reason, execution), execution))


def _why(state: str, reason: str, execution: int) -> str:
    if state == "REPLAYING":
        return f"captured at execution {execution}"
    if state == "OOM_DEFERRED":
        return f"capture ran out of memory at execution {execution}: {reason}"
    return reason


def error(exc: BaseException, plan: int = -1) -> None:
    """A step raised: always kept (the flight recorder's last word)."""
    _rare(Category.EXECUTE, "error", f"{type(exc).__name__}: {exc}"[:2000], 0.0, (plan, -1, -1))


def new_plan_id() -> int:
    """A process-unique id for a live plan (events and terminal records carry it)."""
    return next(_plan_ids)


def record_segment(segment: int, backend: str, names: Sequence[tuple[int, str, str]], times: list[int]) -> None:
    """Per-slot spans of one timed segment run: ``times[n]`` is when step n began, ``times[-1]`` the end."""
    done = next((n for n, t in enumerate(times) if t == 0), len(times)) - 1  # steps that finished
    if done < 0:
        return
    emit(Category.TIMING, Level.FULL, "segment", backend, times[done] - times[0], -1, segment, -1, times[0])
    for n in range(done):
        slot, op, node = names[n]
        emit(Category.TIMING, Level.FULL, op, node, times[n + 1] - times[n], -1, segment, slot, times[n])


def device_span(segment: int, slot: int, op: str, node: str, start_ns: int, duration_ns: int, device: int = 0) -> None:
    """Hook for a GPU backend's device timings (CUDA events): a slot's span on ``device``, perf_counter_ns clock."""
    # The span goes on the device's own trace track: its thread id is -(device + 1).
    if Level.FULL > _levels[Category.TIMING]:
        return
    RECORDER.add(Event(start_ns, -(device + 1), Category.TIMING, Level.FULL, -1, segment, slot, op, node, duration_ns))


def auction(plan: Any, result: Any) -> None:
    """An auction's result (a Partition): one AUCTION event per segment, one per fallback."""
    tag = f"plan {plan.content_hash[:12]}"
    winner = {}
    for seg in result.segments:
        winner.update(dict.fromkeys(seg.slots, seg.backend))
        span = f"slots {seg.slots[0]}..{seg.slots[-1]}" if seg.slots else "no slots"
        message = f"{tag}: {span} -> {seg.backend} ({seg.mode})"
        emit(Category.AUCTION, Level.SUMMARY, "segment", message, len(seg.slots), segment=seg.index)
    for slot, declines in sorted(result.declines.items()):
        for name, decline in declines:
            message = f"{tag}: {plan.slots[slot].op} slot {slot}: {name} declined ({decline}) -> {winner.get(slot)}"
            emit(Category.AUCTION, Level.SUMMARY, "fallback", message, 1, slot=slot)


def watch_disk_cache(cache: Any) -> None:
    """Subscribe to a DiskCache's events (quarantines, evictions, ...): recorded under CACHE."""
    configure_from_env()  # the disk cache is read before any model exists
    if _disk_event not in cache.listeners:
        cache.listeners.append(_disk_event)


def _disk_event(event: dict[str, Any]) -> None:
    kind = str(event.get("kind", "event"))
    _rare(Category.CACHE, f"disk_{kind}", f"{event.get('path', '')}: {event.get('reason', '')}", 0.0, (-1, -1, -1))


# -- reading ----------------------------------------------------------------------------
def events(category: Category | None = None) -> list[Event]:
    """Events still in the ring, oldest first (of one category if given)."""
    kept = RECORDER.events()
    return kept if category is None else [e for e in kept if e.category is category]


def terminal_records() -> list[TerminalRecord]:
    """Why each recent segment ended where it did (at most 64)."""
    return RECORDER.terminal_records()


def clear() -> None:
    """Forget every event, aggregate, terminal record and the flight ring."""
    RECORDER.clear()
    _flight.clear()


def snapshot(kind: str = "dump", last: int | None = None) -> dict[str, Any]:
    """The whole state as a JSON-able dict (the format of dumps and flight files)."""
    kept = RECORDER.events(last)
    if kind == "flight":  # the rare always-on events too, merged in time order
        seen = {id(e) for e in kept}
        kept = sorted(kept + [e for e in list(_flight) if id(e) not in seen], key=lambda e: e.ts)
        kept = kept[-(last or len(kept)) :]
    return {
        "format": FORMAT,
        "kind": kind,
        "pid": os.getpid(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "clock_offset_ns": time.time_ns() - time.perf_counter_ns(),
        "levels": {c.name: Level(_levels[c]).name for c in Category if _levels[c]},
        "written": RECORDER.written,
        "capacity": RECORDER.capacity,
        "aggregates": RECORDER.aggregates(),
        "codes": RECORDER.code_counts(),
        "ops": RECORDER.op_totals(),
        "terminal": [r.as_dict() for r in RECORDER.terminal_records()],
        "events": [e.as_dict() for e in kept],
    }


def dump(path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``snapshot()`` as JSON to ``path`` (default DSP_DIAGNOSTICS_FILE); returns the path."""
    target = Path(path or _state["file"] or "dsp-diag.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(snapshot(), indent=1))
    return target


def report(plan_ids: Iterable[int] | None = None) -> dict[str, Any]:
    """Counts, recaptures, fallbacks, cache misses with explanations, terminal records (see diag.report)."""
    from dsp_core.diag.reports import build_report

    return build_report(snapshot(), plan_ids)


def flight_size() -> int:
    """How many events a flight file keeps."""
    return _flight.maxlen or 0


def _register_exit_dump() -> None:
    if not _state["atexit"]:
        _state["atexit"] = True
        atexit.register(_dump_at_exit)


def _dump_at_exit() -> None:
    if _state["file"]:
        try:
            dump(_state["file"])
        except OSError:
            pass  # the process is leaving: nowhere to report it


__all__ = [
    "Category",
    "Event",
    "Level",
    "TerminalRecord",
    "clear",
    "configure_from_env",
    "disable",
    "dump",
    "emit",
    "enable",
    "enable_timing",
    "events",
    "report",
    "snapshot",
    "terminal_records",
]
