"""Two well-behaved test backends.

- ``test_null`` (mode ACL) declines every slot: AUTO must fall through it.
- ``test_eltwise`` (mode MLIR_CPU_JIT) takes elementwise float32 slots and runs them with
  the reference kernels, counting its runs: AUTO must cut segments around it.
- ``test_bad_probe`` (mode ONEDNN) raises in its availability probe: it must be listed
  as unavailable with the error, never break anything.
Each is available only with DSP_TEST_BACKENDS=1 so it never changes what users see.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from dsp_core import hookimpl
from dsp_core.backends.base import (
    Availability,
    Backend,
    CompiledSegment,
    Decline,
    DeclineReason,
    ModeContract,
    SlotView,
)
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ops.registry import KernelContext, Trait, lookup
from dsp_core.plan.plan import Plan, Segment

_CONTRACT = ModeContract(
    deterministic=True,
    needs_stable_addresses=False,
    can_update_in_place=True,
    tf32=False,
    dtypes=frozenset({"float32", "bool", "int64"}),
    tolerance=0.0,
)


def _enabled() -> Availability:
    if os.environ.get("DSP_TEST_BACKENDS") == "1":
        return Availability.yes()
    return Availability.no("test backend: set DSP_TEST_BACKENDS=1 to enable")


class NullBackend(Backend):
    """Declines everything."""

    name = "test_null"
    mode = GraphExecutionMode.ACL
    platform = "cpu"
    contract = _CONTRACT

    def _availability_probe(self) -> Availability:
        return _enabled()

    def _supports(self, slot: SlotView) -> Decline | None:
        return Decline(DeclineReason.UNSUPPORTED_OP, "the null backend takes nothing")


class EltwiseSegment(CompiledSegment):
    """Runs its slots with the reference kernels; counts runs."""

    runs = 0

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self.steps = []
        for s in segment.slots:
            slot = plan.slots[s]
            ctx = KernelContext(np, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
            fn = functools.partial(lookup(slot.op, slot.domain).kernel, ctx, **slot.attrs)
            self.steps.append((fn, [plan.flat(r) for r in slot.inputs], plan.flat(slot.outputs[0])))

    def run(self, values: list[Any]) -> None:
        """Run each slot (no liveness: this backend keeps it simple)."""
        EltwiseSegment.runs += 1
        for fn, ins, out in self.steps:
            values[out] = fn(*[values[i] for i in ins])


class EltwiseBackend(Backend):
    """Takes elementwise slots only."""

    name = "test_eltwise"
    mode = GraphExecutionMode.MLIR_CPU_JIT
    platform = "cpu"
    contract = _CONTRACT

    def _availability_probe(self) -> Availability:
        return _enabled()

    def _supports(self, slot: SlotView) -> Decline | None:
        if not slot.traits & Trait.ELEMENTWISE:
            return Decline(DeclineReason.UNSUPPORTED_OP, f"{slot.op} is not elementwise")
        return None

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return EltwiseSegment(self, plan, segment)


class BadProbeBackend(Backend):
    """Its availability probe raises."""

    name = "test_bad_probe"
    mode = GraphExecutionMode.ONEDNN
    platform = "cpu"
    contract = _CONTRACT

    def _availability_probe(self) -> Availability:
        raise RuntimeError("probe exploded")


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """The well-behaved test backends."""
    return [NullBackend(), EltwiseBackend(), BadProbeBackend()]
