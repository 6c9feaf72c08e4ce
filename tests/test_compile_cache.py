"""dsp.compile through the disk cache: warm starts, self-healing, concurrency, switches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES

import dsp_core as dsp

GPT2 = FIXTURES / "gpt2_eager.onnx"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _feeds(model, step: int = 1) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    return {n: golden[f"step{step}.{n}"] for n in model.input_names}


def test_warm_start_loads_the_plan_and_matches(cache_dir: Path) -> None:
    cold = dsp.compile(GPT2)
    assert cold.stats.disk_writes == 1 and cold.stats.disk_hits == 0
    warm = dsp.compile(GPT2)
    assert warm.stats.disk_hits == 1
    assert warm._graph is None  # the ONNX file was not even parsed
    assert warm.plan().content_hash == cold.plan().content_hash
    feeds = _feeds(warm)
    for name, value in cold.run(feeds).items():
        np.testing.assert_array_equal(warm.run(feeds)[name], value)
    assert (cache_dir / "weights").is_dir() and any((cache_dir / "weights").iterdir())


def test_force_recompile_and_disabled_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dsp.compile(GPT2)
    assert dsp.compile(GPT2, force_recompile=True).stats.disk_hits == 0
    monkeypatch.setenv("DSP_FORCE_RECOMPILE", "1")
    assert dsp.compile(GPT2).stats.disk_hits == 0
    monkeypatch.delenv("DSP_FORCE_RECOMPILE")
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    model = dsp.compile(GPT2)
    assert model.stats.disk_hits == 0 and model.stats.disk_writes == 0


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _reference_outputs() -> dict[str, np.ndarray]:
    model = dsp.compile(GPT2, mode="slot_by_slot")
    return model.run(_feeds(model))


def test_corrupt_plan_entry_is_quarantined_and_recompiled(cache_dir: Path) -> None:
    reference = _reference_outputs()
    _flip_middle_byte(max((cache_dir / "objects").iterdir(), key=lambda p: p.stat().st_size))
    model = dsp.compile(GPT2)
    assert model.stats.disk_hits == 0 and model.stats.quarantines >= 1
    assert any((cache_dir / "quarantine").iterdir())
    for name, value in model.run(_feeds(model)).items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-6, atol=1e-6)
    assert dsp.compile(GPT2).stats.disk_hits == 1  # rewritten after the recompile


def test_damaged_weight_is_quarantined_read_from_the_model_and_healed(cache_dir: Path) -> None:
    reference = _reference_outputs()
    victim = max((cache_dir / "weights").iterdir(), key=lambda p: p.stat().st_size)
    _flip_middle_byte(victim)
    model = dsp.compile(GPT2)
    assert model.stats.disk_hits == 1 and model.stats.quarantines == 1
    assert any((cache_dir / "quarantine").iterdir())
    for name, value in model.run(_feeds(model)).items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-6, atol=1e-6)
    healed = dsp.compile(GPT2)  # the weight was written back from the model
    assert healed.stats.disk_hits == 1 and healed.stats.quarantines == 0 and healed._graph is None


def test_edited_model_file_misses(cache_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(GPT2.read_bytes())
    dsp.compile(path)
    assert dsp.compile(path).stats.disk_hits == 1
    os.utime(path, ns=(1, 1))  # a new mtime, the same bytes: the same model (identity is content)
    assert dsp.compile(path).stats.disk_hits == 1
    edited = onnx.load(str(path))
    edited.doc_string = "edited"
    path.write_bytes(edited.SerializeToString())
    assert dsp.compile(path).stats.disk_hits == 0


_WORKER = """
import json, sys, numpy as np, dsp_core as dsp
golden = np.load(sys.argv[2])
model = dsp.compile(sys.argv[1])
feeds = {n: golden["step1." + n] for n in model.input_names}
out = model.run(feeds)["logits"]
ok = bool(np.allclose(out, golden["step1.logits"], rtol=1e-4, atol=1e-4))
print(json.dumps({"ok": ok, "stats": model.stats.as_dict()}))
"""


def test_two_processes_compile_the_same_model_at_once(cache_dir: Path) -> None:
    env = {**os.environ, "DSP_CACHE_DIR": str(cache_dir)}
    args = [sys.executable, "-c", _WORKER, str(GPT2), str(FIXTURES / "gpt2_eager.golden.npz")]
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in results)
    assert all(r["stats"]["quarantines"] == 0 for r in results)
    [build] = list((cache_dir / "refs").iterdir())  # one build's directory of refs, holding one ref
    assert len(list(build.iterdir())) == 1
    assert len(list((cache_dir / "objects").iterdir())) == 1
    assert not (cache_dir / "quarantine").exists() or not any((cache_dir / "quarantine").iterdir())


def test_evicted_weight_is_read_from_the_model_not_recompiled(cache_dir: Path) -> None:
    cold = dsp.compile(GPT2)
    for weight in (cache_dir / "weights").iterdir():
        weight.unlink()  # as if the size bound had evicted them
    warm = dsp.compile(GPT2)
    assert warm.stats.disk_hits == 1 and warm.stats.quarantines == 0
    assert any((cache_dir / "weights").iterdir())  # written back for the next start
    feeds = _feeds(warm)
    for name, value in cold.run(feeds).items():
        np.testing.assert_array_equal(warm.run(feeds)[name], value)
