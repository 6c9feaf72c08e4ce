"""The on-disk plan cache: round trip, LRU bound, quarantine of every kind of bad entry,
override dir, env configuration, two processes at once, and the `dsp cache` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_cli

from dsp_core.cache import disk
from dsp_core.cache.disk import DiskCache, fnv1a64
from dsp_core.errors import ConfigError

FP = "dsp-core=test;backend=a:dist-a=1;arch=test"
HEADER_SIZE = disk._HEADER.size


def make(root: Path, **kw) -> DiskCache:
    """A cache in ``root`` with a fixed fingerprint (no backend discovery)."""
    return DiskCache(root, build_fingerprint=kw.pop("build_fingerprint", FP), **kw)


def object_path(cache: DiskCache, payload: bytes) -> Path:
    return cache.object_path(payload)


def quarantined(cache: DiskCache) -> list[Path]:
    qdir = cache.root / "quarantine"
    return sorted(p for p in qdir.iterdir() if not p.name.endswith(".reason")) if qdir.exists() else []


# -- basics ---------------------------------------------------------------------------------
def test_fnv1a64_known_values() -> None:
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_fnv1a64_agrees_with_the_plan_serializer() -> None:
    serialize = pytest.importorskip("dsp_core.plan.serialize")
    for data in (b"", b"a", bytes(range(256)) * 3):
        assert serialize.fnv1a64(data) == fnv1a64(data)


def test_key_is_stable_and_boundary_safe() -> None:
    k = DiskCache.key(b"model", "y", "AUTO")
    assert k == DiskCache.key(b"model", "y", "AUTO") and len(k) == 32
    assert DiskCache.key("ab", "c") != DiskCache.key("a", "bc")
    assert DiskCache.key(b"x") != DiskCache.key("x")
    with pytest.raises(TypeError):
        DiskCache.key(1)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    cache = make(tmp_path)
    key = DiskCache.key(b"model", "out")
    assert cache.get(key) is None
    path = cache.put(key, b"DSP1 payload bytes")
    assert path == object_path(cache, b"DSP1 payload bytes") and path.exists()
    assert cache.get(key) == b"DSP1 payload bytes"
    assert cache.stats.as_dict() == {"hits": 1, "misses": 1, "writes": 1, "evictions": 0, "quarantines": 0}
    ref = json.loads(cache.ref_path(key).read_text())
    assert ref["object"] == path.name and ref["fingerprint"] == FP
    assert not list((tmp_path / "objects").glob(".tmp-*")) and not cache.events


def test_same_payload_two_keys_share_one_object(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("k1", b"same")
    cache.put("k2", b"same")
    assert len(list((tmp_path / "objects").iterdir())) == 1
    assert cache.get("k1") == cache.get("k2") == b"same"


def test_new_payload_replaces_key(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("k", b"old")
    cache.put("k", b"new")
    assert cache.get("k") == b"new"


def test_bad_key_is_refused(tmp_path: Path) -> None:
    cache = make(tmp_path)
    for key in ("", "../escape", ".hidden", "a/b", "x" * 129):
        with pytest.raises(ValueError, match="cache key"):
            cache.get(key)


def test_hit_touches_mtime(tmp_path: Path) -> None:
    cache = make(tmp_path)
    path = cache.put("k", b"payload")
    assert path is not None
    os.utime(path, (1000, 1000))
    cache.get("k")
    assert path.stat().st_mtime > time.time() - 60


# -- LRU bound ------------------------------------------------------------------------------
def test_lru_eviction_oldest_first(tmp_path: Path) -> None:
    entry_size = len(disk.encode_entry(b"0" * 100, FP))
    cache = make(tmp_path, max_bytes=3 * entry_size)
    for i in range(3):
        path = cache.put(f"k{i}", str(i).encode() * 100)
        assert path is not None
        os.utime(path, (1000 + i, 1000 + i))  # k0 oldest, k2 newest
    os.utime(object_path(cache, b"0" * 100), (5000, 5000))  # k0 used last: now k1 is the oldest
    cache.put("k3", b"3" * 100)
    assert cache.get("k1") is None and not cache.ref_path("k1").exists()
    assert [cache.get(k) for k in ("k0", "k2", "k3")] == [b"0" * 100, b"2" * 100, b"3" * 100]
    assert cache.stats.evictions == 1 and cache.info()["size"] <= cache.max_bytes


def test_eviction_never_removes_the_object_just_written(tmp_path: Path) -> None:
    cache = make(tmp_path, max_bytes=10)  # smaller than any entry
    cache.put("a", b"a" * 100)
    cache.put("b", b"b" * 100)
    assert cache.get("b") == b"b" * 100 and cache.get("a") is None
    assert cache.info()["count"] == 1


# -- bad entries ----------------------------------------------------------------------------
def _corrupt(cache: DiskCache, key: str, payload: bytes, how: str) -> Path:
    """Damage the stored entry one way; the file that must end up in quarantine."""
    obj = object_path(cache, payload)
    blob = bytearray(obj.read_bytes())
    if how == "truncated":
        obj.write_bytes(blob[:-3])
    elif how == "flipped_payload":
        blob[-1] ^= 0x01
        obj.write_bytes(blob)
    elif how == "wrong_magic":
        obj.write_bytes(b"XXXX" + blob[4:])
    elif how == "wrong_fingerprint":
        obj.write_bytes(disk.encode_entry(payload, "dsp-core=other"))
    elif how == "trailing_bytes":
        obj.write_bytes(blob + b"junk")
    elif how == "garbage_ref":
        cache.ref_path(key).write_bytes(b"\x00\xffnot json")
        return cache.ref_path(key)
    elif how == "ref_for_other_key":
        cache.ref_path(key).write_bytes(disk.encode_ref("other", obj.name, disk.parse_header(blob)))
        return cache.ref_path(key)
    return obj


BAD = ["truncated", "flipped_payload", "wrong_magic", "wrong_fingerprint", "trailing_bytes", "garbage_ref"]


@pytest.mark.parametrize("how", [*BAD, "ref_for_other_key"])
def test_bad_entry_is_quarantined(tmp_path: Path, how: str) -> None:
    cache = make(tmp_path)
    payload = b"a plan" * 20
    cache.put("k", payload)
    bad = _corrupt(cache, "k", payload, how)
    assert cache.get("k") is None
    assert not bad.exists()
    [moved] = quarantined(cache)
    reason = moved.with_name(moved.name + ".reason").read_text()
    assert str(bad) in reason
    assert cache.stats.quarantines == 1 and cache.stats.misses == 1
    [event] = cache.events
    assert event["kind"] == "quarantine" and event["path"] == str(bad) and event["reason"] in reason
    cache.put("k", payload)  # the caller recompiles and stores again: good as new
    assert cache.get("k") == payload


def test_every_header_byte_is_checked(tmp_path: Path) -> None:
    """A flipped bit anywhere in the header (or the fingerprint after it) is caught."""
    cache = make(tmp_path)
    payload = b"payload" * 10
    for offset in range(HEADER_SIZE + len(FP)):
        cache.put("k", payload)
        obj = object_path(cache, payload)
        blob = bytearray(obj.read_bytes())
        blob[offset] ^= 0x10
        obj.write_bytes(blob)
        assert cache.get("k") is None, f"flip at header byte {offset} not detected"
        assert not obj.exists()
    assert cache.stats.quarantines == HEADER_SIZE + len(FP)
    assert all(e["kind"] == "quarantine" for e in cache.events)


def test_reasons_name_the_fault(tmp_path: Path) -> None:
    cache = make(tmp_path)
    payload = b"p" * 50
    expected = {
        "truncated": "truncated",
        "flipped_payload": "checksum mismatch",
        "wrong_magic": "bad magic",
        "wrong_fingerprint": "fingerprint mismatch",
        "garbage_ref": "garbage ref",
    }
    for how, words in expected.items():
        cache.put("k", payload)
        _corrupt(cache, "k", payload, how)
        cache.get("k")
        assert words in cache.events[-1]["reason"], (how, cache.events[-1])


def test_caller_can_reject_a_payload_it_cannot_load(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("k", b"loads() chokes on this")
    assert cache.reject("k", "PlanFormatError: bad section") is True
    assert cache.get("k") is None and cache.reject("k", "again") is False
    [moved] = quarantined(cache)
    assert "PlanFormatError" in moved.with_name(moved.name + ".reason").read_text()


def test_dangling_ref_is_a_plain_miss(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("k", b"payload")
    object_path(cache, b"payload").unlink()  # as if another process evicted it
    assert cache.get("k") is None and not cache.events and cache.stats.quarantines == 0


def test_quarantine_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "QUARANTINE_KEEP", 3)
    cache = make(tmp_path)
    for i in range(6):
        payload = f"plan {i}".encode()
        cache.put("k", payload)
        _corrupt(cache, "k", payload, "flipped_payload")
        cache.get("k")
    assert cache.stats.quarantines == 6 and len(quarantined(cache)) == 3
    assert len(list((tmp_path / "quarantine").glob("*.reason"))) == 3


def test_unwritable_cache_does_not_raise(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    cache = make(tmp_path / "file" / "cache")
    assert cache.put("k", b"payload") is None
    assert cache.get("k") is None
    assert [e["kind"] for e in cache.events] == ["write_error", "unwritable", "read_error"]


def test_listener_gets_events_and_cannot_break_get(tmp_path: Path) -> None:
    cache = make(tmp_path)
    seen: list[dict] = []

    def broken(event: dict) -> None:
        raise RuntimeError("listener bug")

    cache.listeners += [seen.append, broken]
    cache.put("k", b"payload")
    _corrupt(cache, "k", b"payload", "wrong_magic")
    assert cache.get("k") is None and seen[0]["kind"] == "quarantine"


# -- override dir, switches -----------------------------------------------------------------
def test_override_has_priority_and_is_never_written(tmp_path: Path) -> None:
    seed = make(tmp_path / "seed")
    seed.put("k", b"from override")
    before = {p: p.read_bytes() for p in (tmp_path / "seed").rglob("*") if p.is_file()}
    cache = make(tmp_path / "cache", override_dir=tmp_path / "seed", max_bytes=10)
    cache.put("k", b"from cache")
    cache.put("k2", b"other")  # max_bytes=10: evicts in the cache, never in the override dir
    assert cache.get("k") == b"from override"
    after = {p: p.read_bytes() for p in (tmp_path / "seed").rglob("*") if p.is_file()}
    assert after == before


def test_bad_override_entry_is_reported_and_skipped(tmp_path: Path) -> None:
    seed = make(tmp_path / "seed")
    seed.put("k", b"seeded")
    obj = object_path(seed, b"seeded")
    obj.write_bytes(obj.read_bytes()[:-1])
    cache = make(tmp_path / "cache", override_dir=tmp_path / "seed")
    cache.put("k", b"cached")
    assert cache.get("k") == b"cached"
    assert obj.exists() and not quarantined(cache)
    assert [e["kind"] for e in cache.events] == ["override_rejected"]
    report = cache.verify()
    assert report["override_bad"] == 1 and obj.exists()


def test_disabled_cache(tmp_path: Path) -> None:
    cache = DiskCache.from_config({"DSP_CACHE_DIR": str(tmp_path), "DSP_DISK_CACHE": "0"})
    assert not cache.enabled
    assert cache.put("k", b"payload") is None and cache.get("k") is None
    assert not (tmp_path / "objects").exists()


def test_force_recompile_misses_but_writes(tmp_path: Path) -> None:
    make(tmp_path / "seed").put("k", b"seeded")
    env = {
        "DSP_CACHE_DIR": str(tmp_path / "c"),
        "DSP_FORCE_RECOMPILE": "1",
        "DSP_CACHE_OVERRIDE_DIR": str(tmp_path / "seed"),
    }
    cache = DiskCache.from_config(env)
    cache.build_fingerprint = FP
    cache.put("k", b"fresh")
    assert cache.get("k") is None and cache.stats.misses == 1 and cache.stats.writes == 1
    cache.force_recompile = False
    assert cache.get("k") == b"seeded"  # the override dir still comes first
    cache.override_dir = None
    assert cache.get("k") == b"fresh"


def test_from_config_defaults(tmp_path: Path) -> None:
    cache = DiskCache.from_config({"XDG_CACHE_HOME": str(tmp_path)})
    assert cache.root == tmp_path / "dsp" and cache.enabled and not cache.force_recompile
    assert cache.max_bytes == 4 << 30 and cache.override_dir is None
    assert DiskCache.from_config({"DSP_CACHE_MAX_BYTES": "512M"}).max_bytes == 512 << 20
    assert DiskCache.from_config({"DSP_CACHE_MAX_BYTES": "2GiB"}).max_bytes == 2 << 30
    assert DiskCache.from_config({"DSP_CACHE_MAX_BYTES": "4096"}).max_bytes == 4096


@pytest.mark.parametrize(
    "var, value",
    [
        ("DSP_DISK_CACHE", "maybe"),
        ("DSP_FORCE_RECOMPILE", "2"),
        ("DSP_CACHE_MAX_BYTES", "lots"),
        ("DSP_CACHE_MAX_BYTES", "0"),
        ("DSP_CACHE_MAX_BYTES", "-5"),
        ("DSP_CACHE_OVERRIDE_DIR", "/nonexistent/dsp-override"),
    ],
)
def test_invalid_env_raises_config_error(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        DiskCache.from_config({var: value})


def test_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="DSP_CACHE_DIR"):
        DiskCache.from_config({"DSP_CACHE_DIR": str(tmp_path / "f")})


def test_fingerprint_names_what_makes_the_plan() -> None:
    fp = disk.fingerprint()
    assert fp.startswith("dsp-core=") and ";dsp1=" in fp and ";plan-code=" in fp and ";onnx=" in fp
    assert "backend=" not in fp and "arch=" not in fp  # the auction runs after loading; plans are portable
    assert fp == disk.fingerprint()


# -- management -----------------------------------------------------------------------------
def test_ls_info_clear_verify(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("good", b"good payload")
    cache.put("stale", b"stale payload")
    stale = object_path(cache, b"stale payload")
    stale.write_bytes(disk.encode_entry(b"stale payload", "old build"))
    rows = {r["key"]: r for r in cache.ls()}
    assert rows["good"]["fingerprint_ok"] and rows["good"]["status"] == "ok"
    assert rows["stale"]["fingerprint_ok"] is False and rows["stale"]["status"] == "fingerprint mismatch"
    assert cache.info()["count"] == 2 and cache.info()["fingerprint"] == FP

    report = cache.verify()
    assert report["objects_ok"] == 1 and report["refs_ok"] == 1 and report["quarantined"] == 1
    assert report["dangling_refs_removed"] == 1 and len(report["problems"]) == 1
    assert cache.info()["quarantine_count"] == 1

    assert cache.clear() == 2  # one object, one ref
    assert cache.info()["count"] == 0 and cache.info()["quarantine_count"] == 1
    assert cache.clear(include_quarantine=True) == 2  # the file and its .reason


def test_ls_sees_a_wrong_size_from_the_header(tmp_path: Path) -> None:
    cache = make(tmp_path)
    cache.put("short", b"short payload")
    _corrupt(cache, "short", b"short payload", "truncated")
    [row] = cache.ls()
    assert row["status"].startswith("wrong size") and not quarantined(cache)  # ls only looks


# -- two processes --------------------------------------------------------------------------
WRITER = textwrap.dedent(
    """
    import pathlib, sys, time
    from dsp_core.cache.disk import DiskCache
    root, sync, rounds, name = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
    cache = DiskCache(root, build_fingerprint="fp", max_bytes=int(sys.argv[4]))
    tight = cache.max_bytes < 1 << 20
    payload = b"shared plan " * 500
    (sync / name).touch()  # start together: spin until both processes are up
    deadline = time.time() + 60
    while len(list(sync.iterdir())) < 2 and time.time() < deadline:
        pass
    for i in range(rounds):
        assert cache.put("shared", payload) is not None, cache.events
        got = cache.get("shared")
        # Under eviction pressure the other process may evict it between our put and get.
        assert got == payload or (got is None and tight), cache.events
        cache.put(f"mine-{i % 7}-{name}", payload + name.encode())
    assert not cache.events, cache.events
    print("ok", cache.stats.as_dict())
    """
)


def _race(root: Path, rounds: int, max_bytes: int) -> list[subprocess.CompletedProcess[str]]:
    sync = root.parent / f"{root.name}-sync"
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(sync), str(rounds), str(max_bytes), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("A", "B")
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]


def test_two_processes_write_the_same_entry(tmp_path: Path) -> None:
    for result in _race(tmp_path, rounds=300, max_bytes=1 << 30):
        assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr
    cache = make(tmp_path, build_fingerprint="fp")
    shared = object_path(cache, b"shared plan " * 500)
    objects = sorted(p.name for p in (tmp_path / "objects").iterdir())
    assert shared.name in objects and len(objects) == 3  # shared + one of each process's own
    assert not list(tmp_path.rglob(".tmp-*")) and not (tmp_path / "quarantine").exists()
    report = cache.verify()
    assert report["problems"] == [] and report["refs_ok"] == 1 + 2 * 7


def test_two_processes_with_eviction_pressure(tmp_path: Path) -> None:
    """A tight bound makes each process evict the other's entries mid-flight: misses, never errors."""
    entry = len(disk.encode_entry(b"shared plan " * 500 + b"A", "fp"))
    for result in _race(tmp_path, rounds=200, max_bytes=2 * entry):
        assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr
    cache = make(tmp_path, build_fingerprint="fp")
    assert cache.verify()["problems"] == [] and not (tmp_path / "quarantine").exists()


