"""Linear algebra, quantization, normalization and attention ops.

MatMul, Gemm, Einsum, Det; the integer and quantized matmuls and QuantizeLinear /
DequantizeLinear / DynamicQuantizeLinear; Softmax, LogSoftmax, Hardmax; LayerNorm,
RMSNorm, GroupNorm, InstanceNorm, BatchNorm, LpNorm, MeanVarianceNorm; Attention,
RotaryEmbedding and LinearAttention.

Half-precision inputs (float16, bfloat16) are computed in float32 and cast back, as
ONNX Runtime does; the output dtype is always ONNX's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from dsp_core.errors import DTypeError, ShapeError
from dsp_core.ir.dtypes import FLOAT8_DTYPES, numpy_from_onnx, to_numpy
from dsp_core.ops import lowbit
from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, broadcast_dims, op, same_as_first

Array = Any
Dims = tuple[int | str | None, ...]


# ---------------------------------------------------------------------------
# Helpers shared by the kernels


# Compared by dtype identity: ``dtype.name`` is a slow Python property on the hot path.
_HALF_DTYPES = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def _up(x: Array) -> Array:
    """``x`` in a dtype fit for accumulation: float32 for half types, else unchanged."""
    return x.astype(np.float32) if x.dtype in _HALF_DTYPES else x


def _work_dtype(*dtypes: Any) -> np.dtype[Any]:
    """The widest of float32 and ``dtypes``: float64 only when one of them is."""
    return np.dtype(np.float64) if any(np.dtype(d) == np.float64 for d in dtypes) else np.dtype(np.float32)


def _axis(axis: int, ndim: int) -> int:
    """A non-negative axis; raises ShapeError when out of range."""
    if not -ndim <= axis < max(ndim, 1):
        raise ShapeError(f"axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % max(ndim, 1)


def _channel(v: Array, ndim: int) -> Array:
    """A per-channel vector (C,) reshaped to broadcast over axis 1 of an (N, C, ...) tensor."""
    return v.reshape((-1,) + (1,) * (ndim - 2))


def _split_heads(x: Array, num_heads: int) -> Array:
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hidden = x.shape
    if not num_heads or hidden % num_heads:
        raise ShapeError(f"hidden size {hidden} is not a multiple of num_heads={num_heads}")
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _merge_heads(x: Array) -> Array:
    """(B, H, S, D) -> (B, S, H*D)."""
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


# ---------------------------------------------------------------------------
# Matrix products


def _matmul_dims(a: Dims, b: Dims) -> Dims:
    """The shape of numpy's matmul of shapes ``a`` and ``b`` (1-D operands promoted)."""
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(a) == 1:
        return b[:-2] + b[-1:]
    if len(b) == 1:
        return a[:-1]
    return broadcast_dims(a[:-2], b[:-2]) + (a[-2], b[-1])


def _matmul_rule(attrs: dict[str, Any], a: TensorInfo, b: TensorInfo) -> list[TensorInfo]:
    """Shape rule of MatMul: numpy matmul shapes, dtype of A."""
    shape = None if a.shape is None or b.shape is None else _matmul_dims(a.shape, b.shape)
    return [TensorInfo(a.dtype, shape)]


@op("MatMul", traits=Trait.FUSABLE, shape=_matmul_rule)
def matmul(ctx: KernelContext, a: Array, b: Array) -> Array:
    """Numpy-style matrix product with broadcast batch dimensions."""
    return ctx.xp.matmul(_up(a), _up(b)).astype(a.dtype, copy=False)


