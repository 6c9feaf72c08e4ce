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
for throughput: ``map`` spreads a batch of calls over them. (``ray.serve`` deployments are
not built here: they need ``ray[serve]``'s web stack; a replica actor is what one would wrap.)

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


__all__ = ["RayPipeline", "RayReplicas", "Stage", "stages_of"]
