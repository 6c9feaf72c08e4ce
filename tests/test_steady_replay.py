"""The steady replay and the repeat path: DSP's short per-call path once a plan replays.

A frozen plan whose units all replay, fed placeholders only, runs each step as: copy the
feeds into their staging buffers, one integer test for replaced constants, each unit's
runtime call, copies of the outputs (``PlanRuntime._steady_step``); a call with the
previous call's feed names, shapes and dtypes skips the feed checks it passed then
(the repeat path, ``model._repeat``) and, once the plan has its steady program, is that
program's own run step (``PlanRuntime.run_step``). These tests hold these paths to the full one: the same
outputs, bit for bit; new bindings for new shapes; and every error a bad feed or a
replaced weight gets on the full path.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import PlacingEmulated, mlp_reference
from dsp_cpu_ref.plugin import SlotBySlotBackend

import dsp_core as dsp
from dsp_core.backends.base import Registry
from dsp_core.backends.modes import GraphExecutionMode as M
from dsp_core.errors import DSPError, InputError
from dsp_core.plan.plan import ConstantTable
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.model import CompiledModel
from dsp_core.runtime.plan_runtime import PlanRuntime

# The two CPU runtimes (a runtime call bound once), and cpu_ref's capture (replay by the core).
MODES = ("onnxruntime", "openvino", "emulated_replay")
RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def runtime_of(model: dsp.CompiledModel) -> PlanRuntime:
    assert model.last_live is not None
    runtime = model.last_live.runtime
    assert isinstance(runtime, PlanRuntime)
    return runtime


def until_steady(model: dsp.CompiledModel, feeds: dict[str, np.ndarray], limit: int = 12) -> PlanRuntime:
    """Run ``feeds`` until the live plan takes the steady path; fail if it never does."""
    for _ in range(limit):
        model.run(feeds)
        runtime = runtime_of(model)
        if runtime._steady is not None:
            return runtime
    raise AssertionError(f"no steady path after {limit} calls: phase {runtime_of(model).phase.name}")


def x_of(batch: int) -> np.ndarray:
    return RNG.standard_normal((batch, 8)).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_every_phase_gives_the_same_outputs_bit_for_bit(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    outs = [model.run({"x": x})["y"] for _ in range(3)]  # slot by slot, freezing, capturing
    runtime = until_steady(model, {"x": x})
    outs += [model.run({"x": x})["y"] for _ in range(3)]
    assert runtime._steady is not None and runtime.phase is PlanPhase.REPLAYING
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_the_steady_path_reads_every_call_s_feeds(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(3)
    until_steady(model, {"x": x})
    replays = sum(u.counters.replays for u in runtime_of(model).units)
    for step in range(6):
        if step % 3 == 0:
            feed = x_of(3)  # a new array
        elif step % 3 == 1:
            x[...] = x_of(3)  # the same array, written in place
            feed = x
        else:
            feed = x_of(6)[::2]  # a strided view: not contiguous
        got = model.run({"x": feed})["y"]
        np.testing.assert_allclose(got, mlp_reference(mlp_graph, feed), rtol=1e-4, atol=1e-5)
    runtime = runtime_of(model)
    assert runtime._steady is not None
    assert sum(u.counters.replays for u in runtime.units) == replays + 6 * len(runtime.units)


@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_the_caller_s_own(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    until_steady(model, {"x": x})
    first = model.run({"x": x})["y"]
    kept = first.copy()
    first[...] = 1e9  # the caller writes into what it got
    second = model.run({"x": x})["y"]
    assert second is not first and np.array_equal(second, kept)


@pytest.mark.parametrize("mode", ("onnxruntime", "openvino"))
def test_a_runtime_replay_is_its_bound_call(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    runtime = until_steady(model, {"x": x_of(2)})
    steady = runtime._steady
    assert steady is not None
    ((unit, call),) = steady.units
    assert isinstance(call, functools.partial) and call is unit.compiled._bound
    # the bound inputs are the staging buffers: a feed is copied in, never re-bound
    assert unit.compiled._bound_inputs[0] is steady.buffers[0][0]


@pytest.mark.parametrize("mode", ("onnxruntime", "openvino"))
def test_a_new_batch_gets_its_own_binding_and_the_old_one_is_kept(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    small = until_steady(model, {"x": x_of(2)})
    x5 = x_of(5)
    big = until_steady(model, {"x": x5})
    assert big is not small
    (unit,) = big.units
    assert unit.compiled._bound_inputs[0].shape == (5, 8)
    np.testing.assert_allclose(model.run({"x": x5})["y"], mlp_reference(mlp_graph, x5), rtol=1e-4, atol=1e-5)
    builds = model.stats.plan_builds
    for batch in (2, 5, 2):
        x = x_of(batch)
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
        assert runtime_of(model) is (small if batch == 2 else big)
    assert model.stats.plan_builds == builds  # cache hits: no new plan, no new binding
    assert small._steady is not None and big._steady is not None


BAD_FEEDS = [
    ({"x": np.zeros((2, 8), np.float64)}, "dtype float64 given, model expects float32"),
    ({"x": np.zeros((2, 8, 1), np.float32)}, "has rank 3, model expects rank 2"),
    ({"x": np.zeros((2, 7), np.float32)}, "dimension 1 is 7, model expects 8"),
    ({}, "missing input 'x'"),
    ({"x": np.zeros((2, 8), np.float32), "z": np.zeros(1)}, "unknown input 'z'"),
    ([np.zeros((2, 8), np.float32)], "feeds must be a dict"),
]


@pytest.mark.parametrize("mode", MODES)
def test_a_bad_feed_is_still_a_clear_error_once_steady(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    runtime = until_steady(model, {"x": x})
    for feeds, message in BAD_FEEDS:
        with pytest.raises(InputError, match=message):
            model.run(feeds)  # type: ignore[arg-type]
        # the error left nothing behind: the next good call is right, on the steady path
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
        assert runtime_of(model) is runtime and runtime._steady is not None


@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_constant_is_rejected_on_the_steady_path_and_a_restored_one_runs(
    mode: str, mlp_graph: dsp.Graph
) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    runtime = until_steady(model, {"x": x})
    plan = model.plan()
    assert plan is not None
    k = next(k for k in plan.constants if plan.externals[k].name == "w2")
    original = plan.constants[k]
    plan.constants[k] = original * 2
    with pytest.raises(DSPError, match="constant 'w2' was replaced after the plan froze"):
        model.run({"x": x})
    plan.constants[k] = original  # the very array the plan froze with: nothing to reject
    np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    until_steady(model, {"x": x})
    assert runtime._steady is not None


def test_the_constants_table_counts_every_change() -> None:
    table = ConstantTable({0: np.zeros(1)})
    a = np.ones(1)
    changes = [
        lambda t: t.__setitem__(1, a),
        lambda t: t.update({2: a}),
        lambda t: t.setdefault(3, a),
        lambda t: t.pop(3),
        lambda t: t.__delitem__(2),
        lambda t: t.__ior__({4: a}),
        lambda t: t.popitem(),
        lambda t: t.clear(),
    ]
    for change in changes:
        before = table.version
        change(table)
        assert table.version == before + 1
    before = table.version
    table.get(0), 0 in table, list(table.items()), len(table)  # reads change nothing
    assert table.version == before


def test_a_compiled_plan_holds_a_counting_table(mlp_graph: dsp.Graph) -> None:
    plan = dsp.compile(mlp_graph, mode="slot_by_slot").plan()
    assert plan is not None and isinstance(plan.constants, ConstantTable)


def test_the_repeat_path_keeps_the_plan_cache_s_counters(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    x = x_of(2)
    until_steady(model, {"x": x})
    live = model.last_live
    assert live is not None
    hits, runs = model.stats.memory_hits, live.runs
    for _ in range(5):
        model.run({"x": x})
    assert model.stats.memory_hits == hits + 5 and live.runs == runs + 5 and live.pins == 0


def fault_graph() -> dsp.Graph:
    """x -> Add -> Relu -> Add: every slot one the capturing test fault backend takes (no renaming Identity)."""
    g = dsp.GraphBuilder("add_relu")
    x = g.placeholder("x", "float32", [2, 8])
    c = g.constant(np.full((2, 8), 0.5, np.float32), name="c")
    g.output(g.Relu(x + c) + c)
    return g.build()


@pytest.fixture
def replay_fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """test_fault_capture's replay raises once 8 replays went well (the plan is steady by then)."""
    from dsp_test_backends.faults import Strikes

    from dsp_core.backends.discovery import discover

    monkeypatch.setenv("DSP_TEST_FAULT", "replay_raises")
    monkeypatch.setenv("DSP_TEST_FAULT_AFTER", "8")
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    Strikes.calls = 0
    discover(refresh=True)
    yield
    monkeypatch.delenv("DSP_TEST_FAULT")
    discover(refresh=True)


