"""Transfer analytics: every cross-device copy of a placed plan, typed, per step.

A copy has a reason:
- ACTIVATION: a value computed on one device and read on another (every step);
- CONSTANT_REPLICATION: a weight (or a value computed only from weights) that a second
  device reads; copied once and cached while the source array stays the same object;
- KV_CACHE: mutable state (a VARIABLE input, e.g. a KV buffer) read on a device other than
  its home; a value written in place there is copied back;
- INPUT_MIGRATION: a fed input read on a device other than the caller's (device 0);
- OUTPUT_RETURN: a requested output computed on a device other than the caller's.

The recorder keeps the last ``KEEP_STEPS`` steps' records and exact totals over all
steps; with diagnostics on, each copy is a TRANSFER event (payload: bytes) and each
device switch a MULTI_DEVICE event.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dsp_core import diag
from dsp_core.diag import Category, Level

KEEP_STEPS = 256


class Reason(enum.Enum):
    """Why a value crossed devices."""

    ACTIVATION = "activation"
    CONSTANT_REPLICATION = "constant_replication"
    KV_CACHE = "kv_cache"
    INPUT_MIGRATION = "input_migration"
    OUTPUT_RETURN = "output_return"


@dataclass(frozen=True)
class Copy:
    """One cross-device copy."""

    step: int
    segment: int  # index of the segment (or unit) whose run needed it
    reason: Reason
    name: str  # the value's graph name
    src: int  # device (HOST = -1 for the host)
    dst: int
    nbytes: int
    modelled_s: float  # bytes / the topology's bandwidth between src and dst
    measured_s: float | None  # host wall time of the copy (stub devices); None where it is asynchronous

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "step": self.step,
            "segment": self.segment,
            "reason": self.reason.name,
            "name": self.name,
            "src": self.src,
            "dst": self.dst,
            "bytes": self.nbytes,
            "modelled_s": self.modelled_s,
            "measured_s": self.measured_s,
        }


@dataclass(frozen=True)
class Switch:
    """Execution moved from one device to another between two segments of a step."""

    step: int
    segment: int
    src: int
    dst: int


@dataclass
class StepTransfers:
    """The copies and device switches of one step."""

    step: int
    copies: list[Copy] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes copied in this step."""
        return sum(c.nbytes for c in self.copies)

    @property
    def modelled_s(self) -> float:
        """Modelled seconds of this step's copies."""
        return sum(c.modelled_s for c in self.copies)

    def by_reason(self) -> dict[str, int]:
        """Bytes per reason."""
        out: dict[str, int] = {}
        for c in self.copies:
            out[c.reason.name] = out.get(c.reason.name, 0) + c.nbytes
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "step": self.step,
            "bytes": self.nbytes,
            "modelled_s": self.modelled_s,
            "by_reason": self.by_reason(),
            "copies": [c.as_dict() for c in self.copies],
            "switches": [{"segment": s.segment, "src": s.src, "dst": s.dst} for s in self.switches],
        }


@dataclass
class Totals:
    """Exact counts over every step (they survive the recorder's window)."""

    steps: int = 0
    copies: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    modelled_s: dict[str, float] = field(default_factory=dict)
    switches: int = 0

    def add(self, copy: Copy) -> None:
        key = copy.reason.name
        self.copies[key] = self.copies.get(key, 0) + 1
        self.nbytes[key] = self.nbytes.get(key, 0) + copy.nbytes
        self.modelled_s[key] = self.modelled_s.get(key, 0.0) + copy.modelled_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "steps": self.steps,
            "switches": self.switches,
            "copies": dict(self.copies),
            "bytes": dict(self.nbytes),
            "modelled_s": dict(self.modelled_s),
            "total_bytes": sum(self.nbytes.values()),
        }


class TransferRecorder:
    """Per-step copy and switch records of one placed plan."""

    def __init__(self, plan_id: int = -1) -> None:
        self.plan_id = plan_id
        self.steps: deque[StepTransfers] = deque(maxlen=KEEP_STEPS)
        self.totals = Totals()
        self.lock = threading.Lock()
        self._device = -2  # the device the last segment ran on (-2: none yet this step)

    def begin_step(self) -> int:
        """Open a new step record; returns its number (from 1)."""
        with self.lock:
            self.totals.steps += 1
            self.steps.append(StepTransfers(self.totals.steps))
            self._device = -2
            return self.totals.steps

    @property
    def step(self) -> int:
        """The current step's number (0 before the first)."""
        return self.totals.steps

    def copy(self, copy: Copy) -> None:
        """Record one copy."""
        with self.lock:
            if not self.steps:
                self.steps.append(StepTransfers(self.totals.steps))
            self.steps[-1].copies.append(copy)
            self.totals.add(copy)
        if diag.ON:
            message = f"{copy.reason.name} {copy.name} {copy.src}->{copy.dst}"
            diag.emit(
                Category.TRANSFER,
                Level.SUMMARY,
                copy.reason.name.lower(),
                message,
                copy.nbytes,
                self.plan_id,
                copy.segment,
            )

    def enter(self, device: int, segment: int) -> None:
        """A segment starts on ``device``: a switch when the step's previous segment ran elsewhere."""
        with self.lock:
            previous, self._device = self._device, device
            if previous in (-2, device):
                return
            switch = Switch(self.totals.steps, segment, previous, device)
            if self.steps:
                self.steps[-1].switches.append(switch)
            self.totals.switches += 1
        if diag.ON:
            diag.emit(
                Category.MULTI_DEVICE,
                Level.SUMMARY,
                "switch",
                f"device {previous} -> {device}",
                1,
                self.plan_id,
                segment,
            )

    def records(self) -> list[StepTransfers]:
        """The kept steps, oldest first."""
        with self.lock:
            return list(self.steps)

    def summary(self) -> dict[str, Any]:
        """Totals over every step, and the last step's record."""
        with self.lock:
            last = self.steps[-1].as_dict() if self.steps else None
            return {**self.totals.as_dict(), "last_step": last}
