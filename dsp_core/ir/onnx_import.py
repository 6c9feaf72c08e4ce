"""ONNX -> ir.Graph: initializers, Constant nodes, opsets, external data, value_info, subgraphs."""

from __future__ import annotations

import io
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from dsp_core import config, progress
from dsp_core.errors import DSPError, DTypeError, GraphError, ModelLoadError
from dsp_core.ir import dtypes, onnx_inference, onnx_scan
from dsp_core.ir.external_data import load_external_data, read_external_data
from dsp_core.ir.graph import Dim, Graph, Node, Value
from dsp_core.ir.typecheck import attribute_types, check_types
from dsp_core.ops.registry import has_op, lookup

ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto


def load_model(source: ModelSource, base_dir: str | os.PathLike[str] | None = None) -> onnx.ModelProto:
    """Read an ONNX model from a path, raw bytes or a ModelProto; raise ModelLoadError.

    External data is read from the model file's own directory, or from ``base_dir`` for
    bytes and protos (which have no directory): see :func:`load_external_data`.
    """
    if isinstance(source, onnx.ModelProto):
        return load_external_data(source, base_dir, "the given ModelProto")
    if isinstance(source, bytes):
        return load_external_data(_parse(source, "the given bytes"), base_dir, "the given bytes")
    path = _model_path(source)
    model = _parse(path.read_bytes(), str(path))
    return load_external_data(model, path.parent if base_dir is None else base_dir, str(path))


def _load(
    source: ModelSource, base_dir: str | os.PathLike[str] | None = None
) -> tuple[onnx.ModelProto, dict[int, np.ndarray]]:
    """What :func:`load_model` reads, with the top-level graph's big initializers as arrays beside it.

    ``arrays[i]`` is initializer ``i``'s array, that tensor left without data in the
    proto: the file's bytes go straight into the arrays, so a model is never held twice
    (``onnx_scan``). Everything else is exactly what ``load_model`` returns.
    """
    if isinstance(source, onnx.ModelProto):
        arrays: dict[int, np.ndarray] = {}
        return read_external_data(source, base_dir, "the given ModelProto", arrays), arrays
    if isinstance(source, bytes):
        model, arrays = _scan(io.BytesIO(source), len(source), "the given bytes", lambda: source)
        return read_external_data(model, base_dir, "the given bytes", arrays), arrays
    path = _model_path(source)
    root = path.parent if base_dir is None else base_dir
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device: read as before (the scanner needs a file)
        return read_external_data(_parse(path.read_bytes(), str(path)), root, str(path), {}), {}
    with progress.step(f"load {path.name}", total=st.st_size, unit="B") as bar:
        with open(path, "rb", buffering=1 << 20) as f:
            model, arrays = _scan(f, st.st_size, str(path), path.read_bytes, bar.advance)
    return read_external_data(model, root, str(path), arrays), arrays


def _model_path(source: str | os.PathLike[str]) -> Path:
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not an ONNX model file")
    return path


def _scan(
    f: BinaryIO,
    size: int,
    where: str,
    whole: Callable[[], bytes],
    advance: Callable[[int], None] | None = None,
) -> tuple[onnx.ModelProto, dict[int, np.ndarray]]:
    """The model and its big initializers' arrays read from ``f``; else ``whole()`` parsed the ordinary way."""
    found = onnx_scan.read_model(f, size, advance) if size else None
    if found is None:  # not what the scanner reads (or not a model): protobuf parses it and says why
        return _parse(whole(), where), {}
    _check_model(found[0], where)
    return found


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{where} is not a valid ONNX model (truncated or corrupt?): {exc}") from exc
    if not data:
        raise ModelLoadError(f"{where} is not a valid ONNX model: it holds no graph")
    _check_model(model, where)
    return model


