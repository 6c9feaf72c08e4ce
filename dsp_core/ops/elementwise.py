"""Elementwise ops: math, logic, comparisons, activations and casts.

Every kernel keeps ONNX's output dtype exactly. Half-precision floats (float16,
bfloat16) are computed in float32 and rounded back once: cupy has no bfloat16 and
numpy's float16 loops round through float32 anyway. Python-float attributes are
"weak" under numpy's promotion rules, so ``x * alpha`` keeps the dtype of ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce
from typing import Any

import ml_dtypes
import numpy as np

from dsp_core.ir import dtypes
from dsp_core.ops import lowbit, special
from dsp_core.ops.registry import (
    KernelContext,
    TensorInfo,
    Trait,
    broadcast_bool_rule,
    broadcast_rule,
    op,
    same_as_first,
)

Array = Any

# A pure elementwise computation: a fusing backend may take it, and it writes every element.
_EW = Trait.ELEMENTWISE | Trait.FUSABLE | Trait.FULLY_WRITING

# Compared by dtype identity: ``dtype.name`` is a slow Python property on the hot path.
_HALF_FLOATS = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


# ---------------------------------------------------------------------------
# Helpers


def _widen(xp: Any, *arrays: Array) -> list[Array]:
    """The arrays with half-precision floats cast to float32 (others unchanged)."""
    return [a.astype(xp.float32) if a.dtype in _HALF_FLOATS else a for a in arrays]


def _narrow(y: Array, like: Array) -> Array:
    """``y`` cast to the dtype of ``like`` (a no-op when it already has it)."""
    return y if y.dtype == like.dtype else y.astype(like.dtype)


def _float_op(xp: Any, fn: Callable[..., Array], x: Array, *rest: Array) -> Array:
    """``fn`` applied to widened inputs, the result back in the dtype of ``x``."""
    return _narrow(fn(*_widen(xp, x, *rest)), x)


def _bool_like_first(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of a unary predicate: shape of the input, bool output."""
    return [TensorInfo("bool", inputs[0].shape)]


def _sigmoid(xp: Any, x: Array) -> Array:
    """Logistic function 1 / (1 + exp(-x)) in the dtype of ``x`` (float32 or wider)."""
    return 1.0 / (1.0 + xp.exp(-x))


# ---------------------------------------------------------------------------
# Unary math: one xp ufunc each, registered by a factory.


def _plain_ufunc(ufunc: str, floats_only: bool = False) -> Any:
    """Specializer: with every input dtype known, the bare ufunc (no per-call dtype dispatch).

    float16 is included: numpy's and CuPy's half-precision loops compute in float32 and
    round once, exactly what the generic kernel's widen-compute-narrow does, in one
    kernel instead of four. bfloat16 keeps the generic path (CuPy has no bfloat16).
    ``floats_only`` restricts it to equal float dtypes (Div, Pow: integers differ).
    """

    def specialize(ctx: KernelContext, in_dtypes: tuple[str | None, ...]) -> Any:
        if any(d is None or d == "bfloat16" for d in in_dtypes):
            return None
        if floats_only and (len(set(in_dtypes)) != 1 or in_dtypes[0] not in _SPECIALIZED_FLOATS):
            return None
        return getattr(ctx.xp, ufunc)

    return specialize


_SPECIALIZED_FLOATS = frozenset({"float16", "float32", "float64"})


def _register_unary(name: str, ufunc: str, *, since: int, predicate: bool = False) -> None:
    """Register ``name`` as the xp ufunc ``ufunc`` applied elementwise."""

    def kernel(ctx: KernelContext, x: Array) -> Array:
        fn = getattr(ctx.xp, ufunc)
        return fn(*_widen(ctx.xp, x)) if predicate else _float_op(ctx.xp, fn, x)

    kernel.__name__ = kernel.__qualname__ = name.lower()
    kernel.__doc__ = f"ONNX {name}: elementwise xp.{ufunc}."
    shape = _bool_like_first if predicate else same_as_first
    op(name, traits=_EW, shape=shape, since=since, specialize=_plain_ufunc(ufunc))(kernel)


