"""The plan lifecycle: the three state machines, modes, freezing and sealing, identity keys, staging.

Real models run through ``dsp.compile``; the OOM_DEFERRED and FAILED paths use the test
distribution's ``test_capture_faults`` backend (mode VULKAN, EMULATED_REPLAY with faults
injected by environment variables), registered as a real entry point.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.errors import DSPError
from dsp_core.ops import registry
from dsp_core.runtime.lifecycle import (
    PLAN_TRANSITIONS,
    RANKS,
    SEGMENT_TRANSITIONS,
    SLOT_TRANSITIONS,
    LifecycleError,
    PlanPhase,
    SegmentPhase,
    SlotPhase,
    StateMachine,
)
from dsp_core.runtime.staging import StagingError
from dsp_core.runtime.units import UnitKind

P, S, L = PlanPhase, SegmentPhase, SlotPhase

# -- the state machines, table-driven ---------------------------------------------------------
MACHINES = {
    "plan": (PlanPhase, PLAN_TRANSITIONS),
    "segment": (SegmentPhase, SEGMENT_TRANSITIONS),
    "slot": (SlotPhase, SLOT_TRANSITIONS),
}

# The design of record (design.md section 3), written out so the tables cannot drift silently.
DESIGN_EDGES = {
    "plan": {
        (P.SLOT_BY_SLOT, P.SHAPES_FROZEN),
        (P.SHAPES_FROZEN, P.REPLAYING),
        (P.SHAPES_FROZEN, P.REPLAY_BLOCKED),
    },
    "segment": {
        (S.NEEDS_WARMUP, S.NEEDS_COMPILE),
        (S.NEEDS_COMPILE, S.CAPTURE_PENDING),
        (S.CAPTURE_PENDING, S.REPLAYING),
        (S.NEEDS_WARMUP, S.FAILED),
        (S.NEEDS_COMPILE, S.FAILED),
        (S.CAPTURE_PENDING, S.FAILED),
        (S.REPLAYING, S.FAILED),
        (S.NEEDS_COMPILE, S.OOM_DEFERRED),
        (S.CAPTURE_PENDING, S.OOM_DEFERRED),
        (S.OOM_DEFERRED, S.NEEDS_COMPILE),
        (S.OOM_DEFERRED, S.FAILED),
    },
    "slot": {(L.BUILDING, L.SEALED)},
}

ALL_PAIRS = [
    pytest.param(name, a, b, id=f"{name}-{a.name}->{b.name}")
    for name, (states, _) in MACHINES.items()
    for a, b in itertools.product(states, states)
]


def test_tables_cover_every_state_and_match_the_design() -> None:
    for name, (states, table) in MACHINES.items():
        assert set(table) == set(states), name
        edges = {(a, b) for a, targets in table.items() for b in targets}
        assert edges == DESIGN_EDGES[name], name


@pytest.mark.parametrize(("name", "source", "target"), ALL_PAIRS)
def test_move(name: str, source: Any, target: Any) -> None:
    states, table = MACHINES[name]
    m = StateMachine(name, source, table)
    if target in table[source]:
        assert m.can(target)
        m.move(target, "because", execution=7)
        assert m.state is target
        (t,) = m.history
        assert (t.source, t.target, t.reason, t.execution, t.demotion) == (
            source.name,
            target.name,
            "because",
            7,
            False,
        )
    else:
        assert not m.can(target)
        allowed = ", ".join(sorted(s.name for s in table[source])) or "none (terminal)"
        message = f"{name}: illegal transition {source.name} -> {target.name} (allowed: {allowed})"
        with pytest.raises(LifecycleError, match=re.escape(message)):
            m.move(target, "because")
        assert m.state is source and m.history == []


@pytest.mark.parametrize(("name", "source", "target"), [p for p in ALL_PAIRS if p.values[1] is not p.values[2]])
def test_demote(name: str, source: Any, target: Any) -> None:
    states, table = MACHINES[name]
    m = StateMachine(name, source, table)
    with pytest.raises(LifecycleError, match="needs a reason"):
        m.demote(target, "")
    assert m.state is source and m.history == []
    # Backwards = to a lower rank; FAILED is for good (no rank): nothing demotes out of or into it.
    if source in RANKS and target in RANKS and RANKS[target] < RANKS[source]:
        m.demote(target, "error recovery", execution=3)
        assert m.state is target
        (t,) = m.history
        assert (t.source, t.target, t.reason, t.execution, t.demotion) == (
            source.name,
            target.name,
            "error recovery",
            3,
            True,
        )
    else:
        with pytest.raises(LifecycleError, match="is not backwards"):
            m.demote(target, "error recovery")
        assert m.state is source and m.history == []


# -- graphs -----------------------------------------------------------------------------------
def mlp(tail: str = "Tanh", skip: bool = False, gap: bool = False) -> dsp.Graph:
    """x[batch, 8] -> MatMul -> Relu [-> Sigmoid] -> MatMul [+ h] -> tail -> y[batch, 16]."""
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder("mlp")
    x = g.placeholder("x", "float32", ["batch", 8])
    w1 = g.constant(rng.standard_normal((8, 16)).astype(np.float32), name="w1")
    w2 = g.constant(rng.standard_normal((16, 16)).astype(np.float32), name="w2")
    h = g.Relu(g.MatMul(x, w1))
    z = g.MatMul(g.Sigmoid(h) if gap else h, w2)
    if skip:
        z = z + h
    g.output(g.op(tail, z), "y")
    return g.build()


def stateful() -> dsp.Graph:
    """y = MatMul(x + state, w): ``state`` is a VARIABLE (read in place), ``x`` a placeholder."""
    rng = np.random.default_rng(1)
    g = dsp.GraphBuilder("stateful")
    x = g.placeholder("x", "float32", [2, 8])
    state = g.variable("state", "float32", [2, 8])
    w = g.constant(rng.standard_normal((8, 4)).astype(np.float32), name="w")
    g.output(g.MatMul(x + state, w), "y")
    return g.build()


def two_inputs() -> dsp.Graph:
    """y = Tanh(x) * s: two placeholders, one of which tests mark it variable."""
    g = dsp.GraphBuilder("two")
    x = g.placeholder("x", "float32", [2, 8])
    s = g.placeholder("s", "float32", [2, 8])
    g.output(g.Tanh(x) * s, "y")
    return g.build()


def feeds(seed: int, batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 8)).astype(np.float32)}


def check(model: dsp.CompiledModel, reference: dsp.CompiledModel, f: dict[str, np.ndarray]) -> None:
    """One run of ``model``, bit-equal to the reference backend on the same feeds."""
    got, want = model.run(f), reference.run(f)
    assert got.keys() == want.keys()
    for name in got:
        assert np.array_equal(got[name], want[name]), name


def units(model: dsp.CompiledModel, kind: UnitKind | None = None) -> list[Any]:
    return [u for u in model.dsp.runtime.units if kind is None or u.kind is kind]


def plan_path(model: dsp.CompiledModel) -> list[str]:
    history = model.dsp.runtime.machine.history
    return [history[0].source, *(t.target for t in history)] if history else [model.dsp.phase.name]


def segment_path(unit: Any) -> list[str]:
    return [unit.machine.history[0].source, *(t.target for t in unit.machine.history)]


@pytest.fixture
def freeze_after_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FREEZE_AFTER", "1")


# -- per mode ---------------------------------------------------------------------------------
def test_slot_by_slot_mode_is_blocked_with_eager_units(freeze_after_1) -> None:
    model = dsp.compile(mlp(), "slot_by_slot")
    for step in range(6):
        f = feeds(step)
        out = model.run(f)
        assert np.array_equal(out["y"], model.run_legacy(f)["y"])
        if step == 0:
            assert model.dsp.phase is P.SLOT_BY_SLOT and model.dsp.runtime.units == []
    assert plan_path(model) == ["SLOT_BY_SLOT", "SHAPES_FROZEN", "REPLAY_BLOCKED"]
    assert model.dsp.runtime.machine.history[-1].reason == "no segment can capture"
    eager = units(model)
    assert eager and all(u.kind is UnitKind.EAGER for u in eager)
    assert all(u.phase is S.FAILED and "does not capture" in u.reason for u in eager)
    assert all(u.counters.eager_runs == 5 and u.counters.replays == 0 for u in eager)


def test_emulated_replay_walks_every_island_to_replaying(freeze_after_1) -> None:
    model, ref = dsp.compile(mlp(), "emulated_replay"), dsp.compile(mlp(), "slot_by_slot")
    phases = []
    for step in range(6):
        check(model, ref, feeds(step))
        phases.append(model.dsp.phase)
    assert phases[:2] == [P.SLOT_BY_SLOT, P.SHAPES_FROZEN] and phases[-1] is P.REPLAYING
    assert plan_path(model) == ["SLOT_BY_SLOT", "SHAPES_FROZEN", "REPLAYING"]
    islands = units(model, UnitKind.ISLAND)
    assert islands
    for u in islands:
        assert segment_path(u) == ["NEEDS_WARMUP", "NEEDS_COMPILE", "CAPTURE_PENDING", "REPLAYING"]
        assert (u.counters.warmups, u.counters.compiles, u.counters.captures) == (1, 1, 1)
        assert u.counters.replays == 4 and u.counters.recaptures == 0 and u.counters.eager_runs == 0
    views = model.dsp.segments
    assert all(v.replaying for v in views if v.kind == "island")


# -- FAILED and OOM_DEFERRED, with the fault-injecting test backend -----------------------------
@pytest.fixture
def faults(test_backends, freeze_after_1, monkeypatch: pytest.MonkeyPatch):
    """The capture-fault backend enabled, its knobs cleared; returns monkeypatch to set them."""
    for var in ("DSP_TEST_CAPTURE_OOM", "DSP_TEST_CAPTURE_OOM_AT", "DSP_TEST_CAPTURE_FAIL_OPS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_fault_backend_is_opt_in_and_outside_auto(faults) -> None:
    model = dsp.compile(mlp(gap=True), "vulkan")
    assert model.resolved_backends() == ["test_capture_faults"]
    assert "test_capture_faults" not in dsp.compile(mlp()).explain()["chain"]


def test_fault_backend_is_unavailable_without_the_switch() -> None:
    with pytest.raises(DSPError, match="DSP_TEST_BACKENDS=1"):
        dsp.compile(mlp(), "vulkan")


def test_capture_failure_splits_the_island_around_the_failing_op(faults) -> None:
    """The backend does not say which slot failed: the core bisects [MatMul, Tanh] and keeps MatMul captured."""
    faults.setenv("DSP_TEST_CAPTURE_FAIL_OPS", "Tanh")
    model, ref = dsp.compile(mlp(gap=True), "vulkan"), dsp.compile(mlp(gap=True), "slot_by_slot")
    for step in range(10):
        check(model, ref, feeds(step))
    first, gap, matmul, tanh, identity = units(model)
    assert [u.kind for u in (first, gap, matmul, tanh)] == [UnitKind.ISLAND, UnitKind.GAP] * 2
    assert identity.kind is UnitKind.ISLAND and identity.phase is S.REPLAYING
    assert first.phase is S.REPLAYING and first.counters.replays == 8
    assert gap.phase is S.FAILED and gap.reason.startswith("gap: Sigmoid is excluded")
    assert matmul.phase is S.REPLAYING and matmul.counters.captures == 1 and matmul.counters.replays == 8
    assert tanh.phase is S.FAILED and "injected capture failure: segment holds Tanh" in tanh.reason
    assert tanh.machine.history[-1].reason == tanh.reason
    assert tanh.counters.eager_runs == 8  # the step whose capture failed (run 3), then one per step (4..10)
    assert model.dsp.runtime.counters()["capture_splits"] == 1
    assert model.dsp.phase is P.REPLAYING
    view = model.dsp.segments[3]
    assert view.kind == "gap" and view.reason == tanh.reason and not view.replaying


def test_every_slot_failing_blocks_replay(faults) -> None:
    faults.setenv("DSP_TEST_CAPTURE_FAIL_OPS", "MatMul,Relu,Tanh,Identity")
    model, ref = dsp.compile(mlp(gap=True), "vulkan"), dsp.compile(mlp(gap=True), "slot_by_slot")
    for step in range(5):
        check(model, ref, feeds(step))
    assert plan_path(model) == ["SLOT_BY_SLOT", "SHAPES_FROZEN", "REPLAY_BLOCKED"]
    reason = model.dsp.runtime.machine.history[-1].reason
    assert reason.startswith("no slot could be captured: gap: ") and "segment holds MatMul" in reason
    assert all(u.kind is UnitKind.GAP and u.phase is S.FAILED for u in units(model))


def test_failed_slot_feeding_a_replaying_island_does_not_recapture(faults) -> None:
    """h = Relu(MatMul(x)) feeds the second island directly (skip connection) as well as the gap.

    Relu fails to capture and runs eagerly in a gap; its output must reach the second
    island at a stable address (bridged), or that island recaptures every step.
    """
    faults.setenv("DSP_TEST_CAPTURE_FAIL_OPS", "Relu")
    graph = mlp(gap=True, skip=True)
    model, ref = dsp.compile(graph, "vulkan"), dsp.compile(graph, "slot_by_slot")
    for step in range(12):
        check(model, ref, feeds(step))
    matmul, relu, _, last = units(model)[:4]
    assert matmul.phase is S.REPLAYING and relu.kind is UnitKind.GAP and last.phase is S.REPLAYING
    assert last.counters.recaptures == 0, model.dsp.json_report()["segments"]
    assert model.dsp.runtime.flags == []
    assert model.dsp.phase is P.REPLAYING


@pytest.mark.parametrize(
    ("k", "retries", "every", "at"),
    [(1, 3, 2, "prepare"), (2, 2, 3, "prepare"), (2, 3, 4, "capture"), (3, 2, 2, "prepare"), (5, 1, 3, "capture")],
)
def test_out_of_memory_is_deferred_and_retried(faults, k: int, retries: int, every: int, at: str) -> None:
    faults.setenv("DSP_TEST_CAPTURE_OOM", str(k))
    faults.setenv("DSP_TEST_CAPTURE_OOM_AT", at)
    faults.setenv("DSP_OOM_RETRIES", str(retries))
    faults.setenv("DSP_OOM_RETRY_EVERY", str(every))
    model, ref = dsp.compile(mlp(), "vulkan"), dsp.compile(mlp(), "slot_by_slot")
    # run 1 slot by slot, run 2 freezes and warms up, run 3 makes the first capture attempt
    first_attempt = 3
    attempts = k + 1 if k <= retries else retries + 1  # the last one succeeds when k <= retries
    last = first_attempt + (attempts - 1) * every
    for step in range(last + 4):
        check(model, ref, feeds(step))
    (island,) = units(model)
    history = island.machine.history
    deferred = [t.execution for t in history if t.target == "OOM_DEFERRED"]
    retried = [t.execution for t in history if t.source == "OOM_DEFERRED" and t.target == "NEEDS_COMPILE"]
    # deferred at the first attempt, then again at each failing retry, every `every` executions
    assert deferred == [first_attempt + i * every for i in range(min(k, retries + 1))]
    assert retried == [first_attempt + i * every for i in range(1, attempts)]
    assert island.counters.oom_retries == attempts - 1
    stage = "CAPTURE_PENDING" if at == "capture" else "NEEDS_COMPILE"
    assert all(t.source == stage for t in history if t.target == "OOM_DEFERRED")
    assert all(t.reason.startswith(f"injected out-of-memory at {at}") for t in history if t.target == "OOM_DEFERRED")
    if k <= retries:
        assert island.phase is S.REPLAYING and island.counters.captures == 1
        assert model.dsp.phase is P.REPLAYING
    else:
        # FAILED keeps its reason: the unit's reason is the one recorded with the move
        assert island.phase is S.FAILED and history[-1].target == "FAILED"
        assert history[-1].reason.startswith(f"out of memory after {retries} retries")
        assert island.reason == history[-1].reason
        assert f"injected out-of-memory at {at} attempt {retries + 1}" in island.reason
        assert history[-1].execution == last + 1
        assert island.counters.captures == 0 and island.counters.replays == 0
        assert model.dsp.phase is P.REPLAY_BLOCKED


# -- freezing and sealing -----------------------------------------------------------------------
@pytest.mark.parametrize("after", [1, 3])
def test_freezes_after_the_configured_executions(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    monkeypatch.setenv("DSP_FREEZE_AFTER", str(after))
    model = dsp.compile(mlp(), "emulated_replay")
    for _ in range(after):
        model.run(feeds(0))
        assert model.dsp.phase is P.SLOT_BY_SLOT
    model.run(feeds(0))
    assert model.dsp.phase is P.SHAPES_FROZEN
    (t,) = model.dsp.runtime.machine.history
    assert (t.target, t.execution) == ("SHAPES_FROZEN", after + 1)


def test_freeze_after_zero_waits_for_an_explicit_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FREEZE_AFTER", "0")
    model = dsp.compile(mlp(), "emulated_replay")
    for step in range(5):
        model.run(feeds(step))
    assert model.dsp.phase is P.SLOT_BY_SLOT
    model.dsp.freeze()  # the plan is idle and its shapes are known: it freezes now
    assert model.dsp.phase is P.SHAPES_FROZEN
    assert model.dsp.runtime.machine.history[0].execution == 5


def test_explicit_freeze_before_the_first_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FREEZE_AFTER", "100")
    model, ref = dsp.compile(mlp(), "emulated_replay"), dsp.compile(mlp(), "slot_by_slot")
    with pytest.raises(DSPError, match="no plan has run yet"):
        _ = model.dsp.phase
    model.dsp.freeze()
    check(model, ref, feeds(0))
    assert model.dsp.phase is P.SHAPES_FROZEN
    assert model.dsp.runtime.machine.history[0].execution == 1
    for step in range(1, 5):
        check(model, ref, feeds(step))
    assert model.dsp.phase is P.REPLAYING


def test_no_freeze_prevents_freezing(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("DSP_NO_FREEZE", "1")
    monkeypatch.setenv("DSP_FREEZE_AFTER", "1")
    model, ref = dsp.compile(mlp(), "emulated_replay"), dsp.compile(mlp(), "slot_by_slot")
    model.dsp.freeze()  # before the first run
    for step in range(5):
        check(model, ref, feeds(step))
    assert model.dsp.phase is P.SLOT_BY_SLOT
    with caplog.at_level("WARNING", logger="dsp.runtime"):
        model.dsp.freeze()
    assert model.dsp.phase is P.SLOT_BY_SLOT and "DSP_NO_FREEZE" in caplog.text
    check(model, ref, feeds(9))
    assert model.dsp.phase is P.SLOT_BY_SLOT and model.dsp.runtime.units == []


def reshape_by_shape() -> dsp.Graph:
    """y = Reshape(x, Concat(Slice(Shape(x), 0, 1), [-1])): the target depends only on x's shape."""
    g = dsp.GraphBuilder("reshape")
    x = g.placeholder("x", "float32", [2, 3, 4])
    lead = g.Slice(g.Shape(x), g.constant(np.array([0], np.int64)), g.constant(np.array([1], np.int64)))
    target = g.Concat(lead, g.constant(np.array([-1], np.int64)), axis=0)
    g.output(g.Tanh(g.Reshape(x, target)), "y")
    return g.build()


