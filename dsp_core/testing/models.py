"""Synthetic models for tests and benchmarks, built with the GraphBuilder (no ONNX file, no download)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph


def mlp(widths: Sequence[int], seed: int = 0, *, bias: bool = True, tied: bool = False) -> Graph:
    """``x[batch, widths[0]]`` through MatMul (+ bias) + Relu layers of the given widths, output ``y``.

    Weights are standard normal / sqrt(fan-in), float32, from ``seed``; ``tied`` makes the
    last layer reuse the first layer's weight (a constant two layers read).
    """
    rng = np.random.default_rng(seed)
    g = GraphBuilder()
    h = g.placeholder("x", "float32", ["batch", widths[0]])
    first = None
    last = len(widths) - 2
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        weight = first if tied and i == last and first is not None else g.constant(w, name=f"w{i}")
        first = weight if i == 0 else first
        h = g.MatMul(h, weight)
        if bias:
            h = h + g.constant(rng.standard_normal(b).astype(np.float32), name=f"b{i}")
        h = g.Relu(h)
    g.output(h, "y")
    return g.build()
