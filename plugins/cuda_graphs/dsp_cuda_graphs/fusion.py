"""The run-time side of a fusion group, for a backend that generates kernels on this runtime layer.

Backend-neutral: a fusing backend (dsp-nvrtc) subclasses ``GroupStep`` and writes only how
a kernel is built and launched for one layout (``_build``); the rest is here:

- the group's reference steps (the same CuPy kernels CUDA_GRAPHS runs), run once per new
  input layout, outside any capture, to learn every value's shape and dtype and to give
  the reference outputs;
- the check of the built kernel's outputs against them within the contract's tolerance:
  a mismatch demotes the group to its reference steps, loudly (a warning and the log),
  and the reason is kept in its ``GroupReport``; a group the generator cannot take runs
  its reference steps too, quietly, with the reason kept;
- later calls launch the built kernel; a layout first met inside a capture fails the
  capture (``CaptureFailed``) rather than compiling in it.

``fused_steps`` swaps each group's bound steps for one step, as a segment's ``_fuse`` hook needs;
``unfused_reason`` says why a group keeps its reference steps.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core import progress
from dsp_core.backends.base import CaptureFailed, disagreement
from dsp_core.plan.fusion import FusionResult, Group
from dsp_core.plan.plan import Plan

log = logging.getLogger("dsp.fusion")

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]  # (kernel, input flats, output flat(s), released flats)
MAX_KEYED_ELEMENTS = 4096  # host inputs up to this size are keyed by value (shape vectors decide shapes)


class Unfusable(Exception):
    """A group ``_build`` cannot make a kernel for; the message says why (it runs its reference steps)."""


@dataclass
class GroupReport:
    """What became of one group: its kernel, or why it runs its reference steps."""

    index: int
    template: str
    slots: tuple[int, ...]
    status: str = "pending"  # "fused", "reference", "demoted", "pending"
    reason: str = ""
    kernel: str = ""
    compile_ms: float = 0.0
    cached: bool = False  # the kernel came from the disk cache

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.index,
            "template": self.template,
            "slots": list(self.slots),
            "status": self.status,
            "reason": self.reason,
            "kernel": self.kernel,
            "compile_ms": round(self.compile_ms, 2),
            "cached": self.cached,
        }


def mismatch(got: Sequence[Any], want: Sequence[Any], tolerance: float, to_host: Callable[[Any], Any]) -> str | None:
    """None when every output agrees within ``tolerance`` (relative to the reference's scale), else why not
    (``dsp_core.backends.base.disagreement``, output by output)."""
    for k, (a, b) in enumerate(zip(got, want)):
        if b is None:
            continue
        why = disagreement(to_host(a), to_host(b), tolerance)
        if why is not None:
            return f"output {k}: {why}"
    return None


def constants_match(
    cp: Any, in_flats: Sequence[int], baked: dict[int, tuple[Any, np.ndarray]], inputs: Sequence[Any]
) -> bool:
    """True when the inputs a kernel baked into its source still hold the values it was made for.

    ``baked``: input flat -> (the array seen when the kernel was made, its host value). A
    segment serves every input signature of its plan, so a shape vector computed on the
    device (the same layout, another value) must not reuse a kernel made for an older one.
    The same array object costs nothing; another is read back once (never during capture)
    and remembered.
    """
    by_flat = dict(zip(in_flats, inputs))
    for flat, (seen, value) in list(baked.items()):
        x = by_flat.get(flat)
        if x is seen:
            continue
        host = np.asarray(x) if isinstance(x, np.ndarray | np.generic) else cp.asnumpy(x)
        if host.shape != value.shape or not np.array_equal(host, value):
            return False
        baked[flat] = (x, value)
    return True


def run_step(step: Step, local: dict[int, Any]) -> dict[int, Any]:
    """One reference step on ``local`` (value id -> array): the values it made, also added to ``local``."""
    kernel, ins, outs, _ = step
    got = kernel(*[local.get(i) for i in ins])
    made = {outs: got} if isinstance(outs, int) else dict(zip(outs, got))
    local.update(made)
    return made


def run_reference(
    steps: Sequence[Step], in_flats: Sequence[int], out_flats: Sequence[int], inputs: Sequence[Any], keep: bool = False
) -> tuple[tuple[Any, ...], dict[int, Any]]:
    """A group's slots on their reference kernels: its outputs, and its values (every one with
    ``keep``; else each released after its last reader, unless it is an output)."""
    local: dict[int, Any] = dict(zip(in_flats, inputs))
    for step in steps:
        run_step(step, local)
        if not keep:
            for r in step[3]:  # the values this step's slot releases
                if r not in out_flats:
                    local.pop(r, None)
    return tuple(local.get(o) for o in out_flats), local


class GroupStep:
    """The one step that runs a fusion group: its built kernel per input layout, or its reference steps."""

    backend_name = "fused"  # for messages: "NVRTC"

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        cupy: Any,
        capturing: Callable[[], bool],
        tolerance: float,
    ) -> None:
        self.report = report
        self.steps = steps
        self.in_flats = in_flats
        self.out_flats = out_flats
        self.cp = cupy
        self.capturing = capturing
        self.tolerance = tolerance
        self.built: dict[tuple[Any, ...], Any] = {}
        self.progress: Any = None  # a dsp_core.progress bar while the segment's first runs build

    def reference(self, inputs: Sequence[Any], keep: bool = False) -> tuple[tuple[Any, ...], dict[int, Any]]:
        """The group's slots on their reference kernels: its outputs (and, with ``keep``, every value)."""
        return run_reference(self.steps, self.in_flats, self.out_flats, inputs, keep)

    def __call__(self, *inputs: Any) -> Any:
        if self.report.status in ("reference", "demoted"):
            outs, _ = self.reference(inputs)
        else:
            outs = self._fused(inputs)
        return outs[0] if len(self.out_flats) == 1 else outs

    def signature(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The layout of the inputs (with the values of small host inputs: they decide shapes)."""
        sig: list[Any] = []
        for x in inputs:
            if isinstance(x, np.ndarray | np.generic):
                small = x.size <= MAX_KEYED_ELEMENTS
                sig.append((np.shape(x), x.dtype.str, x.tobytes() if small else id(x)))
            elif hasattr(x, "data") and hasattr(x, "strides"):
                sig.append((x.shape, x.strides, x.dtype.str))
            else:
                sig.append((type(x).__name__, repr(x)[:200]))
        return tuple(sig)

    def _fused(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        key = self.signature(inputs)
        built = self.built.get(key)
        baked = getattr(built, "constants", None)
        if baked and not self.capturing() and not constants_match(self.cp, self.in_flats, baked, inputs):
            built = None  # a value the kernel baked in changed (the segment runs for another signature)
        if built is None:
            if self.capturing():
                raise CaptureFailed(
                    f"fusion group {self.report.index} met a new input layout during capture; "
                    "its kernel must be built before capture"
                )
            cp = self.cp
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):  # never from a traced allocator
                built = self._settle_new(inputs)
            if self.progress is not None:
                self.progress.advance()
            if built is None:
                return self.reference(inputs)[0]
            self.built[key] = built
        return self.launch(built, inputs)

    def _settle_new(self, inputs: Sequence[Any]) -> Any:
        start = time.perf_counter()
        want, local = self.reference(inputs, keep=True)
        try:
            built = self._build(inputs, local)
        except Unfusable as exc:
            self._settle("reference", str(exc))
            return None
        except Exception as exc:  # noqa: BLE001  (a generator or compiler bug costs the group its kernel)
            self._settle("reference", f"building its kernel failed: {type(exc).__name__}: {str(exc)[:400]}")
            self._loud(f"runs its reference kernels: {self.report.reason} (a DSP bug: report it)")
            return None
        bad = self.check(built, inputs, want)
        self.report.compile_ms += (time.perf_counter() - start) * 1000
        if bad is not None:
            self._settle("demoted", f"its kernel disagreed with the reference kernels: {bad}")
            self._loud(f"demoted to its reference kernels: {bad}")
            return None
        self.report.status = "fused"
        return built

    def _loud(self, what: str) -> None:
        r = self.report
        message = f"DSP {self.backend_name}: fusion group {r.index} ({r.template}, slots {list(r.slots)}) {what}"
        warnings.warn(message, stacklevel=3)
        log.warning(message)

    def _settle(self, status: str, reason: str) -> None:
        self.report.status = status
        self.report.reason = reason

    # -- what a backend writes ------------------------------------------------------------
    def _build(self, inputs: Sequence[Any], local: dict[int, Any]) -> Any:
        """A launchable kernel for this layout (``local``: every value of a reference run); Unfusable: none."""
        raise NotImplementedError

    def launch(self, built: Any, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """Run ``built`` on ``inputs`` on the current stream; the group's outputs."""
        raise NotImplementedError

    def check(self, built: Any, inputs: Sequence[Any], want: tuple[Any, ...]) -> str | None:
        """Run ``built`` once on ``inputs`` and compare with the reference's outputs ``want``: how they
        differ, or None. A step that writes its input in place compares on copies of its own."""
        return mismatch(self.launch(built, inputs), want, self.tolerance, self.cp.asnumpy)

    def check_in_place(self, built: Any, inputs: Sequence[Any], written: Sequence[int]) -> str | None:
        """``check`` for a step that writes ``inputs[k]`` in place, for each ``k`` of ``written`` (KV
        buffers): on zeroed copies of them, one written by the reference steps and one by ``built``
        (the reference already wrote the real ones, which the kernel would only write again); then
        ``built`` writes the real ones."""
        cp = self.cp
        mine, theirs = list(inputs), list(inputs)
        for k in written:
            mine[k], theirs[k] = cp.zeros_like(inputs[k]), cp.zeros_like(inputs[k])
        expected, _ = self.reference(theirs)
        bad = mismatch(self.launch(built, mine), expected, self.tolerance, cp.asnumpy)
        if bad is None:
            self.launch(built, inputs)
        return bad


def unfused_reason(plan: Plan, group: Group, templates: frozenset[str], views: frozenset[str]) -> str | None:
    """Why ``group`` runs its reference kernels rather than a generated one (None: it is generated).

    ``templates``: those the backend generates; ``views``: ops whose reference kernel is a
    CuPy view (a group of only these costs no kernel as it is).
    """
    if group.template not in templates:
        return f"a {group.template} group runs alone"
    if not group.outputs:
        return "nothing it computes is read"
    if all(plan.slots[s].op in views for s in group.slots):
        ops = "+".join(dict.fromkeys(plan.slots[s].op for s in group.slots))
        return f"{ops} only: views on the reference kernels, no kernel to save"
    return None


def fused_steps(
    plan: Plan,
    bound: list[Step],
    order: Sequence[int],
    result: FusionResult,
    make: Callable[[Group, list[Step], tuple[int, ...], tuple[int, ...]], Any | None],
) -> tuple[list[Step], list[tuple[int, ...]]]:
    """The segment's steps with each group's replaced by ``make(group, steps, ins, outs)`` (None: kept).

    ``bound`` holds one step per slot of ``order``; the second result says which slots each
    returned step runs (a line of the generated step function).
    """
    step_of = dict(zip(order, bound))
    steps: list[Step] = []
    step_slots: list[tuple[int, ...]] = []
    for g in result.groups:
        mine = [step_of[s] for s in g.slots]
        produced = {o for _, _, outs, _ in mine for o in ((outs,) if isinstance(outs, int) else outs)}
        ins = tuple(dict.fromkeys(i for _, step_ins, _, _ in mine for i in step_ins if i not in produced))
        outs = tuple(plan.flat(v) for v in g.outputs)
        step = make(g, mine, ins, outs) if outs else None
        if step is None:
            steps.extend(mine)
            step_slots.extend((s,) for s in g.slots)
            continue
        releases = tuple(dict.fromkeys(r for *_, rel in mine for r in rel if r not in outs))
        steps.append((step, ins, outs if len(outs) > 1 else outs[0], releases))
        step_slots.append(g.slots)
    return steps, step_slots


class BuildProgress:
    """A progress step (dsp_core.progress) whose bar advances as each pending group step settles
    (any step with a ``progress`` attribute: a GroupStep, dsp-triton's FusedGroup)."""

    def __init__(self, pending: Sequence[Any], label: str) -> None:
        self.pending = list(pending)
        self.label = label
        self._step: Any = None

    def __enter__(self) -> None:
        self._step = progress.step(self.label, total=len(self.pending), unit="kernels")
        bar = self._step.__enter__()
        for g in self.pending:
            g.progress = bar

    def __exit__(self, *exc: Any) -> None:
        for g in self.pending:
            g.progress = None
        self._step.__exit__(*exc)
