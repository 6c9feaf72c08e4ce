"""The plugin module named by the entry point: declares the backends and their contracts."""

from __future__ import annotations

import dataclasses

from dsp_core import hookimpl
from dsp_core.backends.base import Backend, CompiledSegment, Decline, DeclineReason, ModeContract, SlotView
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ir.dtypes import DTYPE_NAMES
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Plan, Segment
from dsp_cpu_ref.emulated import EmulatedSegment
from dsp_cpu_ref.numpy_replay import NUMPY_REPLAY_MAX_BYTES, NumpyReplaySegment, segment_bytes
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


# Slots whose outputs cannot live in buffers fixed at capture: their shapes change with the
# input values (NonZero, Unique...), or they run subgraphs.
_NOT_FIXED = Trait.VALUE_DEPENDENT_SHAPE | Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW


class NumpyReplayBackend(Backend):
    """The reference kernels captured as one generated function over fixed buffers (in place where
    numpy can write a given buffer): a step of a small segment at numpy's own cost, no runtime's.

    For what a native runtime's call overhead dominates (docs/cpu-backends.md); it declines
    segments whose values exceed NUMPY_REPLAY_MAX_BYTES. Bit-equal to the reference.
    """

    name = "numpy_replay"
    mode = GraphExecutionMode.NUMPY_REPLAY
    platform = "cpu"
    captures = True
    timed_against_reference = True  # its kernels are the reference's: it keeps a segment only by being faster
    contract = EmulatedReplayBackend.contract

    def _supports(self, slot: SlotView) -> Decline | None:
        if slot.traits & Trait.RANDOM:  # its capture runs each kernel once more: a draw the reference never made
            return Decline(DeclineReason.UNSUPPORTED_OP, f"{slot.op} draws random numbers: the reference runs it")
        if slot.traits & _NOT_FIXED:
            return Decline(
                DeclineReason.DYNAMIC_SHAPE if not slot.traits & Trait.CONTROL_FLOW else DeclineReason.CONTROL_FLOW,
                f"{slot.op}'s outputs cannot live in buffers fixed at capture",
            )
        return None

    def segment_decline(self, segment: Segment, plan: Plan) -> Decline | None:
        """Declines a segment whose values would hold more than NUMPY_REPLAY_MAX_BYTES of fixed buffers
        (where the plan's shapes say so; with symbolic dimensions the capture checks the real bytes)."""
        size = segment_bytes(plan, segment)  # None with symbolic dims: the capture checks the real bytes
        if size is not None and size > NUMPY_REPLAY_MAX_BYTES:
            return Decline(
                DeclineReason.OTHER,
                f"its values hold {size / 2**20:.1f} MiB (> {NUMPY_REPLAY_MAX_BYTES >> 20} MiB): where the "
                "kernels cost more than a call, a native runtime's kernels win",
            )
        return None

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return NumpyReplaySegment(self, plan, segment)


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
    return [SlotBySlotBackend(), EmulatedReplayBackend(), NumpyReplayBackend(), ShapeInferenceBackend()]
