"""Resolving a mode to backends and cutting a plan into segments: the AUTO auction.

Each slot goes to the first backend of the platform's fallback chain that is available
and supports it; consecutive slots with the same winner form a segment. Every decline
(backend, slot, typed reason) and each segment's bids are recorded for `dsp plan explain`.

Every call into a backend is guarded: ``supports`` or ``cost`` raising (SystemExit too) or
answering off-contract is that backend declining those slots (reason BACKEND_FAULT), and
``assign`` treats a ``compile`` that fails the same way: the slots go to the next backend
of the chain. Each such event is kept in ``Partition.faults``. Strict mode raises instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsp_core import config, diag
from dsp_core.backends.base import Backend, CompiledSegment, Decline, DeclineReason, Registry, SlotView
from dsp_core.backends.guard import BackendFault, describe
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
log = logging.getLogger("dsp.backends")

# slot -> declines forced on it by faults of earlier rounds (backend name, decline)
Excluded = dict[int, list[tuple[str, Decline]]]


@dataclass(frozen=True)
class Fault:
    """A backend that raised, hung or broke its contract in one call, and where."""

    backend: str
    stage: str  # "supports", "cost", "compile", "run", "warm", "replay", "output check", ...
    segment: int  # the auction segment (-1: a slot-level fault of the auction)
    slots: tuple[int, ...]
    reason: str
    fallback: str  # the backend that took over ("" when nothing did: strict mode raised)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for `dsp plan explain`."""
        span = [self.slots[0], self.slots[-1]] if self.slots else []
        return {
            "backend": self.backend,
            "stage": self.stage,
            "segment": self.segment,
            "slots": span,
            "reason": self.reason,
            "fallback": self.fallback,
        }


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
    strict: bool = False
    reference: Backend | None = None  # the SLOT_BY_SLOT oracle a failing segment falls back to
    faults: list[Fault] = field(default_factory=list)
    # segment -> feed-shape key -> the timed trial that picked its backend (measure())
    trials: dict[int, dict[str, Trial]] = field(default_factory=dict)
    # segment -> feed-shape key -> the trial's close runners-up (backend, threads), which replays contest
    rivals: dict[int, dict[str, list[tuple[Backend, int]]]] = field(default_factory=dict)
    # segment -> feed-shape key -> the live plan's replay contest (dsp_core.runtime.contest), for explain
    contests: dict[int, dict[str, Any]] = field(default_factory=dict)

    def record_fault(self, fault: Fault) -> None:
        """Keep ``fault`` (explain, diagnostics) and say it once in the log."""
        self.faults.append(fault)
        taken = f"; {fault.fallback} takes over" if fault.fallback else ""
        log.warning(
            "DSP backend %s failed %s (segment %d): %s%s",
            fault.backend,
            fault.stage,
            fault.segment,
            fault.reason,
            taken,
        )
        if diag.ON:
            message = f"{fault.backend} failed {fault.stage}: {fault.reason}{taken}"
            diag.emit(diag.Category.BACKEND, diag.Level.SUMMARY, "fault", message, 1, -1, fault.segment)

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
        opset=slot.opset,
    )


def candidates(registry: Registry, mode: GraphExecutionMode, strict: bool = False) -> tuple[list[Backend], list[str]]:
    """The backends to try for ``mode``, most preferred first, and notes on remapping.

    A GPU mode that cannot run here is remapped to a CPU mode, with a warning, unless
    ``strict``: then it is a BackendUnavailableError, as strict forbids every fallback.
    """
    notes: list[str] = []
    if mode is M.AUTO:
        left_out = auto_excluded()
        for platform in PLATFORM_ORDER:
            chain = [
                b
                for m in FALLBACK_CHAINS[platform]
                for b in registry.for_mode(m)
                # Left-out backends are not probed: a probe may import a whole runtime (openvino: ~0.1 s).
                if b.platform in (platform, "cpu") and b.name not in left_out and available(b)
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
    usable = [b for b in installed if available(b)]
    if usable:
        return _with_reference(usable, registry), notes
    reasons = "; ".join(f"{b.name}: {b.availability().reason}" for b in installed) or (
        f"not installed ({provider_hint(mode)}) and this machine has no GPU"
    )
    if mode in GPU_MODES and strict:
        raise BackendUnavailableError(
            f"mode {mode.name} cannot run here ({reasons}) and strict mode forbids remapping it to a CPU mode: "
            f"run on a machine where it is available, or compile without strict=True (DSP_STRICT) to accept the remap"
        )
    if mode in GPU_MODES:
        target = M.EMULATED_REPLAY if registry.for_mode(M.EMULATED_REPLAY) else M.SLOT_BY_SLOT
        note = f"mode {mode.name} is unavailable here ({reasons}); remapped to {target.name}"
        warnings.warn(f"DSP: {note}", stacklevel=4)
        notes.append(note)
        chain, more = candidates(registry, target)
        return chain, notes + more
    raise BackendUnavailableError(f"mode {mode.name} is installed but unavailable: {reasons}")


def auto_excluded() -> frozenset[str]:
    """DSP_AUTO_EXCLUDE: names of backends AUTO leaves out (the reference is never left out)."""
    raw = str(config.get("auto_exclude") or "")
    if raw.strip().lower() == "none":  # the default names the native CPU runtimes; "none" lets them in
        return frozenset()
    return frozenset(n.strip() for n in raw.split(",") if n.strip()) - {"slot_by_slot"}


def gpu_present(registry: Registry) -> bool:
    """True when an available backend runs on a GPU platform, or CuPy sees a CUDA device."""
    if any(b.platform != "cpu" and available(b) for b in registry.backends):
        return True
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device: all mean "no GPU")
        return False


