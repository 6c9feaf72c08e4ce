"""The last-position rewrite: a decoder's prefill graph computing the logits of its last position only.

A prefill of n tokens computes ``logits`` ``[B, n, V]``, and the pipeline reads only the
last position's (``logits[:, -1]``: what the next token is chosen from). The LM head's
product is the prefill's widest (GPT-2 124M: 768 x 50257 per position, about a third of a
32-token prefill's multiply-adds, though one row of it still reads the whole weight) and
its output the biggest value. As transformers' ``logits_to_keep=1`` does,
``last_position_logits(graph)`` has the head read the last position alone::

    logits = Mul(MatMul(hidden, W), c)   ->   logits = Mul(MatMul(Slice(hidden, -1:, axis=-2), W), c)

The head is the ``MatMul`` of a rank-3 hidden state ``[B, n, D]`` and a rank-2 weight
whose output reaches ``logits`` through position-wise ops only: ``Cast``, ``Identity``,
``Tanh``, and ``Add``/``Sub``/``Mul``/``Div`` with a constant that does not vary along
the positions (a bias, a scale, a softcap's divisor and multiplier). Every value on that
path must be read by the next op alone. Their declared shapes, and the output's, become
``[B, 1, V]``; nothing else of the graph changes (the presents are the same values).

When no such head is found (a ``Gemm`` over rows that flatten the batch and the
positions, a product whose output something else reads, a graph without ``logits``), the
graph is returned unchanged with the reason (``LastLogits.reason``): the prefill then
computes every position, as before. A head already reading a one-position ``Slice`` of
this form (a graph this rewrite made) is kept as it is.

The values of the kept position are those of the original graph's last position, up to
the product's rounding: a one-row product may sum in another order than a many-row one
(numpy hands it to BLAS's gemv rather than its gemm), a difference in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsp_core.errors import DSPError
from dsp_core.ir.graph import Dim, Graph, Node, Value

INT64_MAX = np.iinfo(np.int64).max
POSITION_WISE = ("Cast", "Identity", "Tanh")  # one input, one output, each position on its own
BY_CONSTANT = ("Add", "Sub", "Mul", "Div")  # position-wise when the other operand is a constant without positions
LAST = "last position"  # LastLogits.kept when the head reads the last position only
ALL = "all positions"


class LMHeadNotFound(DSPError):
    """No LM head whose input can be cut to the last position (the reason names the node)."""


@dataclass(frozen=True)
class LMHead:
    """The product that makes ``logits``, and the position-wise nodes between it and the output."""

    node: int  # index of the MatMul in graph.nodes
    hidden: str  # its first input: the hidden states [B, n, D]
    path: tuple[int, ...]  # indexes of the nodes from the MatMul's output to the logits, in graph order
    sliced: bool = False  # the hidden states are already a last-position Slice (nothing to insert)


@dataclass(frozen=True)
class LastLogits:
    """The prefill graph and what the rewrite did: the head it cut, or why it left the graph as it was."""

    graph: Graph
    head: str | None = None  # the LM head's node (label) when the logits are the last position's alone
    reason: str = ""  # why the graph is unchanged (empty when it computes the last position only)

    @property
    def kept(self) -> str:
        """'last position', or 'all positions (<reason>)': how the pipeline reports it."""
        return LAST if self.head is not None else f"{ALL} ({self.reason})"


def last_position_logits(graph: Graph, logits: str = "logits") -> LastLogits:
    """``graph`` with its LM head reading the last position only, or unchanged with the reason (module doc)."""
    try:
        head = find_lm_head(graph, logits)
    except LMHeadNotFound as exc:
        return LastLogits(graph, reason=str(exc))
    label = graph.nodes[head.node].label()
    if head.sliced:
        return LastLogits(graph, head=label)
    return LastLogits(_cut(graph, head, logits), head=label)


def find_lm_head(graph: Graph, logits: str = "logits") -> LMHead:
    """The LM head of ``logits`` (walking back through position-wise ops); LMHeadNotFound says why not."""
    if logits not in graph.output_names:
        raise LMHeadNotFound(f"graph {graph.name!r} has no output {logits!r}")
    if graph.opsets.get("", 1) < 10:
        raise LMHeadNotFound(f"opset {graph.opsets.get('', 1)}: Slice takes its positions as inputs from opset 10")
    producers, readers = graph.producers(), _reader_counts(graph)
    constants = _constant_shapes(graph)
    path: list[int] = []
    value = logits
    while True:
        index = producers.get(value)
        if index is None:
            raise LMHeadNotFound(f"{logits!r} is not computed by a node (a graph input or constant)")
        node = graph.nodes[index]
        if readers.get(value, 0) != (1 if path else 0) or (path and value in graph.output_names):
            raise LMHeadNotFound(f"{value!r} (the output of {node.label()}) is read elsewhere too: kept whole")
        if node.op_type in ("MatMul", "Gemm") and node.domain == "":
            break
        value = _position_wise_input(node, constants)
        path.append(index)
    _check_product(graph, node, logits)
    hidden = node.inputs[0]
    return LMHead(index, hidden, tuple(reversed(path)), _keeps_last(graph, producers.get(hidden)))


def _position_wise_input(node: Node, constants: dict[str, tuple[int, ...]]) -> str:
    """The input a position-wise node carries the positions through; LMHeadNotFound for any other node."""
    if node.domain == "" and node.op_type in POSITION_WISE and len(node.inputs) == 1 and len(node.outputs) == 1:
        return node.inputs[0]
    if node.domain == "" and node.op_type in BY_CONSTANT and len(node.inputs) == 2:
        fed = [name for name in node.inputs if name not in constants]
        const = [name for name in node.inputs if name in constants]
        if len(fed) == 1 and len(const) == 1 and _no_positions(constants[const[0]]):
            return fed[0]
    raise LMHeadNotFound(
        f"{node.label()} lies between the LM head and the logits: only Cast, Identity, Tanh and "
        "Add/Sub/Mul/Div by a constant without positions can be walked back through"
    )


def _no_positions(shape: tuple[int, ...]) -> bool:
    """A constant operand that broadcasts along the positions (axis -2 of a rank-3 value): the same for each."""
    return len(shape) <= 1 or (len(shape) <= 3 and shape[-2] == 1)


def _check_product(graph: Graph, node: Node, logits: str) -> None:
    """The head is a MatMul of rank-3 hidden states and a rank-2 weight: its axis -2 is the positions'."""
    if node.op_type == "Gemm":
        raise LMHeadNotFound(
            f"{node.label()} makes {logits!r}: a Gemm's rows are the batch and the positions flattened, "
            "so its last row is not each row's last position"
        )
    weight = graph.info(node.inputs[1])
    if weight is None or weight.shape is None or len(weight.shape) != 2:
        raise LMHeadNotFound(f"{node.label()}: its weight {node.inputs[1]!r} is not known to be a matrix")
    rank = next((len(s) for s in (_shape(graph, n) for n in (node.inputs[0], node.outputs[0], logits)) if s), None)
    if rank != 3:
        what = "unknown" if rank is None else str(rank)
        raise LMHeadNotFound(f"{node.label()}: its hidden states have rank {what}, expected [batch, positions, hidden]")


