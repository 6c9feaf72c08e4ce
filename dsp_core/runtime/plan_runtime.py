"""The lifecycle of one live plan, driven by the core for every backend alike.

A live plan (one shape signature) starts SLOT_BY_SLOT: every segment runs eagerly. After
``freeze_after`` executions (or ``freeze()``) it freezes: slots that depend on no fed
input are computed once and sealed, the segments are cut into units (islands, gaps,
eager pieces), placeholders are staged into stable buffers and constants snapshotted.
Islands then go warm-up -> compile -> capture -> replay; identity keys guard every
replay, and drift is met by an in-place refresh where the backend's contract allows it,
else by a recapture, each counted. Two consecutive clean steps with every island
replaying make the plan REPLAYING; with no island able to capture it is REPLAY_BLOCKED.

Islands and gaps (dsp_core/runtime/islands.py): an island whose warm-up or capture
raises CaptureFailed is cut, within that step, into islands around the slots that made
it fail; those slots become eager gaps with the failure as their reason, are remembered
in the plan (``Plan.capture_gaps``) and are cut out before capturing from then on.

Faults: any lifecycle call of a unit's backend that raises (SystemExit included), and
any output that does not match the plan's declaration (checked on a unit's first runs
and after each capture), fail that unit: it moves to FAILED with the reason, the
reference backend runs its slots from then on (here and in the executor, for later
live plans), and the step is run again from its feeds, so the call's result is right.
Strict mode raises a BackendFault instead. A failing ``release`` is logged and ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dsp_core import config, diag
from dsp_core.backends.auction import Fault, measure, release_quietly, shape_key
from dsp_core.backends.base import CaptureFailed, CaptureOutOfMemory, ReplayStatus, disagreement
from dsp_core.backends.guard import describe
from dsp_core.diag import Category, Level
from dsp_core.errors import DSPError
from dsp_core.ops.registry import Trait
from dsp_core.plan.fusion import sealed_slots
from dsp_core.plan.plan import ConstantTable, ExternalClass, Plan, Segment
from dsp_core.runtime.contest import Contest
from dsp_core.runtime.epoch import EPOCH
from dsp_core.runtime.islands import Gap, after_failure, check_capture_fault, remember_gap
from dsp_core.runtime.lifecycle import (
    PLAN_TRANSITIONS,
    SLOT_TRANSITIONS,
    LifecycleError,
    PlanPhase,
    SegmentPhase,
    SlotPhase,
    StateMachine,
)
from dsp_core.runtime.staging import ConstantSnapshot, Staging, injected_fault, placement
from dsp_core.runtime.units import (
    IdentityKeys,
    Unit,
    UnitKind,
    bind_symbols,
    buffer_address,
    check_budget,
    check_published,
    gap_reasons,
    output_specs,
    split_units,
    unit_io,
)

if TYPE_CHECKING:
    from dsp_core.runtime.model import Executor

# DSP_STAGING_FAULT (a test switch, dsp_core.runtime.staging) is checked on every steady
# step; os.environ's own dict (bytes keys on POSIX) answers without encoding the key.
_RAW_ENV = hasattr(os.environ, "_data") and hasattr(os.environ, "encodekey")
_ENVIRON: Any = os.environ._data if _RAW_ENV else os.environ  # type: ignore[attr-defined]
_STAGING_FAULT: Any = os.environ.encodekey("DSP_STAGING_FAULT") if _RAW_ENV else "DSP_STAGING_FAULT"  # type: ignore[attr-defined]

log = logging.getLogger("dsp.runtime")
S = SegmentPhase

# A plan whose islands recaptured in at least this many of the last RECAPTURE_WINDOW
# steps is flagged as recapturing every step.
RECAPTURE_WINDOW = 8
RECAPTURE_FLAG = 6


class PlanRuntime:
    """Phases, units, staging and identity keys of one live plan."""

    def __init__(
        self, executor: Executor, feed_shapes: list[tuple[int, tuple[int, ...], Any]], variables: set[str]
    ) -> None:
        self.executor = executor
        self.plan: Plan = executor.plan
        self.diag_id = diag.new_plan_id()  # diag: events and terminal records of this live plan carry it
        self.machine: StateMachine[PlanPhase] = StateMachine(
            "plan", PlanPhase.SLOT_BY_SLOT, PLAN_TRANSITIONS, (self.diag_id, -1, -1)
        )
        self._slot_machines: list[StateMachine[SlotPhase]] | None = None  # built on first use
        self.feed_shapes = feed_shapes  # (flat, shape, dtype) of each fed input: abstract stand-ins at freeze
        self.variables = set(variables)
        self.executions = 0
        self.freeze_after = int(config.get("freeze_after"))
        self.freeze_requested = False
        self.units: list[Unit] = []
        self.staging = Staging()
        self.snapshot: ConstantSnapshot | None = None
        self.template: list[Any] | None = None
        self.bridges: dict[int, Any] = {}
        self.bridge_targets: frozenset[int] = frozenset()
        # Outputs of MUTATES_INPUT slots (dsp::KVScatter): each aliases a buffer the caller owns,
        # written in place, so an island that reads it reads that buffer at its own address
        # (an address that moves is drift, met like any other); never copied into a bridge,
        # which would copy the whole buffer (a KV cache) every step for nothing.
        self.aliases = frozenset(
            self.plan.flat(slot.outputs[0])
            for slot in self.plan.slots
            if slot.traits & Trait.MUTATES_INPUT and slot.outputs and slot.outputs[0] is not None
        )
        self.clean_streak = 0
        self.recent_recaptures: deque[int] = deque(maxlen=RECAPTURE_WINDOW)
        self.flags: list[str] = []
        self.lock = threading.Lock()
        self._timed_unit: Unit | None = None  # diag: the unit a timed step is running (for fault recovery)
        self._names = {k: e.name for k, e in enumerate(self.plan.externals)}
        self.capture_failures = 0  # captures (or warm-ups) that raised CaptureFailed
        self.splits = 0  # units cut into islands and gaps after such a failure
        self._last_index = -1  # the highest unit index handed out by a split
        self._steady: _Steady | None = None  # the steady-state replay program (see _steady_step)

    # -- queries ---------------------------------------------------------------------------
    @property
    def slot_machines(self) -> list[StateMachine[SlotPhase]]:
        """One BUILDING/SEALED machine per slot (made on first use: most live plans never freeze)."""
        if self._slot_machines is None:
            self._slot_machines = [
                StateMachine(f"slot {i}", SlotPhase.BUILDING, SLOT_TRANSITIONS, (self.diag_id, -1, i))
                for i in range(len(self.plan.slots))
            ]
        return self._slot_machines

    @property
    def phase(self) -> PlanPhase:
        """The plan phase."""
        return self.machine.state

    @property
    def sealed(self) -> frozenset[int]:
        """Slots sealed as frozen constants."""
        return frozenset(i for i, m in enumerate(self.slot_machines) if m.state is SlotPhase.SEALED)

    def counters(self) -> dict[str, int]:
        """Lifecycle counters summed over units."""
        total: dict[str, int] = {}
        for unit in self.units:
            for key, val in unit.counters.as_dict().items():
                total[key] = total.get(key, 0) + val
        total["executions"] = self.executions
        total["staging_copies"] = self.staging.copies
        total["capture_failures"] = self.capture_failures
        total["capture_splits"] = self.splits
        return total

    # -- execution -------------------------------------------------------------------------
    def execute(self, feeds: list[tuple[int, Any]], owned: bool = True) -> list[Any]:
        """Run one step; returns the plan's outputs (owned by the caller). ``owned=False``: on the
        steady path, the replay buffers themselves (valid until the plan's next step; see
        ``CompiledModel.stepper``)."""
        with self.lock:
            self.executions += 1
            if diag.ON:
                diag.emit(Category.EXECUTE, Level.DETAILED, "step", self.phase.name, self.executions, self.diag_id)
            steady = self._steady
            if steady is not None and not diag.ON:
                return self._steady_step(steady, feeds, owned)
            if self.phase is PlanPhase.SLOT_BY_SLOT:
                if not self._should_freeze():
                    return self.executor.run(feeds)
                self._freeze(feeds)
            return self._frozen_step(feeds)

    def _should_freeze(self) -> bool:
        if config.get("no_freeze"):
            return False
        return self.freeze_requested or (self.freeze_after > 0 and self.executions > self.freeze_after)

    def request_freeze(self) -> None:
        """Freeze at the next execution (or now, if the plan is idle: shapes are known)."""
        if config.get("no_freeze"):
            log.warning("DSP_NO_FREEZE is set: freeze() ignored")
            return
        with self.lock:
            if self.phase is PlanPhase.SLOT_BY_SLOT:
                self._freeze()

    # -- freezing --------------------------------------------------------------------------
    def _freeze(self, feeds: list[tuple[int, Any]] | None = None) -> None:
        # The measured auction: where several backends take a segment, the one that ran it
        # fastest on this step's feeds (zeros of their shapes when freeze() came first) keeps it.
        measure(self.executor, feeds if feeds is not None else self._zero_feeds())
        plan = self.plan
        sealed = self._detect_sealed()
        values: list[Any] = list(self.executor.template)
        for flat, shape, dtype in self.feed_shapes:  # shape-only ops read these; no value is read
            values[flat] = np.broadcast_to(np.zeros((), dtype=dtype), shape) if dtype is not None else None
        owner = {s: seg for seg in self.executor.partition.segments for s in seg.slots}
        view = _sealed_view(plan, sealed)
        for seg in self.executor.partition.segments:
            mine = tuple(s for s in seg.slots if s in sealed)
            if mine:
                self._run_sealed(seg, mine, values, view)
        template: list[Any] = list(self.executor.template)
        for s in sorted(sealed):
            for v in plan.slots[s].outputs:
                if v is not None:
                    template[plan.flat(v)] = values[plan.flat(v)]
        self.template = template
        for s in sealed:
            self.slot_machines[s].move(SlotPhase.SEALED, "frozen constant", self.executions)
        self.units = self._build_units(sealed, owner)
        # Any unit may run eagerly (a gap, an eager piece, an island that failed or waits
        # after an out-of-memory): what it writes for an island goes through a stable buffer.
        readers = {i for u in self.units if u.kind is UnitKind.ISLAND for i in u.inputs}
        self.bridge_targets = frozenset(o for u in self.units for o in u.outputs if o in readers)
        self.snapshot = ConstantSnapshot(plan.constants, plan.constant_digests)
        self.staging.placement = placement(self.units, self._staged_flats)  # device backends stage their feeds
        if plan.placement is not None:  # several devices: each feed is staged on its first reader's device
            self.staging.devices = plan.placement.feed_devices(self._staged_flats)
        self.__dict__.pop("_owned_cache", None)
        self.machine.move(PlanPhase.SHAPES_FROZEN, f"{len(sealed)} slots sealed", self.executions)
        if not any(u.kind is UnitKind.ISLAND for u in self.units):
            self.machine.move(PlanPhase.REPLAY_BLOCKED, "no segment can capture", self.executions)

    def _zero_feeds(self) -> list[tuple[int, Any]]:
        return [(flat, np.zeros(shape, dtype)) for flat, shape, dtype in self.feed_shapes if dtype is not None]

    def _run_sealed(self, seg: Segment, mine: tuple[int, ...], values: list[Any], view: Plan) -> None:
        """Compute the sealed slots of ``seg`` once; a backend that fails here hands the segment to the reference.

        They run on ``view``: the plan whose liveness keeps every value a live slot reads.
        """
        backend = self.executor.partition.backends[seg.backend]
        piece = Segment(seg.index, seg.backend, seg.mode, mine, threads=seg.threads)
        try:
            compiled = backend.compile(view, piece)
            compiled.run(values)
            release_quietly(compiled)
            if backend is not self.executor.partition.reference:
                outputs = unit_io(self.plan, mine, frozenset())[1]
                specs = output_specs(self.plan, mine, outputs)
                check_published(
                    backend, self.plan, specs, values, bind_symbols(self.plan, self._feed_stand_ins(values))
                )
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001  (the reference computes them instead)
            self.executor.fail_segment(self.executor.segment_of(seg.slots), "sealed run", exc)
            ref = self.executor.partition.reference
            assert ref is not None
            ref.compile(view, Segment(seg.index, ref.name, ref.mode.name, mine)).run(values)

    def _feed_stand_ins(self, values: list[Any]) -> list[tuple[int, Any]]:
        return [(flat, values[flat]) for flat, _, _ in self.feed_shapes]

    def _detect_sealed(self) -> set[int]:
        """Slots that depend on no fed input and draw no random numbers (``fusion.sealed_slots``)."""
        return sealed_slots(self.plan, self.variables)

    def _build_units(self, sealed: set[int], owner: dict[int, Segment]) -> list[Unit]:
        units: list[Unit] = []
        frozen = frozenset(sealed)
        for k, seg in enumerate(self.executor.partition.segments):
            live = Segment(
                seg.index, seg.backend, seg.mode, tuple(s for s in seg.slots if s not in sealed), threads=seg.threads
            )
            built = self._segment_units(k, live, frozen, len(units))
            units.extend(built)
        return units

    def _segment_units(self, k: int, live: Segment, frozen: frozenset[int], first: int) -> list[Unit]:
        """The units of auction segment ``k``; a failing compile hands the whole segment to the reference."""
        while True:
            seg = self.executor.partition.segments[k]
            backend = self.executor.partition.backends[seg.backend]
            units: list[Unit] = []
            try:
                for kind, slots in split_units(self.plan, live, backend):
                    piece = Segment(first + len(units), seg.backend, seg.mode, slots, threads=seg.threads)
                    compiled = backend.compile(self.plan, piece)
                    units.append(self._unit(piece.index, kind, piece, backend, compiled, frozen, k))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001  (raises when there is nothing to fall back to)
                for unit in units:
                    release_quietly(unit.compiled)
                self.executor.fail_segment(k, "compile", exc)
                continue
            return units

    def _unit(
        self, index: int, kind: UnitKind, piece: Segment, backend: Any, compiled: Any, frozen: frozenset[int], k: int
    ) -> Unit:
        inputs, outputs, constants = unit_io(self.plan, piece.slots, frozen)
        unit = Unit(index, kind, piece, backend, compiled, inputs, outputs, constants, origin=k)
        if backend is not self.executor.partition.reference:
            unit.checks = output_specs(self.plan, piece.slots, outputs)
            unit.unchecked = check_budget(backend) if unit.checks else 0
        unit.machine.owner = (self.diag_id, unit.index, -1)
        if diag.ON:
            self._diag_unit_built(unit)
        if kind is not UnitKind.ISLAND:
            reason = (
                gap_reasons(self.plan, piece.slots, backend)
                if kind is UnitKind.GAP
                else f"backend {backend.name} does not capture: runs eagerly"
            )
            unit.machine.move(S.FAILED, reason, self.executions)
            unit.reason = reason
        return unit

    # -- frozen steps ----------------------------------------------------------------------
    def _frozen_step(self, feeds: list[tuple[int, Any]]) -> list[Any]:
        assert self.template is not None and self.snapshot is not None
        values = self.template.copy()
        # Without islands nothing bakes addresses in: feeds are used as given, not copied.
        staged = self._staged_flats if self._has_islands else frozenset()
        for flat, array in feeds:
            if flat in staged and hasattr(array, "shape"):
                values[flat] = self.staging.stage(flat, array)
            else:
                values[flat] = array  # a variable: read in place, its address is an identity key
        if diag.ON:
            self._diag_staged(feeds, staged)
        self.snapshot.check_identity(self.plan.constants, self._names)
        step_clean = True
        unit: Unit | None = None
        try:
            if diag.TIMED:  # diag: a span per unit for the trace
                step_clean = self._run_units_timed(values, feeds)
            else:
                for unit in self.units:
                    step_clean &= self._run_unit(unit, values)
                    if unit.unchecked:
                        self._check(unit, values, feeds)
        except (KeyboardInterrupt, LifecycleError):
            raise  # the user's, or a broken invariant of the core: never hidden
        except BaseException as exc:  # noqa: BLE001  (a backend's fault: the reference takes the unit)
            self._fail_unit(self._timed_unit if diag.TIMED else unit, exc)
            return self._frozen_step(feeds)  # again from the feeds; ends: each fault moves a unit to the reference
        self._after_step(step_clean, values)
        owned = self._owned_flats
        return [_owned(values[i]) if i in owned else values[i] for i in self.executor.output_flat]

    # -- the steady state: a short path for the common replay ------------------------------
    # Once the plan is REPLAYING and a step was clean, with every unit an island replaying
    # its recording, every feed a staged placeholder or a variable fed as the same array as
    # the step the program was made from (so at the same address: a decode step's KV
    # buffers), and diagnostics off, a step needs only: copy the feeds into their staging
    # buffers, check that no constant was replaced, replay each unit, copy the outputs out.
    # The identity keys cannot drift there (every input a unit reads is a staging buffer or
    # a buffer another unit owns), so they are not recomputed; the constants' table counts
    # its changes (plan.ConstantTable), so the check is one integer unless a weight was
    # touched; the value list is the steady program's own (the template with the staging
    # buffers in place, the units writing the same buffers every replay), so it is not
    # rebuilt. Anything unusual (a changed constants table, a replay that is not OK, a
    # raise, an injected staging fault) leaves this path for good and runs the step again
    # on the full one, which handles it. Measured per call on the 3-node MLP:
    # benchmarks/cpu_overhead.py, docs/cpu-backends.md.
    def bound_step(
        self,
        names: tuple[str, ...],
        full: Callable[[], dict[str, Any]],
        convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> tuple[Callable[[], dict[str, Any]], list[Any]] | None:
        """The run of a binding (``CompiledModel.bind``) and the output buffers it returns, or
        None when the plan has no steady program now (or diagnostics are on).

        The binding's inputs are the staging buffers themselves, written in place by the
        caller, and the steady program's replay buffers are the same arrays step after step:
        so a step is only the check that the program is still current and the units' replay
        calls, under the runtime's lock. It returns ``names`` -> the replay buffers (a new
        dict each step, through ``convert`` where given; the arrays valid until the plan's
        next step). Where the check fails it runs nothing and returns ``full()``, the full
        path. A unit that raises goes to the reference (as in the steady step) and the full
        path runs the step again.

        The check is two comparisons: the plan still replays this program (it is not evicted,
        recaptured or failed), and no process-wide event happened since the step was made
        (diagnostics turned on, a constant replaced: ``dsp_core.runtime.epoch``). The step
        stages nothing, so an injected staging fault has nothing to fail here. Each object a
        step touches after a large call is a cache miss, so the step touches few: a 45 µs
        CNN replayed through ONNX Runtime paid 1.3 µs above the bare call when the step
        looked up five flags and counters in a loop, ~0.5 µs now (``docs/lifecycle.md``).
        """
        steady = self._steady
        if steady is None or diag.ON:
            return None
        calls, counters, failed = self._program(steady)
        buffers = [steady.values[i] for i in steady.outputs]
        outputs = dict(zip(names, buffers))
        cell, epoch = EPOCH, EPOCH[0]

        # The lock's own methods, bound once: after a 44 µs call (the CNN fixture on ONNX Runtime, one
        # thread), ``with lock:`` cost the step 0.2-0.3 µs more than a bare call, these 0.1 (2026-12-05).
        acquire, release = self.lock.acquire, self.lock.release

        # The common case, one native call, without the loops: merged into the loop below, DSP's own
        # bound step on the 3-node MLP went from 0.38-0.40 to 0.55-0.57 µs (cpu_overhead.py --per-call).
        if len(calls) == 1:
            (call,), (counter,) = calls, counters

            def step() -> dict[str, Any]:
                acquire()
                try:
                    ok = self._steady is steady and cell[0] == epoch
                    if ok:
                        try:
                            ok = call() is not False
                        except (KeyboardInterrupt, LifecycleError):
                            raise
                        except BaseException as exc:  # noqa: BLE001  (as in _steady_step)
                            failed(0, exc)
                            ok = False
                        else:
                            if ok:
                                self.executions += 1
                                counter.replays += 1
                            else:
                                failed(0, None)
                finally:
                    release()
                if not ok:
                    return full()
                return outputs.copy() if convert is None else convert(outputs)

            return step, buffers

        def steps() -> dict[str, Any]:
            acquire()
            try:
                ok = self._steady is steady and cell[0] == epoch
                if ok:
                    n = 0
                    try:
                        for n, call in enumerate(calls):  # noqa: B007  (n: read on a raise)
                            if call() is False:
                                failed(n, None)
                                ok = False
                                break
                    except (KeyboardInterrupt, LifecycleError):
                        raise
                    except BaseException as exc:  # noqa: BLE001  (as in _steady_step)
                        failed(n, exc)
                        ok = False
                    if ok:
                        self.executions += 1
                        for c in counters:
                            c.replays += 1
            finally:
                release()
            if not ok:
                return full()
            return outputs.copy() if convert is None else convert(outputs)

        return steps, buffers

    def _program(
        self, steady: _Steady
    ) -> tuple[list[Callable[[], Any]], list[Any], Callable[[int, BaseException | None], None]]:
        """The steady program as a step made once runs it: each unit's call (False: its replay was
        not OK), each unit's counters, and what to do when unit ``n`` was not OK or raised."""
        units = [u for u, _ in steady.units]
        # a unit without a replay call replays through ``replay``: False when it was not OK
        calls = [call or functools.partial(_replayed, u.compiled, steady.values) for u, call in steady.units]

        def failed(n: int, exc: BaseException | None) -> None:
            """Unit ``n``'s replay was not OK (``exc`` None) or raised: the full path takes over."""
            if exc is None:
                self._steady = None  # drifted, stale: the full path recaptures
            else:
                self._fail_unit(units[n], exc)

        return calls, [u.counters for u in units], failed

    def run_step(
        self, names: tuple[str, ...], feeds: Sequence[tuple[int, Any]]
    ) -> Callable[[list[tuple[int, Any]]], dict[str, Any] | None] | None:
        """``CompiledModel.run``'s repeat path on the steady program, made once: a step of feeds
        (flat index, array) already checked against those of the call it was made for (``feeds``:
        their flat indexes and array classes, in order) that copies them into their staging
        buffers, replays the units and returns ``names`` -> copies of the outputs; or None, having
        run nothing, when ``execute`` must take the step (the program no longer current, an
        injected staging fault) or after a unit was not OK or raised (``execute`` then runs the
        step again, as a binding's full path does after ``bound_step``). None instead of a step
        where the program has none: no steady program, diagnostics on, a variable read in place,
        a feed staged on a device, an output that is not a host array.

        It is ``_steady_step`` through ``execute`` without their layers: after a 50 µs call of
        the CNN fixture on ONNX Runtime each object a step reads is a cache miss, and ``model.run``
        cost that much more. The copies in and out are made under the runtime's lock: another
        thread's step between them would write the same buffers."""
        steady = self._steady
        if steady is None or diag.ON:
            return None
        flats = [flat for flat, _, _ in self.feed_shapes]
        staged = {f: buf for f, (buf, fill) in zip(flats, steady.buffers) if fill is None}
        if any(cls is not np.ndarray or flat not in staged for flat, cls in feeds):
            return None
        buffers = [staged[flat] for flat, _ in feeds]
        outputs = [(name, steady.values[i]) for name, i in zip(names, steady.outputs)]
        if len(outputs) != len(names) or any(out.__class__ is not np.ndarray for _, out in outputs):
            return None
        calls, counters, failed = self._program(steady)
        staging = self.staging
        cell, epoch = EPOCH, EPOCH[0]
        acquire, release = self.lock.acquire, self.lock.release
        environ, fault = _ENVIRON, _STAGING_FAULT

        if len(buffers) == 1 and len(calls) == 1 and len(outputs) == 1:
            # The common case (a whole model on one runtime), without the loops: each costs the step
            # after a real call (the CNN fixture at batch 1, in turns with the bare call: about 2 µs
            # less than the general step below, 2026-12-05).
            (buf,), (call,), (counter,), ((name, out),) = buffers, calls, counters, outputs

            def step_one(given: list[tuple[int, Any]]) -> dict[str, Any] | None:
                if fault in environ:
                    return None
                array = given[0][1]
                acquire()
                try:
                    if self._steady is not steady or cell[0] != epoch:
                        return None
                    if array is not buf:  # a binding's input passed to run: already in place
                        buf[...] = array
                        staging.copies += 1
                    try:
                        if call() is False:
                            failed(0, None)
                            return None
                    except (KeyboardInterrupt, LifecycleError):
                        raise
                    except BaseException as exc:  # noqa: BLE001  (as in _steady_step)
                        failed(0, exc)
                        return None
                    self.executions += 1
                    counter.replays += 1
                    return {name: out.copy()}
                finally:
                    release()

            return step_one

        def step(given: list[tuple[int, Any]]) -> dict[str, Any] | None:
            if fault in environ:
                return None
            acquire()
            try:
                if self._steady is not steady or cell[0] != epoch:
                    return None
                for buf, (_, array) in zip(buffers, given):
                    if array is not buf:  # a binding's input passed to run: already in place
                        buf[...] = array
                        staging.copies += 1
                n = 0
                try:
                    for n, call in enumerate(calls):  # noqa: B007  (n: read on a raise)
                        if call() is False:
                            failed(n, None)
                            return None
                except (KeyboardInterrupt, LifecycleError):
                    raise
                except BaseException as exc:  # noqa: BLE001  (as in _steady_step)
                    failed(n, exc)
                    return None
                self.executions += 1
                for c in counters:
                    c.replays += 1
                return {name: out.copy() for name, out in outputs}
            finally:
                release()

        return step

    def _steady_step(self, steady: _Steady, feeds: list[tuple[int, Any]], owned: bool = True) -> list[Any]:
        constants = self.plan.constants
        if (
            _STAGING_FAULT in _ENVIRON  # the test switch, looked up without os.environ's key encoding
            or constants is not steady.constants
            or constants.version != steady.version  # type: ignore[attr-defined]
        ):
            self._steady = None
            return self._frozen_step(feeds)  # checks each constant: raises naming a replaced one
        copies = 0
        for (_, array), (buf, fill) in zip(feeds, steady.buffers):
            if array is buf:
                continue  # a binding's input (written in place), or the variable the program reads
            if fill is READ_IN_PLACE:  # another array for a variable: the full path checks its address
                self._steady = None
                return self._frozen_step(feeds)
            if fill is None:
                buf[...] = array
            else:
                fill(buf, array)  # a device buffer: the backend that reads it copies the feed there
            copies += 1
        self.staging.copies += copies
        values = steady.values
        unit: Unit | None = None
        try:
            for unit, call in steady.units:
                if call is not None:
                    call()
                elif unit.compiled.replay(values) is not ReplayStatus.OK:
                    self._steady = None
                    return self._frozen_step(feeds)
                unit.counters.replays += 1
        except (KeyboardInterrupt, LifecycleError):
            raise
        except BaseException as exc:  # noqa: BLE001  (as in _frozen_step: the reference takes the unit)
            self._fail_unit(unit, exc)
            return self._frozen_step(feeds)
        if not owned:
            return [values[i] for i in steady.outputs]
        # replay buffers: the caller gets copies
        out = []
        for i in steady.outputs:
            v = values[i]
            out.append(v.copy() if v.__class__ is np.ndarray else _owned(v))
        return out

    @property
    def _has_islands(self) -> bool:
        return any(u.kind is UnitKind.ISLAND for u in self.units)

    @property
    def _owned_flats(self) -> frozenset[int]:
        """Outputs to copy before returning: those living in buffers DSP reuses or keeps.

        With islands, every output may sit in a replay buffer; without, only outputs that
        are constants, sealed values or the caller's own feeds (returning those would let
        the caller write into them).
        """
        cached = self.__dict__.get("_owned_cache")
        if cached is None:
            assert self.template is not None
            outs = self.executor.output_flat
            n_ext = len(self.plan.externals)
            cached = (
                frozenset(outs)
                if self._has_islands
                else frozenset(i for i in outs if self.template[i] is not None or i <= n_ext)
            )
            self.__dict__["_owned_cache"] = cached
        return cached

    @property
    def _staged_flats(self) -> frozenset[int]:
        """Flat indexes of placeholders (copied into stable buffers); variables are read in place."""
        cached = self.__dict__.get("_staged_cache")
        if cached is None or cached[0] != frozenset(self.variables):
            flats = frozenset(
                self.plan.flat(self.plan.external_ref(k))
                for k, e in enumerate(self.plan.externals)
                if e.cls is ExternalClass.PLACEHOLDER and e.name not in self.variables
            )
            cached = (frozenset(self.variables), flats)
            self.__dict__["_staged_cache"] = cached
        return cached[1]

    # -- the replay contest (dsp_core.runtime.contest) -------------------------------------------
    def _replay_call(self, unit: Unit, values: list[Any]) -> Callable[[], Any] | None:
        """The steady program's call for ``unit``: its replay call, or its contest with the auction's
        runners-up (made the first time, bound anew on every new steady program)."""
        call = unit.compiled.replay_call(values)
        if call is None or unit.contest is False:
            return call
        if unit.contest is None:
            unit.contest = self._contest(unit, call, values) or False
            return unit.contest or call
        contest = unit.contest
        contest.rebind([call, *(r.rival_call(values, unit.compiled) for r in contest.rivals)])
        if not contest.live:  # every rival dropped: the unit runs alone from now on
            contest.release()
            unit.contest = False
            return call
        return contest  # type: ignore[no-any-return]

    def _contest(self, unit: Unit, call: Callable[[], Any], values: list[Any]) -> Contest | None:
        """A contest for ``unit`` with its segment's trial runners-up, where it has some (auction
        CONTEST_RATIO) and the unit is its whole segment: each rival that binds onto the unit's buffers
        and computes its outputs (within the two contracts' tolerance); else None."""
        part = self.executor.partition
        k = unit.origin
        if not config.get("replay_contest") or unit.kind is not UnitKind.ISLAND or k < 0 or k not in part.rivals:
            return None
        if sum(u.origin == k for u in self.units) != 1 or k >= len(part.segments):
            return None  # a segment cut into islands and gaps: a rival would run other slots
        key = shape_key([(f, values[f]) for f, _, _ in self.feed_shapes])
        rivals, trial = part.rivals[k].get(key, []), part.trials.get(k, {}).get(key)
        seg = part.segments[k]
        if not rivals or trial is None or trial.winner != unit.backend.name or trial.threads != seg.threads:
            return None
        holder = unit.backend.name + (f"@{seg.threads}" if seg.threads else "")
        names, calls, made = [holder], [call], []
        for (backend, threads), name in zip(rivals, trial.rivals):
            compiled, rival_call = None, None
            try:
                piece = Segment(unit.index, backend.name, backend.mode.name, unit.segment.slots, threads=threads)
                compiled = backend.compile(self.plan, piece)
                rival_call = compiled.rival_call(values, unit.compiled)
                problem = "it cannot bind onto the segment's buffers" if rival_call is None else None
                if rival_call is not None:
                    problem = _disagreement(unit, call, rival_call, values, compiled)
            except Exception as exc:  # noqa: BLE001  (a rival that cannot compile or run: out of the contest)
                problem = describe(exc)
            if problem is not None or compiled is None or rival_call is None:
                if compiled is not None:
                    release_quietly(compiled)
                log.info("DSP replay contest: segment %d leaves out %s: %s", k, name, problem)
                continue
            names.append(name)
            calls.append(rival_call)
            made.append(compiled)
        if not made:
            return None
        step_s = trial.time_of(holder) or trial.time_of(trial.winner) or 1e-4
        contest = Contest(names, calls, step_s, made, release_quietly)
        part.contests.setdefault(k, {})[key] = contest
        return contest

    def _check(self, unit: Unit, values: list[Any], feeds: list[tuple[int, Any]]) -> None:
        """Compare the unit's outputs with the plan's declarations (its first runs after freezing or capturing)."""
        unit.unchecked -= 1
        check_published(unit.backend, self.plan, unit.checks, values, bind_symbols(self.plan, feeds))

    def _fail_unit(self, unit: Unit | None, exc: BaseException) -> None:
        """``unit``'s backend failed: FAILED with the reason, the reference runs it from now on (or raise)."""
        if unit is None or not self.executor.can_fall_back(unit.backend):
            from dsp_core.runtime.model import raise_fault

            seg = unit.segment if unit is not None else Segment(-1, "", "", ())
            name = unit.backend.name if unit is not None else "?"
            stage = unit.phase.name.lower() if unit is not None else "step"
            raise_fault(name, f"a step ({stage})", seg, exc, self.executor.partition.strict)
        assert unit is not None
        self._steady = None
        stage, failed = unit.phase.name.lower(), unit.backend.name
        reason = f"{failed} failed while {stage}: {describe(exc)}"
        ref = self.executor.partition.reference
        assert ref is not None
        replacement = ref.compile(self.plan, Segment(unit.index, ref.name, ref.mode.name, unit.segment.slots))
        _let_go(unit)
        unit.compiled, unit.backend, unit.checks, unit.unchecked = replacement, ref, (), 0
        unit.reason = reason
        if unit.phase is not S.FAILED:
            unit.machine.move(S.FAILED, reason, self.executions)
        self._diag(Category.BACKEND, "fault", unit, reason, 1)
        k = unit.origin
        if 0 <= k < len(self.executor.segments) and self.executor.segments[k].backend.name == failed:
            self.executor.fail_segment(k, stage, exc)  # later live plans start on the reference too
        else:
            seg = unit.segment
            self.executor.partition.record_fault(Fault(failed, stage, k, seg.slots, describe(exc), ref.name))

    def _run_unit(self, unit: Unit, values: list[Any]) -> bool:
        """Run one unit according to its phase; True when the step was a clean replay."""
        if unit.kind is not UnitKind.ISLAND or unit.phase is S.FAILED:
            self._run_eagerly(unit, values)
            return True  # running eagerly for good is this unit's steady state
        if unit.phase is S.OOM_DEFERRED:
            return self._retry_after_oom(unit, values)
        if unit.phase is S.NEEDS_WARMUP:
            failure = self._warm(unit, values)
            if failure is not None:
                self._split(unit, values, failure)
            return False
        if unit.phase is S.REPLAYING:
            return self._replay(unit, values)
        return self._compile_and_capture(unit, values)

    def _warm(self, unit: Unit, values: list[Any]) -> CaptureFailed | None:
        """NEEDS_WARMUP -> NEEDS_COMPILE; the CaptureFailed a warm-up raised (the unit cannot be captured whole)."""
        try:
            unit.compiled.warm(values)
        except CaptureFailed as exc:
            self.capture_failures += 1
            return exc
        unit.counters.warmups += 1
        unit.machine.move(S.NEEDS_COMPILE, "warmed up", self.executions)
        return None

    def _compile_and_capture(self, unit: Unit, values: list[Any]) -> bool:
        """NEEDS_COMPILE / CAPTURE_PENDING -> REPLAYING, then the first replay; a failed capture splits the unit."""
        failure = self._capture(unit, values)
        if failure is not None:
            self._split(unit, values, failure)
        return False

    def _capture(self, unit: Unit, values: list[Any]) -> CaptureFailed | None:
        """Prepare and capture ``unit`` and replay it once (or defer it after an out-of-memory).

        Returns the CaptureFailed that stopped it, with the unit left as it was (its
        outputs not yet in ``values``): the caller splits it.
        """
        try:
            if unit.phase is S.NEEDS_COMPILE:
                start = time.perf_counter_ns()
                unit.compiled.prepare(values)
                unit.counters.compiles += 1
                self._diag(Category.COMPILE, "prepare", unit, unit.backend.name, time.perf_counter_ns() - start)
                unit.machine.move(S.CAPTURE_PENDING, "buffers planned", self.executions)
            start = time.perf_counter_ns()
            check_capture_fault(self.plan, unit.segment.slots)
            unit.compiled.capture(values)
            unit.counters.captures += 1
            self._diag(Category.GRAPH_REPLAY, "capture", unit, unit.backend.name, time.perf_counter_ns() - start)
        except CaptureOutOfMemory as exc:
            unit.machine.move(S.OOM_DEFERRED, str(exc), self.executions)
            unit.reason, unit.oom_deferred_at = str(exc), self.executions
            self._run_eagerly(unit, values)
            return None
        except CaptureFailed as exc:
            self.capture_failures += 1
            return exc
        unit.machine.move(S.REPLAYING, "captured", self.executions)
        unit.unchecked = check_budget(unit.backend) if unit.checks else 0  # a new recording: check what it writes
        generation = unit.keys.generation + 1 if unit.keys is not None else 0
        unit.keys = IdentityKeys((), self._addresses(unit, values), self._constant_ids(unit, values), 0, generation)
        self._dispatch(unit, values, redispatched=False)
        unit.keys.output_shapes = tuple(tuple(getattr(values[o], "shape", ())) for o in unit.outputs)
        unit.keys.slot_address_hash = hash(tuple(buffer_address(values[o]) for o in unit.outputs))
        return None

    # -- islands and gaps (dsp_core/runtime/islands.py) -------------------------------------
    def _split(self, unit: Unit, values: list[Any], failure: CaptureFailed) -> None:
        """Replace ``unit``, whose capture failed, by islands around the slots that made it fail (gaps).

        Runs within the step: every piece is warmed (or, a gap, run) in plan order, so
        ``values`` ends with the unit's outputs as an eager run would leave them.
        """
        self._steady = None  # the units change
        backend, plan = unit.backend, self.plan
        inside = set(unit.segment.slots)
        # Gap outputs read by the rest of the unit go through stable buffers (bridges) as soon
        # as the gap runs, so the islands captured after it bake those buffers in.
        read_inside = {plan.flat(r) for s in unit.segment.slots for r in plan.slots[s].inputs if r is not None}
        targets = self.bridge_targets | read_inside
        pieces: list[Unit] = []
        work = deque(after_failure(unit.segment.slots, failure))
        learned = False
        try:
            while work:
                step = work.popleft()
                if isinstance(step, Gap):  # remembered first: the gap unit reports the reason
                    learned |= remember_gap(plan, backend, step.slots[0], step.reason)
                    pieces.append(self._piece(unit, UnitKind.GAP, step.slots))
                    self._run_eagerly(pieces[-1], values, targets)
                    continue
                pieces.append(self._piece(unit, UnitKind.ISLAND, step.slots))
                failed = self._warm(pieces[-1], values) or self._capture(pieces[-1], values)
                if failed is not None:
                    release_quietly(pieces.pop().compiled)
                    work.extendleft(reversed(after_failure(step.slots, failed)))
        except BaseException:
            for piece in pieces:
                release_quietly(piece.compiled)
            raise  # the step's handler gives ``unit`` (still in place) to the reference
        _let_go(unit)
        at = self.units.index(unit)
        self.units = [*self.units[:at], *pieces, *self.units[at + 1 :]]  # a new list: the step's loop is unaffected
        readers = {i for u in self.units if u.kind is UnitKind.ISLAND for i in u.inputs}
        self.bridge_targets = frozenset(o for u in self.units for o in u.outputs if o in readers)
        self.__dict__.pop("_owned_cache", None)
        self.splits += 1
        gaps = [p for p in pieces if p.kind is UnitKind.GAP]
        islands = [p for p in pieces if p.kind is UnitKind.ISLAND]
        message = (
            f"capture of slots {min(inside)}..{max(inside)} failed ({failure}): "
            f"{len(islands)} island(s) around {sum(len(g.segment.slots) for g in gaps)} gap slot(s)"
        )
        self._diag(Category.GRAPH_REPLAY, "split", pieces[0] if pieces else None, message, len(gaps))
        log.info("DSP plan %s: %s", plan.content_hash[:12], message)
        on_learned = getattr(self.executor, "on_learned", None)  # the disk cache stores the plan again
        if learned and on_learned is not None:
            try:
                on_learned(plan)
            except Exception as exc:  # noqa: BLE001  (remembering is an optimisation: never fails a step)
                log.warning("DSP: could not store the learned capture gaps: %s", describe(exc))

    def _piece(self, unit: Unit, kind: UnitKind, slots: tuple[int, ...]) -> Unit:
        """A unit of ``slots`` cut from ``unit`` (same backend and origin), compiled.

        Unit indexes are ids (diagnostics and terminal records are keyed by them): the
        piece holding the unit's first slot keeps its index, the others take new ones.
        """
        index = unit.index if slots[0] == unit.segment.slots[0] else self._new_index()
        piece = Segment(index, unit.segment.backend, unit.segment.mode, slots, threads=unit.segment.threads)
        compiled = unit.backend.compile(self.plan, piece)
        return self._unit(index, kind, piece, unit.backend, compiled, self.sealed, unit.origin)

    def _new_index(self) -> int:
        self._last_index = max(self._last_index, max((u.index for u in self.units), default=-1)) + 1
        return self._last_index

    def _replay(self, unit: Unit, values: list[Any]) -> bool:
        """Check the identity keys, meet drift, replay."""
        assert unit.keys is not None
        now = self._addresses(unit, values)
        clean = True
        if now != unit.keys.input_addresses or self._constant_ids(unit, values) != unit.keys.constant_ids:
            clean = False
            self._steady = None  # its calls were made for the recording as it was
            changed = [i for i, a, b in zip(unit.inputs, now, unit.keys.input_addresses) if a != b]
            if unit.compiled.refresh(values, changed):
                unit.counters.refreshes += 1
                self._diag(Category.GRAPH_REPLAY, "refresh", unit, f"address drift at inputs {changed}", len(changed))
                unit.keys.input_addresses = now
                unit.keys.generation += 1
            else:
                return self._recapture(unit, values, f"address drift at inputs {changed}")
        self._dispatch(unit, values, redispatched=False)
        return clean

    def _recapture(self, unit: Unit, values: list[Any], reason: str) -> bool:
        self._steady = None
        unit.machine.demote(S.NEEDS_WARMUP, reason, self.executions)
        unit.counters.recaptures += 1
        self._diag(Category.GRAPH_REPLAY, "recapture", unit, reason, unit.counters.recaptures)
        self.recent_recaptures.append(self.executions)
        unit.compiled.warm(values)
        unit.counters.warmups += 1
        unit.machine.move(S.NEEDS_COMPILE, "re-warmed after drift", self.executions)
        self._compile_and_capture(unit, values)
        return False

    def _dispatch(self, unit: Unit, values: list[Any], redispatched: bool) -> None:
        """Replay; a STALE_BUFFER status re-stages and re-dispatches once."""
        status = unit.compiled.replay(values)
        if injected_fault() == "stale_buffer" and not redispatched:
            status = ReplayStatus.STALE_BUFFER
        unit.counters.replays += 1
        if status is ReplayStatus.STALE_BUFFER:
            if redispatched:
                raise DSPError(f"segment {unit.index} ({unit.backend.name}): buffers still stale after re-dispatch")
            unit.counters.stale_redispatches += 1
            self._steady = None  # the unit records again: the steady program's calls are old
            self._diag(Category.GRAPH_REPLAY, "stale_redispatch", unit, "a recorded buffer was replaced", 1)
            unit.compiled.capture(values)  # re-record against the buffers in values now
            unit.counters.captures += 1
            assert unit.keys is not None
            unit.keys.input_addresses = self._addresses(unit, values)
            unit.keys.generation += 1
            self._dispatch(unit, values, redispatched=True)

    def _retry_after_oom(self, unit: Unit, values: list[Any]) -> bool:
        every = int(config.get("oom_retry_every"))
        if (
            unit.counters.oom_retries < int(config.get("oom_retries"))
            and self.executions - unit.oom_deferred_at >= every
        ):
            unit.counters.oom_retries += 1
            unit.machine.move(S.NEEDS_COMPILE, "retry after out-of-memory", self.executions)
            return self._compile_and_capture(unit, values)
        if unit.counters.oom_retries >= int(config.get("oom_retries")):
            unit.reason = f"out of memory after {unit.counters.oom_retries} retries ({unit.reason})"
            unit.machine.move(S.FAILED, unit.reason, self.executions)
        self._run_eagerly(unit, values)
        return False

    def _run_eagerly(self, unit: Unit, values: list[Any], targets: frozenset[int] | set[int] | None = None) -> None:
        """Run a unit without its recording (gap, eager backend, or a capture that is not there)."""
        unit.compiled.run(values)
        unit.counters.eager_runs += 1
        self._bridge(unit, values, self.bridge_targets if targets is None else targets)

    def _bridge(self, unit: Unit, values: list[Any], targets: frozenset[int] | set[int]) -> None:
        """Copy an eager unit's outputs that islands read (``targets``) into stable buffers."""
        for o in unit.outputs:
            if o not in targets or o in self.aliases or not hasattr(values[o], "shape"):
                continue
            buf = self.bridges.get(o)
            if buf is None or buf.shape != values[o].shape or buf.dtype != values[o].dtype:
                # a numpy scalar's copy is a scalar, which the next step could not write into: a 0-d array
                buf = np.array(values[o]) if isinstance(values[o], np.generic) else values[o].copy()
                self.bridges[o] = buf
            else:
                buf[...] = values[o]
            values[o] = buf
            if diag.ON:
                self._diag(Category.TRANSFER, "bridge", unit, f"value {o}", buf.nbytes, Level.DETAILED)

    def _addresses(self, unit: Unit, values: list[Any]) -> tuple[int, ...]:
        return tuple(buffer_address(values[i]) for i in unit.inputs)

    def _constant_ids(self, unit: Unit, values: list[Any]) -> tuple[int, ...]:
        return tuple(id(values[i]) for i in unit.constants)

    def _after_step(self, clean: bool, values: list[Any]) -> None:
        islands = [u for u in self.units if u.kind is UnitKind.ISLAND]
        if self.phase is PlanPhase.SHAPES_FROZEN:
            if not islands:  # every slot of every island turned out to be a gap
                reasons = sorted({u.reason for u in self.units if u.kind is UnitKind.GAP})
                shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
                self.machine.move(PlanPhase.REPLAY_BLOCKED, f"no slot could be captured: {shown}", self.executions)
                return
            if all(u.phase is S.FAILED for u in islands):
                self.machine.move(PlanPhase.REPLAY_BLOCKED, "every island failed to capture", self.executions)
                return
            ready = any(u.phase is S.REPLAYING for u in islands) and all(
                u.phase in (S.REPLAYING, S.FAILED) for u in islands
            )
            self.clean_streak = self.clean_streak + 1 if (clean and ready) else 0
            if self.clean_streak >= 2:
                self.machine.move(
                    PlanPhase.REPLAYING, "every island replayed twice with stable addresses", self.executions
                )
        elif self.phase is PlanPhase.REPLAYING and clean and self._steady is None:
            self._steady = _Steady.of(self, values)
        recent = [e for e in self.recent_recaptures if e > self.executions - RECAPTURE_WINDOW]
        if len(recent) >= RECAPTURE_FLAG and "recapturing every step" not in self.flags:
            self.flags.append("recapturing every step")
            self._diag(Category.GRAPH_REPLAY, "drift", None, "recapturing every step: addresses drift", len(recent))
            log.warning(
                "DSP plan %s recaptures nearly every step: addresses drift (feed variables in place?)",
                self.plan.content_hash[:12],
            )

    # -- diagnostics (dsp_core.diag): called only when diag.ON / diag.TIMED ----------------
    def _diag(
        self,
        category: Category,
        code: str,
        unit: Unit | None,
        message: str,
        payload: float,
        level: Level = Level.SUMMARY,
    ) -> None:
        """One event about this plan (and ``unit``); rare paths call it unconditionally."""
        if diag.ON:
            diag.emit(category, level, code, message, payload, self.diag_id, unit.index if unit else -1)

    def _diag_unit_built(self, unit: Unit) -> None:
        seconds = float(getattr(unit.compiled, "compile_seconds", 0.0))
        message = f"{unit.kind.value} on {unit.backend.name}, slots {len(unit.segment.slots)}"
        self._diag(Category.COMPILE, "unit", unit, message, seconds * 1e9)

    def _diag_staged(self, feeds: list[tuple[int, Any]], staged: frozenset[int]) -> None:
        for flat, array in feeds:
            if flat in staged and hasattr(array, "shape"):
                message = f"input {self._names.get(flat - 1, flat)}"  # external k lives at flat 1 + k
                diag.emit(Category.TRANSFER, Level.DETAILED, "stage", message, array.nbytes, self.diag_id, -1, -1)

    def _run_units_timed(self, values: list[Any], feeds: list[tuple[int, Any]]) -> bool:
        """The units of one frozen step, each timed as a span (trace category 'unit')."""
        clean = True
        for unit in self.units:
            self._timed_unit = unit
            start = time.perf_counter_ns()
            clean &= self._run_unit(unit, values)
            if unit.unchecked:
                self._check(unit, values, feeds)
            spent = time.perf_counter_ns() - start
            label = f"{unit.kind.value} {unit.phase.name.lower()} on {unit.backend.name}"
            diag.emit(Category.TIMING, Level.FULL, "unit", label, spent, self.diag_id, unit.index, -1, start)
        return clean

    # -- demotion --------------------------------------------------------------------------
    def demote(self, reason: str) -> None:
        """Back to SLOT_BY_SLOT (recorded): units released, sealed slots rebuilt on the next freeze."""
        with self.lock:
            if self.phase is PlanPhase.SLOT_BY_SLOT:
                return
            self._steady = None
            for unit in self.units:
                _let_go(unit)
            self.units = []
            self.template = None
            self.__dict__.pop("_owned_cache", None)
            self.staging.invalidate()
            self.bridges.clear()
            for m in self.slot_machines:
                if m.state is SlotPhase.SEALED:
                    m.demote(SlotPhase.BUILDING, reason, self.executions)
            self.machine.demote(PlanPhase.SLOT_BY_SLOT, reason, self.executions)
            self.executions = 0
            self.clean_streak = 0

    def release(self) -> None:
        """Free every unit's buffers and recordings, the staging buffers and bridges (the plan left the cache)."""
        self._steady = None
        for unit in self.units:
            _let_go(unit)
        self.staging.invalidate()
        self.bridges.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by staging, bridges and units."""
        return (
            self.staging.nbytes
            + sum(int(getattr(b, "nbytes", 0)) for b in self.bridges.values())
            + sum(u.compiled.nbytes for u in self.units)
        )


def _sealed_view(plan: Plan, sealed: set[int]) -> Plan:
    """``plan`` with liveness for the freeze: no value a live slot (or the caller) reads is released.

    Sealed slots run once, before any live slot: a value whose last reader in plan order
    is sealed may still be read by an earlier live slot at every step (it lives in the
    template), so the sealed run must not release it.
    """
    keep = {r for slot in plan.slots if slot.index not in sealed for r in slot.inputs if r is not None and r >= 0}
    keep.update(r for r in plan.outputs if r >= 0)
    release = tuple(tuple(v for v in rel if v not in keep) for rel in plan.release)
    return dataclasses.replace(plan, release=release) if release != plan.release else plan


def _owned(value: Any) -> Any:
    """A copy of an output that lives in a buffer the next step will overwrite."""
    if isinstance(value, list):
        return [_owned(v) for v in value]
    copy = getattr(value, "copy", None)
    return copy() if callable(copy) else value


def _disagreement(
    unit: Unit, call: Callable[[], Any], rival_call: Callable[[], Any], values: list[Any], rival: Any
) -> str | None:
    """Why the rival may not run ``unit``'s steps: its outputs on the same inputs disagree with the
    holder's within the looser of the two contracts' tolerance (``base.disagreement``: relative to
    the holder's largest value); None when they agree. The holder runs last: ``values`` keep its outputs."""
    call()
    want = [np.array(values[o], copy=True) for o in unit.outputs]
    rival_call()
    got = [np.array(values[o], copy=True) for o in unit.outputs]
    call()
    tolerance = max(unit.backend.contract.tolerance, rival.backend.contract.tolerance)
    for flat, a, b in zip(unit.outputs, want, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"its output v{flat} is {b.dtype}{list(b.shape)}, the segment's {a.dtype}{list(a.shape)}"
        why = disagreement(b, a, tolerance)
        if why is not None:
            return f"its output v{flat} differs: {why}"
    return None


def _let_go(unit: Unit) -> None:
    """Release ``unit``'s compiled segment and its contest's rival; no contest is made for it again."""
    if unit.contest:
        unit.contest.release()
    unit.contest = False
    release_quietly(unit.compiled)


def _replayed(compiled: Any, values: list[Any]) -> bool:
    """Replay ``compiled`` on ``values``: whether it was OK (a binding's step of a unit without a replay call)."""
    return compiled.replay(values) is ReplayStatus.OK


# The "fill" of a variable's entry in a steady program: read in place, never copied.
READ_IN_PLACE: Any = object()


class _Steady:
    """What ``PlanRuntime._steady_step`` needs, computed once when the plan settles into replaying.

    ``values``: the value list of the clean step it is made from (template, staging
    buffers, the units' output buffers); each replay writes the same buffers, so steps
    reuse it. ``units``: each unit with its backend's ``replay_call`` (None: ``replay``).
    """

    def __init__(self, runtime: PlanRuntime, flats: list[int], values: list[Any]) -> None:
        fills, staged = runtime.staging.fills, runtime._staged_flats
        # per feed, in feed order: its staging buffer and the fill of a device buffer (None: host);
        # a variable's array, read in place, and READ_IN_PLACE (a step feeding another array leaves)
        self.buffers = [(values[f], fills.get(f) if f in staged else READ_IN_PLACE) for f in flats]
        self.values = values
        self.units = [(u, runtime._replay_call(u, values)) for u in runtime.units]
        self.outputs = runtime.executor.output_flat
        self.constants = runtime.plan.constants  # the table and its version when the step was clean
        self.version = getattr(self.constants, "version", -1)

    @classmethod
    def of(cls, runtime: PlanRuntime, values: list[Any]) -> _Steady | None:
        """The steady program of ``runtime`` from a clean step's ``values``, or None when steps need the full path."""
        units = runtime.units
        if not units or any(u.kind is not UnitKind.ISLAND or u.phase is not S.REPLAYING or u.unchecked for u in units):
            return None
        if not isinstance(runtime.plan.constants, ConstantTable):
            return None  # a table that does not count its changes: every step checks each constant
        staged, staging = runtime._staged_flats, runtime.staging
        flats = [flat for flat, _, _ in runtime.feed_shapes]
        if any(f in staging.devices for f in flats):
            return None  # a feed placed on one of several devices
        for f in flats:
            if f not in staged:
                # A variable, read in place (a decode step's KV buffers): the program reads this array,
                # and a step that feeds it again (the same object, so the same memory) replays it;
                # one that feeds another array takes the full path, which checks its address.
                if not hasattr(values[f], "shape"):
                    return None
                continue
            buf = staging.buffers.get(f)
            if buf is None or values[f] is not buf:
                return None
            if f not in staging.fills and not isinstance(buf, np.ndarray):
                return None  # a host buffer that is not numpy's: the full path stages it
        return cls(runtime, flats, values)
