"""Beyond one host, on Ray (the optional extra ``dsp-core[ray]``): pipeline stages as actors, replicas.

``RayPipeline(model, stages=N)`` places the plan with PIPELINE_PARALLEL (or any placement)
over N devices, writes each device's slots out as a self-contained ONNX model
(dsp_core.plan.subgraph: the values it reads from earlier stages and the fed inputs become
its graph inputs, the weights it reads its initializers, the values later stages or the
caller read its outputs) and starts one Ray actor per stage in a placement group (one
bundle per stage: ``{"CPU": 1}`` by default, ``{"GPU": 1}`` for a GPU per stage). Each actor
compiles its model with ``dsp.compile``: a stage is a DSP plan of its slots, frozen and
replayed like any other. A step passes each stage's outputs to the next stages as Ray
object references (actor to actor; the driver fetches only the requested outputs).

``RayReplicas(model, replicas=N)`` starts N actors each holding the whole compiled model,
for throughput: ``map`` spreads a batch of calls over them.

``RayServe(model, replicas=N)`` (the extra ``dsp-core[serve]``) puts N replicas behind a
Ray Serve deployment: Serve routes each request to a replica that is not busy and can
scale the count; Python callers use ``run``/``map`` (its deployment handle), others POST
JSON to ``url`` (``{"inputs": {name: nested lists}}``; each input takes the model's
declared dtype, or ``"dtypes": {name: "float32"}`` says it), answered as
``{"outputs": {name: nested lists}, "dtypes": {...}, "shapes": {...}}``.

Ray is imported on first use; without it, the error says how to install it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.devices.placement import Placement, PlacementError
from dsp_core.devices.topology import current_topology, stub_topology
from dsp_core.errors import DSPError
from dsp_core.plan.plan import ExternalClass, Plan
from dsp_core.plan.subgraph import SubgraphIO, name_of, segment_model, serialized
from dsp_core.runtime.units import unit_io

GROUP_TIMEOUT_S = 60.0  # how long a placement group may wait for its bundles


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise DSPError("Ray is not installed: pip install 'dsp-core[ray]' (or pip install ray)") from None
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return ray


@dataclass(frozen=True)
class Stage:
    """One stage: its slots, the flat indexes it reads and writes, and its model's bytes."""

    index: int
    slots: tuple[int, ...]
    io: SubgraphIO
    model: bytes

    @property
    def input_names(self) -> list[str]:
        """The stage model's graph inputs, in order."""
        return [name_of(f) for f in self.io.inputs]


def stages_of(plan: Plan, placement: Placement) -> list[Stage]:
    """The plan cut into one ONNX model per device that runs slots (in device order)."""
    if plan.regions:
        raise PlacementError("a plan with control flow (If, Loop, Scan) cannot be cut into Ray stages yet")
    stages: list[Stage] = []
    for device in placement.devices_used:
        slots = tuple(s for s in range(len(plan.slots)) if placement[s] == device)
        if slots != tuple(range(slots[0], slots[-1] + 1)):
            raise PlacementError(f"device {device}'s slots are not contiguous: Ray stages need pipeline placements")
        inputs, outputs, constants = unit_io(plan, slots, frozenset())
        io = SubgraphIO(inputs, outputs)
        feeds = {f: _static_info(plan, f) for f in inputs}
        weights = {f: plan.constants[f - 1] for f in constants}
        model = serialized(segment_model(plan, slots, io, feeds, weights))
        stages.append(Stage(len(stages), slots, io, model))
    return stages


def _static_info(plan: Plan, flat: int) -> tuple[str, tuple[Any, ...] | None]:
    """(dtype, shape) the plan knows for a flat index (symbolic dims kept as names)."""
    n_ext = len(plan.externals)
    ref = -flat if flat <= n_ext else flat - 1 - n_ext
    dtype, shape = plan.ref_info(ref)
    if dtype is None:
        raise PlacementError(f"value {plan.ref_name(ref)!r} crosses a stage with no static dtype")
    return dtype, shape


