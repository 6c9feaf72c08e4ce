"""The fixed-KV-buffer rewrite: a decoder graph -> its decode graph with persistent KV buffers.

A decoder exported with a KV cache grows it every step: per layer,
``present.N.key = Concat(past_key_values.N.key, new_key, axis=seq)`` (eager exports and
the opset-23 fused-``Attention`` exports alike: the join happens outside the op). Fed
as is, every decode step has a new shape (past grows by one), so a plan captured for
one step cannot replay the next.

``fixed_kv_buffers(graph, batch=B, max_length=L)`` returns a graph whose shapes never
change:

- each ``past_key_values.N.*`` input becomes a persistent buffer ``[B, H, L, D]`` (a
  VARIABLE: read in place, never staged or copied);
- each growth ``Concat`` becomes ``dsp::KVScatter(buffer, new, kv_position)``: the step's
  K/V are written into the buffer in place at the device-resident position
  ``kv_position`` (a new int64 ``[1]`` input), and the op returns the buffer itself, so
  attention reads the whole buffer;
- every shape read of a past input (``Shape``/``Size``) becomes a constant, as if the
  past were ``L - 1`` long: the graph's own causal/padding mask logic then sees a
  constant total length ``L``; the ``attention_mask`` input (``[B, L]``, ones on the
  valid positions) masks the unused tail, and the causal part is all-true for the one
  query (position ``L - 1`` as far as the graph knows), which is right because only
  positions up to the current one are valid;
- the outputs are ``logits`` and ``next_token`` (greedy ``ArgMax`` in the plan); the
  ``present.*`` outputs are dropped (they would alias the buffers, and a plan output
  is copied for its caller).

A past may reach its growth Concat through copies (``Identity``, a one-input ``Concat``:
torch's TorchScript exporter writes ``Concat(past_key_values.0.key)`` and reads its
output); a copy is the buffer itself: it is dropped and its readers read the buffer.

The rewrite declines (KVTransformError, with the node) when a past input is read by
anything but the growth Concat and shape reads, or when a fused ``Attention`` node takes
the cache itself (``past_key``/``past_value`` inputs).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsp_core.errors import DSPError
from dsp_core.ir.graph import Graph, Node, Value

PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
POSITION_INPUT = "kv_position"
NEXT_TOKEN = "next_token"
PASS_THROUGH = ("Identity", "Concat")  # with one input: the output is the input (see _is_pass_through)


class KVTransformError(DSPError):
    """The decoder's KV cache could not be rewritten into fixed buffers (names the node)."""


@dataclass(frozen=True)
class KVGrowth:
    """One layer's K or V growth: ``present = Concat(past, new, axis)``."""

    layer: int
    kind: str  # "key" or "value"
    past: str  # the graph input (becomes the buffer)
    new: str  # the step's keys or values
    present: str  # the Concat output (becomes the KVScatter output, aliasing the buffer)
    axis: int  # the sequence axis, negative
    node: str  # the Concat node's name
    aliases: tuple[str, ...] = ()  # values equal to the past through pass-through nodes (TorchScript exports)
    passes: tuple[str, ...] = ()  # the pass-through nodes' names (dropped: their readers read the buffer)


