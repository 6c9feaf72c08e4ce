"""dsp-triton's decode kernels in bfloat16, compiled by Triton and launched on the GPU.

DSP's device runtime holds its buffers as CuPy arrays, and CuPy has no bfloat16, so a bf16
model cannot run end to end on the GPU yet (its slots go to the reference on the CPU). The
kernels themselves are generated for bf16 like for fp16: each fusion group's kernel is
compiled for the GPU and launched on torch tensors holding the reference's own inputs (with
their real strides), and its outputs are compared with the reference's, which numpy computed
in bf16 (ml_dtypes: fp32 arithmetic, rounded once per op). Shapes: the skinny product
(rows 1..16, K and N not multiples of any block) with its epilogue and with a norm as its
prologue; decode attention with GQA ratios 1, 3 and 4 at valid lengths 1, 255, 257, L-1 and L,
in one program per head and split over the KV positions.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "triton_interp"))

# bf16 keeps 8 significant bits (fp16 11): one rounding is up to 2**-8 = 0.0039 of the value.
# The reference rounds after every op (product, bias, activation, residual); the kernel once,
# at its store: three roundings apart is 0.012 of the output's scale.
BF16_TOLERANCE = 2e-2


def _check(model: dsp.CompiledModel, feeds: dict[str, np.ndarray], template: str) -> list[Any]:
    import interpret_check as ic

    results = ic.check_model(model, feeds, tolerance=BF16_TOLERANCE, device="cuda")
    bad = [r for r in results if r.status != "ok"]
    assert not bad, [(r.template, r.ops, r.status, r.detail[:2000]) for r in bad]
    ran = [r for r in results if r.template == template]
    assert ran, f"no {template} group: {[(r.template, r.ops) for r in results]}"
    return results


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype("bfloat16")


def _product_model(m: int, k: int, n: int, residual: bool) -> dsp.CompiledModel:
    rng = np.random.default_rng(m * 1000 + k + n)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "bfloat16", [1, m, k])
    w = g.constant(_bf16(rng.standard_normal((k, n)) / np.sqrt(k)), name="w")
    b = g.constant(_bf16(rng.standard_normal((n,))), name="b")
    y = g.Relu(x @ w + b)
    if residual:
        y = y + g.placeholder("r", "bfloat16", [1, m, n])
    g.output(y, "y")
    return dsp.compile(g.build(), mode="slot_by_slot")


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("k, n", [(333, 70), (1000, 130), (64, 1030)])
def test_bf16_products_with_their_epilogue_match_the_reference(m: int, k: int, n: int) -> None:
    """One kernel: the product of rows 1..16, its bias, Relu and residual add, stored once in bf16."""
    rng = np.random.default_rng(7)
    feeds = {"x": _bf16(rng.standard_normal((1, m, k))), "r": _bf16(rng.standard_normal((1, m, n)))}
    results = _check(_product_model(m, k, n, residual=True), feeds, "product")
    product = next(r for r in results if r.template == "product")
    assert {"MatMul", "Add", "Relu"} <= set(product.ops), product.ops


def _norm_model(m: int, k: int, n: int, norm: str) -> dsp.CompiledModel:
    rng = np.random.default_rng(m + k + n)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "bfloat16", [1, m, k])
    gamma = g.constant(_bf16(1 + 0.1 * rng.standard_normal(k)), name="gamma")
    if norm == "rms":
        h = g.op("RMSNormalization", x, gamma, axis=-1, epsilon=1e-6)
    else:
        beta = g.constant(_bf16(0.1 * rng.standard_normal(k)), name="beta")
        h = g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)
    w = g.constant(_bf16(rng.standard_normal((k, n)) / np.sqrt(k)), name="w")
    g.output(h @ w, "y")
    return dsp.compile(g.build(), mode="slot_by_slot")


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("m, k, n", [(1, 517, 96), (5, 1000, 130), (16, 200, 72)])
def test_bf16_norm_as_the_product_prologue_matches_the_reference(m: int, k: int, n: int, norm: str) -> None:
    rng = np.random.default_rng(11)
    results = _check(_norm_model(m, k, n, norm), {"x": _bf16(rng.standard_normal((1, m, k)))}, "product")
    product = next(r for r in results if r.template == "product")
    assert any(op.endswith("Normalization") for op in product.ops), product.ops


@pytest.mark.parametrize("splits", ["1", "4", "16"])
def test_bf16_decode_attention_matches_the_reference(splits: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA ratios 1, 3, 4; valid lengths 1, 255, 257, L-1, L; one kernel per head, or partials over
    ``splits`` ranges of KV positions and their combine kernel."""
    import attention_graphs as ag

    monkeypatch.setenv("DSP_TRITON_ATTENTION", "1")
    monkeypatch.setenv("DSP_TRITON_KV_SPLITS", splits)
    for heads, kv, length, valid, dim in ag.CASES:
        feeds = ag.feeds(heads, kv, length, valid, dim, "bfloat16")
        model = ag.model(heads, kv, length, dim, "slot_by_slot", "bfloat16")
        _check(model, feeds, "decode_attention")
