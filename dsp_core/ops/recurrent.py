"""Recurrent ops: LSTM, GRU and RNN.

The three share one driver (``_recurrence``): it normalises the layout, projects the
whole input sequence through W once, runs each direction's time loop (vectorised over
the batch, honouring ``sequence_lens``) and assembles Y and the final states. Each op
contributes only its cell, the per-step update of its states.

Shapes inside the driver use layout 0: X is [seq, batch, input], states are
[num_directions, batch, hidden], Y is [seq, num_directions, batch, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from dsp_core.ops.registry import KernelContext, op

Array = Any
Activation = Callable[[Array], Array]
# Products go through xp.matmul (never the @ operator), so a device backend's own matmul runs
# them (CUDA_GRAPHS: the owned cuBLAS binding, which a capture accepts).
# A cell maps (direction index, x_t @ W^T + Wb, states) to the new states; h comes first.
Cell = Callable[[int, Array, tuple[Array, ...]], tuple[Array, ...]]


# ---------------------------------------------------------------------------
# Activations named by the ``activations`` attribute, with their ONNX default alpha/beta.


def _sigmoid(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return 0.5 * (xp.tanh(0.5 * x) + 1)  # tanh form: no overflow for large |x|


def _tanh(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.tanh(x)


def _relu(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.maximum(x, 0)


def _affine(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return alpha * x + beta


def _leaky_relu(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.where(x >= 0, x, alpha * x)


def _thresholded_relu(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.where(x > alpha, x, 0 * x)


def _scaled_tanh(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return alpha * xp.tanh(beta * x)


def _hard_sigmoid(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.clip(alpha * x + beta, 0, 1)


def _elu(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.where(x >= 0, x, alpha * (xp.exp(xp.minimum(x, 0)) - 1))


def _softsign(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return x / (1 + xp.abs(x))


def _softplus(xp: Any, x: Array, alpha: float, beta: float) -> Array:
    return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))


# lower-case name -> (function, default alpha or None if unused, default beta or None)
_ACTIVATIONS: dict[str, tuple[Callable[..., Array], float | None, float | None]] = {
    "sigmoid": (_sigmoid, None, None),
    "tanh": (_tanh, None, None),
    "relu": (_relu, None, None),
    "affine": (_affine, 1.0, 0.0),
    "leakyrelu": (_leaky_relu, 0.01, None),
    "thresholdedrelu": (_thresholded_relu, 1.0, None),
    "scaledtanh": (_scaled_tanh, 1.0, 1.0),
    "hardsigmoid": (_hard_sigmoid, 0.2, 0.5),
    "elu": (_elu, 1.0, None),
    "softsign": (_softsign, None, None),
    "softplus": (_softplus, None, None),
}


def _activations(
    xp: Any,
    names: Sequence[str],
    alphas: Sequence[float] | None,
    betas: Sequence[float] | None,
) -> list[Activation]:
    """Bind each named activation to its alpha/beta.

    The alpha and beta lists are consumed in order by the activations that take them
    (as onnxruntime reads them); an exhausted list leaves ONNX's default.
    """
    alpha_iter, beta_iter = iter(alphas or ()), iter(betas or ())
    bound: list[Activation] = []
    for name in names:
        entry = _ACTIVATIONS.get(name.lower())
        if entry is None:
            raise ValueError(f"unknown recurrent activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
        fn, alpha, beta = entry
        alpha = next(alpha_iter, alpha) if alpha is not None else 0.0
        beta = next(beta_iter, beta) if beta is not None else 0.0
        bound.append(partial(fn, xp, alpha=alpha, beta=beta))
    return bound


def _per_direction(
    xp: Any,
    direction: str,
    activations: Sequence[str] | None,
    alphas: Sequence[float] | None,
    betas: Sequence[float] | None,
    defaults: Sequence[str],
) -> list[list[Activation]]:
    """The activation functions of each direction (a bidirectional list holds both halves)."""
    n_dirs = _num_directions(direction)
    k = len(defaults)
    names = list(activations) if activations else list(defaults)
    if len(names) < k * n_dirs:  # one direction's list given for both: reuse it
        names = names[:k] * n_dirs
    funcs = _activations(xp, names, alphas, betas)
    return [funcs[d * k : (d + 1) * k] for d in range(n_dirs)]


def _clipper(xp: Any, clip: float | None) -> Activation:
    """The clip applied to every gate's input before its activation."""
    if clip is None:
        return lambda x: x
    return lambda x: xp.clip(x, -clip, clip)


# ---------------------------------------------------------------------------
# The shared driver.


def _num_directions(direction: str) -> int:
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ValueError(f"direction must be forward, reverse or bidirectional, got {direction!r}")
    return 2 if direction == "bidirectional" else 1