def _with_reference(chain: list[Backend], registry: Registry) -> list[Backend]:
    """Append the slot-by-slot reference so every slot has a taker."""
    refs = [b for b in registry.for_mode(M.SLOT_BY_SLOT) if available(b)]
    return chain + [b for b in refs if b not in chain]


def available(backend: Backend) -> bool:
    """``backend.availability().ok``, False when even that call breaks (a backend that overrides it)."""
    try:
        return bool(backend.availability().ok)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        log.warning("DSP backend %s: availability() raised %s; treated as unavailable", backend.name, describe(exc))
        return False


def reference_of(registry: Registry) -> Backend | None:
    """The available SLOT_BY_SLOT backend: the oracle every failing segment falls back to."""
    return next((b for b in registry.for_mode(M.SLOT_BY_SLOT) if available(b)), None)


def _failures(registry: Registry) -> str:
    return "; ".join(f"{f.entry_point}: {f.error}" for f in registry.failures) or "none"


def partition(
    plan: Plan,
    registry: Registry,
    mode: GraphExecutionMode,
    strict: bool = False,
    excluded: Excluded | None = None,
) -> Partition:
    """Cut ``plan`` into segments and give each to a backend; ``strict`` forbids fallback.

    ``excluded`` holds declines forced by earlier faults (a raising ``cost`` or
    ``compile``): those backends are not asked again for those slots.
    """
    chain, notes = candidates(registry, mode, strict)
    if mode not in (M.AUTO,) and strict:
        chain = [b for b in chain if b.mode is chain[0].mode]
    result = Partition(
        mode, tuple(chain), [], {b.name: b for b in chain}, notes=notes, strict=strict, reference=reference_of(registry)
    )
    forced: Excluded = {k: list(v) for k, v in (excluded or {}).items()}
    while True:
        owners = _owners(plan, chain, result, forced, mode, strict)
        segments = _segments(plan, owners)
        # A backend the user named takes its segments whole: only AUTO asks whether it would rather not.
        declined = mode is M.AUTO and _segment_declines(plan, segments, result, forced)
        if not declined:
            break
        result.declines.clear()
    result.segments = segments
    for seg in result.segments:
        result.bids[seg.index] = {seg.backend: _ask_cost(result.backends[seg.backend], seg, plan, strict)}
    if diag.ON:
        diag.auction(plan, result)
    return result


def _segment_declines(plan: Plan, segments: list[Segment], result: Partition, forced: Excluded) -> bool:
    """Ask each segment's winner whether it takes the segment whole; a decline is forced on its slots."""
    declined = False
    for seg in segments:
        backend = result.backends[seg.backend]
        if backend is result.reference:
            continue
        try:
            answer = backend.segment_decline(seg, plan)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001  (a raising hook declines, like supports)
            answer = Decline(DeclineReason.BACKEND_FAULT, f"{backend.name}.segment_decline raised {describe(exc)}")
        if isinstance(answer, Decline):
            for s in seg.slots:
                forced.setdefault(s, []).append((backend.name, answer))
            declined = True
    return declined


def _owners(
    plan: Plan, chain: list[Backend], result: Partition, forced: Excluded, mode: GraphExecutionMode, strict: bool
) -> list[Backend]:
    """Each slot's winner: the first backend of ``chain`` that takes it (declines recorded in ``result``)."""
    owners: list[Backend] = []
    for i in range(len(plan.slots)):
        view = slot_view(plan, i)
        winner = None
        for backend in chain:
            decline = next((d for name, d in forced.get(i, ()) if name == backend.name), None)
            if decline is None:
                decline = _ask_supports(backend, view, plan, strict)
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
    return owners


def _ask_supports(backend: Backend, view: SlotView, plan: Plan, strict: bool) -> Decline | None:
    """``backend.supports(view)``, guarded: a raise or a wrong type is a BACKEND_FAULT decline."""
    try:
        answer = backend.supports(view)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001  (a backend that overrides the public method)
        answer = Decline(DeclineReason.BACKEND_FAULT, f"{backend.name}.supports raised {describe(exc)}")
    if answer is not None and not isinstance(answer, Decline):
        answer = Decline(
            DeclineReason.BACKEND_FAULT,
            f"{backend.name}.supports returned {type(answer).__name__} {answer!r}, not a Decline or None",
        )
    if strict and answer is not None and answer.reason is DeclineReason.BACKEND_FAULT:
        slot = plan.slots[view.index]
        raise BackendFault(
            f'backend {backend.name} failed on {slot.op} node "{slot.name}" (slot {view.index}): {answer.detail}; '
            "strict mode: no fallback (compile without strict=True to let the next backend take it)"
        )
    return answer


def _ask_cost(backend: Backend, seg: Segment, plan: Plan, strict: bool) -> float:
    """``backend.cost``, guarded: BackendFault when it raises or is not a finite number."""
    try:
        bid = backend.cost(seg, plan)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        raise _CostFault(backend, seg, f"cost raised {describe(exc)}", strict) from exc
    if isinstance(bid, bool) or not isinstance(bid, (int, float)) or not math.isfinite(bid):
        raise _CostFault(backend, seg, f"cost returned {bid!r}, not a finite number", strict)
    return float(bid)


class _CostFault(BackendFault):
    """A bid that could not be had: ``assign`` gives the segment to the next backend."""

    def __init__(self, backend: Backend, seg: Segment, reason: str, strict: bool) -> None:
        span = f"slots {seg.slots[0]}..{seg.slots[-1]}" if seg.slots else "no slots"
        tail = "; strict mode: no fallback" if strict else ""
        super().__init__(f"backend {backend.name} failed to bid for segment {seg.index} ({span}): {reason}{tail}")
        self.backend, self.segment, self.reason, self.strict = backend, seg, reason, strict


