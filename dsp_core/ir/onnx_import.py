"""ONNX -> ir.Graph: initializers, Constant nodes, opsets, external data, value_info, subgraphs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from dsp_core.errors import DSPError, DTypeError, GraphError, ModelLoadError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Dim, Graph, Node, Value

ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto


def load_model(source: ModelSource) -> onnx.ModelProto:
    """Read an ONNX model from a path, raw bytes or a ModelProto; raise ModelLoadError."""
    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, bytes):
        return _parse(source, "the given bytes")
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not an ONNX model file")
    model = _parse(path.read_bytes(), str(path))
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read its external data: {exc}") from exc
    return model


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{where} is not a valid ONNX model (truncated or corrupt?): {exc}") from exc
    if not data or not model.HasField("graph"):
        raise ModelLoadError(f"{where} is not a valid ONNX model: it holds no graph")
    if model.ir_version <= 0 or not model.opset_import:
        raise ModelLoadError(f"{where} is not a valid ONNX model: no IR version or opset imports")
    return model


def import_model(source: ModelSource, infer_shapes: bool = True) -> Graph:
    """Import an ONNX model into an ir.Graph, with static shapes inferred where known."""
    model = load_model(source)
    if infer_shapes:
        model = _with_inferred_shapes(model)
    opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version for o in model.opset_import}
    try:
        graph = _import_graph(model.graph, opsets, outer=frozenset())
    except DSPError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"cannot import ONNX graph {model.graph.name!r}: {exc}") from exc
    graph.validate()
    return graph


def _with_inferred_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX's static shape inference, when it succeeds; the model unchanged otherwise."""
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001  (inference is an optimisation; the model stays valid)
        return model


def _value(info: onnx.ValueInfoProto) -> Value:
    t = info.type
    if t.HasField("sequence_type"):
        return Value(info.name, None, None, kind="sequence")
    if t.HasField("optional_type"):
        return Value(info.name, None, None, kind="optional")
    if not t.HasField("tensor_type"):
        return Value(info.name, None, None)
    tt = t.tensor_type
    try:
        dtype = dtypes.from_onnx(tt.elem_type) if tt.elem_type else None
    except DTypeError:
        dtype = f"unsupported:{onnx.TensorProto.DataType.Name(tt.elem_type).lower()}"
    shape: tuple[Dim, ...] | None = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
    return Value(info.name, dtype, shape)


def tensor_to_array(t: onnx.TensorProto) -> np.ndarray:
    """Convert a TensorProto (inline or already-loaded external data) to numpy."""
    if t.data_type in (8,):
        raise DTypeError(f"tensor {t.name!r} holds strings; DSP does not support string tensors")
    dtypes.from_onnx(t.data_type)  # raises a clear DTypeError for unsupported element types
    return numpy_helper.to_array(t)


def attribute_value(attr: onnx.AttributeProto, opsets: dict[str, int], outer: frozenset[str]) -> Any:
    """An attribute as a Python value: numbers, str, lists, numpy arrays or ir.Graph."""
    if attr.type == onnx.AttributeProto.GRAPH:
        return _import_graph(attr.g, opsets, outer)
    if attr.type == onnx.AttributeProto.GRAPHS:
        return [_import_graph(g, opsets, outer) for g in attr.graphs]
    if attr.type == onnx.AttributeProto.TENSOR:
        return tensor_to_array(attr.t)
    if attr.type == onnx.AttributeProto.TENSORS:
        return [tensor_to_array(t) for t in attr.tensors]
    if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
        raise DTypeError(f"attribute {attr.name!r}: sparse tensors are not supported")
    val = helper.get_attribute_value(attr)
    if isinstance(val, bytes):
        return val.decode("utf-8")
    if isinstance(val, list) and val and isinstance(val[0], bytes):
        return [v.decode("utf-8") for v in val]
    return val


def _import_graph(g: onnx.GraphProto, opsets: dict[str, int], outer: frozenset[str]) -> Graph:
    initializers = {t.name: tensor_to_array(t) for t in g.initializer}
    for sparse in g.sparse_initializer:
        raise DTypeError(f"sparse initializer {sparse.values.name!r} is not supported")
    inputs = [_value(v) for v in g.input]
    scope = set(initializers) | {v.name for v in inputs}
    nodes: list[Node] = []
    visible = outer | frozenset(scope)
    for i, n in enumerate(g.node):
        attrs = {a.name: attribute_value(a, opsets, visible | frozenset(scope)) for a in n.attribute}
        node = Node(
            op_type=n.op_type,
            inputs=list(n.input),
            outputs=list(n.output),
            attrs=attrs,
            name=n.name or f"{n.op_type}_{i}",
            domain="" if n.domain == "ai.onnx" else n.domain,
        )
        nodes.append(node)
        scope.update(o for o in n.output if o)
    reads = {name for node in nodes for name in node.inputs if name}
    reads |= {o.name for o in g.output}
    for node in nodes:
        for _, _, sub in Graph.subgraphs_of(node):
            reads |= sub.outer_names
    used_outer = frozenset(name for name in reads if name not in scope and name in outer)
    missing = sorted(name for name in reads if name not in scope and name not in outer and name)
    if missing:
        raise GraphError(f"graph {g.name!r} reads undefined values: {', '.join(missing[:5])}")
    value_info = {v.name: _value(v) for v in g.value_info}
    return Graph(
        name=g.name or "graph",
        inputs=inputs,
        outputs=[_value(v) for v in g.output],
        nodes=nodes,
        initializers=initializers,
        value_info=value_info,
        opsets=dict(opsets),
        outer_names=used_outer,
    )
