"""The disk cache under faults: stale models, changed or damaged weight files, non-regular
files in place of cache files, and the ref's fingerprint (issue 12, items 1, 2, 10, 11, 12).

Every scenario that could hang or kill the process (a FIFO, /dev/zero, a truncated mapped
file) runs in a child interpreter with a timeout and a memory cap, so a regression fails
the test instead of hanging or killing the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CACHE_X, weight_matmul_expected, weight_matmul_model

import dsp_core as dsp
from dsp_core.cache import disk
from dsp_core.cache.disk import DiskCache
from dsp_core.runtime import loader


def _y(model: dsp.CompiledModel) -> np.ndarray:
    return model.run({"x": CACHE_X})["y"]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _replace_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    """Overwrite ``path`` in place (same inode, same size), then put its times back, as cp -p does."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _quarantined(cache_dir: Path) -> list[str]:
    qdir = cache_dir / "quarantine"
    return sorted(p.name for p in qdir.iterdir() if not p.name.endswith(".reason")) if qdir.exists() else []


# -- item 1: a model's identity is its content ----------------------------------------------
def test_model_replaced_with_same_size_and_mtime_is_not_served_stale(cache_dir: Path, tmp_path: Path) -> None:
    a, b = weight_matmul_model(1.0).SerializeToString(), weight_matmul_model(2.0).SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(a)
    np.testing.assert_allclose(_y(dsp.compile(path)), weight_matmul_expected(1.0), rtol=1e-5)
    assert dsp.compile(path).stats.disk_hits == 1
    _replace_keeping_size_and_mtime(path, b)
    model = dsp.compile(path)
    np.testing.assert_allclose(_y(model), weight_matmul_expected(2.0), rtol=1e-5)
    assert model.stats.disk_hits == 0