def assign(
    plan: Plan, registry: Registry, mode: GraphExecutionMode, strict: bool = False
) -> tuple[Partition, list[CompiledSegment]]:
    """The auction, then each segment compiled by its winner; a bid or compile that fails falls through.

    A backend whose ``cost`` or ``compile`` fails for a segment declines those slots
    (BACKEND_FAULT, recorded in ``faults``) and the auction runs again without it there,
    so the slots go to the next backend of the chain. Each round excludes at least one
    (slot, backend) pair, so this ends. Strict mode raises a BackendFault instead.
    """
    excluded: Excluded = {}
    faults: list[Fault] = []
    while True:
        try:
            result = partition(plan, registry, mode, strict, excluded)
        except _CostFault as exc:
            if exc.strict:
                raise
            _exclude(excluded, faults, exc.backend.name, "cost", exc.segment, exc.reason)
            continue
        compiled: list[CompiledSegment] = []
        for seg in result.segments:
            backend = result.backends[seg.backend]
            try:
                compiled.append(backend.compile(plan, seg))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001  (any failure: the next backend takes the slots)
                if strict or backend is result.reference:
                    _release_all(compiled)
                    if strict and not isinstance(exc, BackendError):
                        raise BackendFault(f"backend {backend.name} failed to compile: {describe(exc)}") from exc
                    raise
                _release_all(compiled)
                _exclude(excluded, faults, backend.name, "compile", seg, describe(exc))
                break
        else:
            for fault in faults:  # the final segments: who took over each faulty slot
                taker = next((s for s in result.segments if fault.slots and fault.slots[0] in s.slots), None)
                index, name = (taker.index, taker.backend) if taker is not None else (-1, "")
                result.record_fault(Fault(fault.backend, fault.stage, index, fault.slots, fault.reason, name))
            return result, compiled


def _exclude(excluded: Excluded, faults: list[Fault], backend: str, stage: str, seg: Segment, reason: str) -> None:
    decline = Decline(DeclineReason.BACKEND_FAULT, f"{backend} failed {stage}: {reason}")
    for s in seg.slots:
        excluded.setdefault(s, []).append((backend, decline))
    faults.append(Fault(backend, stage, seg.index, seg.slots, reason, ""))


def _release_all(compiled: list[CompiledSegment]) -> None:
    for c in compiled:
        release_quietly(c)


def release_quietly(compiled: CompiledSegment) -> None:
    """``compiled.release()``; a failure there is logged, never raised (the segment is gone anyway)."""
    try:
        compiled.release()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        log.warning("DSP backend %s: release() raised %s (ignored)", compiled.backend.name, describe(exc))


# A slot with these traits ends its segment: its output size (or what its subgraphs do)
# is known only after it runs, so whatever follows starts a new segment.
SEGMENT_ENDING = Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW


def _segments(plan: Plan, owners: list[Backend]) -> list[Segment]:
    """Maximal runs of slots with one owner (and one device), cut after every segment-ending slot."""
    segments: list[Segment] = []
    start = 0
    # A placed plan's segments never straddle two devices (dsp_core/devices/execution.py).
    devices = plan.placement.placement.slots if plan.placement is not None else None
    for i in range(1, len(owners) + 1):
        ends = plan.slots[i - 1].traits & SEGMENT_ENDING
        moves = devices is not None and i < len(owners) and devices[i] != devices[start]
        if i == len(owners) or owners[i] is not owners[start] or ends or moves:
            b = owners[start]
            segments.append(Segment(len(segments), b.name, b.mode.name, tuple(range(start, i))))
            start = i
    return segments


