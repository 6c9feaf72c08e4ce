"""The plan lifecycle on the backend under test: phases, captures, variable drift, release."""

from __future__ import annotations

import numpy as np
import pytest

from dsp_core.backends.base import Backend
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.units import UnitKind
from dsp_core.testing import (
    assert_fully_replaying,
    assert_no_address_drift,
    assert_pointers_stable,
    plan_dump,
)
from dsp_core.testing.conformance.cases import CASES, VARIABLE_CASES, Case
from dsp_core.testing.conformance.helpers import (
    CAPTURE_HISTORY,
    assert_matches,
    assert_settled,
    compile_for,
    drift_events,
    drive,
    input_flat,
    reference,
    require_backend_ran,
    settle_steps,
    steady_phase,
    unit_history,
)

_RANK = {PlanPhase.SLOT_BY_SLOT: 0, PlanPhase.SHAPES_FROZEN: 1, PlanPhase.REPLAYING: 2, PlanPhase.REPLAY_BLOCKED: 2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lifecycle_reaches_steady_phase(dsp_backend: Backend, dsp_rng: np.random.Generator, case: Case) -> None:
    """One shape, fresh values each step: phases move forward to REPLAYING (capturing) or REPLAY_BLOCKED."""
    graph = case.build()
    model = compile_for(dsp_backend, graph)
    require_backend_ran(dsp_backend, model, f"case {case.name}")
    phases = drive(dsp_backend, model, reference(graph), lambda _: case.feeds(dsp_rng), settle_steps(), case.name)
    ranks = [_RANK[p] for p in phases]
    demotions = [t for t in model.dsp.transitions if t["machine"] == "plan" and t["demotion"]]
    assert ranks == sorted(ranks) and not demotions, (
        f"case {case.name}: the plan phase went backwards: {[p.name for p in phases]}\n{plan_dump(model)}"
    )
    assert_settled(dsp_backend, model, f"case {case.name}")
    want = steady_phase(model)
    units = model.dsp.segments
    if dsp_backend.captures:
        assert_no_address_drift(model)  # placeholders are staged: new arrays each step are no drift
        for unit in units:
            if unit.kind == UnitKind.ISLAND.value:
                history = unit_history(model, unit.index)
                assert history == CAPTURE_HISTORY, (
                    f"case {case.name}: island {unit.index} went {history}, "
                    f"expected {CAPTURE_HISTORY}\n{plan_dump(model)}"
                )
        if want is PlanPhase.REPLAYING:
            assert_fully_replaying(model)
            assert_pointers_stable(model, case.feeds(dsp_rng), runs=3)
    else:
        mine = [u for u in units if u.backend == dsp_backend.name]
        wrong = [u.index for u in units if u.kind != UnitKind.EAGER.value]
        idle = [u.index for u in mine if u.counters.get("eager_runs", 0) == 0]
        assert mine and not wrong and not idle, (
            f"case {case.name}: a backend that does not capture must run eager units only, each of them "
            f"(non-eager units {wrong}, units that never ran {idle})\n{plan_dump(model)}"
        )


@pytest.mark.parametrize("case", VARIABLE_CASES, ids=lambda c: c.name)
def test_variable_drift_refreshes_or_recaptures(dsp_backend: Backend, dsp_rng: np.random.Generator, case: Case) -> None:
    """A new array for a variable: one refresh (can_update_in_place) or one recapture per island reading it."""
    assert case.variable is not None
    graph = case.build()
    model = compile_for(dsp_backend, graph)
    model.dsp.mark_variable([case.variable])
    require_backend_ran(dsp_backend, model, f"case {case.name}")
    ref = reference(graph)
    feeds = case.feeds(dsp_rng)
    drive(dsp_backend, model, ref, lambda _: feeds, settle_steps(), f"{case.name} (variable {case.variable})")
    assert_settled(dsp_backend, model, f"case {case.name} (variable {case.variable})")
    assert_no_address_drift(model)  # the same variable array every step
    var = input_flat(model, case.variable)
    readers = {u.index for u in model.dsp.runtime.units if u.kind is UnitKind.ISLAND and var in u.inputs}

    moved = dict(feeds)
    moved[case.variable] = case.feeds(dsp_rng)[case.variable]  # a new array object: a new address
    before = drift_events(model)
    want = ref.run(moved)
    assert_matches(dsp_backend, model.run(moved), want, f"case {case.name}: after the variable moved", model)
    _check_events(dsp_backend, model, before, readers, f"case {case.name}: variable {case.variable} moved")

    before = drift_events(model)
    assert_matches(dsp_backend, model.run(moved), want, f"case {case.name}: the moved variable, again", model)
    _check_events(dsp_backend, model, before, set(), f"case {case.name}: the same (moved) variable again")

    array = moved[case.variable]
    array[...] = case.feeds(dsp_rng)[case.variable]  # new values, same buffer: read in place, no event
    before = drift_events(model)
    assert_matches(dsp_backend, model.run(moved), ref.run(moved), f"case {case.name}: variable updated in place", model)
    _check_events(dsp_backend, model, before, set(), f"case {case.name}: variable updated in place")
    if readers:
        assert_fully_replaying(model)


def _check_events(backend: Backend, model, before: dict[int, tuple[int, int]], readers: set[int], what: str) -> None:
    """Exactly one drift event on each island in ``readers`` (of the kind the contract implies), none elsewhere."""
    after = drift_events(model)
    problems = []
    for index, (refreshes, recaptures) in after.items():
        d_ref, d_rec = refreshes - before[index][0], recaptures - before[index][1]
        if index not in readers:
            if d_ref or d_rec:
                problems.append(f"unit {index}: {d_ref} refresh(es), {d_rec} recapture(s), expected none")
        elif backend.contract.can_update_in_place and (d_ref, d_rec) != (1, 0):
            problems.append(
                f"unit {index}: {d_ref} refresh(es), {d_rec} recapture(s); the contract says "
                "can_update_in_place, so exactly one refresh"
            )
        elif not backend.contract.can_update_in_place and (d_ref, d_rec) != (0, 1):
            problems.append(f"unit {index}: {d_ref} refresh(es), {d_rec} recapture(s); expected exactly one recapture")
    assert not problems, f"{what}: " + "; ".join(problems) + f"\n{plan_dump(model)}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cache_clear_releases_buffers(dsp_backend: Backend, dsp_rng: np.random.Generator, case: Case) -> None:
    """After model.cache.clear() every unit holds 0 bytes, and the model still runs correctly."""
    graph = case.build()
    model = compile_for(dsp_backend, graph)
    require_backend_ran(dsp_backend, model, f"case {case.name}")
    ref = reference(graph)
    drive(dsp_backend, model, ref, lambda _: case.feeds(dsp_rng), settle_steps(), case.name)
    units = list(model.dsp.runtime.units)
    negative = [(u.index, u.compiled.nbytes) for u in units if u.compiled.nbytes < 0]
    assert not negative, f"case {case.name}: units report negative nbytes: {negative}"
    model.cache.clear()
    assert len(model.cache) == 0, f"case {case.name}: {len(model.cache)} plan(s) left in the cache after clear()"
    leaked = [
        f"unit {u.index} ({u.backend.name}, {u.kind.value}): {u.compiled.nbytes} bytes"
        for u in units
        if u.compiled.nbytes != 0
    ]
    assert not leaked, f"case {case.name}: release() left buffers: " + "; ".join(leaked)
    feeds = case.feeds(dsp_rng)
    assert_matches(dsp_backend, model.run(feeds), ref.run(feeds), f"case {case.name}: after cache.clear()", model)
