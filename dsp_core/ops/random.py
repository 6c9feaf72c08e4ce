"""Random ops: RandomUniform, RandomNormal, their *Like forms, Bernoulli and Multinomial.

Values come from ``xp.random.default_rng``: seeded from the ``seed`` attribute when the
node has one (so the node gives the same values on every run), fresh entropy otherwise.
ONNX does not define the generator, so no implementation reproduces another's values;
only shape, dtype and distribution are specified.
"""

from __future__ import annotations

import struct
from typing import Any

from dsp_core.ir.dtypes import from_onnx, numpy_from_onnx
from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, op

Array = Any
FLOAT = 1  # TensorProto.FLOAT, the default dtype of the generator ops
INT32 = 6  # TensorProto.INT32, Multinomial's default
INT64 = 7


def _rng(ctx: KernelContext, seed: float | None) -> Any:
    """A generator seeded by the float ``seed`` attribute (its bit pattern), or unseeded."""
    if seed is None:
        return ctx.xp.random.default_rng()
    bits = struct.unpack("<I", struct.pack("<f", seed))[0]  # distinct float32 seeds, distinct streams
    return ctx.xp.random.default_rng(bits)


def _float_dtype(code: int) -> Any:
    """The numpy dtype of an ONNX float dtype code (the generator ops' only legal outputs)."""
    dtype = numpy_from_onnx(code)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise ValueError(f"random ops produce floating-point tensors, got dtype {dtype.name} (code {code})")
    return dtype


def _uniform(ctx: KernelContext, shape: tuple[int, ...], dtype: Any, low: float, high: float, seed: Any) -> Array:
    """Uniform values in [low, high), drawn in float64 and cast to ``dtype``."""
    u = _rng(ctx, seed).random(shape)
    return (low + (high - low) * u).astype(dtype)


def _normal(ctx: KernelContext, shape: tuple[int, ...], dtype: Any, mean: float, scale: float, seed: Any) -> Array:
    """Normal values of the given mean and standard deviation, cast to ``dtype``."""
    z = _rng(ctx, seed).standard_normal(shape)
    return (mean + scale * z).astype(dtype)


def _like_dtype(x: Array, dtype: int | None) -> Any:
    """The *Like ops' output dtype: the attribute when given, else the input's."""
    return x.dtype if dtype is None else _float_dtype(dtype)


# Shape rules: generators take their shape from the attribute, *Like ops from the input.


def _shape_attr_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    return [TensorInfo(from_onnx(attrs.get("dtype", FLOAT)), tuple(attrs["shape"]))]


def _like_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    dtype = attrs.get("dtype")
    return [TensorInfo(x.dtype if dtype is None else from_onnx(dtype), x.shape)]


def _multinomial_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    batch = None if x.shape is None else x.shape[0]
    return [TensorInfo(from_onnx(attrs.get("dtype", INT32)), (batch, attrs.get("sample_size", 1)))]


@op("RandomUniform", traits=Trait.RANDOM, inputs=(0, 0), shape=_shape_attr_rule)
def random_uniform(
    ctx: KernelContext,
    *,
    shape: list[int],
    dtype: int = FLOAT,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> Array:
    """A tensor of the given shape, uniform in [low, high)."""
    return _uniform(ctx, tuple(shape), _float_dtype(dtype), low, high, seed)


@op("RandomNormal", traits=Trait.RANDOM, inputs=(0, 0), shape=_shape_attr_rule)
def random_normal(
    ctx: KernelContext,
    *,
    shape: list[int],
    dtype: int = FLOAT,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> Array:
    """A tensor of the given shape, normal with the given mean and standard deviation."""
    return _normal(ctx, tuple(shape), _float_dtype(dtype), mean, scale, seed)


@op("RandomUniformLike", traits=Trait.RANDOM, shape=_like_rule)
def random_uniform_like(
    ctx: KernelContext,
    input: Array,
    *,
    dtype: int | None = None,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> Array:
    """A tensor shaped like ``input``, uniform in [low, high)."""
    return _uniform(ctx, input.shape, _like_dtype(input, dtype), low, high, seed)


@op("RandomNormalLike", traits=Trait.RANDOM, shape=_like_rule)
def random_normal_like(
    ctx: KernelContext,
    input: Array,
    *,
    dtype: int | None = None,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> Array:
    """A tensor shaped like ``input``, normal with the given mean and standard deviation."""
    return _normal(ctx, input.shape, _like_dtype(input, dtype), mean, scale, seed)


@op("Bernoulli", traits=Trait.RANDOM, since=15, shape=_like_rule)
def bernoulli(ctx: KernelContext, input: Array, *, dtype: int | None = None, seed: float | None = None) -> Array:
    """0/1 draws with probabilities ``input``, in ``dtype`` (default: the input's dtype)."""
    out_dtype = input.dtype if dtype is None else numpy_from_onnx(dtype)
    draws = _rng(ctx, seed).random(input.shape) < input
    return draws.astype(out_dtype)


@op("Multinomial", traits=Trait.RANDOM, since=7, shape=_multinomial_rule)
def multinomial(
    ctx: KernelContext, input: Array, *, dtype: int = INT32, sample_size: int = 1, seed: float | None = None
) -> Array:
    """``sample_size`` class indices per batch row, drawn from unnormalized log-probabilities ``input``."""
    xp = ctx.xp
    if dtype not in (INT32, INT64):
        raise ValueError(f"Multinomial dtype must be int32 (6) or int64 (7), got {dtype}")
    logits = input.astype(xp.float64)
    weights = xp.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = xp.cumsum(weights, axis=1)
    u = _rng(ctx, seed).random((input.shape[0], sample_size)) * cdf[:, -1:]
    # The drawn class is the number of cdf entries at or below u (never past the last class).
    index = (cdf[:, None, :] <= u[:, :, None]).sum(axis=2)
    return xp.minimum(index, input.shape[1] - 1).astype(numpy_from_onnx(dtype))