def _keeps_last(graph: Graph, index: int | None) -> bool:
    """Node ``index`` is ``Slice(x, [-1], [INT64_MAX], [-2])`` (or axis 1, the same of rank 3): the last position."""
    if index is None:
        return False
    node = graph.nodes[index]
    parts = [name for name in node.inputs[1:] if name]
    if node.op_type != "Slice" or node.domain != "" or len(parts) not in (3, 4) or len(node.inputs) > 5:
        return False
    values = [_constant_value(graph, name) for name in parts]
    if any(v is None or v.size != 1 for v in values):
        return False
    start, end, axis, *step = (int(v.reshape(-1)[0]) for v in values if v is not None)
    return start == -1 and end >= INT64_MAX // 2 and axis in (-2, 1) and step in ([], [1])


def _cut(graph: Graph, head: LMHead, logits: str) -> Graph:
    """The graph with ``Slice(hidden, -1:, axis=-2)`` before the head, and the shapes on its path at one position."""
    node = graph.nodes[head.node]
    taken = set(graph.initializers) | {v.name for v in graph.inputs} | set(graph.value_info)
    taken |= {name for n in graph.nodes for name in n.outputs}
    stem = _fresh(f"{node.name or head.hidden}/last_position", taken)
    starts, ends, axes, last = (f"{stem}/{part}" for part in ("starts", "ends", "axes", "hidden"))
    initializers = dict(graph.initializers)  # the weights themselves are shared, not copied
    initializers[starts] = np.array([-1], np.int64)
    initializers[ends] = np.array([INT64_MAX], np.int64)
    initializers[axes] = np.array([-2], np.int64)
    cut = Node("Slice", [head.hidden, starts, ends, axes], [last], {}, stem)
    product = Node(node.op_type, [last, *node.inputs[1:]], list(node.outputs), dict(node.attrs), node.name, node.domain)
    nodes = [*graph.nodes[: head.node], cut, product, *graph.nodes[head.node + 1 :]]
    value_info = dict(graph.value_info)
    hidden = graph.info(head.hidden)
    if hidden is not None and hidden.shape is not None:
        value_info[last] = Value(last, hidden.dtype, _one_position(hidden.shape))
    for name in [node.outputs[0], *(graph.nodes[i].outputs[0] for i in head.path)]:
        info = value_info.get(name)
        if info is not None and info.shape is not None:
            value_info[name] = Value(name, info.dtype, _one_position(info.shape), info.kind)
    outputs = [
        Value(v.name, v.dtype, _one_position(v.shape), v.kind) if v.name == logits and v.shape is not None else v
        for v in graph.outputs
    ]
    out = Graph(
        name=graph.name,
        inputs=list(graph.inputs),
        outputs=outputs,
        nodes=nodes,
        initializers=initializers,
        value_info=value_info,
        opsets=dict(graph.opsets),
        outer_names=graph.outer_names,
        variables=set(graph.variables),
    )
    out.validate()
    return out


