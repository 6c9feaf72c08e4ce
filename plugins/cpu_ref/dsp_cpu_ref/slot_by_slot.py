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
import time
from typing import Any

import numpy as np

from dsp_core import diag
from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.errors import DSPError, KernelError
from dsp_core.ir.graph import Value
from dsp_core.ops.registry import KernelContext, lookup
from dsp_core.plan.fusion import release_order
from dsp_core.plan.plan import ExternalClass, Plan, Segment

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]


def run_order(segment: Segment) -> tuple[int, ...]:
    """The order a segment's slots run in: its fusion groups one after another, else plan order.

    Running a group's slots in order is how the reference executes any fusion group, so a
    grouped plan is checked on a CPU against the ungrouped one (docs/fusion.md).
    """
    if not segment.groups:
        return segment.slots
    order = tuple(s for group in segment.groups for s in group)
    if sorted(order) != sorted(segment.slots):
        raise DSPError(
            f"segment {segment.index}'s fusion groups cover slots {sorted(order)[:8]}..., not its own "
            f"{list(segment.slots[:8])}...: the fusion policy of backend {segment.backend} is broken; "
            "fix its fusion_policy() or run without it"
        )
    return order


def bind_steps(plan: Plan, segment: Segment, xp: Any = np, specialize: bool = True) -> list[Step]:
    """A segment's slots as steps (in ``run_order``): (bound kernel, input indexes, output index(es), releases)."""
    steps: list[Step] = []
    order = run_order(segment)
    released = release_order(plan, order) if segment.groups else None
    for s in order:
        slot = plan.slots[s]
        opdef = lookup(slot.op, slot.domain)
        ctx = KernelContext(xp, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
        kernel = None
        if s in plan.regions:
            kernel = _region_kernel(plan, s, opdef.kernel, xp)
        elif specialize and opdef.specialize is not None and not slot.attrs:
            kernel = opdef.specialize(ctx, tuple(plan.ref_info(r)[0] for r in slot.inputs))
        if kernel is None:
            kernel = functools.partial(opdef.kernel, ctx, **slot.attrs)
        ins = tuple(plan.flat(r) for r in slot.inputs)
        outs: Any
        if opdef.single_output:
            outs = plan.flat(slot.outputs[0]) if slot.outputs[0] is not None else plan.scratch
        else:
            outs = tuple(plan.flat(v) if v is not None else plan.scratch for v in slot.outputs)
        releases = tuple(plan.flat(v) for v in (plan.release[s] if released is None else released[s]))
        steps.append((kernel, ins, outs, releases))
    return steps


def plan_values(model: Any, feeds: dict[str, np.ndarray]) -> tuple[Plan, Any, list[Any]]:
    """The plan of ``feeds``' signature, its partition, and every value of one slot-by-slot run of it.

    For checking a backend's kernels against the reference value by value (every
    intermediate, not only the outputs): ``values[plan.flat(ref)]``.
    """
    model.run(feeds)
    plan, part = model.plan(), model.partition()
    values: list[Any] = [None] * plan.n_flat
    for k, array in plan.constants.items():
        values[plan.flat(plan.external_ref(k))] = array
    for k, e in enumerate(plan.externals):
        if e.name in feeds:
            values[plan.flat(plan.external_ref(k))] = np.asarray(feeds[e.name])
    for seg in part.segments:
        for kernel, ins, outs, _ in bind_steps(plan, seg):
            got = kernel(*[values[i] for i in ins])
            if isinstance(outs, int):
                values[outs] = got
            else:
                for o, x in zip(outs, got):
                    values[o] = x
    return plan, part, values


def _line(n: int, step: Step, timed: bool = False) -> str:
    _, ins, outs, releases = step
    call = f"k{n}({', '.join(f'v[{i}]' for i in ins)})"
    if isinstance(outs, int):
        parts = [f"v[{outs}] = {call}"]
    else:
        parts = [f"r = {call}"] + [f"v[{o}] = r[{j}]" for j, o in enumerate(outs)]
    parts += [f"v[{i}] = None" for i in releases]
    if timed:
        parts.insert(0, f"t[{n}] = pc()")
    return "    " + "; ".join(parts)


def _source(steps: list[Step], timed: bool) -> str:
    header = "def run(v, t):" if timed else "def run(v):"
    body = [_line(n, step, timed) for n, step in enumerate(steps)]
    if timed:
        body.append(f"    t[{len(steps)}] = pc()")
    return "\n".join([header, *(body or ["    pass"])]) + "\n"


class Program:
    """A segment's steps as one callable ``run(v)`` (timed: ``run(v, t)``), and which step raised.

    From its second run on it is generated straight-line code (one line per step, no loop,
    no lookups). Its first run goes through the steps in a loop instead: compiling the
    code of a big plan costs more than running it once (GPT-2 124M's prefill: ~8 ms of
    ``compile`` against well under a millisecond of loop), and a plan that runs once (a
    prefill, a warm start's first token) never pays for it. ``timed`` programs are
    generated at once (diag TIMING, traces).
    """

    def __init__(self, steps: list[Step], name: str, timed: bool = False) -> None:
        self.steps = steps
        self.name = name
        self.timed = timed
        self._run: Any = None  # the generated function, once generated
        self._failed: tuple[BaseException, int] | None = None  # the loop's last raise and its step
        self._looped = False  # one run went through the loop: the next compiles
        if timed:
            self._compile()

    def _compile(self) -> None:
        # timed=True (diag TIMING, traces): t[n] = perf_counter_ns() as step n begins, t[len(steps)] at the end.
        namespace: dict[str, Any] = {f"k{n}": step[0] for n, step in enumerate(self.steps)}
        namespace["pc"] = time.perf_counter_ns
        code = compile(_source(self.steps, self.timed), f"<dsp segment {self.name}>", "exec")
        exec(code, namespace)  # noqa: S102  (source made of integers and fixed names only)
        self._run = namespace["run"]

    @property
    def code(self) -> Any:
        """The generated function's code object (None until it is generated)."""
        return None if self._run is None else self._run.__code__

    def __call__(self, v: list[Any], t: list[int] | None = None) -> None:
        if self._run is None and self._looped:
            self._compile()  # the second run on: straight-line code
        if self._run is not None:
            if self.timed:
                self._run(v, t)
            else:
                self._run(v)
            return
        n = 0
        try:
            for n, (kernel, ins, outs, releases) in enumerate(self.steps):  # noqa: B007  (n: read on a raise)
                r = kernel(*[v[i] for i in ins])
                if isinstance(outs, int):
                    v[outs] = r
                else:
                    for j, o in enumerate(outs):
                        v[o] = r[j]
                for i in releases:
                    v[i] = None
        except BaseException as exc:
            self._failed = (exc, n)
            raise
        self._looped = True

    def failing_step(self, exc: BaseException) -> int | None:
        """The index of the step whose call raised ``exc`` in this program (None: not raised here)."""
        if self._failed is not None:
            seen: BaseException | None = exc
            while seen is not None:  # the loop's raise, or an error raised from it
                if seen is self._failed[0]:
                    return self._failed[1]
                seen = seen.__cause__ or seen.__context__
        tb, line = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code is self.code:  # None until generated: matches no frame
                line = tb.tb_lineno
            tb = tb.tb_next
        if line is None:
            return None
        return max(0, min(line - 2, len(self.steps) - 1))  # line 1 is the header


def generate(steps: list[Step], name: str, timed: bool = False) -> Program:
    """The steps as one callable ``run(v)`` (timed: ``run(v, t)``): see Program."""
    return Program(steps, name, timed)


class SlotBySlotSegment(CompiledSegment):
    """A segment run slot by slot with the reference kernels, as generated straight-line code."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self._plan = plan
        self._order = run_order(segment)  # the slot of each step
        self._steps = bind_steps(plan, segment)
        self._run = generate(self._steps, f"{plan.graph_name}#{segment.index}")
        self._timed_run: Program | None = None  # diag: the timed variant, generated on first use

    def run(self, values: list[Any]) -> None:
        """Execute every slot of the segment in order."""
        try:
            if diag.TIMED:  # diag: per-slot timing only when asked (TIMING at full level, or a trace)
                self._run_timed(values)
            else:
                self._run(values)
        except DSPError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc

    def _run_timed(self, values: list[Any]) -> None:
        """Run the timed variant and hand each slot's span to diag (those that finished, if one raised)."""
        if self._timed_run is None:
            self._timed_run = generate(self._steps, f"{self._plan.graph_name}#{self.segment.index}", timed=True)
        times = [0] * (len(self._steps) + 1)
        try:
            self._timed_run(values, times)
        finally:
            names = [(s, self._plan.slots[s].op, self._plan.slots[s].name) for s in self._order]
            diag.record_segment(self.segment.index, self.backend.name, names, times)

    def _error(self, exc: Exception) -> KernelError:
        """Name the slot whose line raised."""
        k = self._run.failing_step(exc)
        if k is None and self._timed_run is not None:
            k = self._timed_run.failing_step(exc)
        k = k or 0
        slot = self._plan.slots[self._order[max(0, min(k, len(self._order) - 1))]]
        return KernelError(f'{slot.op} node "{slot.name}" (slot {slot.index}) failed: {type(exc).__name__}: {exc}')


class SubPlanRunner:
    """A sub-plan (an If branch, a Loop or Scan body) compiled once, run per iteration.

    ``bind(outer)`` gives the callable a control-flow kernel receives in
    ``ctx.subgraphs``: it takes the body's formal inputs by name and returns its outputs.
    """

    def __init__(self, plan: Plan, xp: Any) -> None:
        self.plan = plan
        steps = bind_steps(plan, Segment(0, "slot_by_slot", "SLOT_BY_SLOT", tuple(range(len(plan.slots)))), xp)
        self._run = generate(steps, f"{plan.graph_name}")
        template: list[Any] = [None] * plan.n_flat
        for k, array in plan.constants.items():
            template[plan.flat(plan.external_ref(k))] = xp.asarray(array)
        self._template = template
        self._formal = {
            e.name: plan.flat(plan.external_ref(k))
            for k, e in enumerate(plan.externals)
            if e.cls in (ExternalClass.PLACEHOLDER, ExternalClass.VARIABLE)
        }
        self._outer = [
            (e.name, plan.flat(plan.external_ref(k)))
            for k, e in enumerate(plan.externals)
            if e.cls is ExternalClass.OUTER
        ]
        self._outputs = [plan.flat(r) for r in plan.outputs]
        self.graph = _Signature(
            [Value(e.name, e.dtype, e.shape) for e in plan.externals if e.name in self._formal],
            [Value(name, *plan.ref_info(r)) for name, r in zip(plan.output_names, plan.outputs)],
        )

    def bind(self, outer: dict[str, Any]) -> Any:
        """The body as a callable with the enclosing values fixed."""
        base = self._template.copy()
        for name, flat in self._outer:
            base[flat] = outer[name]

        def run(feeds: dict[str, Any]) -> list[Any]:
            values = base.copy()
            for name, value in feeds.items():
                values[self._formal[name]] = value
            self._run(values)
            return [values[i] for i in self._outputs]

        run.graph = self.graph  # type: ignore[attr-defined]
        return run


class _Signature:
    """What a control-flow kernel may read of its body: formal inputs and outputs."""

    def __init__(self, inputs: list[Value], outputs: list[Value]) -> None:
        self.inputs = inputs
        self.outputs = outputs


def _region_kernel(plan: Plan, s: int, kernel: Any, xp: Any) -> Any:
    """The kernel of a control-flow slot: its sub-plans bound to the slot's implicit inputs."""
    slot = plan.slots[s]
    region = plan.regions[s]
    runners = {attr: SubPlanRunner(sub, xp) for attr, sub in region.subplans.items()}
    n_explicit = len(slot.inputs) - len(region.outer)
    attrs = dict(slot.attrs)

    def call(*args: Any) -> Any:
        outer = dict(zip(region.outer, args[n_explicit:]))
        ctx = KernelContext(
            xp,
            slot.opset,
            n_explicit,
            len(slot.outputs),
            slot.name,
            subgraphs={attr: r.bind(outer) for attr, r in runners.items()},
        )
        return kernel(ctx, *args[:n_explicit], **attrs)

    return call


__all__ = ["SlotBySlotSegment", "SubPlanRunner", "bind_steps", "generate", "run_order"]
