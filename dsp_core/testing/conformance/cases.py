"""The conformance kit's graphs: small builder graphs and fresh random feeds for each.

Each case is one graph (weights drawn once, from a fixed seed, so the graph is the same
in every run) and a feed maker that draws new input values from the generator the test
passes (a fresh seed per run: see the kit's ``--dsp-seed``). ``variable`` names an input
the drift test may mark VARIABLE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Case:
    """One conformance graph: how to build it, how to draw its feeds, which input may be variable."""

    name: str
    build: Callable[[], Graph]
    feeds: Callable[[np.random.Generator], Feeds]
    variable: str | None = None
    doc: str = ""


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _weights(*shape: int, seed: int = 7, scale: float = 0.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _ints(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# -- graphs -----------------------------------------------------------------------------------
def _elementwise() -> Graph:
    g = GraphBuilder("kit_elementwise")
    x = g.placeholder("x", "float32", ["batch", 16])
    y = g.placeholder("y", "float32", ["batch", 16])
    z = g.Sigmoid(x * y + x) - g.Tanh(y)
    g.output(g.Sqrt(g.Abs(z)) * 2.0 + g.Exp(g.Neg(g.Abs(y))) / (g.Abs(x) + 1.0), "out")
    return g.build()


def _mlp() -> Graph:
    g = GraphBuilder("kit_mlp")
    x = g.placeholder("x", "float32", ["batch", 8])
    h = g.Relu(g.MatMul(x, g.constant(_weights(8, 16), name="w1")) + g.constant(_weights(16, seed=8), name="b1"))
    g.output(
        g.Relu(g.MatMul(h, g.constant(_weights(16, 4, seed=9), name="w2")) + g.constant(_weights(4), name="b2")), "y"
    )
    return g.build()


def _softmax() -> Graph:
    g = GraphBuilder("kit_softmax")
    x = g.placeholder("x", "float32", ["batch", 8])
    g.output(g.Softmax(g.MatMul(x, g.constant(_weights(8, 12, scale=1.0), name="w")), axis=-1), "p")
    return g.build()


def _layernorm() -> Graph:
    g = GraphBuilder("kit_layernorm")
    x = g.placeholder("x", "float32", ["batch", 6, 16])
    scale = g.constant(1.0 + _weights(16, scale=0.1), name="gamma")
    bias = g.constant(_weights(16, seed=3, scale=0.1), name="beta")
    g.output(g.LayerNormalization(x, scale, bias, axis=-1, epsilon=1e-5), "y")
    return g.build()


def _reshape_transpose() -> Graph:
    g = GraphBuilder("kit_reshape_transpose")
    x = g.placeholder("x", "float32", [2, 3, 8])
    r = g.Reshape(x, g.constant(_ints(2, 3, 2, 4), name="shape4"))
    t = g.Transpose(r, perm=[0, 2, 1, 3])
    u = g.Unsqueeze(g.Reshape(t, g.constant(_ints(2, -1), name="shape2")), g.constant(_ints(0), name="axes0"))
    g.output(g.Squeeze(u, g.constant(_ints(0), name="axes_sq")) * 3.0, "y")
    return g.build()


def _concat_slice() -> Graph:
    g = GraphBuilder("kit_concat_slice")
    x = g.placeholder("x", "float32", ["batch", 6])
    y = g.placeholder("y", "float32", ["batch", 4])
    c = g.Concat(x, y, axis=1)
    s = g.Slice(
        c, g.constant(_ints(1), name="starts"), g.constant(_ints(9), name="ends"), g.constant(_ints(1), name="axes")
    )
    g.output(s * s, "y2")
    g.output(g.Concat(s, x, axis=-1), "cat")
    return g.build()


def _gather() -> Graph:
    g = GraphBuilder("kit_gather")
    table = g.placeholder("table", "float32", [10, 5])
    ids = g.placeholder("ids", "int64", ["n"])
    rows = g.Gather(table, ids, axis=0)
    cols = g.Gather(rows, g.constant(_ints(4, 0, 2), name="cols"), axis=1)
    g.output(cols + 1.0, "picked")
    return g.build()


def _reduce() -> Graph:
    g = GraphBuilder("kit_reduce")
    x = g.placeholder("x", "float32", ["batch", 5, 7])
    mean = g.ReduceMean(x, g.constant(_ints(1), name="ax1"), keepdims=1)
    total = g.ReduceSum(x - mean, g.constant(_ints(-1), name="axlast"), keepdims=0)
    g.output(mean, "mean")
    g.output(total, "total")
    return g.build()


def _where_compare() -> Graph:
    g = GraphBuilder("kit_where_compare")
    x = g.placeholder("x", "float32", ["batch", 9])
    y = g.placeholder("y", "float32", ["batch", 9])
    picked = g.Where(g.Greater(x, y), x, y * 2.0)
    g.output(picked, "picked")
    g.output(g.Or(g.Less(x, g.constant(np.float32(-0.5))), g.Equal(g.Sign(x), g.Sign(y))), "mask")
    return g.build()


def _cast() -> Graph:
    g = GraphBuilder("kit_cast")
    x = g.placeholder("x", "float32", ["batch", 8])
    as_int = g.Cast(x * 10.0, to=TensorProto.INT64)
    back = g.Cast(as_int, to=TensorProto.FLOAT)
    g.output(as_int, "as_int")
    g.output(back - x, "err")
    g.output(g.Cast(g.Greater(x, g.constant(np.float32(0.0))), to=TensorProto.FLOAT), "positive")
    return g.build()


def _attention() -> Graph:
    g = GraphBuilder("kit_attention")
    q = g.placeholder("q", "float32", ["batch", 6, 8])
    k = g.placeholder("k", "float32", ["batch", 6, 8])
    v = g.placeholder("v", "float32", ["batch", 6, 8])
    scores = g.MatMul(q, g.Transpose(k, perm=[0, 2, 1])) * float(1 / np.sqrt(8))
    g.output(g.MatMul(g.Softmax(scores, axis=-1), v), "ctx")
    return g.build()


def _residual_block() -> Graph:
    g = GraphBuilder("kit_residual_block")
    x = g.placeholder("x", "float32", ["batch", 4, 8])
    h = g.Relu(g.MatMul(x, g.constant(_weights(8, 16, seed=11), name="up")))
    y = x + g.MatMul(h, g.constant(_weights(16, 8, seed=12), name="down"))
    ln = g.LayerNormalization(
        y, g.constant(np.ones(8, np.float32), name="ln_g"), g.constant(np.zeros(8, np.float32), name="ln_b")
    )
    g.output(ln, "out")
    return g.build()


def _broadcast_expand() -> Graph:
    g = GraphBuilder("kit_broadcast_expand")
    x = g.placeholder("x", "float32", ["batch", 1, 5])
    e = g.Expand(x, g.constant(_ints(1, 3, 5), name="to"))
    g.output(
        g.Max(e, g.constant(_weights(3, 1, seed=4), name="col")) + g.ReduceMax(e, g.constant(_ints(2), name="ax2")), "y"
    )
    return g.build()


# -- feeds ------------------------------------------------------------------------------------
CASES: tuple[Case, ...] = (
    Case(
        "elementwise_chain",
        _elementwise,
        lambda r: {"x": _normal(r, 3, 16), "y": _normal(r, 3, 16)},
        "y",
        "Sigmoid, Tanh, Sqrt, Abs, Exp, Neg and the four arithmetic ops",
    ),
    Case("matmul_add_relu", _mlp, lambda r: {"x": _normal(r, 4, 8)}, "x", "a two-layer MLP"),
    Case("softmax", _softmax, lambda r: {"x": _normal(r, 3, 8)}, None, "MatMul then Softmax over the last axis"),
    Case("layernorm", _layernorm, lambda r: {"x": _normal(r, 2, 6, 16)}, None, "LayerNormalization over the last axis"),
    Case(
        "reshape_transpose",
        _reshape_transpose,
        lambda r: {"x": _normal(r, 2, 3, 8)},
        None,
        "Reshape, Transpose, Unsqueeze, Squeeze",
    ),
    Case(
        "concat_slice",
        _concat_slice,
        lambda r: {"x": _normal(r, 3, 6), "y": _normal(r, 3, 4)},
        None,
        "Concat and Slice, two outputs",
    ),
    Case(
        "gather",
        _gather,
        lambda r: {"table": _normal(r, 10, 5), "ids": r.integers(0, 10, size=7).astype(np.int64)},
        "table",
        "Gather of rows by fed int64 ids, then of constant columns",
    ),
    Case("reduce", _reduce, lambda r: {"x": _normal(r, 2, 5, 7)}, None, "ReduceMean (keepdims) and ReduceSum"),
    Case(
        "where_compare",
        _where_compare,
        lambda r: {"x": _normal(r, 4, 9), "y": _normal(r, 4, 9)},
        None,
        "Where, Greater, Less, Equal, Or, Sign; a bool output",
    ),
    Case("cast", _cast, lambda r: {"x": _normal(r, 3, 8)}, None, "Cast float32 -> int64 -> float32, bool -> float32"),
    Case(
        "attention",
        _attention,
        lambda r: {"q": _normal(r, 2, 6, 8), "k": _normal(r, 2, 6, 8), "v": _normal(r, 2, 6, 8)},
        "k",
        "scaled dot-product attention: MatMul, Transpose, Softmax",
    ),
    Case(
        "residual_block",
        _residual_block,
        lambda r: {"x": _normal(r, 2, 4, 8)},
        "x",
        "MatMul, Relu, residual Add, LayerNormalization",
    ),
    Case(
        "broadcast_expand",
        _broadcast_expand,
        lambda r: {"x": _normal(r, 2, 1, 5)},
        None,
        "Expand, broadcasting Max, ReduceMax",
    ),
)

CASES_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
VARIABLE_CASES: tuple[Case, ...] = tuple(c for c in CASES if c.variable is not None)
