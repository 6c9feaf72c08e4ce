"""SLOT_BY_SLOT: a tight loop over precomputed (kernel, input indexes, output indexes, releases).

Everything that can be decided once is decided at compile time: the kernel is bound to
its context and attributes, wiring references become flat list indexes, liveness becomes
a tuple of indexes to clear. The hot path does no string lookup and no dict access.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.errors import DSPError, KernelError
from dsp_core.ops.registry import KernelContext, lookup
from dsp_core.plan.plan import Plan, Segment

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]


def bind_steps(plan: Plan, segment: Segment, xp: Any = np) -> list[Step]:
    """Compile a segment's slots into steps: (bound kernel, inputs, outputs, releases)."""
    steps: list[Step] = []
    for s in segment.slots:
        slot = plan.slots[s]
        opdef = lookup(slot.op, slot.domain)
        ctx = KernelContext(xp, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
        kernel = functools.partial(opdef.kernel, ctx, **slot.attrs)
        ins = tuple(plan.flat(r) for r in slot.inputs)
        outs: Any
        if opdef.single_output:
            outs = plan.flat(slot.outputs[0]) if slot.outputs[0] is not None else plan.scratch
        else:
            outs = tuple(plan.flat(v) if v is not None else plan.scratch for v in slot.outputs)
        releases = tuple(plan.flat(v) for v in plan.release[s])
        steps.append((kernel, ins, outs, releases))
    return steps


class SlotBySlotSegment(CompiledSegment):
    """A segment run slot by slot with the reference kernels."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self._plan = plan
        self._steps = bind_steps(plan, segment)

    def run(self, values: list[Any]) -> None:
        """Execute every slot of the segment in order."""
        step: Step | None = None
        try:
            for step in self._steps:
                kernel, ins, outs, releases = step
                result = kernel(*[values[i] for i in ins])
                if outs.__class__ is int:
                    values[outs] = result
                else:
                    for o, r in zip(outs, result):
                        values[o] = r
                for i in releases:
                    values[i] = None
        except DSPError:
            raise
        except Exception as exc:
            raise _kernel_error(self._plan, self.segment, self._steps, step, exc) from exc


def _kernel_error(plan: Plan, segment: Segment, steps: list[Step], step: Step | None, exc: Exception) -> KernelError:
    idx = segment.slots[steps.index(step)] if step is not None else segment.slots[0]
    slot = plan.slots[idx]
    return KernelError(f'{slot.op} node "{slot.name}" (slot {idx}) failed: {type(exc).__name__}: {exc}')