# name: (xp ufunc, first opset implemented); opset-1 versions had `consumed_inputs`.
_UNARY: dict[str, tuple[str, int]] = {
    "Abs": ("absolute", 6),
    "Acos": ("arccos", 7),
    "Acosh": ("arccosh", 9),
    "Asin": ("arcsin", 7),
    "Asinh": ("arcsinh", 9),
    "Atan": ("arctan", 7),
    "Atanh": ("arctanh", 9),
    "Cos": ("cos", 7),
    "Cosh": ("cosh", 9),
    "Sin": ("sin", 7),
    "Sinh": ("sinh", 9),
    "Tan": ("tan", 7),
    "Tanh": ("tanh", 6),
    "Exp": ("exp", 6),
    "Log": ("log", 6),
    "Sqrt": ("sqrt", 6),
    "Reciprocal": ("reciprocal", 6),
    "Neg": ("negative", 6),
    "Floor": ("floor", 6),
    "Ceil": ("ceil", 6),
    "Round": ("rint", 11),  # rint rounds halves to even, as ONNX asks
    "Sign": ("sign", 9),
    "Not": ("logical_not", 1),
    "BitwiseNot": ("invert", 18),
}
for _name, (_ufunc, _since) in _UNARY.items():
    _register_unary(_name, _ufunc, since=_since)
_register_unary("IsNaN", "isnan", since=9, predicate=True)


@op("IsInf", traits=_EW, shape=_bool_like_first, since=10)
def isinf(ctx: KernelContext, x: Array, *, detect_negative: int = 1, detect_positive: int = 1) -> Array:
    """ONNX IsInf: True where x is an infinity of a detected sign."""
    xp = ctx.xp
    (x,) = _widen(xp, x)
    inf = xp.isinf(x)
    if not detect_negative:
        inf = inf & (x > 0)
    if not detect_positive:
        inf = inf & (x < 0)
    return inf


@op("Erf", traits=_EW, shape=same_as_first, since=9)
def erf(ctx: KernelContext, x: Array) -> Array:
    """ONNX Erf: the Gauss error function (scipy.special / cupyx.scipy.special, one ufunc call)."""
    return _float_op(ctx.xp, lambda v: special.erf(ctx.xp, v), x)


# ---------------------------------------------------------------------------
# Binary arithmetic, logic and comparisons.


def _register_binary(name: str, ufunc: str, *, since: int, kind: str) -> None:
    """Register ``name`` as a broadcasting xp ufunc; kind is "math", "predicate" (bool result) or "bits"."""

    def kernel(ctx: KernelContext, a: Array, b: Array) -> Array:
        fn = getattr(ctx.xp, ufunc)
        if kind == "math":
            return _float_op(ctx.xp, fn, a, b)
        if kind == "predicate":
            return fn(*_widen(ctx.xp, a, b))
        return fn(a, b)

    kernel.__name__ = kernel.__qualname__ = name.lower()
    kernel.__doc__ = f"ONNX {name}: elementwise xp.{ufunc} with numpy broadcasting."
    shape = broadcast_bool_rule if kind == "predicate" else broadcast_rule
    op(name, traits=_EW, shape=shape, since=since, specialize=_plain_ufunc(ufunc))(kernel)


# name: (xp ufunc, first opset implemented, kind); opsets before 7 had legacy broadcasting.
_BINARY: dict[str, tuple[str, int, str]] = {
    "Add": ("add", 7, "math"),
    "Sub": ("subtract", 7, "math"),
    "Mul": ("multiply", 7, "math"),
    "Equal": ("equal", 7, "predicate"),
    "Greater": ("greater", 7, "predicate"),
    "GreaterOrEqual": ("greater_equal", 12, "predicate"),
    "Less": ("less", 7, "predicate"),
    "LessOrEqual": ("less_equal", 12, "predicate"),
    "And": ("logical_and", 7, "predicate"),
    "Or": ("logical_or", 7, "predicate"),
    "Xor": ("logical_xor", 7, "predicate"),
    "BitwiseAnd": ("bitwise_and", 18, "bits"),
    "BitwiseOr": ("bitwise_or", 18, "bits"),
    "BitwiseXor": ("bitwise_xor", 18, "bits"),
}
for _name, (_ufunc, _since, _kind) in _BINARY.items():
    _register_binary(_name, _ufunc, since=_since, kind=_kind)