@dataclass
class KVLayout:
    """What the pipeline needs to feed a decode plan: the fixed-KV graph's interface, without the graph.

    A warm start (dsp_core/llm/store.py) reads it from the disk cache beside the decode
    plan, so the graph is neither imported nor rewritten.
    """

    growth: tuple[KVGrowth, ...]
    batch: int
    max_length: int
    buffer_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffer_dtypes: dict[str, str] = field(default_factory=dict)
    position_input: str = POSITION_INPUT
    logits: str = "logits"
    next_token: str = NEXT_TOKEN
    input_dtypes: dict[str, str] = field(default_factory=dict)  # the fed inputs' declared dtypes (input_ids, ...)

    def layout(self) -> KVLayout:
        """This interface alone (a FixedKVGraph's without its graph)."""
        return KVLayout(
            self.growth,
            self.batch,
            self.max_length,
            dict(self.buffer_shapes),
            dict(self.buffer_dtypes),
            self.position_input,
            self.logits,
            self.next_token,
            dict(self.input_dtypes),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of the layout (``from_json`` reads it back)."""
        return {
            "growth": [dataclasses.asdict(g) for g in self.growth],
            "batch": self.batch,
            "max_length": self.max_length,
            "buffer_shapes": {k: list(v) for k, v in self.buffer_shapes.items()},
            "buffer_dtypes": dict(self.buffer_dtypes),
            "position_input": self.position_input,
            "logits": self.logits,
            "next_token": self.next_token,
            "input_dtypes": dict(self.input_dtypes),
        }

    @classmethod
    def from_json(cls, data: Any) -> KVLayout:
        """The layout ``to_json`` wrote; ValueError naming the field when anything is missing or mistyped."""
        if not isinstance(data, dict):
            raise ValueError(f"KV layout: expected a JSON object, got {type(data).__name__}")
        growth = tuple(_growth_from_json(g) for g in _typed(data, "growth", list))
        shapes = _typed(data, "buffer_shapes", dict)
        for name, shape in shapes.items():
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"KV layout: buffer_shapes[{name!r}] is not a list of sizes: {shape!r}")
        layout = cls(
            growth,
            _typed(data, "batch", int),
            _typed(data, "max_length", int),
            {str(k): tuple(v) for k, v in shapes.items()},
            _str_map(data, "buffer_dtypes"),
            _typed(data, "position_input", str),
            _typed(data, "logits", str),
            _typed(data, "next_token", str),
            _str_map(data, "input_dtypes"),
        )
        pasts = {g.past for g in growth}
        if set(layout.buffer_shapes) != pasts or set(layout.buffer_dtypes) != pasts:
            raise ValueError("KV layout: the buffers do not match the growth list")
        return layout


def _typed(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if type(value) is not kind:
        raise ValueError(f"KV layout: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _str_map(data: dict[str, Any], key: str) -> dict[str, str]:
    value = _typed(data, key, dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"KV layout: {key!r} must map names to dtype names")
    return dict(value)


def _growth_from_json(data: Any) -> KVGrowth:
    if not isinstance(data, dict):
        raise ValueError(f"KV layout: a growth entry must be a JSON object, got {data!r}")
    fields = {f.name: f.type for f in dataclasses.fields(KVGrowth)}
    if set(data) != set(fields):
        raise ValueError(f"KV layout: a growth entry has fields {sorted(data)}, expected {sorted(fields)}")
    ints, tuples = ("layer", "axis"), ("aliases", "passes")
    for key, value in data.items():
        ok = (
            type(value) is int
            if key in ints
            else isinstance(value, list) and all(isinstance(v, str) for v in value)
            if key in tuples
            else isinstance(value, str)
        )
        if not ok:
            raise ValueError(f"KV layout: growth field {key!r} has the wrong type: {value!r}")
    return KVGrowth(
        data["layer"],
        data["kind"],
        data["past"],
        data["new"],
        data["present"],
        data["axis"],
        data["node"],
        tuple(data["aliases"]),
        tuple(data["passes"]),
    )


@dataclass
class FixedKVGraph(KVLayout):
    """The decode graph and what the pipeline needs to feed it (its KVLayout)."""

    graph: Graph = field(kw_only=True)


def past_inputs(graph: Graph) -> list[str]:
    """The graph inputs named ``past_key_values.N.key|value``, in graph order."""
    return [n for n in graph.input_names if PAST.match(n)]


def find_kv_growth(graph: Graph) -> list[KVGrowth]:
    """Every ``Concat(past_key_values.N.*, new, axis=seq)`` of the graph; KVTransformError if one is missing.

    The past may reach its growth Concat through pass-through nodes (``Identity``, a
    one-input ``Concat``): torch's TorchScript exporter writes
    ``Concat(past_key_values.0.key)`` once, whose output the mask logic's ``Shape`` and
    the growth Concat both read. Those copies are recorded as ``aliases`` of the past.
    """
    pasts = past_inputs(graph)
    if not pasts:
        raise KVTransformError(
            f"graph {graph.name!r} has no past_key_values.N.key/value inputs: not a decoder with a KV cache"
        )
    _check_fused_attention(graph, set(pasts))
    readers = _readers(graph)
    found: list[KVGrowth] = []
    for past in pasts:
        match = PAST.match(past)
        assert match is not None
        aliases, passes = _aliases(graph, past, readers)
        names = {past, *aliases}
        concat = [n for n in graph.nodes if n.op_type == "Concat" and len(n.inputs) == 2 and n.inputs[0] in names]
        if len(concat) != 1:
            raise KVTransformError(_growth_missing(past, concat, names, readers))
        node = concat[0]
        info = graph.info(past)
        rank = len(info.shape) if info is not None and info.shape is not None else 4
        axis = int(node.attrs.get("axis", 0))
        axis = axis - rank if axis >= 0 else axis
        if axis != -2:
            raise KVTransformError(f"{node.label()}: joins {past!r} on axis {axis}, expected the sequence axis -2")
        found.append(
            KVGrowth(
                int(match.group(1)),
                match.group(2),
                past,
                node.inputs[1],
                node.outputs[0],
                axis,
                node.name,
                tuple(aliases),
                tuple(passes),
            )
        )
    return found


def _readers(graph: Graph) -> dict[str, list[Node]]:
    """Per value name, the nodes that read it (graph order)."""
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            if name:
                readers.setdefault(name, []).append(node)
    return readers


def _is_pass_through(node: Node) -> bool:
    """A node whose one output equals its one input: Identity, or a Concat of a single input."""
    return node.op_type in PASS_THROUGH and len(node.inputs) == 1 and len(node.outputs) == 1


def _aliases(graph: Graph, past: str, readers: dict[str, list[Node]]) -> tuple[list[str], list[str]]:
    """The values equal to ``past`` through pass-through nodes, and those nodes' names."""
    aliases: list[str] = []
    passes: list[str] = []
    todo = [past]
    while todo:
        for node in readers.get(todo.pop(), []):
            if _is_pass_through(node) and node.outputs[0] not in aliases:
                if node.outputs[0] in graph.output_names:
                    raise KVTransformError(
                        f"{node.label()} copies the KV cache {past!r} to the graph output {node.outputs[0]!r}: "
                        "the fixed-KV rewrite needs the past read only by its growth Concat and shape reads"
                    )
                aliases.append(node.outputs[0])
                passes.append(node.name)
                todo.append(node.outputs[0])
    return aliases, passes


def _growth_missing(past: str, concat: list[Node], names: set[str], readers: dict[str, list[Node]]) -> str:
    """What was found reading ``past`` (and its copies), and what the rewrite needs instead."""
    found = [n for name in sorted(names) for n in readers.get(name, [])]
    seen = ", ".join(dict.fromkeys(n.label() for n in found)) or "no node at all"
    what = (
        f"{len(concat)} two-input Concat nodes ({', '.join(n.label() for n in concat)})"
        if concat
        else "no two-input Concat"
    )
    return (
        f"input {past!r}: the fixed-KV rewrite needs exactly one Concat({past}, new, axis=-2) growing the cache "
        f"(directly or through Identity / one-input Concat copies); found {what} among its readers: {seen}"
    )


def _check_fused_attention(graph: Graph, pasts: set[str]) -> None:
    for node in graph.nodes:
        if node.op_type == "Attention" and any(name in pasts for name in node.inputs[4:6]):
            raise KVTransformError(
                f"{node.label()} takes the KV cache itself (past_key/past_value inputs): the fixed-KV rewrite "
                "needs the cache joined by a Concat outside the op (re-export, or run without fixed buffers)"
            )


def fixed_kv_buffers(
    graph: Graph, *, batch: int, max_length: int, logits: str = "logits", position_input: str = POSITION_INPUT
) -> FixedKVGraph:
    """The decode graph of ``graph`` with persistent KV buffers of ``max_length`` (see the module doc)."""
    if max_length < 2:
        raise KVTransformError(f"max_length must be at least 2, got {max_length}")
    growth = find_kv_growth(graph)
    by_past = {g.past: g for g in growth}
    if logits not in graph.output_names:
        raise KVTransformError(f"graph {graph.name!r} has no output {logits!r}; outputs are {graph.output_names}")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes_: dict[str, str] = {}
    virtual: dict[str, tuple[int, ...]] = {}  # the past shapes the graph's shape logic sees: length L - 1
    for past in by_past:
        info = graph.info(past)
        if (
            info is None
            or info.shape is None
            or len(info.shape) != 4
            or not all(isinstance(d, int) for d in (info.shape[1], info.shape[3]))
        ):
            raise KVTransformError(f"input {past!r}: needs a declared [batch, heads, past, head_dim] shape")
        heads, dim = int(info.shape[1]), int(info.shape[3])  # type: ignore[arg-type]
        shapes[past] = (batch, heads, max_length, dim)
        virtual[past] = (batch, heads, max_length - 1, dim)
        dtypes_[past] = info.dtype or "float32"
    alias = {a: g.past for g in growth for a in g.aliases}  # a copy of a past is the buffer itself
    nodes: list[Node] = []
    for node in graph.nodes:
        if _is_pass_through(node) and node.outputs[0] in alias:
            continue  # its readers read the buffer itself
        if any(name in alias for name in node.inputs):
            node = Node(
                node.op_type,
                [alias.get(name, name) for name in node.inputs],
                list(node.outputs),
                dict(node.attrs),
                node.name,
                node.domain,
            )
        reads = [name for name in node.inputs if name in by_past]
        if not reads:
            nodes.append(node)
        elif node.op_type == "Concat" and node.inputs[0] in by_past and by_past[node.inputs[0]].present in node.outputs:
            g = by_past[node.inputs[0]]
            nodes.append(
                Node(
                    "KVScatter",
                    [g.past, g.new, position_input],
                    [g.present],
                    {"axis": g.axis},
                    f"{node.name}/kv_scatter",
                    "dsp",
                )
            )
        elif node.op_type in ("Shape", "Size"):
            nodes.append(_shape_constant(node, virtual[reads[0]]))
        else:
            raise KVTransformError(
                f"{node.label()} reads the KV cache {reads[0]!r} directly: only the growth Concat and shape reads "
                "can be rewritten onto a fixed buffer"
            )
    logits_info = graph.info(logits)
    vocab = logits_info.shape[-1] if logits_info is not None and logits_info.shape else None
    nodes.append(Node("ArgMax", [logits], [NEXT_TOKEN], {"axis": -1, "keepdims": 0}, "dsp/greedy_next_token"))
    inputs: list[Value] = []
    for v in graph.inputs:
        if v.name in graph.initializers:
            inputs.append(v)
        elif v.name in shapes:
            inputs.append(Value(v.name, dtypes_[v.name], shapes[v.name]))
        elif v.name == "attention_mask":
            inputs.append(Value(v.name, v.dtype, (batch, max_length)))
        elif v.name in ("input_ids", "position_ids"):
            inputs.append(Value(v.name, v.dtype, (batch, 1)))
        else:
            inputs.append(v)
    inputs.append(Value(position_input, "int64", (1,)))
    outputs = [
        Value(logits, logits_info.dtype if logits_info else None, (batch, 1, vocab)),
        Value(NEXT_TOKEN, "int64", (batch, 1)),
    ]
    dropped = {g.present for g in growth}
    dropped |= set(alias)
    value_info = {k: v for k, v in graph.value_info.items() if k not in dropped}
    out = Graph(
        name=f"{graph.name}/decode_fixed_kv",
        inputs=inputs,
        outputs=outputs,
        nodes=nodes,
        initializers=graph.initializers,  # shared: the weights are not copied
        value_info=value_info,
        opsets={**graph.opsets, "dsp": 1},
        variables=set(graph.variables) | set(shapes),
    )
    out.validate()
    declared = {v.name: v.dtype for v in graph.inputs if v.name in ("input_ids", "position_ids", "attention_mask")}
    fed = {name: dtype for name, dtype in declared.items() if dtype}
    return FixedKVGraph(
        tuple(growth), batch, max_length, shapes, dtypes_, position_input, logits, input_dtypes=fed, graph=out
    )


def _shape_constant(node: Node, shape: tuple[int, ...]) -> Node:
    """A Shape/Size node of a past input, folded for the virtual past shape."""
    if node.op_type == "Size":
        value = np.asarray(int(np.prod(shape)), dtype=np.int64)
    else:
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        value = np.asarray(shape[start : None if end is None else int(end)], dtype=np.int64)
    return Node("Constant", [], list(node.outputs), {"value": value}, f"{node.name}/fixed_kv", "")
