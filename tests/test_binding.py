"""IO binding (``CompiledModel.bind``): the plan's own buffers in and out, no copies.

A binding's inputs are the live plan's staging buffers and its ``run`` replays the steady
program on them, returning the replay buffers. These tests hold it to ``model.run``: the
same outputs for every new value written in; no staging copy and no output copy on the
bound path; and the full path (owned copies, still correct) whenever the steady program is
not there: a plan that never replays whole, an evicted plan, diagnostics on, a replaced
weight.
"""

from __future__ import annotations

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
from dsp_core.runtime.model import CompiledModel
from dsp_core.runtime.plan_runtime import PlanRuntime

MODES = ("onnxruntime", "openvino", "emulated_replay", "numpy_replay")
RNG = np.random.default_rng(11)


@pytest.fixture(autouse=True)
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def x_of(batch: int) -> np.ndarray:
    return RNG.standard_normal((batch, 8)).astype(np.float32)


def runtime_of(model: dsp.CompiledModel) -> PlanRuntime:
    assert model.last_live is not None and isinstance(model.last_live.runtime, PlanRuntime)
    return model.last_live.runtime


@pytest.mark.parametrize("mode", MODES)
def test_a_bound_step_reads_what_was_written_into_its_inputs(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    binding = model.bind({"x": x_of(3)})
    assert binding.bound
    runtime = runtime_of(model)
    steady = runtime._steady
    assert steady is not None
    assert binding.inputs["x"] is steady.buffers[0][0]  # the staging buffer itself
    copies, replays = runtime.staging.copies, sum(u.counters.replays for u in runtime.units)
    for _ in range(5):
        x = x_of(3)
        binding.inputs["x"][...] = x
        got = binding.run()["y"]
        np.testing.assert_allclose(got, mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert runtime.staging.copies == copies  # nothing copied in
    assert sum(u.counters.replays for u in runtime.units) == replays + 5 * len(runtime.units)
    assert runtime._steady is steady


@pytest.mark.parametrize("mode", MODES)
def test_a_bound_step_returns_the_plan_s_buffers_and_run_still_returns_copies(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    x = x_of(2)
    binding = model.bind({"x": x})
    first = binding.run()["y"]
    kept = first.copy()
    x2 = x_of(2)
    binding.inputs["x"][...] = x2
    second = binding.run()["y"]
    assert second is first  # the replay buffer, overwritten in place by the next step
    np.testing.assert_allclose(second, mlp_reference(mlp_graph, x2), rtol=1e-4, atol=1e-5)
    assert not np.array_equal(kept, second)
    owned = model.run({"x": x})["y"]  # the plain call on the same plan: the caller's own copy
    assert owned is not second
    np.testing.assert_allclose(owned, mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)


def test_a_plan_that_does_not_replay_whole_binds_to_copies_and_stays_correct(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="slot_by_slot")
    x = x_of(2)
    binding = model.bind({"x": x})
    assert not binding.bound and binding.inputs["x"] is not x
    for _ in range(3):
        x = x_of(2)
        binding.inputs["x"][...] = x
        np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ("onnxruntime", "emulated_replay", "numpy_replay"))
def test_a_bound_binding_pins_its_plan_until_closed(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    binding = model.bind({"x": x_of(4)})
    assert binding.bound
    model.cache.clear()  # drops what is not pinned: the binding's plan stays, and stays bound
    assert binding.bound and len(model.cache) == 1
    x = x_of(4)
    binding.inputs["x"][...] = x
    np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    binding.close()
    binding.close()  # twice is harmless
    assert not binding.bound
    model.cache.clear()
    assert len(model.cache) == 0


def test_a_dropped_binding_unpins_its_plan(mlp_graph: dsp.Graph) -> None:
    import gc

    model = dsp.compile(mlp_graph, mode="numpy_replay")
    binding = model.bind({"x": x_of(2)})
    live = model.last_live
    assert live is not None and live.pins == 1
    del binding
    gc.collect()
    assert live.pins == 0


@pytest.mark.parametrize("mode", ("onnxruntime", "emulated_replay", "numpy_replay"))
def test_an_evicted_plan_is_rebuilt_from_the_binding_s_inputs(mode: str, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=mode)
    binding = model.bind({"x": x_of(4)})
    builds = model.stats.plan_builds
    binding.close()  # unpinned: eviction may take the plan
    model.cache.clear()
    for _ in range(6):  # the full path while the new plan freezes and captures
        x = x_of(4)
        binding.inputs["x"][...] = x
        np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert model.stats.plan_builds == builds + 1


def test_diagnostics_on_take_the_full_path(mlp_graph: dsp.Graph) -> None:
    from dsp_core import diag

    model = dsp.compile(mlp_graph, mode="onnxruntime")
    binding = model.bind({"x": x_of(2)})
    runtime = runtime_of(model)
    buffer = binding.run()["y"]  # bound: the plan's own output buffer
    copies = runtime.staging.copies
    x = x_of(2)
    binding.inputs["x"][...] = x
    diag.enable("EXECUTE", "detailed")
    try:
        got = binding.run()["y"]
        assert got is not buffer  # the full path's owned copy: the step made before diagnostics stood aside
    finally:
        diag.disable()
    np.testing.assert_allclose(got, mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert runtime.staging.copies == copies  # the full path too skips a feed that is its buffer
    assert binding.bound  # bound again once diagnostics are off
    assert binding.run()["y"] is binding.run()["y"]  # the plan's own buffer, not copies


def test_a_replaced_weight_is_still_refused_through_a_binding(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    binding = model.bind({"x": x_of(2)})
    plan = model.plan()
    assert plan is not None
    key = next(k for k in plan.constants if plan.externals[k].name == "w2")
    original = plan.constants[key]
    plan.constants[key] = original * 2
    with pytest.raises(DSPError, match="constant 'w2' was replaced after the plan froze"):
        binding.run()
    plan.constants[key] = original  # the very array the plan froze with
    x = x_of(2)
    binding.inputs["x"][...] = x
    np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)


def test_a_replaced_constants_table_is_refused_through_a_binding(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    binding = model.bind({"x": x_of(2)})
    plan = model.plan()
    assert plan is not None and binding.bound
    key = next(k for k in plan.constants if plan.externals[k].name == "w2")
    table = plan.constants
    plan.constants = ConstantTable({**table, key: table[key] * 2})  # the whole table, not an entry
    with pytest.raises(DSPError, match="constant 'w2' was replaced after the plan froze"):
        binding.run()


def test_an_event_elsewhere_costs_a_binding_one_full_path(mlp_graph: dsp.Graph) -> None:
    """A bound step checks a process-wide count of invalidating events (dsp_core.runtime.epoch):
    a weight replaced in another model sends this binding down the full path once (owned copies,
    correct), and it is bound again after."""
    model, other = dsp.compile(mlp_graph, mode="onnxruntime"), dsp.compile(mlp_graph, mode="slot_by_slot")
    other.run({"x": x_of(2)})
    binding = model.bind({"x": x_of(2)})
    buffer = binding.run()["y"]
    assert binding.run()["y"] is buffer  # bound: the plan's own buffer, step after step
    plan = other.plan()
    assert plan is not None
    key = next(iter(plan.constants))
    plan.constants[key] = plan.constants[key]  # a change to the other plan's table (the same array)
    x = x_of(2)
    binding.inputs["x"][...] = x
    first = binding.run()["y"]
    assert first is not buffer  # the full path's owned copy
    np.testing.assert_allclose(first, mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert binding.bound
    assert binding.run()["y"] is buffer  # bound again


def test_a_device_staged_input_is_bound_without_its_fill(mlp_graph: dsp.Graph) -> None:
    placing = PlacingEmulated()
    model = CompiledModel(mlp_graph, M.EMULATED_REPLAY, registry=Registry(backends=[placing, SlotBySlotBackend()]))
    binding = model.bind({"x": x_of(2)})
    assert binding.bound
    fills = placing.fills
    for _ in range(3):
        x = x_of(2)
        binding.inputs["x"][...] = x
        np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    assert placing.fills == fills


def test_bind_refuses_a_model_with_variables_and_a_settle_below_one(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    with pytest.raises(InputError, match="at least one warm-up step"):
        model.bind({"x": x_of(2)}, settle=0)
    model.mark_variable(["x"])
    with pytest.raises(InputError, match="would advance the variables"):
        model.bind({"x": x_of(2)})


def test_a_plain_run_of_the_same_shapes_writes_the_binding_s_inputs(mlp_graph: dsp.Graph) -> None:
    """The documented sharing: the inputs are the plan's staging buffers, which ``run`` fills."""
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    binding = model.bind({"x": x_of(2)})
    other = x_of(2)
    model.run({"x": other})
    np.testing.assert_array_equal(binding.inputs["x"], other)
    x = x_of(2)
    binding.inputs["x"][...] = x  # written again before the bound step: it reads x
    np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)


def test_a_declined_graph_binds_to_copies_on_the_legacy_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_plan import _if_model

    from dsp_core.plan.compiler import Declined
    from dsp_core.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "compile_plan", lambda graph, names: Declined("forced for the test", "the_if"))
    model = dsp.compile(_if_model(), force_recompile=True)
    x = np.array([1.0, -2.0], np.float32)
    binding = model.bind({"x": x, "c": np.array(True)})
    assert not binding.bound and model.last_live is None
    binding.inputs["c"][...] = False
    np.testing.assert_array_equal(binding.run()["y"], [-1.0, -0.0])


def test_a_step_kept_past_its_binding_says_so(mlp_graph: dsp.Graph) -> None:
    """``binding.run`` is the bound step itself; kept past the binding's collection it still
    replays, but where it would fall back to the full path it says the binding is gone."""
    import gc

    from dsp_core import diag

    model = dsp.compile(mlp_graph, mode="onnxruntime")
    binding = model.bind({"x": x_of(2)})
    step = binding.run
    x = x_of(2)
    binding.inputs["x"][...] = x
    np.testing.assert_allclose(step()["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-5)
    del binding
    gc.collect()
    diag.enable("EXECUTE", "detailed")  # the step's check fails: it would take the full path
    try:
        with pytest.raises(InputError, match="this binding was collected"):
            step()
    finally:
        diag.disable()