def _is_int(a: Array) -> bool:
    return a.dtype.kind in "iu"


@op("Div", traits=_EW, shape=broadcast_rule, since=7, specialize=_plain_ufunc("divide", floats_only=True))
def div(ctx: KernelContext, a: Array, b: Array) -> Array:
    """ONNX Div: true division for floats, division truncated toward zero for integers."""
    xp = ctx.xp
    if not _is_int(a):
        return _float_op(xp, xp.divide, a, b)
    # Integer math throughout: a float detour would lose precision on large int64.
    q = xp.floor_divide(a, b)
    inexact = xp.remainder(a, b) != 0
    # floor and trunc differ by one when the quotient is negative and inexact.
    return q + (inexact & ((a < 0) != (b < 0))).astype(q.dtype)


@op("Mod", traits=_EW, shape=broadcast_rule, since=10)
def mod(ctx: KernelContext, a: Array, b: Array, *, fmod: int = 0) -> Array:
    """ONNX Mod: sign of the divisor (Python's %) by default, sign of the dividend if fmod=1."""
    xp = ctx.xp
    if fmod:
        return _float_op(xp, xp.fmod, a, b)
    if a.dtype.kind == "f" or a.dtype in _HALF_FLOATS:
        return _float_op(xp, lambda x, y: _float_remainder(xp, x, y), a, b)
    return xp.remainder(a, b)


def _float_remainder(xp: Any, a: Array, b: Array) -> Array:
    """Python's float %, from C's fmod: numpy's own algorithm (bit-equal to np.remainder), on any xp.

    CuPy's remainder is ``a - floor(a / b) * b``, which is wrong at the edges (3 % inf is
    nan there, 3.0 in Python); fmod is exact everywhere.
    """
    r = xp.fmod(a, b)
    r = xp.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return xp.where(r == 0, xp.copysign(xp.zeros_like(r), b), r)


@op("Pow", traits=_EW, shape=broadcast_rule, since=7, specialize=_plain_ufunc("power", floats_only=True))
def pow_(ctx: KernelContext, a: Array, b: Array) -> Array:
    """ONNX Pow: a ** b in the dtype of the base, whatever the exponent's dtype."""
    xp = ctx.xp
    if a.dtype == b.dtype:
        return _float_op(xp, xp.power, a, b)
    # Mixed base and exponent types: compute in float64, then round to the base's dtype.
    return _narrow(xp.power(a.astype(xp.float64), b.astype(xp.float64)), a)


