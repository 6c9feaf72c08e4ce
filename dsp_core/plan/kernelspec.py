"""A fusion group as a kernel generator reads it: its slots as nodes wired by flat value ids, and values.

Backend-neutral (no GPU, no compiler): a plugin that generates kernels for the core's fusion
groups (dsp-nvrtc's CUDA C) describes a group with ``node_specs`` and, once one step's shapes
are known, each value with a ``TensorSpec``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsp_core.plan.fusion import LAYOUT_OPS as LAYOUT_OPS  # a merged product's way to its KV store
from dsp_core.plan.plan import Plan


@dataclass(frozen=True)
class TensorSpec:
    """A value of one step: shape, dtype (numpy name), element strides (inputs only)."""

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class NodeSpec:
    """One slot of a group."""

    op: str
    inputs: tuple[int | None, ...]  # flat value ids
    outputs: tuple[int | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 17
    domain: str = ""
    name: str = ""


class Unsupported(Exception):
    """A group the generator's templates cannot generate; the message says why."""


@dataclass
class GroupSpec:
    """What a generator needs: the nodes in order, every value's spec, what is read and stored."""

    template: str
    nodes: list[NodeSpec]
    values: dict[int, TensorSpec]  # every value the nodes read or write (inputs with strides)
    inputs: list[int]  # values read from outside the group (device arrays)
    outputs: list[int]  # values stored (read outside the group)
    constants: Callable[[int], np.ndarray | None] = lambda v: None  # host copy of a small constant input
    # product template (dsp-triton): output -> (offset, width) along the product's last axis, for
    # sibling products merged into one (each output stored by its own lanes of the joined product)
    splits: dict[int, tuple[int, int]] = field(default_factory=dict)
    # decode attention (dsp-triton) split over the KV positions: {"kv_splits": S, "out": the weighted sum}
    params: dict[str, int] = field(default_factory=dict)


# The injective ops a generator computes as index arithmetic (a view or a pick of another
# value at a computed index): the same for every generator of the core's groups.
INDEX_OPS = frozenset(
    {
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Expand",
        "Transpose",
        "Slice",
        "Split",
        "Concat",
        "Gather",
        "GatherND",
    }
)


# The ops a generated row-reduction kernel computes (a last-axis reduction stage, or a norm or
# softmax that reduces its row): the same for every generator of the core's groups.
ROW_VALUED_OPS = frozenset(
    {
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSumExp",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
    }
)


