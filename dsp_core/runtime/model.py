"""CompiledModel: what ``dsp.compile`` returns. Plans per output set, feeds checked, run.

The model compiles one plan per requested output set, has the auction cut it into
segments, and runs those segments over one flat value list per call. A graph the plan
compiler declines runs on the legacy interpreter; ``model.declined`` says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dsp_core import config, diag
from dsp_core.backends.auction import Fault, Partition, assign, explain, release_quietly
from dsp_core.backends.base import CompiledSegment, Registry
from dsp_core.backends.discovery import discover
from dsp_core.backends.guard import BackendFault, describe
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.cache.memory import CacheStats, LivePlan, PlanCache, ShapeSignature, available_host_bytes
from dsp_core.devices.execution import Placed
from dsp_core.devices.placement import Placement, place
from dsp_core.devices.placement import parse as parse_placement
from dsp_core.devices.topology import Topology, current_topology
from dsp_core.diag import Category, Level, flight
from dsp_core.errors import InputError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Value
from dsp_core.plan.compiler import Declined, check_outputs, compile_plan
from dsp_core.plan.merge import merge_report
from dsp_core.plan.plan import ExternalClass, Plan, Segment
from dsp_core.runtime.epoch import EPOCH
from dsp_core.runtime.handle import DspHandle
from dsp_core.runtime.legacy import run_graph
from dsp_core.runtime.plan_runtime import PlanRuntime
from dsp_core.runtime.units import OutputSpec, bind_symbols, check_published, output_specs, unit_io

if TYPE_CHECKING:
    from dsp_core.runtime.binding import Binding


@dataclass(frozen=True)
class FeedSpec:
    """How one fed input is checked and where it goes in the flat value list."""

    name: str
    flat: int
    dtype: np.dtype[Any] | None
    shape: tuple[int | str | None, ...] | None
    kind: str = "tensor"


class Executor:
    """One plan made runnable: its partition, compiled segments and value-list template.

    A segment whose backend fails while running (raises anything, or writes an output
    that is not what the plan declares) is given to the reference backend for good and
    the step is run again from its feeds; the fault is kept in ``partition.faults``.
    Strict mode raises a BackendFault instead.
    """

    def __init__(self, plan: Plan, part: Partition, compiled: list[CompiledSegment] | None = None) -> None:
        self.plan = plan
        self.partition = part
        self.segments: list[CompiledSegment] = (
            compiled if compiled is not None else [part.backends[s.backend].compile(plan, s) for s in part.segments]
        )
        if diag.ON:
            for seg in self.segments:
                seconds = float(getattr(seg, "compile_seconds", 0.0))
                message = f"segment {seg.segment.index} on {seg.backend.name}, {len(seg.segment.slots)} slots"
                diag.emit(Category.COMPILE, Level.SUMMARY, "segment", message, seconds * 1e9, -1, seg.segment.index)
        template: list[Any] = [None] * plan.n_flat
        for k, array in plan.constants.items():
            template[plan.flat(plan.external_ref(k))] = array
        self.template = template
        self.output_flat = tuple(plan.flat(r) for r in plan.outputs)
        self.checks: list[tuple[OutputSpec, ...]] = [self._specs(c) for c in self.segments]
        # Called with the plan when a live plan learned capture gaps (Plan.capture_gaps).
        self.on_learned: Callable[[Plan], None] | None = None

    def _specs(self, compiled: CompiledSegment) -> tuple[OutputSpec, ...]:
        """What a segment's published outputs must be; nothing for the reference (the oracle)."""
        if compiled.backend is self.partition.reference:
            return ()
        slots = compiled.segment.slots
        return output_specs(self.plan, slots, unit_io(self.plan, slots, frozenset())[1])

    def run(self, staged: list[tuple[int, Any]]) -> list[Any]:
        """Run every segment on a fresh value list; returns the outputs in order."""
        while True:
            values = self.template.copy()
            for flat, array in staged:
                values[flat] = array
            symbols = bind_symbols(self.plan, staged) if any(self.checks) else {}
            k = 0
            try:
                for k, segment in enumerate(self.segments):
                    segment.run(values)
                    if self.checks[k]:
                        check_published(segment.backend, self.plan, self.checks[k], values, symbols)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001  (a backend's fault: its segment goes to the reference)
                self.fail_segment(k, "run", exc)
                continue
            return [values[i] for i in self.output_flat]

    def can_fall_back(self, backend: Any) -> bool:
        """True when a fault of ``backend`` can be met by running on the reference."""
        ref = self.partition.reference
        return ref is not None and backend is not ref and not self.partition.strict

    def fail_segment(self, k: int, stage: str, exc: BaseException) -> None:
        """Segment ``k``'s backend failed at ``stage``: the reference runs it from now on (or raise)."""
        compiled = self.segments[k]
        backend, seg = compiled.backend, self.partition.segments[k]
        if not self.can_fall_back(backend):
            raise_fault(backend.name, stage, seg, exc, self.partition.strict)
        ref = self.partition.reference
        assert ref is not None
        moved = Segment(seg.index, ref.name, ref.mode.name, seg.slots)
        replacement = ref.compile(self.plan, moved)
        release_quietly(compiled)
        self.partition.segments[k] = moved
        self.partition.backends.setdefault(ref.name, ref)
        self.segments[k], self.checks[k] = replacement, ()
        self.partition.record_fault(Fault(backend.name, stage, seg.index, seg.slots, describe(exc), ref.name))

    def segment_of(self, slots: tuple[int, ...]) -> int:
        """Index in ``segments`` of the auction segment holding ``slots`` (-1 if none)."""
        first = slots[0] if slots else -1
        return next((k for k, s in enumerate(self.partition.segments) if first in s.slots), -1)


def raise_fault(backend: str, stage: str, seg: Segment, exc: BaseException, strict: bool) -> None:
    """Re-raise a segment's failure: as it is from the reference, as a BackendFault in strict mode."""
    if not strict:
        if isinstance(exc, Exception):
            raise exc
        span = f"slots {seg.slots[0]}..{seg.slots[-1]}" if seg.slots else "no slots"
        raise BackendFault(
            f"backend {backend} failed {stage} of segment {seg.index} ({span}): {describe(exc)}"
        ) from exc
    span = f"slots {seg.slots[0]}..{seg.slots[-1]}" if seg.slots else "no slots"
    raise BackendFault(
        f"backend {backend} failed {stage} of segment {seg.index} ({span}): {describe(exc)}; "
        "strict mode: no fallback (compile without strict=True to fall back to the reference)"
    ) from exc


class CompiledModel:
    """A graph compiled for one execution mode; ``run`` feeds it and returns outputs.

    Plans: one base plan per requested output set (compiled once), and one *live plan*
    per shape signature, kept in an LRU cache with pins and budgets (dsp_core.cache).
    """

    def __init__(
        self,
        graph: Graph | None,
        mode: GraphExecutionMode = GraphExecutionMode.AUTO,
        strict: bool = False,
        registry: Registry | None = None,
        *,
        plan: Plan | None = None,
        load_graph: Callable[[], Graph] | None = None,
        cache_capacity: int | None = None,
        stats: CacheStats | None = None,
        placement: Any = None,
    ) -> None:
        if graph is None and (plan is None or load_graph is None):
            raise ValueError("CompiledModel needs a graph, or a plan and a way to load the graph")
        diag.configure_from_env()  # diag: DSP_DIAGNOSTICS* are read once per process
        # Placement across devices (dsp_core.devices): None = one device, no pass at all.
        self.placement_request = placement
        self.topology: Topology | None = None
        if placement is not None:
            parse_placement(placement)  # a malformed request fails here, before any compiling
            self.topology = current_topology()
        self.placements: dict[tuple[str, ...], Placement] = {}
        self.variables: set[str] = set()  # inputs marked variable (mark_variable); one set, shared
        self._graph = graph
        self._load_graph = load_graph
        self.mode = mode
        self.strict = strict
        self.registry = registry if registry is not None else discover()
        self.stats = stats if stats is not None else CacheStats()
        self._executors: dict[tuple[str, ...], Executor | Declined] = {}
        self._lock = threading.Lock()
        if plan is not None:  # from the disk cache: the graph is loaded only if ever needed
            self._default_outputs = plan.output_names
            self._feeds = _feed_specs_of_plan(plan)
            self._executors[plan.output_names] = self._executor(plan)
        else:
            assert graph is not None
            self._default_outputs = tuple(graph.output_names)
            self._feeds = _feed_specs(graph)
            self._prepare(self._default_outputs)  # compile eagerly: errors surface at compile()
        self.last_live: LivePlan | None = None
        self.freeze_on_build = False
        # False: outputs are numpy (device arrays are copied to the host); True: a GPU
        # backend's outputs are returned as its device arrays (CuPy), with no copy to the host.
        self.outputs_on_device = False
        self._repeat: _Repeat | None = None  # the previous call's checked feeds (the repeat path)
        self.dsp = DspHandle(self)
        self._feed_names = frozenset(s.name for s in self._feeds)
        self._feed_name_tuple = tuple(s.name for s in self._feeds)
        self._mode_name = mode.name
        self.cache = PlanCache(
            self._capacity(cache_capacity),
            int(config.get("plan_cache_budget") * available_host_bytes()),
            self.stats,
            explain_misses=config.get("explain_cache_misses"),
        )

    def _capacity(self, explicit: int | None) -> int:
        """Live plans kept: explicit, else DSP_PLAN_CACHE_CAPACITY, else 64 with a GPU backend, 4 on CPU."""
        capacity = config.get("plan_cache_capacity", explicit)
        if capacity:
            return int(capacity)
        entry = self._executors.get(self._default_outputs)
        gpu = isinstance(entry, Executor) and any(b.platform != "cpu" for b in entry.partition.backends.values())
        return 64 if gpu else 4

    # -- introspection ----------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        """The model's graph (loaded on first use when the plan came from the disk cache)."""
        if self._graph is None:
            assert self._load_graph is not None
            self._graph = self._load_graph()
        return self._graph

    @property
    def input_names(self) -> list[str]:
        """Names the caller feeds."""
        return [s.name for s in self._feeds]

    @property
    def input_dtypes(self) -> dict[str, np.dtype[Any] | None]:
        """Each fed input's declared dtype (None where the graph leaves it open)."""
        return {s.name: s.dtype for s in self._feeds}

    @property
    def output_names(self) -> list[str]:
        """The graph's outputs (what ``run`` returns by default)."""
        return list(self._default_outputs)

    @property
    def declined(self) -> Declined | None:
        """Why the plan compiler declined the graph (default outputs), or None."""
        entry = self._prepare(self._default_outputs)
        return entry if isinstance(entry, Declined) else None

    def plan(self, outputs: Sequence[str] | None = None) -> Plan | None:
        """The plan for ``outputs`` (None if the graph was declined)."""
        entry = self._prepare(self._names(outputs))
        return entry.plan if isinstance(entry, Executor) else None

    def partition(self, outputs: Sequence[str] | None = None) -> Partition | None:
        """The auction's result for ``outputs`` (None if declined)."""
        entry = self._prepare(self._names(outputs))
        return entry.partition if isinstance(entry, Executor) else None

    def resolved_backends(self) -> list[str]:
        """Names of the backends running the default plan ('legacy' if declined)."""
        part = self.partition()
        return part.resolved() if part is not None else ["legacy"]

    def explain(self, outputs: Sequence[str] | None = None) -> dict[str, Any]:
        """The auction record (or the decline reason) as a JSON-able dict."""
        entry = self._prepare(self._names(outputs))
        if isinstance(entry, Declined):
            return {"mode": self.mode.name, "declined": str(entry), "segments": []}
        report = explain(entry.plan, entry.partition)
        report["merges"] = merge_report(entry.plan, self.graph)
        return report

    def when_plan_learns(self, callback: Callable[[Plan], None]) -> None:
        """Call ``callback(plan)`` when a live plan of the default outputs learns capture gaps."""
        entry = self._prepare(self._default_outputs)
        if isinstance(entry, Executor):
            entry.on_learned = callback

    def explain_miss(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> list[str]:
        """Why these feeds would miss the plan cache: differences from the nearest cached signature."""
        names = self._names(outputs)
        entry = self._prepare(names)
        if isinstance(entry, Declined):
            return ["the graph was declined: it runs on the legacy interpreter, uncached"]
        signature = self._signature(names, entry, self._stage(feeds))
        if signature in self.cache:
            return []
        nearest = [signature.differences(s) for s in self.cache.signatures()]
        return min(nearest, key=len) if nearest else ["the cache is empty"]

    # -- running ----------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` (name -> array); returns every requested output by name."""
        if outputs is None:
            repeat = self._repeat
            if repeat is not None:
                done = repeat.run(self, repeat, feeds)
                if done is not None:
                    return done
        names = self._default_outputs if outputs is None else self._names(outputs)
        staged = self._stage(feeds)
        try:
            return self._run_staged(names, staged)
        except Exception as exc:  # diag: the flight recorder writes its file and names it in the error
            flight.record_failure(exc, self.last_live.runtime.diag_id if self.last_live is not None else -1)
            raise

    def stepper(self, feeds: Mapping[str, Any]) -> Stepper:
        """Steps on ``feeds`` whose arrays stay the same objects (written in place between steps),
        for a loop that reads each step's outputs before the next (``GenerationPipeline``'s decode):
        the first step takes ``run``; later ones skip the feed checks it passed, keep the live plan
        pinned (``close`` releases it) and return the plan's output buffers without copies (valid
        until the next step). Unlike ``bind``, the arrays are the caller's (variables are read in
        place), and a step is never run to warm up."""
        return Stepper(self, feeds)

    def bind(self, feeds: Mapping[str, Any], settle: int = 8) -> Binding:
        """IO binding: warm the plan up on ``feeds`` (up to ``settle`` real steps, until it replays)
        and return a ``Binding`` whose ``inputs`` are the plan's own staging buffers (write the next
        values into them in place) and whose ``run()`` replays without copying feeds in or outputs
        out (its outputs are the plan's buffers, valid until the next step). For a model without
        variables (``mark_variable``): the warm-up steps would advance them. README: "IO binding"."""
        from dsp_core.runtime.binding import Binding

        return Binding(self, feeds, settle)

    def _run_staged(self, names: tuple[str, ...], staged: list[Any]) -> dict[str, np.ndarray]:
        """One step on checked feeds: the legacy interpreter for a declined graph, else the live plan."""
        entry = self._prepare(names)
        if isinstance(entry, Declined):
            results = run_graph(self.graph, {s.name: a for s, a in zip(self._feeds, staged)}, names)
            return {name: _as_output(r) for name, r in zip(names, results)}
        live = self.live_plan(names, entry, staged)
        self.last_live = live
        try:
            results = live.runtime.execute([(s.flat, a) for s, a in zip(self._feeds, staged)])
        finally:
            self.cache.release(live)
        if names == self._default_outputs and all(a.__class__ is np.ndarray or _on_device(a) for a in staged):
            checked = tuple((s.name, s.flat, a.__class__, a.shape, a.dtype) for s, a in zip(self._feeds, staged))
            self._repeat = _Repeat(live.signature, checked)
        return {name: _as_output(r, self.outputs_on_device) for name, r in zip(names, results)}

    def live_plan(self, names: tuple[str, ...], entry: Executor, staged: list[Any]) -> LivePlan:
        """The live plan of this call's shape signature (pinned: release it after the run)."""
        signature = self._signature(names, entry, staged)
        live = self.cache.acquire(signature)
        if live is None:
            nbytes = sum(getattr(a, "nbytes", 0) for a in staged)
            shapes = [
                (s.flat, a.shape, a.dtype) if hasattr(a, "shape") else (s.flat, (), None)
                for s, a in zip(self._feeds, staged)
            ]
            runtime = PlanRuntime(entry, shapes, self.variables)
            runtime.freeze_requested = self.freeze_on_build
            live = self.cache.insert(LivePlan(signature, entry, runtime, nbytes=nbytes))
        return live

    def mark_variable(self, names: Sequence[str]) -> None:
        """Class inputs as VARIABLE in every live plan; frozen ones are demoted to re-run detection."""
        self.variables.update(names)
        for signature in self.cache.signatures():
            live = self.cache.acquire(signature)
            if live is None:
                continue
            try:
                live.runtime.variables = set(self.variables)
                live.runtime.demote(f"inputs marked variable: {', '.join(sorted(names))}")
            finally:
                self.cache.release(live)

    def _signature(self, names: tuple[str, ...], entry: Executor, staged: list[Any]) -> ShapeSignature:
        # dtype objects, not dtype.str (a slow property): the key is built on every call.
        feeds = tuple([(a.shape, a.dtype) if a.__class__ is np.ndarray else _other_feed_key(a) for a in staged])
        return ShapeSignature(names, self._feed_name_tuple, feeds, self._mode_name, entry.plan.content_hash)

    def run_legacy(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run on the legacy interpreter (the baseline every plan is measured against)."""
        names = self._names(outputs)
        staged = self._stage(feeds)
        results = run_graph(self.graph, {s.name: a for s, a in zip(self._feeds, staged)}, names)
        return {name: _as_output(r) for name, r in zip(names, results)}

    def _names(self, outputs: Sequence[str] | None) -> tuple[str, ...]:
        if outputs is None:
            return self._default_outputs
        if tuple(outputs) in self._executors:
            return tuple(outputs)
        return check_outputs(self.graph, outputs)

    def _executor(self, plan: Plan) -> Executor:
        if self.placement_request is not None:
            placed = place(plan, self.placement_request, self.topology)
            self.placements[plan.output_names] = placed
            plan.placement = Placed(plan, placed, self.variables) if placed.multi_device else None
        part, compiled = assign(plan, self.registry, self.mode, self.strict)
        return Executor(plan, part, compiled)

    def _prepare(self, names: tuple[str, ...]) -> Executor | Declined:
        entry = self._executors.get(names)
        if entry is None:
            with self._lock:
                entry = self._executors.get(names)
                if entry is None:
                    start = time.perf_counter_ns()
                    built = compile_plan(self.graph, names)
                    if diag.ON:
                        spent = time.perf_counter_ns() - start
                        diag.emit(Category.COMPILE, Level.SUMMARY, "plan", f"outputs {', '.join(names)}", spent)
                    entry = built if isinstance(built, Declined) else self._executor(built)
                    self._executors[names] = entry
        return entry

    def _stage(self, feeds: Mapping[str, Any]) -> list[Any]:
        """Check feeds against the graph's inputs: names, dtypes, ranks, dims."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        if len(feeds) != len(self._feeds) or any(name not in self._feed_names for name in feeds):
            self._check_names(feeds)
        staged: list[Any] = []
        symbols: dict[str, tuple[int, str]] = {}
        for spec in self._feeds:
            staged.append(_check_feed(spec, feeds[spec.name], symbols))
        return staged

    def _check_names(self, feeds: Mapping[str, Any]) -> None:
        expected = {s.name for s in self._feeds}
        unknown = [name for name in feeds if name not in expected]
        if unknown:
            raise InputError(
                f"unknown input {unknown[0]!r}; the model's inputs are {', '.join(sorted(expected)) or '(none)'}"
            )
        for spec in self._feeds:
            if spec.name not in feeds:
                raise InputError(f"missing input {spec.name!r}; the model needs {', '.join(self.input_names)}")


class Stepper:
    """See ``CompiledModel.stepper``."""

    def __init__(self, model: CompiledModel, feeds: Mapping[str, Any]) -> None:
        self.model = model
        self.feeds = feeds
        self._live: LivePlan | None = None
        self._staged: list[tuple[int, Any]] = []

    def step(self) -> dict[str, Any]:
        """One step: output name -> array (the plan's buffer on the steady path)."""
        live = self._live
        if live is None:
            out = self.model.run(self.feeds)
            self._pin()
            return out
        try:
            results = live.runtime.execute(self._staged, owned=False)
        except Exception as exc:  # diag: as in run()
            flight.record_failure(exc, live.runtime.diag_id)
            raise
        for r in results:
            if r.__class__ is not np.ndarray:  # a sequence, None, a device array: as run() returns them
                on_device = self.model.outputs_on_device
                return {name: _as_output(r, on_device) for name, r in zip(self.model._default_outputs, results)}
        return dict(zip(self.model._default_outputs, results))

    def _pin(self) -> None:
        """After the first step: the repeat path's checked feeds, if the call left them (the same
        arrays as ``feeds`` holds now), and the live plan pinned."""
        model, repeat = self.model, self.model._repeat
        if repeat is None or model.last_live is None or model.last_live.signature != repeat.signature:
            return
        feeds = self.feeds
        if feeds.__class__ is not dict or len(feeds) != repeat.count:
            return
        staged = [(flat, feeds[name]) for name, flat, *_ in repeat.feeds]
        live = model.cache.acquire(repeat.signature)
        if live is None:
            return
        self._live, self._staged = live, staged

    def close(self) -> None:
        """Release the pinned plan (later steps take ``run`` again)."""
        if self._live is not None:
            self.model.cache.release(self._live)
            self._live = None

    def __enter__(self) -> Stepper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Repeat:
    """A call's shape signature and its feeds as checked: (name, flat index, array class, shape, dtype);
    ``run``: the repeat path made for them (``_repeat_path``), with the live plan's run step
    (``PlanRuntime.run_step``) once the plan replays its steady program (``made_from``: the program
    and the epoch (``dsp_core.runtime.epoch``) the step was made under, or tried under where there was
    none: a step made before diagnostics were switched on and off, or a constant replaced and
    restored, would take ``execute`` for good)."""

    signature: ShapeSignature
    feeds: tuple[tuple[str, int, Any, tuple[int, ...], np.dtype[Any]], ...]
    count: int = field(init=False)  # len(feeds)
    run: Callable[[CompiledModel, _Repeat, Mapping[str, Any]], dict[str, Any] | None] = field(init=False)
    made_from: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.count = len(self.feeds)
        self.run = _repeat_path(self.signature, self.feeds, None)


# -- the repeat path: DSP's own per-call overhead --------------------------------------------
# A call with the default outputs whose feeds are a dict of exactly the previous such call's
# names, as arrays of the same classes (numpy's, or a device's such as CuPy's), shapes and
# dtypes, passed every check of ``_stage`` last time and passes them again: it skips them and
# reuses that call's shape signature (looked up in the plan cache as usual, so pins, LRU order
# and hit counts are unchanged). Anything else takes the full path. Once the plan replays its
# steady program, the step is the program's own (``PlanRuntime.run_step``: copies in, replay,
# copies out), not ``execute``'s layers: after a real call each object a step reads is a cache
# miss (``benchmarks/cpu_overhead.py --per-call``, ``after_a_call``).
def _repeat_path(
    signature: ShapeSignature,
    checked: tuple[tuple[str, int, Any, tuple[int, ...], np.dtype[Any]], ...],
    step: Callable[[list[tuple[int, Any]]], dict[str, Any] | None] | None,
) -> Callable[[CompiledModel, _Repeat, Mapping[str, Any]], dict[str, Any] | None]:
    """The repeat path of the call that left ``signature`` and ``checked``: a function of (model, its
    ``_Repeat``, feeds) returning the outputs, or None for the full path.

    It refers to neither the model nor the ``_Repeat`` that stores it (each is passed in): a reference
    cycle would keep a dropped model's buffers alive until the garbage collector runs."""
    count = len(checked)
    one = checked[0] if count == 1 else None

    def run(model: CompiledModel, repeat: _Repeat, feeds: Mapping[str, Any]) -> dict[str, Any] | None:
        if feeds.__class__ is not dict or len(feeds) != count:
            return None
        if one is not None:  # one feed, without the loop
            name, flat, cls, shape, dtype = one
            array: Any = feeds.get(name)
            if array.__class__ is not cls or array.dtype is not dtype or array.shape != shape:
                return None  # the class first: a missing feed (None) has no dtype
            staged = [(flat, array)]
        else:
            staged = []
            get = feeds.get
            for name, flat, cls, shape, dtype in checked:
                array = get(name)
                if array.__class__ is not cls or array.dtype is not dtype or array.shape != shape:
                    return None
                staged.append((flat, array))
        cache = model.cache
        live = cache.acquire(signature)
        if live is None:  # evicted since: the full path rebuilds it
            model._repeat = None
            return None
        model.last_live = live
        runtime = live.runtime
        try:
            if step is not None:
                done = step(staged)
                if done is not None:
                    return done
            results = runtime.execute(staged)  # the first steps, or the program no longer current
        except Exception as exc:  # diag: as in run()
            flight.record_failure(exc, runtime.diag_id)
            raise
        finally:
            cache.release(live)
        made_from = (runtime._steady, EPOCH[0])
        if made_from != repeat.made_from:  # a steady program (again, or after an epoch): the next call takes its step
            repeat.made_from = made_from
            made = runtime.run_step(model._default_outputs, [(flat, cls) for _, flat, cls, _, _ in checked])
            repeat.run = _repeat_path(signature, checked, made)
        for r in results:
            if r.__class__ is not np.ndarray:  # a sequence, None, a device array: as the full path returns them
                on_device = model.outputs_on_device
                return {name: _as_output(r, on_device) for name, r in zip(model._default_outputs, results)}
        return dict(zip(model._default_outputs, results))

    return run


def _other_feed_key(value: Any) -> tuple[tuple[int, ...], Any]:
    """Signature entry of a feed that is not a plain ndarray (a sequence, None, a subclass, a device array)."""
    if isinstance(value, np.ndarray) or _on_device(value):
        return (tuple(value.shape), np.dtype(value.dtype))
    if isinstance(value, list):
        return ((len(value),), "sequence:" + ",".join(f"{v.dtype}{v.shape}" for v in value))
    return ((), type(value).__name__)


def _feed_specs_of_plan(plan: Plan) -> list[FeedSpec]:
    """Feed specs from a plan's non-constant externals (they come first, in graph input order)."""
    specs = []
    for k, ext in enumerate(plan.externals):
        if ext.cls in (ExternalClass.PLACEHOLDER, ExternalClass.VARIABLE):
            dtype = None if ext.dtype is None or ext.dtype.startswith("unsupported:") else dtypes.to_numpy(ext.dtype)
            specs.append(FeedSpec(ext.name, plan.flat(plan.external_ref(k)), dtype, ext.shape))
    return specs


def _on_device(value: Any) -> bool:
    """True for a device array (CuPy and friends: ``__cuda_array_interface__``)."""
    return hasattr(value, "__cuda_array_interface__") and not isinstance(value, np.ndarray)


def _as_output(value: Any, on_device: bool = False) -> Any:
    """An output as numpy (arrays, 0-d results; sequences as lists; None kept), or kept on its device."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_as_output(v, on_device) for v in value]
    if _on_device(value):
        return value if on_device else value.get()
    return np.asarray(value)


def _feed_specs(graph: Graph) -> list[FeedSpec]:
    specs = []
    for v in graph.inputs:
        if v.name in graph.initializers:
            continue
        specs.append(FeedSpec(v.name, -1, _np_dtype(v), v.shape, v.kind))
    # Flat indexes are per plan; externals of every plan start with the graph inputs in order.
    return [FeedSpec(s.name, 1 + k, s.dtype, s.shape, s.kind) for k, s in enumerate(specs)]


def _np_dtype(v: Value) -> np.dtype[Any] | None:
    if v.dtype is None or v.dtype.startswith("unsupported:"):
        return None
    return dtypes.to_numpy(v.dtype)


def _check_feed(spec: FeedSpec, value: Any, symbols: dict[str, tuple[int, str]]) -> Any:
    if spec.kind == "sequence":
        if not isinstance(value, (list, tuple)):
            raise InputError(f"input {spec.name!r} is a sequence: feed a list of arrays, not {type(value).__name__}")
        return [np.asarray(v) for v in value]
    if spec.kind == "optional" and (value is None or isinstance(value, (list, tuple))):
        return None if value is None else [np.asarray(v) for v in value]  # empty, or holding a sequence
    try:
        # a device array (CuPy) is kept as it is: a GPU backend reads it where it lies
        arr = value if isinstance(value, np.ndarray) or _on_device(value) else np.asarray(value)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"input {spec.name!r}: cannot convert {type(value).__name__} to an array: {exc}") from exc
    if spec.dtype is not None and arr.dtype != spec.dtype:
        raise InputError(f"input {spec.name!r}: dtype {arr.dtype} given, model expects {spec.dtype}")
    if spec.shape is None:
        return arr
    if arr.ndim != len(spec.shape):
        raise InputError(
            f"input {spec.name!r}: shape {arr.shape} has rank {arr.ndim}, model expects rank "
            f"{len(spec.shape)} {_fmt(spec.shape)}"
        )
    for axis, (want, got) in enumerate(zip(spec.shape, arr.shape)):
        if isinstance(want, int) and want != got:
            raise InputError(
                f"input {spec.name!r}: dimension {axis} is {got}, model expects {want} "
                f"(shape {arr.shape} vs {_fmt(spec.shape)})"
            )
        if isinstance(want, str):
            seen = symbols.get(want)
            if seen is not None and seen[0] != got:
                raise InputError(
                    f"input {spec.name!r}: dimension {axis} ({want!r}) is {got}, but input "
                    f"{seen[1]!r} gave {want!r} = {seen[0]}"
                )
            symbols.setdefault(want, (got, spec.name))
    return arr


def _fmt(shape: tuple[int | str | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
