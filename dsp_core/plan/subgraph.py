"""A segment of a plan written back out as a self-contained ONNX model.

Backends that hand a whole segment to another runtime (OpenVINO, ONNX Runtime) compile
it from this model: the segment's slots become its nodes, the values it reads from
outside become its graph inputs (with the concrete shapes of this live plan), the
constants and sealed values it reads become initializers, and the values other units
read become its outputs. Every tensor is named ``v<flat index>``, so the runtime's
input and output names map straight back onto the executor's flat value list.

A ``dsp::MergedMatMul`` slot (dsp_core/plan/merge.py) is written in ONNX as what it
means: its weights (and biases) joined by Concat, which the runtime folds once, one
MatMul or Gemm, and a Split on the last axis into the slot's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dsp_core.ir import dtypes
from dsp_core.ir.typecheck import attribute_types
from dsp_core.plan.merge import is_merged
from dsp_core.plan.plan import Plan

# The IR version written: 10 is read by every ONNX Runtime >= 1.17 and OpenVINO >= 2024.
IR_VERSION = 10


@dataclass(frozen=True)
class SubgraphIO:
    """The flat indexes a segment model reads (feeds, in input order) and writes (outputs)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def name_of(flat: int) -> str:
    """The tensor name of flat index ``flat`` in a segment model."""
    return f"v{flat}"


def segment_model(
    plan: Plan,
    slots: Sequence[int],
    io: SubgraphIO,
    feeds: Mapping[int, tuple[str, tuple[int, ...] | None]],
    constants: Mapping[int, np.ndarray],
) -> onnx.ModelProto:
    """The ONNX model of ``slots``: inputs ``io.inputs`` typed by ``feeds`` (flat -> (dtype, shape))."""
    nodes = [node for s in slots for node in _nodes(plan, s)]
    graph_inputs = [_value_info(name_of(f), *feeds[f]) for f in io.inputs]
    graph_outputs = [_value_info(name_of(f), *_out_info(plan, f)) for f in io.outputs]
    graph = helper.make_graph(nodes, f"dsp_segment_{len(slots)}", graph_inputs, graph_outputs)
    opsets: dict[str, int] = {}
    for s in slots:
        slot = plan.slots[s]
        domain = "" if is_merged(slot) else slot.domain  # written as ONNX ops
        opsets[domain] = max(opsets.get(domain, 1), slot.opset)
    opsets.setdefault("", max(opsets.values(), default=17))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], producer_name="dsp"
    )
    model.ir_version = IR_VERSION
    # The constants go in last, straight into the model's own graph: make_graph and make_model
    # copy every initializer they are given, and a segment's weights can be gigabytes.
    for f, a in constants.items():
        _add_initializer(model.graph, name_of(f), c_order(a))
    return model


# numpy dtypes whose bytes are an ONNX tensor's raw_data as they are (little-endian, one element each)
_RAW_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
)


def _add_initializer(graph: onnx.GraphProto, name: str, array: np.ndarray) -> None:
    """``array`` as the initializer ``name`` of ``graph``, its bytes copied once (numpy_helper for other dtypes)."""
    if array.dtype.name not in _RAW_DTYPES or array.dtype.byteorder == ">":
        graph.initializer.append(numpy_helper.from_array(array, name))
        return
    tensor = graph.initializer.add()
    tensor.name = name
    tensor.data_type = dtypes.to_onnx(array.dtype.name)
    tensor.dims.extend(array.shape)
    tensor.raw_data = array.tobytes()


def _nodes(plan: Plan, s: int) -> list[onnx.NodeProto]:
    """The ONNX nodes of slot ``s``: one, except for a merged product."""
    return _merged_nodes(plan, s) if is_merged(plan.slots[s]) else [_node(plan, s)]


