"""Islands and gaps: when a capture fails because of some slots, only those slots run eagerly.

A capturing backend's unit whose capture fails (a host transfer or sync inside it, a
kernel that raised while recording, an injected fault) is not given up: the core finds
the slots that made it fail and captures the rest of the unit as islands around them,
with the offending slots as eager *gaps* (run on the backend, eagerly, between its
islands). One op never costs the whole plan its replay.

How the offending slots are found, within the step whose capture failed:

- the backend names the slot (``CaptureFailed(message, slot=s)``): the unit is cut
  into ``before``, the gap ``[s]`` and ``after``, and ``before`` and ``after`` are tried;
- it does not: the unit is bisected and each half tried, down to single slots.

Pieces are tried in plan order, each warmed (run eagerly: later pieces read its outputs)
then captured, so the step's outputs stay right whatever fails. A gap's reason is the
failure that isolated it. The gaps are remembered in the plan (``Plan.capture_gaps``,
per backend, kept in DSP1 so a disk-cached plan has them): later live plans and later
processes cut those slots out before capturing and never fail on them again.

``DSP_CAPTURE_FAULT=OP[,OP...]`` (a test switch) makes every capture of a slot of those
ops fail, on every capturing backend: the core raises before the backend records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dsp_core import config
from dsp_core.backends.base import Backend, CaptureFailed
from dsp_core.plan.plan import Plan

INJECTED = "injected capture failure (DSP_CAPTURE_FAULT)"


def injected_ops() -> frozenset[str]:
    """The ops DSP_CAPTURE_FAULT names (empty when unset)."""
    raw = str(config.get("capture_fault"))
    return frozenset(op.strip() for op in raw.split(",") if op.strip())


def check_capture_fault(plan: Plan, slots: Iterable[int]) -> None:
    """CaptureFailed naming the first slot whose op DSP_CAPTURE_FAULT lists (nothing when unset)."""
    ops = injected_ops()
    if not ops:
        return
    for s in slots:
        slot = plan.slots[s]
        if slot.op in ops:
            raise CaptureFailed(f"{INJECTED}: {slot.op} node {slot.name!r} (slot {s})", slot=s)


def learned_gaps(plan: Plan, backend: Backend) -> dict[int, str]:
    """Slots known to fail capture on ``backend`` (slot -> reason)."""
    return plan.capture_gaps.get(backend.name, {})


def remember_gap(plan: Plan, backend: Backend, slot: int, reason: str) -> bool:
    """Record that ``slot`` cannot be captured on ``backend``; True when it was not known yet."""
    known = plan.capture_gaps.setdefault(backend.name, {})
    if slot in known:
        return False
    known[slot] = reason
    return True


@dataclass(frozen=True)
class Try:
    """Warm and capture these slots as one island."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class Gap:
    """Run this slot eagerly between islands, for this reason."""

    slots: tuple[int, ...]
    reason: str


Step = Try | Gap


def after_failure(slots: tuple[int, ...], failure: CaptureFailed) -> list[Step]:
    """What to do next with ``slots`` whose capture just failed with ``failure``, in plan order."""
    reason = str(failure)
    bad = failure.slot
    if bad is not None and bad in slots:
        i = slots.index(bad)
        steps: list[Step] = [Try(slots[:i])] if i else []
        steps.append(Gap((bad,), reason))
        if i + 1 < len(slots):
            steps.append(Try(slots[i + 1 :]))
        return steps
    if len(slots) == 1:
        return [Gap(slots, reason)]
    mid = len(slots) // 2
    return [Try(slots[:mid]), Try(slots[mid:])]


def gap_reason(slot: int, reason: str) -> str:
    """How a learned gap is reported."""
    return f"gap: slot {slot} failed to capture: {reason}"