def test_digest_memo_is_revalidated_by_ctime(cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the memo trusted at once (no racy window), an in-place replacement still re-hashes."""
    monkeypatch.setattr(disk, "RACY_NS", -(10**18))
    hashed: list[Path] = []
    real = loader._hash_file
    monkeypatch.setattr(loader, "_hash_file", lambda p: hashed.append(p) or real(p))
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_matmul_model(1.0).SerializeToString())
    dsp.compile(path)
    assert dsp.compile(path).stats.disk_hits == 1 and hashed == [path]  # the second start used the memo
    time.sleep(0.05)  # past the file system's timestamp tick, so the rewrite gets a new ctime
    _replace_keeping_size_and_mtime(path, weight_matmul_model(3.0).SerializeToString())
    np.testing.assert_allclose(_y(dsp.compile(path)), weight_matmul_expected(3.0), rtol=1e-5)
    assert hashed == [path, path]


def _external_model(directory: Path, scale: float) -> Path:
    path = directory / "ext.onnx"
    onnx.save_model(
        weight_matmul_model(scale), str(path), save_as_external_data=True, location="ext.bin", size_threshold=0
    )
    return path


def test_changed_external_data_file_is_not_served_stale(cache_dir: Path, tmp_path: Path) -> None:
    path = _external_model(tmp_path, 1.0)
    np.testing.assert_allclose(_y(dsp.compile(path)), weight_matmul_expected(1.0), rtol=1e-5)
    assert dsp.compile(path).stats.disk_hits == 1
    model_bytes = path.read_bytes()
    _replace_keeping_size_and_mtime(tmp_path / "ext.bin", np.full((128, 256), 5.0, np.float32).tobytes())
    assert path.read_bytes() == model_bytes  # the model file itself did not change
    model = dsp.compile(path)
    np.testing.assert_allclose(_y(model), weight_matmul_expected(5.0), rtol=1e-5)
    assert model.stats.disk_hits == 0


def test_bytes_with_base_dir_are_keyed_by_their_external_data(cache_dir: Path, tmp_path: Path) -> None:
    path = _external_model(tmp_path, 1.0)
    data = path.read_bytes()
    np.testing.assert_allclose(_y(dsp.compile(data, base_dir=tmp_path)), weight_matmul_expected(1.0), rtol=1e-5)
    assert dsp.compile(data, base_dir=tmp_path).stats.disk_hits == 1
    _replace_keeping_size_and_mtime(tmp_path / "ext.bin", np.full((128, 256), 7.0, np.float32).tobytes())
    np.testing.assert_allclose(_y(dsp.compile(data, base_dir=tmp_path)), weight_matmul_expected(7.0), rtol=1e-5)


# -- faults that may hang or kill: run in a child with a timeout and a memory cap -------------
_CHILD = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import numpy as np, dsp_core as dsp
from dsp_core.cache.disk import DiskCache
model_path, action = sys.argv[1], sys.argv[2]
x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128)
out = {}
if action == "verify":
    report = DiskCache.from_config().verify()
    out = {"problems": report["problems"], "weights_ok": report.get("weights_ok")}
elif action == "compile":
    model = dsp.compile(model_path)
    out = {"y": model.run({"x": x})["y"].tolist(), "stats": model.stats.as_dict()}
elif action == "live":  # a warm model keeps its weights whatever happens to the files afterwards
    model = dsp.compile(model_path)
    before = model.run({"x": x})["y"]
    weights = os.path.join(os.environ["DSP_CACHE_DIR"], "weights")
    for name in os.listdir(weights):
        with open(os.path.join(weights, name), "r+b") as f:
            f.seek(-4096, 2)
            f.write(b"\\x7f" * 4096)
    after_write = model.run({"x": x})["y"]
    for name in os.listdir(weights):
        os.truncate(os.path.join(weights, name), 0)
    after_truncate = model.run({"x": x})["y"]
    same = bool((before == after_write).all() and (before == after_truncate).all())
    out = {"hits": model.stats.disk_hits, "same": same}
print(json.dumps(out))
"""


def _child(cache_dir: Path, model_path: Path, action: str) -> dict:
    env = {**os.environ, "DSP_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_path), action], env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, f"child exited with {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def warm(cache_dir: Path, tmp_path: Path) -> Path:
    """A model compiled once into the cache (the next compile is a warm start)."""
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_matmul_model(1.0).SerializeToString())
    dsp.compile(path)
    assert dsp.compile(path).stats.disk_hits == 1
    return path


# -- item 2: weights are read into memory DSP owns --------------------------------------------
def test_live_model_survives_weight_file_overwrite_and_truncation(cache_dir: Path, warm: Path) -> None:
    result = _child(cache_dir, warm, "live")
    assert result == {"hits": 1, "same": True}
    model = dsp.compile(warm)  # the damage is found on the next start and healed
    assert model.stats.disk_hits == 1 and model.stats.quarantines == 1
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)
    assert dsp.compile(warm).stats.quarantines == 0


def test_warm_weights_are_private_read_only_arrays(cache_dir: Path, warm: Path) -> None:
    plan = dsp.compile(warm).plan()
    big = [a for a in plan.constants.values() if a.nbytes > 1 << 16]
    assert big and all(type(a) is np.ndarray and not a.flags.writeable for a in big)
    assert all(a.base is None or not isinstance(a.base, np.memmap) for a in big)


# -- item 10: damaged weight files ------------------------------------------------------------
def _weight_file(cache_dir: Path) -> Path:
    [path] = list((cache_dir / "weights").iterdir())
    return path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["empty", "header_byte", "magic", "data_byte", "short", "long"])
def test_damaged_weight_file_is_quarantined_and_healed(cache_dir: Path, warm: Path, how: str) -> None:
    victim = _weight_file(cache_dir)
    size = victim.stat().st_size
    damage = {
        "empty": lambda: victim.write_bytes(b""),
        "header_byte": lambda: _flip(victim, 9),
        "magic": lambda: _flip(victim, 0),
        "data_byte": lambda: _flip(victim, size - 100),
        "short": lambda: os.truncate(victim, size - 1),
        "long": lambda: victim.write_bytes(victim.read_bytes() + b"x"),
    }
    damage[how]()
    report = DiskCache.from_config().verify()
    assert [p["path"] for p in report["problems"]] == [str(victim)] and report["weights_ok"] == 0
    assert not victim.exists() and len(_quarantined(cache_dir)) == 1
    assert dsp.compile(warm).stats.quarantines == 0  # gone: read from the model and written back
    size = victim.stat().st_size
    damage[how]()  # again, for a compile to meet
    model = dsp.compile(warm)
    assert model.stats.disk_hits == 1 and model.stats.quarantines == 1
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)
    healed = dsp.compile(warm)
    assert healed.stats.disk_hits == 1 and healed.stats.quarantines == 0 and healed._graph is None
    assert DiskCache.from_config().verify()["weights_ok"] == 1


