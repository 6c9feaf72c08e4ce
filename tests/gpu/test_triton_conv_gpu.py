"""dsp-triton's convolution groups on a GPU: cuDNN without the bias, the bias and the pointwise ops
after it as one generated kernel; equal to the reference while replaying, fewer kernels a call.

Run on the GPU image: ``python -m pytest -q tests/gpu/test_triton_conv_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.testing.models import residual_conv_block

from .fused_checks import fusion_reports, replays_match

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOL = {"float16": 2e-2, "float32": 1e-4}


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_conv_group_adds_its_bias_in_its_epilogue_kernel_and_matches_the_reference(dtype: str, batch: int) -> None:
    graph = residual_conv_block(dtype, channels=16, size=14, batch=batch, seed=batch)
    ref = dsp.compile(graph, mode="slot_by_slot")
    model = dsp.compile(graph, mode="triton", strict=True)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((batch, 16, 14, 14)).astype(dtype)} for _ in range(3)]
    replays_match(model, ref, feeds, TOL[dtype])
    convs = [r for r in fusion_reports(model) if r["template"] == "conv"]
    fused = [r for r in convs if r["status"] == "triton"]
    assert len(fused) == 2, convs  # Conv+Relu and Conv+Add+Relu
    assert all("cuDNN without its bias" in r["reason"] for r in fused)
    # the third conv's output is also a graph output: cuDNN adds its bias, its group runs its steps
    (kept,) = [r for r in convs if r["status"] != "triton"]
    assert "read outside its group" in kept["reason"]


def test_switched_off_the_same_outputs_and_no_conv_group(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = residual_conv_block("float16", channels=16, size=14, batch=2)
    x = {"x": np.random.default_rng(2).standard_normal((2, 16, 14, 14)).astype(np.float16)}
    on = dsp.compile(graph, mode="triton", strict=True)
    for _ in range(6):
        fused = on.run(x)
    monkeypatch.setenv("DSP_TRITON_CONV_EPILOGUE", "0")
    off = dsp.compile(graph, mode="triton", strict=True)
    for _ in range(6):
        plain = off.run(x)
    assert not [r for r in fusion_reports(off) if r["template"] == "conv"]
    for name in plain:
        np.testing.assert_allclose(fused[name].astype(np.float32), plain[name].astype(np.float32), rtol=2e-2, atol=2e-2)


def test_the_fixture_cnn_runs_its_batch_norms_in_generated_kernels_and_matches_the_reference() -> None:
    """The fixture CNN keeps its BatchNormalization nodes (not folded by its exporter): each is a
    per-channel op of a generated kernel with the ops after it, replaying, equal to the reference."""
    path = FIXTURES / "cnn.onnx"
    ref = dsp.compile(path, mode="slot_by_slot")
    model = dsp.compile(path, mode="triton", strict=True)
    rng = np.random.default_rng(3)
    feeds = [{"input": rng.standard_normal((b, 3, 32, 32)).astype(np.float32)} for b in (2, 2, 2)]
    wants = [ref.run(f) for f in feeds]
    for i in range(10):
        got = model.run(feeds[i % 3])
        for name, want in wants[i % 3].items():
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=f"call {i} {name}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    plan = model.plan()
    assert plan is not None
    bns = [r for r in fusion_reports(model) if any(plan.slots[s].op == "BatchNormalization" for s in r["slots"])]
    assert len(bns) == 3 and all(r["status"] == "triton" for r in bns), bns