@dataclass(frozen=True)
class _Spec:
    """What a cell and the driver need besides the sequence: sizes, activations, R and Rb."""

    hidden: int
    dtype: Any  # compute dtype: float32 for half-precision inputs
    direction: str
    layout: int
    acts: list[list[Activation]]  # per direction, in the op's (f, g, h) order
    clip: Activation
    rt: Array  # R transposed: [num_directions, hidden, gates * hidden]
    rb: Array  # the R half of B: [num_directions, gates * hidden]

    @property
    def n_dirs(self) -> int:
        return _num_directions(self.direction)

    def gate(self, a: Array, k: int) -> Array:
        """The k-th hidden-sized block along the last axis."""
        return a[..., k * self.hidden : (k + 1) * self.hidden]


def _spec(
    ctx: KernelContext, x: Array, r: Array, b: Array | None, attrs: dict[str, Any], defaults: Sequence[str]
) -> _Spec:
    """Read the attributes shared by LSTM, GRU and RNN (``attrs``: the kernel's locals) into a _Spec."""
    xp = ctx.xp
    hidden = attrs["hidden_size"] or r.shape[-1]
    dtype = xp.float32 if x.dtype.itemsize < 4 else x.dtype
    direction = attrs["direction"]
    n_dirs = _num_directions(direction)
    gates = r.shape[1] // hidden
    acts = _per_direction(
        xp, direction, attrs["activations"], attrs["activation_alpha"], attrs["activation_beta"], defaults
    )
    rb = xp.zeros((n_dirs, gates * hidden), dtype) if b is None else b[:, gates * hidden :].astype(dtype)
    rt = xp.swapaxes(r.astype(dtype), 1, 2)
    return _Spec(hidden, dtype, direction, attrs["layout"], acts, _clipper(xp, attrs["clip"]), rt, rb)


def _reverse_within(xp: Any, seq: Array, lens: Array) -> Array:
    """Reverse each batch entry's first lens[b] steps along axis 0 (padding stays put)."""
    t = xp.arange(seq.shape[0])[:, None]
    index = xp.where(t < lens[None, :], lens[None, :] - 1 - t, t)
    return seq[index, xp.arange(seq.shape[1])[None, :]]


def _scan(
    xp: Any, xw: Array, lens: Array, states: tuple[Array, ...], step: Callable[..., tuple[Array, ...]]
) -> tuple[Array, tuple[Array, ...]]:
    """Run one direction forward in time; steps past a batch entry's length keep its state."""
    outputs = []
    for t in range(xw.shape[0]):
        live = (t < lens)[:, None]
        new = step(xw[t], states)
        states = tuple(xp.where(live, n, s) for n, s in zip(new, states))
        outputs.append(xp.where(live, states[0], xp.zeros_like(states[0])))
    # An empty sequence has no last step: its final states are zeros (as onnxruntime does).
    empty = (lens == 0)[:, None]
    states = tuple(xp.where(empty, xp.zeros_like(s), s) for s in states)
    if not outputs:
        return xp.zeros((0,) + states[0].shape, states[0].dtype), states
    return xp.stack(outputs), states


def _recurrence(
    ctx: KernelContext,
    spec: _Spec,
    x: Array,
    w: Array,
    b: Array | None,
    sequence_lens: Array | None,
    initial: Sequence[Array | None],
    cell: Cell,
) -> tuple[Array, ...]:
    """Run ``cell`` over the sequence in every direction; return (Y, *final states)."""
    xp, dtype, n_dirs = ctx.xp, spec.dtype, spec.n_dirs
    out_dtype = x.dtype
    if spec.layout:
        x = xp.swapaxes(x, 0, 1)
        initial = [None if s is None else xp.swapaxes(s, 0, 1) for s in initial]
    seq_len, batch = x.shape[0], x.shape[1]
    x, w = x.astype(dtype), w.astype(dtype)
    wb = xp.zeros((n_dirs, w.shape[1]), dtype) if b is None else b[:, : w.shape[1]].astype(dtype)
    zeros = xp.zeros((n_dirs, batch, spec.hidden), dtype)
    states0 = tuple(zeros if s is None else s.astype(dtype) for s in initial)
    lens = xp.full((batch,), seq_len, xp.int64) if sequence_lens is None else sequence_lens.astype(xp.int64)
    ys, finals = [], []
    for d in range(n_dirs):
        reverse = spec.direction == "reverse" or d == 1
        xd = _reverse_within(xp, x, lens) if reverse else x
        xw = xp.matmul(xd, w[d].T) + wb[d]
        y, final = _scan(xp, xw, lens, tuple(s[d] for s in states0), partial(cell, d))
        ys.append(_reverse_within(xp, y, lens) if reverse else y)
        finals.append(final)
    y_all = xp.stack(ys, axis=1)
    final_states = [xp.stack([f[i] for f in finals]) for i in range(len(states0))]
    if spec.layout:
        y_all = xp.transpose(y_all, (2, 0, 1, 3))
        final_states = [xp.swapaxes(s, 0, 1) for s in final_states]
    return tuple(a.astype(out_dtype) for a in (y_all, *final_states))


