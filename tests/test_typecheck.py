"""Compile-time dtype checking (dsp_core/ir/typecheck.py): invalid dtypes are DTypeErrors, valid models pass.

The repro cases (issue 12, item 4) go through ``dsp.compile``, so they test the wiring as
well as the check: before it, each of them compiled and ran (with a wrong or
backend-dependent result).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import dsp_core as dsp
from dsp_core.errors import DSPError, DTypeError
from dsp_core.ir.onnx_import import import_model
from dsp_core.ir.typecheck import check_types

FIXTURES = Path(__file__).parent / "fixtures"
F, I32, I64, BOOL = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, int, list[Any]]],
    outputs: list[tuple[str, int, list[Any]]],
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    opset: int = 23,
) -> bytes:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model.SerializeToString()


def _compile_error(model: bytes) -> str:
    with pytest.raises(DTypeError) as info:
        dsp.compile(model, force_recompile=True)
    return str(info.value)


@pytest.mark.parametrize(
    "code, got",
    [(TensorProto.INT32, "int32"), (TensorProto.FLOAT16, "float16"), (TensorProto.UINT8, "uint8")],
)
def test_add_of_two_dtypes_names_node_input_expected_and_got(code: int, got: str) -> None:
    c = helper.make_tensor("c", code, [4], [1, 2, 3, 1])
    model = _model([helper.make_node("Add", ["c", "x"], ["y"], name="add_3")], [("x", F, [4])], [("y", F, [4])], [c])
    msg = _compile_error(model)
    assert 'Add node "add_3"' in msg
    assert f'input 1 ("x") is float32, expected {got} like input 0 ("c")' in msg
    assert "type T" in msg


def test_not_of_float32() -> None:
    model = _model([helper.make_node("Not", ["x"], ["y"], name="not")], [("x", F, [3])], [("y", BOOL, [3])])
    msg = _compile_error(model)
    assert 'Not node "not": input 0 ("x", X) is float32, expected one of bool' in msg


def test_acos_of_int4() -> None:
    c = helper.make_tensor("c", TensorProto.INT4, [4], [1, 2, 3, 1])
    model = _model([helper.make_node("Acos", ["c"], ["y"], name="acos")], [], [("y", F, [4])], [c])
    msg = _compile_error(model)
    assert 'Acos node "acos": input 0 ("c", input) is int4' in msg
    assert "float32" in msg.split("expected one of")[1]


def test_matmul_with_a_uint2_weight() -> None:
    w = helper.make_tensor("w", TensorProto.UINT2, [4, 2], [1, 2, 3, 0, 1, 2, 3, 0])
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", F, [1, 4])], [("y", F, [1, 2])], [w]
    )
    msg = _compile_error(model)
    assert 'MatMul node "mm": input 1 ("w", B) is uint2, expected one of' in msg


def test_concat_of_mixed_dtypes() -> None:
    node = helper.make_node("Concat", ["a", "b", "c"], ["y"], name="cat", axis=0)
    model = _model([node], [("a", F, [2]), ("b", F, [2]), ("c", I64, [2])], [("y", F, [6])])
    msg = _compile_error(model)
    assert 'Concat node "cat": input 2 ("c") is int64, expected float32 like input 0 ("a")' in msg


def test_where_with_a_non_bool_condition() -> None:
    node = helper.make_node("Where", ["cond", "a", "b"], ["y"], name="where")
    model = _model([node], [("cond", F, [3]), ("a", F, [3]), ("b", F, [3])], [("y", F, [3])])
    msg = _compile_error(model)
    assert 'Where node "where": input 0 ("cond", condition) is float32, expected one of bool' in msg


def test_a_cast_chain_stays_valid_and_carries_its_dtypes() -> None:
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=I64),
        helper.make_node("Add", ["xi", "one"], ["yi"]),
        helper.make_node("Cast", ["yi"], ["yh"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["yh", "half"], ["y"]),
    ]
    inits = [
        helper.make_tensor("one", I64, [], [1]),
        helper.make_tensor("half", TensorProto.FLOAT16, [], [0.5]),
    ]
    model = _model(nodes, [("x", F, [3])], [("y", TensorProto.FLOAT16, [3])], inits)
    assert check_types(import_model(model)) == {
        "x": "float32",
        "one": "int64",
        "half": "float16",
        "xi": "int64",
        "yi": "int64",
        "yh": "float16",
        "y": "float16",
    }
    out = dsp.compile(model, force_recompile=True).run({"x": np.array([1.7, 2.2, 3.9], np.float32)})["y"]
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, np.array([1.0, 1.5, 2.0], np.float16))


def test_a_dtype_after_cast_is_checked_downstream() -> None:
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=I64),
        helper.make_node("Add", ["xi", "x"], ["y"], name="late"),
    ]
    model = _model(nodes, [("x", F, [3])], [("y", F, [3])])
    assert 'Add node "late": input 1 ("x") is float32, expected int64 like input 0 ("xi")' in _compile_error(model)


def _if_model(branch_const: onnx.TensorProto) -> bytes:
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["t"], name="inner_add")],
        "then",
        [],
        [helper.make_tensor_value_info("t", F, [3])],
        [branch_const],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, [3])]
    )
    nodes = [
        helper.make_node("If", ["cond"], ["r"], name="if", then_branch=then_graph, else_branch=else_graph),
        helper.make_node("Mul", ["r", "x"], ["y"]),
    ]
    return _model(nodes, [("cond", BOOL, []), ("x", F, [3])], [("y", F, [3])])


def test_a_subgraph_node_is_checked_with_the_outer_dtypes() -> None:
    msg = _compile_error(_if_model(helper.make_tensor("k", I32, [3], [1, 2, 3])))
    assert 'Add node "inner_add": input 1 ("k") is int32, expected float32 like input 0 ("x")' in msg


def test_a_valid_subgraph_passes_and_gives_the_if_its_output_dtype() -> None:
    model = _if_model(helper.make_tensor("k", F, [3], [1, 2, 3]))
    assert check_types(import_model(model))["r"] == "float32"
    x = np.array([1, 2, 3], np.float32)
    out = dsp.compile(model, force_recompile=True).run({"cond": np.array(True), "x": x})["y"]
    np.testing.assert_array_equal(out, (x + [1, 2, 3]) * x)


def test_a_builder_graph_is_checked_too() -> None:
    g = dsp.GraphBuilder()
    a = g.placeholder("a", "int32", [4])
    b = g.placeholder("b", "float32", [4])
    g.output(g.Add(a, b), "y")
    with pytest.raises(DTypeError, match=r'input 1 \("b"\) is float32, expected int32 like input 0 \("a"\)'):
        dsp.compile(g.build())


def test_every_fixture_passes() -> None:
    # fixtures/fuzz holds models that are invalid on purpose (tests/test_fuzz_regressions.py)
    paths = sorted(p for p in FIXTURES.glob("**/*.onnx") if "fuzz" not in p.relative_to(FIXTURES).parts)
    assert len(paths) >= 5
    for path in paths:
        check_types(import_model(path))


def test_every_node_suite_model_the_onnx_checker_accepts_passes() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from node_suite import load_cases

    checked = 0
    for case in load_cases():
        try:
            onnx.checker.check_model(case.model, full_check=True)
            graph = import_model(case.model)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, DSPError):
            continue  # invalid for ONNX, or refused by the importer (string tensors): not this check's business
        check_types(graph)  # raises on a false rejection, naming the node
        checked += 1
    assert checked > 1800


def test_a_type_a_later_opset_allows_is_accepted() -> None:
    # Cast took uint2 from opset 25; DSP's Cast kernel takes it at any opset (the builder's is 23).
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "uint2", [4])
    g.output(g.Cast(x, to=TensorProto.FLOAT), "y")
    graph = g.build()
    assert check_types(graph)["x"] == "uint2"
    feeds = {"x": np.array([0, 1, 2, 3]).astype(dsp.ir.dtypes.to_numpy("uint2"))}
    np.testing.assert_array_equal(dsp.compile(graph).run(feeds)["y"], np.array([0, 1, 2, 3], np.float32))
