"""Resolving a mode to backends and cutting a plan into segments: the AUTO auction.

Each slot goes to the first backend of the platform's fallback chain that is available
and supports it; consecutive slots with the same winner form a segment. Every decline
(backend, slot, typed reason) and each segment's bids are recorded for `dsp plan explain`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from dsp_core import diag
from dsp_core.backends.base import Backend, Decline, DeclineReason, Registry, SlotView
from dsp_core.backends.modes import (
    FALLBACK_CHAINS,
    GPU_MODES,
    PLATFORM_ORDER,
    GraphExecutionMode,
    provider_hint,
)
from dsp_core.errors import BackendError, BackendUnavailableError
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Plan, Segment

M = GraphExecutionMode


@dataclass
class Partition:
    """The auction's result for one plan: segments, their backends, and the record."""

    mode: GraphExecutionMode  # the mode asked for
    chain: tuple[Backend, ...]  # candidates in preference order
    segments: list[Segment]
    backends: dict[str, Backend]  # backend name -> backend
    declines: dict[int, list[tuple[str, Decline]]] = field(default_factory=dict)  # slot -> declines
    bids: dict[int, dict[str, float]] = field(default_factory=dict)  # segment -> backend -> cost
    notes: list[str] = field(default_factory=list)

    def fallback_fraction(self, reference: str = "slot_by_slot") -> float:
        """Fraction of slots that ended on the reference backend while others were asked first."""
        total = sum(len(s.slots) for s in self.segments)
        if total == 0 or len(self.chain) <= 1:
            return 0.0
        fell = sum(len(s.slots) for s in self.segments if s.backend == reference)
        return fell / total

    def resolved(self) -> list[str]:
        """Backend names in use, in segment order, without repeats."""
        seen: list[str] = []
        for s in self.segments:
            if s.backend not in seen:
                seen.append(s.backend)
        return seen


def slot_view(plan: Plan, index: int) -> SlotView:
    """What a backend's ``supports`` sees of slot ``index``."""
    slot = plan.slots[index]
    return SlotView(
        index=index,
        op=slot.op,
        domain=slot.domain,
        traits=slot.traits,
        attrs=dict(slot.attrs),
        input_dtypes=tuple(plan.ref_info(r)[0] for r in slot.inputs),
        output_dtypes=tuple(plan.ref_info(v)[0] for v in slot.outputs if v is not None),
    )


def candidates(registry: Registry, mode: GraphExecutionMode) -> tuple[list[Backend], list[str]]:
    """The backends to try for ``mode``, most preferred first, and notes on remapping."""
    notes: list[str] = []
    if mode is M.AUTO:
        for platform in PLATFORM_ORDER:
            chain = [
                b
                for m in FALLBACK_CHAINS[platform]
                for b in registry.for_mode(m)
                if b.platform in (platform, "cpu") and b.availability().ok
            ]
            if any(b.platform == platform for b in chain):
                return _with_reference(chain, registry), notes
        raise BackendUnavailableError(
            "AUTO found no available backend, not even the CPU reference; "
            f"{provider_hint(M.SLOT_BY_SLOT)} (failures: {_failures(registry)})"
        )
    installed = registry.for_mode(mode)
    if not installed and not (mode in GPU_MODES and not gpu_present(registry)):
        raise BackendUnavailableError(f"no installed backend serves mode {mode.name}; {provider_hint(mode)}")
    usable = [b for b in installed if b.availability().ok]
    if usable:
        return _with_reference(usable, registry), notes
    reasons = "; ".join(f"{b.name}: {b.availability().reason}" for b in installed) or (
        f"not installed ({provider_hint(mode)}) and this machine has no GPU"
    )
    if mode in GPU_MODES:
        target = M.EMULATED_REPLAY if registry.for_mode(M.EMULATED_REPLAY) else M.SLOT_BY_SLOT
        note = f"mode {mode.name} is unavailable here ({reasons}); remapped to {target.name}"
        warnings.warn(f"DSP: {note}", stacklevel=4)
        notes.append(note)
        chain, more = candidates(registry, target)
        return chain, notes + more
    raise BackendUnavailableError(f"mode {mode.name} is installed but unavailable: {reasons}")