# ---------------------------------------------------------------------------
# The ops. Attributes common to all three (ONNX defaults): activation_alpha,
# activation_beta, activations, clip, direction, hidden_size, layout (opset 14+) and
# output_sequence (opset 1 only, no effect: Y is always produced).


@op("LSTM", outputs=(0, 3), inputs=(3, 8))
def lstm(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    sequence_lens: Array | None = None,
    initial_h: Array | None = None,
    initial_c: Array | None = None,
    p: Array | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    output_sequence: int = 0,
) -> tuple[Array, Array, Array]:
    """Long short-term memory over a sequence (gates i, o, f, c): returns (Y, Y_h, Y_c)."""
    spec = _spec(ctx, x, r, b, locals(), ("Sigmoid", "Tanh", "Tanh"))
    peep = ctx.xp.zeros((spec.n_dirs, 3 * spec.hidden), spec.dtype) if p is None else p.astype(spec.dtype)

    def cell(d: int, xw: Array, states: tuple[Array, ...]) -> tuple[Array, ...]:
        f, g, h = spec.acts[d]
        h_prev, c_prev = states
        gates = xw + ctx.xp.matmul(h_prev, spec.rt[d]) + spec.rb[d]
        pi, po, pf = (spec.gate(peep[d], k) for k in range(3))
        i = f(spec.clip(spec.gate(gates, 0) + pi * c_prev))
        forget = 1 - i if input_forget else f(spec.clip(spec.gate(gates, 2) + pf * c_prev))
        c = forget * c_prev + i * g(spec.clip(spec.gate(gates, 3)))
        o = f(spec.clip(spec.gate(gates, 1) + po * c))
        return o * h(c), c

    y, y_h, y_c = _recurrence(ctx, spec, x, w, b, sequence_lens, [initial_h, initial_c], cell)
    return y, y_h, y_c


@op("GRU", outputs=(0, 2), inputs=(3, 6))
def gru(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    sequence_lens: Array | None = None,
    initial_h: Array | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
    output_sequence: int = 0,
) -> tuple[Array, Array]:
    """Gated recurrent unit over a sequence (gates z, r, h): returns (Y, Y_h)."""
    spec = _spec(ctx, x, r, b, locals(), ("Sigmoid", "Tanh"))

    def cell(d: int, xw: Array, states: tuple[Array, ...]) -> tuple[Array, ...]:
        f, g = spec.acts[d]
        (h_prev,) = states
        zr_ = slice(0, 2 * spec.hidden)  # the z and r gates, computed together
        zr = f(spec.clip(xw[:, zr_] + ctx.xp.matmul(h_prev, spec.rt[d][:, zr_]) + spec.rb[d][zr_]))
        rt_h, rb_h = spec.gate(spec.rt[d], 2), spec.gate(spec.rb[d], 2)
        z, reset = spec.gate(zr, 0), spec.gate(zr, 1)
        if linear_before_reset:
            recur = reset * (ctx.xp.matmul(h_prev, rt_h) + rb_h)
        else:
            recur = ctx.xp.matmul(reset * h_prev, rt_h) + rb_h
        candidate = g(spec.clip(spec.gate(xw, 2) + recur))
        return ((1 - z) * candidate + z * h_prev,)

    y, y_h = _recurrence(ctx, spec, x, w, b, sequence_lens, [initial_h], cell)
    return y, y_h


@op("RNN", outputs=(0, 2), inputs=(3, 6))
def rnn(
    ctx: KernelContext,
    x: Array,
    w: Array,
    r: Array,
    b: Array | None = None,
    sequence_lens: Array | None = None,
    initial_h: Array | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    output_sequence: int = 0,
) -> tuple[Array, Array]:
    """Simple (Elman) recurrent network over a sequence: returns (Y, Y_h)."""
    spec = _spec(ctx, x, r, b, locals(), ("Tanh",))

    def cell(d: int, xw: Array, states: tuple[Array, ...]) -> tuple[Array, ...]:
        (f,) = spec.acts[d]
        (h_prev,) = states
        return (f(spec.clip(xw + ctx.xp.matmul(h_prev, spec.rt[d]) + spec.rb[d])),)

    y, y_h = _recurrence(ctx, spec, x, w, b, sequence_lens, [initial_h], cell)
    return y, y_h
