"""Ops of the ``dsp`` domain used by the LLM decode path (dsp_core.llm).

``dsp::KVScatter`` is the first op with the MUTATES_INPUT trait: it writes the step's
keys or values into a persistent KV buffer *in place*, at a position held in a device
array, and returns the buffer itself. The plan compiler only lets such an op write a
graph input (a VARIABLE, read in place) that no later slot reads directly; backends
alias the output to the input instead of giving it a buffer of its own.
"""

from __future__ import annotations

from typing import Any

from dsp_core.ops.registry import KernelContext, Trait, op, same_as_first

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
    index = xp.reshape(position, (-1,))[:1].astype(xp.int64) + xp.arange(n, dtype=xp.int64)
    buffer[(slice(None),) * ax + (index,)] = update
    return buffer