# -- the measured auction ---------------------------------------------------------------
# Where more than one available backend (the reference aside: it is the fallback that
# takes whatever nobody else does; but it bids against a backend that only runs its own
# kernels faster, numpy_replay) takes every slot of a segment, the chain's order
# alone does not say which is faster on this machine, for these shapes. At freeze, each
# candidate runs the segment on the step's real inputs: a capturing one warm -> prepare ->
# capture, and one untimed replay (what only a first run pays); an eager one runs once.
# Then the candidates are timed run by run in turns (each round in a rotated order), at
# least DSP_AUCTION_TRIALS runs each, and more rounds (up to TRIAL_ROUNDS) while TRIAL_BUDGET_S
# lasts: turns spread a shared machine's passing load over every candidate instead of one.
# The lowest median wins (a runtime's several threads on shared cores are judged on what a
# step usually costs, not on its one lucky run); candidates within TIE of the fastest count
# as tied, and the chain's order breaks ties, unless the fastest was the faster in so many rounds
# that chance would rarely give as many (a sign test, ``_pick``). The result is kept in the
# partition (per segment and feed shapes) and in the disk cache, so a later freeze of the
# same shapes, here or in another process, does not time again.
TIE = 0.05
# Rounds are taken while the budget lasts, not three at most: a short segment's three rounds were
# 15 runs in 10 ms, and one noisy moment then gave the CNN fixture's batch-8 segment to OpenVINO
# (399 us a call against ONNX Runtime's 312: benchmarks/results/cpu_race_2026-12-04d/).
TRIAL_ROUNDS = 12  # 60 counted runs each at the default 5: a 300 us segment is timed in ~45 ms
TRIAL_BUDGET_S = 0.5
# A long step gets TRIAL_MIN_ROUNDS rounds at least, past the budget while TRIAL_MAX_S lasts: GPT-2
# 124M's decode step (25-30 ms) had 2 rounds in 0.5 s, and its pick between OpenVINO and ONNX
# Runtime, 7-15% apart in the real loop, flipped from one freeze to the next on a 2-core machine.
TRIAL_MIN_ROUNDS = 4
TRIAL_MAX_S = 3.0
# A candidate within TIE of an earlier one in the chain wins all the same when it had the lower
# median in so many of the rounds that two equally fast candidates would give it as many at most
# SIGN_P of the time (a one-sided sign test: 4 of 4 rounds, 6 of 7, 9 of 12): a difference that
# holds round after round is not the machine's noise. GPT-2 124M's decode step at one thread: ONNX
# Runtime 22.3 ms against OpenVINO's 23.0 in the trial (3% apart, a tie by TIE, so OpenVINO), 44.8
# against 42.6 tok/s over 256 tokens. Until 2026-12-05 it had to be the faster in every round: the
# Llama (eager) fixture's decode step at batch 8, two threads, was ONNX Runtime's by 4% in 9 and in
# 11 of 12 rounds in two trials, went to OpenVINO both times, and ran 1.3x ONNX Runtime's own call
# in the race of 2026-12-05 00:34 (benchmarks/results/cpu_race_2026-12-04m/).
SIGN_P = 0.1
# After a candidate's settle (CompiledSegment.settle_s) the next one runs untimed this long first.
TRIAL_WAKE_S = 2e-3
# 8: a tie goes to the faster by a sign test over the rounds; 7: a candidate's settle slept after its
# bursts; 6: the faster in every round wins a tie; 5: and TRIAL_MIN_ROUNDS for a long step; 4: rounds
# while the budget lasts; 3: medians of bursts in turns, three rounds at most (2: of runs in turns;
# 1: best runs). A trial kept under an older format is timed again.
TRIAL_FORMAT = "dsp-auction-trial/10"
# A winner whose segments run on a thread count of their own (Backend.threads_variants) and whose
# median was under this is timed again against itself at fewer threads (half, a quarter, ... one),
# in the same turns, and the fastest count is kept by the same rule (the full count first in the
# order, so a tie keeps it). Threads synchronise on every op: a short step can cost more on several
# than on one. Two threads on a 2-core AMD EPYC, ONNX Runtime: the GPT-2 fixture's decode step at
# batch 8, 191.8 us on two against 171.2 on one (one the faster in 16 of 16 rounds); the CNN fixture
# at batch 8, 232.5 against 339.7 (two the faster in 16 of 16). A longer step is left at the count
# asked for: its compile at another count costs as much again (GPT-2 124M: 5-9 s).
THREADS_TRIAL_MAX_S = 2e-3
# 9: a short winner timed at fewer threads too (Trial.threads).
# A trial is about a second of a machine whose load changes from minute to minute: the CNN fixture's
# segment at two threads timed 50.5 us on one thread against 61.6 on two (10 of 12 rounds), and minutes
# later ran 68.3 us on one where ONNX Runtime's own call on two took 61.2 (cpu_race_2026-12-05c). So a
# short winner (median under CONTEST_MAX_S) keeps rivals: the other backends, and the fastest other
# thread count of its own, each where its median was within CONTEST_RATIO of the winner's. The
# plan's replays run them in turns now and then and keep the fastest (dsp_core.runtime.contest).
# Trial.rivals names them; 10: the rivals kept in the record.
CONTEST_MAX_S = THREADS_TRIAL_MAX_S
CONTEST_RATIO = 1.5