def _gemm_rule(attrs: dict[str, Any], a: TensorInfo, b: TensorInfo, *c: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Gemm: (M, N) from the (transposed) operands."""
    if a.shape is None or b.shape is None:
        return [TensorInfo(a.dtype, None)]
    m = a.shape[1] if attrs.get("transA", 0) else a.shape[0]
    n = b.shape[0] if attrs.get("transB", 0) else b.shape[1]
    return [TensorInfo(a.dtype, (m, n))]


@op("Gemm", traits=Trait.FUSABLE, inputs=(2, 3), shape=_gemm_rule)
def gemm(
    ctx: KernelContext,
    a: Array,
    b: Array,
    c: Array | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
    broadcast: int = 0,  # opsets < 7 only; numpy broadcasting covers it
) -> Array:
    """Y = alpha * op(A) @ op(B) + beta * C, op being an optional transpose."""
    a2 = a.T if transA else a
    b2 = b.T if transB else b
    y = ctx.xp.matmul(_up(a2), _up(b2))
    if alpha != 1.0:
        y = y * alpha
    if c is not None and beta != 0.0:
        y = y + (_up(c) * beta if beta != 1.0 else _up(c))
    return y.astype(a.dtype, copy=False)


def _merged_rule(attrs: dict[str, Any], a: TensorInfo, *parts: TensorInfo) -> list[TensorInfo]:
    """Shape rule of dsp::MergedMatMul: one output per weight, as its original product."""
    if attrs.get("form", "MatMul") == "Gemm":
        k = len(parts) // 2 if attrs.get("bias", 0) else len(parts)
        return [_gemm_rule(attrs, a, b)[0] for b in parts[:k]]
    return [_matmul_rule(attrs, a, b)[0] for b in parts]


@op("MergedMatMul", domain="dsp", traits=Trait.FUSABLE, inputs=(2, -1), outputs=(1, -1), shape=_merged_rule)
def merged_matmul(
    ctx: KernelContext,
    a: Array,
    *weights: Array,
    form: str = "MatMul",
    bias: int = 0,
    alpha: float = 1.0,
    beta: float = 1.0,
    transB: int = 0,
    merged: Any = (),
) -> tuple[Array, ...]:
    """Sibling products of one input as one product over weights concatenated along N, cut back into parts.

    Made by the sibling-merge rewrite (dsp_core/plan/merge.py, docs/merge.md): inputs are
    ``a`` then the k weights ``B_1..B_k`` of the products it replaced, then (``form="Gemm"``,
    ``bias=1``) their k biases; output i is ``a @ B_i`` (Gemm: ``alpha * a @ op(B_i) +
    beta * C_i``), which is column block i of ``a @ concat(B_1..B_k)``. ``merged`` names
    the nodes it replaced (for reports). The weights stay separate constants: a backend
    that runs one product concatenates them once when it compiles the segment, as it
    transposes weights. This reference runs each part exactly as the product it replaced
    (the same kernel on the same arrays), so the rewritten plan is bit-equal to the
    original; one numpy product over the concatenation is not (BLAS blocks the columns
    by N, docs/merge.md measures it).
    """
    k = ctx.n_outputs
    if len(weights) != (2 * k if bias else k):
        raise ValueError(f"{len(weights)} weight and bias inputs for {k} outputs (bias={bias})")
    if form == "MatMul":
        return tuple(matmul(ctx, a, b) for b in weights)
    if form != "Gemm":
        raise ValueError(f"form {form!r}: expected 'MatMul' or 'Gemm'")
    biases = weights[k:] if bias else (None,) * k
    return tuple(gemm(ctx, a, b, c, alpha=alpha, beta=beta, transB=transB) for b, c in zip(weights[:k], biases))


_EQUATION = re.compile(r"[A-Za-z ,]*(?:\.\.\.[A-Za-z ,]*)*(?:->[A-Za-z ]*(?:\.\.\.[A-Za-z ]*)?)?")


def _check_equation(attrs: Mapping[str, Any]) -> str | None:
    equation = attrs.get("equation")
    if not isinstance(equation, str) or not _EQUATION.fullmatch(equation):
        return f"equation {equation!r} is not an Einstein summation (letters, ',', '...', one '->')"
    return None


def einsum_by_matmul(xp: Any, equation: str, *operands: Array) -> Array:
    """``xp.einsum(equation, *operands)`` as sums, transposes and ``xp.matmul`` (batched products),
    the operands taken pairwise left to right: a device backend whose ``matmul`` is capturable
    (DSP's own cuBLAS binding) runs every Einsum that way. Equations with an ellipsis, a label
    repeated within one operand (a diagonal) or labels whose sizes differ go to ``xp.einsum``."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if "." in eq or len(terms) != len(operands) or any(len(set(t)) != len(t) for t in terms):
        return xp.einsum(eq, *operands)
    if not arrow:
        rhs = "".join(sorted(c for c in set(lhs) if c != "," and lhs.count(c) == 1))
    sizes: dict[str, int] = {}
    for t, x in zip(terms, operands):
        if len(t) != x.ndim:
            return xp.einsum(eq, *operands)
        for c, n in zip(t, x.shape):
            if sizes.setdefault(c, int(n)) != int(n):
                return xp.einsum(eq, *operands)
    items = list(zip(terms, operands))

    def reduce_alone(t: str, x: Array, keep: set[str]) -> tuple[str, Array]:
        gone = tuple(i for i, c in enumerate(t) if c not in keep)
        if gone:
            x = x.sum(axis=gone)
            t = "".join(c for c in t if c in keep)
        return t, x

    while len(items) > 1:
        (ta, a), (tb, b) = items[0], items[1]
        later = set(rhs).union(*(set(t) for t, _ in items[2:]))
        ta, a = reduce_alone(ta, a, later | set(tb))
        tb, b = reduce_alone(tb, b, later | set(ta))
        batch = [c for c in ta if c in tb and c in later]
        contract = [c for c in ta if c in tb and c not in later]
        left = [c for c in ta if c not in tb]
        right = [c for c in tb if c not in ta]
        nb = math.prod(sizes[c] for c in batch)
        nl, nk, nr = (math.prod(sizes[c] for c in g) for g in (left, contract, right))
        a3 = a.transpose([ta.index(c) for c in batch + left + contract]).reshape(nb, nl, nk)
        b3 = b.transpose([tb.index(c) for c in batch + contract + right]).reshape(nb, nk, nr)
        out = xp.matmul(a3, b3).reshape([sizes[c] for c in batch + left + right])
        items = [("".join(batch + left + right), out), *items[2:]]
    t, x = reduce_alone(*items[0], set(rhs))
    return x.transpose([t.index(c) for c in rhs]) if t != rhs else x


@op("Einsum", traits=Trait.NONE, since=12, check=_check_equation)
def einsum(ctx: KernelContext, *inputs: Array, equation: str) -> Array:
    """Einstein summation over the inputs, as numpy.einsum."""
    xp = ctx.xp
    run = getattr(xp, "einsum_by_matmul", None) or xp.einsum  # a device backend's capturable form
    result = run(equation.replace(" ", ""), *[_up(x) for x in inputs])
    return xp.asarray(result).astype(inputs[0].dtype, copy=False)


def _det_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Det: the batch dimensions."""
    return [TensorInfo(x.dtype, None if x.shape is None else x.shape[:-2])]


MAX_ELIMINATION_ORDER = 64  # larger matrices take the library's det (n steps of a few kernels each)


def det_by_elimination(xp: Any, a: Array) -> Array:
    """Determinants of ``a`` [..., n, n] by Gaussian elimination with partial pivoting, in array ops
    only: no factorisation library and no host read (a pivot is found with argmax on the device
    and rows are swapped by masks), so a capturing device backend runs it inside its graph.
    ``n`` steps of a few kernels each: for the small matrices models take determinants of."""
    n = a.shape[-1]
    batch = a.shape[:-2]
    if n == 0:
        return xp.ones(batch, dtype=a.dtype)
    m = a.astype(a.dtype, copy=True)
    det = xp.ones(batch, dtype=a.dtype)
    rows = xp.arange(n).reshape(n, 1)
    for k in range(n):
        p = xp.argmax(xp.abs(m[..., k:, k]), axis=-1) + k  # [...]: the pivot row
        pick = xp.expand_dims(p, -1)  # [..., 1]
        row_k = m[..., k, :]
        row_p = xp.take_along_axis(m, xp.expand_dims(pick, -1) * xp.ones((1, n), dtype=p.dtype), axis=-2)[..., 0, :]
        is_p = rows == xp.expand_dims(pick, -1)  # [..., n, 1]
        m = xp.where(rows == k, xp.expand_dims(row_p, -2), xp.where(is_p, xp.expand_dims(row_k, -2), m))
        pivot = m[..., k, k]
        det = det * xp.where(p == k, pivot, -pivot)
        if k + 1 < n:
            safe = xp.where(pivot == 0, 1, pivot)
            factor = m[..., k + 1 :, k] / xp.expand_dims(safe, -1)  # a zero pivot: the column is zero below it
            m[..., k + 1 :, :] = m[..., k + 1 :, :] - xp.expand_dims(factor, -1) * xp.expand_dims(m[..., k, :], -2)
    return det


@op("Det", traits=Trait.NONE, since=11, shape=_det_rule)
def det(ctx: KernelContext, x: Array) -> Array:
    """Determinant of each square matrix in the last two dimensions."""
    xp = ctx.xp
    run = getattr(xp, "det_by_elimination", None) or xp.linalg.det  # a device backend's capturable form
    return xp.asarray(run(_up(x))).astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------
# Integer and quantized products, quantization


def _centered(x: Array, zero_point: Array | None, per_row: bool = False) -> Array:
    """``x - zero_point`` in int32; a per-row (1-D) zero point of A applies to its rows."""
    x32 = x.astype(np.int32)
    if zero_point is None:
        return x32
    zp = zero_point.astype(np.int32)
    if per_row and zp.ndim == 1:
        zp = zp.reshape(-1, 1)
    return x32 - zp


def _int_matmul(xp: Any, a: Array, a_zp: Array | None, b: Array, b_zp: Array | None) -> Array:
    """(A - a_zp) @ (B - b_zp), accumulated in int32."""
    return xp.matmul(_centered(a, a_zp, per_row=True), _centered(b, b_zp))


def _int_matmul_rule(attrs: dict[str, Any], a: TensorInfo, b: TensorInfo, *zps: TensorInfo) -> list[TensorInfo]:
    """Shape rule of MatMulInteger: matmul shapes, int32."""
    return [TensorInfo("int32", _matmul_rule(attrs, a, b)[0].shape)]


@op("MatMulInteger", traits=Trait.NONE, since=10, shape=_int_matmul_rule)
def matmul_integer(
    ctx: KernelContext, a: Array, b: Array, a_zero_point: Array | None = None, b_zero_point: Array | None = None
) -> Array:
    """Integer matmul of zero-point-shifted 8-bit operands, int32 result."""
    return _int_matmul(ctx.xp, a, a_zero_point, b, b_zero_point)


def _saturate(xp: Any, q: Array, dtype: np.dtype[Any]) -> Array:
    """Round-half-to-even values (float64) clipped to the range of integer ``dtype``."""
    info = ml_dtypes.iinfo(dtype)  # numpy's iinfo does not know int4, int2, ...
    return lowbit.convert(xp, xp.clip(q, info.min, info.max), dtype)


def _qlinear_matmul_rule(attrs: dict[str, Any], a: TensorInfo, *rest: TensorInfo) -> list[TensorInfo]:
    """Shape rule of QLinearMatMul: matmul shapes, dtype of y_zero_point."""
    return [TensorInfo(rest[-1].dtype, _matmul_rule(attrs, a, rest[2])[0].shape)]


@op("QLinearMatMul", traits=Trait.NONE, since=10, shape=_qlinear_matmul_rule)
def qlinear_matmul(
    ctx: KernelContext,
    a: Array,
    a_scale: Array,
    a_zero_point: Array,
    b: Array,
    b_scale: Array,
    b_zero_point: Array,
    y_scale: Array,
    y_zero_point: Array,
) -> Array:
    """Quantized matmul: requantize (A - a_zp) @ (B - b_zp) to y_scale, y_zero_point."""
    xp = ctx.xp
    acc = _int_matmul(xp, a, a_zero_point, b, b_zero_point).astype(np.float64)
    # The multiplier is rounded in the scales' own dtype, as the reference does.
    multiplier = (a_scale * b_scale / y_scale).astype(np.float64)
    q = xp.rint(acc * multiplier) + y_zero_point.astype(np.float64)
    return _saturate(xp, q, y_zero_point.dtype)


def _per_axis(xp: Any, p: Array, shape: tuple[int, ...], axis: int, block_size: int) -> Array:
    """A scale or zero point shaped to broadcast against x: per tensor, per axis or blocked."""
    if p.size == 1:  # per tensor, whatever the axis (a 1-D x has no axis 1)
        return p.reshape(())
    axis = _axis(axis, len(shape))
    if block_size > 0:
        p = xp.repeat(p, block_size, axis=axis)
        index = [slice(None)] * p.ndim
        index[axis] = slice(0, shape[axis])
        return p[tuple(index)]
    new_shape = [1] * len(shape)
    new_shape[axis] = -1
    return p.reshape(new_shape)


# The dtypes QuantizeLinear produces and DequantizeLinear reads (the latter int32 too).
_INT_QUANT_NAMES = ("int8", "uint8", "int16", "uint16", "int4", "uint4", "int2", "uint2")
_FLOAT_QUANT_NAMES = (*sorted(FLOAT8_DTYPES), "float4_e2m1fn")
_QUANT_NAMES = _INT_QUANT_NAMES + _FLOAT_QUANT_NAMES
_FLOAT_QUANT_DTYPES = frozenset(to_numpy(name) for name in _FLOAT_QUANT_NAMES)
_QUANT_DTYPES = _FLOAT_QUANT_DTYPES | {to_numpy(name) for name in _INT_QUANT_NAMES}


def _quant_dtype(zero_point: Array | None, output_dtype: int) -> np.dtype[Any]:
    """The output dtype of QuantizeLinear: y_zero_point's, else output_dtype, else uint8."""
    if zero_point is not None:
        dtype = np.dtype(zero_point.dtype)
    elif output_dtype:
        dtype = numpy_from_onnx(output_dtype)
    else:
        dtype = np.dtype(np.uint8)
    if dtype not in _QUANT_DTYPES:
        raise DTypeError(f"QuantizeLinear to {dtype} is not supported; DSP quantizes to {', '.join(_QUANT_NAMES)}")
    return dtype


def _quantize_rule(attrs: dict[str, Any], x: TensorInfo, scale: TensorInfo, *zp: TensorInfo) -> list[TensorInfo]:
    """Shape rule of QuantizeLinear: shape of x, the quantized dtype."""
    if zp and zp[0] is not None:
        dtype = zp[0].dtype
    elif attrs.get("output_dtype"):
        dtype = numpy_from_onnx(attrs["output_dtype"]).name
    else:
        dtype = "uint8"
    return [TensorInfo(dtype, x.shape)]


@op("QuantizeLinear", traits=Trait.NONE, since=10, shape=_quantize_rule)
def quantize_linear(
    ctx: KernelContext,
    x: Array,
    y_scale: Array,
    y_zero_point: Array | None = None,
    *,
    axis: int = 1,
    saturate: int = 1,  # applies to float8 outputs only, which DSP does not produce
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
) -> Array:
    """y = saturate(round_half_even(x / y_scale) + y_zero_point), per tensor, axis or block.

    Float targets (float8, float4) round by the cast itself; ``saturate`` says whether
    float8 overflow clamps or becomes inf/NaN. Integer targets clamp to their range.
    """
    xp = ctx.xp
    out = _quant_dtype(y_zero_point, output_dtype)
    scale = _per_axis(xp, y_scale, x.shape, axis, block_size)
    work = numpy_from_onnx(precision) if precision else np.dtype(scale.dtype)
    q = x.astype(work) / scale.astype(work)
    if out in _FLOAT_QUANT_DTYPES:
        if y_zero_point is not None:
            q = q + _per_axis(xp, lowbit.convert(xp, y_zero_point, work), x.shape, axis, block_size)
        return lowbit.convert(xp, q, out, saturate=bool(saturate))
    q = xp.rint(q).astype(np.float64)
    if y_zero_point is not None:
        q = q + _per_axis(xp, lowbit.convert(xp, y_zero_point, np.float64), x.shape, axis, block_size)
    return _saturate(xp, q, out)


def _dequantize_rule(attrs: dict[str, Any], x: TensorInfo, scale: TensorInfo, *zp: TensorInfo) -> list[TensorInfo]:
    """Shape rule of DequantizeLinear: shape of x, dtype of the scale or output_dtype."""
    dtype = numpy_from_onnx(attrs["output_dtype"]).name if attrs.get("output_dtype") else scale.dtype
    return [TensorInfo(dtype, x.shape)]


@op("DequantizeLinear", traits=Trait.NONE, since=10, shape=_dequantize_rule)
def dequantize_linear(
    ctx: KernelContext,
    x: Array,
    x_scale: Array,
    x_zero_point: Array | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> Array:
    """y = (x - x_zero_point) * x_scale, per tensor, axis or block."""
    xp = ctx.xp
    if x.dtype.kind not in "iu" and x.dtype not in _QUANT_DTYPES:
        raise DTypeError(
            f"DequantizeLinear of {x.dtype} is not supported; DSP dequantizes integers and {', '.join(_QUANT_NAMES)}"
        )
    out = numpy_from_onnx(output_dtype) if output_dtype else np.dtype(x_scale.dtype)
    work = _work_dtype(x_scale.dtype)
    # Integers subtract exactly in int64; float8 and float4 values are exact in float32.
    wide = work if x.dtype in _FLOAT_QUANT_DTYPES else np.dtype(np.int64)
    dx = lowbit.convert(xp, x, wide)
    if x_zero_point is not None:
        dx = dx - _per_axis(xp, lowbit.convert(xp, x_zero_point, wide), x.shape, axis, block_size)
    scale = _per_axis(xp, x_scale, x.shape, axis, block_size)
    return (dx.astype(work) * scale.astype(work)).astype(out)


def _dynamic_quantize_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    """Shape rule of DynamicQuantizeLinear: y (uint8, shape of x), scalar scale and zero point."""
    return [TensorInfo("uint8", x.shape), TensorInfo("float32", ()), TensorInfo("uint8", ())]


@op("DynamicQuantizeLinear", traits=Trait.NONE, outputs=3, since=11, shape=_dynamic_quantize_rule)
def dynamic_quantize_linear(ctx: KernelContext, x: Array) -> tuple[Array, Array, Array]:
    """Quantize float32 x to uint8 over its range widened to hold 0; returns y, scale, zero point."""
    xp = ctx.xp
    x = x.astype(np.float32, copy=False)
    hi = xp.maximum(xp.max(x), np.float32(0))
    lo = xp.minimum(xp.min(x), np.float32(0))
    scale = (xp.where(hi == lo, np.float32(1), hi - lo) / np.float32(255)).astype(np.float32)
    zero_point = xp.rint(xp.clip(-lo / scale, 0, 255))
    y = _saturate(xp, xp.rint(x / scale).astype(np.float64) + zero_point, np.dtype(np.uint8))
    return y, scale, zero_point.astype(np.uint8)


# ---------------------------------------------------------------------------
# Softmax family. Before opset 13 the input is coerced to 2-D at ``axis`` and the op
# runs over the second dimension; from 13 it runs along ``axis`` alone.


def _softmax(xp: Any, x: Array, axis: int) -> Array:
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def _log_softmax(xp: Any, x: Array, axis: int) -> Array:
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


def _hardmax(xp: Any, x: Array, axis: int) -> Array:
    first_max = xp.expand_dims(xp.argmax(x, axis=axis), axis)
    index_shape = [1] * x.ndim
    index_shape[axis] = x.shape[axis]
    return xp.arange(x.shape[axis]).reshape(index_shape) == first_max


def _along_axis(ctx: KernelContext, x: Array, axis: int | None, fn: Any) -> Array:
    """Apply ``fn(xp, x, axis)`` with the axis semantics of the node's opset."""
    xp = ctx.xp
    if ctx.opset < 13:
        a = _axis(1 if axis is None else axis, x.ndim)
        rows = math.prod(x.shape[:a])
        y = fn(xp, _up(x).reshape(rows, -1), 1).reshape(x.shape)
    else:
        y = fn(xp, _up(x), _axis(-1 if axis is None else axis, x.ndim))
    return y.astype(x.dtype, copy=False)


@op("Softmax", traits=Trait.NONE, shape=same_as_first)
def softmax(ctx: KernelContext, x: Array, *, axis: int | None = None) -> Array:
    """exp(x) / sum(exp(x)) along axis (default 1 before opset 13, -1 from 13)."""
    return _along_axis(ctx, x, axis, _softmax)


@op("LogSoftmax", traits=Trait.NONE, shape=same_as_first)
def log_softmax(ctx: KernelContext, x: Array, *, axis: int | None = None) -> Array:
    """log(softmax(x)) along axis (default 1 before opset 13, -1 from 13)."""
    return _along_axis(ctx, x, axis, _log_softmax)


@op("Hardmax", traits=Trait.NONE, shape=same_as_first)
def hardmax(ctx: KernelContext, x: Array, *, axis: int | None = None) -> Array:
    """One-hot of the first maximum along axis (default 1 before opset 13, -1 from 13)."""
    return _along_axis(ctx, x, axis, _hardmax)


# ---------------------------------------------------------------------------
# Normalizations


def _moments(xp: Any, x: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """Mean and (population) variance over ``axes``, kept as size-1 dims."""
    mean = xp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    return mean, xp.mean(centered * centered, axis=axes, keepdims=True)


def _stash_dtype(stash_type: int, dtype: Any) -> np.dtype[Any]:
    """The stage-one precision: stash_type's dtype, never narrower than the input's."""
    stash = numpy_from_onnx(stash_type)
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else stash


def _layer_norm_rule(attrs: dict[str, Any], x: TensorInfo, *rest: TensorInfo) -> list[TensorInfo]:
    """Shape rule of LayerNormalization: Y like X; Mean and InvStdDev reduced from axis on."""
    stash = numpy_from_onnx(attrs.get("stash_type", 1)).name
    if x.shape is None:
        return [x, TensorInfo(stash, None), TensorInfo(stash, None)]
    a = _axis(attrs.get("axis", -1), len(x.shape))
    reduced = TensorInfo(stash, x.shape[:a] + (1,) * (len(x.shape) - a))
    return [x, reduced, reduced]


@op("LayerNormalization", traits=Trait.NONE, outputs=(1, 3), since=17, shape=_layer_norm_rule)
def layer_normalization(
    ctx: KernelContext,
    x: Array,
    scale: Array,
    b: Array | None = None,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
) -> tuple[Array, Array, Array]:
    """(x - mean) / sqrt(var + epsilon) * scale + B over the dims from axis on."""
    xp = ctx.xp
    stash = _stash_dtype(stash_type, x.dtype)
    xw = x.astype(stash)
    mean, var = _moments(xp, xw, tuple(range(_axis(axis, x.ndim), x.ndim)))
    inv_std = 1.0 / xp.sqrt(var + epsilon)
    y = (xw - mean) * inv_std * scale.astype(stash)
    if b is not None:
        y = y + b.astype(stash)
    if ctx.n_outputs == 1:  # Mean and InvStdDev are not named: do not materialise them
        return y.astype(x.dtype), None, None
    return y.astype(x.dtype), mean.astype(stash), inv_std.astype(stash)


def _rms_norm_rule(attrs: dict[str, Any], x: TensorInfo, scale: TensorInfo) -> list[TensorInfo]:
    """Shape rule of RMSNormalization: shape of X, dtype of scale."""
    return [TensorInfo(scale.dtype, x.shape)]


@op("RMSNormalization", traits=Trait.NONE, since=23, shape=_rms_norm_rule)
def rms_normalization(
    ctx: KernelContext, x: Array, scale: Array, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> Array:
    """x / sqrt(mean(x^2) + epsilon) * scale over the dims from axis on."""
    xp = ctx.xp
    stash = _stash_dtype(stash_type, x.dtype)
    xw = x.astype(stash)
    mean_square = xp.mean(xw * xw, axis=tuple(range(_axis(axis, x.ndim), x.ndim)), keepdims=True)
    return (xw / xp.sqrt(mean_square + epsilon) * scale.astype(stash)).astype(scale.dtype)


def _group_norm(xp: Any, x: Array, groups: int, scale: Array, bias: Array, epsilon: float, stash: Any) -> Array:
    """Normalize each of ``groups`` channel groups of (N, C, ...) x, then per-channel affine."""
    n, c = x.shape[:2]
    grouped = x.astype(stash).reshape(n, groups, -1)
    mean, var = _moments(xp, grouped, (2,))
    normed = ((grouped - mean) / xp.sqrt(var + epsilon)).reshape(x.shape)
    y = normed * _channel(scale.astype(stash), x.ndim) + _channel(bias.astype(stash), x.ndim)
    return y.astype(x.dtype)


@op("GroupNormalization", traits=Trait.NONE, since=18, shape=same_as_first)
def group_normalization(
    ctx: KernelContext,
    x: Array,
    scale: Array,
    bias: Array,
    *,
    num_groups: int,
    epsilon: float = 1e-5,
    stash_type: int = 1,
) -> Array:
    """Normalize channel groups of (N, C, ...) x; scale and bias per channel (per group before 21)."""
    channels = x.shape[1]
    if ctx.opset < 21 and scale.shape[0] == num_groups != channels:
        scale = ctx.xp.repeat(scale, channels // num_groups)
        bias = ctx.xp.repeat(bias, channels // num_groups)
    return _group_norm(ctx.xp, x, num_groups, scale, bias, epsilon, _stash_dtype(stash_type, x.dtype))


@op("InstanceNormalization", traits=Trait.NONE, since=6, shape=same_as_first)
def instance_normalization(ctx: KernelContext, x: Array, scale: Array, b: Array, *, epsilon: float = 1e-5) -> Array:
    """Normalize each (n, c) slice of (N, C, ...) x over its spatial dims, then scale and B."""
    return _group_norm(ctx.xp, x, x.shape[1], scale, b, epsilon, _work_dtype(x.dtype))


def _batch_norm_rule(attrs: dict[str, Any], x: TensorInfo, scale: TensorInfo, *rest: TensorInfo) -> list[TensorInfo]:
    """Shape rule of BatchNormalization: Y like X; running statistics like input_mean."""
    return [x, rest[1], rest[2]]


@op("BatchNormalization", traits=Trait.NONE, outputs=(1, 3), since=6, shape=_batch_norm_rule)
def batch_normalization(
    ctx: KernelContext,
    x: Array,
    scale: Array,
    b: Array,
    input_mean: Array,
    input_var: Array,
    *,
    epsilon: float = 1e-5,
    momentum: float = 0.9,
    training_mode: int = 0,
    is_test: int = 0,  # opsets 6-7; inference is what DSP runs
    spatial: int = 1,  # opsets 6-8
) -> tuple[Array, Array, Array]:
    """Normalize per channel with the given statistics, or (training_mode) the batch's own."""
    xp = ctx.xp
    work = _work_dtype(x.dtype)
    xw = x.astype(work)

    def per_channel(v: Array) -> Array:
        # spatial=0 (before opset 9): statistics per activation, shaped (C, D1, ...)
        return _channel(v.astype(work), x.ndim) if spatial else v.astype(work)[None]

    mean, var = per_channel(input_mean), per_channel(input_var)
    running_mean, running_var = input_mean, input_var
    if training_mode:
        mean, var = _moments(xp, xw, (0,) + tuple(range(2, x.ndim)))
        running_mean = (input_mean * momentum + mean.reshape(-1) * (1 - momentum)).astype(input_mean.dtype)
        running_var = (input_var * momentum + var.reshape(-1) * (1 - momentum)).astype(input_var.dtype)
    y = (xw - mean) / xp.sqrt(var + epsilon) * per_channel(scale) + per_channel(b)
    return y.astype(x.dtype), running_mean, running_var


@op("LpNormalization", traits=Trait.NONE, shape=same_as_first)
def lp_normalization(ctx: KernelContext, x: Array, *, axis: int = -1, p: int = 2) -> Array:
    """x divided by its L1 or L2 norm along axis (a zero norm gives zeros)."""
    xp = ctx.xp
    xw = _up(x)
    a = _axis(axis, x.ndim)
    if p == 1:
        norm = xp.sum(xp.abs(xw), axis=a, keepdims=True)
    elif p == 2:
        norm = xp.sqrt(xp.sum(xw * xw, axis=a, keepdims=True))
    else:
        raise ValueError(f"LpNormalization supports p=1 or p=2, got p={p}")
    return (xw / xp.where(norm == 0, 1, norm)).astype(x.dtype)


@op("MeanVarianceNormalization", traits=Trait.NONE, since=9, shape=same_as_first)
def mean_variance_normalization(ctx: KernelContext, x: Array, *, axes: list[int] | None = None) -> Array:
    """(x - mean) / (std + 1e-9) over axes (default [0, 2, 3])."""
    xp = ctx.xp
    xw = _up(x)
    dims = tuple(_axis(a, x.ndim) for a in (axes if axes is not None else [0, 2, 3]))
    mean = xp.mean(xw, axis=dims, keepdims=True)
    variance = xp.mean(xw * xw, axis=dims, keepdims=True) - mean * mean
    return ((xw - mean) / (xp.sqrt(variance) + 1e-9)).astype(x.dtype)


# ---------------------------------------------------------------------------
# Attention (opset 23, 24, 25)


def _mask_bias(xp: Any, mask: Array, total: int, dtype: Any) -> Array:
    """attn_mask as an additive bias; a short last dim is padded with masked positions."""
    missing = total - mask.shape[-1]
    if missing > 0:
        fill = False if mask.dtype == np.bool_ else -np.inf
        pad = xp.full(mask.shape[:-1] + (missing,), fill, dtype=mask.dtype)
        mask = xp.concatenate([mask, pad], axis=-1)
    if mask.dtype == np.bool_:
        return xp.where(mask, dtype.type(0), dtype.type(-np.inf))
    return mask.astype(dtype)


def _position_bias(
    xp: Any, offset: Any, q_len: int, total: int, is_causal: int, left: int, right: int, dtype: Any
) -> Array:
    """Causal and sliding-window limits as a 0 / -inf bias, (Sq, T) or (B, 1, Sq, T).

    Query i sits at absolute position p = offset + i; it may attend key j when
    j <= p (causal), p - left <= j (left >= 0) and j <= p + right (right >= 0).
    """
    pos = xp.arange(q_len).reshape(q_len, 1) + offset
    key = xp.arange(total)
    allowed = xp.ones(pos.shape[:-1] + (total,), dtype=bool)
    if is_causal:
        allowed = allowed & (key <= pos)
    if left >= 0:
        allowed = allowed & (key >= pos - left)
    if right >= 0:
        allowed = allowed & (key <= pos + right)
    return xp.where(allowed, dtype.type(0), dtype.type(-np.inf))


def _attention_bias(
    xp: Any,
    attn_mask: Array | None,
    nonpad_kv_seqlen: Array | None,
    past_len: int,
    shape: tuple[int, int],
    limits: tuple[int, int, int],
    dtype: Any,
) -> Array | None:
    """The total additive bias, broadcastable to (B, Hq, Sq, T); None when nothing masks.

    ``shape`` is (Sq, T); ``limits`` is (is_causal, left_window, right_window).
    """
    q_len, total = shape
    terms = []
    if attn_mask is not None:
        terms.append(_mask_bias(xp, attn_mask, total, dtype))
    if nonpad_kv_seqlen is not None:
        lengths = nonpad_kv_seqlen.astype(np.int64).reshape(-1, 1, 1, 1)
        terms.append(xp.where(xp.arange(total) < lengths, dtype.type(0), dtype.type(-np.inf)))
        offset: Any = lengths - q_len  # external cache: the valid keys precede the queries
    else:
        offset = past_len
    is_causal, left, right = limits
    if is_causal or left >= 0 or right >= 0:
        terms.append(_position_bias(xp, offset, q_len, total, is_causal, left, right, dtype))
    if not terms:
        return None
    bias = terms[0]
    for term in terms[1:]:
        bias = bias + term
    return bias


def _masked_softmax(xp: Any, scores: Array, fully_masked: Array | None) -> Array:
    """Softmax over the last axis; rows with no attendable key are all zeros (not NaN)."""
    row_max = xp.max(scores, axis=-1, keepdims=True)
    row_max = xp.where(row_max == -np.inf, 0, row_max)
    e = xp.exp(scores - row_max)
    total = xp.sum(e, axis=-1, keepdims=True)
    probs = e / xp.where(total == 0, 1, total)
    if fully_masked is not None:
        probs = xp.where(fully_masked, 0, probs)
    return probs


def _grouped_matmul(xp: Any, x: Array, y: Array) -> Array:
    """(B, Hq, S, X) @ (B, Hkv, X, Z) with query head h using kv head h // (Hq / Hkv)."""
    b, hq, s, width = x.shape
    hkv = y.shape[1]
    if hq % hkv:
        raise ShapeError(f"Attention: q_num_heads={hq} is not a multiple of kv_num_heads={hkv}")
    # Heads of one group are adjacent, so folding them into the row axis pairs each
    # query row with its kv head without repeating K or V.
    out = xp.matmul(x.reshape(b, hkv, (hq // hkv) * s, width), y)
    return out.reshape(b, hq, s, out.shape[-1])


def _scaled_scores(xp: Any, q: Array, k: Array, scale: float | None, work: Any) -> Array:
    """Q K^T * scale (default 1/sqrt(head_size)) in ``work`` precision, GQA-aware."""
    # Scaling Q and K by sqrt(scale) each keeps Q K^T in range, as the spec says.
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return _grouped_matmul(xp, q.astype(work) * root, (k.astype(work) * root).transpose(0, 1, 3, 2))


def _attention_dtype(dtype: Any, softmax_precision: int | None) -> np.dtype[Any]:
    """The compute dtype: float32, or float64 when the input or softmax_precision asks for it."""
    wide = [dtype] + ([numpy_from_onnx(softmax_precision)] if softmax_precision else [])
    return _work_dtype(*wide)


def _attention_rule(
    attrs: dict[str, Any], q: TensorInfo, k: TensorInfo, v: TensorInfo, *rest: TensorInfo
) -> list[TensorInfo]:
    """Shape rule of Attention: Y, present_key, present_value, qk_matmul_output."""
    if q.shape is None or k.shape is None or v.shape is None:
        return [TensorInfo(t.dtype, None) for t in (q, k, v, q)]
    past = rest[1] if len(rest) > 1 and rest[1] is not None else None
    past_len = past.shape[2] if past is not None and past.shape is not None else 0
    total = k.shape[-2 if len(k.shape) == 4 else 1]
    total = total + past_len if isinstance(total, int) and isinstance(past_len, int) else None
    if len(q.shape) == 4:
        b, hq, sq, _ = q.shape
        hkv, d, dv = k.shape[1], k.shape[3], v.shape[3]
        y_shape: Dims = (b, hq, sq, dv)
    else:
        b, sq, _ = q.shape
        hq, hkv = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
        d = k.shape[2] // hkv if isinstance(k.shape[2], int) and hkv else None
        dv = v.shape[2] // hkv if isinstance(v.shape[2], int) and hkv else None
        y_shape = (b, sq, hq * dv if hq and dv is not None else None)
    return [
        TensorInfo(q.dtype, y_shape),
        TensorInfo(k.dtype, (b, hkv, total, d)),
        TensorInfo(v.dtype, (b, hkv, total, dv)),
        TensorInfo(q.dtype, (b, hq, sq, total)),
    ]


@op("Attention", traits=Trait.ATTENTION, outputs=(1, 4), since=23, shape=_attention_rule)
def attention(
    ctx: KernelContext,
    q: Array,
    k: Array,
    v: Array,
    attn_mask: Array | None = None,
    past_key: Array | None = None,
    past_value: Array | None = None,
    nonpad_kv_seqlen: Array | None = None,
    *,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    left_window_size: int = -1,
    right_window_size: int = -1,
) -> tuple[Array, Array, Array, Array | None]:
    """softmax(Q K^T * scale + mask) V with GQA, KV cache, softcap and sliding windows."""
    xp = ctx.xp
    packed = q.ndim == 3
    if packed:
        q = _split_heads(q, q_num_heads or 0)
        k, v = _split_heads(k, kv_num_heads or 0), _split_heads(v, kv_num_heads or 0)
    past_len = 0
    if past_key is not None and past_value is not None:
        past_len = past_key.shape[2]
        k = xp.concatenate([past_key, k], axis=2)
        v = xp.concatenate([past_value, v], axis=2)
    work = _attention_dtype(q.dtype, softmax_precision)
    raw = _scaled_scores(xp, q, k, scale, work)
    capped = softcap * xp.tanh(raw / softcap) if softcap > 0 else raw
    bias = _attention_bias(
        xp,
        attn_mask,
        nonpad_kv_seqlen,
        past_len,
        (q.shape[2], k.shape[2]),
        (is_causal, left_window_size, right_window_size),
        work,
    )
    scores = capped if bias is None else capped + bias
    fully_masked = None if bias is None else xp.all(bias == -np.inf, axis=-1, keepdims=True)
    probs = _masked_softmax(xp, scores, fully_masked)
    y = _grouped_matmul(xp, probs, v.astype(work)).astype(q.dtype)
    qk_output = None
    if ctx.n_outputs > 3:
        qk_output = (raw, capped, scores, probs)[qk_matmul_output_mode].astype(q.dtype)
    return (_merge_heads(y) if packed else y), k, v, qk_output


# ---------------------------------------------------------------------------
# Rotary embedding (opset 23) and linear attention (opset 27)


@op("RotaryEmbedding", traits=Trait.NONE, since=23, shape=same_as_first)
def rotary_embedding(
    ctx: KernelContext,
    x: Array,
    cos_cache: Array,
    sin_cache: Array,
    position_ids: Array | None = None,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> Array:
    """Rotate the first rotary_embedding_dim features of each head by position angles."""
    xp = ctx.xp
    packed = x.ndim == 3
    heads = _split_heads(x, num_heads) if packed else x  # (B, H, S, D)
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    cos = _up(cos_cache)[:, None]  # (B, 1, S, R/2)
    sin = _up(sin_cache)[:, None]
    dim = rotary_embedding_dim or heads.shape[-1]
    rotated = _up(heads[..., :dim])
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated[..., : dim // 2], rotated[..., dim // 2 :]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = xp.stack([real, imag], axis=-1).reshape(rotated.shape)
    else:
        rotated = xp.concatenate([real, imag], axis=-1)
    y = xp.concatenate([rotated.astype(x.dtype), heads[..., dim:]], axis=-1)
    return _merge_heads(y) if packed else y


def _linear_attention_rule(
    attrs: dict[str, Any], q: TensorInfo, k: TensorInfo, v: TensorInfo, *rest: TensorInfo
) -> list[TensorInfo]:
    """Shape rule of LinearAttention: output (B, T, Hq*dv) and state (B, Hkv, dk, dv)."""
    hq, hkv = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
    if q.shape is None or v.shape is None or k.shape is None or not hq or not hkv:
        return [TensorInfo(q.dtype, None), TensorInfo(q.dtype, None)]
    dk = k.shape[2] // hkv if isinstance(k.shape[2], int) else None
    dv = v.shape[2] // hkv if isinstance(v.shape[2], int) else None
    state_dtype = rest[0].dtype if rest and rest[0] is not None else q.dtype
    return [
        TensorInfo(q.dtype, (q.shape[0], q.shape[1], hq * dv if dv is not None else None)),
        TensorInfo(state_dtype, (q.shape[0], hkv, dk, dv)),
    ]


def _per_head(x: Array, kv_heads: int) -> Array:
    """A decay or beta input (B, T, Hkv*X) or (B, T, Hkv) or (B, T, 1) as (B, Hkv|1, T, X)."""
    b, t, width = x.shape
    heads = kv_heads if width % kv_heads == 0 else 1
    return _up(x).reshape(b, t, heads, width // heads).transpose(0, 2, 1, 3).astype(np.float32)


@op("LinearAttention", traits=Trait.ATTENTION, outputs=2, since=27, shape=_linear_attention_rule)
def linear_attention(
    ctx: KernelContext,
    query: Array,
    key: Array,
    value: Array,
    past_state: Array | None = None,
    decay: Array | None = None,
    beta: Array | None = None,
    *,
    q_num_heads: int,
    kv_num_heads: int,
    chunk_size: int = 64,  # a tuning hint: the sequential recurrence below is exact
    scale: float = 0.0,
    update_rule: str = "gated_delta",
) -> tuple[Array, Array]:
    """Recurrent linear attention (linear, gated, delta, gated_delta); returns output, state."""
    xp = ctx.xp
    q = _split_heads(_up(query), q_num_heads).astype(np.float32)
    k = _split_heads(_up(key), kv_num_heads).astype(np.float32)
    v = _split_heads(_up(value), kv_num_heads).astype(np.float32)
    b, _, steps, dk = q.shape
    if past_state is not None:
        state = _up(past_state).astype(np.float32)
    else:
        state = xp.zeros((b, kv_num_heads, dk, v.shape[-1]), dtype=np.float32)
    gate = xp.exp(_per_head(decay, kv_num_heads)) if update_rule in ("gated", "gated_delta") else None
    rate = _per_head(beta, kv_num_heads) if update_rule in ("delta", "gated_delta") else None
    factor = scale if scale else 1.0 / math.sqrt(dk)
    outputs = []
    for t in range(steps):
        k_t, v_t = k[:, :, t], v[:, :, t]
        if gate is not None:
            state = state * gate[:, :, t, :, None]
        if rate is not None:
            # Delta rule: write only what the state does not already predict for k_t.
            predicted = xp.matmul(k_t[:, :, None, :], state)[:, :, 0]
            v_t = rate[:, :, t] * (v_t - predicted)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        outputs.append(_grouped_matmul(xp, q[:, :, t, None] * factor, state))
    y = xp.concatenate(outputs, axis=2)  # (B, Hq, T, dv)
    state_dtype = past_state.dtype if past_state is not None else query.dtype
    return _merge_heads(y).astype(query.dtype), state.astype(state_dtype)


# ---------------------------------------------------------------------------
# FlexAttention (ai.onnx.preview): attention with user subgraphs on scores and probs


def _apply_mod(ctx: KernelContext, name: str, x: Array) -> Array:
    """Run the modifier subgraph attribute ``name`` on ``x``; ``x`` itself when it is absent."""
    runner = ctx.subgraphs.get(name)
    if runner is None:
        return x
    (formal,) = [v.name for v in runner.graph.inputs]
    return ctx.xp.asarray(runner({formal: x})[0]).astype(x.dtype, copy=False)


@op("FlexAttention", domain="ai.onnx.preview", traits=Trait.ATTENTION | Trait.CONTROL_FLOW, shape=same_as_first)
def flex_attention(
    ctx: KernelContext,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    softmax_precision: int | None = None,
    score_mod: Any = None,
    prob_mod: Any = None,
) -> Array:
    """softmax(score_mod(Q K^T * scale)), then prob_mod, times V; GQA over rank-4 inputs."""
    xp = ctx.xp
    work = numpy_from_onnx(softmax_precision) if softmax_precision else _work_dtype(q.dtype)
    scores = _scaled_scores(xp, q, k, scale, work)
    probs = _masked_softmax(xp, _apply_mod(ctx, "score_mod", scores), None)
    probs = _apply_mod(ctx, "prob_mod", probs)
    return _grouped_matmul(xp, probs, v.astype(work)).astype(v.dtype)