def test_a_unit_that_fails_on_the_steady_path_goes_to_the_reference(replay_fault: None) -> None:
    from dsp_test_backends.faults import Strikes

    model = dsp.compile(fault_graph())
    assert model.resolved_backends() == ["test_fault_capture"]
    (y,) = model.output_names
    x = x_of(2)
    want = np.maximum(x + 0.5, 0) + 0.5
    runtime = until_steady(model, {"x": x})
    assert Strikes.calls <= 8  # the fault has not struck yet: the steady path meets it
    for _ in range(12):
        np.testing.assert_allclose(model.run({"x": x})[y], want, rtol=1e-6)
    (unit,) = runtime.units
    assert unit.phase is SegmentPhase.FAILED and unit.backend.name == "slot_by_slot"
    assert "test_fault_capture failed" in unit.reason


@pytest.mark.parametrize("mode", ("onnxruntime", "emulated_replay"))
def test_diagnostics_switched_on_take_the_full_path_and_off_the_steady_one(mode: str, mlp_graph: dsp.Graph) -> None:
    from dsp_core import diag

    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    runtime = until_steady(model, {"x": x})
    want = model.run({"x": x})["y"]
    copies = runtime.staging.copies
    diag.enable("EXECUTE", "detailed")
    try:
        diag.clear()
        assert np.array_equal(model.run({"x": x})["y"], want)
        steps = [e for e in diag.events() if e.code == "step" and e.plan == runtime.diag_id]
        assert len(steps) == 1  # the full path: it reports the step
    finally:
        diag.disable()
    assert runtime._steady is not None and np.array_equal(model.run({"x": x})["y"], want)
    assert runtime.staging.copies == copies + 2