class _StageActor:
    """The Ray actor of one stage: its model compiled once, run per step."""

    def __init__(self, model: bytes, names: list[str], mode: str | None) -> None:
        import dsp_core as dsp

        self.model = dsp.compile(model, mode=mode)
        self.names = names

    def run(self, *arrays: np.ndarray) -> Any:
        outs = self.model.run(dict(zip(self.names, arrays)))
        values = list(outs.values())
        return values[0] if len(values) == 1 else values


class _ReplicaActor:
    """The Ray actor of one replica: the whole model."""

    def __init__(self, model: Any, mode: str | None) -> None:
        import dsp_core as dsp

        self.model = dsp.compile(model, mode=mode)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.model.run(feeds)


class RayPipeline:
    """A model's plan as pipeline stages on Ray actors (one per device, in a placement group)."""

    def __init__(
        self,
        model: Any,
        stages: int = 2,
        *,
        placement: Any = "pipeline_parallel",
        mode: str | None = None,
        bundle: Mapping[str, float] | None = None,
    ) -> None:
        import dsp_core as dsp

        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if stages < 1:
            raise DSPError(f"stages must be at least 1, got {stages}")
        topo = current_topology()
        # Stages come from a placement over ``stages`` devices: the current topology's when it
        # has that many (each device one stage), else stub devices standing for the actors.
        scope = stub_topology([{"memory": 1 << 50}] * stages) if len(topo) < stages else contextlib.nullcontext()
        with scope:
            local = dsp.compile(model, mode="slot_by_slot", placement=placement)
        plan = local.plan()
        if plan is None:
            raise DSPError(f"the graph was declined ({local.declined}): it cannot be cut into stages")
        self.plan = plan
        self.placement = local.dsp.placement
        self.stages = stages_of(plan, self.placement)
        self.output_flats = [plan.flat(r) for r in plan.outputs]
        self.output_names = list(plan.output_names)
        self.feed_flats = {
            plan.flat(plan.external_ref(k)): e.name
            for k, e in enumerate(plan.externals)
            if e.cls is not ExternalClass.CONSTANT
        }
        bundles = [dict(bundle or {"CPU": 1}) for _ in self.stages]
        self.group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=GROUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise DSPError(
                f"Ray could not place {len(bundles)} stage(s) of {bundles[0]} within {GROUP_TIMEOUT_S:.0f} s: the "
                f"cluster has {ray.available_resources()} free; start Ray with more (ray.init(num_cpus=...)) "
                "or shut down other pipelines"
            ) from None
        actor = ray.remote(_StageActor)
        self.actors = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
                num_cpus=float((bundle or {"CPU": 1}).get("CPU", 0)),
                num_gpus=float((bundle or {}).get("GPU", 0)),
            ).remote(st.model, st.input_names, mode)
            for i, st in enumerate(self.stages)
        ]
        self._ray = ray

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One step: each stage's inputs are the feeds and earlier stages' output references."""
        unknown = set(feeds) - set(self.feed_flats.values())
        missing = set(self.feed_flats.values()) - set(feeds)
        if unknown or missing:
            raise DSPError(
                f"feeds: unknown {sorted(unknown)}, missing {sorted(missing)}; "
                f"the model's inputs are {sorted(self.feed_flats.values())}"
            )
        refs: dict[int, Any] = {f: np.asarray(feeds[name]) for f, name in self.feed_flats.items()}
        for st, actor in zip(self.stages, self.actors):
            args = [refs[f] for f in st.io.inputs]
            n = len(st.io.outputs)
            result = actor.run.options(num_returns=n).remote(*args)
            refs.update(zip(st.io.outputs, [result] if n == 1 else result))
        values = self._ray.get([refs[f] for f in self.output_flats])
        return dict(zip(self.output_names, values))

    def shutdown(self) -> None:
        """Stop the actors and free the placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            self._ray.kill(actor)
        remove_placement_group(self.group)