@op("BitShift", traits=_EW, shape=broadcast_rule, since=11)
def bitshift(ctx: KernelContext, x: Array, y: Array, *, direction: str) -> Array:
    """ONNX BitShift: LEFT or RIGHT (arithmetic for signed types); shifts out of range fill."""
    xp = ctx.xp
    bits = x.dtype.itemsize * 8
    in_range = (y >= 0) & (y < bits)
    count = xp.where(in_range, y, 0).astype(x.dtype)
    if direction == "LEFT":
        # Shift the unsigned view so bits may pass the sign bit without overflow.
        unsigned = xp.dtype(f"uint{bits}")
        shifted = xp.left_shift(x.view(unsigned), count.astype(unsigned)).view(x.dtype)
        fill = xp.zeros_like(x)
    elif direction == "RIGHT":
        shifted = xp.right_shift(x, count)
        # A shift by >= the width leaves only the sign extension: -1 or 0.
        fill = xp.right_shift(x, bits - 1) if x.dtype.kind == "i" else xp.zeros_like(x)
    else:
        raise ValueError(f"BitShift direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    return xp.where(in_range, shifted, fill)


# ---------------------------------------------------------------------------
# Variadic and selection ops.


@op("Max", traits=_EW, shape=broadcast_rule, since=6)
def max_(ctx: KernelContext, first: Array, *rest: Array) -> Array:
    """ONNX Max: elementwise maximum of all inputs (NaN propagates)."""
    return _float_op(ctx.xp, lambda *xs: reduce(ctx.xp.maximum, xs), first, *rest)


@op("Min", traits=_EW, shape=broadcast_rule, since=6)
def min_(ctx: KernelContext, first: Array, *rest: Array) -> Array:
    """ONNX Min: elementwise minimum of all inputs (NaN propagates)."""
    return _float_op(ctx.xp, lambda *xs: reduce(ctx.xp.minimum, xs), first, *rest)


@op("Sum", traits=_EW, shape=broadcast_rule, since=6)
def sum_(ctx: KernelContext, first: Array, *rest: Array) -> Array:
    """ONNX Sum: elementwise sum of all inputs."""
    return _float_op(ctx.xp, lambda *xs: reduce(ctx.xp.add, xs), first, *rest)


@op("Mean", traits=_EW, shape=broadcast_rule, since=6)
def mean(ctx: KernelContext, first: Array, *rest: Array) -> Array:
    """ONNX Mean: elementwise mean of all inputs."""
    n = 1 + len(rest)
    return _float_op(ctx.xp, lambda *xs: reduce(ctx.xp.add, xs) / n, first, *rest)


def _where_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Where: broadcast of all three, dtype of X."""
    return [TensorInfo(inputs[1].dtype, broadcast_rule(attrs, *inputs)[0].shape)]


@op("Where", traits=_EW, shape=_where_rule, since=9)
def where(ctx: KernelContext, condition: Array, x: Array, y: Array) -> Array:
    """ONNX Where: x where condition is True, else y."""
    return ctx.xp.where(condition, x, y)


@op("Clip", traits=_EW, shape=same_as_first, since=6)
def clip(
    ctx: KernelContext,
    x: Array,
    lo: Array | None = None,
    hi: Array | None = None,
    *,
    min: float = -3.4028234663852886e38,  # the attribute names of opsets 6-10 shadow builtins
    max: float = 3.4028234663852886e38,
) -> Array:
    """ONNX Clip: Min(max, Max(x, min)); bounds are attributes before opset 11, inputs after."""
    xp = ctx.xp
    if ctx.opset < 11:
        lo, hi = xp.asarray(min, dtype=x.dtype), xp.asarray(max, dtype=x.dtype)
    y = x
    if lo is not None:
        y = xp.maximum(y, lo)
    if hi is not None:
        y = xp.minimum(y, hi)  # applied last: when min > max every value becomes max
    return y


# ---------------------------------------------------------------------------
# Activations.


@op("Relu", traits=_EW, shape=same_as_first, since=6)
def relu(ctx: KernelContext, x: Array) -> Array:
    """ONNX Relu: max(x, 0)."""
    return ctx.xp.maximum(x, 0)


@op("LeakyRelu", traits=_EW, shape=same_as_first, since=6)
def leaky_relu(ctx: KernelContext, x: Array, *, alpha: float = 0.01) -> Array:
    """ONNX LeakyRelu: x if x >= 0 else alpha * x."""
    return _float_op(ctx.xp, lambda v: ctx.xp.where(v < 0, alpha * v, v), x)


@op("PRelu", traits=_EW, shape=broadcast_rule, since=7)
def prelu(ctx: KernelContext, x: Array, slope: Array) -> Array:
    """ONNX PRelu: x if x >= 0 else slope * x (slope broadcasts to x)."""
    return _float_op(ctx.xp, lambda v, s: ctx.xp.where(v < 0, s * v, v), x, slope)


@op("Elu", traits=_EW, shape=same_as_first, since=6)
def elu(ctx: KernelContext, x: Array, *, alpha: float = 1.0) -> Array:
    """ONNX Elu: x if x >= 0 else alpha * (exp(x) - 1)."""
    return _float_op(ctx.xp, lambda v: ctx.xp.where(v < 0, alpha * ctx.xp.expm1(v), v), x)


@op("Selu", traits=_EW, shape=same_as_first, since=6)
def selu(
    ctx: KernelContext,
    x: Array,
    *,
    alpha: float = 1.67326319217681884765625,
    gamma: float = 1.05070102519989013671875,
) -> Array:
    """ONNX Selu: gamma * (x if x > 0 else alpha * (exp(x) - 1))."""
    xp = ctx.xp
    return _float_op(xp, lambda v: gamma * xp.where(v > 0, v, alpha * xp.expm1(v)), x)


@op("Celu", traits=_EW, shape=same_as_first, since=12)
def celu(ctx: KernelContext, x: Array, *, alpha: float = 1.0) -> Array:
    """ONNX Celu: max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    xp = ctx.xp
    return _float_op(xp, lambda v: xp.where(v > 0, v, alpha * xp.expm1(v / alpha)), x)


@op("ThresholdedRelu", traits=_EW, shape=same_as_first, since=10)
def thresholded_relu(ctx: KernelContext, x: Array, *, alpha: float = 1.0) -> Array:
    """ONNX ThresholdedRelu: x if x > alpha else 0."""
    return _narrow(ctx.xp.where(x > alpha, x, 0), x)


@op("HardSigmoid", traits=_EW, shape=same_as_first, since=6)
def hard_sigmoid(ctx: KernelContext, x: Array, *, alpha: float = 0.2, beta: float = 0.5) -> Array:
    """ONNX HardSigmoid: clip(alpha * x + beta, 0, 1)."""
    xp = ctx.xp
    return _float_op(xp, lambda v: xp.minimum(xp.maximum(alpha * v + beta, 0.0), 1.0), x)


@op("HardSwish", traits=_EW, shape=same_as_first, since=14)
def hard_swish(ctx: KernelContext, x: Array) -> Array:
    """ONNX HardSwish: x * HardSigmoid(x) with alpha = 1/6, beta = 0.5."""
    xp = ctx.xp
    return _float_op(xp, lambda v: v * xp.minimum(xp.maximum(v / 6.0 + 0.5, 0.0), 1.0), x)


@op("Sigmoid", traits=_EW, shape=same_as_first, since=6)
def sigmoid(ctx: KernelContext, x: Array) -> Array:
    """ONNX Sigmoid: 1 / (1 + exp(-x))."""
    return _float_op(ctx.xp, lambda v: _sigmoid(ctx.xp, v), x)


@op("Softplus", traits=_EW, shape=same_as_first)
def softplus(ctx: KernelContext, x: Array) -> Array:
    """ONNX Softplus: log(1 + exp(x)), computed without overflow."""
    return _float_op(ctx.xp, lambda v: ctx.xp.logaddexp(v, 0.0), x)


@op("Softsign", traits=_EW, shape=same_as_first)
def softsign(ctx: KernelContext, x: Array) -> Array:
    """ONNX Softsign: x / (1 + |x|)."""
    return _float_op(ctx.xp, lambda v: v / (1.0 + ctx.xp.abs(v)), x)


@op("Gelu", traits=_EW, shape=same_as_first, since=20)
def gelu(ctx: KernelContext, x: Array, *, approximate: str = "none") -> Array:
    """ONNX Gelu: x * Phi(x) exactly (erf), or its tanh approximation, computed in float64."""
    xp = ctx.xp
    v = x.astype(xp.float64)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)
        return _narrow(0.5 * v * (1.0 + xp.tanh(inner)), x)
    if approximate != "none":
        raise ValueError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return _narrow(0.5 * v * (1.0 + special.erf(xp, v / math.sqrt(2.0))), x)