# The greedy pick's keys: a float's bits, read as a signed integer of its width, give
# ``key = -(bits & magnitude) if bits < 0 else bits & magnitude``, which orders like the
# floats (-0 equal to +0); a magnitude above +inf's bits is a NaN, keyed above everything
# (numpy's argmax takes the first NaN). dtype -> (bits, magnitude mask, +inf's bits).
ORDERED_KEY_BITS: dict[str, tuple[int, int, int]] = {
    "float16": (16, 0x7FFF, 0x7C00),
    "bfloat16": (16, 0x7FFF, 0x7F80),
    "float32": (32, 0x7FFFFFFF, 0x7F800000),
    "float64": (64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


@dataclass(frozen=True)
class PickRows:
    """A greedy pick's [rows, vocab] logits as its generators lay them out over chunks."""

    width: int  # bits of the integer keys
    magnitude: int  # the mask of a key's magnitude bits
    inf: int  # +inf's bits: a magnitude above is a NaN
    rows: int
    vocab: int
    row_stride: int  # elements
    col_stride: int
    chunk: int  # elements of a row one program (block) reads
    chunks: int


def pick_rows(logits: TensorSpec, chunk: int) -> PickRows:
    """``logits`` [rows, vocab] split into chunks of at most ``chunk``, or Unsupported (the reference picks)."""
    got = ORDERED_KEY_BITS.get(logits.dtype)
    if got is None:
        raise Unsupported(f"a greedy pick over {logits.dtype}")
    if len(logits.shape) != 2 or logits.numel == 0:
        raise Unsupported(f"a greedy pick over {list(logits.shape)}")
    rows, vocab = logits.shape
    if vocab >= 2**31:
        raise Unsupported("a row of 2^31 values or more")
    rs, cs = logits.strides or tuple(row_major(logits.shape))
    blk = min(chunk, max(32, 1 << (vocab - 1).bit_length()))
    return PickRows(*got, rows, vocab, rs, cs, blk, (vocab + blk - 1) // blk)


def node_specs(plan: Plan, slots: Sequence[int]) -> list[NodeSpec]:
    """A group's slots as nodes, wired by flat value indexes."""
    return [
        NodeSpec(
            op=plan.slots[s].op,
            inputs=tuple(plan.flat(r) if r is not None else None for r in plan.slots[s].inputs),
            outputs=tuple(plan.flat(v) if v is not None else None for v in plan.slots[s].outputs),
            attrs=dict(plan.slots[s].attrs),
            opset=plan.slots[s].opset,
            domain=plan.slots[s].domain,
            name=plan.slots[s].name,
        )
        for s in slots
    ]


def gather_nd_layout(data: Sequence[int], indices: Sequence[int], batch_dims: int) -> tuple[int, int]:
    """(k, m) of a GatherND: the coordinates each index row holds and the output dims that walk
    ``indices``; Unsupported for a layout no generator takes (an empty last axis, too many coordinates)."""
    k = indices[-1] if indices else 0
    m = len(indices) - 1
    if k < 1 or batch_dims + k > len(data) or batch_dims > m:
        raise Unsupported(f"GatherND of {list(indices)} indices into {list(data)} with batch_dims {batch_dims}")
    return k, m


def row_major(shape: Sequence[int]) -> list[int]:
    """Element strides of a C-order array of ``shape``."""
    st, acc = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        st[k] = acc
        acc *= shape[k]
    return st


def reference_specs(
    local: Mapping[int, Any], in_flats: Sequence[int], inputs: Sequence[Any]
) -> tuple[dict[int, TensorSpec], list[int]]:
    """A group's values as one reference run left them (``local``: flat id -> array), as specs
    (the group's inputs with their element strides), and the inputs that live on the device.

    Unsupported when an input's strides are not whole elements.
    """
    values: dict[int, TensorSpec] = {}
    for flat, x in local.items():
        if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue
        strides = None
        if flat in in_flats and hasattr(x, "strides"):
            item = x.dtype.itemsize
            if any(s % item for s in x.strides):
                raise Unsupported(f"input {flat} has strides {x.strides} not in whole elements")
            strides = tuple(int(s) // item for s in x.strides)
        values[flat] = TensorSpec(tuple(int(d) for d in x.shape), str(x.dtype), strides)
    device = [f for f, x in zip(in_flats, inputs) if x is not None and not isinstance(x, np.ndarray | np.generic)]
    return values, device


# Value ids of merged sibling products' joined weights, biases and product (dsp::MergedMatMul).
MERGED_B, MERGED_C, MERGED_Y = -1001, -1002, -1003


def merged_operands(node: NodeSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The weights and biases of a ``dsp::MergedMatMul`` node (its parts in order)."""
    k = len(node.outputs)
    weights = node.inputs[1 : 1 + k]
    biases = node.inputs[1 + k :] if node.attrs.get("bias") else ()
    if node.inputs[0] is None or None in weights or None in biases or None in node.outputs:
        raise Unsupported("a merged product with a missing operand")
    return tuple(w for w in weights if w is not None), tuple(c for c in biases if c is not None)


def kv_store_nodes(spec: GroupSpec) -> list[NodeSpec]:
    """The group's ``dsp::KVScatter`` nodes: each the in-place store of a row the kernel computes."""
    return [n for n in spec.nodes if (n.domain, n.op) == ("dsp", "KVScatter")]


# -- decode attention groups (both generators' T4) ----------------------------------------------
def attention_nodes(spec: GroupSpec) -> tuple[NodeSpec, NodeSpec, NodeSpec]:
    """The scores product, the Softmax and the weighted-sum product of an attention group."""
    products = [n for n in spec.nodes if n.op == "MatMul" and n.domain in ("", "ai.onnx")]
    softmax = [n for n in spec.nodes if n.op == "Softmax"]
    if len(products) != 2 or len(softmax) != 1:
        raise Unsupported(f"an attention group of {len(products)} products and {len(softmax)} softmaxes (parts)")
    p1, sm, p2 = products[0], softmax[0], products[1]
    if not spec.nodes.index(p1) < spec.nodes.index(sm) < spec.nodes.index(p2):
        raise Unsupported("an attention group whose products and softmax are out of order")
    return p1, sm, p2


@dataclass(frozen=True)
class AttentionValues:
    """The values an attention group's kernel reads and makes: q, K and the scores of the first
    product; the softmax's input (after the scale and mask) and its probabilities; the weighted
    sum's first operand (the probabilities after any casts), V and the output."""

    q: int
    k: int
    scores: int
    x_in: int
    probs: int
    a: int
    v: int
    out: int


def attention_values(spec: GroupSpec) -> tuple[NodeSpec, NodeSpec, NodeSpec, AttentionValues]:
    """``attention_nodes`` and the values they connect, or Unsupported where an operand is missing."""
    p1, sm, p2 = attention_nodes(spec)
    got = (p1.inputs[0], p1.inputs[1], p1.outputs[0], sm.inputs[0], sm.outputs[0], p2.inputs[0], p2.inputs[1])
    out = p2.outputs[0] if p2.outputs else None
    if any(x is None for x in got) or out is None or len(p1.inputs) < 2 or len(p2.inputs) < 2:
        raise Unsupported("an attention group with a missing operand")
    q, k, scores, x_in, probs, a, v = (int(x) for x in got if x is not None)
    return p1, sm, p2, AttentionValues(q, k, scores, x_in, probs, a, v, out)


def value_side(nodes: Sequence[NodeSpec], weighted_sum: NodeSpec) -> set[int]:
    """Indexes into ``nodes`` of the ops that make the weighted sum's second operand (V's index
    arithmetic: GQA's expand, a transpose), up to a Softmax or a product."""
    producer = {v: j for j, n in enumerate(nodes) for v in n.outputs if v is not None}
    side: set[int] = set()
    stack = [weighted_sum.inputs[1] if len(weighted_sum.inputs) > 1 else None]
    while stack:
        r = stack.pop()
        j = producer.get(r) if r is not None else None
        if j is not None and j not in side and nodes[j].op not in ("Softmax", "MatMul"):
            side.add(j)
            stack.extend(nodes[j].inputs)
    return side


ATT_M, ATT_L, ATT_ACC = -2001, -2002, -2003  # a split attention's partial max, sum and weighted sum


def attention_split_specs(spec: GroupSpec, n_split: int) -> list[GroupSpec]:
    """A decode attention split over ``n_split`` ranges of KV positions: partials, then their combine."""
    p1, _, p2 = attention_nodes(spec)
    out = p2.outputs[0]
    assert out is not None
    batch = tuple(spec.values[out].shape[:-2])
    bh, d2 = max(1, math.prod(batch)), spec.values[out].shape[-1]
    values = dict(spec.values)
    values[ATT_M] = TensorSpec((bh, n_split), "float32", (n_split, 1))
    values[ATT_L] = TensorSpec((bh, n_split), "float32", (n_split, 1))
    values[ATT_ACC] = TensorSpec((bh, n_split, d2), "float32", (n_split * d2, d2, 1))
    partial = GroupSpec(
        "decode_attention",
        spec.nodes,
        values,
        list(spec.inputs),
        [ATT_M, ATT_L, ATT_ACC],
        spec.constants,
        params={"kv_splits": n_split},
    )
    i_p2 = spec.nodes.index(p2)
    epilogue = spec.nodes[i_p2 + 1 :]
    made = {v for n in spec.nodes[: i_p2 + 1] for v in n.outputs if v is not None}
    reads = [r for n in epilogue for r in n.inputs if r is not None and r in spec.inputs and r not in made]
    combine = GroupSpec(
        "decode_attention_combine",
        epilogue,
        values,
        [ATT_M, ATT_L, ATT_ACC, *dict.fromkeys(reads)],
        list(spec.outputs),
        spec.constants,
        params={"kv_splits": n_split, "out": out},
    )
    return [partial, combine]


def merged_spec(spec: GroupSpec, bias_shape: tuple[int, ...] | None) -> GroupSpec:
    """Merged siblings as one product: the joined weights (``MERGED_B``, a [K, sum N] view of a
    [sum N, K] buffer), the joined biases (``MERGED_C``), each part stored by its own lanes."""
    j = merged_index(spec)
    node = spec.nodes[j]
    prologue = spec.nodes[:j]  # a norm feeding the product
    weights, biases = merged_operands(node)
    form = str(node.attrs.get("form", "MatMul"))
    trans_b = bool(node.attrs.get("transB", 0)) and form == "Gemm"
    shapes = [spec.values[w].shape for w in weights]
    if any(len(sh) != 2 for sh in shapes):
        raise Unsupported("merged products of other than matrices")
    widths = [int(sh[0] if trans_b else sh[1]) for sh in shapes]
    kdim = int(shapes[0][1] if trans_b else shapes[0][0])
    values = dict(spec.values)
    dtype = spec.values[weights[0]].dtype
    values[MERGED_B] = TensorSpec((kdim, sum(widths)), dtype, (1, kdim))
    first = spec.values[node.outputs[0]]  # type: ignore[index]
    values[MERGED_Y] = TensorSpec((*first.shape[:-1], sum(widths)), first.dtype)
    a = node.inputs[0]
    assert a is not None
    operands: tuple[int, ...] = (a, MERGED_B)
    attrs: dict[str, Any] = {}
    if form == "Gemm":
        attrs = {"alpha": node.attrs.get("alpha", 1.0), "beta": node.attrs.get("beta", 1.0)}
        if biases:
            assert bias_shape is not None
            values[MERGED_C] = TensorSpec(bias_shape, spec.values[biases[0]].dtype, tuple(row_major(bias_shape)))
            operands = (a, MERGED_B, MERGED_C)
    product = NodeSpec(form, operands, (MERGED_Y,), attrs, node.opset, "", node.name)
    epilogue = spec.nodes[j + 1 :]
    # A unless a norm prologue makes it, then what the prologue (the residual, the norm's
    # scale) and the epilogue read, besides the parts' own weights and biases
    inputs = [r for r in operands if r in spec.inputs or r < 0]
    outside = [r for r in spec.inputs if r not in (*weights, *biases, a)]
    to_stores = all(n.op in LAYOUT_OPS or n in kv_store_nodes(spec) for n in epilogue)
    if epilogue and not to_stores:  # only two siblings of one width, each column of both in one program
        if len(widths) != 2 or widths[0] != widths[1] or form != "MatMul":
            raise Unsupported("an epilogue over merged products other than two MatMuls of one width")
        y0, y1 = node.outputs
        assert y0 is not None and y1 is not None
        paired = {"paired": widths[0], "y0": y0, "y1": y1}
        nodes = [*prologue, product, *epilogue]
        ins = [*inputs, *outside]  # what the prologue and epilogue read
        return GroupSpec("product", nodes, values, ins, list(spec.outputs), spec.constants, params=paired)
    splits: dict[int, tuple[int, int]] = {}
    offset = 0
    for y, width in zip(node.outputs, widths):
        assert y is not None
        splits[y] = (offset, width)
        offset += width
    nodes = [*prologue, product, *epilogue]  # an epilogue here: a part's way to its KV store
    return GroupSpec("product", nodes, values, [*inputs, *outside], list(spec.outputs), spec.constants, splits)


def merged_index(spec: GroupSpec) -> int:
    """Where a group's ``dsp::MergedMatMul`` node is (after its prologue), or -1."""
    return next((j for j, n in enumerate(spec.nodes) if n.op == "MergedMatMul" and n.domain == "dsp"), -1)
