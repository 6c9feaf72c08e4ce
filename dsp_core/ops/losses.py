"""Loss ops (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss) and the optimizer ops of
the ``ai.onnx.preview.training`` domain (Adagrad, Adam, Momentum).

The optimizers take their tensors grouped: R, T, then n X's, n G's, and (per optimizer)
n of each state; they return the n new X's followed by the n of each new state.
"""

from __future__ import annotations

from typing import Any

from dsp_core.ops.registry import KernelContext, TensorInfo, op

Array = Any
TRAINING = "ai.onnx.preview.training"


# ---------------------------------------------------------------------------
# Losses. Input is [N, C, d1, ..., dk], target [N, d1, ..., dk] of class indices.


def _loss_info(attrs: dict[str, Any], scores: TensorInfo) -> TensorInfo:
    """The loss output: [N, d1..dk] for reduction none, a scalar otherwise."""
    if attrs.get("reduction", "mean") != "none":
        return TensorInfo(scores.dtype, ())
    return TensorInfo(scores.dtype, None if scores.shape is None else scores.shape[:1] + scores.shape[2:])


def _nll_rule(attrs: dict[str, Any], scores: TensorInfo, *rest: TensorInfo | None) -> list[TensorInfo]:
    return [_loss_info(attrs, scores)]


def _sce_rule(attrs: dict[str, Any], scores: TensorInfo, *rest: TensorInfo | None) -> list[TensorInfo]:
    return [_loss_info(attrs, scores), scores]  # (loss, log_prob)


def _nll(
    xp: Any, log_prob: Array, target: Array, weight: Array | None, reduction: str, ignore_index: int | None
) -> Array:
    """-log_prob[n, target[n, ...], ...] weighted by class and reduced; ignored targets count 0."""
    target = target.astype(xp.int64)
    keep = xp.ones(target.shape, bool) if ignore_index is None else target != ignore_index
    safe = xp.where(keep, target, 0)  # ignore_index may lie outside [0, C)
    picked = xp.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    w = xp.ones(target.shape, log_prob.dtype) if weight is None else weight[safe]
    w = xp.where(keep, w, xp.zeros_like(w))
    loss = -picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / w.sum()
    raise ValueError(f"reduction must be none, sum or mean, got {reduction!r}")


def _upcast(xp: Any, a: Array) -> Array:
    """Half-precision tensors are computed in float32."""
    return a.astype(xp.float32) if a is not None and a.dtype.itemsize < 4 else a


@op("NegativeLogLikelihoodLoss", since=12, shape=_nll_rule)
def negative_log_likelihood_loss(
    ctx: KernelContext,
    input: Array,
    target: Array,
    weight: Array | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Array:
    """Negative log likelihood of ``target`` classes under log-probabilities ``input``."""
    xp = ctx.xp
    loss = _nll(xp, _upcast(xp, input), target, _upcast(xp, weight), reduction, ignore_index)
    return loss.astype(input.dtype)


@op("SoftmaxCrossEntropyLoss", since=12, outputs=(1, 2), shape=_sce_rule)
def softmax_cross_entropy_loss(
    ctx: KernelContext,
    scores: Array,
    labels: Array,
    weights: Array | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> tuple[Array, Array]:
    """Cross entropy of softmax(scores, axis=1) against ``labels``: returns (loss, log_prob)."""
    xp = ctx.xp
    s = _upcast(xp, scores)
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    loss = _nll(xp, log_prob, labels, _upcast(xp, weights), reduction, ignore_index)
    return loss.astype(scores.dtype), log_prob.astype(scores.dtype)


# ---------------------------------------------------------------------------
# Optimizers (ai.onnx.preview.training, version 1).


def _groups(tensors: tuple[Array, ...], k: int, op_name: str) -> list[tuple[Array, ...]]:
    """Split X1..Xn, G1..Gn, S1..Sn, ... into k groups of n tensors each."""
    if not tensors or len(tensors) % k:
        raise ValueError(f"{op_name} expects R, T and {k} groups of equally many tensors, got {len(tensors)}")
    n = len(tensors) // k
    return [tensors[i * n : (i + 1) * n] for i in range(k)]


def _flatten(per_tensor: list[tuple[Array, ...]]) -> tuple[Array, ...]:
    """[(X1_new, S1_new), (X2_new, S2_new)] -> (X1_new, X2_new, S1_new, S2_new)."""
    return tuple(a for group in zip(*per_tensor) for a in group)


@op("Adagrad", domain=TRAINING, inputs=(5, -1), outputs=(1, -1))
def adagrad(
    ctx: KernelContext,
    r: Array,
    t: Array,
    *tensors: Array,
    decay_factor: float = 0.0,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
) -> tuple[Array, ...]:
    """One ADAGRAD step of every X: returns (X_new..., H_new...)."""
    xp = ctx.xp
    rate = r / (1 + t * decay_factor)
    updated = []
    for x, g, h in zip(*_groups(tensors, 3, "Adagrad")):
        g_reg = norm_coefficient * x + g
        h_new = h + g_reg * g_reg
        x_new = x - rate * g_reg / (xp.sqrt(h_new) + epsilon)
        updated.append((x_new.astype(x.dtype), h_new.astype(h.dtype)))
    return _flatten(updated)


@op("Adam", domain=TRAINING, inputs=(6, -1), outputs=(1, -1))
def adam(
    ctx: KernelContext,
    r: Array,
    t: Array,
    *tensors: Array,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> tuple[Array, ...]:
    """One Adam step of every X: returns (X_new..., V_new..., H_new...)."""
    xp = ctx.xp
    # The step count decides the bias correction; computed where T lives (a device segment
    # never reads it back), the same float64 arithmetic the host form did.
    step = xp.asarray(t, dtype=xp.float64)
    first = step <= 0
    safe = xp.where(first, 1.0, step)
    correction = xp.sqrt(1 - beta**safe) / (1 - alpha**safe)
    rate = r * xp.where(first, 1.0, correction).astype(r.dtype)
    updated = []
    for x, g, v, h in zip(*_groups(tensors, 4, "Adam")):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * g_reg * g_reg
        x_new = (1 - norm_coefficient_post) * (x - rate * v_new / (xp.sqrt(h_new) + epsilon))
        updated.append((x_new.astype(x.dtype), v_new.astype(v.dtype), h_new.astype(h.dtype)))
    return _flatten(updated)


@op("Momentum", domain=TRAINING, inputs=(5, -1), outputs=(1, -1))
def momentum(
    ctx: KernelContext,
    r: Array,
    t: Array,
    *tensors: Array,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
) -> tuple[Array, ...]:
    """One SGD-with-momentum step (mode standard or nesterov): returns (X_new..., V_new...)."""
    if mode not in ("standard", "nesterov"):
        raise ValueError(f"Momentum mode must be 'standard' or 'nesterov', got {mode!r}")
    xp = ctx.xp
    # beta, or 1 on the first step: chosen where T lives (a device segment never reads it back)
    beta_adjusted = xp.where(xp.asarray(t) > 0, beta, 1.0)
    updated = []
    for x, g, v in zip(*_groups(tensors, 3, "Momentum")):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + beta_adjusted.astype(g_reg.dtype) * g_reg
        direction = g_reg + alpha * v_new if mode == "nesterov" else v_new
        updated.append(((x - r * direction).astype(x.dtype), v_new.astype(v.dtype)))
    return _flatten(updated)