def _check_model(model: onnx.ModelProto, where: str) -> None:
    if not model.HasField("graph"):
        raise ModelLoadError(f"{where} is not a valid ONNX model: it holds no graph")
    if model.ir_version <= 0 or not model.opset_import:
        raise ModelLoadError(f"{where} is not a valid ONNX model: no IR version or opset imports")


def import_model(
    source: ModelSource, infer_shapes: bool = True, base_dir: str | os.PathLike[str] | None = None
) -> Graph:
    """Import an ONNX model into an ir.Graph, with static shapes inferred where known.

    DSP's own checks run first (names are text and unique, every read is defined, nodes
    fit their op's arity, declared sizes are within bounds); only a model that passed them
    is given to ONNX's shape inference, and that runs sandboxed (``onnx_inference``).
    """
    model, arrays = _load(source, base_dir)
    with progress.step("import graph"):
        try:
            opsets = {_opset_domain(o.domain): o.version for o in model.opset_import}
            graph = _import_graph(model.graph, opsets, outer=frozenset(), arrays=arrays)
        except DSPError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"cannot import ONNX graph {_printable(model.graph.name)!r}: {exc}") from exc
        graph.validate()
        check_types(graph, check_declared=True)
        _check_bounds(graph)
    if infer_shapes:
        with progress.step("shape inference"):
            inferred = onnx_inference.infer(
                model, float(config.get("shape_inference_timeout")), int(config.get("shape_inference_memory_mb"))
            )
        if inferred is not None:
            _merge_inferred(graph, inferred.graph)
            # Inferred types reach values DSP's own rules could not type (ConstantOfShape's
            # dtype comes from a tensor attribute): check the inputs that now have one too.
            check_types(graph)
    return graph


def _opset_domain(domain: Any) -> str:
    name = _text(domain, "an opset import's domain")
    return "" if name == "ai.onnx" else name


def _text(value: Any, what: str) -> str:
    """A proto string field as str; GraphError when it holds bytes that are not UTF-8."""
    if isinstance(value, str):
        return value
    raise GraphError(f"{what} is not UTF-8 text: {_printable(value)!r}")


def _printable(value: Any) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8", "backslashreplace")


