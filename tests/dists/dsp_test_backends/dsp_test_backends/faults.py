"""Backends that misbehave on demand: ``DSP_TEST_FAULT`` picks the fault; unset, they are inert.

Inert means: the hook registers only ``test_fault`` and ``test_fault_capture``, both
unavailable ("set DSP_TEST_FAULT=..."), so the normal test suite discovers them as
harmless. With a fault selected, the faulty backend is available and serves a mode of
the CPU fallback chain tried before slot_by_slot (ARM_HYBRID, ONEDNN; the other test
backends there are off unless DSP_TEST_BACKENDS=1), so it wins the auction for the slots
it takes (Add, Relu) and the fault is really exercised. (Not OPENVINO: a test checks that
a mode nobody installed names its distribution.)

``DSP_TEST_FAULT_AFTER=N``: a run-time fault strikes only after N good calls, so it
hits a segment that is already running (a frozen plan, a replaying island).
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

import numpy as np
from dsp_cpu_ref.emulated import EmulatedSegment

from dsp_core import hookimpl
from dsp_core.backends.base import (
    Availability,
    Backend,
    CompiledSegment,
    Decline,
    DeclineReason,
    ModeContract,
    ReplayStatus,
    SlotView,
)
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ops.registry import KernelContext, lookup
from dsp_core.plan.plan import Plan, Segment

# Faults of test_fault (eager, ARM_HYBRID) and of test_fault_capture (capturing, ONEDNN).
EAGER_FAULTS = frozenset(
    {
        "supports_raises",
        "supports_systemexit",
        "cost_raises",
        "cost_nan",
        "compile_raises",
        "compile_systemexit",
        "run_valueerror",
        "run_systemexit",
        "wrong_shape",
        "wrong_dtype",
        "release_raises",
        "availability_hang",
        "availability_systemexit",
        "none",  # available and well behaved: the control case
    }
)
CAPTURE_FAULTS = frozenset({"warm_raises", "prepare_raises", "capture_raises", "replay_raises", "replay_systemexit"})
# Faults of the registration hook and malformed Backend objects (discovery must reject them).
HOOK_FAULTS = frozenset(
    {"hook_systemexit", "hook_hang", "no_contract", "string_mode", "bool_supports", "duplicate_name"}
)
TAKES = frozenset({"Add", "Relu"})

_CONTRACT = ModeContract(
    deterministic=True,
    needs_stable_addresses=False,
    can_update_in_place=False,
    tf32=False,
    dtypes=frozenset({"float32"}),
    tolerance=0.0,
)


def fault() -> str:
    """The selected fault ('' when none)."""
    return os.environ.get("DSP_TEST_FAULT", "")


class Strikes:
    """Counts good calls; a fault strikes once DSP_TEST_FAULT_AFTER of them have happened."""

    calls: ClassVar[int] = 0

    @classmethod
    def now(cls, name: str) -> bool:
        if fault() != name:
            return False
        cls.calls += 1
        return cls.calls > int(os.environ.get("DSP_TEST_FAULT_AFTER", "0"))


def _hang() -> None:
    threading.Event().wait()  # never set: the call does not return


def _probe(faults: frozenset[str]) -> Availability:
    if fault() == "availability_hang":
        _hang()
    if fault() == "availability_systemexit":
        raise SystemExit(4)
    if fault() in faults:
        return Availability.yes()
    return Availability.no("test backend: set DSP_TEST_FAULT=<fault> to enable")


class FaultSegment(CompiledSegment):
    """Runs Add/Relu with the reference kernels, then misbehaves as selected."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self.steps = []
        for s in segment.slots:
            slot = plan.slots[s]
            ctx = KernelContext(np, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
            kernel = lookup(slot.op, slot.domain).kernel
            ins = [plan.flat(r) for r in slot.inputs]
            self.steps.append((kernel, ctx, dict(slot.attrs), ins, plan.flat(slot.outputs[0])))

    def run(self, values: list[Any]) -> None:
        """The slots, with the selected fault."""
        if Strikes.now("run_valueerror"):
            raise ValueError("test_fault: run fails on purpose")
        if Strikes.now("run_systemexit"):
            raise SystemExit(5)
        for kernel, ctx, attrs, ins, out in self.steps:
            values[out] = kernel(ctx, *[values[i] for i in ins], **attrs)
        last = self.steps[-1][-1]
        if Strikes.now("wrong_shape"):
            values[last] = values[last][..., :-1]  # one column short
        if Strikes.now("wrong_dtype"):
            values[last] = values[last].astype(np.float64)

    def _release(self) -> None:
        if fault() == "release_raises":
            raise RuntimeError("test_fault: release fails on purpose")


class FaultBackend(Backend):
    """Takes Add and Relu in float32 (mode ARM_HYBRID, in the CPU chain), faulty as selected."""

    name = "test_fault"
    mode = GraphExecutionMode.ARM_HYBRID
    platform = "cpu"
    contract = _CONTRACT

    def _availability_probe(self) -> Availability:
        return _probe(EAGER_FAULTS)

    def _supports(self, slot: SlotView) -> Decline | None:
        if slot.op not in TAKES:
            return Decline(DeclineReason.UNSUPPORTED_OP, f"test_fault takes only {sorted(TAKES)}")
        if fault() == "supports_raises":
            raise ValueError("test_fault: _supports fails on purpose")
        if fault() == "supports_systemexit":
            raise SystemExit(6)
        return None

    def cost(self, segment: Segment, plan: Plan) -> float:
        """A bid, or a fault."""
        if fault() == "cost_raises":
            raise RuntimeError("test_fault: cost fails on purpose")
        if fault() == "cost_nan":
            return float("nan")
        return float(len(segment.slots))

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        if fault() == "compile_raises":
            raise RuntimeError("test_fault: _compile fails on purpose")
        if fault() == "compile_systemexit":
            raise SystemExit(7)
        return FaultSegment(self, plan, segment)


class CaptureFaultSegment(EmulatedSegment):
    """cpu_ref's emulated capture/replay, with a lifecycle call that raises (not CaptureFailed)."""

    def _warm(self, values: list[Any]) -> None:
        if Strikes.now("warm_raises"):
            raise RuntimeError("test_fault_capture: warm fails on purpose")
        super()._warm(values)

    def _prepare(self, values: list[Any]) -> None:
        if Strikes.now("prepare_raises"):
            raise RuntimeError("test_fault_capture: prepare fails on purpose")
        super()._prepare(values)

    def _capture(self, values: list[Any]) -> None:
        if Strikes.now("capture_raises"):
            raise ValueError("test_fault_capture: capture fails on purpose")
        super()._capture(values)

    def _replay(self, values: list[Any]) -> ReplayStatus:
        if Strikes.now("replay_raises"):
            raise RuntimeError("test_fault_capture: replay fails on purpose")
        if Strikes.now("replay_systemexit"):
            raise SystemExit(8)
        return super()._replay(values)


class CaptureFaultBackend(Backend):
    """Captures Add and Relu (mode ONEDNN: before slot_by_slot in the CPU chain), faulty as selected."""

    name = "test_fault_capture"
    mode = GraphExecutionMode.ONEDNN
    platform = "cpu"
    captures = True
    contract = ModeContract(
        deterministic=True,
        needs_stable_addresses=True,
        can_update_in_place=False,
        tf32=False,
        dtypes=frozenset({"float32"}),
        tolerance=0.0,
    )

    def _availability_probe(self) -> Availability:
        return _probe(CAPTURE_FAULTS)

    def _supports(self, slot: SlotView) -> Decline | None:
        if slot.op not in TAKES:
            return Decline(DeclineReason.UNSUPPORTED_OP, f"test_fault_capture takes only {sorted(TAKES)}")
        return None

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return CaptureFaultSegment(self, plan, segment)


# -- malformed Backend objects: discovery must reject each with its reason --------------
class NoContractBackend(Backend):
    """Declares no ModeContract."""

    name = "test_no_contract"
    mode = GraphExecutionMode.NNAPI
    platform = "cpu"


class StringModeBackend(Backend):
    """Its mode is a string, not a GraphExecutionMode."""

    name = "test_string_mode"
    mode = "openvino"  # type: ignore[assignment]
    platform = "cpu"
    contract = _CONTRACT


class BoolSupportsBackend(Backend):
    """Its ``_supports`` answers True/False instead of Decline | None."""

    name = "test_bool_supports"
    mode = GraphExecutionMode.NNAPI
    platform = "cpu"
    contract = _CONTRACT

    def _supports(self, slot: SlotView) -> Any:
        return True


class DuplicateNameBackend(Backend):
    """Claims the reference backend's name."""

    name = "slot_by_slot"
    mode = GraphExecutionMode.NNAPI
    platform = "cpu"
    contract = _CONTRACT


_MALFORMED: dict[str, type[Backend]] = {
    "no_contract": NoContractBackend,
    "string_mode": StringModeBackend,
    "bool_supports": BoolSupportsBackend,
    "duplicate_name": DuplicateNameBackend,
}


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """The faulty backends; with a hook fault selected, the hook itself misbehaves."""
    if fault() == "hook_systemexit":
        raise SystemExit(9)
    if fault() == "hook_hang":
        _hang()
    extra = [_MALFORMED[fault()]()] if fault() in _MALFORMED else []
    return [FaultBackend(), CaptureFaultBackend(), *extra]