@dataclass(frozen=True)
class Trial:
    """One segment's timed trial: best seconds per backend, the winner, where it came from."""

    times: dict[str, float]
    winner: str
    source: str  # "measured", or "disk" when a record of an earlier process was used
    rounds: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # median seconds per round
    # The winner's threads per call (Segment.threads; 0: DSP_CPU_THREADS). Its timings at each count
    # are in ``times`` and ``rounds`` as "backend@threads" (THREADS_TRIAL_MAX_S).
    threads: int = 0
    # The runners-up that replays contest with the winner ("backend", or "backend@threads"; CONTEST_RATIO)
    rivals: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for `dsp plan explain` (microseconds)."""
        return {
            "times_us": {k: round(v * 1e6, 2) for k, v in self.times.items()},
            "rounds_us": {k: [round(v * 1e6, 2) for v in got] for k, got in self.rounds.items()},
            "winner": self.winner,
            "threads": self.threads,
            "rivals": list(self.rivals),
            "source": self.source,
        }

    def time_of(self, name: str) -> float | None:
        """The median seconds of variant ``name`` ("backend" or "backend@threads", as ``variant``
        reads it) in this trial, or None where it was not timed."""
        want = variant(name)
        got = [t for n, t in self.times.items() if variant(n) == want]
        return min(got) if got else None


def variant(name: str) -> tuple[str, int]:
    """(backend name, threads) of a trial's variant name ("onnxruntime@1" -> ("onnxruntime", 1); the
    full count and a plain name -> threads 0, DSP_CPU_THREADS)."""
    backend, _, count = name.partition("@")
    threads = int(count) if count.isdigit() else 0
    return backend, 0 if threads == full_threads() else threads


def on_threads(threads: int) -> str:
    """How a report names a variant's thread count: " on 1 thread", " on 2 threads"; "" for 0
    (DSP_CPU_THREADS, as ``variant`` gives it)."""
    return f" on {threads} thread{'s' if threads > 1 else ''}" if threads else ""


def contenders(plan: Plan, result: Partition, k: int) -> list[Backend]:
    """The available backends of the chain, the reference aside, that take all of segment ``k`` (chain order);
    and the reference, where one of them is ``timed_against_reference``."""
    seg = result.segments[k]
    faulty = {f.backend for f in result.faults if set(f.slots) & set(seg.slots)}
    found: list[Backend] = []
    for backend in result.chain:
        if backend is result.reference or backend.name in faulty or not available(backend):
            continue  # the reference is the fallback, not a bidder
        if backend.platform != "cpu":
            # On a GPU the chain decides (TRITON runs everything CUDA_GRAPHS runs, plus fused
            # kernels); timing captured GPU segments against each other at freeze is not built.
            continue
        if not backend.contract.computes_values:
            continue
        if backend.name != seg.backend:
            if any(_ask_supports(backend, slot_view(plan, s), plan, False) is not None for s in seg.slots):
                continue
            if backend.segment_decline(seg, plan) is not None:
                continue
        found.append(backend)
    # A bidder that runs the reference's kernels another way is timed against the reference
    # itself, which comes just before it, so a tie leaves the segment on the reference.
    first = next((j for j, b in enumerate(found) if b.timed_against_reference), None)
    if first is not None and result.reference is not None and available(result.reference):
        found.insert(first, result.reference)
    return found


def measure(executor: Any, feeds: list[tuple[int, Any]]) -> None:
    """Time the contenders of every contested segment on ``feeds`` and give each segment to the fastest.

    ``executor`` is the runtime's Executor (plan, partition, compiled segments). Does
    nothing outside AUTO, in strict mode or with DSP_AUCTION_TRIALS=0: the fixed chain decides.
    """
    part: Partition = executor.partition
    runs = int(config.get("auction_trials"))
    if part.strict or runs <= 0 or part.mode is not M.AUTO:
        return  # strict, trials off, or a mode the user named: the chain decides
    plan: Plan = executor.plan
    contested = {k: c for k in range(len(part.segments)) if _contested(c := contenders(plan, part, k))}
    if not contested:
        return
    key = shape_key(feeds)
    values = list(executor.template)
    for flat, array in feeds:
        values[flat] = array
    for k, compiled in enumerate(executor.segments):
        if k in contested:
            kept: CompiledSegment | None = None
            trial = part.trials.get(k, {}).get(key) or _recall(plan, part, k, contested[k], key)
            if trial is None:
                trial, kept = _time_segment(plan, part.segments[k], contested[k], compiled, values, runs)
                _remember(plan, part, k, contested[k], key, trial)
            part.trials.setdefault(k, {})[key] = trial
            rivals = _rivals_of(trial, contested[k])
            if rivals:
                part.rivals.setdefault(k, {})[key] = rivals
            seg = part.segments[k]
            if trial.winner != seg.backend or trial.threads != seg.threads:
                winner = next(b for b in contested[k] if b.name == trial.winner)
                _hand_over(executor, k, winner, kept, trial.threads)
                compiled = executor.segments[k]
        try:
            compiled.run(values)  # the values the next segment's trial reads
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001  (the step after the trial meets it and gives the unit to the reference)
            log.info(
                "DSP auction: segment %d failed on %s (%s): the segments after it keep the chain's backends",
                k,
                compiled.backend.name,
                describe(exc),
            )
            return


def _rivals_of(trial: Trial, candidates: list[Backend]) -> list[tuple[Backend, int]]:
    """The trial's rivals as (backend, threads), those that name one of ``candidates``."""
    found = []
    for name in trial.rivals:
        backend_name, threads = variant(name)
        backend = next((b for b in candidates if b.name == backend_name), None)
        if backend is not None:
            found.append((backend, threads))
    return found


def _rivals(times: dict[str, float], winner: str, threads: int) -> tuple[str, ...]:
    """The rivals of ``winner`` at ``threads`` among a trial's variants (``times``), each compared
    with the winner in the turns it was timed in: the other backends (the backends' turns, plain
    names) within CONTEST_RATIO of the winner's full count there, fastest first (one that cannot bind
    onto another's buffers, the reference, is left out when the contest is made), and the fastest
    other thread count of the winner ("backend@N": the thread counts' turns, the full count among
    them) within CONTEST_RATIO of the count chosen. None where the winner's step was long
    (CONTEST_MAX_S)."""
    base = times.get(winner)
    if base is None or base > CONTEST_MAX_S:
        return ()
    others = {n: t for n, t in times.items() if "@" not in n and n != winner and t <= base * CONTEST_RATIO}
    found = sorted(others, key=lambda n: others[n])
    mine = times.get(f"{winner}@{threads or full_threads()}")
    if mine is not None:
        counts = {
            n: t
            for n, t in times.items()
            if n.startswith(f"{winner}@") and variant(n) != (winner, threads) and t <= mine * CONTEST_RATIO
        }
        if counts:
            found.append(min(counts, key=lambda n: counts[n]))
    return tuple(found)


def _contested(candidates: list[Backend]) -> bool:
    """Whether a segment's trial has anything to choose: two candidates or more, or one that may run
    it on fewer threads than it was given."""
    return len(candidates) > 1 or (len(candidates) == 1 and candidates[0].threads_variants and full_threads() > 1)


def full_threads() -> int:
    """The threads a native CPU runtime's call is given: DSP_CPU_THREADS, else the machine's cores."""
    return int(config.get("cpu_threads")) or os.cpu_count() or 1


def _fewer_threads(backend: Backend, median_s: float) -> list[int]:
    """The thread counts below the full one to time ``backend`` at (half, a quarter, ... one), where
    it takes them and its step was short (THREADS_TRIAL_MAX_S); else none."""
    if not backend.threads_variants or median_s > THREADS_TRIAL_MAX_S:
        return []
    counts, t = [], full_threads() // 2
    while t >= 1:
        counts.append(t)
        t //= 2
    return counts


