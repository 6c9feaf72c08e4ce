"""Plugin fault isolation (issue 12, item 13): a faulty backend declines or fails, never takes DSP down.

The faulty backends are real entry points of tests/dists/dsp_test_backends (``faults``,
``fault_import``), inert unless DSP_TEST_FAULT selects a fault. Faults that are safe in
this process (a raise, a SystemExit, a wrong output) run here with discovery refreshed;
imports and probes that hang, and the CLI, run in a subprocess with a timeout, so a hang
fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import mlp_reference, run_cli

import dsp_core as dsp
from dsp_core.backends.base import Registry
from dsp_core.backends.discovery import discover
from dsp_core.errors import BackendError
from dsp_core.runtime.lifecycle import SegmentPhase

Select = Callable[..., Registry]
X = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)


@pytest.fixture
def select_fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Select]:
    """Select a fault (and after how many good calls it strikes); discovery is refreshed both ways."""
    from dsp_test_backends.faults import Strikes

    def select(name: str, after: int = 0) -> Registry:
        monkeypatch.setenv("DSP_TEST_FAULT", name)
        monkeypatch.setenv("DSP_TEST_FAULT_AFTER", str(after))
        monkeypatch.setenv("DSP_DISK_CACHE", "0")
        Strikes.calls = 0
        return discover(refresh=True)

    yield select
    monkeypatch.delenv("DSP_TEST_FAULT", raising=False)
    discover(refresh=True)


@pytest.fixture
def eltwise_graph() -> dsp.Graph:
    """x[batch, 8] -> Add -> Relu -> y: every slot is one the fault backends take (strict mode)."""
    g = dsp.GraphBuilder("eltwise")
    x = g.placeholder("x", "float32", ["batch", 8])
    y = g.Relu(x + g.constant(np.full(8, 0.5, np.float32), name="c"))
    g.output(y)  # no name: no Identity (which the fault backends do not take)
    return g.build()


def _faults(model: dsp.CompiledModel) -> list[dict]:
    return model.explain()["faults"]


def test_control_the_fault_backends_win_the_auction(select_fault: Select, mlp_graph: dsp.Graph) -> None:
    select_fault("none")
    model = dsp.compile(mlp_graph)
    assert "test_fault" in model.resolved_backends()  # so every fault below really runs
    np.testing.assert_allclose(model.run({"x": X})["y"], mlp_reference(mlp_graph, X), rtol=1e-5)
    assert _faults(model) == []


def test_inert_without_a_selected_fault(mlp_graph: dsp.Graph) -> None:
    reg = discover(refresh=True)
    assert {"test_fault", "test_fault_capture"} <= {b.name for b in reg.backends}
    assert dsp.compile(mlp_graph).resolved_backends() == ["slot_by_slot"]


@pytest.mark.parametrize("fault", ["supports_raises", "supports_systemexit"])
def test_supports_that_raises_is_a_recorded_decline(select_fault: Select, mlp_graph: dsp.Graph, fault: str) -> None:
    select_fault(fault)
    model = dsp.compile(mlp_graph)
    assert model.resolved_backends() == ["slot_by_slot"]
    declines = [d for s in model.explain()["segments"] for d in s["declines"] if d["backend"] == "test_fault"]
    faulty = [d for d in declines if d["reason"] == "backend_fault"]
    assert faulty and ("ValueError" in faulty[0]["detail"] or "SystemExit" in faulty[0]["detail"])
    np.testing.assert_allclose(model.run({"x": X})["y"], mlp_reference(mlp_graph, X), rtol=1e-5)


def test_supports_that_raises_fails_strict(select_fault: Select, eltwise_graph: dsp.Graph) -> None:
    select_fault("supports_raises")
    with pytest.raises(BackendError, match="test_fault.*ValueError.*strict"):
        dsp.compile(eltwise_graph, strict=True, mode="arm_hybrid")


@pytest.mark.parametrize(("fault", "stage", "cause"), [
    ("cost_raises", "cost", "RuntimeError"),
    ("cost_nan", "cost", "nan"),
    ("compile_raises", "compile", "RuntimeError"),
    ("compile_systemexit", "compile", "SystemExit"),
])  # fmt: skip
def test_cost_or_compile_that_fails_falls_to_the_next_backend(
    select_fault: Select, mlp_graph: dsp.Graph, fault: str, stage: str, cause: str
) -> None:
    select_fault(fault)
    model = dsp.compile(mlp_graph)
    assert model.resolved_backends() == ["slot_by_slot"]
    (record,) = _faults(model)
    assert (record["backend"], record["stage"], record["fallback"]) == ("test_fault", stage, "slot_by_slot")
    assert cause in record["reason"]
    segment_faults = [f for s in model.explain()["segments"] for f in s["faults"]]
    assert segment_faults == [record]
    np.testing.assert_allclose(model.run({"x": X})["y"], mlp_reference(mlp_graph, X), rtol=1e-5)


@pytest.mark.parametrize("fault", ["cost_raises", "compile_raises", "compile_systemexit"])
def test_cost_or_compile_that_fails_raises_in_strict_mode(
    select_fault: Select, eltwise_graph: dsp.Graph, fault: str
) -> None:
    select_fault(fault)
    with pytest.raises(BackendError, match="test_fault failed to (bid|compile)"):
        dsp.compile(eltwise_graph, strict=True, mode="arm_hybrid")


@pytest.mark.parametrize(("fault", "after"), [
    ("run_valueerror", 0),  # the first run, before freezing
    ("run_systemexit", 0),
    ("run_valueerror", 4),  # a frozen plan whose eager unit already ran
    ("run_systemexit", 4),
])  # fmt: skip
def test_run_that_raises_fails_the_segment_and_the_call_is_right(
    select_fault: Select, mlp_graph: dsp.Graph, fault: str, after: int
) -> None:
    select_fault(fault, after)
    model = dsp.compile(mlp_graph)
    assert "test_fault" in model.resolved_backends()
    for _ in range(7):
        np.testing.assert_allclose(model.run({"x": X})["y"], mlp_reference(mlp_graph, X), rtol=1e-5)
    assert model.resolved_backends() == ["slot_by_slot"]
    records = [f for f in _faults(model) if f["backend"] == "test_fault"]
    assert records and records[0]["fallback"] == "slot_by_slot"
    assert ("ValueError" if "valueerror" in fault else "SystemExit") in records[0]["reason"]
    if after:
        units = model.last_live.runtime.units
        failed = [u for u in units if "test_fault failed" in u.reason]
        assert failed and all(u.phase is SegmentPhase.FAILED and u.backend.name == "slot_by_slot" for u in failed)
    x4 = np.ones((4, 8), np.float32)  # a new live plan starts on the reference
    np.testing.assert_allclose(model.run({"x": x4})["y"], mlp_reference(mlp_graph, x4), rtol=1e-5)


def test_run_that_raises_fails_strict(select_fault: Select, eltwise_graph: dsp.Graph) -> None:
    select_fault("run_valueerror")
    model = dsp.compile(eltwise_graph, strict=True, mode="arm_hybrid")
    with pytest.raises(BackendError, match="test_fault failed run.*ValueError.*strict"):
        model.run({"x": X})


@pytest.mark.parametrize(("fault", "after", "expected"), [
    ("wrong_shape", 0, "expected shape [batch, 16] with {'batch': 2}, got shape (2, 15)"),
    ("wrong_dtype", 0, "expected dtype float32, got dtype float64"),
    ("wrong_shape", 2, "got shape (2, 15)"),  # first run after freezing: a frozen unit is checked too
    ("wrong_dtype", 2, "got dtype float64"),
])  # fmt: skip
def test_wrong_output_is_the_backend_failing(
    select_fault: Select, mlp_graph: dsp.Graph, fault: str, after: int, expected: str
) -> None:
    select_fault(fault, after)
    model = dsp.compile(mlp_graph)
    for _ in range(5):
        y = model.run({"x": X})["y"]
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, mlp_reference(mlp_graph, X), rtol=1e-5)
    (record,) = _faults(model)
    assert record["backend"] == "test_fault" and record["fallback"] == "slot_by_slot"
    assert "Relu node" in record["reason"] and expected in record["reason"], record["reason"]


CAPTURE_FAULTS = ["warm_raises", "prepare_raises", "capture_raises", "replay_raises", "replay_systemexit"]


@pytest.mark.parametrize("fault", CAPTURE_FAULTS)
def test_capture_lifecycle_call_that_raises_fails_the_island(
    select_fault: Select, mlp_graph: dsp.Graph, fault: str
) -> None:
    select_fault(fault)
    model = dsp.compile(mlp_graph)
    assert "test_fault_capture" in model.resolved_backends()
    for _ in range(8):
        np.testing.assert_allclose(model.run({"x": X})["y"], mlp_reference(mlp_graph, X), rtol=1e-5)
    islands = [u for u in model.last_live.runtime.units if "test_fault_capture failed" in u.reason]
    assert islands and islands[0].phase is SegmentPhase.FAILED and islands[0].backend.name == "slot_by_slot"
    assert any(f["backend"] == "test_fault_capture" for f in _faults(model))


def test_release_that_raises_is_logged_not_raised(select_fault: Select, mlp_graph: dsp.Graph) -> None:
    select_fault("release_raises")
    model = dsp.compile(mlp_graph)
    for _ in range(4):
        model.run({"x": X})
    runtime = model.last_live.runtime
    assert any(u.backend.name == "test_fault" for u in runtime.units)
    runtime.release()  # the plan left the cache
    model.mark_variable(["x"])  # demotes every live plan: releases their units


def test_probe_that_raises_systemexit_is_unavailable(select_fault: Select, mlp_graph: dsp.Graph) -> None:
    reg = select_fault("availability_systemexit")
    probe = next(b for b in reg.backends if b.name == "test_fault").availability()
    assert not probe.ok and "SystemExit" in probe.reason
    assert dsp.compile(mlp_graph).resolved_backends() == ["slot_by_slot"]


def test_hook_that_raises_systemexit_is_a_load_failure(select_fault: Select) -> None:
    reg = select_fault("hook_systemexit")
    (failure,) = [f for f in reg.failures if f.entry_point == "test_faults"]
    assert failure.stage == "hook" and "SystemExit" in failure.error
    assert "slot_by_slot" in {b.name for b in reg.backends}


@pytest.mark.parametrize(("fault", "name", "reason"), [
    ("no_contract", "test_no_contract", "declares no ModeContract"),
    ("string_mode", "test_string_mode", "not a GraphExecutionMode"),
    ("bool_supports", "test_bool_supports", "_supports returned bool"),
    ("duplicate_name", "slot_by_slot", "already registered by dsp-cpu-ref"),
])  # fmt: skip
def test_malformed_backend_is_rejected_at_discovery(select_fault: Select, fault: str, name: str, reason: str) -> None:
    reg = select_fault(fault)
    (failure,) = [f for f in reg.failures if f.entry_point == f"test_faults:{name}"]
    assert failure.stage == "backend" and reason in failure.error, failure.error
    mine = [b for b in reg.backends if b.name == name]
    assert all(b.distribution != "dsp-test-backends" for b in mine)  # the malformed one is not there
    assert [b.distribution for b in reg.backends if b.name == "slot_by_slot"] == ["dsp-cpu-ref"]


# -- in a subprocess: SystemExit at import, and hangs -------------------------------------
def _fault_env(fault: str) -> dict[str, str]:
    return {"DSP_TEST_FAULT": fault, "DSP_PLUGIN_TIMEOUT": "1", "DSP_DISK_CACHE": "0"}


@pytest.mark.parametrize(("fault", "said"), [
    ("import_systemexit", "SystemExit"),
    ("import_hang", "did not answer within 1 s"),
    ("hook_hang", "did not answer within 1 s"),
])  # fmt: skip
def test_backends_list_survives_a_plugin_that_exits_or_hangs(fault: str, said: str) -> None:
    done = run_cli("backends", "list", "--json", env=_fault_env(fault))
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)
    assert "slot_by_slot" in {r["name"] for r in table["backends"]}
    entry = "test_fault_import" if fault.startswith("import") else "test_faults"
    (failure,) = [f for f in table["failures"] if f["entry_point"] == entry]
    assert said in failure["error"]
    text = run_cli("backends", "list", env=_fault_env(fault))
    assert text.returncode == 0 and f"failed plugin {entry}" in text.stdout and "slot_by_slot" in text.stdout


def test_backends_list_shows_a_rejected_backend() -> None:
    done = run_cli("backends", "list", env=_fault_env("string_mode"))
    assert done.returncode == 0, done.stderr
    assert "test_faults:test_string_mode" in done.stdout and "not a GraphExecutionMode" in done.stdout


SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, dsp_core as dsp
    from dsp_core.backends.discovery import discover
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2, 3])
    g.output(g.Relu(x + 1.0), "y")
    model = dsp.compile(g.build())
    xs = np.arange(6, dtype=np.float32).reshape(2, 3) - 3
    y = model.run({"x": xs})["y"]
    probe = next(b for b in discover().backends if b.name == "test_fault").availability()
    print(json.dumps({"ok": bool(np.array_equal(y, np.maximum(xs + 1, 0))), "reason": probe.reason,
                      "backends": model.resolved_backends()}))
    """
)


@pytest.mark.parametrize("fault", ["availability_hang", "import_hang"])
def test_compile_and_run_survive_a_hanging_probe_or_import(fault: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **_fault_env(fault)},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["backends"] == ["slot_by_slot"]
    if fault == "availability_hang":
        assert "did not answer within 1 s" in result["reason"]
