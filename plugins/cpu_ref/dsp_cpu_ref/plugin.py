"""The plugin module named by the entry point: declares the backends and their contracts."""

from __future__ import annotations

import dataclasses

from dsp_core import hookimpl
from dsp_core.backends.base import Backend, CompiledSegment, ModeContract
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ir.dtypes import DTYPE_NAMES
from dsp_core.plan.plan import Plan, Segment
from dsp_cpu_ref.emulated import EmulatedSegment
from dsp_cpu_ref.shape_only import ShapeOnlySegment
from dsp_cpu_ref.slot_by_slot import SlotBySlotSegment

_REFERENCE = ModeContract(
    deterministic=True,
    needs_stable_addresses=False,
    can_update_in_place=True,
    tf32=False,
    dtypes=frozenset(DTYPE_NAMES),
    tolerance=0.0,
)


class SlotBySlotBackend(Backend):
    """Runs every slot with its numpy reference kernel: the oracle for all other backends."""

    name = "slot_by_slot"
    mode = GraphExecutionMode.SLOT_BY_SLOT
    platform = "cpu"
    contract = _REFERENCE

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return SlotBySlotSegment(self, plan, segment)


class EmulatedReplayBackend(Backend):
    """The capture/replay lifecycle on the CPU: fixed buffers, recorded steps, identity keys."""

    name = "emulated_replay"
    mode = GraphExecutionMode.EMULATED_REPLAY
    platform = "cpu"
    captures = True
    contract = ModeContract(
        deterministic=True,
        needs_stable_addresses=True,
        can_update_in_place=False,  # like a plain CUDA graph: drift means recapture
        tf32=False,
        dtypes=frozenset(DTYPE_NAMES),
        tolerance=0.0,
    )

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return EmulatedSegment(self, plan, segment)


class ShapeInferenceBackend(Backend):
    """Propagates dtypes and shapes through the plan without computing values."""

    name = "shape_inference_only"
    mode = GraphExecutionMode.SHAPE_INFERENCE_ONLY
    platform = "cpu"
    contract = dataclasses.replace(_REFERENCE, computes_values=False)  # outputs are shape/dtype stand-ins

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return ShapeOnlySegment(self, plan, segment)


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """cpu_ref's backends."""
    return [SlotBySlotBackend(), EmulatedReplayBackend(), ShapeInferenceBackend()]
