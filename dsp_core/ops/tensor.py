"""Tensor ops: constants, shape plumbing, indexing, scatter/gather and reductions.

Semantics are ONNX's (default domain) for every opset the node test suite exercises.

Naming rule for parameters: a kernel's positional parameters are the node's inputs and
its keyword-only parameters are attributes, matched by ONNX name. Where an older opset
had an *attribute* with the same name as a later *input* (Reduce* ``axes``, Slice
``starts``, Split ``split``, TopK ``k``, ...), the input parameter is suffixed
``_input`` and the kernel takes whichever of the two the node gives.

Shape-like inputs (shapes, axes, starts, pads, ...) go through :func:`_ints`, which
reads them to the host as Python ints (a device-to-host copy on cupy).

Shape rules are given only where shapes and attributes always decide the output shape: a
rule sees no values, and SHAPE_INFERENCE_ONLY uses a rule instead of the kernel whenever
there is one, so Squeeze, Unsqueeze and Reduce* (axes as an input in current opsets) have
none; their kernels run on the abstract inputs there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dsp_core.errors import UnsupportedOpError
from dsp_core.ir import dtypes
from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, alias, op, same_as_first

Array = Any
Dims = tuple[int | str | None, ...]

_WRITES = Trait.FULLY_WRITING
_VALUE_SHAPE = Trait.VALUE_DEPENDENT_SHAPE | Trait.FULLY_WRITING
_DYNAMIC = Trait.DYNAMIC_OUTPUT_SIZE | Trait.FULLY_WRITING

# ---------------------------------------------------------------------------
# Helpers


def _ints(value: Any) -> list[int]:
    """A shape-like value (an xp array, a sequence, a scalar or None) as Python ints."""
    if value is None:
        return []
    if hasattr(value, "reshape"):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _int(value: Any) -> int:
    """A scalar (or one-element) input as a Python int."""
    return _ints(value)[0]


def _axis(axis: int, rank: int) -> int:
    """``axis`` in [-rank, rank) made non-negative."""
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _first_given(*values: Any) -> Any:
    """The first of ``values`` that is not None (an input, else its old attribute)."""
    return next((v for v in values if v is not None), None)


def _nonneg_indices(xp: Any, indices: Array, dim: int) -> Array:
    """Indices in [-dim, dim) made non-negative, as int64."""
    indices = indices.astype(xp.int64, copy=False)
    return xp.where(indices < 0, indices + dim, indices)


def _open_grid(xp: Any, shape: Sequence[int]) -> list[Array]:
    """One arange per axis, each shaped to broadcast over ``shape`` (like numpy's ogrid)."""
    rank = len(shape)
    return [xp.arange(n, dtype=xp.int64).reshape((n,) + (1,) * (rank - 1 - i)) for i, n in enumerate(shape)]


def _prod(dims: Dims) -> int | str | None:
    """Product of dims: the dim itself when alone, None when a dim is not a known int."""
    if len(dims) == 1:
        return dims[0]
    total = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        total *= d
    return total


def _unknown(dtype: str | None) -> list[TensorInfo]:
    return [TensorInfo(dtype, None)]


# ---------------------------------------------------------------------------
# Constants and shape queries


def _constant_value(xp: Any, value: Any, value_float: Any, value_floats: Any, value_int: Any, value_ints: Any) -> Array:
    if value is not None:
        return xp.asarray(value)
    if value_float is not None:
        return xp.asarray(value_float, dtype=xp.float32)
    if value_floats is not None:
        return xp.asarray(value_floats, dtype=xp.float32).reshape(-1)
    if value_int is not None:
        return xp.asarray(value_int, dtype=xp.int64)
    if value_ints is not None:
        return xp.asarray(value_ints, dtype=xp.int64).reshape(-1)
    raise ValueError("Constant node has none of value, value_float(s), value_int(s)")


def _constant_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Constant: the attribute's dtype and shape."""
    if attrs.get("value") is not None:
        return [TensorInfo(dtypes.normalize(attrs["value"].dtype), tuple(attrs["value"].shape))]
    for name, dtype in (("value_float", "float32"), ("value_int", "int64")):
        if attrs.get(name) is not None:
            return [TensorInfo(dtype, ())]
        if attrs.get(name + "s") is not None:
            return [TensorInfo(dtype, (len(attrs[name + "s"]),))]
    return _unknown(None)


@op("Constant", traits=_WRITES, shape=_constant_rule)
def constant(
    ctx: KernelContext,
    *,
    value: Any = None,
    value_float: Any = None,
    value_floats: Any = None,
    value_int: Any = None,
    value_ints: Any = None,
    value_string: Any = None,
    value_strings: Any = None,
    sparse_value: Any = None,
) -> Array:
    """The tensor held by whichever value attribute the node sets."""
    if value_string is not None or value_strings is not None:
        raise UnsupportedOpError("Constant with value_string(s): DSP has no string tensors")
    if sparse_value is not None:
        raise UnsupportedOpError("Constant with sparse_value: DSP has no sparse tensors")
    return _constant_value(ctx.xp, value, value_float, value_floats, value_int, value_ints)


def _shape_rule(attrs: dict[str, Any], data: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Shape: a 1-D int64 of the sliced rank."""
    if data.shape is None:
        return [TensorInfo("int64", (None,))]
    start, end = attrs.get("start", 0), attrs.get("end")
    return [TensorInfo("int64", (len(data.shape[start:end]),))]


@op("Shape", traits=Trait.SHAPE_ONLY_OUTPUT | _WRITES, shape=_shape_rule)
def shape_of(ctx: KernelContext, data: Array, *, start: int = 0, end: int | None = None) -> Array:
    """The input's shape (dims start..end, Python-slice clamping) as 1-D int64."""
    return ctx.xp.asarray(data.shape[start:end], dtype=ctx.xp.int64)


def _size_rule(attrs: dict[str, Any], data: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Size: an int64 scalar."""
    return [TensorInfo("int64", ())]


@op("Size", traits=Trait.SHAPE_ONLY_OUTPUT | _WRITES, shape=_size_rule)
def size(ctx: KernelContext, data: Array) -> Array:
    """The input's element count as an int64 scalar."""
    return ctx.xp.asarray(data.size, dtype=ctx.xp.int64)


@op("ConstantOfShape", traits=_VALUE_SHAPE)
def constant_of_shape(ctx: KernelContext, shape: Array, *, value: Any = None) -> Array:
    """A tensor of the given shape filled with ``value`` (one element; default float32 0)."""
    xp = ctx.xp
    if value is None:
        return xp.zeros(_ints(shape), dtype=xp.float32)
    fill = xp.asarray(value).reshape(-1)
    return xp.full(_ints(shape), fill[0], dtype=fill.dtype)


@op("Range", traits=_VALUE_SHAPE)
def range_(ctx: KernelContext, start: Array, limit: Array, delta: Array) -> Array:
    """start, start+delta, ... up to (excluding) limit, in the inputs' dtype."""
    xp = ctx.xp
    first, step = start.item(), delta.item()  # scalars read on the host (a device backend hands host arrays)
    count = max(math.ceil((limit.item() - first) / step), 0)
    dtype = np.dtype(start.dtype)  # numpy scalars of it: kernel arguments on a device, no copy
    return xp.arange(count, dtype=dtype) * dtype.type(step) + dtype.type(first)


def _eye_like_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of EyeLike: input's shape, the dtype attribute or the input's dtype."""
    dtype = attrs.get("dtype")
    return [TensorInfo(dtypes.normalize(dtype) if dtype is not None else x.dtype, x.shape)]


@op("EyeLike", traits=_WRITES | Trait.SHAPE_ONLY_OUTPUT, shape=_eye_like_rule)
def eye_like(ctx: KernelContext, x: Array, *, dtype: int | None = None, k: int = 0) -> Array:
    """A 2-D tensor of the input's shape with ones on diagonal ``k``, zeros elsewhere."""
    out_dtype = dtypes.to_numpy(dtypes.normalize(dtype)) if dtype is not None else x.dtype
    rows, cols = x.shape
    return ctx.xp.eye(rows, cols, k=k, dtype=out_dtype)


# ---------------------------------------------------------------------------
# Reshaping (no data movement beyond a copy or a transpose)


def _reshape_target(in_shape: Sequence[int], target: list[int], allowzero: int) -> list[int]:
    out = [in_shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = math.prod(in_shape) // known if known else 0
    return out


@op("Reshape", traits=_VALUE_SHAPE, since=5)
def reshape(ctx: KernelContext, data: Array, shape: Array, *, allowzero: int = 0) -> Array:
    """``data`` with a new shape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    return data.reshape(tuple(_reshape_target(data.shape, _ints(shape), allowzero)))


def _flatten_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Flatten: (prod of dims before axis, prod of the rest)."""
    if x.shape is None:
        return [TensorInfo(x.dtype, (None, None))]
    axis = attrs.get("axis", 1)
    axis = axis + len(x.shape) if axis < 0 else axis
    return [TensorInfo(x.dtype, (_prod(x.shape[:axis]), _prod(x.shape[axis:])))]


@op("Flatten", traits=_WRITES, shape=_flatten_rule)
def flatten(ctx: KernelContext, x: Array, *, axis: int = 1) -> Array:
    """``x`` as 2-D: dims before ``axis`` form the rows, the rest the columns."""
    axis = axis + x.ndim if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _squeeze_dims(shape: Sequence[int], axes: list[int]) -> tuple[int, ...]:
    if not axes:
        return tuple(d for d in shape if d != 1)
    drop = {_axis(a, len(shape)) for a in axes}
    return tuple(d for i, d in enumerate(shape) if i not in drop)


@op("Squeeze", traits=_VALUE_SHAPE)
def squeeze(ctx: KernelContext, data: Array, axes_input: Array = None, *, axes: Any = None) -> Array:
    """``data`` without the listed size-1 axes (all size-1 axes when none are listed)."""
    return data.reshape(_squeeze_dims(data.shape, _ints(_first_given(axes_input, axes))))


def _unsqueeze_dims(shape: Dims, axes: list[int]) -> Dims:
    rank = len(shape) + len(axes)
    inserted = {_axis(a, rank) for a in axes}
    rest = iter(shape)
    return tuple(1 if i in inserted else next(rest) for i in range(rank))


@op("Unsqueeze", traits=_VALUE_SHAPE)
def unsqueeze(ctx: KernelContext, data: Array, axes_input: Array = None, *, axes: Any = None) -> Array:
    """``data`` with size-1 axes inserted at the listed output positions."""
    return data.reshape(_unsqueeze_dims(data.shape, _ints(_first_given(axes_input, axes))))


def _transpose_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Transpose: dims permuted (reversed by default)."""
    if x.shape is None:
        return _unknown(x.dtype)
    perm = attrs.get("perm") or range(len(x.shape) - 1, -1, -1)
    return [TensorInfo(x.dtype, tuple(x.shape[p] for p in perm))]


@op("Transpose", traits=_WRITES, shape=_transpose_rule)
def transpose(ctx: KernelContext, x: Array, *, perm: Sequence[int] | None = None) -> Array:
    """``x`` with its axes permuted by ``perm`` (reversed when absent)."""
    return ctx.xp.transpose(x, None if perm is None else tuple(perm))


@op("Expand", traits=_VALUE_SHAPE)
def expand(ctx: KernelContext, x: Array, shape: Array) -> Array:
    """``x`` broadcast (both ways) with the given shape."""
    xp = ctx.xp
    target = _ints(shape)
    rank = max(len(target), x.ndim)
    padded_x = (1,) * (rank - x.ndim) + tuple(x.shape)
    padded_t = (1,) * (rank - len(target)) + tuple(target)
    out = tuple(a if b == 1 else b for a, b in zip(padded_x, padded_t))
    return xp.broadcast_to(x, out).copy()


@op("Tile", traits=_VALUE_SHAPE)
def tile(ctx: KernelContext, x: Array, repeats: Array) -> Array:
    """``x`` repeated ``repeats[i]`` times along each axis i."""
    return ctx.xp.tile(x, tuple(_ints(repeats)))


def _scaled(dim: int | str | None, factor: int, inverse: bool = False) -> int | None:
    if not isinstance(dim, int):
        return None
    return dim // factor if inverse else dim * factor


def _depth_space_rule(to_space: bool) -> Callable[..., list[TensorInfo]]:
    def rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
        if x.shape is None or len(x.shape) != 4:
            return _unknown(x.dtype)
        n, c, h, w = x.shape
        bs = attrs["blocksize"]
        # DepthToSpace divides channels by bs*bs and multiplies H, W by bs; SpaceToDepth the reverse.
        dims = (n, _scaled(c, bs * bs, to_space), _scaled(h, bs, not to_space), _scaled(w, bs, not to_space))
        return [TensorInfo(x.dtype, dims)]

    rule.__doc__ = f"Shape rule of {'DepthToSpace' if to_space else 'SpaceToDepth'}."
    return rule


@op("DepthToSpace", traits=_WRITES, shape=_depth_space_rule(to_space=True))
def depth_to_space(ctx: KernelContext, x: Array, *, blocksize: int, mode: str = "DCR") -> Array:
    """Moves channel blocks of an NCHW tensor into spatial blocks (modes DCR, CRD)."""
    n, c, h, w = x.shape
    bs = blocksize
    if mode == "DCR":
        y = x.reshape(n, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (bs * bs), h * bs, w * bs)


@op("SpaceToDepth", traits=_WRITES, shape=_depth_space_rule(to_space=False))
def space_to_depth(ctx: KernelContext, x: Array, *, blocksize: int, mode: str = "DCR") -> Array:
    """Moves spatial blocks of an NCHW tensor into channels (modes DCR, CRD)."""
    n, c, h, w = x.shape
    bs = blocksize
    y = x.reshape(n, c, h // bs, bs, w // bs, bs)
    y = y.transpose(0, 3, 5, 1, 2, 4) if mode == "DCR" else y.transpose(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * bs * bs, h // bs, w // bs)


# ---------------------------------------------------------------------------
# Joining, splitting, slicing, padding


def _concat_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Concat: dims of the first input, the concat axis summed."""
    first = inputs[0]
    shapes = [i.shape for i in inputs]
    if first.shape is None or any(s is None for s in shapes):
        return _unknown(first.dtype)
    axis = _axis(attrs.get("axis", 1), len(first.shape))
    dims = list(first.shape)
    total: int | None = 0
    for s in shapes:
        d = s[axis] if s is not None else None
        total = total + d if isinstance(d, int) and total is not None else None
    dims[axis] = total
    return [TensorInfo(first.dtype, tuple(dims))]


@op("Concat", traits=_WRITES, shape=_concat_rule)
def concat(ctx: KernelContext, *inputs: Array, axis: int = 1) -> Array:
    """The inputs joined along ``axis``."""
    return ctx.xp.concatenate(inputs, axis=axis)


def _split_sizes(dim: int, n_outputs: int, num_outputs: int | None) -> list[int]:
    """Equal split sizes: ceil(dim/n) each, the last one smaller when uneven."""
    n = num_outputs or n_outputs
    chunk = -(-dim // n)
    return [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]


@op("Split", traits=_VALUE_SHAPE, outputs=(1, -1))
def split(
    ctx: KernelContext,
    x: Array,
    split_input: Array = None,
    *,
    axis: int = 0,
    num_outputs: int | None = None,
    split: Any = None,
) -> tuple[Array, ...]:
    """``x`` cut along ``axis`` into the given sizes, or into equal parts."""
    axis = _axis(axis, x.ndim)
    if num_outputs is not None and num_outputs != ctx.n_outputs:
        raise ValueError(f"num_outputs={num_outputs}, but the node names {ctx.n_outputs} outputs")
    sizes = _ints(_first_given(split_input, split))
    if not sizes:
        sizes = _split_sizes(x.shape[axis], ctx.n_outputs, num_outputs)
    elif len(sizes) != ctx.n_outputs or sum(sizes) != x.shape[axis] or min(sizes) < 0:
        raise ValueError(
            f"split sizes {sizes[:8]}{'...' if len(sizes) > 8 else ''} must be {ctx.n_outputs} non-negative "
            f"sizes summing to the axis length {x.shape[axis]}"
        )
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    cut = [slice(None)] * x.ndim
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        cut[axis] = slice(lo, hi)
        parts.append(x[tuple(cut)])
    return tuple(parts)


def _slice_of(start: int, end: int, step: int, dim: int) -> slice:
    """The Python slice of ONNX's (start, end, step) on a dim, with ONNX's clamping."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return slice(start, end, step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@op("Slice", traits=_VALUE_SHAPE)
def slice_(
    ctx: KernelContext,
    data: Array,
    starts_input: Array = None,
    ends_input: Array = None,
    axes_input: Array = None,
    steps: Array = None,
    *,
    starts: Any = None,
    ends: Any = None,
    axes: Any = None,
) -> Array:
    """``data[starts:ends:steps]`` on the listed axes (inputs from opset 10, attributes before)."""
    begin = _ints(_first_given(starts_input, starts))
    end = _ints(_first_given(ends_input, ends))
    axis_list = _ints(_first_given(axes_input, axes)) or list(range(len(begin)))
    step_list = _ints(steps) or [1] * len(begin)
    index = [slice(None)] * data.ndim
    for b, e, a, s in zip(begin, end, axis_list, step_list):
        a = _axis(a, data.ndim)
        index[a] = _slice_of(b, e, s, data.shape[a])
    return data[tuple(index)]


def _pad_widths(rank: int, pads: list[int], axes: list[int]) -> list[tuple[int, int]]:
    """ONNX's [begin..., end...] pads over ``axes`` as one (begin, end) pair per axis."""
    axes = [_axis(a, rank) for a in axes] or list(range(rank))
    widths = [(0, 0)] * rank
    for i, a in enumerate(axes):
        widths[a] = (pads[i], pads[i + len(axes)])
    return widths


def _crop_then_pad_widths(x: Array, widths: list[tuple[int, int]]) -> tuple[Array, list[tuple[int, int]]]:
    """Negative pads crop: apply them as a slice, return the non-negative rest."""
    crop = tuple(slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(widths, x.shape))
    return x[crop], [(max(b, 0), max(e, 0)) for b, e in widths]


@op("Pad", traits=_VALUE_SHAPE)
def pad(
    ctx: KernelContext,
    data: Array,
    pads_input: Array = None,
    constant_value: Array = None,
    axes: Array = None,
    *,
    mode: str = "constant",
    pads: Any = None,
    value: float = 0.0,
    paddings: Any = None,
) -> Array:
    """``data`` padded (negative pads crop) in mode constant, reflect, edge or wrap."""
    raw = _ints(_first_given(pads_input, pads, paddings))
    widths = _pad_widths(data.ndim, raw, _ints(axes))
    cropped, widths = _crop_then_pad_widths(data, widths)
    if mode == "constant":
        fill = constant_value.item() if constant_value is not None and constant_value.size else value
        return ctx.xp.pad(cropped, widths, mode="constant", constant_values=fill)
    if mode not in ("reflect", "edge", "wrap"):
        raise ValueError(f"Pad mode {mode!r} is not one of constant, reflect, edge, wrap")
    return ctx.xp.pad(cropped, widths, mode=mode)


@op("CenterCropPad", traits=_VALUE_SHAPE)
def center_crop_pad(ctx: KernelContext, input_data: Array, shape: Array, *, axes: Any = None) -> Array:
    """``input_data`` centre-cropped or zero-padded to ``shape`` on ``axes``."""
    rank = input_data.ndim
    axis_list = [_axis(a, rank) for a in (axes or range(rank))]
    out_shape = list(input_data.shape)
    src = [slice(None)] * rank
    dst = [slice(None)] * rank
    for a, target in zip(axis_list, _ints(shape)):
        dim = input_data.shape[a]
        out_shape[a] = target
        if dim > target:
            lo = (dim - target) // 2
            src[a] = slice(lo, lo + target)
        elif dim < target:
            lo = (target - dim) // 2
            dst[a] = slice(lo, lo + dim)
    out = ctx.xp.zeros(out_shape, dtype=input_data.dtype)
    out[tuple(dst)] = input_data[tuple(src)]
    return out


@op("Trilu", traits=_WRITES, shape=same_as_first)
def trilu(ctx: KernelContext, x: Array, k: Array = None, *, upper: int = 1) -> Array:
    """The upper (or lower) triangle of the last two dims from diagonal ``k``, zeros elsewhere."""
    diagonal = _int(k) if k is not None else 0
    return ctx.xp.triu(x, diagonal) if upper else ctx.xp.tril(x, diagonal)


# ---------------------------------------------------------------------------
# Gathering


def _gather_rule(attrs: dict[str, Any], data: TensorInfo, indices: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Gather: data dims with the axis replaced by the indices' dims."""
    if data.shape is None or indices.shape is None:
        return _unknown(data.dtype)
    axis = _axis(attrs.get("axis", 0), len(data.shape))
    return [TensorInfo(data.dtype, data.shape[:axis] + indices.shape + data.shape[axis + 1 :])]


@op("Gather", traits=_WRITES, shape=_gather_rule)
def gather(ctx: KernelContext, data: Array, indices: Array, *, axis: int = 0) -> Array:
    """Entries of ``data`` along ``axis`` at ``indices`` (negative counts from the end)."""
    axis = _axis(axis, data.ndim)
    return ctx.xp.take(data, _nonneg_indices(ctx.xp, indices, data.shape[axis]), axis=axis)


def _gather_elements_rule(attrs: dict[str, Any], data: TensorInfo, indices: TensorInfo) -> list[TensorInfo]:
    """Shape rule of GatherElements: the indices' shape, the data's dtype."""
    return [TensorInfo(data.dtype, indices.shape)]


@op("GatherElements", traits=_WRITES, shape=_gather_elements_rule)
def gather_elements(ctx: KernelContext, data: Array, indices: Array, *, axis: int = 0) -> Array:
    """``out[i][j] = data[indices[i][j]][j]`` (for axis 0), and so on for any axis."""
    axis = _axis(axis, data.ndim)
    idx = _nonneg_indices(ctx.xp, indices, data.shape[axis])
    return ctx.xp.take_along_axis(data, idx, axis=axis)


def _nd_index(xp: Any, data_shape: Sequence[int], indices: Array, batch_dims: int) -> tuple[Array, ...]:
    """The advanced-index tuple of GatherND/ScatterND over ``data`` reshaped to (batch, ...)."""
    k = indices.shape[-1]
    batch = math.prod(indices.shape[:batch_dims])
    flat = indices.reshape(batch, -1, k)
    cols = [_nonneg_indices(xp, flat[..., j], data_shape[batch_dims + j]) for j in range(k)]
    return (xp.arange(batch, dtype=xp.int64)[:, None], *cols)


def _gather_nd_rule(attrs: dict[str, Any], data: TensorInfo, indices: TensorInfo) -> list[TensorInfo]:
    """Shape rule of GatherND: batch dims + indices' dims + data dims not indexed."""
    k = indices.shape[-1] if indices.shape else None
    if data.shape is None or indices.shape is None or not isinstance(k, int):
        return _unknown(data.dtype)
    b = attrs.get("batch_dims", 0)
    return [TensorInfo(data.dtype, indices.shape[:-1] + data.shape[b + k :])]


@op("GatherND", traits=_WRITES, shape=_gather_nd_rule)
def gather_nd(ctx: KernelContext, data: Array, indices: Array, *, batch_dims: int = 0) -> Array:
    """Slices of ``data`` addressed by the last axis of ``indices`` (after ``batch_dims``)."""
    k = indices.shape[-1]
    batch = math.prod(data.shape[:batch_dims])
    flat_data = data.reshape((batch,) + data.shape[batch_dims:])
    picked = flat_data[_nd_index(ctx.xp, data.shape, indices, batch_dims)]
    return picked.reshape(indices.shape[:-1] + data.shape[batch_dims + k :])


@op("Compress", traits=_DYNAMIC)
def compress(ctx: KernelContext, x: Array, condition: Array, *, axis: int | None = None) -> Array:
    """Slices of ``x`` along ``axis`` (flattened when absent) where ``condition`` is true."""
    xp = ctx.xp
    if axis is None:
        x, axis = x.reshape(-1), 0
    keep = xp.nonzero(condition.reshape(-1))[0]
    return xp.take(x, keep, axis=axis)


@op("NonZero", traits=_DYNAMIC)
def nonzero(ctx: KernelContext, x: Array) -> Array:
    """Indices of the non-zero elements, shape (rank, count), int64."""
    xp = ctx.xp
    coords = xp.nonzero(x if x.ndim else x.reshape(1))
    return xp.stack(coords).astype(xp.int64).reshape(len(coords), -1)


@op("OneHot", traits=_VALUE_SHAPE)
def one_hot(ctx: KernelContext, indices: Array, depth: Array, values: Array, *, axis: int = -1) -> Array:
    """``values[1]`` where a new axis of size ``depth`` matches ``indices``, ``values[0]`` elsewhere."""
    xp = ctx.xp
    n = int(depth.item())
    axis = _axis(axis, indices.ndim + 1)
    idx = xp.expand_dims(_nonneg_indices(xp, indices, n), axis)
    positions = xp.arange(n, dtype=xp.int64).reshape((n,) + (1,) * (indices.ndim - axis))
    return xp.where(idx == positions, values[1], values[0])


@op("ReverseSequence", traits=_WRITES, shape=same_as_first)
def reverse_sequence(
    ctx: KernelContext, x: Array, sequence_lens: Array, *, batch_axis: int = 1, time_axis: int = 0
) -> Array:
    """For each batch entry b, its first ``sequence_lens[b]`` time steps reversed."""
    xp = ctx.xp
    steps = x.shape[time_axis]
    t = xp.arange(steps, dtype=xp.int64)[:, None]
    lens = sequence_lens.astype(xp.int64)[None, :]
    source = xp.where(t < lens, lens - 1 - t, t)  # (time, batch)
    if batch_axis < time_axis:
        source = source.T
    shape = [1] * x.ndim
    shape[time_axis], shape[batch_axis] = steps, x.shape[batch_axis]
    source = xp.broadcast_to(source.reshape(shape), x.shape)
    return xp.take_along_axis(x, source, axis=time_axis)


# ---------------------------------------------------------------------------
# Scattering (the output is a copy of ``data`` with some entries replaced or combined)


def _scatter_into(xp: Any, out: Array, index: tuple[Array, ...], updates: Array, reduction: str) -> Array:
    """Write ``updates`` into ``out[index]``, combining with ``reduction`` when not none."""
    if reduction == "none":
        out[index] = updates
        return out
    ufuncs = {"add": xp.add, "mul": xp.multiply, "max": xp.maximum, "min": xp.minimum}
    if reduction not in ufuncs:
        raise ValueError(f"reduction {reduction!r} is not one of none, add, mul, max, min")
    ufuncs[reduction].at(out, index, updates)
    return out


@op("ScatterElements", traits=Trait.NONE, shape=same_as_first)
def scatter_elements(
    ctx: KernelContext, data: Array, indices: Array, updates: Array, *, axis: int = 0, reduction: str = "none"
) -> Array:
    """A copy of ``data`` with ``updates`` written at ``indices`` along ``axis``."""
    xp = ctx.xp
    axis = _axis(axis, data.ndim)
    index = _open_grid(xp, indices.shape)
    index[axis] = _nonneg_indices(xp, indices, data.shape[axis])
    return _scatter_into(xp, data.copy(), tuple(index), updates, reduction)


alias("Scatter", "ScatterElements")


@op("ScatterND", traits=Trait.NONE, shape=same_as_first)
def scatter_nd(ctx: KernelContext, data: Array, indices: Array, updates: Array, *, reduction: str = "none") -> Array:
    """A copy of ``data`` with slices addressed by ``indices`` replaced by (or combined with) ``updates``."""
    xp = ctx.xp
    index = tuple(_nonneg_indices(xp, indices[..., j], data.shape[j]) for j in range(indices.shape[-1]))
    return _scatter_into(xp, data.copy(), index, updates, reduction)


@op("TensorScatter", traits=Trait.NONE, shape=same_as_first)
def tensor_scatter(
    ctx: KernelContext,
    past_cache: Array,
    update: Array,
    write_indices: Array = None,
    *,
    mode: str = "linear",
    axis: int = -2,
) -> Array:
    """A copy of the cache with ``update`` written from each batch's write index on ``axis``."""
    xp = ctx.xp
    axis = _axis(axis, past_cache.ndim)
    batch, max_len, seq_len = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
    start = xp.zeros(batch, dtype=xp.int64) if write_indices is None else write_indices.astype(xp.int64)
    positions = start[:, None] + xp.arange(seq_len, dtype=xp.int64)[None, :]
    if mode == "circular":
        positions = positions % max_len
    out = past_cache.copy()
    # Move the sequence axis next to the batch axis; inner batch-like axes follow.
    view = xp.moveaxis(out, axis, 1)
    moved_update = xp.moveaxis(update, axis, 1)
    view[xp.arange(batch)[:, None], positions] = moved_update
    return out


# ---------------------------------------------------------------------------
# Reductions


def _reduce_axes(rank: int, axes: list[int], noop_with_empty_axes: int) -> tuple[int, ...] | None:
    """The axes to reduce, sorted; None when the reduction is a no-op."""
    if not axes:
        return None if noop_with_empty_axes else tuple(range(rank))
    return tuple(sorted({_axis(a, rank) for a in axes}))


def _reduced_dims(shape: Dims, axes: Iterable[int], keepdims: int) -> Dims:
    gone = set(axes)
    return tuple(1 if i in gone else d for i, d in enumerate(shape) if keepdims or i not in gone)


ReduceFn = Callable[[Any, Array, tuple[int, ...]], Array]


def _dtype_min(xp: Any, dtype: Any) -> Any:
    if dtype.kind == "b":
        return False
    return -xp.inf if dtype.kind == "f" else xp.iinfo(dtype).min


def _dtype_max(xp: Any, dtype: Any) -> Any:
    if dtype.kind == "b":
        return True
    return xp.inf if dtype.kind == "f" else xp.iinfo(dtype).max


def _log_sum_exp(xp: Any, x: Array, axes: tuple[int, ...]) -> Array:
    peak = xp.max(x, axis=axes, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0)
    return xp.log(xp.sum(xp.exp(x - peak), axis=axes, keepdims=True)) + peak


def _register_reduce(name: str, what: str, fn: ReduceFn, empty: Callable[[Any, Any], Any] | None = None) -> None:
    """Register Reduce<name>: ``fn(xp, x, axes)`` reduces with keepdims=True.

    ``empty(xp, dtype)`` gives the result of reducing zero elements where ``fn`` cannot
    (max and min of nothing).
    """

    def kernel(
        ctx: KernelContext,
        data: Array,
        axes_input: Array = None,
        *,
        keepdims: int = 1,
        noop_with_empty_axes: int = 0,
        axes: Any = None,
    ) -> Array:
        xp = ctx.xp
        chosen = _reduce_axes(data.ndim, _ints(_first_given(axes_input, axes)), noop_with_empty_axes)
        if chosen is None:
            return data
        if empty is not None and any(data.shape[a] == 0 for a in chosen):
            result = xp.full(_reduced_dims(data.shape, chosen, 1), empty(xp, data.dtype), dtype=data.dtype)
        else:
            result = fn(xp, data, chosen)
        if not keepdims:
            result = result.reshape(_reduced_dims(data.shape, chosen, 0))
        return result.astype(data.dtype, copy=False)

    kernel.__name__ = kernel.__qualname__ = name.lower()
    kernel.__doc__ = f"{what} over ``axes`` (all when absent), keeping them when keepdims."
    op(name, traits=Trait.REDUCTION | _VALUE_SHAPE)(kernel)


_register_reduce("ReduceSum", "Sum", lambda xp, x, ax: xp.sum(x, axis=ax, keepdims=True))
_register_reduce("ReduceMean", "Mean", lambda xp, x, ax: xp.mean(x, axis=ax, keepdims=True))
_register_reduce("ReduceProd", "Product", lambda xp, x, ax: xp.prod(x, axis=ax, keepdims=True))
_register_reduce("ReduceMax", "Maximum", lambda xp, x, ax: xp.max(x, axis=ax, keepdims=True), _dtype_min)
_register_reduce("ReduceMin", "Minimum", lambda xp, x, ax: xp.min(x, axis=ax, keepdims=True), _dtype_max)
_register_reduce("ReduceL1", "Sum of absolute values", lambda xp, x, ax: xp.sum(xp.abs(x), axis=ax, keepdims=True))
_register_reduce("ReduceL2", "Euclidean norm", lambda xp, x, ax: xp.sqrt(xp.sum(x * x, axis=ax, keepdims=True)))
_register_reduce("ReduceSumSquare", "Sum of squares", lambda xp, x, ax: xp.sum(x * x, axis=ax, keepdims=True))
_register_reduce("ReduceLogSum", "Log of the sum", lambda xp, x, ax: xp.log(xp.sum(x, axis=ax, keepdims=True)))
_register_reduce("ReduceLogSumExp", "Log of the sum of exponentials", _log_sum_exp, lambda xp, dt: -xp.inf)


def _arg_rule(attrs: dict[str, Any], data: TensorInfo) -> list[TensorInfo]:
    """Shape rule of ArgMax/ArgMin: the axis reduced (kept when keepdims), int64."""
    if data.shape is None:
        return _unknown("int64")
    axis = _axis(attrs.get("axis", 0), len(data.shape))
    return [TensorInfo("int64", _reduced_dims(data.shape, [axis], attrs.get("keepdims", 1)))]


def _arg_reduce(
    xp: Any, pick: Callable[..., Array], data: Array, axis: int, keepdims: int, select_last_index: int
) -> Array:
    axis = _axis(axis, data.ndim)
    if select_last_index:
        flipped = xp.flip(data, axis=axis)
        index = data.shape[axis] - 1 - pick(flipped, axis=axis)
    else:
        index = pick(data, axis=axis)
    if keepdims:
        index = xp.expand_dims(index, axis)
    return index.astype(xp.int64)


@op("ArgMax", traits=Trait.REDUCTION | _WRITES, shape=_arg_rule)
def argmax(ctx: KernelContext, data: Array, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Array:
    """Index of the largest element along ``axis`` (first one, or last when asked), int64."""
    return _arg_reduce(ctx.xp, ctx.xp.argmax, data, axis, keepdims, select_last_index)


@op("ArgMin", traits=Trait.REDUCTION | _WRITES, shape=_arg_rule)
def argmin(ctx: KernelContext, data: Array, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Array:
    """Index of the smallest element along ``axis`` (first one, or last when asked), int64."""
    return _arg_reduce(ctx.xp, ctx.xp.argmin, data, axis, keepdims, select_last_index)


def _scan(
    xp: Any, scan: Callable[..., Array], identity: int, x: Array, axis: Array, exclusive: int, reverse: int
) -> Array:
    """An inclusive scan along ``axis``, optionally reversed and/or shifted to exclusive."""
    axis_ = _axis(_int(axis), x.ndim)
    y = xp.flip(x, axis=axis_) if reverse else x
    y = scan(y, axis=axis_, dtype=x.dtype)
    if exclusive:
        head = [slice(None)] * x.ndim
        head[axis_] = slice(0, x.shape[axis_] - 1)
        pad_shape = list(x.shape)
        pad_shape[axis_] = min(1, x.shape[axis_])
        y = xp.concatenate([xp.full(pad_shape, identity, dtype=x.dtype), y[tuple(head)]], axis=axis_)
    return xp.flip(y, axis=axis_) if reverse else y


@op("CumSum", traits=_WRITES, shape=same_as_first)
def cum_sum(ctx: KernelContext, x: Array, axis: Array, *, exclusive: int = 0, reverse: int = 0) -> Array:
    """Running sums along ``axis`` (exclusive: shifted by one; reverse: from the end)."""
    return _scan(ctx.xp, ctx.xp.cumsum, 0, x, axis, exclusive, reverse)


@op("CumProd", traits=_WRITES, shape=same_as_first)
def cum_prod(ctx: KernelContext, x: Array, axis: Array, *, exclusive: int = 0, reverse: int = 0) -> Array:
    """Running products along ``axis`` (exclusive: shifted by one; reverse: from the end)."""
    return _scan(ctx.xp, ctx.xp.cumprod, 1, x, axis, exclusive, reverse)


def _order_reversing_key(xp: Any, x: Array) -> Array:
    """A key whose ascending order is ``x``'s descending order (no overflow on ints)."""
    return ~x if x.dtype.kind in "iu" else -x


@op("TopK", traits=_VALUE_SHAPE, outputs=2)
def top_k(
    ctx: KernelContext,
    x: Array,
    k_input: Array = None,
    *,
    axis: int = -1,
    largest: int = 1,
    sorted: int = 1,  # noqa: A002  (ONNX's attribute name)
    k: int | None = None,
) -> tuple[Array, Array]:
    """The k largest (or smallest) entries along ``axis`` and their int64 indices; ties by lower index."""
    xp = ctx.xp
    count = _int(_first_given(k_input, k))
    key = _order_reversing_key(xp, x) if largest else x
    order = xp.argsort(key, axis=axis, kind="stable")
    indices = xp.take(order, xp.arange(count), axis=axis)
    return xp.take_along_axis(x, indices, axis=axis), indices.astype(xp.int64)


@op("Unique", traits=_DYNAMIC, outputs=(1, 4))
def unique(
    ctx: KernelContext,
    x: Array,
    *,
    axis: int | None = None,
    sorted: int = 1,  # noqa: A002  (ONNX's name)
) -> tuple[Array, Array, Array, Array]:
    """Unique values (or slices along ``axis``), first-occurrence indices, inverse indices, counts."""
    xp = ctx.xp
    if axis is not None:
        axis = _axis(axis, x.ndim)
    values, first, inverse, counts = xp.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not sorted:  # reorder by first occurrence
        order = xp.argsort(first, kind="stable")
        rank = xp.argsort(order, kind="stable")
        values = xp.take(values, order, axis=axis if axis is not None else 0)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return values, first.astype(xp.int64), inverse.astype(xp.int64), counts.astype(xp.int64)
