"""IR, builder and ONNX import."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.errors import DTypeError, GraphError, ModelLoadError, UnsupportedOpError
from dsp_core.ir import dtypes
from dsp_core.ir.onnx_import import import_model


def test_dtype_round_trips() -> None:
    for name in dtypes.DTYPE_NAMES:
        assert dtypes.from_onnx(dtypes.to_onnx(name)) == name
        assert dtypes.normalize(dtypes.to_numpy(name)) == name
    assert dtypes.normalize(np.float32) == "float32"
    assert dtypes.normalize(16) == "bfloat16"


def test_unsupported_dtypes_are_named() -> None:
    with pytest.raises(DTypeError, match="string"):
        dtypes.from_onnx(TensorProto.STRING)
    with pytest.raises(DTypeError, match="complex64"):
        dtypes.from_onnx(TensorProto.COMPLEX64)
    with pytest.raises(DTypeError, match="unknown dtype"):
        dtypes.normalize("float33")


def test_builder_graph_runs(mlp_graph: dsp.Graph) -> None:
    assert mlp_graph.input_names == ["x"]
    assert mlp_graph.output_names == ["y"]
    assert [n.op_type for n in mlp_graph.nodes] == ["MatMul", "Add", "Relu", "MatMul", "Identity"]


def test_builder_rejects_unknown_op_and_duplicates() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2])
    with pytest.raises(UnsupportedOpError, match="NoSuchOp"):
        g.NoSuchOp(x)
    with pytest.raises(GraphError, match="twice"):
        g.placeholder("x", "float32", [2])
    with pytest.raises(GraphError, match="no outputs"):
        g.build()


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_import_initializers_constants_value_info() -> None:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(2.0))),
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Mul", ["mm", "c"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    graph = import_model(model)
    assert graph.initializers["w"].shape == (2, 3)
    assert graph.inputs[0].shape == ("n", 2)
    # ONNX shape inference filled the intermediate value's shape
    assert graph.info("mm") is not None and graph.info("mm").shape == ("n", 3)
    out = dsp.compile(model).run({"x": np.ones((4, 2), np.float32)})["y"]
    np.testing.assert_allclose(out, 2 * np.ones((4, 2), np.float32) @ graph.initializers["w"])


def test_import_external_data(tmp_path) -> None:
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "ext.onnx"
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.data",
        size_threshold=0,
    )
    assert (tmp_path / "ext.data").exists()
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(dsp.compile(path).run({"x": x})["y"], x @ w, rtol=1e-5)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        dsp.compile(tmp_path / "missing.onnx")
    rnd = tmp_path / "random.onnx"
    rnd.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError):
        dsp.compile(rnd)
    good = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    ).SerializeToString()
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelLoadError):
        dsp.compile(trunc)


def test_unknown_op_is_named() -> None:
    model = _model(
        [helper.make_node("FancyOp", ["x"], ["y"], name="fancy_1", domain="com.example")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpError, match=r"FancyOp node \"fancy_1\""):
        dsp.compile(model)


def test_undefined_value_rejected() -> None:
    model = _model(
        [helper.make_node("Relu", ["nowhere"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    with pytest.raises(GraphError, match="nowhere"):
        import_model(model, infer_shapes=False)
