"""What the diagnostics record: categories, levels, events and segment terminal records."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from dsp_core.errors import ConfigError


class Category(enum.IntEnum):
    """What an event is about; each can be switched on by name (DSP_DIAGNOSTICS=CACHE,SEGMENT)."""

    EXECUTE = 0  # one step of a live plan
    SEGMENT = 1  # a segment's or slot's lifecycle move
    GRAPH_REPLAY = 2  # plan phase moves, captures, recaptures, refreshes, drift
    STREAM_SYNC = 3  # host/device synchronisation (GPU backends)
    MULTI_DEVICE = 4  # work split across devices: a placed plan's device switches (dsp_core.devices)
    TRANSFER = 5  # staging copies, bridges, cross-device copies (with their reason)
    BACKEND = 6  # a backend's own notes
    MEMORY = 7  # buffer allocation and release
    TIMING = 8  # per-slot and per-segment spans (full level only)
    CACHE = 9  # plan builds, hits, misses (with the explanation), disk cache events
    COMPILE = 10  # plan and segment compile times
    AUCTION = 11  # which backend won each segment, and every fallback


class Level(enum.IntEnum):
    """How much is recorded: each level includes the ones below it."""

    OFF = 0
    SUMMARY = 1  # rare events: builds, misses, lifecycle moves, failures
    DETAILED = 2  # per step: executions, staging copies
    FULL = 3  # per slot: timings


class Event(NamedTuple):
    """One recorded event (timestamps in perf_counter nanoseconds)."""

    ts: int
    thread: int
    category: Category
    level: Level
    plan: int  # live plan id (-1: none)
    segment: int  # segment or unit index (-1: none)
    slot: int  # slot index (-1: none)
    code: str  # short machine-readable kind: "miss", "recapture", an op name for TIMING
    message: str
    payload: float  # a number: bytes, nanoseconds, an execution count

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (category and level by name)."""
        return {**self._asdict(), "category": self.category.name, "level": self.level.name}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Event:
        """The inverse of ``as_dict``."""
        return cls(**{**row, "category": Category[row["category"]], "level": Level[row["level"]]})


# The states a segment (or the plan) ends in; reaching one writes a terminal record.
TERMINAL_STATES = frozenset({"FAILED", "REPLAYING", "OOM_DEFERRED", "REPLAY_BLOCKED"})


def parse_categories(text: str, where: str = "DSP_DIAGNOSTICS") -> frozenset[Category]:
    """'CACHE,SEGMENT' or 'ALL' (any case; empty = none); ConfigError naming the bad name."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names == ["ALL"]:
        return frozenset(Category)
    bad = [n for n in names if n not in Category.__members__]
    if bad:
        allowed = ", ".join(["ALL", *Category.__members__])
        raise ConfigError(f"{where} = {text!r}: unknown category {bad[0]!r}; expected a comma list of {allowed}")
    return frozenset(Category[n] for n in names)


def parse_level(value: str | Level) -> Level:
    """A Level from its name in any case; ConfigError naming the allowed ones."""
    if isinstance(value, Level):
        return value
    try:
        return Level[str(value).strip().upper()]
    except KeyError:
        allowed = ", ".join(n.lower() for n in Level.__members__)
        raise ConfigError(f"diagnostics level {value!r} is invalid: expected one of {allowed}") from None