def _one_position(shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """``shape`` with its positions' axis (-2) at 1."""
    return (*shape[:-2], 1, shape[-1]) if len(shape) >= 2 else shape


def _shape(graph: Graph, name: str) -> tuple[Dim, ...] | None:
    info = graph.info(name)
    return info.shape if info is not None else None


def _fresh(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem_2``, ``stem_3``...: the first name the graph does not use (nor its parts)."""
    name, k = stem, 1
    while any(n == name or n.startswith(f"{name}/") for n in taken):
        k += 1
        name = f"{stem}_{k}"
    return name


def _reader_counts(graph: Graph) -> dict[str, int]:
    """Per value name, how many nodes read it."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _constant_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The shapes of the graph's initializers and Constant node outputs."""
    shapes = {k: tuple(np.shape(v)) for k, v in graph.initializers.items()}
    for node in graph.nodes:
        if node.op_type == "Constant" and node.domain == "" and node.outputs and "value" in node.attrs:
            shapes[node.outputs[0]] = tuple(np.shape(node.attrs["value"]))
    return shapes


def _constant_value(graph: Graph, name: str) -> np.ndarray | None:
    """An initializer's or a Constant node's value, or None."""
    if name in graph.initializers:
        return np.asarray(graph.initializers[name])
    for node in graph.nodes:
        if node.op_type == "Constant" and node.domain == "" and name in node.outputs and "value" in node.attrs:
            return np.asarray(node.attrs["value"])
    return None
