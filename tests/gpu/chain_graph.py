"""The graph both GPU plugins' dependent-launch tests replay: a chain of products whose every
kernel reads the one before (a constant weight each, preloaded before the kernel waits)."""

from __future__ import annotations

from typing import Any

import numpy as np

import dsp_core as dsp


def product_chain(rng: np.random.Generator, layers: int = 48, width: int = 768) -> Any:
    """``layers`` products by [width, width] fp16 weights, alternately Tanh and Relu plus a residual."""
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, width])
    h = x
    for layer in range(layers):
        w = g.constant((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float16), name=f"w{layer}")
        h = g.Relu(h @ w) + h if layer % 2 else g.Tanh(h @ w)
    g.output(h, "y")
    return g.build()
