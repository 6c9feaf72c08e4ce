"""Plan compiler: wiring, externals, liveness, declines; executors vs the legacy interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import mlp_reference
from onnx import TensorProto, helper

import dsp_core as dsp
from dsp_core.errors import InputError
from dsp_core.ir.onnx_import import import_model
from dsp_core.ops.registry import Trait
from dsp_core.plan.compiler import Declined, compile_plan
from dsp_core.plan.plan import ExternalClass


def test_wiring_and_external_classes(mlp_graph: dsp.Graph) -> None:
    plan = compile_plan(mlp_graph)
    assert not isinstance(plan, Declined)
    assert [s.op for s in plan.slots] == ["MatMul", "Add", "Relu", "MatMul", "Identity"]
    assert plan.externals[0].name == "x" and plan.externals[0].cls is ExternalClass.PLACEHOLDER
    assert {e.name for e in plan.externals if e.cls is ExternalClass.CONSTANT} == {"w1", "b1", "w2"}
    first = plan.slots[0]
    assert first.inputs[0] == -1  # external 0 is x
    assert all(r >= 0 for r in plan.slots[1].inputs[:1])  # reads slot 0's output
    for slot in plan.slots:  # every value read comes from an earlier slot
        for r in slot.inputs:
            if r is not None and r >= 0:
                producer = next(s for s in plan.slots if r in s.outputs)
                assert producer.index < slot.index
    assert plan.slots[2].traits & Trait.ELEMENTWISE


def test_liveness_releases_each_value_once_and_keeps_outputs(mlp_graph: dsp.Graph) -> None:
    plan = compile_plan(mlp_graph)
    released = [v for vs in plan.release for v in vs]
    assert len(released) == len(set(released))
    out_values = {r for r in plan.outputs if r >= 0}
    assert not out_values & set(released)
    assert set(released) | out_values == set(range(len(plan.values)))
    # each value is released at (not before) its last reader
    for s, values in enumerate(plan.release):
        for v in values:
            readers = [sl.index for sl in plan.slots if v in sl.inputs]
            assert s == (max(readers) if readers else next(sl.index for sl in plan.slots if v in sl.outputs))


def test_requested_outputs_prune_the_plan(mlp_graph: dsp.Graph) -> None:
    hidden = mlp_graph.nodes[2].outputs[0]  # Relu output
    plan = compile_plan(mlp_graph, [hidden])
    assert [s.op for s in plan.slots] == ["MatMul", "Add", "Relu"]
    model = dsp.compile(mlp_graph)
    x = np.ones((3, 8), np.float32)
    outs = model.run({"x": x}, outputs=[hidden])
    assert list(outs) == [hidden] and outs[hidden].shape == (3, 16)
    with pytest.raises(InputError, match="not a value"):
        model.run({"x": x}, outputs=["nope"])


@pytest.mark.parametrize("mode", ["auto", "slot_by_slot", "SLOT_BY_SLOT", "Slot_By_Slot"])
def test_modes_by_name_match_reference(mlp_graph: dsp.Graph, mode: str) -> None:
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    model = dsp.compile(mlp_graph, mode=mode)
    np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-5)
    np.testing.assert_array_equal(model.run({"x": x})["y"], model.run_legacy({"x": x})["y"])


def test_shape_inference_only_mode(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="shape_inference_only")
    out = model.run({"x": np.ones((7, 8), np.float32)})["y"]
    assert out.shape == (7, 4) and out.dtype == np.float32


def test_shape_inference_follows_value_dependent_shapes() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", ["n", 6])
    shape = g.Shape(x)
    flat = g.Reshape(
        x,
        g.Concat(
            g.constant(np.array([-1], np.int64)),
            g.Slice(shape, g.constant(np.array([1], np.int64)), g.constant(np.array([2], np.int64))),
            axis=0,
        ),
    )
    g.output(g.Transpose(flat, perm=[1, 0]), "y")
    out = dsp.compile(g.build(), mode="shape_inference_only").run({"x": np.ones((4, 6), np.float32)})["y"]
    assert out.shape == (6, 4)


def _if_model():
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="the_if"),
    ]
    return helper.make_model(
        helper.make_graph(
            nodes,
            "cf",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )


def test_control_flow_runs_inside_the_plan_as_regions() -> None:
    plan = compile_plan(import_model(_if_model()))
    assert not isinstance(plan, Declined)
    assert [s.op for s in plan.slots] == ["Relu", "If"]
    region = plan.regions[1]
    assert region.kind == "If" and set(region.subplans) == {"then_branch", "else_branch"}
    assert region.outer == ("a",)
    # the enclosing value the branches read is an input of the If slot, so liveness keeps it
    assert plan.slots[1].inputs[-1] == plan.slots[0].outputs[0]
    assert plan.release[1] == (plan.slots[0].outputs[0],)
    sub = region.subplans["else_branch"]
    assert [e.cls.value for e in sub.externals] == ["outer"] and [s.op for s in sub.slots] == ["Neg"]
    m = dsp.compile(_if_model())
    assert m.declined is None and m.resolved_backends() == ["slot_by_slot"]
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(m.run({"x": x, "c": np.array(True)})["y"], [1.0, 0.0])
    np.testing.assert_array_equal(m.run({"x": x, "c": np.array(False)})["y"], [-1.0, -0.0])


def test_declined_graph_runs_on_legacy_with_visible_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_core.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "compile_plan", lambda graph, names: Declined("forced for the test", "the_if"))
    m = dsp.compile(_if_model(), force_recompile=True)  # not the plan a previous test left on disk
    assert m.declined is not None and "forced for the test" in str(m.declined)
    assert m.resolved_backends() == ["legacy"] and m.plan() is None
    assert m.explain()["declined"] == "forced for the test (at the_if)"
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(m.run({"x": x, "c": np.array(False)})["y"], [-1.0, -0.0])


def test_feed_errors_are_clear(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(InputError, match="unknown input 'z'"):
        model.run({"x": x, "z": x})
    with pytest.raises(InputError, match="missing input 'x'"):
        model.run({})
    with pytest.raises(InputError, match=r"dtype float64 given, model expects float32"):
        model.run({"x": x.astype(np.float64)})
    with pytest.raises(InputError, match=r"dimension 1 is 7, model expects 8"):
        model.run({"x": np.ones((2, 7), np.float32)})
    with pytest.raises(InputError, match="rank 1"):
        model.run({"x": np.ones(8, np.float32)})


def test_symbolic_dims_must_agree() -> None:
    g = dsp.GraphBuilder()
    a = g.placeholder("a", "float32", ["batch", 3])
    b = g.placeholder("b", "float32", ["batch", 3])
    g.output(a + b, "y")
    model = dsp.compile(g.build())
    with pytest.raises(InputError, match="'batch'"):
        model.run({"a": np.ones((2, 3), np.float32), "b": np.ones((4, 3), np.float32)})


def test_kernel_failure_names_the_node() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", None)
    y = g.placeholder("y", "float32", None)
    g.output(g.MatMul(x, y), "z")
    model = dsp.compile(g.build())
    with pytest.raises(dsp.DSPError, match="MatMul node"):
        model.run({"x": np.ones((2, 3), np.float32), "y": np.ones((4, 5), np.float32)})


def test_variables_are_classed(mlp_graph: dsp.Graph) -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2])
    state = g.variable("state", "float32", [2])
    g.output(x + state, "y")
    plan = compile_plan(g.build())
    classes = {e.name: e.cls for e in plan.externals}
    assert classes == {
        "x": ExternalClass.PLACEHOLDER,
        "state": ExternalClass.VARIABLE,
        **{e.name: ExternalClass.CONSTANT for e in plan.externals if e.cls is ExternalClass.CONSTANT},
    }


# -- the reference backend's step program: a loop on its first run, generated code after ----------
def test_a_step_program_loops_once_then_runs_generated_code_and_names_the_raising_step() -> None:
    from dsp_cpu_ref.slot_by_slot import generate

    def bad(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x

    steps = [(lambda a: a + 1, (0,), 1, ()), (lambda a: (a * 2, a * 3), (1,), (2, 3), (1,)), (bad, (3,), 4, ())]
    program = generate(steps, "t")
    values: list[object] = [1, None, None, None, None]
    program(values)  # the first run: the loop, nothing compiled (a plan that runs once never pays for it)
    assert values == [1, None, 4, 6, 6] and program.code is None
    values = [1, None, None, None, None]
    program(values)  # the second: compiled, then run as straight-line code
    assert values == [1, None, 4, 6, 6] and program.code is not None
    for first in (True, False):
        fresh = generate(steps, "t") if first else program
        values = [-5, None, None, None, None]
        with pytest.raises(ValueError) as info:
            fresh(values)
        assert fresh.failing_step(info.value) == 2, "loop" if first else "generated"
    assert program.failing_step(RuntimeError("elsewhere")) is None