@op("Mish", traits=_EW, shape=same_as_first, since=18)
def mish(ctx: KernelContext, x: Array) -> Array:
    """ONNX Mish: x * tanh(softplus(x))."""
    xp = ctx.xp
    return _float_op(xp, lambda v: v * xp.tanh(xp.logaddexp(v, 0.0)), x)


@op("Swish", traits=_EW, shape=same_as_first, since=24)
def swish(ctx: KernelContext, x: Array, *, alpha: float = 1.0) -> Array:
    """ONNX Swish: x * sigmoid(alpha * x)."""
    return _float_op(ctx.xp, lambda v: v * _sigmoid(ctx.xp, alpha * v), x)


@op("SwiGLU", traits=_EW, shape=same_as_first, since=28)
def swiglu(ctx: KernelContext, a: Array, b: Array, *, alpha: float = 1.0) -> Array:
    """ONNX SwiGLU: Swish_alpha(a) * b; a and b have one shape, no broadcasting."""
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU needs inputs of one shape (no broadcasting), got {a.shape} and {b.shape}")
    return _float_op(ctx.xp, lambda u, v: u * _sigmoid(ctx.xp, alpha * u) * v, a, b)


@op("Shrink", traits=_EW, shape=same_as_first, since=9)
def shrink(ctx: KernelContext, x: Array, *, bias: float = 0.0, lambd: float = 0.5) -> Array:
    """ONNX Shrink: x + bias below -lambd, x - bias above lambd, 0 between."""
    xp = ctx.xp

    def fn(v: Array) -> Array:
        return xp.where(v < -lambd, v + bias, xp.where(v > lambd, v - bias, 0))

    return _float_op(xp, fn, x)


