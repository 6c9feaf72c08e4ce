"""Weight stamps: a warm start trusts a cached weight file only while its stat signature is
the one DSP recorded when it last knew the file's bytes (docs/cache.md, "What a stamp
catches"); any change through the file system is hashed in full and, if damaged, quarantined.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CACHE_X, weight_matmul_expected, weight_matmul_model
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.cache import disk
from dsp_core.cache.disk import DiskCache


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DSP_CACHE_VERIFY_WEIGHTS", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte lengths of every weight file's bytes hashed by the cache."""
    seen: list[int] = []
    real = disk.weight_digest
    monkeypatch.setattr(disk, "weight_digest", lambda data: seen.append(memoryview(data).nbytes) or real(data))
    return seen


@pytest.fixture
def warm(cache_dir: Path, tmp_path: Path) -> Path:
    """A model compiled once into the cache: its weight file written and stamped by the writer."""
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_matmul_model(1.0).SerializeToString())
    assert dsp.compile(path).stats.disk_writes == 1
    return path


def _y(model: dsp.CompiledModel) -> np.ndarray:
    return model.run({"x": CACHE_X})["y"]


def _weight_file(cache_dir: Path) -> Path:
    [path] = list((cache_dir / "weights").iterdir())
    return path


def _stamp_of(weight: Path) -> Path:
    return weight.parent.parent / "stamps" / (weight.name.removesuffix(".dspw") + ".stamp")


def _rewrite_keeping_size_and_times(path: Path, offset: int) -> None:
    """Flip one byte in place, then put mtime back (cp -p, rsync -t do as much): only ctime moves."""
    st = path.stat()
    time.sleep(0.02)  # past the file system's timestamp tick
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def test_warm_start_does_not_rehash_an_unchanged_weight_file(warm: Path, hashed: list[int]) -> None:
    for _ in range(2):
        model = dsp.compile(warm)
        assert model.stats.disk_hits == 1 and model.stats.quarantines == 0
        np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)
    assert hashed == []


def test_a_weight_changed_with_its_mtime_kept_is_hashed_and_quarantined(
    cache_dir: Path, warm: Path, hashed: list[int]
) -> None:
    victim = _weight_file(cache_dir)
    _rewrite_keeping_size_and_times(victim, victim.stat().st_size - 100)
    model = dsp.compile(warm)
    assert hashed == [128 * 256 * 4]  # the stamp no longer matched: the bytes were checked, and failed
    assert model.stats.disk_hits == 1 and model.stats.quarantines == 1
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)  # read from the model
    healed = dsp.compile(warm)  # written back and stamped by its writer: trusted again
    assert healed.stats.quarantines == 0 and hashed == [128 * 256 * 4]


def test_a_write_while_a_start_reads_the_file_is_hashed(
    cache_dir: Path, warm: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = _weight_file(cache_dir)
    real = disk._read_exactly

    def read_then_damage(f: object, n: int) -> object:
        data = real(f, n)  # type: ignore[arg-type]
        _rewrite_keeping_size_and_times(victim, victim.stat().st_size - 100)  # lands after the read's fstat
        return data

    monkeypatch.setattr(disk, "_read_exactly", read_then_damage)
    model = dsp.compile(warm)
    assert hashed == [128 * 256 * 4]  # the signature moved during the read: the stamp was not trusted
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)  # the bytes read were good
    monkeypatch.setattr(disk, "_read_exactly", real)
    assert dsp.compile(warm).stats.quarantines == 1  # and the damage is caught by the next start


@pytest.mark.parametrize("how", ["truncate", "append", "replace"])
def test_any_other_change_of_the_file_is_hashed(cache_dir: Path, warm: Path, hashed: list[int], how: str) -> None:
    victim = _weight_file(cache_dir)
    data = victim.read_bytes()
    if how == "truncate":
        os.truncate(victim, len(data) - 1)
    elif how == "append":
        victim.write_bytes(data + b"x")
    else:  # a good copy under a new inode: not what the stamp names, so hashed (and accepted)
        victim.unlink()
        victim.write_bytes(data)
    model = dsp.compile(warm)
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)
    if how == "replace":
        assert hashed == [len(data) - 32] and model.stats.quarantines == 0
    else:  # the size check refuses it before any hashing
        assert model.stats.quarantines == 1


