"""CompiledModel: what ``dsp.compile`` returns. Plans per output set, feeds checked, run.

The model compiles one plan per requested output set, has the auction cut it into
segments, and runs those segments over one flat value list per call. A graph the plan
compiler declines runs on the legacy interpreter; ``model.declined`` says why.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.backends.auction import Partition, explain, partition
from dsp_core.backends.base import CompiledSegment, Registry
from dsp_core.backends.discovery import discover
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import InputError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Value
from dsp_core.plan.compiler import Declined, check_outputs, compile_plan
from dsp_core.plan.plan import Plan
from dsp_core.runtime.legacy import run_graph


@dataclass(frozen=True)
class FeedSpec:
    """How one fed input is checked and where it goes in the flat value list."""

    name: str
    flat: int
    dtype: np.dtype[Any] | None
    shape: tuple[int | str | None, ...] | None
    kind: str = "tensor"


class Executor:
    """One plan made runnable: its partition, compiled segments and value-list template."""

    def __init__(self, plan: Plan, part: Partition) -> None:
        self.plan = plan
        self.partition = part
        self.segments: list[CompiledSegment] = [part.backends[seg.backend].compile(plan, seg) for seg in part.segments]
        template: list[Any] = [None] * plan.n_flat
        for k, array in plan.constants.items():
            template[plan.flat(plan.external_ref(k))] = array
        self.template = template
        self.output_flat = tuple(plan.flat(r) for r in plan.outputs)

    def run(self, staged: list[tuple[int, Any]]) -> list[Any]:
        """Run every segment on a fresh value list; returns the outputs in order."""
        values = self.template.copy()
        for flat, array in staged:
            values[flat] = array
        for segment in self.segments:
            segment.run(values)
        return [values[i] for i in self.output_flat]


class CompiledModel:
    """A graph compiled for one execution mode; ``run`` feeds it and returns outputs."""

    def __init__(
        self,
        graph: Graph,
        mode: GraphExecutionMode = GraphExecutionMode.AUTO,
        strict: bool = False,
        registry: Registry | None = None,
    ) -> None:
        self.graph = graph
        self.mode = mode
        self.strict = strict
        self.registry = registry if registry is not None else discover()
        self._feeds = _feed_specs(graph)
        self._executors: dict[tuple[str, ...], Executor | Declined] = {}
        self._lock = threading.Lock()
        self._prepare(check_outputs(graph, None))  # compile eagerly: errors surface at compile()

    # -- introspection ----------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        """Names the caller feeds."""
        return [s.name for s in self._feeds]

    @property
    def output_names(self) -> list[str]:
        """The graph's outputs (what ``run`` returns by default)."""
        return self.graph.output_names

    @property
    def declined(self) -> Declined | None:
        """Why the plan compiler declined the graph (default outputs), or None."""
        entry = self._prepare(check_outputs(self.graph, None))
        return entry if isinstance(entry, Declined) else None

    def plan(self, outputs: Sequence[str] | None = None) -> Plan | None:
        """The plan for ``outputs`` (None if the graph was declined)."""
        entry = self._prepare(check_outputs(self.graph, outputs))
        return entry.plan if isinstance(entry, Executor) else None

    def partition(self, outputs: Sequence[str] | None = None) -> Partition | None:
        """The auction's result for ``outputs`` (None if declined)."""
        entry = self._prepare(check_outputs(self.graph, outputs))
        return entry.partition if isinstance(entry, Executor) else None

    def resolved_backends(self) -> list[str]:
        """Names of the backends running the default plan ('legacy' if declined)."""
        part = self.partition()
        return part.resolved() if part is not None else ["legacy"]

    def explain(self, outputs: Sequence[str] | None = None) -> dict[str, Any]:
        """The auction record (or the decline reason) as a JSON-able dict."""
        entry = self._prepare(check_outputs(self.graph, outputs))
        if isinstance(entry, Declined):
            return {"mode": self.mode.name, "declined": str(entry), "segments": []}
        return explain(entry.plan, entry.partition)

    # -- running ----------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` (name -> array); returns every requested output by name."""
        names = check_outputs(self.graph, outputs)
        staged = self._stage(feeds)
        entry = self._prepare(names)
        if isinstance(entry, Declined):
            results = run_graph(self.graph, {s.name: a for s, a in zip(self._feeds, staged)}, names)
        else:
            results = entry.run([(s.flat, a) for s, a in zip(self._feeds, staged)])
        return {name: _as_output(r) for name, r in zip(names, results)}

    def run_legacy(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run on the legacy interpreter (the baseline every plan is measured against)."""
        names = check_outputs(self.graph, outputs)
        staged = self._stage(feeds)
        results = run_graph(self.graph, {s.name: a for s, a in zip(self._feeds, staged)}, names)
        return {name: _as_output(r) for name, r in zip(names, results)}

    def _prepare(self, names: tuple[str, ...]) -> Executor | Declined:
        entry = self._executors.get(names)
        if entry is None:
            with self._lock:
                entry = self._executors.get(names)
                if entry is None:
                    built = compile_plan(self.graph, names)
                    entry = (
                        built
                        if isinstance(built, Declined)
                        else Executor(built, partition(built, self.registry, self.mode, self.strict))
                    )
                    self._executors[names] = entry
        return entry

    def _stage(self, feeds: Mapping[str, Any]) -> list[Any]:
        """Check feeds against the graph's inputs: names, dtypes, ranks, dims."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        expected = {s.name for s in self._feeds}
        unknown = [name for name in feeds if name not in expected]
        if unknown:
            raise InputError(
                f"unknown input {unknown[0]!r}; the model's inputs are {', '.join(sorted(expected)) or '(none)'}"
            )
        staged: list[Any] = []
        symbols: dict[str, tuple[int, str]] = {}
        for spec in self._feeds:
            if spec.name not in feeds:
                raise InputError(f"missing input {spec.name!r}; the model needs {', '.join(self.input_names)}")
            staged.append(_check_feed(spec, feeds[spec.name], symbols))
        return staged


def _as_output(value: Any) -> Any:
    """An output as numpy: arrays (and 0-d results) as ndarray, sequences as lists, None kept."""
    if value is None:
        return None
    if isinstance(value, list):
        return [np.asarray(v) for v in value]
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
    if spec.kind == "optional" and value is None:
        return None
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
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