def _merge_inferred(graph: Graph, inferred: onnx.GraphProto) -> None:
    """Take the value_info (and refined output types) ONNX inferred into ``graph`` and its subgraphs."""
    for info in inferred.value_info:
        if isinstance(info.name, str) and info.name:
            graph.value_info[info.name] = _combined(graph.value_info.get(info.name), _value(info))
    for i, info in enumerate(inferred.output):
        if i < len(graph.outputs) and info.name == graph.outputs[i].name:
            graph.outputs[i] = _combined(graph.outputs[i], _value(info))
    for node, proto in zip(graph.nodes, inferred.node):
        for attr in proto.attribute:
            held = node.attrs.get(attr.name) if isinstance(attr.name, str) else None
            if attr.type == onnx.AttributeProto.GRAPH and isinstance(held, Graph):
                _merge_inferred(held, attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS and isinstance(held, list):
                for sub, sub_proto in zip(held, attr.graphs):
                    if isinstance(sub, Graph):
                        _merge_inferred(sub, sub_proto)


def _combined(old: Value | None, new: Value) -> Value:
    """``new``, completed by what ``old`` knows and it does not (a dtype, a shape): never less specific."""
    if old is None:
        return new
    shape = new.shape if new.shape is not None else old.shape
    return Value(new.name, new.dtype or old.dtype, shape, new.kind)


def _check_bounds(graph: Graph) -> None:
    """GraphError for a declared tensor larger than DSP_MAX_TENSOR_ELEMENTS (subgraphs included)."""
    limit = int(config.get("max_tensor_elements"))
    declared = [*graph.inputs, *graph.outputs, *graph.value_info.values()]
    for v in declared:
        dims = [d for d in (v.shape or ()) if isinstance(d, int)]
        if math.prod(dims) > limit:
            raise GraphError(
                f"value {v.name!r} is declared with shape {list(v.shape or ())}: more than {limit:,} elements "
                "(DSP_MAX_TENSOR_ELEMENTS bounds declared sizes; raise it if the model really needs more)"
            )
    for node in graph.nodes:
        for _, _, sub in Graph.subgraphs_of(node):
            _check_bounds(sub)


def _value(info: onnx.ValueInfoProto) -> Value:
    name = _text(info.name, "a value name")
    t = info.type
    if t.HasField("sequence_type"):
        return Value(name, None, None, kind="sequence")
    if t.HasField("optional_type"):
        return Value(name, None, None, kind="optional")
    if not t.HasField("tensor_type"):
        return Value(name, None, None)
    tt = t.tensor_type
    try:
        dtype = dtypes.from_onnx(tt.elem_type) if tt.elem_type else None
    except DTypeError:
        dtype = f"unsupported:{onnx.TensorProto.DataType.Name(tt.elem_type).lower()}"
    shape: tuple[Dim, ...] | None = None
    if tt.HasField("shape"):
        shape = tuple(_dim(d) for d in tt.shape.dim)
    return Value(name, dtype, shape)


def _dim(d: onnx.TensorShapeProto.Dimension) -> Dim:
    """A declared dim: an int, a symbolic name, or None (unknown; a negative value counts as unknown)."""
    if d.HasField("dim_value"):
        return d.dim_value if d.dim_value >= 0 else None
    return d.dim_param if isinstance(d.dim_param, str) and d.dim_param else None


def tensor_to_array(t: onnx.TensorProto, read: np.ndarray | None = None) -> np.ndarray:
    """Convert a TensorProto (inline or already-loaded external data) to numpy.

    ``read``: the tensor's array, already read from the file (``onnx_scan``); the tensor
    itself then holds no data, and is checked as any other.
    """
    if t.data_type in (8,):
        raise DTypeError(f"tensor {t.name!r} holds strings; DSP does not support string tensors")
    dtypes.from_onnx(t.data_type)  # raises a clear DTypeError for unsupported element types
    return numpy_helper.to_array(t) if read is None else read


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


def _import_graph(
    g: onnx.GraphProto, opsets: dict[str, int], outer: frozenset[str], arrays: dict[int, np.ndarray] | None = None
) -> Graph:
    """``g`` as a Graph; ``arrays``: initializers already read as arrays, by index (see ``_load``)."""
    gname = _text(g.name, "a graph name") or "graph"
    initializers: dict[str, np.ndarray] = {}
    for i, t in enumerate(g.initializer):
        name = _text(t.name, f"an initializer name of graph {gname!r}")
        if not name:
            raise GraphError(f"graph {gname!r} has an initializer with an empty name")
        if name in initializers:
            raise GraphError(f"graph {gname!r} defines initializer {name!r} twice (ONNX names are unique)")
        initializers[name] = tensor_to_array(t, arrays.pop(i, None) if arrays else None)
    for sparse in g.sparse_initializer:
        raise DTypeError(f"sparse initializer {_printable(sparse.values.name)!r} is not supported")
    inputs = [_value(v) for v in g.input]
    _unique([v.name for v in inputs], f"graph {gname!r} lists input")
    scope = set(initializers) | {v.name for v in inputs}
    nodes: list[Node] = []
    visible = outer | frozenset(scope)
    max_outputs = int(config.get("max_node_outputs"))
    for i, n in enumerate(g.node):
        node = _node(n, i, opsets, visible | frozenset(scope), gname, max_outputs)
        nodes.append(node)
        scope.update(o for o in node.outputs if o)
    outputs = [_value(v) for v in g.output]
    _unique([v.name for v in outputs], f"graph {gname!r} lists output")
    reads = {name for node in nodes for name in node.inputs if name}
    reads |= {o.name for o in outputs}
    for node in nodes:
        for _, _, sub in Graph.subgraphs_of(node):
            reads |= sub.outer_names
    used_outer = frozenset(name for name in reads if name not in scope and name in outer)
    missing = sorted(name for name in reads if name not in scope and name not in outer and name)
    if missing:
        raise GraphError(f"graph {gname!r} reads undefined values: {', '.join(missing[:5])}")
    value_info = {v.name: _value(v) for v in g.value_info}
    for v in (*inputs, *outputs):
        other = value_info.get(v.name)
        if other is not None:
            _check_agrees(v, other, gname)
            # one value, one description: what either declaration knows (Graph.info reads value_info first)
            value_info[v.name] = _combined(v, other)
    return Graph(
        name=gname,
        inputs=inputs,
        outputs=outputs,
        nodes=nodes,
        initializers=initializers,
        value_info=value_info,
        opsets=dict(opsets),
        outer_names=used_outer,
    )


def _node(
    n: onnx.NodeProto, i: int, opsets: dict[str, int], visible: frozenset[str], gname: str, max_outputs: int
) -> Node:
    """One NodeProto as a Node; GraphError for non-text names, repeated attributes, too many outputs."""
    op_type = _text(n.op_type, f"the op type of node {i} of graph {gname!r}")
    name = _text(n.name, f"the name of {op_type} node {i}") or f"{op_type}_{i}"
    label = f'{op_type} node "{name}"'
    attrs: dict[str, Any] = {}
    domain = _opset_domain(n.domain)
    opset = opsets.get(domain)
    declared = attribute_types(domain, op_type, opset) if opset is not None else None
    for a in n.attribute:
        key = _text(a.name, f"an attribute name of {label}")
        if key in attrs:
            raise GraphError(f"{label} has attribute {key!r} twice")
        if declared is not None and key in declared and a.type != declared[key]:
            raise GraphError(
                f"attribute {key!r} of {label} is of type {_attr_type_name(a.type)}; "
                f"{op_type} takes {_attr_type_name(declared[key])}"
            )
        try:
            attrs[key] = attribute_value(a, opsets, visible)
        except UnicodeDecodeError:
            raise GraphError(f"attribute {key!r} of {label} holds a string that is not UTF-8") from None
    if len(n.output) > max_outputs:
        raise GraphError(
            f"{label} names {len(n.output):,} outputs, more than {max_outputs:,} "
            "(DSP_MAX_NODE_OUTPUTS bounds them; raise it if the model really needs more)"
        )
    node = Node(
        op_type=op_type,
        inputs=[_text(x, f"an input name of {label}") for x in n.input],
        outputs=[_text(x, f"an output name of {label}") for x in n.output],
        attrs=attrs,
        name=name,
        domain=domain,
    )
    _unique([o for o in node.outputs if o], f"{label} names output")
    if has_op(node.op_type, node.domain):
        lookup(node.op_type, node.domain).check_arity(node.label(), len(node.inputs), len(node.outputs), attrs)
    return node


def _attr_type_name(code: int) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(code)
    except ValueError:
        return f"unknown ({code})"


def _check_agrees(v: Value, other: Value | None, gname: str) -> None:
    """GraphError when a value's two declarations (as input/output and in value_info) contradict."""
    if other is None or v.kind != "tensor" or other.kind != "tensor":
        return
    clash = v.dtype is not None and other.dtype is not None and v.dtype != other.dtype
    if v.shape is not None and other.shape is not None:
        clash |= len(v.shape) != len(other.shape) or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(v.shape, other.shape)
        )
    if clash:
        raise GraphError(
            f"graph {gname!r} declares {v.name!r} twice, differently: {v.describe()} and {other.describe()} "
            "in value_info"
        )


def _unique(names: list[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if not name:
            raise GraphError(f"{what} with an empty name (a graph's inputs, outputs and initializers need names)")
        if name in seen:
            raise GraphError(f"{what} {name!r} twice (ONNX names are unique)")
        seen.add(name)
