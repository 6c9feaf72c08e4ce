"""What the kit's tests share: compiling for the backend under test, the reference, comparisons, driving."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core import config
from dsp_core.backends.base import Backend
from dsp_core.ir.graph import Graph
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.model import CompiledModel
from dsp_core.runtime.units import UnitKind
from dsp_core.testing import assert_no_capture_failures, plan_dump

REFERENCE_MODE = "slot_by_slot"
# Absolute slack for elements near zero, as a fraction of the output's largest magnitude:
# ATOL_FLOOR always, plus a tenth of the backend's declared (relative) tolerance.
ATOL_FLOOR = 1e-6
ATOL_SHARE_OF_TOLERANCE = 0.1
# Steps beyond freezing that any conforming plan needs to settle: warm-up, compile and
# capture, then two clean replays; plus margin.
SETTLE_STEPS = 6
CAPTURE_HISTORY = [
    ("NEEDS_WARMUP", "NEEDS_COMPILE"),
    ("NEEDS_COMPILE", "CAPTURE_PENDING"),
    ("CAPTURE_PENDING", "REPLAYING"),
]


def compile_for(backend: Backend, graph: Graph) -> CompiledModel:
    """``graph`` compiled in the mode of the backend under test."""
    return dsp.compile(graph, mode=backend.mode.name)


def reference(graph: Graph) -> CompiledModel:
    """``graph`` compiled for the SLOT_BY_SLOT reference, the oracle of every comparison."""
    return dsp.compile(graph, mode=REFERENCE_MODE)


def require_backend_ran(backend: Backend, model: CompiledModel, what: str) -> None:
    """Skip when the backend declined every slot of the graph (with its reasons); fail if it vanished otherwise."""
    if model.declined is not None:
        pytest.fail(f"{what}: the plan compiler declined the graph: {model.declined}")
    if backend.name in model.resolved_backends():
        return
    record = model.explain()
    declines = [
        f"slot {d['slot']} {d['op']}: {d['reason']}" + (f" ({d['detail']})" if d["detail"] else "")
        for seg in record["segments"]
        for d in seg["declines"]
        if d["backend"] == backend.name
    ]
    if not declines:
        pytest.fail(
            f"{what}: backend {backend.name} ran no slot and declined none; the auction chose "
            f"{model.resolved_backends()} (chain {record.get('chain')})"
        )
    shown = "; ".join(declines[:8]) + (f"; ... {len(declines) - 8} more" if len(declines) > 8 else "")
    pytest.skip(f"{backend.name} declines every op of {what}: {shown}")


def assert_matches(
    backend: Backend, got: Mapping[str, Any], want: Mapping[str, Any], what: str, model: CompiledModel | None = None
) -> None:
    """Outputs equal the reference: same names, shapes, dtypes; values within the contract's tolerance."""
    problems: list[str] = []
    if set(got) != set(want):
        problems.append(f"outputs {sorted(got)} != reference outputs {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        problems += _compare(backend, name, np.asarray(got[name]), np.asarray(want[name]))
    if problems:
        dump = f"\nplan state:\n{plan_dump(model)}" if model is not None else ""
        raise AssertionError(
            f"{what}: backend {backend.name} disagrees with the reference: " + "; ".join(problems) + dump
        )


def _compare(backend: Backend, name: str, out: np.ndarray, ref: np.ndarray) -> list[str]:
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return [f"{name}: got {out.dtype}{list(out.shape)}, reference {ref.dtype}{list(ref.shape)}"]
    if not backend.contract.computes_values or ref.size == 0:
        return []
    if ref.dtype.kind not in "fc" and ref.dtype.kind != "V":
        bad = out != ref
        if not bad.any():
            return []
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        return [
            f"{name}: {int(bad.sum())} of {ref.size} elements differ (first at {where}: {out[where]} vs {ref[where]})"
        ]
    o, r = out.astype(np.float64), ref.astype(np.float64)
    tol = backend.contract.tolerance
    finite = np.isfinite(r)
    scale = max(1.0, float(np.abs(r[finite]).max())) if finite.any() else 1.0
    atol = (ATOL_FLOOR + ATOL_SHARE_OF_TOLERANCE * tol) * scale
    err = np.abs(o - r)
    same_special = (np.isnan(o) & np.isnan(r)) | (o == r)
    bad = ~same_special & ~(err <= tol * np.abs(r) + atol)
    if not bad.any():
        return []
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    nonzero = bad & (r != 0)
    rel = f"{float(np.max(err[nonzero] / np.abs(r[nonzero]))):.3g}" if nonzero.any() else "n/a (reference is 0)"
    return [
        f"{name}: {int(bad.sum())} of {ref.size} elements outside tolerance (rtol {tol}, atol {atol:.3g}); "
        f"first at {where}: {out[where]} vs reference {ref[where]}; max abs err {float(err[bad].max()):.3g}, "
        f"max rel err {rel}"
    ]


def settle_steps() -> int:
    """How many runs of one shape a conforming plan needs to reach its steady phase."""
    if config.get("no_freeze"):
        pytest.skip("DSP_NO_FREEZE is set: plans never freeze, so the lifecycle cannot be checked")
    return max(int(config.get("freeze_after")), 1) + SETTLE_STEPS


def drive(
    backend: Backend,
    model: CompiledModel,
    ref: CompiledModel,
    feeds_of: Callable[[int], Mapping[str, Any]],
    steps: int,
    what: str,
) -> list[PlanPhase]:
    """Run ``steps`` steps, checking every output against the reference; returns the phase after each."""
    if int(config.get("freeze_after")) <= 0 and model.last_live is None:
        model.dsp.freeze()  # freeze_after 0 means "only when asked": ask
    phases: list[PlanPhase] = []
    for step in range(steps):
        feeds = feeds_of(step)
        got = model.run(feeds)
        assert_matches(backend, got, ref.run(feeds), f"{what}, step {step + 1} (phase {model.dsp.phase.name})", model)
        phases.append(model.dsp.phase)
    return phases


def assert_settled(backend: Backend, model: CompiledModel, what: str) -> None:
    """After ``settle_steps()`` runs: no capture failed, and the plan is in its steady phase."""
    if backend.captures:
        assert_no_capture_failures(model)
    want = steady_phase(model)
    if model.dsp.phase is not want:
        raise AssertionError(
            f"{what}: plan phase {model.dsp.phase.name} after {model.dsp.runtime.executions} runs of one shape, "
            f"expected {want.name}\nplan state:\n{plan_dump(model)}"
        )


def steady_phase(model: CompiledModel) -> PlanPhase:
    """Where a conforming plan ends: REPLAYING when it has an island, else REPLAY_BLOCKED."""
    has_island = any(s.kind == UnitKind.ISLAND.value for s in model.dsp.segments)
    return PlanPhase.REPLAYING if has_island else PlanPhase.REPLAY_BLOCKED


def unit_history(model: CompiledModel, index: int) -> list[tuple[str, str]]:
    """(source, target) of every recorded move of unit ``index``, in order."""
    label = f"segment {index}"
    return [(t["source"], t["target"]) for t in model.dsp.transitions if t["machine"] == label]


def input_flat(model: CompiledModel, name: str) -> int:
    """The flat index of the fed input ``name`` in the live plan."""
    plan = model.dsp.runtime.plan
    for k, ext in enumerate(plan.externals):
        if ext.name == name:
            return plan.flat(plan.external_ref(k))
    raise KeyError(f"{name!r} is not an external input of the live plan")


def drift_events(model: CompiledModel) -> dict[int, tuple[int, int]]:
    """Per unit: (refreshes, recaptures)."""
    return {u.index: (u.counters.refreshes, u.counters.recaptures) for u in model.dsp.runtime.units}