def test_stamp_of_another_boot_is_not_trusted(
    cache_dir: Path, warm: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "boot_id", lambda: "another-boot")
    dsp.compile(warm)
    assert hashed == [128 * 256 * 4]


@pytest.mark.parametrize("damage", ["check", "signature", "garbage", "empty", "dir", "symlink"])
def test_damaged_stamp_is_ignored(cache_dir: Path, warm: Path, hashed: list[int], damage: str) -> None:
    stamp = _stamp_of(_weight_file(cache_dir))
    record = json.loads(stamp.read_text())
    stamp.unlink()
    if damage == "check":
        stamp.write_text(json.dumps({**record, "check": "0" * 32}))
    elif damage == "signature":  # another inode, check left as it was
        stamp.write_text(json.dumps({**record, "signature": record["signature"][:2] + [1] + record["signature"][3:]}))
    elif damage == "garbage":
        stamp.write_bytes(b"\x00\xff{not json")
    elif damage == "empty":
        stamp.write_bytes(b"")
    elif damage == "dir":
        stamp.mkdir()
    else:
        (stamp.parent / "elsewhere").write_text(json.dumps(record))
        stamp.symlink_to(stamp.parent / "elsewhere")
    model = dsp.compile(warm)
    np.testing.assert_allclose(_y(model), weight_matmul_expected(1.0), rtol=1e-5)
    assert hashed == [128 * 256 * 4] and model.stats.quarantines == 0


def test_verify_weights_always_hashes_every_start(
    cache_dir: Path, warm: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_CACHE_VERIFY_WEIGHTS", "always")
    dsp.compile(warm)
    dsp.compile(warm)
    assert hashed == [128 * 256 * 4] * 2


def test_verify_weights_rejects_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_CACHE_VERIFY_WEIGHTS", "sometimes")
    with pytest.raises(dsp.DSPError, match="DSP_CACHE_VERIFY_WEIGHTS"):
        DiskCache.from_config()


def test_a_change_that_keeps_the_signature_is_caught_by_cache_verify(
    cache_dir: Path, warm: Path, hashed: list[int]
) -> None:
    """What a stamp cannot see (bit rot under the file system, simulated by re-stamping a damaged
    file) a start trusts, as docs/cache.md says; ``dsp cache verify`` hashes every file and finds it."""
    victim = _weight_file(cache_dir)
    _rewrite_keeping_size_and_times(victim, victim.stat().st_size - 100)
    cache = DiskCache.from_config()
    cache._stamp_weight(victim, victim.stat())  # as if the bytes had changed below the file system
    damaged = dsp.compile(warm)
    assert hashed == [] and damaged.stats.quarantines == 0
    report = DiskCache.from_config().verify()
    assert [p["path"] for p in report["problems"]] == [str(victim)] and "digest" in report["problems"][0]["reason"]
    assert not victim.exists() and not _stamp_of(victim).exists()
    np.testing.assert_allclose(_y(dsp.compile(warm)), weight_matmul_expected(1.0), rtol=1e-5)


def test_a_hashed_settled_file_is_stamped(
    cache_dir: Path, warm: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "RACY_NS", 1_000_000_000)  # long enough for the first start to fall inside it
    victim = _weight_file(cache_dir)
    _stamp_of(victim).unlink()  # say the writer could not stamp it
    old = time.time() - 60
    os.utime(victim, (old, old))  # mtime a minute back; ctime is now: not settled yet
    dsp.compile(warm)
    assert hashed == [128 * 256 * 4] and not _stamp_of(victim).exists()
    _settle(victim)
    dsp.compile(warm)
    dsp.compile(warm)
    assert hashed == [128 * 256 * 4] * 2 and _stamp_of(victim).exists()  # hashed once more, then trusted


def _settle(path: Path) -> None:
    """Wait until the file's ctime is older than the racy window (kept short by the test)."""
    while time.time_ns() - path.stat().st_ctime_ns <= disk.RACY_NS:
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _short_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "RACY_NS", 100_000_000)