def test_cli_verify_reports_a_damaged_weight(cache_dir: Path, warm: Path) -> None:
    victim = _weight_file(cache_dir)
    _flip(victim, victim.stat().st_size // 2)
    proc = subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", "cache", "verify"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DSP_CACHE_DIR": str(cache_dir)},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 weights" in proc.stdout and str(victim) in proc.stdout and "digest" in proc.stdout


# -- item 11: what is not a regular file is refused, never read -------------------------------
def _target(cache_dir: Path, which: str) -> Path:
    sub = {"ref": f"refs/{DiskCache(cache_dir).build}", "object": "objects", "weight": "weights"}[which]
    [path] = list((cache_dir / sub).iterdir())
    return path


def _put_in_place(path: Path, kind: str) -> None:
    data = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink":  # a link to a file with the right bytes is still refused
        elsewhere = path.parent.parent.parent / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        (elsewhere / path.name).write_bytes(data)
        path.symlink_to(elsewhere / path.name)
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_bytes(data)


@pytest.mark.parametrize("kind", ["fifo", "devzero", "symlink", "dir"])
@pytest.mark.parametrize("which", ["ref", "object", "weight"])
def test_non_regular_cache_file_is_refused(cache_dir: Path, warm: Path, which: str, kind: str) -> None:
    victim = _target(cache_dir, which)
    _put_in_place(victim, kind)
    problems = _child(cache_dir, warm, "verify")["problems"]
    assert [p["path"] for p in problems] == [str(victim)] and "not a regular file" in problems[0]["reason"]
    assert not victim.is_symlink() and not victim.exists()  # moved aside
    assert len(_quarantined(cache_dir)) == 1
    dsp.compile(warm, force_recompile=True)  # a whole entry again, then the same fault for a compile to meet
    victim = _target(cache_dir, which)
    _put_in_place(victim, kind)
    result = _child(cache_dir, warm, "compile")
    np.testing.assert_allclose(np.array(result["y"], np.float32), weight_matmul_expected(1.0), rtol=1e-5)
    assert result["stats"]["quarantines"] == 1
    assert result["stats"]["disk_hits"] == (1 if which == "weight" else 0)  # a weight is healed from the model
    assert len(_quarantined(cache_dir)) == 2
    assert dsp.compile(warm).stats.disk_hits == 1  # rewritten: good as new
    assert DiskCache.from_config().verify()["problems"] == []


def test_oversized_ref_is_not_read_whole(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, build_fingerprint="fp")
    cache.put("k", b"payload")
    cache.ref_path("k").write_bytes(b"{" + b" " * (1 << 20))
    assert cache.get("k") is None and cache.stats.quarantines == 1
    assert "more than" in cache.events[-1]["reason"]


# -- item 12: the ref's fingerprint -----------------------------------------------------------
def test_ref_of_another_build_is_a_miss_not_damage(tmp_path: Path) -> None:
    other = DiskCache(tmp_path, build_fingerprint="dsp-core=other")
    other.put("k", b"their plan")
    mine = DiskCache(tmp_path, build_fingerprint="dsp-core=mine")
    assert mine.get("k") is None
    assert mine.stats.quarantines == 0 and mine.stats.misses == 1 and not (tmp_path / "quarantine").exists()
    assert other.get("k") == b"their plan"  # still good for its own environment


def test_ref_whose_fingerprint_disagrees_with_its_object_is_damage(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, build_fingerprint="fp-a")
    obj = cache.put("k", b"a plan")
    assert obj is not None
    obj.write_bytes(disk.encode_entry(b"a plan", "fp-b"))  # same payload, built by another build
    assert cache.get("k") is None and cache.stats.quarantines == 1
    assert "fingerprint" in cache.events[-1]["reason"]


def test_ref_fingerprint_is_checked_against_this_build(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, build_fingerprint="fp-a")
    cache.put("k", b"a plan")
    ref_path = cache.ref_path("k")
    ref = json.loads(ref_path.read_text())
    ref_path.write_text(json.dumps({**ref, "fingerprint": "fp-z"}))  # the object is fp-a's, the ref says fp-z
    # Each build keeps its refs in its own directory: one naming another build there is damage.
    assert cache.get("k") is None and cache.stats.quarantines == 1
    assert "fingerprint mismatch" in cache.events[-1]["reason"]


def test_source_that_cannot_be_read_compiles_without_cache(cache_dir: Path, tmp_path: Path) -> None:
    assert loader.model_key(tmp_path / "missing.onnx", "v") is None
    assert loader.model_key(tmp_path, "v") is None  # a directory: import_model says what is wrong
