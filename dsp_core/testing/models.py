"""Synthetic models for tests and benchmarks, built with the GraphBuilder (no ONNX file, no download)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsp_core.ir import dtypes
from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph


def mlp(widths: Sequence[int], seed: int = 0, *, bias: bool = True, tied: bool = False) -> Graph:
    """``x[batch, widths[0]]`` through MatMul (+ bias) + Relu layers of the given widths, output ``y``.

    Weights are standard normal / sqrt(fan-in), float32, from ``seed``; ``tied`` makes the
    last layer reuse the first layer's weight (a constant two layers read).
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder()
    h = g.placeholder("x", "float32", ["batch", widths[0]])
    first = None
    last = len(widths) - 2
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        weight = first if tied and i == last and first is not None else g.constant(w, name=f"w{i}")
        first = weight if i == 0 else first
        h = g.MatMul(h, weight)
        if bias:
            h = h + g.constant(rng.standard_normal(b).astype(np.float32), name=f"b{i}")
        h = g.Relu(h)
    g.output(h, "y")
    return g.build()


def residual_conv_block(
    dtype: str = "float32", *, bias: bool = True, channels: int = 4, size: int = 6, batch: int = 1, seed: int = 0
) -> Graph:
    """A residual block of 3x3 convolutions on ``x[batch, channels, size, size]``: Conv + Relu,
    Conv + the residual Add + Relu, then a Conv whose output is both output ``raw`` and, through
    a Sigmoid, output ``y`` (a convolution read outside the pointwise ops after it)."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder("residual_conv_block")
    x = g.placeholder("x", dtype, [batch, channels, size, size])
    scale = 1.0 / np.sqrt(9 * channels)

    def conv(v: Any, name: str) -> Any:
        w = g.constant((rng.standard_normal((channels, channels, 3, 3)) * scale).astype(dtype), name=f"{name}_w")
        if not bias:
            return g.Conv(v, w, pads=[1, 1, 1, 1])
        b = g.constant(rng.standard_normal(channels).astype(dtype), name=f"{name}_b")
        return g.Conv(v, w, b, pads=[1, 1, 1, 1])

    a = g.Relu(conv(x, "c1"))
    r = g.Relu(conv(a, "c2") + x)
    c = conv(r, "c3")
    g.output(g.Sigmoid(c), "y")
    g.output(c, "raw")
    return g.build()


def encoder_attention(
    dtype: str = "float32",
    *,
    batch: int = 1,
    seq: int = 24,
    heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
) -> Graph:
    """An encoder's self-attention as exporters write it: ``x[batch, seq, heads*head_dim]`` through one
    QKV projection (+ bias), split into heads (Reshape, Transpose, Split, Squeeze), the scores
    ``q @ k^T / sqrt(head_dim)`` plus the padding mask made from ``mask[batch, seq]`` (1 keep, 0 pad),
    Softmax, the weighted sum with V, the heads transposed and merged back, the output projection:
    output ``y``."""
    rng = np.random.default_rng(seed)
    hidden = heads * head_dim
    g = GraphBuilder("encoder_attention")
    x = g.placeholder("x", dtype, [batch, seq, hidden])
    keep = g.placeholder("mask", "int64", [batch, seq])
    # the additive padding mask first, as exporters place it (before the layers that read it)
    m = g.Cast(g.Unsqueeze(keep, g.constant(np.array([1, 2], np.int64))), to=int(dtypes.to_onnx(dtype)))
    bias = g.Mul(g.Sub(g.constant(np.array(1.0, dtype)), m), g.constant(np.array(-10000.0, dtype)))
    scale = 1.0 / np.sqrt(hidden)
    wqkv = g.constant((rng.standard_normal((hidden, 3 * hidden)) * scale).astype(dtype), name="wqkv")
    bqkv = g.constant((rng.standard_normal(3 * hidden) * 0.1).astype(dtype), name="bqkv")
    qkv = g.MatMul(x, wqkv) + bqkv
    qkv = g.Reshape(qkv, g.constant(np.array([batch, seq, 3, heads, head_dim], np.int64)))
    qkv = g.Transpose(qkv, perm=[2, 0, 3, 1, 4])
    parts = g.Split(qkv, g.constant(np.array([1, 1, 1], np.int64)), axis=0, outputs=3)
    axis0 = g.constant(np.array([0], np.int64))
    q, k, v = (g.Squeeze(p, axis0) for p in parts)
    kt = g.Transpose(k, perm=[0, 1, 3, 2])
    scores = g.Div(g.MatMul(q, kt), g.constant(np.array(np.sqrt(head_dim), dtype)))
    probs = g.Softmax(g.Add(scores, bias), axis=-1)
    ctx = g.Transpose(g.MatMul(probs, v), perm=[0, 2, 1, 3])
    ctx = g.Reshape(ctx, g.constant(np.array([batch, seq, hidden], np.int64)))
    wo = g.constant((rng.standard_normal((hidden, hidden)) * scale).astype(dtype), name="wo")
    g.output(g.MatMul(ctx, wo) + g.constant((rng.standard_normal(hidden) * 0.1).astype(dtype), name="bo"), "y")
    return g.build()


def encoder_attention_feeds(
    dtype: str = "float32", *, batch: int = 1, seq: int = 24, heads: int = 2, head_dim: int = 16, seed: int = 1
) -> dict[str, np.ndarray]:
    """Feeds for ``encoder_attention``: standard normal ``x`` and a mask whose last eighth is padding."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - max(1, seq // 8) :] = 0
    return {"x": rng.standard_normal((batch, seq, heads * head_dim)).astype(dtype), "mask": mask}


def fixed_kv_step(
    path: str | os.PathLike[str], max_length: int = 16, position: int = 5, seed: int = 0
) -> tuple[Graph, dict[str, Any]]:
    """A decoder's fixed-KV decode graph (``GenerationPipeline``'s, dsp_core/llm/kv.py) and one step's feeds.

    The KV buffers hold random rows (standard normal, from ``seed``); the attention mask
    covers rows ``0..position``; the step's token is 3 at ``position``, so its KV stores
    write row ``position`` of every buffer.
    """
    from dsp_core.ir.onnx_import import import_model
    from dsp_core.llm.kv import fixed_kv_buffers

    fixed = fixed_kv_buffers(import_model(path), batch=1, max_length=max_length)
    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {}
    for name, shape in fixed.buffer_shapes.items():
        feeds[name] = rng.standard_normal(shape).astype(fixed.buffer_dtypes[name])
    mask = np.zeros((1, max_length), np.int64)
    mask[0, : position + 1] = 1
    step = {"input_ids": np.array([[3]]), "attention_mask": mask, "position_ids": np.array([[position]])}
    names = set(fixed.graph.input_names)
    feeds.update({k: v.astype(fixed.input_dtypes.get(k, "int64")) for k, v in step.items() if k in names})
    feeds[fixed.position_input] = np.array([position], np.int64)
    return fixed.graph, feeds
