"""dsp-triton's flash attention on a GPU: an encoder's attention (scores, scale, padding mask,
softmax, the weighted sum, the heads' transpose and merge) as one generated kernel, equal to the
reference while replaying; switched off, the same outputs from cuBLAS and separate kernels.

Run on the GPU image: ``python -m pytest -q tests/gpu/test_triton_attention_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import dsp_core as dsp
from dsp_core.ir.onnx_export import to_onnx
from dsp_core.testing.models import encoder_attention, encoder_attention_feeds

from .fused_checks import fusion_reports, replays_match

TOL = {"float16": 2e-2, "float32": 1e-4}


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")


def _model(tmp_path: Path, dtype: str, batch: int, seq: int, heads: int, head_dim: int) -> Path:
    path = tmp_path / f"attention_{dtype}_{batch}_{seq}.onnx"
    onnx.save(to_onnx(encoder_attention(dtype, batch=batch, seq=seq, heads=heads, head_dim=head_dim)), path)
    return path


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    ("batch", "seq", "heads", "head_dim"),
    [(1, 128, 12, 32), (8, 128, 12, 32), (3, 40, 2, 64), (2, 200, 4, 16), (1, 512, 12, 64)],
)
def test_an_encoder_attention_is_one_kernel_and_matches_the_reference(
    tmp_path: Path, dtype: str, batch: int, seq: int, heads: int, head_dim: int
) -> None:
    path = _model(tmp_path, dtype, batch, seq, heads, head_dim)
    ref = dsp.compile(path, mode="slot_by_slot")
    model = dsp.compile(path, mode="triton", strict=True)
    feeds = [
        encoder_attention_feeds(dtype, batch=batch, seq=seq, heads=heads, head_dim=head_dim, seed=s) for s in (1, 2, 3)
    ]
    replays_match(model, ref, feeds, TOL[dtype])
    (att,) = [r for r in fusion_reports(model) if r["template"] == "decode_attention"]
    assert att["status"] == "triton", att
    assert att["kernel"].startswith("dsp_attn_"), att
    assert set(att["config"]) == {"block_m", "block_l", "num_warps"}, att  # the flash template's, tuned


def test_switched_off_the_same_outputs_and_no_attention_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model(tmp_path, "float16", 2, 64, 4, 32)
    feeds = [encoder_attention_feeds("float16", batch=2, seq=64, heads=4, head_dim=32)]
    on = dsp.compile(path, mode="triton", strict=True)
    for _ in range(6):
        fused = on.run(feeds[0])
    monkeypatch.setenv("DSP_TRITON_FLASH_ATTENTION", "0")
    off = dsp.compile(path, mode="triton", strict=True)
    replays_match(off, dsp.compile(path, mode="slot_by_slot"), feeds, TOL["float16"])
    assert not [r for r in fusion_reports(off) if r["template"] == "decode_attention"]
    plain = off.run(feeds[0])
    np.testing.assert_allclose(fused["y"].astype(np.float32), plain["y"].astype(np.float32), rtol=2e-2, atol=2e-2)