@pytest.mark.parametrize("mode", ["slot_by_slot", "emulated_replay"])
def test_shape_of_a_placeholder_does_not_taint(freeze_after_1, mode: str) -> None:
    model = dsp.compile(reshape_by_shape(), mode)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.standard_normal((2, 3, 4)).astype(np.float32)
        assert np.array_equal(model.run({"x": x})["y"], np.tanh(x.reshape(2, 12)))
    phases = {s["op"]: s["phase"] for s in model.dsp.slots}
    assert phases == {
        "Shape": "SEALED",
        "Slice": "SEALED",
        "Concat": "SEALED",
        "Reshape": "BUILDING",
        "Tanh": "BUILDING",
        "Identity": "BUILDING",
    }
    sealed_in_units = {s for u in units(model) for s in u.segment.slots} & model.dsp.runtime.sealed
    assert sealed_in_units == set()  # sealed slots belong to no unit: they never run again


@pytest.fixture
def cos_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the Cos kernel (patched in the op table before a model compiles)."""
    calls = [0]
    opdef = registry.lookup("Cos")

    def spy(ctx: Any, x: Any) -> Any:
        calls[0] += 1
        return opdef.kernel(ctx, x)

    monkeypatch.setitem(registry._TABLE, ("", "Cos"), dataclasses.replace(opdef, kernel=spy, specialize=None))
    return calls


def constant_chain(variable: bool = False) -> dsp.Graph:
    """y = x + Cos(Cos(Cos(c))) and z = s * Cos(c): the Cos chain depends on a constant only."""
    g = dsp.GraphBuilder("chain")
    x = g.placeholder("x", "float32", [2, 8])
    s = (g.variable if variable else g.placeholder)("s", "float32", [2, 8])
    c = g.constant(np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8), name="c")
    first = g.Cos(c)
    g.output(x + g.Cos(g.Cos(first)), "y")
    g.output(s * first, "z")
    return g.build()


def chain_reference(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    c = np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8)
    return {"y": f["x"] + np.cos(np.cos(np.cos(c))), "z": f["s"] * np.cos(c)}


def chain_feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((2, 8)).astype(np.float32) for n in ("x", "s")}


@pytest.mark.parametrize("mode", ["slot_by_slot", "emulated_replay"])
def test_sealed_slots_are_computed_once_then_skipped(freeze_after_1, cos_spy, mode: str) -> None:
    model = dsp.compile(constant_chain(), mode)
    f = chain_feeds(0)
    out = model.run(f)
    assert cos_spy[0] == 3  # slot by slot: every slot runs
    model.run(f)  # freezes: the sealed chain is computed once
    assert cos_spy[0] == 6
    for step in range(10):
        f = chain_feeds(step)
        out = model.run(f)
        want = chain_reference(f)
        assert np.allclose(out["y"], want["y"]) and np.allclose(out["z"], want["z"])
    assert cos_spy[0] == 6, "sealed slots ran again after freezing"
    sealed_ops = sorted(s["op"] for s in model.dsp.slots if s["phase"] == "SEALED")
    assert sealed_ops == ["Cos", "Cos", "Cos"]


def test_mark_variable_demotes_and_reruns_detection(freeze_after_1, cos_spy) -> None:
    model = dsp.compile(constant_chain(), "emulated_replay")
    for step in range(5):
        model.run(chain_feeds(step))
    assert model.dsp.phase is P.REPLAYING
    runtime = model.dsp.runtime
    sealed_before = runtime.sealed
    calls = cos_spy[0]
    s_flat = next(i for i, e in enumerate(runtime.plan.externals) if e.name == "s")
    s_flat = runtime.plan.flat(runtime.plan.external_ref(s_flat))
    assert s_flat in runtime.staging.buffers  # a placeholder: staged

    model.dsp.mark_variable(["s"])
    assert runtime.phase is P.SLOT_BY_SLOT and runtime.units == [] and runtime.sealed == frozenset()
    demotion = runtime.machine.history[-1]
    assert demotion.demotion and demotion.reason == "inputs marked variable: s"
    assert (demotion.source, demotion.target) == ("REPLAYING", "SLOT_BY_SLOT")
    slot_demotions = [m.history[-1] for m in runtime.slot_machines if m.history and m.history[-1].demotion]
    assert len(slot_demotions) == len(sealed_before)
    assert all(t.reason == demotion.reason and t.target == "BUILDING" for t in slot_demotions)
    assert {e["name"]: e["class"] for e in model.dsp.external_inputs}["s"] == "variable"

    f = chain_feeds(7)
    out = model.run(f)  # slot by slot again (executions restarted)
    assert runtime.phase is P.SLOT_BY_SLOT
    out = model.run(f)  # refreezes
    assert runtime.phase is P.SHAPES_FROZEN
    assert np.allclose(out["z"], chain_reference(f)["z"])
    # every fed input already taints, so a placeholder marked variable leaves the sealed set as it was
    assert runtime.sealed == sealed_before
    assert cos_spy[0] == calls + 3 + 3  # one slot-by-slot run, then the sealed chain recomputed once
    assert s_flat not in runtime.staging.buffers  # a variable is read in place, never staged
    for step in range(4):  # new placeholder values, the variable fed in place (same object)
        f = dict(chain_feeds(step), s=f["s"])
        out = model.run(f)
        assert np.allclose(out["z"], chain_reference(f)["z"]) and np.allclose(out["y"], chain_reference(f)["y"])
    assert runtime.phase is P.REPLAYING
    (island,) = units(model, UnitKind.ISLAND)
    assert s_flat in island.inputs and island.counters.recaptures == 0


# -- identity keys and drift ---------------------------------------------------------------------
def stateful_reference(f: dict[str, np.ndarray]) -> np.ndarray:
    w = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    return (f["x"] + f["state"]) @ w


@pytest.fixture
def replaying_stateful(freeze_after_1) -> tuple[dsp.CompiledModel, dsp.CompiledModel, dict[str, np.ndarray]]:
    model, ref = dsp.compile(stateful(), "emulated_replay"), dsp.compile(stateful(), "slot_by_slot")
    rng = np.random.default_rng(5)
    f = {n: rng.standard_normal((2, 8)).astype(np.float32) for n in ("x", "state")}
    for _ in range(5):
        check(model, ref, f)
    assert model.dsp.phase is P.REPLAYING
    return model, ref, f


def test_new_variable_object_recaptures_exactly_once(replaying_stateful) -> None:
    model, ref, f = replaying_stateful
    (island,) = units(model, UnitKind.ISLAND)
    assert island.counters.recaptures == 0 and island.keys.generation == 0
    replays = island.counters.replays
    moved = dict(f, state=f["state"] + 1)  # a new array object, new values
    check(model, ref, moved)
    assert island.counters.recaptures == 1 and island.counters.captures == 2
    assert island.keys.generation == 1 and island.phase is S.REPLAYING
    recapture = [t for t in island.machine.history if t.demotion]
    assert len(recapture) == 1 and recapture[0].reason.startswith("address drift at inputs")
    for _ in range(3):
        check(model, ref, moved)  # the same object again: no drift
    assert island.counters.recaptures == 1 and island.counters.replays == replays + 4
    assert model.dsp.runtime.flags == []


def test_new_placeholder_object_each_step_never_recaptures(replaying_stateful) -> None:
    model, ref, f = replaying_stateful
    (island,) = units(model, UnitKind.ISLAND)
    copies = model.dsp.runtime.staging.copies
    for step in range(10):
        check(model, ref, dict(f, x=np.random.default_rng(step).standard_normal((2, 8)).astype(np.float32)))
    assert island.counters.recaptures == 0
    assert model.dsp.runtime.staging.copies == copies + 10
    assert model.dsp.runtime.staging.allocations == 1


def test_variable_moving_every_step_is_flagged(replaying_stateful, caplog) -> None:
    model, ref, f = replaying_stateful
    with caplog.at_level("WARNING", logger="dsp.runtime"):
        for step in range(8):
            check(model, ref, dict(f, state=f["state"] + step))
    assert "recapturing every step" in model.dsp.runtime.flags
    assert model.dsp.json_report()["flags"] == ["recapturing every step"]
    assert units(model, UnitKind.ISLAND)[0].counters.recaptures == 8
    assert "recaptures nearly every step" in caplog.text


def test_marked_variable_is_read_in_place_and_drifts(freeze_after_1) -> None:
    model, ref = dsp.compile(two_inputs(), "emulated_replay"), dsp.compile(two_inputs(), "slot_by_slot")
    model.dsp.mark_variable(["s"])
    rng = np.random.default_rng(3)
    f = {n: rng.standard_normal((2, 8)).astype(np.float32) for n in ("x", "s")}
    for _ in range(5):
        check(model, ref, f)
    assert model.dsp.phase is P.REPLAYING
    (island,) = units(model, UnitKind.ISLAND)
    check(model, ref, dict(f, x=f["x"].copy()))  # placeholder: staged, no drift
    assert island.counters.recaptures == 0
    check(model, ref, dict(f, s=f["s"].copy()))  # variable: read in place, its address moved
    assert island.counters.recaptures == 1


# -- staging ------------------------------------------------------------------------------------
def constant_index(model: dsp.CompiledModel, name: str) -> int:
    plan = model.plan()
    return next(k for k in plan.constants if plan.externals[k].name == name)


def test_replaced_constant_is_rejected_by_name(freeze_after_1) -> None:
    model = dsp.compile(mlp(), "emulated_replay")
    for step in range(4):
        model.run(feeds(step))
    plan = model.plan()
    k = constant_index(model, "w2")
    plan.constants[k] = plan.constants[k] * 2
    with pytest.raises(DSPError, match="constant 'w2' was replaced after the plan froze"):
        model.run(feeds(0))
    with pytest.raises(DSPError, match="'w2'"):
        model.dsp.verify_constants()


def test_constant_modified_in_place_fails_verification(freeze_after_1) -> None:
    model = dsp.compile(mlp(), "emulated_replay")
    for step in range(4):
        model.run(feeds(step))
    model.dsp.verify_constants()  # untouched: fine
    array = model.plan().constants[constant_index(model, "w1")]
    if not array.flags.writeable:
        array.setflags(write=True)
    array[0, 0] += 1.0
    with pytest.raises(DSPError, match="constant 'w1' was modified in place"):
        model.dsp.verify_constants()


def total_replays(model: dsp.CompiledModel) -> int:
    return sum(u.counters.replays for u in units(model))


@pytest.mark.parametrize("fault", ["allocation", "copy", "stream_sync"])
def test_staging_fault_raises_before_any_replay(freeze_after_1, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    model, ref = dsp.compile(mlp(), "emulated_replay"), dsp.compile(mlp(), "slot_by_slot")
    check(model, ref, feeds(0))  # slot by slot: nothing staged yet
    if fault != "allocation":
        for step in range(1, 6):
            check(model, ref, feeds(step))
        assert model.dsp.phase is P.REPLAYING
    before = total_replays(model)  # 0 for allocation: the buffer is first allocated at the freezing run
    monkeypatch.setenv("DSP_STAGING_FAULT", fault)
    with pytest.raises(StagingError, match="injected fault") as info:
        model.run(feeds(9))
    assert isinstance(info.value, DSPError)
    assert total_replays(model) == before
    monkeypatch.delenv("DSP_STAGING_FAULT")
    for step in range(10, 15):  # the fault was transient: the plan carries on, outputs correct
        check(model, ref, feeds(step))
    assert model.dsp.phase is P.REPLAYING


def test_stale_buffer_is_redispatched_once(freeze_after_1, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ref = dsp.compile(mlp(), "emulated_replay"), dsp.compile(mlp(), "slot_by_slot")
    for step in range(5):
        check(model, ref, feeds(step))
    (island,) = units(model, UnitKind.ISLAND)
    replays = island.counters.replays
    monkeypatch.setenv("DSP_STAGING_FAULT", "stale_buffer")
    check(model, ref, feeds(7))
    monkeypatch.delenv("DSP_STAGING_FAULT")
    assert island.counters.stale_redispatches == 1
    assert island.counters.replays == replays + 2  # the stale dispatch and its re-dispatch
    assert island.counters.recaptures == 0
    check(model, ref, feeds(8))
    assert island.counters.stale_redispatches == 1


def test_unknown_staging_fault_is_named(freeze_after_1, monkeypatch: pytest.MonkeyPatch) -> None:
    model = dsp.compile(mlp(), "emulated_replay")
    model.run(feeds(0))
    monkeypatch.setenv("DSP_STAGING_FAULT", "bogus")
    with pytest.raises(StagingError, match="'bogus' is not a known fault"):
        model.run(feeds(0))


# -- concurrency --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["emulated_replay", "slot_by_slot"])
def test_threads_share_a_compiled_model(mode: str) -> None:
    threads, steps = 8, 200
    batches = [1, 2, 2, 3, 1, 2, 3, 3]  # same and different shapes across threads
    inputs = [
        [np.random.default_rng(1000 * t + s).standard_normal((batches[t], 8)).astype(np.float32) for s in range(steps)]
        for t in range(threads)
    ]
    single = dsp.compile(mlp(), mode)
    want = [[single.run({"x": x})["y"] for x in xs] for xs in inputs]
    shared = dsp.compile(mlp(), mode)
    got: list[list[np.ndarray]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        try:
            start.wait()
            for x in inputs[t]:
                got[t].append(shared.run({"x": x})["y"])
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert errors == []
    for t in range(threads):
        assert len(got[t]) == steps
        assert all(np.array_equal(a, b) for a, b in zip(got[t], want[t])), f"thread {t}"
    assert shared.stats.plan_builds == 3
    expected = P.REPLAYING if mode == "emulated_replay" else P.REPLAY_BLOCKED
    for sig in shared.cache.signatures():
        live = shared.cache.acquire(sig)
        try:
            assert live.runtime.phase is expected
            assert live.runtime.counters().get("recaptures", 0) == 0
        finally:
            shared.cache.release(live)


def test_shape_of_a_computed_value_is_not_sealed() -> None:
    """Shape(x) of a fed x is frozen; Shape of a value computed from x exists only at run time."""
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2, 3])
    h = g.Relu(x)
    g.output(g.Reshape(h, g.Shape(h)), "y")  # Shape reads a computed value
    g.output(g.Shape(x), "s")  # Shape of the fed input: sealed
    model = dsp.compile(g.build(), mode="emulated_replay")
    x_val = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    for _ in range(5):
        outs = model.run({"x": x_val})
    np.testing.assert_array_equal(outs["y"], np.maximum(x_val, 0))
    sealed = {model.plan().slots[i].op for i in model.dsp.runtime.sealed}
    phases = {s["op"]: s["phase"] for s in model.dsp.slots}
    assert phases["Relu"] == "BUILDING" and phases["Reshape"] == "BUILDING"
    assert "Shape" in sealed  # the one of x
    assert sum(1 for s in model.dsp.slots if s["op"] == "Shape" and s["phase"] == "SEALED") == 1
