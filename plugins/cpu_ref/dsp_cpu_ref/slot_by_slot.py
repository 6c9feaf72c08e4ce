"""SLOT_BY_SLOT: a segment compiled into one straight-line Python function.

Everything that can be decided once is decided at compile time: each kernel is bound to
its context and attributes (or replaced by the op's specialized form for the slot's
static dtypes), wiring references become flat list indexes, liveness becomes stores of
None. The segment then runs as generated code, one line per slot::

    def run(v):
        v[9] = k0(v[1], v[2])
        v[10] = k1(v[9]); v[9] = None
        ...

so the hot path does no string lookup, no dict access and no interpretive loop. The
generated source is built from integers and fixed names only (nothing from the model
is ever placed in it), and a failing line maps back to its slot for the error message.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.errors import DSPError, KernelError
from dsp_core.ops.registry import KernelContext, lookup
from dsp_core.plan.plan import Plan, Segment

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]


def bind_steps(plan: Plan, segment: Segment, xp: Any = np, specialize: bool = True) -> list[Step]:
    """A segment's slots as steps: (bound kernel, input indexes, output index(es), releases)."""
    steps: list[Step] = []
    for s in segment.slots:
        slot = plan.slots[s]
        opdef = lookup(slot.op, slot.domain)
        ctx = KernelContext(xp, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
        kernel = None
        if specialize and opdef.specialize is not None and not slot.attrs:
            kernel = opdef.specialize(ctx, tuple(plan.ref_info(r)[0] for r in slot.inputs))
        if kernel is None:
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


def _line(n: int, step: Step) -> str:
    _, ins, outs, releases = step
    call = f"k{n}({', '.join(f'v[{i}]' for i in ins)})"
    if isinstance(outs, int):
        parts = [f"v[{outs}] = {call}"]
    else:
        parts = [f"r = {call}"] + [f"v[{o}] = r[{j}]" for j, o in enumerate(outs)]
    parts += [f"v[{i}] = None" for i in releases]
    return "    " + "; ".join(parts)


def generate(steps: list[Step], name: str) -> tuple[Any, int]:
    """Compile the steps into ``run(v)``; returns it and the line number of the first step."""
    header = "def run(v):"
    body = [_line(n, step) for n, step in enumerate(steps)] or ["    pass"]
    source = "\n".join([header, *body]) + "\n"
    namespace: dict[str, Any] = {f"k{n}": step[0] for n, step in enumerate(steps)}
    code = compile(source, f"<dsp segment {name}>", "exec")
    exec(code, namespace)  # noqa: S102  (source made of integers and fixed names only)
    return namespace["run"], 2


class SlotBySlotSegment(CompiledSegment):
    """A segment run slot by slot with the reference kernels, as generated straight-line code."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self._plan = plan
        self._steps = bind_steps(plan, segment)
        self._run, self._first_line = generate(self._steps, f"{plan.graph_name}#{segment.index}")

    def run(self, values: list[Any]) -> None:
        """Execute every slot of the segment in order."""
        try:
            self._run(values)
        except DSPError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc

    def _error(self, exc: Exception) -> KernelError:
        """Name the slot whose line raised."""
        tb = exc.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code is self._run.__code__:
                line = tb.tb_lineno
            tb = tb.tb_next
        k = (line - self._first_line) if line is not None else 0
        slot = self._plan.slots[self.segment.slots[max(0, min(k, len(self.segment.slots) - 1))]]
        return KernelError(f'{slot.op} node "{slot.name}" (slot {slot.index}) failed: {type(exc).__name__}: {exc}')


__all__ = ["SlotBySlotSegment", "bind_steps", "generate", "sys"]
