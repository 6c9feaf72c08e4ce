"""Convolution, pooling, image and signal ops.

Convolutions run as im2col over strided views followed by one batched matmul; pools
reduce the same strided window view. Sliding-window geometry (output size and padding
from kernel, stride, dilation, pads and auto_pad) lives in one helper shared by the
kernels and the shape rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsp_core.ir.dtypes import numpy_from_onnx
from dsp_core.ops.registry import TensorInfo, Trait, op, same_as_first

# ---------------------------------------------------------------------------
# Sliding-window geometry


def _ints(values: Sequence[int] | None, n: int, fill: int) -> list[int]:
    """``values`` as a list of ints, or ``n`` copies of ``fill`` when absent."""
    return [int(v) for v in values] if values is not None else [fill] * n


def _window_extent(kernel: int, dilation: int) -> int:
    return (kernel - 1) * dilation + 1


def _window_geometry(
    in_sp: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    auto_pad: str = "NOTSET",
    ceil_mode: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Output spatial dims and the (begin, end) pads a sliding window needs.

    The end pads include the extra room ceil_mode needs for its last window.
    """
    n = len(in_sp)
    out, begin, end = [], [], []
    for i in range(n):
        size, ext, s = in_sp[i], _window_extent(kernel[i], dilations[i]), strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max(0, (o - 1) * s + ext - size)
            small, big = total // 2, total - total // 2
            pb, pe = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            pb = pe = 0
            o = (size - ext) // s + 1
        else:
            pb, pe = pads[i], pads[i + n]
            span = size + pb + pe - ext
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= size + pb:
                o -= 1  # the last window must start inside the image or its left pad
        out.append(o)
        begin.append(pb)
        end.append(max(pe, (o - 1) * s + ext - size - pb))
    return out, begin, end