class RayReplicas:
    """``replicas`` actors each holding the whole model; ``map`` spreads calls over them."""

    def __init__(self, model: Any, replicas: int = 2, *, mode: str | None = None, num_cpus: float = 1) -> None:
        ray = _ray()
        actor = ray.remote(_ReplicaActor)
        self.actors = [actor.options(num_cpus=num_cpus).remote(model, mode) for _ in range(replicas)]
        self._next = itertools.cycle(range(replicas))
        self._ray = ray

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One call on the next replica."""
        result: dict[str, np.ndarray] = self._ray.get(self.actors[next(self._next)].run.remote(dict(feeds)))
        return result

    def map(self, batch: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
        """Every call of ``batch``, spread round-robin over the replicas, results in order."""
        refs = [self.actors[next(self._next)].run.remote(dict(f)) for f in batch]
        results: list[dict[str, np.ndarray]] = self._ray.get(refs)
        return results

    def shutdown(self) -> None:
        """Stop the actors."""
        for actor in self.actors:
            self._ray.kill(actor)


class _ServedModel:
    """The body of a Serve replica: the whole model, compiled once when the replica starts."""

    def __init__(self, model: Any, mode: str | None) -> None:
        import dsp_core as dsp

        self.model = dsp.compile(model, mode=mode)

    def run(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = self.model.run(feeds)
        return result

    def replica(self) -> int:
        """The replica's process id (which replica answered)."""
        import os

        return os.getpid()

    async def __call__(self, request: Any) -> dict[str, Any]:
        """HTTP: ``{"inputs": {name: nested lists}, "dtypes": {name: str}}`` -> outputs as lists."""
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict):
            return {"error": 'the body must be JSON {"inputs": {name: nested lists}}'}
        declared = self.model.input_dtypes
        asked = body.get("dtypes") or {}
        try:
            feeds = {
                name: np.asarray(value, dtype=asked.get(name) or declared.get(name))
                for name, value in body["inputs"].items()
            }
            outs = self.model.run(feeds)
        except (DSPError, TypeError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        arrays = {k: np.asarray(v) for k, v in outs.items()}
        return {
            "outputs": {k: v.tolist() for k, v in arrays.items()},
            "dtypes": {k: str(v.dtype) for k, v in arrays.items()},
            "shapes": {k: list(v.shape) for k, v in arrays.items()},
        }


def _serve() -> Any:
    _ray()
    try:
        from ray import serve
    except ImportError:
        raise DSPError(
            "Ray Serve is not installed: pip install 'dsp-core[serve]' (or pip install 'ray[serve]')"
        ) from None
    return serve


class RayServe:
    """``replicas`` copies of the whole model behind one Ray Serve deployment (HTTP and a handle)."""

    def __init__(
        self,
        model: Any,
        replicas: int = 2,
        *,
        mode: str | None = None,
        num_cpus: float = 1,
        name: str = "dsp",
        route_prefix: str = "/dsp",
        http_port: int = 8000,
    ) -> None:
        if replicas < 1:
            raise DSPError(f"RayServe needs at least one replica, got {replicas}")
        serve = _serve()
        if not isinstance(model, str | bytes) and hasattr(model, "SerializeToString"):
            model = model.SerializeToString()  # an onnx.ModelProto travels as its bytes
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        deployment = serve.deployment(
            _ServedModel, name=name, num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus}
        )
        self.handle = serve.run(deployment.bind(model, mode), name=name, route_prefix=route_prefix)
        self.url = f"http://127.0.0.1:{http_port}{route_prefix}"
        self.name = name
        self._serve = serve

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One call, routed by Serve to a replica."""
        result: dict[str, np.ndarray] = self.handle.run.remote(dict(feeds)).result()
        return result

    def map(self, batch: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
        """Every call of ``batch`` in flight at once (Serve spreads them), results in order."""
        responses = [self.handle.run.remote(dict(f)) for f in batch]
        return [r.result() for r in responses]

    def replicas_answering(self, calls: int = 16) -> set[int]:
        """The process ids of the replicas that answered ``calls`` concurrent calls."""
        return {r.result() for r in [self.handle.replica.remote() for _ in range(calls)]}

    def shutdown(self) -> None:
        """Delete the deployment (Serve itself stays up for others)."""
        self._serve.delete(self.name)


__all__ = ["RayPipeline", "RayReplicas", "RayServe", "Stage", "stages_of"]