def _time_segment(
    plan: Plan, seg: Segment, candidates: list[Backend], current: CompiledSegment, values: list[Any], runs: int
) -> tuple[Trial, CompiledSegment | None]:
    """Every candidate made ready (compiled, captured, warmed), then timed in turns: see TRIAL_ROUNDS;
    then a short winner at fewer threads against itself: see THREADS_TRIAL_MAX_S.

    Returns the trial and, when another backend (or thread count) than the current one won, the
    winner's compiled segment: handed over as it is, it is not compiled a second time (a whole-model
    runtime's compile of a big segment takes seconds).
    """
    steps: dict[str, Callable[[], Any]] = {}
    settle: dict[str, float] = {}
    made: list[CompiledSegment] = []
    ready: dict[str, CompiledSegment] = {}
    kept: CompiledSegment | None = None
    threads = 0
    times: dict[str, float] = {}
    rivals: tuple[str, ...] = ()
    try:
        for backend in candidates:
            mine = current if backend.name == seg.backend and seg.threads == 0 else None
            _make_ready(plan, seg, backend, 0, backend.name, mine, values, made, ready, steps, settle)
        times, rounds = _timed_turns(steps, runs, seg.index, settle)
        if times:
            winner = _pick([b.name for b in candidates], times, rounds)
            chosen = ready[winner]
            backend = chosen.backend
            fewer = _fewer_threads(backend, times[winner])
            if fewer:
                full = f"{winner}@{full_threads()}"
                more_steps, more_settle = {full: steps[winner]}, {full: settle[winner]}
                for t in fewer:
                    name = f"{winner}@{t}"
                    _make_ready(plan, seg, backend, t, name, None, values, made, ready, more_steps, more_settle)
                more_times, more_rounds = _timed_turns(more_steps, runs, seg.index, more_settle)
                if full in more_times and len(more_times) > 1:
                    times.update(more_times)
                    rounds.update(more_rounds)
                    best = _pick(list(more_steps), more_times, more_rounds)
                    if best != full:
                        threads, chosen = int(best.rsplit("@", 1)[1]), ready[best]
            rivals = _rivals(times, winner, threads)
            # Kept for the CPU runtimes, whose compile is what a second one would cost; a device
            # segment is compiled afresh, as it always was (its trial capture used copies of the buffers).
            kept = chosen if chosen is not current and chosen.backend.platform == "cpu" else None
    finally:
        for compiled in made:
            if compiled is not kept:
                release_quietly(compiled)
    if not times:
        return Trial({}, seg.backend, "measured", threads=seg.threads), None
    return Trial(times, winner, "measured", rounds, threads, rivals), kept


def _make_ready(
    plan: Plan,
    seg: Segment,
    backend: Backend,
    threads: int,
    name: str,
    compiled: CompiledSegment | None,
    values: list[Any],
    made: list[CompiledSegment],
    ready: dict[str, CompiledSegment],
    steps: dict[str, Callable[[], Any]],
    settle: dict[str, float],
) -> None:
    """``backend`` on ``seg`` at ``threads`` (``compiled``, else compiled here and added to ``made``)
    made ready to time as ``name``: into ``ready``, ``steps`` and ``settle``; a candidate that cannot
    compile or run is left out of the trial."""
    if compiled is None:
        trial_seg = dataclasses.replace(seg, backend=backend.name, mode=backend.mode.name, threads=threads)
        try:
            compiled = backend.compile(plan, trial_seg)
        except Exception as exc:  # noqa: BLE001  (a candidate that cannot compile is out of the trial)
            log.info("DSP auction trial: %s cannot compile segment %d: %s", name, seg.index, describe(exc))
            return
        made.append(compiled)
    try:
        steps[name] = _ready_step(backend, compiled, values)
        settle[name] = compiled.settle_s
        ready[name] = compiled
    except Exception as exc:  # noqa: BLE001  (nor one that fails to run)
        log.info("DSP auction trial: %s failed on segment %d: %s", name, seg.index, describe(exc))


def _ready_step(backend: Backend, compiled: CompiledSegment, values: list[Any]) -> Callable[[], Any]:
    """A candidate's steady-state step (a replay for a capturing backend, an eager run otherwise), run once untimed.

    The untimed run pays what only a first run pays (a runtime's allocations, lazy
    initialisation), which would otherwise count against that candidate.
    """
    step: Callable[[], Any]
    if backend.captures:
        compiled.warm(list(values))
        mine = list(values)
        compiled.prepare(mine)
        compiled.capture(mine)
        step = lambda: compiled.replay(mine)  # noqa: E731
    else:
        compiled.run(list(values))
        step = lambda: compiled.run(list(values))  # noqa: E731
    step()
    return step


def _pick(order: list[str], times: dict[str, float], rounds: dict[str, list[float]]) -> str:
    """The winner of a trial: the fastest median (``times``), or the first in the chain's ``order``
    within TIE of it, unless the fastest had the lower median in enough of the rounds against that
    one (``rounds``: each candidate's median per round, the rounds in step) to pass a one-sided sign
    test at SIGN_P (``sign_test``; an equal round counts against it)."""
    fastest = min(times, key=lambda name: times[name])
    first = next(name for name in order if name in times and times[name] <= times[fastest] * (1 + TIE))
    pairs = list(zip(rounds.get(fastest, ()), rounds.get(first, ())))
    if first != fastest and pairs and sign_test(sum(a < b for a, b in pairs), len(pairs)) <= SIGN_P:
        return fastest
    return first