def _geometry_from_attrs(
    in_sp: Sequence[int], kernel: Sequence[int], attrs: dict[str, Any]
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(out, pads_begin, pads_end, strides, dilations) from a node's attributes."""
    n = len(in_sp)
    strides = _ints(attrs.get("strides"), n, 1)
    dilations = _ints(attrs.get("dilations"), n, 1)
    pads = _ints(attrs.get("pads"), 2 * n, 0)
    for name, vals, want, low in (
        ("kernel_shape", list(kernel), n, 1),
        ("strides", strides, n, 1),
        ("dilations", dilations, n, 1),
        ("pads", pads, 2 * n, 0),
    ):
        if len(vals) != want or any(v < low for v in vals):
            raise ValueError(f"{name} {vals} must hold {want} values >= {low} for {n} spatial dims")
    auto_pad = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    out, pb, pe = _window_geometry(in_sp, kernel, strides, dilations, pads, auto_pad, bool(attrs.get("ceil_mode", 0)))
    return out, pb, pe, strides, dilations


def _pad_spatial(xp: Any, x: Any, begin: Sequence[int], end: Sequence[int], value: Any = 0) -> Any:
    """``x`` padded on its trailing spatial axes (a no-op view when nothing to pad)."""
    if not any(begin) and not any(end):
        return x
    lead = [(0, 0)] * (x.ndim - len(begin))
    widths = lead + [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    y = xp.pad(x, widths, mode="constant", constant_values=value)
    # negative pads crop
    crop = tuple(slice(None) for _ in lead) + tuple(
        slice(-min(b, 0), y.shape[len(lead) + i] + min(e, 0)) for i, (b, e) in enumerate(zip(begin, end))
    )
    return y[crop]


def _windows(
    xp: Any, x: Any, out: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> Any:
    """A read-only view (lead..., *out, *kernel) of every window of padded ``x``."""
    n = len(out)
    lead = x.shape[: x.ndim - n]
    sp_strides = x.strides[x.ndim - n :]
    for o, k, s, d, size in zip(out, kernel, strides, dilations, x.shape[x.ndim - n :]):
        # as_strided reads whatever memory the geometry names: it must stay inside x
        if o < 0 or k < 1 or s < 1 or d < 1 or (o > 0 and (o - 1) * s + (k - 1) * d >= size):
            raise ValueError(
                f"window geometry out of bounds: {o} windows of {k} (stride {s}, dilation {d}) over {size}"
            )
    shape = (*lead, *out, *kernel)
    st = (
        *x.strides[: x.ndim - n],
        *(a * s for a, s in zip(sp_strides, strides)),
        *(a * d for a, d in zip(sp_strides, dilations)),
    )
    return xp.lib.stride_tricks.as_strided(x, shape=shape, strides=st)


def _acc_dtype(dtype: Any) -> Any:
    """The dtype to accumulate in: float64 stays, everything else goes through float32."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# ---------------------------------------------------------------------------
# Shape rules


def _spatial_rule(attrs: dict[str, Any], x: TensorInfo, channels: Any, kernel: Sequence[Any] | None) -> TensorInfo:
    """(N, channels, *out) when every spatial dim and the kernel are known ints."""
    if x.shape is None:
        return TensorInfo(x.dtype, None)
    sp = x.shape[2:]
    known = kernel is not None and all(isinstance(d, int) for d in (*sp, *kernel))
    out: list[Any]
    if known:
        out = _geometry_from_attrs(sp, kernel, attrs)[0]  # type: ignore[arg-type]
    else:
        out = [None] * len(sp)
    return TensorInfo(x.dtype, (x.shape[0], channels, *out))


def _conv_rule(attrs: dict[str, Any], x: TensorInfo, w: TensorInfo, *rest: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Conv: (N, M, *out)."""
    kernel = attrs.get("kernel_shape") or (w.shape[2:] if w.shape is not None else None)
    m = w.shape[0] if w.shape is not None else None
    return [_spatial_rule(attrs, x, m, kernel)]


def _pool_rule(attrs: dict[str, Any], x: TensorInfo, *rest: Any) -> list[TensorInfo]:
    """Shape rule of a pool: (N, C, *out), plus int64 indices for MaxPool."""
    c = x.shape[1] if x.shape is not None else None
    y = _spatial_rule(attrs, x, c, attrs.get("kernel_shape"))
    return [y, TensorInfo("int64", y.shape)]


def _global_pool_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of a global pool: (N, C, 1, ...)."""
    if x.shape is None:
        return [x]
    return [TensorInfo(x.dtype, (*x.shape[:2], *([1] * (len(x.shape) - 2))))]


def _conv_transpose_rule(attrs: dict[str, Any], x: TensorInfo, w: TensorInfo, *rest: TensorInfo) -> list[TensorInfo]:
    """Shape rule of ConvTranspose: (N, M, *out)."""
    if x.shape is None or w.shape is None:
        return [TensorInfo(x.dtype, None)]
    m = w.shape[1] * attrs.get("group", 1) if isinstance(w.shape[1], int) else None
    sp, kernel = x.shape[2:], attrs.get("kernel_shape") or w.shape[2:]
    if not all(isinstance(d, int) for d in (*sp, *kernel)):
        return [TensorInfo(x.dtype, (x.shape[0], m, *([None] * len(sp))))]
    out = _transpose_geometry(sp, kernel, attrs)[0]  # type: ignore[arg-type]
    return [TensorInfo(x.dtype, (x.shape[0], m, *out))]


# ---------------------------------------------------------------------------
# Convolution


def _im2col_matmul(
    xp: Any, x: Any, w: Any, group: int, out: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> Any:
    """Convolve padded ``x`` (N, C, *sp) with ``w`` (M, C/group, *k): (N, M, *out)."""
    n, c = x.shape[:2]
    m, cg, kernel = w.shape[0], w.shape[1], w.shape[2:]
    nd, mg = len(kernel), m // group
    k_size, p_size = math.prod(kernel), math.prod(out)
    cols = _windows(xp, x, out, kernel, strides, dilations)  # (N, C, *out, *k)
    cols = cols.reshape(n, group, cg, *out, *kernel)
    # -> (G, N, *out, Cg, *k): one matmul row per output pixel
    perm = (1, 0, *range(3, 3 + nd), 2, *range(3 + nd, 3 + 2 * nd))
    cols = xp.ascontiguousarray(cols.transpose(perm)).reshape(group, n * p_size, cg * k_size)
    wmat = w.reshape(group, mg, cg * k_size).transpose(0, 2, 1)
    y = xp.matmul(cols, wmat)  # (G, N*P, Mg)
    y = y.reshape(group, n, p_size, mg).transpose(1, 0, 3, 2)
    return y.reshape(n, m, *out)


def _conv_core(xp: Any, x: Any, w: Any, attrs: dict[str, Any], pad_value: Any = 0) -> Any:
    """Conv of already-cast ``x`` and ``w`` under the node's window attributes."""
    kernel = list(w.shape[2:])
    out, pb, pe, strides, dilations = _geometry_from_attrs(x.shape[2:], kernel, attrs)
    xpad = _pad_spatial(xp, x, pb, pe, pad_value)
    return _im2col_matmul(xp, xpad, w, attrs.get("group", 1), out, strides, dilations)


def _bias_shape(b: Any, ndim: int) -> Any:
    return b.reshape((1, -1) + (1,) * (ndim - 2))


@op("Conv", traits=Trait.FUSABLE, shape=_conv_rule)
def conv(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """N-D convolution with groups, strides, dilations and padding."""
    acc = _acc_dtype(x.dtype)
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, pads=pads, strides=strides)
    y = _conv_core(ctx.xp, x.astype(acc, copy=False), w.astype(acc, copy=False), attrs)
    if b is not None:
        y = y + _bias_shape(b.astype(acc, copy=False), y.ndim)
    return y.astype(x.dtype, copy=False)


def _int_conv(xp: Any, x: Any, x_zp: Any, w: Any, w_zp: Any, attrs: dict[str, Any]) -> Any:
    """Exact integer convolution of zero-point-shifted operands, as float64."""
    # the zero point stays an array (a device scalar on a GPU: no host read inside a capture)
    xs = x.astype(np.float64) if x_zp is None else x.astype(np.float64) - x_zp.reshape(-1)[0].astype(np.float64)
    ws = w.astype(np.float64)
    if w_zp is not None:
        ws = ws - w_zp.astype(np.float64).reshape((-1,) + (1,) * (w.ndim - 1))
    return _conv_core(xp, xs, ws, attrs)


@op("ConvInteger", since=10)
def conv_integer(
    ctx,
    x,
    w,
    x_zero_point=None,
    w_zero_point=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """Integer convolution with zero points; int32 output."""
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, pads=pads, strides=strides)
    return ctx.xp.rint(_int_conv(ctx.xp, x, x_zero_point, w, w_zero_point, attrs)).astype(np.int32)


def _saturate(xp: Any, y: Any, dtype: Any) -> Any:
    """Round half to even and clip into integer ``dtype``."""
    info = np.iinfo(dtype)
    return xp.clip(xp.rint(y), info.min, info.max).astype(dtype)


@op("QLinearConv", since=10)
def qlinear_conv(
    ctx,
    x,
    x_scale,
    x_zero_point,
    w,
    w_scale,
    w_zero_point,
    y_scale,
    y_zero_point,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """Quantized convolution: int conv, rescale by x_scale*w_scale/y_scale, add y_zero_point."""
    xp = ctx.xp
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, pads=pads, strides=strides)
    acc = _int_conv(xp, x, x_zero_point, w, w_zero_point, attrs)
    if b is not None:
        acc = acc + _bias_shape(b.astype(np.float64), acc.ndim)
    scale = x_scale.astype(np.float64) * w_scale.astype(np.float64).reshape(-1) / y_scale.astype(np.float64)
    y = acc * _bias_shape(scale, acc.ndim) + y_zero_point.reshape(-1)[0].astype(np.float64)
    return _saturate(xp, y, y_zero_point.dtype)


@op("CausalConvWithState", since=27, outputs=2)
def causal_conv_with_state(ctx, x, weight, bias=None, past_state=None, *, activation="none"):
    """Causal depthwise 1-D conv carrying the last k-1 positions as state; optional SiLU."""
    xp = ctx.xp
    n, c, _ = x.shape
    k = weight.shape[2]
    past = xp.zeros((n, c, k - 1), dtype=x.dtype) if past_state is None else past_state.astype(x.dtype)
    padded = xp.concatenate([past, x], axis=2)
    acc = _acc_dtype(x.dtype)
    y = _conv_core(xp, padded.astype(acc), weight.astype(acc), {"group": c})
    if bias is not None:
        y = y + bias.astype(acc).reshape(1, -1, 1)
    y = y.astype(x.dtype)
    if activation in ("silu", "swish"):
        yf = y.astype(np.float32)
        y = (yf / (1.0 + xp.exp(-yf))).astype(x.dtype)
    elif activation != "none":
        raise ValueError(f"CausalConvWithState: activation {activation!r} is not one of none, silu, swish")
    return y, padded[:, :, padded.shape[2] - (k - 1) :]


# ---------------------------------------------------------------------------
# Transposed convolution and Col2Im: scatter-add of columns into an image


def _fold(xp: Any, cols: Any, full: Sequence[int], strides: Sequence[int], dilations: Sequence[int]) -> Any:
    """Sum ``cols`` (N, C, *k, *in) into an image (N, C, *full), one add per kernel tap.

    Tap ``kk`` at input position ``i`` lands at ``i*stride + kk*dilation``.
    """
    nd = len(full)
    kernel, in_sp = cols.shape[2 : 2 + nd], cols.shape[2 + nd :]
    y = xp.zeros((*cols.shape[:2], *full), dtype=cols.dtype)
    for kk in itertools.product(*(range(k) for k in kernel)):
        dst = tuple(slice(t * d, t * d + (i - 1) * s + 1, s) for t, d, i, s in zip(kk, dilations, in_sp, strides))
        y[(slice(None), slice(None), *dst)] += cols[(slice(None), slice(None), *kk)]
    return y


def _transpose_geometry(
    in_sp: Sequence[int], kernel: Sequence[int], attrs: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """ConvTranspose output dims and begin pads (the crop offset into the full output)."""
    n = len(in_sp)
    strides = _ints(attrs.get("strides"), n, 1)
    dilations = _ints(attrs.get("dilations"), n, 1)
    out_pad = _ints(attrs.get("output_padding"), n, 0)
    auto_pad = attrs.get("auto_pad") or "NOTSET"
    full = [
        s * (i - 1) + op_ + _window_extent(k, d) for s, i, op_, k, d in zip(strides, in_sp, out_pad, kernel, dilations)
    ]
    target = attrs.get("output_shape")
    if target is not None:
        target = list(target)[-n:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = [i * s for i, s in zip(in_sp, strides)]
    if target is None:
        pads = _ints(attrs.get("pads"), 2 * n, 0)
        return [f - pads[i] - pads[i + n] for i, f in enumerate(full)], pads[:n]
    total = [f - t for f, t in zip(full, target)]
    begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    return [int(t) for t in target], begin


@op("ConvTranspose", traits=Trait.FUSABLE, shape=_conv_transpose_rule)
def conv_transpose(
    ctx,
    x,
    w,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
):
    """Transposed convolution (gradient of Conv) with output_padding / output_shape."""
    xp = ctx.xp
    acc = _acc_dtype(x.dtype)
    n, c = x.shape[:2]
    in_sp, kernel, mg = x.shape[2:], w.shape[2:], w.shape[1]
    nd = len(in_sp)
    attrs = dict(
        auto_pad=auto_pad,
        dilations=dilations,
        output_padding=output_padding,
        output_shape=output_shape,
        pads=pads,
        strides=strides,
    )
    out, begin = _transpose_geometry(in_sp, kernel, attrs)
    strides_, dilations_ = _ints(strides, nd, 1), _ints(dilations, nd, 1)
    cg, k_size, p_size = c // group, math.prod(kernel), math.prod(in_sp)
    xg = x.astype(acc).reshape(n, group, cg, p_size).transpose(1, 0, 3, 2)  # (G, N, P, Cg)
    wg = w.astype(acc).reshape(group, 1, cg, mg * k_size)
    cols = xp.matmul(xg, wg).reshape(group, n, p_size, mg, k_size)
    cols = cols.transpose(1, 0, 3, 4, 2).reshape(n, group * mg, *kernel, *in_sp)
    reach = [(i - 1) * s + _window_extent(k, d) for i, s, k, d in zip(in_sp, strides_, kernel, dilations_)]
    y = _fold(xp, cols, reach, strides_, dilations_)
    # crop the pads off (or zero-extend, for output_padding / a larger output_shape)
    y = _pad_spatial(xp, y, [-b_ for b_ in begin], [o + b_ - r for o, b_, r in zip(out, begin, reach)])
    if b is not None:
        y = y + _bias_shape(b.astype(acc), y.ndim)
    return y.astype(x.dtype)


@op("Col2Im", traits=Trait.VALUE_DEPENDENT_SHAPE, since=18)
def col2im(ctx, x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Rearrange column blocks (N, C*prod(block), L) back into an image, summing overlaps."""
    image, kernel = [int(v) for v in image_shape.tolist()], [int(v) for v in block_shape.tolist()]
    attrs = dict(dilations=dilations, pads=pads, strides=strides)
    out, pb, pe, strides_, dilations_ = _geometry_from_attrs(image, kernel, attrs)
    n, ck, _ = x.shape
    cols = x.reshape(n, ck // math.prod(kernel), *kernel, *out)
    padded = [i + b + e for i, b, e in zip(image, pb, pe)]
    y = _fold(ctx.xp, cols, padded, strides_, dilations_)
    return _pad_spatial(ctx.xp, y, [-b for b in pb], [-e for e in pe])


# ---------------------------------------------------------------------------
# Pooling


def _pool_view(
    xp: Any, x: Any, kernel_shape: Sequence[int], attrs: dict[str, Any], fill: Any
) -> tuple[Any, list[int], list[int], list[int], list[int]]:
    """The window view (N, C, *out, *k) of ``x`` padded with ``fill``, and its geometry.

    ``fill`` must not change the result (the lowest value for max, 0 for sums), so the
    parts of the windows that are padding in *every* window are cut off first
    (``_trim_windows``): a kernel far larger than its input costs what the input costs.
    The returned geometry (kernel, begin pads) is the trimmed one; it maps window
    positions to the same input positions.
    """
    out, pb, pe, strides, dilations = _geometry_from_attrs(x.shape[2:], kernel_shape, attrs)
    kernel, pb, pe = _trim_windows(x.shape[2:], list(kernel_shape), out, pb, pe, strides, dilations)
    xpad = _pad_spatial(xp, x, pb, pe, fill)
    return _windows(xp, xpad, out, kernel, strides, dilations), out, pb, strides, dilations


def _trim_windows(
    in_sp: Sequence[int],
    kernel: list[int],
    out: Sequence[int],
    pb: list[int],
    pe: list[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """(kernel, begin pads, end pads) without the window positions that only ever see padding."""
    kernel, pb, pe = list(kernel), list(pb), list(pe)
    for i, (size, o, s, d) in enumerate(zip(in_sp, out, strides, dilations)):
        if d != 1 or o <= 0 or kernel[i] <= size:
            continue
        lead = max(0, min(pb[i] - (o - 1) * s, kernel[i] - 1))  # padding before the data in every window
        kernel[i] -= lead
        pb[i] -= lead
        tail = max(0, min(kernel[i] - pb[i] - size, kernel[i] - 1))  # padding after the data in every window
        kernel[i] -= tail
        pe[i] = max(0, (o - 1) * s + kernel[i] - size - pb[i])
    return kernel, pb, pe


def _window_counts(
    xp: Any, in_sp: Sequence[int], kernel_shape: Sequence[int], attrs: dict[str, Any], include_pad: bool
) -> Any:
    """How many elements each window averages over: real ones, plus explicit pads if asked."""
    out, pb, pe, strides, dilations = _geometry_from_attrs(in_sp, kernel_shape, attrs)
    pads = _ints(attrs.get("pads"), 2 * len(in_sp), 0)
    ones = xp.ones(tuple(in_sp), dtype=np.float64)
    if not include_pad:  # padding counts 0: cut what only ever sees padding, as _pool_view does
        kernel_shape, pb, pe = _trim_windows(in_sp, list(kernel_shape), out, pb, pe, strides, dilations)
    if include_pad and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "", None):
        # explicit pads count, the extra room of ceil_mode does not
        nd = len(in_sp)
        ones = _pad_spatial(xp, ones, pads[:nd], pads[nd:], 1.0)
        pb = [b - p for b, p in zip(pb, pads[:nd])]
        pe = [e - p for e, p in zip(pe, pads[nd:])]
    elif include_pad:
        ones = _pad_spatial(xp, ones, pb, pe, 1.0)
        pb = pe = [0] * len(in_sp)
    view = _windows(xp, _pad_spatial(xp, ones, pb, pe, 0.0), out, kernel_shape, strides, dilations)
    return view.sum(axis=tuple(range(len(in_sp), 2 * len(in_sp))))


def _pool_attrs(auto_pad: str, ceil_mode: int, dilations: Any, pads: Any, strides: Any) -> dict[str, Any]:
    return dict(auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations, pads=pads, strides=strides)


def _lowest(dtype: Any) -> Any:
    return -np.inf if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min


@op("MaxPool", outputs=(1, 2), shape=_pool_rule)
def max_pool(
    ctx,
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    storage_order=0,
    strides=None,
):
    """Max pooling; the optional Indices output holds flat input positions."""
    xp = ctx.xp
    attrs = _pool_attrs(auto_pad, ceil_mode, dilations, pads, strides)
    view, out, pb, strides_, dilations_ = _pool_view(xp, x, kernel_shape, attrs, _lowest(x.dtype))
    nd = len(kernel_shape)
    y = view.max(axis=tuple(range(2 + nd, 2 + 2 * nd)))
    if ctx.n_outputs < 2:
        return y, None
    flat = view.reshape(*view.shape[: 2 + nd], -1).argmax(axis=-1)
    kernel = view.shape[2 + nd :]  # the trimmed windows the view holds
    return y, _max_indices(xp, flat, x.shape, out, kernel, pb, strides_, dilations_, storage_order)


def _max_indices(
    xp: Any,
    flat: Any,
    x_shape: Sequence[int],
    out: Sequence[int],
    kernel: Sequence[int],
    pb: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    storage_order: int,
) -> Any:
    """Flat input indices (row- or column-major spatial) of each window's argmax."""
    nd = len(kernel)
    sp = x_shape[2:]
    # unravel by arithmetic: CuPy's unravel_index checks its bounds on the host (a sync, no capture)
    taps, rest = [], flat
    for k in reversed(kernel):
        taps.append(rest % k)
        rest = rest // k
    taps.reverse()
    pos = []
    for i in range(nd):
        o = xp.arange(out[i]).reshape((-1,) + (1,) * (nd - 1 - i))
        pos.append(o * strides[i] - pb[i] + taps[i] * dilations[i])
    order = range(nd - 1, -1, -1) if storage_order else range(nd)
    index = xp.zeros(flat.shape, dtype=np.int64)
    for i in order:
        index = index * sp[i] + pos[i]
    nc = xp.arange(x_shape[0] * x_shape[1], dtype=np.int64).reshape(x_shape[0], x_shape[1], *([1] * nd))
    return index + nc * math.prod(sp)


@op("AveragePool", shape=_pool_rule)
def average_pool(
    ctx,
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    count_include_pad=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """Average pooling; count_include_pad decides whether explicit pads are averaged in."""
    xp = ctx.xp
    attrs = _pool_attrs(auto_pad, ceil_mode, dilations, pads, strides)
    acc = _acc_dtype(x.dtype)
    view = _pool_view(xp, x.astype(acc), kernel_shape, attrs, 0)[0]
    nd = len(kernel_shape)
    total = view.sum(axis=tuple(range(2 + nd, 2 + 2 * nd)))
    counts = _window_counts(xp, x.shape[2:], kernel_shape, attrs, bool(count_include_pad))
    return (total / counts).astype(x.dtype)


@op("LpPool", shape=_pool_rule)
def lp_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None, strides=None):
    """Lp pooling: (sum |x|^p over the window) ^ (1/p)."""
    xp = ctx.xp
    attrs = _pool_attrs(auto_pad, ceil_mode, dilations, pads, strides)
    acc = _acc_dtype(x.dtype)
    view = _pool_view(xp, xp.abs(x.astype(acc)) ** p, kernel_shape, attrs, 0)[0]
    nd = len(kernel_shape)
    return (view.sum(axis=tuple(range(2 + nd, 2 + 2 * nd))) ** (1.0 / p)).astype(x.dtype)


def _global(xp: Any, x: Any, reduce: str) -> Any:
    axes = tuple(range(2, x.ndim))
    if reduce == "max":
        return x.max(axis=axes, keepdims=True)
    return x.astype(_acc_dtype(x.dtype)).mean(axis=axes, keepdims=True).astype(x.dtype)


@op("GlobalAveragePool", traits=Trait.REDUCTION | Trait.FUSABLE, shape=_global_pool_rule)
def global_average_pool(ctx, x):
    """Mean over every spatial axis, kept as size 1."""
    return _global(ctx.xp, x, "mean")


@op("GlobalMaxPool", traits=Trait.REDUCTION | Trait.FUSABLE, shape=_global_pool_rule)
def global_max_pool(ctx, x):
    """Max over every spatial axis, kept as size 1."""
    return _global(ctx.xp, x, "max")


@op("GlobalLpPool", traits=Trait.REDUCTION, shape=_global_pool_rule)
def global_lp_pool(ctx, x, *, p=2):
    """Lp norm over every spatial axis, kept as size 1."""
    xf = ctx.xp.abs(x.astype(_acc_dtype(x.dtype))) ** p
    return (xf.sum(axis=tuple(range(2, x.ndim)), keepdims=True) ** (1.0 / p)).astype(x.dtype)


@op("MaxUnpool", traits=Trait.VALUE_DEPENDENT_SHAPE, since=9)
def max_unpool(ctx, x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    """Scatter pooled values back to the positions their indices name; zeros elsewhere."""
    xp = ctx.xp
    nd = len(kernel_shape)
    strides_, pads_ = _ints(strides, nd, 1), _ints(pads, 2 * nd, 0)
    sp = [
        (i - 1) * s + k - pads_[d] - pads_[d + nd]
        for d, (i, s, k) in enumerate(zip(x.shape[2:], strides_, kernel_shape))
    ]
    default = (*x.shape[:2], *sp)
    shape = default if output_shape is None else tuple(int(v) for v in output_shape.tolist())
    # indices address the default unpooled shape; re-address them in the requested one
    flat = xp.ravel_multi_index(xp.unravel_index(indices.reshape(-1), default), shape)
    y = xp.zeros(math.prod(shape), dtype=x.dtype)
    y[flat] = x.reshape(-1)
    return y.reshape(shape)


@op("LRN", traits=Trait.FUSABLE, shape=same_as_first)
def lrn(ctx, x, *, alpha=0.0001, beta=0.75, bias=1.0, size=None):
    """Local response normalization across channels."""
    xp = ctx.xp
    acc = _acc_dtype(x.dtype)
    sq = x.astype(acc) ** 2
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = xp.pad(sq, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    c = x.shape[1]
    window = sum(padded[:, i : i + c] for i in range(size))
    return (x.astype(acc) / (bias + alpha / size * window) ** beta).astype(x.dtype)


# ---------------------------------------------------------------------------
# Resize: separable, one axis at a time, each output position a weighted sum of taps


def _source_coords(xp: Any, mode: str, out_n: int, scale: float, in_n: int, roi: tuple[float, float]) -> Any:
    """Input coordinate of every output position along one axis."""
    y = xp.arange(out_n, dtype=np.float64)
    out_f = scale * in_n  # the unrounded output length
    if mode == "asymmetric":
        return y / scale
    if mode == "align_corners":
        return y * 0.0 if out_f == 1 else y * (in_n - 1) / (out_f - 1)
    if mode == "pytorch_half_pixel":
        return y * 0.0 - 0.5 if out_f == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if mode == "half_pixel_symmetric":
        offset = in_n / 2 * (1 - out_n / out_f)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_f == 1:
            return y * 0.0 + (end - start) * (in_n - 1) / 2 + start * (in_n - 1)
        return start * (in_n - 1) + y * (end - start) * (in_n - 1) / (out_f - 1)
    raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")


def _nearest_index(xp: Any, x: Any, nearest_mode: str) -> Any:
    """Round source coordinates to input indices the way ``nearest_mode`` says."""
    rounding = {
        "round_prefer_floor": lambda v: xp.ceil(v - 0.5),
        "round_prefer_ceil": lambda v: xp.floor(v + 0.5),
        "floor": xp.floor,
        "ceil": xp.ceil,
    }
    if nearest_mode not in rounding:
        raise ValueError(f"Resize: unknown nearest_mode {nearest_mode!r}")
    return rounding[nearest_mode](x).astype(np.int64)


def _cubic_kernel(d: Any, a: float, xp: Any) -> Any:
    d = xp.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return xp.where(d <= 1, near, xp.where(d < 2, far, 0.0))


def _interp_taps(xp: Any, x: Any, in_n: int, scale: float, opts: dict[str, Any]) -> tuple[Any, Any]:
    """(indices, weights), each (out, taps), of linear or cubic interpolation at ``x``."""
    cubic = opts["mode"] == "cubic"
    radius = 2 if cubic else 1
    stretch = min(scale, 1.0) if opts["antialias"] else 1.0  # antialias widens the filter
    start = math.floor(-radius / stretch) + 1
    base = xp.floor(x)
    offsets = xp.arange(start, 1 - start + 1, dtype=np.float64)
    dist = (offsets[None, :] - (x - base)[:, None]) * stretch
    w = _cubic_kernel(dist, opts["cubic_coeff_a"], xp) if cubic else xp.clip(1 - xp.abs(dist), 0, 1)
    idx = base.astype(np.int64)[:, None] + offsets.astype(np.int64)[None, :]
    if opts["exclude_outside"]:
        w = xp.where((idx < 0) | (idx >= in_n), 0.0, w)
    if opts["antialias"] or opts["exclude_outside"]:
        w = w / w.sum(axis=1, keepdims=True)
    return xp.clip(idx, 0, in_n - 1), w


def _resize_axis(
    xp: Any, data: Any, axis: int, out_n: int, scale: float, roi: tuple[float, float], opts: dict[str, Any]
) -> Any:
    """Resize ``data`` along ``axis`` to ``out_n`` positions."""
    in_n = data.shape[axis]
    ctm = opts["coordinate_transformation_mode"]
    x = _source_coords(xp, ctm, out_n, scale, in_n, roi)
    if opts["mode"] == "nearest":
        idx = xp.clip(_nearest_index(xp, x, opts["nearest_mode"]), 0, in_n - 1)
        y = xp.take(data, idx, axis=axis)
    else:
        idx, w = _interp_taps(xp, x, in_n, scale, opts)
        taps = xp.take(data, idx.reshape(-1), axis=axis)
        taps = taps.reshape(*data.shape[:axis], *idx.shape, *data.shape[axis + 1 :])
        w = w.astype(data.dtype).reshape(idx.shape + (1,) * (data.ndim - axis - 1))
        y = (taps * w).sum(axis=axis + 1)
    if ctm == "tf_crop_and_resize":
        outside = ((x < 0) | (x > in_n - 1)).reshape((-1,) + (1,) * (data.ndim - axis - 1))
        y = xp.where(outside, xp.asarray(opts["extrapolation_value"], dtype=y.dtype), y)
    return y


def _resize_plan(
    x_shape: Sequence[int], scales: Any, sizes: Any, axes: Sequence[int], policy: str
) -> tuple[list[float], list[int]]:
    """Per-axis (scale, output length) for the resized axes."""
    in_sp = [x_shape[a] for a in axes]
    if sizes is not None and sizes.size:
        want = [int(v) for v in sizes.tolist()]
        scale_list = [o / i for o, i in zip(want, in_sp)]
        if policy in ("not_larger", "not_smaller"):
            s = min(scale_list) if policy == "not_larger" else max(scale_list)
            return [s] * len(axes), [int(math.floor(s * i + 0.5)) for i in in_sp]
        return scale_list, want
    scale_list = [float(v) for v in scales.tolist()]
    return scale_list, [int(math.floor(i * s)) for i, s in zip(in_sp, scale_list)]


def _resize(
    xp: Any, x: Any, roi: Any, scales: Any, sizes: Any, axes: Sequence[int] | None, opts: dict[str, Any]
) -> Any:
    """Resize ``x``; shared by Resize and Upsample."""
    r = x.ndim
    axes = [a % r for a in axes] if axes is not None else list(range(r))
    scale_list, out_list = _resize_plan(x.shape, scales, sizes, axes, opts.get("keep_aspect_ratio_policy", "stretch"))
    rois = roi.tolist() if roi is not None and roi.size else None
    nearest = opts["mode"] == "nearest"
    y = x if nearest else x.astype(np.float64 if x.dtype.kind != "f" else _acc_dtype(x.dtype))
    for i, axis in enumerate(axes):
        pair = (float(rois[i]), float(rois[i + len(axes)])) if rois else (0.0, 1.0)
        if math.isclose(scale_list[i], 1.0) and out_list[i] == x.shape[axis] and pair == (0.0, 1.0):
            continue  # identity along this axis
        y = _resize_axis(xp, y, axis, out_list[i], scale_list[i], pair, opts)
    if y.dtype == x.dtype:
        return y
    return y.astype(x.dtype) if x.dtype.kind == "f" else _saturate(xp, y, x.dtype)


@op("Resize", since=10, traits=Trait.VALUE_DEPENDENT_SHAPE)
def resize(
    ctx,
    x,
    roi=None,
    scales=None,
    sizes=None,
    *,
    antialias=0,
    axes=None,
    coordinate_transformation_mode="half_pixel",
    cubic_coeff_a=-0.75,
    exclude_outside=0,
    extrapolation_value=0.0,
    keep_aspect_ratio_policy="stretch",
    mode="nearest",
    nearest_mode="round_prefer_floor",
):
    """Resize by scales or to sizes: nearest, linear or cubic, with every coordinate mode."""
    if ctx.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates, floor for nearest
        roi, scales = None, roi
        coordinate_transformation_mode, nearest_mode = "asymmetric", "floor"
    opts = dict(
        antialias=antialias,
        coordinate_transformation_mode=coordinate_transformation_mode,
        cubic_coeff_a=cubic_coeff_a,
        exclude_outside=exclude_outside,
        extrapolation_value=extrapolation_value,
        keep_aspect_ratio_policy=keep_aspect_ratio_policy,
        mode=mode,
        nearest_mode=nearest_mode,
    )
    return _resize(ctx.xp, x, roi, scales, sizes, axes, opts)


@op("Upsample", since=9, traits=Trait.VALUE_DEPENDENT_SHAPE)
def upsample(ctx, x, scales, *, mode="nearest"):
    """Deprecated upsampling by scales: nearest (floor) or linear, asymmetric coordinates."""
    opts = dict(
        antialias=0,
        coordinate_transformation_mode="asymmetric",
        cubic_coeff_a=-0.75,
        exclude_outside=0,
        extrapolation_value=0.0,
        mode="linear" if mode in ("linear", "bilinear") else mode,
        nearest_mode="floor",
    )
    return _resize(ctx.xp, x, None, scales, None, None, opts)


# ---------------------------------------------------------------------------
# Sampling at fractional positions: GridSample, DeformConv, AffineGrid


def _reflect(xp: Any, x: Any, lo: float, hi: float) -> Any:
    """Fold coordinates outside [lo, hi] back in by mirror reflection."""
    rng = hi - lo
    if rng <= 0:
        return xp.zeros_like(x) + lo
    below, above = lo - x, x - hi
    dist = xp.where(x < lo, below, above)
    n = xp.trunc(dist / rng)
    r = dist - n * rng
    even = (n % 2) == 0
    low_side = xp.where(even, lo + r, hi - r)
    high_side = xp.where(even, hi - r, lo + r)
    return xp.where(x < lo, low_side, xp.where(x > hi, high_side, x))


def _axis_taps(xp: Any, x: Any, mode: str) -> tuple[Any, list[tuple[int, Any]]]:
    """Base index and (offset, weight) taps of one axis of nearest/linear/cubic sampling."""
    if mode == "nearest":
        return x.astype(np.int64), [(0, xp.ones_like(x))]
    base = xp.floor(x)
    r = x - base
    if mode == "linear":
        return base.astype(np.int64), [(0, 1 - r), (1, r)]
    return base.astype(np.int64), [(o, _cubic_kernel(o - r, -0.75, xp)) for o in (-1, 0, 1, 2)]


def _fix_index(xp: Any, idx: Any, size: int, padding: str, borders: tuple[float, float]) -> tuple[Any, Any]:
    """An in-range index for each tap and whether the tap reads real data."""
    if padding == "zeros":
        valid = (idx >= 0) & (idx < size)
        return xp.clip(idx, 0, size - 1), valid
    if padding == "reflection":
        idx = _reflect(xp, idx.astype(np.float64), *borders).astype(np.int64)
    return xp.clip(idx, 0, size - 1), None


def _sample(xp: Any, data: Any, coords: Any, mode: str, padding: str, borders: list[tuple[float, float]]) -> Any:
    """Sample ``data`` (N, C, *sp) at pixel ``coords`` (N, P, nd): (N, C, P)."""
    n, c, sp = data.shape[0], data.shape[1], data.shape[2:]
    flat_data = data.reshape(n, c, -1)
    axes = [_axis_taps(xp, coords[..., d], mode) for d in range(len(sp))]
    out = xp.zeros((n, c, coords.shape[1]), dtype=data.dtype)
    for combo in itertools.product(*(taps for _, taps in axes)):
        flat: Any = 0
        weight: Any = 1.0
        for d, (offset, w) in enumerate(combo):
            idx, valid = _fix_index(xp, axes[d][0] + offset, sp[d], padding, borders[d])
            flat = flat * sp[d] + idx
            weight = weight * (w if valid is None else xp.where(valid, w, 0.0))
        index = xp.broadcast_to(flat[:, None, :], out.shape)
        out += xp.take_along_axis(flat_data, index, axis=2) * weight[:, None, :].astype(data.dtype)
    return out


@op("GridSample", since=16)
def grid_sample(ctx, x, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    """Sample ``x`` at the normalized positions of ``grid`` (nearest, linear or cubic)."""
    xp = ctx.xp
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    n, c, sp = x.shape[0], x.shape[1], x.shape[2:]
    nd = len(sp)
    g = grid.astype(np.float64).reshape(n, -1, nd)[..., ::-1]  # grid holds (x, y, ...) = reversed axes
    # per axis, with the sizes as Python numbers: an array of them would be a host-to-device copy
    scaled = [
        (g[..., d] + 1) / 2 * (s - 1) if align_corners else ((g[..., d] + 1) * s - 1) / 2 for d, s in enumerate(sp)
    ]
    coords = xp.stack(scaled, axis=-1)
    borders = [(0.0, s - 1.0) if align_corners else (-0.5, s - 0.5) for s in sp]
    if mode == "nearest":
        coords = xp.rint(coords)
    if padding_mode == "border":
        coords = xp.stack([xp.clip(coords[..., d], 0, s - 1) for d, s in enumerate(sp)], axis=-1)
    elif padding_mode == "reflection":
        coords = xp.stack([_reflect(xp, coords[..., d], *borders[d]) for d in range(nd)], axis=-1)
    acc = _acc_dtype(x.dtype)
    y = _sample(xp, x.astype(acc), coords, mode, padding_mode, borders)
    return y.reshape(n, c, *grid.shape[1:-1]).astype(x.dtype)


@op("AffineGrid", since=20, traits=Trait.VALUE_DEPENDENT_SHAPE)
def affine_grid(ctx, theta, size, *, align_corners=0):
    """Sampling grid (N, *sp, nd) of affine matrices theta over a normalized [-1, 1] box."""
    xp = ctx.xp
    sp = [int(v) for v in size.tolist()[2:]]
    axes = []
    for s in sp:
        i = xp.arange(s, dtype=np.float64)
        axes.append(i * (2.0 / (s - 1)) - 1 if align_corners and s > 1 else (2 * i + 1) / s - 1)
    mesh = xp.meshgrid(*axes, indexing="ij")
    base = xp.stack([*mesh[::-1], xp.ones_like(mesh[0])], axis=-1)  # (*sp, nd+1) as (x, y, ..., 1)
    grid = xp.einsum("...k,njk->n...j", base, theta.astype(np.float64))
    return grid.astype(theta.dtype)


@op("DeformConv", since=19)
def deform_conv(
    ctx,
    x,
    w,
    offset,
    b=None,
    mask=None,
    *,
    dilations=None,
    group=1,
    kernel_shape=None,
    offset_group=1,
    pads=None,
    strides=None,
):
    """Deformable convolution: each tap samples bilinearly at its learned offset."""
    xp = ctx.xp
    acc = _acc_dtype(x.dtype)
    n, c, sp = x.shape[0], x.shape[1], x.shape[2:]
    kernel, nd = w.shape[2:], len(sp)
    out, pb, _, strides_, dilations_ = _geometry_from_attrs(
        sp, kernel, dict(dilations=dilations, pads=pads, strides=strides)
    )
    k_size, p_size = math.prod(kernel), math.prod(out)
    # regular sampling positions (K, P, nd) plus offsets (N, og, K, P, nd)
    grids = xp.meshgrid(
        *(xp.arange(k, dtype=np.float64) for k in kernel), *(xp.arange(o, dtype=np.float64) for o in out), indexing="ij"
    )
    regular = xp.stack([grids[d] * dilations_[d] + grids[nd + d] * strides_[d] - pb[d] for d in range(nd)], axis=-1)
    off = offset.astype(np.float64).reshape(n, offset_group, k_size, nd, p_size).transpose(0, 1, 2, 4, 3)
    coords = (regular.reshape(k_size, p_size, nd) + off).reshape(n * offset_group, k_size * p_size, nd)
    data = x.astype(acc).reshape(n * offset_group, c // offset_group, *sp)
    cols = _sample(xp, data, coords, "linear", "zeros", [(0.0, 0.0)] * nd).reshape(
        n, offset_group, c // offset_group, k_size, p_size
    )
    if mask is not None:
        cols = cols * mask.astype(acc).reshape(n, offset_group, 1, k_size, p_size)
    cg, mg = c // group, w.shape[0] // group
    cols = cols.reshape(n, group, cg * k_size, p_size).transpose(1, 0, 3, 2)  # (G, N, P, Cg*K)
    y = xp.matmul(cols, w.astype(acc).reshape(group, 1, mg, cg * k_size).transpose(0, 1, 3, 2))
    y = y.transpose(1, 0, 3, 2).reshape(n, group * mg, *out)
    if b is not None:
        y = y + _bias_shape(b.astype(acc), y.ndim)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------
# Detection: RoiAlign, NonMaxSuppression


def _roi_bilinear(xp: Any, feat: Any, ys: Any, xs: Any) -> tuple[list[Any], list[Any]]:
    """Corner values and weights of RoiAlign's bilinear sampling (zero beyond one pixel out)."""
    h, w = feat.shape[-2:]
    outside = (ys < -1.0) | (ys > h) | (xs < -1.0) | (xs > w)
    ys, xs = xp.maximum(ys, 0.0), xp.maximum(xs, 0.0)
    y0, x0 = xp.floor(ys).astype(np.int64), xp.floor(xs).astype(np.int64)
    y_edge, x_edge = y0 >= h - 1, x0 >= w - 1
    y0, x0 = xp.where(y_edge, h - 1, y0), xp.where(x_edge, w - 1, x0)
    y1, x1 = xp.where(y_edge, y0, y0 + 1), xp.where(x_edge, x0, x0 + 1)
    ly, lx = xp.where(y_edge, 0.0, ys - y0), xp.where(x_edge, 0.0, xs - x0)
    keep = xp.where(outside, 0.0, 1.0)
    weights = [(1 - ly) * (1 - lx) * keep, (1 - ly) * lx * keep, ly * (1 - lx) * keep, ly * lx * keep]
    values = [feat[:, yy, xx] for yy, xx in ((y0, x0), (y0, x1), (y1, x0), (y1, x1))]
    return values, weights


@op("RoiAlign", since=10)
def roi_align(
    ctx,
    x,
    rois,
    batch_indices,
    *,
    coordinate_transformation_mode="half_pixel",
    mode="avg",
    output_height=1,
    output_width=1,
    sampling_ratio=0,
    spatial_scale=1.0,
):
    """Pool each region of interest to (output_height, output_width) by bilinear sampling."""
    xp = ctx.xp
    half_pixel = coordinate_transformation_mode == "half_pixel" and ctx.opset >= 16
    shift = 0.5 if half_pixel else 0.0
    acc = _acc_dtype(x.dtype)
    outs = []
    for r, bi in zip(rois.astype(np.float64).tolist(), batch_indices.tolist()):
        x0, y0, x1, y1 = (v * spatial_scale - shift for v in r)
        rh, rw = y1 - y0, x1 - x0
        if not half_pixel:
            rh, rw = max(rh, 1.0), max(rw, 1.0)
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / output_height)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / output_width)
        ys = y0 + (xp.arange(output_height)[:, None] + (xp.arange(gh)[None, :] + 0.5) / gh) * (rh / output_height)
        xs = x0 + (xp.arange(output_width)[:, None] + (xp.arange(gw)[None, :] + 0.5) / gw) * (rw / output_width)
        yy, xx = ys.reshape(-1, 1, 1, 1) * 1.0, xs.reshape(1, 1, -1, 1)  # (oh*gh, 1, ow*gw, 1)
        yy, xx = xp.broadcast_arrays(yy[:, 0, :, 0], xx[:, 0, :, 0])
        values, weights = _roi_bilinear(xp, x[int(bi)].astype(acc), yy, xx)
        if mode == "avg":
            v = sum(val * wt.astype(acc) for val, wt in zip(values, weights))
            reduce = "mean"
        else:  # ORT's max: the largest weighted corner of any sample
            v = xp.max(xp.stack([val * wt.astype(acc) for val, wt in zip(values, weights)]), axis=0)
            reduce = "max"
        v = v.reshape(x.shape[1], output_height, gh, output_width, gw)
        outs.append(v.mean(axis=(2, 4)) if reduce == "mean" else v.max(axis=(2, 4)))
    if not outs:
        return xp.zeros((0, x.shape[1], output_height, output_width), dtype=x.dtype)
    return xp.stack(outs).astype(x.dtype)


def _corners(boxes: Any, center_point_box: int) -> Any:
    """Boxes as (y_min, x_min, y_max, x_max)."""
    if center_point_box:
        xc, yc, w, h = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y = np.sort(boxes[..., [0, 2]], axis=-1)
    x = np.sort(boxes[..., [1, 3]], axis=-1)
    return np.stack([y[..., 0], x[..., 0], y[..., 1], x[..., 1]], axis=-1)


def _iou_matrix(b: Any) -> Any:
    """Pairwise intersection over union of (y0, x0, y1, x1) boxes; 0 where they do not overlap."""
    ih = np.minimum(b[:, None, 2], b[None, :, 2]) - np.maximum(b[:, None, 0], b[None, :, 0])
    iw = np.minimum(b[:, None, 3], b[None, :, 3]) - np.maximum(b[:, None, 1], b[None, :, 1])
    inter = np.where((ih > 0) & (iw > 0), ih * iw, 0.0)
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area[:, None] + area[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((inter > 0) & (union > 0), inter / union, 0.0)


def _greedy_nms(scores: Any, iou: Any, limit: int, iou_threshold: float, score_threshold: float | None) -> list[int]:
    """Indices kept by greedy suppression, best score first (ties: lower index first)."""
    order = np.argsort(-scores, kind="stable")
    if score_threshold is not None:
        order = order[scores[order] > score_threshold]
    kept: list[int] = []
    for i in order.tolist():
        if len(kept) >= limit:
            break
        if not kept or not (iou[i, kept] > iou_threshold).any():
            kept.append(i)
    return kept


def _to_host(a: Any) -> np.ndarray:
    """A numpy copy of a numpy or cupy array (the greedy loop runs on the host)."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def _optional_scalar(a: Any, default: Any) -> Any:
    """The single value of an optional scalar input, or ``default`` when absent or empty."""
    if a is None or a.size == 0:
        return default
    return _to_host(a).reshape(-1)[0].item()


@op("NonMaxSuppression", since=10, traits=Trait.DYNAMIC_OUTPUT_SIZE)
def non_max_suppression(
    ctx, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None, *, center_point_box=0
):
    """Greedy per-class box selection; (selected, 3) int64 rows of (batch, class, box)."""
    xp = ctx.xp
    limit = _optional_scalar(max_output_boxes_per_class, 0)
    iou_t = _optional_scalar(iou_threshold, 0.0)
    score_t = _optional_scalar(score_threshold, None)
    corners = _corners(_to_host(boxes).astype(np.float64), center_point_box)
    all_scores = _to_host(scores).astype(np.float64)
    rows = []
    for bi in range(corners.shape[0]):
        iou = _iou_matrix(corners[bi])
        for ci in range(all_scores.shape[1]):
            rows += [(bi, ci, k) for k in _greedy_nms(all_scores[bi, ci], iou, limit, iou_t, score_t)]
    return xp.asarray(np.array(rows, dtype=np.int64).reshape(-1, 3))


# ---------------------------------------------------------------------------
# Signal: DFT, STFT, windows, mel filterbank


def _as_complex(xp: Any, x: Any) -> Any:
    """A (..., 1) real or (..., 2) complex ONNX signal as a complex array (...).

    Single precision stays single (complex64) on numpy, as the ONNX reference computes it. On
    a device it is computed in double: cuFFT's single-precision transform differs from
    numpy's by ~1e-6 where the exact result is 0 (ONNX's inverse-DFT cases allow 1e-7).
    """
    ctype = np.complex128 if x.dtype == np.float64 or xp is not np else np.complex64
    z = x[..., 0].astype(ctype)
    if x.shape[-1] == 2:
        z = z + 1j * x[..., 1].astype(ctype)
    return z.astype(ctype)


def _as_pairs(xp: Any, z: Any, dtype: Any) -> Any:
    return xp.stack([z.real, z.imag], axis=-1).astype(dtype)


def _scalar(a: Any) -> Any:
    return a.reshape(-1)[0].item()


@op("DFT", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def dft(ctx, x, dft_length=None, axis_input=None, *, axis=1, inverse=0, onesided=0):
    """Discrete Fourier transform along one signal axis; (re, im) pairs in the last axis."""
    xp = ctx.xp
    if ctx.opset >= 20:
        axis = int(_scalar(axis_input)) if axis_input is not None else -2
    axis = axis % x.ndim
    signal = _as_complex(xp, x)
    n_in = x.shape[axis]
    if dft_length is not None and dft_length.size:
        n = int(_scalar(dft_length))
    else:
        n = 2 * (n_in - 1) if inverse and onesided else n_in
    if inverse and onesided:
        return xp.fft.irfft(signal, n=n, axis=axis)[..., None].astype(x.dtype)
    z = xp.fft.ifft(signal, n=n, axis=axis) if inverse else xp.fft.fft(signal, n=n, axis=axis)
    if onesided:
        z = xp.take(z, xp.arange(n // 2 + 1), axis=axis)
    return _as_pairs(xp, z, x.dtype)


@op("STFT", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def stft(ctx, signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """Short-time Fourier transform: (batch, frames, bins, 2)."""
    xp = ctx.xp
    step = int(_scalar(frame_step))
    length = signal.shape[1]
    if frame_length is not None:
        size = int(_scalar(frame_length))
    else:
        size = window.shape[0] if window is not None else length
    n_frames = (length - size) // step + 1
    z = _as_complex(xp, signal)  # (batch, length)
    starts = xp.arange(n_frames)[:, None] * step + xp.arange(size)[None, :]
    frames = z[:, starts]  # (batch, frames, size)
    if window is not None:
        frames = frames * window.astype(np.float64)
    spec = xp.fft.fft(frames, n=size, axis=-1)
    if onesided:
        spec = spec[..., : size // 2 + 1]
    return _as_pairs(xp, spec, signal.dtype)


def _cosine_window(xp: Any, size: Any, periodic: int, output_datatype: int, coeffs: Sequence[float]) -> Any:
    """sum_k (-1)^k a_k cos(2 pi k n / N), N = size (periodic) or size - 1 (symmetric)."""
    length = int(_scalar(size))
    denom = length if periodic else length - 1
    n = xp.arange(length, dtype=np.float64)
    w = xp.zeros(length, dtype=np.float64)
    for k, a in enumerate(coeffs):
        w = w + (-1) ** k * a * xp.cos(2 * math.pi * k * n / denom)
    return w.astype(numpy_from_onnx(output_datatype))


@op("HannWindow", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def hann_window(ctx, size, *, output_datatype=1, periodic=1):
    """Hann window of ``size`` points."""
    return _cosine_window(ctx.xp, size, periodic, output_datatype, (0.5, 0.5))


@op("HammingWindow", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def hamming_window(ctx, size, *, output_datatype=1, periodic=1):
    """Hamming window of ``size`` points (alpha = 25/46)."""
    return _cosine_window(ctx.xp, size, periodic, output_datatype, (25 / 46, 1 - 25 / 46))


@op("BlackmanWindow", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def blackman_window(ctx, size, *, output_datatype=1, periodic=1):
    """Blackman window of ``size`` points."""
    return _cosine_window(ctx.xp, size, periodic, output_datatype, (0.42, 0.5, 0.08))


@op("MelWeightMatrix", since=17, traits=Trait.VALUE_DEPENDENT_SHAPE)
def mel_weight_matrix(
    ctx, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *, output_datatype=1
):
    """Triangular mel filterbank (dft_length // 2 + 1, num_mel_bins), peaks of 1."""
    xp = ctx.xp
    n_mel, n_dft, rate = int(_scalar(num_mel_bins)), int(_scalar(dft_length)), _scalar(sample_rate)
    to_mel = lambda f: 2595 * math.log10(1 + f / 700)  # noqa: E731
    lo, hi = to_mel(float(_scalar(lower_edge_hertz))), to_mel(float(_scalar(upper_edge_hertz)))
    mel = lo + np.arange(n_mel + 2) * (hi - lo) / (n_mel + 2)
    hz = 700 * (10 ** (mel / 2595) - 1)
    edges = ((n_dft + 1) * hz // rate).astype(np.int64)
    j = np.arange(n_dft // 2 + 1)[:, None]
    left, center, right = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
    rise = np.where((j >= left) & (j <= center), (j - left) / np.maximum(center - left, 1), 0.0)
    rise = np.where((center == left) & (j == center), 1.0, rise)
    fall = np.where((j >= center) & (j < right), (right - j) / np.maximum(right - center, 1), 0.0)
    out = np.where((j >= center) & (right > center), fall, rise)
    return xp.asarray(out.astype(numpy_from_onnx(output_datatype)))
