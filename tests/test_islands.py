"""Islands and gaps: a capture that fails because of some slots costs those slots only.

EMULATED_REPLAY (cpu_ref's capture/replay) with DSP_CAPTURE_FAULT naming the ops whose
captures fail; every run is compared bit for bit with SLOT_BY_SLOT. The test backend
``test_capture_faults`` fails captures without naming the slot, so the core bisects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.errors import PlanFormatError
from dsp_core.plan import serialize
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.units import UnitKind

# x[batch, 8] -> MatMul(w) -> Relu -> Tanh -> Neg -> Abs -> Sin -> Exp -> y: eight distinct ops.
CHAIN = ("MatMul", "Relu", "Tanh", "Neg", "Abs", "Sin", "Exp")


def chain_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.linspace(-0.5, 0.5, 64, dtype=np.float32).reshape(8, 8), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["v0"], name="n0")]
    for k, op in enumerate(CHAIN[1:], start=1):
        out = "y" if k == len(CHAIN) - 1 else f"v{k}"
        nodes.append(helper.make_node(op, [f"v{k - 1}"], [out], name=f"n{k}"))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def feeds(seed: int, batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 8)).astype(np.float32)}


def run_and_check(model: dsp.CompiledModel, ref: dsp.CompiledModel, steps: int, batch: int = 2) -> None:
    for step in range(steps):
        f = feeds(step, batch)
        got, want = model.run(f)["y"], ref.run(f)["y"]
        assert np.array_equal(got, want), f"step {step}"


def kinds(model: dsp.CompiledModel) -> list[tuple[str, list[str]]]:
    plan = model.dsp.runtime.plan
    return [(u.kind.value, [plan.slots[s].op for s in u.segment.slots]) for u in model.dsp.runtime.units]


@pytest.fixture
def freeze_after_1(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("DSP_FREEZE_AFTER", "1")
    monkeypatch.setenv("DSP_DISK_CACHE", "0")  # learned gaps are kept on disk: each test starts cold
    monkeypatch.delenv("DSP_CAPTURE_FAULT", raising=False)
    return monkeypatch


def expected_units(bad: set[str]) -> list[tuple[str, list[str]]]:
    """Runs of good ops as islands, each bad op a gap of its own, in plan order."""
    units: list[tuple[str, list[str]]] = []
    for op in CHAIN:
        if op in bad:
            units.append(("gap", [op]))
        elif units and units[-1][0] == "island":
            units[-1][1].append(op)
        else:
            units.append(("island", [op]))
    return units


@pytest.mark.parametrize(
    "bad",
    [{"MatMul"}, {"Neg"}, {"Exp"}, {"Tanh", "Neg"}, {"Relu", "Sin"}, {"MatMul", "Exp"}],
    ids=["start", "middle", "end", "two-adjacent", "two-apart", "both-ends"],
)
def test_bad_ops_become_gaps_and_the_rest_replays(freeze_after_1: pytest.MonkeyPatch, bad: set[str]) -> None:
    freeze_after_1.setenv("DSP_CAPTURE_FAULT", ",".join(sorted(bad)))
    model, ref = dsp.compile(chain_model(), "emulated_replay"), dsp.compile(chain_model(), "slot_by_slot")
    run_and_check(model, ref, 8)
    assert kinds(model) == expected_units(bad)
    assert model.dsp.phase is PlanPhase.REPLAYING
    runtime = model.dsp.runtime
    for unit in runtime.units:
        if unit.kind is UnitKind.ISLAND:
            assert unit.phase is SegmentPhase.REPLAYING and unit.counters.recaptures == 0
        else:
            (slot,) = unit.segment.slots
            assert unit.phase is SegmentPhase.FAILED
            assert "DSP_CAPTURE_FAULT" in unit.reason and runtime.plan.slots[slot].op in unit.reason
    # the injected failure names its slot: one failed capture per bad op, found in one step, never again
    counters = runtime.counters()
    assert counters["capture_failures"] == len(bad) and counters["capture_splits"] == 1
    gaps = runtime.plan.capture_gaps["emulated_replay"]
    assert sorted(runtime.plan.slots[s].op for s in gaps) == sorted(bad)
    assert len({u.index for u in runtime.units}) == len(runtime.units)  # unit indexes are unique ids


def test_every_op_bad_is_replay_blocked_with_reasons(freeze_after_1: pytest.MonkeyPatch) -> None:
    freeze_after_1.setenv("DSP_CAPTURE_FAULT", ",".join(CHAIN))
    model, ref = dsp.compile(chain_model(), "emulated_replay"), dsp.compile(chain_model(), "slot_by_slot")
    run_and_check(model, ref, 6)
    assert model.dsp.phase is PlanPhase.REPLAY_BLOCKED
    reason = model.dsp.runtime.machine.history[-1].reason
    assert reason.startswith("no slot could be captured: gap: ") and "DSP_CAPTURE_FAULT" in reason
    assert all(u.kind is UnitKind.GAP and "DSP_CAPTURE_FAULT" in u.reason for u in model.dsp.runtime.units)
    assert len(model.dsp.runtime.units) == len(CHAIN)


def test_the_split_is_reused_by_a_new_shape_and_on_replay(freeze_after_1: pytest.MonkeyPatch) -> None:
    freeze_after_1.setenv("DSP_CAPTURE_FAULT", "Tanh")
    model, ref = dsp.compile(chain_model(), "emulated_replay"), dsp.compile(chain_model(), "slot_by_slot")
    run_and_check(model, ref, 6)
    first = model.dsp.runtime
    assert first.counters()["capture_failures"] == 1
    run_and_check(model, ref, 6, batch=5)  # a second live plan (new shape signature), same plan
    second = model.dsp.runtime
    assert second is not first and second.phase is PlanPhase.REPLAYING
    assert second.counters()["capture_failures"] == 0 and second.counters()["capture_splits"] == 0
    assert kinds(model) == expected_units({"Tanh"})
    assert first.counters()["capture_failures"] == 1  # replays of the first never failed again


def test_the_split_survives_a_disk_cache_load(
    freeze_after_1: pytest.MonkeyPatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = dsp.compile(chain_model(), "slot_by_slot")  # the disk cache is still off here
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DSP_DISK_CACHE", "1")
    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(), path)
    freeze_after_1.setenv("DSP_CAPTURE_FAULT", "Neg,Sin")
    cold = dsp.compile(str(path), "emulated_replay")
    run_and_check(cold, ref, 5)
    assert cold.dsp.runtime.counters()["capture_failures"] == 2
    assert cold.stats.disk_writes == 2  # at compile, and again once the gaps were learned
    # A new process would start here: the switch is off, yet the cached plan knows its gaps.
    freeze_after_1.delenv("DSP_CAPTURE_FAULT")
    warm = dsp.compile(str(path), "emulated_replay")
    assert warm.stats.disk_hits == 1
    plan = warm.plan()
    assert plan is not None
    assert sorted(plan.slots[s].op for s in plan.capture_gaps["emulated_replay"]) == ["Neg", "Sin"]
    run_and_check(warm, ref, 5)
    assert warm.dsp.runtime.counters()["capture_failures"] == 0
    assert kinds(warm) == expected_units({"Neg", "Sin"})
    assert all("DSP_CAPTURE_FAULT" in u.reason for u in warm.dsp.runtime.units if u.kind is UnitKind.GAP)
    assert warm.dsp.phase is PlanPhase.REPLAYING


def test_bisection_finds_the_slots_when_the_backend_does_not_name_them(
    test_backends: Any, freeze_after_1: pytest.MonkeyPatch
) -> None:
    """test_capture_faults fails any capture holding Neg or Exp without saying which slot."""
    freeze_after_1.setenv("DSP_TEST_CAPTURE_FAIL_OPS", "Neg,Exp")
    for var in ("DSP_TEST_CAPTURE_OOM", "DSP_TEST_CAPTURE_OOM_AT"):
        freeze_after_1.delenv(var, raising=False)
    model, ref = dsp.compile(chain_model(), "vulkan"), dsp.compile(chain_model(), "slot_by_slot")
    run_and_check(model, ref, 8)
    assert model.dsp.phase is PlanPhase.REPLAYING
    # Bisection may leave the good slots of this live plan in several islands; the gaps are exact.
    gaps = [ops for kind, ops in kinds(model) if kind == "gap"]
    assert gaps == [["Neg"], ["Exp"]]
    assert [op for kind, ops in kinds(model) if kind == "island" for op in ops] == [
        op for op in CHAIN if op not in ("Neg", "Exp")
    ]
    counters = model.dsp.runtime.counters()
    assert counters["capture_splits"] == 1
    assert 2 < counters["capture_failures"] <= 2 * 2 * 3  # a few halvings per bad op, not one per slot
    # A later live plan cuts the learned gaps out up front: maximal islands, no failed capture.
    run_and_check(model, ref, 6, batch=3)
    assert kinds(model) == expected_units({"Neg", "Exp"})
    assert model.dsp.runtime.counters()["capture_failures"] == 0


def test_gaps_show_in_diagnostics(freeze_after_1: pytest.MonkeyPatch) -> None:
    from dsp_core import diag

    freeze_after_1.setenv("DSP_CAPTURE_FAULT", "Abs")
    diag.clear()
    diag.enable("ALL")
    try:
        model = dsp.compile(chain_model(), "emulated_replay")
        for step in range(5):
            model.run(feeds(step))
        events = [e for e in diag.events() if e.code == "split"]
        assert len(events) == 1 and "1 gap slot(s)" in events[0].message
        gap = next(u for u in model.dsp.runtime.units if u.kind is UnitKind.GAP)
        records = [r for r in diag.terminal_records() if r.plan == model.dsp.runtime.diag_id]
        assert any(r.segment == gap.index and r.state == "FAILED" and "Abs" in r.reason for r in records)
        report = model.dsp.json_report()
        assert any(s["kind"] == "gap" and "DSP_CAPTURE_FAULT" in s["reason"] for s in report["segments"])
    finally:
        diag.disable()
        diag.clear()


# -- DSP1: the learned gaps travel with the plan ------------------------------------------------
def test_capture_gaps_round_trip_through_dsp1() -> None:
    plan = dsp.compile(chain_model(), "slot_by_slot").plan()
    assert plan is not None
    plain = serialize.dumps(plan)
    assert serialize.loads(plain).capture_gaps == {}
    plan.capture_gaps = {"emulated_replay": {3: "injected"}, "cuda_graphs": {0: "H2D during capture", 5: "sync"}}
    data = serialize.dumps(plan)
    assert data.startswith(plain[:4]) and len(data) > len(plain)
    back = serialize.loads(data)
    assert back.capture_gaps == plan.capture_gaps and back.content_hash == plan.content_hash
    plan.capture_gaps = {}


def test_a_gap_slot_out_of_range_is_a_format_error() -> None:
    plan = dsp.compile(chain_model(), "slot_by_slot").plan()
    assert plan is not None
    plan.capture_gaps = {"b": {len(plan.slots) + 4: "x"}}
    with pytest.raises(PlanFormatError, match="gap slot"):
        serialize.loads(serialize.dumps(plan))
    plan.capture_gaps = {}


def test_capture_fault_is_an_option_of_the_one_config_table() -> None:
    from dsp_core import config

    opt = config.option("capture_fault")
    assert opt.env == "DSP_CAPTURE_FAULT" and "Test switch" in opt.doc


def test_plan_explain_shows_each_gap_and_its_reason(tmp_path: Path) -> None:
    import json

    from conftest import run_cli

    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(), path)
    env = {"DSP_CAPTURE_FAULT": "Neg", "DSP_DISK_CACHE": "0"}
    done = run_cli("plan", "explain", str(path), "--mode", "emulated_replay", "--runs", "6", env=env)
    assert done.returncode == 0, done.stderr
    assert "gap slot 3 Neg: Neg failed to capture: injected capture failure (DSP_CAPTURE_FAULT)" in done.stdout
    assert "after 6 run(s): plan phase REPLAYING" in done.stdout
    done = run_cli("plan", "explain", str(path), "--mode", "emulated_replay", "--runs", "6", "--json", env=env)
    report = json.loads(done.stdout)
    (gap,) = report["segments"][0]["gaps"]
    assert gap["slot"] == 3 and gap["learned"] and "DSP_CAPTURE_FAULT" in gap["reason"]
    assert [u["kind"] for u in report["units"]] == ["island", "gap", "island"]