# -- the CLI --------------------------------------------------------------------------------
def dsp(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_cli("cache", *args, env=env)


def test_cli_cache_commands(tmp_path: Path) -> None:
    env = {"DSP_CACHE_DIR": str(tmp_path)}
    fp = json.loads(dsp("info", "--json", env=env).stdout)["fingerprint"]  # the CLI's own build
    real = make(tmp_path, build_fingerprint=fp)
    real.put(DiskCache.key(b"model"), b"a plan")
    real.put(DiskCache.key(b"other"), b"another plan")
    obj = object_path(real, b"another plan")
    obj.write_bytes(obj.read_bytes()[:-1])

    info = json.loads(dsp("info", "--json", env=env).stdout)
    assert info["dir"] == str(tmp_path) and info["count"] == 2 and info["refs"] == 2

    rows = json.loads(dsp("ls", "--json", env=env).stdout)
    assert {r["key"] for r in rows} == {DiskCache.key(b"model"), DiskCache.key(b"other")}

    out = dsp("verify", "--json", env=env)
    assert out.returncode == 1 and json.loads(out.stdout)["quarantined"] == 1
    assert dsp("verify", env=env).returncode == 0

    text = dsp("ls", env=env)
    assert text.returncode == 0 and "1 entries" in text.stdout
    out = dsp("clear", "--all", "--json", env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["removed"] == 4  # object, ref, quarantined + .reason
    assert json.loads(dsp("info", "--json", env=env).stdout)["count"] == 0


def test_cli_bad_env_exits_2(tmp_path: Path) -> None:
    out = dsp("info", env={"DSP_CACHE_DIR": str(tmp_path), "DSP_CACHE_MAX_BYTES": "huge"})
    assert out.returncode == 2
    assert "DSP_CACHE_MAX_BYTES" in out.stderr and "Traceback" not in out.stderr