# ---------------------------------------------------------------------------
# Identity, Dropout and casts.


@op("Identity", traits=Trait.ELEMENTWISE, shape=same_as_first)
def identity(ctx: KernelContext, x: Array) -> Array:
    """ONNX Identity: the input itself (a tensor, sequence or optional)."""
    return x


def _dropout_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Dropout: output like the data, mask of bools."""
    return [inputs[0], TensorInfo("bool", inputs[0].shape)]


@op("Dropout", traits=Trait.ELEMENTWISE, shape=_dropout_rule, outputs=(1, 2), since=7)
def dropout(
    ctx: KernelContext,
    data: Array,
    ratio_input: Array | None = None,
    training_mode: Array | None = None,
    *,
    ratio: float = 0.5,
    seed: int | None = None,
) -> tuple[Array, Array]:
    """ONNX Dropout: identity in inference; in training, drop with numpy's seeded stream.

    The ratio is an attribute before opset 12 and an input after. In training mode the
    mask is drawn on the host by numpy's legacy RandomState(seed), as ONNX's reference
    does, so every backend gets the same mask for the same seed.
    """
    xp = ctx.xp
    drop = float(ratio_input) if ratio_input is not None else ratio
    training = training_mode is not None and bool(training_mode)
    if not training or drop == 0.0:
        return data, xp.ones(data.shape, dtype=bool)
    keep = np.random.RandomState(seed).uniform(0.0, 1.0, data.shape) >= drop
    mask = xp.asarray(keep)
    scale = 1.0 / (1.0 - drop)
    return _float_op(xp, lambda v: xp.where(mask, v * scale, 0.0), data), mask


def _cast_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of Cast and BitCast: shape of the input, dtype named by `to`."""
    return [TensorInfo(dtypes.from_onnx(attrs["to"]), inputs[0].shape)]


def _cast_like_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of CastLike: shape of the input, dtype of the second input."""
    return [TensorInfo(inputs[1].dtype, inputs[0].shape)]


@op("Cast", traits=_EW, shape=_cast_rule, since=6)
def cast(ctx: KernelContext, x: Array, *, to: int, saturate: int = 1, round_mode: str = "up") -> Array:
    """ONNX Cast to a DSP dtype; saturate concerns float8 targets, round_mode float8e8m0."""
    target = dtypes.numpy_from_onnx(to)
    return lowbit.convert(ctx.xp, x, target, saturate=bool(saturate), round_mode=round_mode)


@op("CastLike", traits=_EW, shape=_cast_like_rule, since=15)
def cast_like(ctx: KernelContext, x: Array, like: Array, *, saturate: int = 1, round_mode: str = "up") -> Array:
    """ONNX CastLike: Cast to the dtype of the second input."""
    dtypes.normalize(like.dtype)  # raises DTypeError for a dtype DSP does not know
    return lowbit.convert(ctx.xp, x, like.dtype, saturate=bool(saturate), round_mode=round_mode)


@op("BitCast", traits=Trait.ELEMENTWISE, shape=_cast_rule, since=26)
def bitcast(ctx: KernelContext, x: Array, *, to: int) -> Array:
    """ONNX BitCast: the same bytes read as another dtype of the same width (a view)."""
    target = dtypes.numpy_from_onnx(to)
    if target.itemsize != x.dtype.itemsize:
        raise ValueError(
            f"BitCast needs dtypes of one width, got {x.dtype} ({x.dtype.itemsize * 8} bits) "
            f"to {target} ({target.itemsize * 8} bits)"
        )
    return x.view(target)