def sign_test(wins: int, rounds: int) -> float:
    """The chance of ``wins`` or more lower medians in ``rounds`` rounds between two equally fast
    candidates (each round a fair coin): the one-sided sign test's p-value."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2**rounds


def _timed_turns(
    steps: dict[str, Callable[[], Any]], runs: int, index: int, settle: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median seconds of each step, and its median per round (``_pick`` reads them), timed in bursts
    taken in turns: rounds while TRIAL_BUDGET_S lasts (at least one, and TRIAL_MIN_ROUNDS while
    TRIAL_MAX_S lasts; TRIAL_ROUNDS at most), each round a burst of ``runs`` + 1 runs of every
    candidate (the order rotating round by round), the burst's first run not counted. After a
    candidate's burst the trial sleeps its ``settle`` seconds (``CompiledSegment.settle_s``; the
    sleeps are not counted against the budget).

    Turns spread a shared machine's passing load over every candidate. They are bursts, not single
    runs, because a runtime's threads outlive its call: ONNX Runtime's intra-op threads spin for a
    while after a run, and on two cores they took OpenVINO's from it, so run-by-run turns timed
    OpenVINO's MiniLM-L3 step at 15.8 ms against 8.7 ms in bursts (ONNX Runtime's 10.8 either way;
    benchmarks/results/auction_bursts_2026-12-03.json) and gave ONNX Runtime the segment. The
    first run of a burst pays for the candidate before it and is dropped; each candidate's time is
    the median of its other runs, not its best: a runtime using several threads on shared cores is
    judged on what a step usually costs it.

    Dropping one run is not enough after ONNX Runtime at several threads: its pool threads spin
    for tens of milliseconds after a call returns. Timed right after its bursts, OpenVINO's MiniLM-L3
    step took 12.7-13.8 ms against 9.0 ms alone (2 threads; 8.2-8.4 ms once 50 ms had passed), and
    the trial judged OpenVINO on ONNX Runtime's leftovers; so such a candidate declares a settle.
    After the sleep the next candidate runs untimed for TRIAL_WAKE_S first: OpenVINO's first calls
    after 60 ms idle took 3.7x, 1.3x, 1.05x its steady time (GPT-2 fixture prefill), and a 90 us step
    was timed at 166 us with only its first run dropped.
    """
    samples: dict[str, list[float]] = {name: [] for name in steps}
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    settle = settle or {}
    started, slept, woken = time.perf_counter(), 0.0, False
    names = list(steps)
    for turn in range(TRIAL_ROUNDS):
        spent = time.perf_counter() - started - slept
        if turn >= 1 and spent > TRIAL_BUDGET_S and (turn >= TRIAL_MIN_ROUNDS or spent > TRIAL_MAX_S):
            break  # one round each at least, TRIAL_MIN_ROUNDS within TRIAL_MAX_S, more while the budget lasts
        k = turn % len(names) if names else 0
        for name in names[k:] + names[:k]:
            got: list[float] = []
            try:
                if woken:  # after a sleep: untimed runs while the cores and its threads wake
                    waking = time.perf_counter()
                    steps[name]()
                    while time.perf_counter() - waking < TRIAL_WAKE_S:
                        steps[name]()
                    slept += time.perf_counter() - waking
                    woken = False
                for _ in range(max(1, runs) + 1):
                    start = time.perf_counter()
                    steps[name]()
                    got.append(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001  (a candidate that fails while timed is out)
                log.info("DSP auction trial: %s failed on segment %d: %s", name, index, describe(exc))
                del steps[name], samples[name], per_round[name]
                names.remove(name)
                continue
            samples[name] += got[1:]
            per_round[name].append(statistics.median(got[1:] or got))
            if settle.get(name, 0.0) > 0.0 and len(names) > 1:
                asleep = time.perf_counter()
                time.sleep(settle[name])  # its threads spin down before the next candidate is timed
                slept += time.perf_counter() - asleep
                woken = True
    return {name: statistics.median(got) for name, got in samples.items() if got}, per_round


def _hand_over(
    executor: Any, k: int, winner: Backend, compiled: CompiledSegment | None = None, threads: int = 0
) -> None:
    """Segment ``k`` of the executor to ``winner`` at ``threads`` (its trial's compiled segment, else
    compiled afresh; the loser's segment released)."""
    part: Partition = executor.partition
    seg = part.segments[k]
    moved = dataclasses.replace(seg, backend=winner.name, mode=winner.mode.name, threads=threads)
    if compiled is None:
        compiled = winner.compile(executor.plan, moved)
    release_quietly(executor.segments[k])
    part.segments[k] = moved
    part.backends.setdefault(winner.name, winner)
    part.bids.setdefault(seg.index, {})[winner.name] = _ask_cost(winner, moved, executor.plan, False)
    executor.segments[k] = compiled
    executor.checks[k] = executor._specs(compiled)


def shape_key(feeds: list[tuple[int, Any]]) -> str:
    """The feeds' shapes and dtypes as text, in the order of their flat indexes (a trial holds for
    these shapes only; the replay contest finds its trial by the staged arrays, in another order)."""
    return ";".join(
        f"{flat}:{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}"
        for flat, a in sorted(feeds, key=lambda pair: pair[0])
    )


def _record_key(plan: Plan, seg: Segment, candidates: list[Backend], key: str) -> str:
    """The disk cache key of a trial: plan, segment span, candidates and their versions, shapes, machine."""
    import platform

    from dsp_core.cache.disk import DiskCache

    who = ",".join(f"{b.name}={b.version}" for b in candidates)
    machine = f"{platform.machine()}|{os.cpu_count()}|threads={config.get('cpu_threads')}"
    span = f"{seg.slots[0]}-{seg.slots[-1]}" if seg.slots else "-"
    return DiskCache.key(TRIAL_FORMAT, plan.content_hash, span, who, key, machine)


def _disk() -> Any:
    from dsp_core.cache.disk import DiskCache

    try:
        cache = DiskCache.from_config()
    except Exception:  # noqa: BLE001  (a misconfigured cache: trials are kept in memory only)
        return None
    return cache if cache.enabled else None


def _recall(plan: Plan, part: Partition, k: int, candidates: list[Backend], key: str) -> Trial | None:
    """A trial an earlier process stored for this segment, these candidates and shapes, if any."""
    cache = _disk()
    if cache is None or cache.force_recompile:
        return None
    raw = cache.get(_record_key(plan, part.segments[k], candidates, key))
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        times = {str(n): float(t) for n, t in record["times"].items()}
        rounds = {str(n): [float(t) for t in got] for n, got in record.get("rounds", {}).items()}
        winner = str(record["winner"])
        threads = int(record.get("threads", 0))
        rivals = tuple(str(n) for n in record.get("rivals", ()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if winner not in {b.name for b in candidates} or threads < 0:
        return None
    return Trial(times, winner, "disk", rounds, threads, rivals)


def _remember(plan: Plan, part: Partition, k: int, candidates: list[Backend], key: str, trial: Trial) -> None:
    cache = _disk()
    if cache is None or not trial.times:
        return
    record = {
        "format": TRIAL_FORMAT,
        "segment": k,
        "times": trial.times,
        "rounds": trial.rounds,
        "winner": trial.winner,
        "threads": trial.threads,
        "rivals": list(trial.rivals),
    }
    cache.put(_record_key(plan, part.segments[k], candidates, key), json.dumps(record, sort_keys=True).encode())


def explain(plan: Plan, result: Partition) -> dict[str, Any]:
    """A JSON-able account of the auction: per segment, the winner, bids and declines."""
    segs = []
    for seg in result.segments:
        declines = [
            {"slot": i, "op": plan.slots[i].op, "backend": name, "reason": d.reason.value, "detail": d.detail}
            for i in seg.slots
            for name, d in result.declines.get(i, [])
        ]
        entry = {
            "segment": seg.index,
            "backend": seg.backend,
            "mode": seg.mode,
            "slots": [seg.slots[0], seg.slots[-1]] if seg.slots else [],
            "n_slots": len(seg.slots),
            "threads": seg.threads,  # 0: DSP_CPU_THREADS; else the trial's count (THREADS_TRIAL_MAX_S)
            "bids": result.bids.get(seg.index, {}),
            "declines": declines,
            "faults": [f.as_dict() for f in result.faults if f.segment == seg.index or set(f.slots) & set(seg.slots)],
        }
        trials = result.trials.get(seg.index)
        if trials:
            entry["trials"] = [{"feeds": shapes, **t.as_dict()} for shapes, t in trials.items()]
        contests = result.contests.get(seg.index)
        if contests:
            entry["contests"] = [{"feeds": shapes, **c.as_dict()} for shapes, c in contests.items()]
        fusion = _fusion_of(plan, seg, result.backends.get(seg.backend), result)
        if fusion is not None:
            entry["fusion"] = fusion
        entry["gaps"] = _gaps_of(plan, seg, result.backends.get(seg.backend))
        segs.append(entry)
    return {
        "mode": result.mode.name,
        "chain": [b.name for b in result.chain],
        "segments": segs,
        "fallback_fraction": result.fallback_fraction(),
        "notes": result.notes,
        "faults": [f.as_dict() for f in result.faults],
    }


def _gaps_of(plan: Plan, seg: Segment, backend: Backend | None) -> list[dict[str, Any]]:
    """The slots a capturing winner runs eagerly between its islands: by its profile, or learned."""
    if backend is None or not backend.captures:
        return []
    from dsp_core.runtime.units import why_gap

    gaps = []
    for s in seg.slots:
        reason = why_gap(plan, s, backend)
        if reason is not None:
            learned = s in plan.capture_gaps.get(backend.name, {})
            gaps.append({"slot": s, "op": plan.slots[s].op, "learned": learned, "reason": reason})
    return gaps


def _fusion_of(plan: Plan, seg: Segment, backend: Backend | None, result: Partition) -> dict[str, Any] | None:
    """The segment's fusion groups and boundaries under its winner's policy (None: it fuses nothing)."""
    try:
        policy = backend.fusion_policy() if backend is not None else None
    except Exception as exc:  # noqa: BLE001  (explain reports; compile is where a broken policy fails)
        return {"policy": "error", "error": describe(exc), "slots": 0, "kernels": 0, "groups": [], "boundaries": []}
    if policy is None:
        return None
    from dsp_core.plan.fusion import segment_fusion

    assert backend is not None  # a policy came from it
    fusion = segment_fusion(plan, seg.slots, policy)
    report = fusion.as_dict(plan)
    for group, entry in zip(fusion.groups, report["groups"]):
        entry["chain"] = _group_chain(plan, result, backend, policy, group)
    return report


def _group_chain(plan: Plan, result: Partition, winner: Backend, policy: Any, group: Any) -> list[dict[str, str]]:
    """How AUTO's chain went for one group: each backend before the winner and why it did not take
    the group, then the winner and whether its templates make the group one generated kernel."""
    chain: list[dict[str, str]] = []
    for b in result.chain:
        if b.name == winner.name:
            break
        why = [d.detail for s in group.slots for name, d in result.declines.get(s, []) if name == b.name]
        chain.append({"backend": b.name, "verdict": f"declined: {why[0]}" if why else "did not take the segment"})
    try:
        reason = policy.unfused(plan, group)
    except Exception as exc:  # noqa: BLE001  (explain reports; a broken policy fails at compile)
        reason = f"its policy failed: {describe(exc)}"
    verdict = "one generated kernel" if reason is None else f"its slots' own kernels ({reason})"
    chain.append({"backend": winner.name, "verdict": verdict})
    return chain


__all__ = [
    "Decline",
    "DeclineReason",
    "Fault",
    "Partition",
    "assign",
    "candidates",
    "explain",
    "partition",
    "slot_view",
]