def test_lru_touch_is_hourly_and_keeps_the_stamp(cache_dir: Path, warm: Path, hashed: list[int]) -> None:
    victim = _weight_file(cache_dir)
    before = victim.stat().st_mtime_ns
    dsp.compile(warm)
    assert victim.stat().st_mtime_ns == before and hashed == []  # read within the hour: not touched
    two_hours_ago = time.time() - 7200
    os.utime(victim, (two_hours_ago, two_hours_ago))  # moves ctime: the stamp no longer matches
    dsp.compile(warm)  # hashed (changed), then touched: a use moves it up the LRU order, stamped anew
    assert hashed == [128 * 256 * 4] and victim.stat().st_mtime > time.time() - 60
    dsp.compile(warm)
    assert hashed == [128 * 256 * 4]


def test_stamps_go_with_their_weights(cache_dir: Path, warm: Path) -> None:
    victim = _weight_file(cache_dir)
    stamp = _stamp_of(victim)
    assert stamp.exists()
    victim.unlink()
    (stamp.parent / "junk").write_text("x")
    report = DiskCache.from_config().verify()
    assert report["stale_stamps_removed"] == 2 and not stamp.exists()
    dsp.compile(warm)  # read from the model, written back, stamped
    assert stamp.exists()
    DiskCache.from_config().clear()
    assert not stamp.exists()


def test_evicted_weight_takes_its_stamp(cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tmp_path / "a.onnx"
    first.write_bytes(weight_matmul_model(1.0).SerializeToString())
    dsp.compile(first)
    [old] = list((cache_dir / "weights").iterdir())
    os.utime(old, (1000, 1000))  # least recently used
    monkeypatch.setenv("DSP_CACHE_MAX_BYTES", str(old.stat().st_size + 4096))
    second = tmp_path / "b.onnx"
    second.write_bytes(weight_matmul_model(2.0).SerializeToString())
    dsp.compile(second)
    assert not old.exists() and not _stamp_of(old).exists()
    assert [p.name for p in (cache_dir / "stamps").iterdir()] == [_stamp_of(_weight_file(cache_dir)).name]


def _big_model(path: Path) -> Path:
    """y = x @ W, W 1024x1024 float32 (4 MiB: read into huge-page-advised private memory)."""
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])],
        [numpy_helper.from_array(w, "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping holding ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_warm_weights_live_in_private_anonymous_memory(cache_dir: Path, tmp_path: Path) -> None:
    path = _big_model(tmp_path / "big.onnx")
    x = np.linspace(-1, 1, 1024, dtype=np.float32).reshape(1, 1024)
    expected = dsp.compile(path).run({"x": x})["y"]
    model = dsp.compile(path)
    assert model.stats.disk_hits == 1
    [w] = [a for a in model.plan().constants.values() if a.nbytes == 4 << 20]
    assert not w.flags.writeable
    fields = _mapping_of(w.__array_interface__["data"][0]).split()
    assert len(fields) == 5 or fields[5].startswith("["), f"a file-backed mapping: {fields}"  # no path: anonymous
    assert "s" not in fields[1], f"a shared mapping: {fields}"
    np.testing.assert_array_equal(model.run({"x": x})["y"], expected)


@pytest.fixture
def split_reads(monkeypatch: pytest.MonkeyPatch) -> int:
    """Reads split among threads from 64 KiB on (32 MiB in use), as many parts as cores allow (at least 2 here)."""
    monkeypatch.setattr(disk, "_PARALLEL_READ", 1 << 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    return 1 << 20


def test_a_split_read_gives_the_bytes_and_leaves_the_file_after_them(tmp_path: Path, split_reads: int) -> None:
    data = np.random.default_rng(1).integers(0, 256, split_reads + 4096, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as f:
        f.seek(100)
        got = disk._read_exactly(f, split_reads)  # type: ignore[arg-type]
        assert got is not None and bytes(got) == data[100 : 100 + split_reads]
        assert f.tell() == 100 + split_reads
        f.seek(len(data) - 10)
        assert disk._read_exactly(f, split_reads) is None  # type: ignore[arg-type]  # the file ends first


def test_an_io_error_in_a_split_read_is_raised_not_taken_for_damage(
    tmp_path: Path, split_reads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(split_reads))
    real = os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset >= split_reads // 2:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with open(path, "rb", buffering=0) as f, pytest.raises(OSError, match="Input/output"):
        disk._read_exactly(f, split_reads)  # type: ignore[arg-type]
