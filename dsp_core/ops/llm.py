"""Ops of the ``dsp`` domain used by the LLM decode path (dsp_core.llm).

``dsp::Sample`` draws one token per row from logits with a given uniform number
(temperature, top-k, top-p as attributes): the token choice of a sampled decode block
runs inside the plan, so a block of K sampled steps is captured like a greedy one. Its
math (``sample_tokens``) is the one the host-side sampler uses, so both give the same
tokens for the same uniforms.

``dsp::KVScatter`` is the first op with the MUTATES_INPUT trait: it writes the step's
keys or values into a persistent KV buffer *in place*, at a position held in a device
array, and returns the buffer itself. The plan compiler only lets such an op write a
graph input (a VARIABLE, read in place) that no later slot reads directly; backends
alias the output to the input instead of giving it a buffer of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, op, same_as_first

Array = Any


@op("KVScatter", domain="dsp", traits=Trait.MUTATES_INPUT, shape=same_as_first)
def kv_scatter(ctx: KernelContext, buffer: Array, update: Array, position: Array, *, axis: int = -2) -> Array:
    """Write ``update`` into ``buffer`` along ``axis`` from index ``position[0]``, in place; returns ``buffer``.

    The index is built on the device (``position + arange(n)``) and used as a fancy
    index, so no value goes to the host: a captured graph replays it for any position.
    Writing the same update twice is harmless (idempotent), which is what makes a
    re-warm-and-recapture of the step safe.
    """
    xp = ctx.xp
    ax = axis % buffer.ndim
    n = update.shape[ax]
    if isinstance(buffer, np.ndarray) and isinstance(position, np.ndarray) and position.size:
        # On the host nothing is captured: the rows as a slice (a view), where they fit; the
        # fancy index for the rest (it wraps a negative start and raises past the end).
        return store_rows(buffer, update, position, axis)
    index = xp.reshape(position, (-1,))[:1].astype(xp.int64) + xp.arange(n, dtype=xp.int64)
    buffer[(slice(None),) * ax + (index,)] = update
    return buffer


KV_STORE_OPSET = 11  # ONNX opset of what a KV store is written as (ScatterElements with negative indices, Range)


def is_kv_store(slot: Any) -> bool:
    """True for a slot of ``dsp::KVScatter`` (a plan slot or a backend's view of one)."""
    return (slot.domain, slot.op) == ("dsp", "KVScatter")


def store_rows(buffer: np.ndarray, update: np.ndarray, position: np.ndarray, axis: int = -2) -> np.ndarray:
    """``kv_scatter``'s write on host arrays: ``update`` into ``buffer`` in place, from ``position[0]``."""
    ax = axis % buffer.ndim
    n = update.shape[ax]
    p = int(np.asarray(position).reshape(-1)[0])
    if 0 <= p <= buffer.shape[ax] - n:
        buffer[(slice(None),) * ax + (slice(p, p + n),)] = update
    else:  # a negative start wraps, and past the end raises, as the fancy index does
        buffer[(slice(None),) * ax + (p + np.arange(n, dtype=np.int64),)] = update
    return buffer


def sample_tokens(xp: Any, logits: Array, uniform: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """One token per row of ``logits`` [B, V], int64 [B]; ``uniform`` [B] in [0, 1).

    Greedy (argmax) when ``temperature <= 0``. Else: logits / temperature in float64,
    keep the ``top_k`` best (0: all), then the smallest set of best tokens whose
    probability reaches ``top_p`` (1.0: all; the best token always stays), and pick the
    token where the row's uniform falls in the cumulative distribution. Array code only:
    nothing is read on the host, so it runs inside a captured graph.
    """
    if temperature <= 0.0:
        return xp.argmax(logits, axis=-1).astype(xp.int64)
    x = logits.astype(xp.float64) / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = -xp.partition(-x, top_k - 1, axis=-1)[:, top_k - 1 : top_k]
        x = xp.where(x < kth, -xp.inf, x)
    if top_p < 1.0:
        order = xp.argsort(-x, axis=-1)
        ranked = xp.take_along_axis(x, order, axis=-1)
        probs = _softmax(xp, ranked)
        before = xp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
        ranked = xp.where(before >= top_p, -xp.inf, ranked)  # the best token always stays
        x = xp.empty_like(x)
        x[xp.arange(x.shape[0])[:, None], order] = ranked  # put_along_axis, in numpy and cupy alike
    cdf = xp.cumsum(_softmax(xp, x), axis=-1)
    target = xp.reshape(uniform, (-1, 1)) * cdf[:, -1:]
    chosen = (cdf <= target).sum(axis=-1)
    return xp.minimum(chosen, vocab - 1).astype(xp.int64)


def _softmax(xp: Any, x: Array) -> Array:
    shifted = x - x.max(axis=-1, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def _sample_rule(attrs: dict[str, Any], logits: TensorInfo, uniform: TensorInfo) -> list[TensorInfo]:
    """Shape rule of dsp::Sample: [B, 1] int64."""
    if logits.shape is None:
        return [TensorInfo("int64", None)]
    return [TensorInfo("int64", (logits.shape[0], 1))]


@op("Sample", domain="dsp", traits=Trait.FULLY_WRITING, shape=_sample_rule)
def sample(
    ctx: KernelContext, logits: Array, uniform: Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Array:
    """One token per row, [B, 1] int64, from logits [B, V] or [B, S, V] (last position) and uniforms [B]."""
    x = logits[:, -1] if logits.ndim == 3 else logits
    return sample_tokens(ctx.xp, x, uniform, float(temperature), int(top_k), float(top_p))[:, None]
