"""K greedy decode steps as ONE plan: step, sample, scatter, advance, unrolled K times.

``unroll(fixed, k)`` chains k copies of the fixed-KV decode graph (see kv.py): copy ``i``
reads the token copy ``i - 1`` chose (``next_token``, the in-plan greedy ArgMax), its
position and attention mask are the block's inputs advanced by ``i`` (computed in the
graph), and its KV reads go through the KVScatter outputs of copy ``i - 1`` (the same
buffers, written in place). The block's output is ``tokens`` ``[B, k]``. Compiled, it is
one plan whose shapes never change: a capturing backend records the whole block once
and then replays it once per K tokens (on a GPU: one graph launch per K tokens), and the
host reads the K tokens once, after the block.

After a block the caller advances the state by K (device-side, ``BlockHook``): the KV
buffers already hold the block's keys and values.

Shape-static nodes (``Shape``/``Size`` of any value, and whatever is computed from them
and constants alone) give the same value in every copy, because every copy has the same
shapes. Copies ``i >= 1`` do not repeat them: they read copy 0's. This is not only
smaller: in copy 0 those nodes read fed inputs and are sealed when the plan freezes,
whereas copy ``i``'s would read values computed in the block (the previous token, the
advanced mask), and a shape computed every step is a host read that a CUDA graph
cannot hold (Reshape's shape, Expand's shape, Slice's starts...).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dsp_core.errors import DSPError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Node, Value
from dsp_core.llm.kv import FixedKVGraph
from dsp_core.llm.sampling import GREEDY, Sampling
from dsp_core.ops.registry import Trait, has_op, lookup

TOKENS = "tokens"
UNIFORMS = "dsp/block/uniforms"  # [k, B] float64: a sampled block's random numbers, fed per block
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask")


class BlockUnrollError(DSPError):
    """The decode graph cannot be unrolled into a K-step block (the reason names what)."""


def unroll(fixed: FixedKVGraph, k: int, sampling: Sampling = GREEDY) -> Graph:
    """The K-step block graph of a fixed-KV decode graph.

    Greedy: copy ``i``'s token is the graph's own ArgMax (``next_token``). Sampled: the
    block takes one more input, ``UNIFORMS`` [k, B] float64, and copy ``i`` draws its
    token with ``dsp::Sample`` (the sampling's temperature, top-k, top-p as attributes)
    from its logits and row ``i`` of the uniforms.
    """
    if k < 1:
        raise BlockUnrollError(f"a block needs k >= 1 steps, got {k}")
    g = fixed.graph
    if any(True for _ in g.subgraphs()):
        raise BlockUnrollError("the decode graph has subgraphs (If/Loop/Scan): it is not unrolled")
    inputs = {v.name for v in g.inputs}
    buffers = {growth.past: growth.present for growth in fixed.growth}
    known = set(STEP_INPUTS) | {fixed.position_input} | set(buffers)
    if inputs - known:
        raise BlockUnrollError(f"the decode graph has inputs a block cannot advance: {sorted(inputs - known)}")
    block = Graph(
        name=f"{g.name}_block{k}",
        inputs=list(g.inputs),
        nodes=[],
        initializers=dict(g.initializers),
        opsets=dict(g.opsets),
        variables=set(g.variables),
    )
    block.initializers["dsp/block/range"] = np.arange(fixed.max_length, dtype=np.int64)
    if not sampling.greedy:
        block.inputs.append(Value(UNIFORMS, "float64", (k, fixed.batch)))
    static = shape_static(g)
    chosen = [f"b{i}/{fixed.next_token}" if sampling.greedy else f"b{i}/dsp_token" for i in range(k)]
    for i in range(k):
        feeds = _step_feeds(block, fixed, buffers, i, chosen)
        if i:
            feeds.update({out: f"b0/{out}" for j in static for out in g.nodes[j].outputs if out})
        for j, node in enumerate(g.nodes):
            if i and j in static:
                continue
            block.nodes.append(
                Node(
                    node.op_type,
                    [_name(n, i, feeds, g) for n in node.inputs],
                    [f"b{i}/{n}" if n else "" for n in node.outputs],
                    dict(node.attrs),
                    f"b{i}/{node.name}",
                    node.domain,
                )
            )
        for name, info in g.value_info.items():
            block.value_info[f"b{i}/{name}"] = Value(f"b{i}/{name}", info.dtype, info.shape)
        if not sampling.greedy:
            _sample_node(block, fixed, sampling, i)
    block.nodes.append(Node("Concat", chosen, [TOKENS], {"axis": 1}, "dsp/block/tokens"))
    block.outputs = [Value(TOKENS, "int64", (fixed.batch, k))]
    block.validate()
    return block


def block_key(batch: int, k: int, sampling: Sampling = GREEDY) -> tuple[Any, ...]:
    """The key of a block plan: (batch, k) when greedy, plus what the sampling bakes in."""
    if sampling.greedy:
        return (batch, k)
    return (batch, k, sampling.temperature, sampling.top_k, sampling.top_p)


def shape_static(g: Graph) -> set[int]:
    """Indexes of the nodes whose outputs depend only on shapes and constants (equal in every copy)."""
    static_values = set(g.initializers)
    static: set[int] = set()
    for j, node in enumerate(g.nodes):
        if not has_op(node.op_type, node.domain):
            continue
        opdef = lookup(node.op_type, node.domain)
        if opdef.has(Trait.RANDOM) or opdef.has(Trait.MUTATES_INPUT):
            continue
        if opdef.has(Trait.SHAPE_ONLY_OUTPUT) or all(not n or n in static_values for n in node.inputs):
            static.add(j)
            static_values.update(n for n in node.outputs if n)
    return static


def _name(name: str, i: int, feeds: dict[str, str], g: Graph) -> str:
    """What copy ``i`` reads for graph value ``name``."""
    if not name or name in g.initializers:
        return name
    if name in feeds:
        return feeds[name]
    return f"b{i}/{name}"


def _sample_node(block: Graph, fixed: FixedKVGraph, sampling: Sampling, i: int) -> None:
    """Copy ``i``'s token drawn from its logits with row ``i`` of the block's uniforms."""
    row = f"dsp/block/row{i}"
    block.initializers[row] = np.array(i, dtype=np.int64)
    block.nodes.append(Node("Gather", [UNIFORMS, row], [f"b{i}/dsp_uniform"], {"axis": 0}, f"b{i}/dsp_uniform"))
    attrs = {"temperature": float(sampling.temperature), "top_k": int(sampling.top_k), "top_p": float(sampling.top_p)}
    block.nodes.append(
        Node(
            "Sample",
            [f"b{i}/{fixed.logits}", f"b{i}/dsp_uniform"],
            [f"b{i}/dsp_token"],
            attrs,
            f"b{i}/dsp_sample",
            "dsp",
        )
    )


def _step_feeds(
    block: Graph, fixed: FixedKVGraph, buffers: dict[str, str], i: int, chosen: list[str]
) -> dict[str, str]:
    """Copy ``i``'s inputs: the block's own for i == 0, else computed from copy ``i - 1`` (glue nodes)."""
    if i == 0:
        return {name: name for name in (*STEP_INPUTS, fixed.position_input, *buffers)}
    pos, prev = fixed.position_input, f"b{i - 1}/"
    step = f"dsp/block/step{i}"
    block.initializers[step] = np.array([i], dtype=np.int64)
    glue = [
        Node("Add", [pos, step], [f"b{i}/{pos}"], {}, f"b{i}/dsp_advance_position"),
        Node("Greater", ["dsp/block/range", pos], [f"b{i}/dsp_after_start"], {}, f"b{i}/dsp_after_start"),
        Node("LessOrEqual", ["dsp/block/range", f"b{i}/{pos}"], [f"b{i}/dsp_upto"], {}, f"b{i}/dsp_upto"),
        Node("And", [f"b{i}/dsp_after_start", f"b{i}/dsp_upto"], [f"b{i}/dsp_new_valid"], {}, f"b{i}/dsp_new_valid"),
        Node(
            "Cast",
            [f"b{i}/dsp_new_valid"],
            [f"b{i}/dsp_new_mask"],
            {"to": _onnx_dtype(block, "attention_mask")},
            f"b{i}/dsp_new_mask",
        ),
        Node("Max", ["attention_mask", f"b{i}/dsp_new_mask"], [f"b{i}/attention_mask"], {}, f"b{i}/dsp_mask"),
    ]
    position_step = f"dsp/block/position_step{i}"
    block.initializers[position_step] = np.array([i], dtype=_np_dtype(block, "position_ids"))
    glue.append(Node("Add", ["position_ids", position_step], [f"b{i}/position_ids"], {}, f"b{i}/dsp_positions"))
    block.nodes.extend(glue)
    feeds = {
        "input_ids": chosen[i - 1],
        "position_ids": f"b{i}/position_ids",
        "attention_mask": f"b{i}/attention_mask",
        pos: f"b{i}/{pos}",
    }
    feeds.update({past: f"{prev}{present}" for past, present in buffers.items()})  # the alias, written in place
    return feeds


def _np_dtype(g: Graph, name: str) -> Any:
    info = g.info(name)
    return dtypes.to_numpy(info.dtype) if info is not None and info.dtype else np.int64


def _onnx_dtype(g: Graph, name: str) -> int:
    return dtypes.to_onnx(dtypes.normalize(_np_dtype(g, name)))


class BlockHook:
    """``DecodeLoop.block_hook`` for blocks of exactly K steps: one plan run per block.

    A sampled block is fed the block's uniforms ([K, B], drawn by the session's sampler
    in the same order as the one-step path draws them).
    """

    def __init__(self, model: Any, state: Any, k: int) -> None:
        self.model = model
        self.state = state
        self.k = k
        xp = state.xp
        self._range = xp.arange(state.max_length, dtype=xp.int64)

    def __call__(self, k: int) -> Any:
        """The block runner for ``k`` steps, or None (the caller then steps one by one)."""
        return self._run if k == self.k else None

    def _run(self, out: Any, uniforms: Any, offset: int) -> None:
        state, xp = self.state, self.state.xp
        feeds = state.feeds if uniforms is None else {**state.feeds, UNIFORMS: uniforms}
        tokens = self.model.run(feeds)[TOKENS]
        out[:, offset : offset + self.k] = tokens
        start = state.kv_position.copy()
        state.kv_position += self.k  # device-side, like DecodeState.advance, K at once
        state.position_ids += self.k
        new = (self._range > start) & (self._range <= state.kv_position)
        state.attention_mask[...] = xp.maximum(state.attention_mask, new.astype(state.attention_mask.dtype))
        state.input_ids[:, 0] = tokens[:, -1]
