"""ir.Graph -> onnx.ModelProto, so builder graphs can be saved and compared with other runtimes."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Value


def _value_info(v: Value) -> onnx.ValueInfoProto:
    elem = dtypes.to_onnx(v.dtype) if v.dtype else onnx.TensorProto.UNDEFINED
    return helper.make_tensor_value_info(v.name, elem, None if v.shape is None else list(v.shape))


def _attr(key: str, val: Any) -> onnx.AttributeProto:
    if isinstance(val, Graph):
        return helper.make_attribute(key, to_graph_proto(val))
    if isinstance(val, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(val))
    return helper.make_attribute(key, val)


def to_graph_proto(graph: Graph) -> onnx.GraphProto:
    """The GraphProto of ``graph`` (subgraphs included)."""
    nodes = []
    for n in graph.nodes:
        node = helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name, domain=n.domain or None)
        node.attribute.extend(_attr(k, v) for k, v in n.attrs.items())
        nodes.append(node)
    return helper.make_graph(
        nodes,
        graph.name,
        [_value_info(v) for v in graph.inputs],
        [_value_info(v) for v in graph.outputs],
        [numpy_helper.from_array(np.asarray(a), name) for name, a in graph.initializers.items()],
    )


def to_onnx(graph: Graph, ir_version: int = 10) -> onnx.ModelProto:
    """A ModelProto of ``graph`` with its opset imports."""
    opsets = [helper.make_opsetid(domain, version) for domain, version in graph.opsets.items()]
    model = helper.make_model(to_graph_proto(graph), opset_imports=opsets, producer_name="dsp")
    model.ir_version = ir_version
    return model