def test_feeds_a_backend_stages_on_its_device_take_the_steady_path_through_its_fill(mlp_graph: dsp.Graph) -> None:
    placing = PlacingEmulated()
    model = CompiledModel(mlp_graph, M.EMULATED_REPLAY, registry=Registry(backends=[placing, SlotBySlotBackend()]))
    runtime = until_steady(model, {"x": x_of(2)})
    steady = runtime._steady
    assert steady is not None
    ((buf, fill),) = steady.buffers
    assert any(buf is made for made in placing.made)  # the backend's own buffer, filled by the backend
    assert fill == placing.stage_into
    fills = placing.fills
    for _ in range(4):
        x = x_of(2)
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert runtime._steady is steady and placing.fills == fills + 4


@pytest.mark.parametrize("mode", MODES)
def test_a_variable_fed_as_the_same_array_takes_the_steady_path(mode: str, mlp_graph: dsp.Graph) -> None:
    """A decode step's KV buffers are variables, read in place and fed as the same arrays every
    step: the steady program reads them where they are (their contents written in place between
    steps are what it reads); another array for the variable takes the full path once, which
    meets the new address, and the plan settles again."""
    model = dsp.compile(mlp_graph, mode=mode)
    model.mark_variable(["x"])
    x = x_of(3)
    runtime = until_steady(model, {"x": x})
    replays = sum(u.counters.replays for u in runtime.units)
    for _ in range(3):
        x[...] = x_of(3)  # the same array, new contents
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
        assert runtime._steady is not None
    assert sum(u.counters.replays for u in runtime.units) == replays + 3 * len(runtime.units)
    other = x_of(3)  # another array: its address is checked on the full path
    np.testing.assert_allclose(model.run({"x": other})["y"], mlp_reference(mlp_graph, other), rtol=1e-4, atol=1e-5)
    for _ in range(4):
        other[...] = x_of(3)
        np.testing.assert_allclose(model.run({"x": other})["y"], mlp_reference(mlp_graph, other), rtol=1e-4, atol=1e-5)
    assert runtime._steady is not None  # settled again on the new array