def _merged_nodes(plan: Plan, s: int) -> list[onnx.NodeProto]:
    """``dsp::MergedMatMul`` as ONNX: Concat of the weights (and biases), one product, Split on the last axis."""
    slot = plan.slots[s]
    k = len(slot.outputs)
    names = [name_of(plan.flat(r)) for r in slot.inputs]
    outs = [name_of(plan.flat(v)) if v is not None else f"s{s}_unused{j}" for j, v in enumerate(slot.outputs)]
    trans_b = int(slot.attrs.get("transB", 0))
    tmp = f"s{s}_merged_"
    nodes = [helper.make_node("Concat", names[1 : 1 + k], [tmp + "w"], name=tmp + "w", axis=0 if trans_b else 1)]
    product_inputs = [names[0], tmp + "w"]
    if slot.attrs.get("form") == "Gemm":
        if slot.attrs.get("bias"):
            nodes.append(helper.make_node("Concat", names[1 + k :], [tmp + "c"], name=tmp + "c", axis=-1))
            product_inputs.append(tmp + "c")
        alpha, beta = float(slot.attrs.get("alpha", 1.0)), float(slot.attrs.get("beta", 1.0))
        gemm = helper.make_node("Gemm", product_inputs, [tmp + "y"], name=tmp + "y", transB=trans_b)
        gemm.attribute.extend([helper.make_attribute("alpha", alpha), helper.make_attribute("beta", beta)])
        nodes.append(gemm)
    else:
        nodes.append(helper.make_node("MatMul", product_inputs, [tmp + "y"], name=tmp + "y"))
    sizes = [_part_n(plan, r, trans_b) for r in slot.inputs[1 : 1 + k]]
    if slot.opset >= 13:  # the sizes are an input from opset 13 on
        sizes_tensor = numpy_helper.from_array(np.asarray(sizes, np.int64), tmp + "sizes")
        nodes.append(helper.make_node("Constant", [], [tmp + "sizes"], name=tmp + "sizes", value=sizes_tensor))
        nodes.append(helper.make_node("Split", [tmp + "y", tmp + "sizes"], outs, name=f"s{s}", axis=-1))
    else:
        nodes.append(helper.make_node("Split", [tmp + "y"], outs, name=f"s{s}", axis=-1, split=sizes))
    return nodes


def _part_n(plan: Plan, weight: int | None, trans_b: int) -> int:
    shape = plan.ref_info(weight)[1]
    assert shape is not None and len(shape) == 2, "a merged product's weights are rank-2 constants"
    return int(shape[0] if trans_b else shape[1])  # type: ignore[arg-type]


def _node(plan: Plan, s: int) -> onnx.NodeProto:
    slot = plan.slots[s]
    ins = ["" if r is None else name_of(plan.flat(r)) for r in slot.inputs]
    outs = ["" if v is None else name_of(plan.flat(v)) for v in slot.outputs]
    while ins and ins[-1] == "":  # trailing missing optionals: leave them out
        ins.pop()
    node = helper.make_node(slot.op, ins, outs, name=f"s{s}", domain=slot.domain or None)
    declared = attribute_types(slot.domain, slot.op, slot.opset) or {}
    node.attribute.extend(_attr(k, v, declared.get(k)) for k, v in slot.attrs.items())
    return node


def _attr(key: str, val: Any, declared: int | None) -> onnx.AttributeProto:
    if isinstance(val, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(val))
    if isinstance(val, (list, tuple)) and val and isinstance(val[0], np.ndarray):
        return helper.make_attribute(key, [numpy_helper.from_array(v) for v in val])
    if isinstance(val, tuple):
        val = list(val)
    # An empty list has no element to infer the type from: the schema says it.
    attr_type = declared if declared is not None and isinstance(val, list) and not val else None
    return helper.make_attribute(key, val, attr_type=attr_type)  # type: ignore[arg-type]


def _value_info(name: str, dtype: str | None, shape: tuple[Any, ...] | None) -> onnx.ValueInfoProto:
    if not dtype:
        return onnx.ValueInfoProto(name=name)  # untyped: the runtime's own inference types it
    elem = dtypes.to_onnx(dtype)
    dims = None if shape is None else [d if isinstance(d, (int, str)) and d != -1 else None for d in shape]
    return helper.make_tensor_value_info(name, elem, dims)


def _out_info(plan: Plan, flat: int) -> tuple[str | None, None]:
    """An output's dtype as the plan knows it; its shape is left to the runtime's inference
    (a model's declared shapes can be stale, and the runtime checks them against its own)."""
    ref = flat - 1 - len(plan.externals)
    return plan.ref_info(ref)[0], None


def c_order(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous ndarray of the same shape (np.ascontiguousarray makes a 0-d array 1-d)."""
    array = np.asarray(array)
    return array if array.flags.c_contiguous else array.copy(order="C")


def serialized(model: onnx.ModelProto) -> bytes:
    """The model's bytes (what ``Core.read_model`` and ``InferenceSession`` read)."""
    return model.SerializeToString()


__all__ = ["SubgraphIO", "c_order", "name_of", "segment_model", "serialized"]
