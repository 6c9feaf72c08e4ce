"""Diagnostics: the ring and its aggregates, terminal records, the flight recorder, traces, the CLI."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli as dsp_cli
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core import diag
from dsp_core.diag import Category, Level
from dsp_core.diag.recorder import RING_CAPACITY
from dsp_core.diag.trace import chrome_trace
from dsp_core.errors import ConfigError, KernelError


@pytest.fixture(autouse=True)
def fresh_diag() -> Iterator[None]:
    """Every test starts and ends with diagnostics off and empty."""
    diag.disable()
    diag.clear()
    yield
    diag.disable()
    diag.clear()


def run_n(model: dsp.CompiledModel, n: int, batch: int = 2) -> None:
    """``n`` steps of the 8-wide MLP on fresh inputs of one shape."""
    rng = np.random.default_rng(0)
    for _ in range(n):
        model.run({"x": rng.standard_normal((batch, 8)).astype(np.float32)})


def terminal(state: str) -> list[diag.TerminalRecord]:
    return [t for t in diag.terminal_records() if t.state == state]


# -- the ring -------------------------------------------------------------------------------
def test_off_by_default_records_nothing() -> None:
    assert diag.ON is False and diag.TIMED is False
    diag.emit(Category.CACHE, Level.SUMMARY, "miss", "x")
    assert diag.events() == [] and diag.RECORDER.written == 0


def test_wrap_around_keeps_aggregates_exact() -> None:
    diag.enable("ALL", "full")
    n = 200_000
    cats = list(Category)
    for i in range(n):
        diag.emit(cats[i % len(cats)], Level.SUMMARY, "tick", "", float(i))
    kept = diag.events()
    assert len(kept) == RING_CAPACITY and diag.RECORDER.written == n
    assert [e.payload for e in kept[:3]] == [n - RING_CAPACITY, n - RING_CAPACITY + 1, n - RING_CAPACITY + 2]
    assert kept[-1].payload == n - 1
    aggregates = diag.RECORDER.aggregates()
    for k, cat in enumerate(cats):
        values = range(k, n, len(cats))
        agg = aggregates[cat.name]
        assert agg["count"] == len(values)
        assert agg["sum"] == float(sum(values))
        assert (agg["min"], agg["max"]) == (values[0], values[-1])
    assert sum(a["count"] for a in aggregates.values()) == n
    assert diag.RECORDER.code_counts() == {f"{c.name}.tick": len(range(k, n, len(cats))) for k, c in enumerate(cats)}


def test_concurrent_writers_lose_no_count() -> None:
    diag.enable("CACHE,TIMING", "summary")
    per_thread, threads = 25_000, 8

    def writer(t: int) -> None:
        for i in range(per_thread):
            diag.emit(Category.CACHE if i % 2 else Category.TIMING, Level.SUMMARY, f"w{t}", "", 1.0)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    agg = diag.RECORDER.aggregates()
    assert agg["CACHE"]["count"] + agg["TIMING"]["count"] == per_thread * threads
    assert agg["CACHE"]["sum"] == per_thread * threads / 2
    codes = diag.RECORDER.code_counts()
    assert all(codes[f"CACHE.w{t}"] == codes[f"TIMING.w{t}"] == per_thread // 2 for t in range(threads))
    assert len(diag.events()) == RING_CAPACITY


def test_levels_and_categories_filter() -> None:
    diag.enable("CACHE", "summary")
    diag.emit(Category.CACHE, Level.DETAILED, "hit")
    diag.emit(Category.SEGMENT, Level.SUMMARY, "move")
    diag.emit(Category.CACHE, Level.SUMMARY, "miss")
    assert [e.code for e in diag.events()] == ["miss"]
    assert diag.enabled(Category.CACHE) and not diag.enabled(Category.CACHE, Level.DETAILED)


def test_bad_category_and_level_name_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="unknown category 'BOGUS'.*ALL, EXECUTE, SEGMENT"):
        diag.enable("CACHE,BOGUS")
    with pytest.raises(ConfigError, match="expected one of off, summary, detailed, full"):
        diag.enable("ALL", "loud")


# -- events from the core ------------------------------------------------------------------
def test_core_emits_cache_auction_compile_execute_transfer(mlp_graph: dsp.Graph) -> None:
    diag.enable("ALL", "detailed")
    model = dsp.compile(mlp_graph, mode="emulated_replay")
    run_n(model, 5)
    run_n(model, 1, batch=3)
    codes = diag.RECORDER.code_counts()
    assert codes["AUCTION.segment"] == 1 and codes["COMPILE.plan"] == 1 and codes["COMPILE.segment"] == 1
    assert codes["CACHE.build"] == 2 and codes["CACHE.miss"] == 2 and codes["CACHE.hit"] == 4
    assert codes["EXECUTE.step"] == 6 and codes["TRANSFER.stage"] >= 3 and codes["GRAPH_REPLAY.capture"] == 1
    misses = [e.message for e in diag.events(Category.CACHE) if e.code == "miss"]
    assert misses == ["cache empty", "placeholder x: shape (3, 8) vs cached (2, 8)"]
    moves = [e.message for e in diag.events(Category.SEGMENT)]
    assert any("NEEDS_WARMUP -> NEEDS_COMPILE" in m for m in moves)
    assert any("CAPTURE_PENDING -> REPLAYING" in m for m in moves)
    rep = model.dsp.diag_report()
    assert rep["cache"]["miss"] == 2 and rep["terminal"][0]["state"] == "REPLAYING"


def test_recaptures_are_counted(mlp_graph: dsp.Graph) -> None:
    diag.enable("GRAPH_REPLAY", "summary")
    model = dsp.compile(mlp_graph, mode="emulated_replay")
    model.dsp.mark_variable(["x"])  # read in place: a new array each step drifts its address
    run_n(model, 8)
    report = diag.report()
    assert report["graph_replay"]["recapture"] >= 3
    assert report["graph_replay"]["recapture"] == model.dsp.runtime.counters()["recaptures"]


def test_fallbacks_are_recorded(test_backends, mlp_graph: dsp.Graph) -> None:
    diag.enable("AUCTION")
    dsp.compile(mlp_graph)  # AUTO with the test backends: the eltwise one declines MatMul
    fallbacks = diag.report()["fallbacks"]
    assert fallbacks["count"] >= 1
    assert any("MatMul" in m["message"] and "declined" in m["message"] for m in fallbacks["detail"])


# -- terminal records ------------------------------------------------------------------------
def test_terminal_record_replaying(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="emulated_replay")
    run_n(model, 6)
    (rec,) = terminal("REPLAYING")
    assert rec.plan == model.dsp.runtime.diag_id and rec.segment == 0
    assert rec.reason == f"captured at execution {rec.execution}" and rec.execution == 4


def test_terminal_records_slot_by_slot_blocked(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="slot_by_slot")
    run_n(model, 3)
    (blocked,) = terminal("REPLAY_BLOCKED")
    assert blocked.segment == -1 and blocked.reason == "no segment can capture"
    (failed,) = terminal("FAILED")
    assert failed.reason == "backend slot_by_slot does not capture: runs eagerly"


@pytest.fixture
def faults(test_backends, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("DSP_TEST_CAPTURE_OOM", "DSP_TEST_CAPTURE_OOM_AT", "DSP_TEST_CAPTURE_FAIL_OPS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_terminal_record_failed_capture(faults: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    ops = {s.op for s in dsp.compile(mlp_graph, mode="slot_by_slot").plan().slots}
    faults.setenv("DSP_TEST_CAPTURE_FAIL_OPS", ",".join(sorted(ops)))
    model = dsp.compile(mlp_graph, mode="vulkan")
    run_n(model, 5)
    failed = terminal("FAILED")
    assert len(failed) == len(model.dsp.runtime.units) == len(model.dsp.runtime.plan.slots)
    assert any(f.reason.endswith("injected capture failure: segment holds MatMul") for f in failed)
    assert terminal("REPLAY_BLOCKED")[0].reason.startswith("no slot could be captured: gap: ")


def test_terminal_record_oom_deferred(faults: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    faults.setenv("DSP_TEST_CAPTURE_OOM", "100")
    model = dsp.compile(mlp_graph, mode="vulkan")
    run_n(model, 4)
    (rec,) = terminal("OOM_DEFERRED")
    assert rec.reason.startswith("capture ran out of memory at execution 4: injected out-of-memory")


def test_at_most_64_terminal_records(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="slot_by_slot")
    for batch in range(1, 40):  # 39 live plans, two records each
        run_n(model, 3, batch=batch)
    records = diag.terminal_records()
    assert len(records) == 64 and records[-1].plan == model.dsp.runtime.diag_id


# -- the flight recorder ---------------------------------------------------------------------
def mismatch_model() -> dsp.CompiledModel:
    """y = a @ b with symbolic dims: shapes that do not chain fail only at run time."""
    g = dsp.GraphBuilder("mismatch")
    a = g.placeholder("a", "float32", ["n", "k"])
    b = g.placeholder("b", "float32", ["m", "j"])
    g.output(g.Relu(g.MatMul(a, b)), "y")
    return dsp.compile(g.build(), mode="slot_by_slot")


def failing_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[KernelError, dict]:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    model = mismatch_model()
    model.run({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 4), np.float32)})
    with pytest.raises(KernelError) as info:
        model.run({"a": np.ones((2, 3), np.float32), "b": np.ones((4, 5), np.float32)})
    (path,) = (tmp_path / "flight").glob("flight-*.json")
    return info.value, json.loads(path.read_text())


def test_flight_recorder_names_its_file_and_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exc, state = failing_step(tmp_path, monkeypatch)
    path = next((tmp_path / "flight").glob("*.json"))
    assert f"[flight recorder: {path}]" in str(exc)
    assert any(str(path) in note for note in exc.__notes__)
    assert isinstance(exc.__cause__, ValueError)  # the kernel's own error stays chained
    assert path.name.endswith(f"-{os.getpid()}.json")
    assert state["error"]["type"] == "KernelError" and 'MatMul node "' in state["error"]["message"]
    (error,) = [e for e in state["events"] if e["code"] == "error"]
    assert error["category"] == "EXECUTE" and "matmul" in error["message"].lower()
    assert error["plan"] >= 1


def test_flight_recorder_with_diagnostics_on_keeps_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    diag.enable("ALL", "full")
    _, state = failing_step(tmp_path, monkeypatch)
    codes = {(e["category"], e["code"]) for e in state["events"]}
    assert {("CACHE", "miss"), ("CACHE", "build"), ("EXECUTE", "step"), ("EXECUTE", "error")} <= codes
    timed = [e for e in state["events"] if e["category"] == "TIMING" and e["slot"] >= 0]
    assert [e["code"] for e in timed].count("MatMul") == 1  # the first step's; the failing one never finished


def test_flight_recorder_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FLIGHT_RECORDER", "0")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelError) as info:
        mismatch_model().run({"a": np.ones((2, 3), np.float32), "b": np.ones((4, 5), np.float32)})
    assert "flight recorder" not in str(info.value) and not (tmp_path / "flight").exists()


# -- timing ------------------------------------------------------------------------------------
def test_timed_code_times_every_slot_and_agrees(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="slot_by_slot")
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    plain = model.run({"x": x})["y"]
    diag.enable_timing()
    assert diag.TIMED and diag.ON
    timed = model.run({"x": x})["y"]
    np.testing.assert_array_equal(plain, timed)
    slots = {e.slot for e in diag.events(Category.TIMING) if e.slot >= 0}
    plan = model.plan()
    assert plan is not None and slots == set(range(len(plan.slots)))
    assert all(e.payload > 0 for e in diag.events(Category.TIMING))
    trace = chrome_trace(diag.events())
    spans = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert {t["cat"] for t in spans if t["args"]["slot"] >= 0} == {"segment 0/slot_by_slot"}


# -- the command line --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x[n, 3] @ w -> Relu -> Tanh (w + 1 is a frozen constant)."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    one = numpy_helper.from_array(np.ones((1,), np.float32), "one")
    nodes = [
        helper.make_node("Add", ["w", "one"], ["w1"]),
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Tanh", ["r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [w, one],
    )
    path = tmp_path_factory.mktemp("m") / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_cli_trace_covers_every_slot(tiny: Path, tmp_path: Path) -> None:
    out = dsp_cli("run", str(tiny), "--random-inputs", "--trace", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert "top ops" in out.stdout and "MatMul" in out.stdout
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys() for e in spans)
    slots = {e["args"]["slot"] for e in spans if e["args"]["slot"] >= 0}
    assert slots == {0, 1, 2, 3}
    assert any(e["name"] == "MatMul node_1" or e["name"].startswith("MatMul ") for e in spans)


def test_cli_config(tiny: Path) -> None:
    out = dsp_cli("config", "--json", env={"DSP_DIAGNOSTICS": "CACHE"})
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["diagnostics"]["value"] == "CACHE" and rows["diagnostics"]["source"] == "environment"
    assert rows["flight_events"]["value"] == 2000 and rows["flight_events"]["source"] == "default"
    text = dsp_cli("config")
    assert "DSP_DIAGNOSTICS_LEVEL" in text.stdout and "off / summary / detailed / full" in text.stdout
    bad = dsp_cli("config", env={"DSP_DIAGNOSTICS_LEVEL": "loud"})
    assert bad.returncode == 2 and "diagnostics_level" in bad.stderr and "summary, detailed, full" in bad.stderr


def test_cli_bad_category_is_a_one_line_error(tiny: Path) -> None:
    out = dsp_cli("run", str(tiny), "--random-inputs", env={"DSP_DIAGNOSTICS": "CACHE,NOPE"})
    assert out.returncode == 2 and "unknown category 'NOPE'" in out.stderr and "Traceback" not in out.stderr


def test_cli_diagnostics_file_written_at_exit(tiny: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump.json"
    env = {"DSP_DIAGNOSTICS": "CACHE,SEGMENT", "DSP_DIAGNOSTICS_FILE": str(dump)}
    out = dsp_cli("run", str(tiny), "--random-inputs", env=env)
    assert out.returncode == 0, out.stderr
    state = json.loads(dump.read_text())
    assert state["levels"] == {"SEGMENT": "SUMMARY", "CACHE": "SUMMARY"}
    assert state["codes"]["CACHE.build"] == 1
    report = dsp_cli("diag", "report", "--json", str(dump))
    assert report.returncode == 0 and json.loads(report.stdout)["cache"]["miss"] == 1


def test_cli_diag_show_and_report_on_a_flight_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing_step(tmp_path, monkeypatch)
    path = next((tmp_path / "flight").glob("*.json"))
    shown = dsp_cli("diag", "show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "error: KernelError: MatMul node" in shown.stdout and "EXECUTE" in shown.stdout
    report = json.loads(dsp_cli("diag", "report", "--json", str(path)).stdout)
    assert report["kind"] == "flight" and report["errors"][0]["count"] == 1
    assert dsp_cli("diag", "report").returncode == 0  # this (fresh) process's state
    bad = dsp_cli("diag", "show", str(tmp_path))
    assert bad.returncode == 2 and "cannot read diagnostics file" in bad.stderr


def test_cli_plan_show_runs_gives_phases_and_counters(tiny: Path) -> None:
    out = dsp_cli("plan", "show", str(tiny), "--runs", "3", "--json")
    assert out.returncode == 0, out.stderr
    life = json.loads(out.stdout)["lifecycle"]
    assert life["phase"] == "REPLAY_BLOCKED" and life["counters"]["executions"] == 3
    assert life["slots"] == ["SEALED", "BUILDING", "BUILDING", "BUILDING"]
    assert life["units"][0]["phase"] == "FAILED" and life["units"][0]["counters"]["eager_runs"] == 1
    text = dsp_cli("plan", "show", str(tiny), "--runs", "3")
    assert "plan phase REPLAY_BLOCKED; 1 of 4 slots sealed" in text.stdout and "sealed" in text.stdout
    plain = json.loads(dsp_cli("plan", "show", str(tiny), "--json").stdout)
    assert "lifecycle" not in plain


def test_cli_plan_dot(tiny: Path) -> None:
    out = dsp_cli("plan", "dot", str(tiny), "--mode", "emulated_replay")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("digraph plan {") and out.stdout.rstrip().endswith("}")
    assert "sealed" in out.stdout and "island 0" in out.stdout
    before = dsp_cli("plan", "dot", str(tiny), "--runs", "1")
    assert "segment 0" in before.stdout  # not frozen yet: the auction's segments