@pytest.mark.parametrize("mode", MODES)
def test_a_stepper_steps_on_the_same_arrays_and_hands_out_the_plans_buffers(mode: str, mlp_graph: dsp.Graph) -> None:
    """``model.stepper`` (GenerationPipeline's decode loop): the first step is a ``run``; later ones
    skip the feed checks, keep the live plan pinned, and on the steady path return the plan's own
    output buffers (read before the next step); ``close`` unpins. Every step is right."""
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(3)
    feeds = {"x": x}
    outs = []
    with model.stepper(feeds) as stepper:
        for _ in range(10):
            x[...] = x_of(3)  # the same array, new contents
            out = stepper.step()
            np.testing.assert_allclose(out["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
            outs.append(out["y"])
        live = model.last_live
        assert live is not None and live.pins == 1  # pinned by the stepper alone between steps
        assert runtime_of(model)._steady is not None
        assert outs[-1] is outs[-2]  # the steady program's buffer, not a copy
    assert live.pins == 0
    assert model.run(feeds)["y"] is not outs[-1]  # run() still hands out copies


def two_in_two_out() -> dsp.Graph:
    """a[batch, 8], b[batch, 8] -> (relu(a + b) @ w, a * b): two feeds and two outputs (the run step's loops)."""
    g = dsp.GraphBuilder("two_two")
    a = g.placeholder("a", "float32", ["batch", 8])
    b = g.placeholder("b", "float32", ["batch", 8])
    w = g.constant(np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32), name="w")
    g.output(g.MatMul(g.Relu(a + b), w), "y")
    g.output(a * b, "z")
    return g.build()


def _no_execute(runtime: PlanRuntime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``runtime.execute`` count its calls: the run step does not go through it."""
    calls: list[int] = []
    execute = runtime.execute

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return execute(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime, "execute", counted)
    return calls


@pytest.mark.parametrize("mode", MODES)
def test_a_steady_plan_s_run_is_its_run_step_with_the_full_path_s_results_and_counters(
    mode: str, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the plan replays its steady program, ``model.run`` with the previous call's feed shapes is
    the program's own step (``PlanRuntime.run_step``), not ``execute``: the same outputs as the
    reference, the caller's own copies, and the counters the full path keeps (cache hits and runs,
    replays, executions, staging copies)."""
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(3)
    runtime = until_steady(model, {"x": x})
    model.run({"x": x})  # the call that makes the step
    calls = _no_execute(runtime, monkeypatch)
    live = model.last_live
    assert live is not None
    hits, runs, executions, copies = model.stats.memory_hits, live.runs, runtime.executions, runtime.staging.copies
    replays = sum(u.counters.replays for u in runtime.units)
    got = []
    for _ in range(5):
        feed = x_of(3)
        out = model.run({"x": feed})["y"]
        np.testing.assert_allclose(out, mlp_reference(mlp_graph, feed), rtol=1e-4, atol=1e-5)
        got.append(out)
    assert calls == []  # every call took the run step
    assert len({id(o) for o in got}) == 5 and not any(np.shares_memory(o, got[-1]) for o in got[:-1])
    assert model.stats.memory_hits == hits + 5 and live.runs == runs + 5 and live.pins == 0
    assert runtime.executions == executions + 5 and runtime.staging.copies == copies + 5
    assert sum(u.counters.replays for u in runtime.units) == replays + 5 * len(runtime.units)
    from dsp_core import diag

    diag.enable("EXECUTE", "detailed")  # an epoch: the step made before it takes execute's full path
    try:
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    finally:
        diag.disable()
    model.run({"x": x})  # execute again, once: the step is made anew for the new epoch
    calls.clear()
    for _ in range(3):
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert calls == []  # the run step again
    assert model.run({"x": x_of(4)})["y"].shape == (4, 4)  # another shape: the full path, a new plan


@pytest.mark.parametrize("mode", ("onnxruntime", "openvino"))
def test_the_run_step_of_several_feeds_and_outputs(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = two_in_two_out()
    w = graph.initializers["w"]
    model = dsp.compile(graph, mode=mode)
    rng = np.random.default_rng(11)
    a, b = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
    runtime = until_steady(model, {"a": a, "b": b})
    model.run({"a": a, "b": b})
    calls = _no_execute(runtime, monkeypatch)
    for _ in range(4):
        a, b = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
        out = model.run({"b": b, "a": a})  # another order of the same names
        np.testing.assert_allclose(out["y"], np.maximum(a + b, 0) @ w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["z"], a * b, rtol=1e-6)
    assert calls == []
    with pytest.raises(InputError):  # a missing feed is still the full path's clear error
        model.run({"a": a})
    with pytest.raises(InputError):
        model.run({"a": a, "b": b.astype(np.float64)})


def test_threads_running_one_model_each_get_their_own_step(mlp_graph: dsp.Graph) -> None:
    """Three threads calling the same steady model (the run step copies feeds in and outputs out under
    the runtime's lock) each get the outputs of their own feeds."""
    import threading

    model = dsp.compile(mlp_graph, mode="onnxruntime")
    until_steady(model, {"x": x_of(2)})
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            x = rng.standard_normal((2, 8)).astype(np.float32)
            y = model.run({"x": x})["y"]
            if not np.allclose(y, mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5):
                errors.append(f"thread {seed}: wrong outputs")
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2, 3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: steps interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
