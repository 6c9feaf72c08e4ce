"""Sequence and optional ops: SequenceConstruct ... SequenceMap, Optional, OptionalHasElement.

Representation: a sequence value is a Python list of xp arrays; kernels never mutate a
list they receive, they return a new one. An optional value is None (empty) or what it
holds (an array or a list).

A sequence carries no shape, so the length of a sequence built from a value
(SplitToSequence) or the size of a tensor built from a sequence (ConcatFromSequence) is
known only once the kernel runs.
"""

from __future__ import annotations

from typing import Any

from dsp_core.errors import KernelError
from dsp_core.ops.registry import KernelContext, Trait, op

Array = Any

# A list output is no buffer a backend could size or capture: its length is known only
# once the kernel has run, so every list-producing op ends a capturable segment.
_LIST_OUT = Trait.DYNAMIC_OUTPUT_SIZE


def _position(ctx: KernelContext, position: Array | None, length: int, *, insert: bool = False) -> int:
    """A position input as a non-negative index into a sequence of ``length``.

    Positions lie in [-length, length - 1], or [-length, length] for an insertion; a
    missing position means the end (after the last element to insert, the last to erase).
    """
    hi = length if insert else length - 1
    if position is None:
        return hi
    pos = int(ctx.xp.asarray(position).reshape(-1)[0])
    if not -length <= pos <= hi:
        raise KernelError(f"sequence position {pos} is out of range [{-length}, {hi}] for a sequence of {length}")
    return pos + length if pos < 0 else pos


@op("SequenceEmpty", since=11, traits=_LIST_OUT, inputs=(0, 0))
def sequence_empty(ctx: KernelContext, *, dtype: int | None = None) -> list[Array]:
    """An empty sequence."""
    return []


@op("SequenceConstruct", since=11, traits=_LIST_OUT, inputs=(1, -1))
def sequence_construct(ctx: KernelContext, *inputs: Array) -> list[Array]:
    """A sequence holding the inputs, in order."""
    return list(inputs)


@op("SequenceInsert", since=11, traits=_LIST_OUT)
def sequence_insert(ctx: KernelContext, seq: list[Array], tensor: Array, position: Array = None) -> list[Array]:
    """A copy of ``seq`` with ``tensor`` inserted at ``position`` (default: appended)."""
    at = _position(ctx, position, len(seq), insert=True)
    return [*seq[:at], tensor, *seq[at:]]


@op("SequenceErase", since=11, traits=_LIST_OUT)
def sequence_erase(ctx: KernelContext, seq: list[Array], position: Array = None) -> list[Array]:
    """A copy of ``seq`` without the element at ``position`` (default: the last)."""
    at = _position(ctx, position, len(seq))
    return [*seq[:at], *seq[at + 1 :]]


@op("SequenceAt", since=11, traits=Trait.VALUE_DEPENDENT_SHAPE)
def sequence_at(ctx: KernelContext, seq: list[Array], position: Array) -> Array:
    """The element of ``seq`` at ``position``."""
    return seq[_position(ctx, position, len(seq))]


@op("SequenceLength", since=11, traits=Trait.FULLY_WRITING)
def sequence_length(ctx: KernelContext, seq: list[Array]) -> Array:
    """The number of elements of ``seq``, as an int64 scalar."""
    return ctx.xp.asarray(len(seq), dtype=ctx.xp.int64)


def _split_points(ctx: KernelContext, split: Array | None, dim: int) -> list[int]:
    """Where SplitToSequence cuts an axis of ``dim``: chunks of 1, of a scalar size, or given sizes."""
    if split is None:
        sizes = [1] * dim
    else:
        split = ctx.xp.asarray(split)
        if split.ndim == 0:
            chunk = int(split)
            sizes = [chunk] * (dim // chunk) + ([dim % chunk] if dim % chunk else [])
        else:
            sizes = [int(s) for s in split.tolist()]
            if sum(sizes) != dim:
                raise KernelError(f"SplitToSequence: split sizes {sizes} sum to {sum(sizes)}, the axis has {dim}")
    points, total = [], 0
    for s in sizes[:-1]:
        total += s
        points.append(total)
    return points


@op("SplitToSequence", since=11, traits=_LIST_OUT | Trait.VALUE_DEPENDENT_SHAPE)
def split_to_sequence(
    ctx: KernelContext, x: Array, split: Array = None, *, axis: int = 0, keepdims: int = 1
) -> list[Array]:
    """Split ``x`` along ``axis`` into a sequence (no split: size-1 chunks, squeezed unless keepdims)."""
    xp = ctx.xp
    axis = axis % x.ndim
    parts = xp.split(x, _split_points(ctx, split, x.shape[axis]), axis=axis)
    if split is None and not keepdims:
        parts = [xp.squeeze(p, axis=axis) for p in parts]
    return list(parts)


@op("ConcatFromSequence", since=11, traits=Trait.DYNAMIC_OUTPUT_SIZE | Trait.FULLY_WRITING)
def concat_from_sequence(ctx: KernelContext, seq: list[Array], *, axis: int, new_axis: int = 0) -> Array:
    """Concatenate the elements of ``seq`` along ``axis`` (stack them along a new one if new_axis)."""
    if not seq:
        raise KernelError("ConcatFromSequence: the sequence is empty; there is nothing to concatenate")
    xp = ctx.xp
    if new_axis:
        return xp.stack(seq, axis=axis % (seq[0].ndim + 1))
    return xp.concatenate(seq, axis=axis % seq[0].ndim)


@op("SequenceMap", since=17, traits=Trait.CONTROL_FLOW, outputs=(1, -1), inputs=(1, -1))
def sequence_map(ctx: KernelContext, seq: list[Array], *extra: Any, body: Any = None) -> tuple[list[Array], ...]:
    """Run ``body`` on each element of ``seq`` (and of sequence inputs in ``extra``); one sequence per output."""
    runner = ctx.subgraphs["body"]
    names = [v.name for v in runner.graph.inputs]
    for k, value in enumerate(extra):
        if isinstance(value, list) and len(value) != len(seq):
            raise KernelError(f"SequenceMap: input {k + 1} has {len(value)} elements, input 0 has {len(seq)}")
    results: list[list[Array]] = [[] for _ in range(ctx.n_outputs)]
    for i, element in enumerate(seq):
        args = [element, *(v[i] if isinstance(v, list) else v for v in extra)]
        for collected, out in zip(results, runner(dict(zip(names, args)))):
            collected.append(out)
    return tuple(results)


@op("Optional", since=15, inputs=(0, 1))
def optional(ctx: KernelContext, value: Any = None, *, type: Any = None) -> Any:
    """An optional holding ``value``, or an empty one (None) when the input is absent."""
    return value


@op("OptionalHasElement", since=15, traits=Trait.FULLY_WRITING, inputs=(0, 1))
def optional_has_element(ctx: KernelContext, value: Any = None) -> Array:
    """True when the optional holds a value (a missing input is an empty optional)."""
    return ctx.xp.asarray(value is not None)


@op("OptionalGetElement", since=15)
def optional_get_element(ctx: KernelContext, value: Any) -> Any:
    """The value an optional holds (a tensor or sequence input is returned as is)."""
    if value is None:
        raise KernelError("OptionalGetElement: the optional is empty")
    return value