def gpu_present(registry: Registry) -> bool:
    """True when an available backend runs on a GPU platform, or CuPy sees a CUDA device."""
    if any(b.platform != "cpu" and b.availability().ok for b in registry.backends):
        return True
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device: all mean "no GPU")
        return False


def _with_reference(chain: list[Backend], registry: Registry) -> list[Backend]:
    """Append the slot-by-slot reference so every slot has a taker."""
    refs = [b for b in registry.for_mode(M.SLOT_BY_SLOT) if b.availability().ok]
    return chain + [b for b in refs if b not in chain]


def _failures(registry: Registry) -> str:
    return "; ".join(f"{f.entry_point}: {f.error}" for f in registry.failures) or "none"


def partition(plan: Plan, registry: Registry, mode: GraphExecutionMode, strict: bool = False) -> Partition:
    """Cut ``plan`` into segments and give each to a backend; ``strict`` forbids fallback."""
    chain, notes = candidates(registry, mode)
    if mode not in (M.AUTO,) and strict:
        chain = [b for b in chain if b.mode is chain[0].mode]
    result = Partition(mode, tuple(chain), [], {b.name: b for b in chain}, notes=notes)
    owners: list[Backend] = []
    for i in range(len(plan.slots)):
        view = slot_view(plan, i)
        winner = None
        for backend in chain:
            decline = backend.supports(view)
            if decline is None:
                winner = backend
                break
            result.declines.setdefault(i, []).append((backend.name, decline))
        if winner is None:
            said = "; ".join(f"{name}: {d}" for name, d in result.declines.get(i, []))
            slot = plan.slots[i]
            raise BackendError(
                f'no backend takes {slot.op} node "{slot.name}" in mode {mode.name}'
                f"{' (strict: no fallback)' if strict else ''}; {said}"
            )
        if strict and mode is M.AUTO and winner is not chain[0] and result.declines.get(i):
            raise BackendError(
                f'strict AUTO: {plan.slots[i].op} node "{plan.slots[i].name}" would fall back to '
                f"{winner.name}; declines: {'; '.join(f'{n}: {d}' for n, d in result.declines[i])}"
            )
        owners.append(winner)
    result.segments = _segments(plan, owners)
    for seg in result.segments:
        result.bids[seg.index] = {seg.backend: result.backends[seg.backend].cost(seg, plan)}
    if diag.ON:
        diag.auction(plan, result)
    return result


# A slot with these traits ends its segment: its output size (or what its subgraphs do)
# is known only after it runs, so whatever follows starts a new segment.
SEGMENT_ENDING = Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW


def _segments(plan: Plan, owners: list[Backend]) -> list[Segment]:
    """Maximal runs of slots with one owner, cut after every segment-ending slot."""
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(owners) + 1):
        ends = plan.slots[i - 1].traits & SEGMENT_ENDING
        if i == len(owners) or owners[i] is not owners[start] or ends:
            b = owners[start]
            segments.append(Segment(len(segments), b.name, b.mode.name, tuple(range(start, i))))
            start = i
    return segments


def explain(plan: Plan, result: Partition) -> dict[str, Any]:
    """A JSON-able account of the auction: per segment, the winner, bids and declines."""
    segs = []
    for seg in result.segments:
        declines = [
            {"slot": i, "op": plan.slots[i].op, "backend": name, "reason": d.reason.value, "detail": d.detail}
            for i in seg.slots
            for name, d in result.declines.get(i, [])
        ]
        segs.append(
            {
                "segment": seg.index,
                "backend": seg.backend,
                "mode": seg.mode,
                "slots": [seg.slots[0], seg.slots[-1]] if seg.slots else [],
                "n_slots": len(seg.slots),
                "bids": result.bids.get(seg.index, {}),
                "declines": declines,
            }
        )
    return {
        "mode": result.mode.name,
        "chain": [b.name for b in result.chain],
        "segments": segs,
        "fallback_fraction": result.fallback_fraction(),
        "notes": result.notes,
    }


__all__ = ["Decline", "DeclineReason", "Partition", "candidates", "explain", "partition", "slot_view"]
