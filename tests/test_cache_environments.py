"""The disk cache shared by several environments, and warm starts that read nothing they need not
(issue 17 items 1, 6 and 8).

A different build fingerprint is not damage: each build keeps its entries beside the others'
(LRU-bounded together), only what is damaged is quarantined, and the fingerprint covers only
what can change a plan. Two environments are real processes here: environment B runs a copy
of dsp_core whose plan compiler differs by one comment (another build of the plan-making code)
and has one more backend distribution installed (a dist-info on its path), so it is a
different build for this code and for the code before it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CACHE_X, run_cli, weight_matmul_expected, weight_matmul_model

import dsp_core as dsp
from dsp_core import cli, diag
from dsp_core.cache import disk
from dsp_core.cache.disk import DiskCache
from dsp_core.diag.events import Category
from dsp_core.errors import DSPError
from dsp_core.runtime import loader

FIXTURES = Path(__file__).parent / "fixtures"
GPT2 = FIXTURES / "gpt2_eager.onnx"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_matmul_model(1.0, batch="batch").SerializeToString())
    return path


def _quarantined(cache_dir: Path) -> list[str]:
    qdir = cache_dir / "quarantine"
    return sorted(p.name for p in qdir.iterdir() if not p.name.endswith(".reason")) if qdir.exists() else []


# -- two environments, for real -----------------------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import json, sys, numpy as np, dsp_core as dsp
    from dsp_core.errors import DSPError
    x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128)
    try:
        model = dsp.compile(sys.argv[1], mode=sys.argv[2], strict=sys.argv[3] == "strict")
    except DSPError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(0)
    y = model.run({"x": x})["y"]
    ok = bool(np.allclose(y, x @ np.full((128, 256), 1.0, np.float32), rtol=1e-5))
    print(json.dumps({"ok": ok, "stats": model.stats.as_dict(), "core": dsp.__file__}))
    """
)

_EXTRA_BACKEND = textwrap.dedent(
    '''
    """One more installed backend distribution (a test double): declines everything."""
    from dsp_core import hookimpl
    from dsp_core.backends.base import Availability, Backend, Decline, DeclineReason
    from dsp_core.backends.modes import GraphExecutionMode


    class ExtraBackend(Backend):
        name = "test_extra_env"
        mode = GraphExecutionMode.NNAPI
        platform = "cpu"

        def _availability_probe(self):
            return Availability.no("a test double")

        def _supports(self, slot):
            return Decline(DeclineReason.UNSUPPORTED_OP, "takes nothing")


    @hookimpl
    def dsp_register_backends():
        return [ExtraBackend()]
    '''
)


def _core_root() -> Path:
    """The directory holding the dsp_core package this test runs (so a check of older code runs that)."""
    return Path(dsp.__file__).resolve().parent.parent


def _extra_backend_dir(root: Path) -> Path:
    """A directory that, on PYTHONPATH, installs one more backend distribution (a real entry point)."""
    site = root / "extra-site"
    info = site / "dsp_extra_env-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsp-extra-env\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dsp.backends]\ntest_extra_env = dsp_extra_env\n")
    (site / "dsp_extra_env.py").write_text(_EXTRA_BACKEND)
    return site


def _other_build_dir(root: Path) -> Path:
    """A copy of dsp_core whose plan compiler differs by a comment: another build of the plan-making code."""
    copy = root / "other-build"
    shutil.copytree(_core_root() / "dsp_core", copy / "dsp_core", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "dsp_core" / "plan" / "compiler.py", "a") as f:
        f.write("\n# environment B: another build of the plan compiler\n")
    return copy


def _run_child(model: Path, cache_dir: Path, *path: Path, mode: str = "auto", strict: bool = False, **env: str) -> dict:
    """Compile and run ``model`` in a fresh interpreter whose import path is ``path`` (not the cwd)."""
    env = {**os.environ, "DSP_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join(map(str, path)), **env}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), mode, "strict" if strict else "lenient"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=cache_dir.parent,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" in result or result["ok"], result
    return result


def test_two_environments_alternating_keep_each_others_entries(tmp_path: Path, model_path: Path) -> None:
    """The issue's 0 hits in 6 alternating runs: now every run after each environment's first is a hit."""
    cache_dir = tmp_path / "cache"
    env_a = [_core_root()]
    env_b = [_other_build_dir(tmp_path), _extra_backend_dir(tmp_path)]
    runs = [_run_child(model_path, cache_dir, *(env_a if i % 2 == 0 else env_b)) for i in range(6)]
    assert Path(runs[1]["core"]).is_relative_to(tmp_path)  # B really ran the other build
    assert [r["stats"]["disk_hits"] for r in runs] == [0, 0, 1, 1, 1, 1]
    assert [r["stats"]["disk_writes"] for r in runs] == [1, 1, 0, 0, 0, 0]
    assert all(r["stats"]["quarantines"] == 0 for r in runs) and _quarantined(cache_dir) == []
    builds = sorted(p.name for p in (cache_dir / "refs").iterdir())
    assert len(builds) == 2  # side by side, one directory of refs per build


def test_installing_or_removing_a_backend_keeps_every_entry(tmp_path: Path, model_path: Path) -> None:
    """The plan holds no auction result (it runs after loading), so backends are not in the fingerprint."""
    cache_dir = tmp_path / "cache"
    first = _run_child(model_path, cache_dir, _core_root())
    installed = _run_child(model_path, cache_dir, _core_root(), _extra_backend_dir(tmp_path))
    removed = _run_child(model_path, cache_dir, _core_root())
    assert first["stats"]["disk_writes"] == 1
    assert installed["stats"]["disk_hits"] == 1 and removed["stats"]["disk_hits"] == 1
    assert _quarantined(cache_dir) == []


# -- the same, in one process: objects, verify, LRU ---------------------------------------------
def test_identical_payloads_of_two_builds_are_two_objects(tmp_path: Path) -> None:
    """Objects named by the payload alone were shared: B re-stamped A's, and A's ref then looked damaged."""
    a = DiskCache(tmp_path, build_fingerprint="dsp-core=1;build=a")
    b = DiskCache(tmp_path, build_fingerprint="dsp-core=1;build=b")
    a.put("k", b"the same plan")
    b.put("k", b"the same plan")
    assert a.get("k") == b"the same plan" and b.get("k") == b"the same plan"
    assert a.stats.quarantines == b.stats.quarantines == 0 and not a.events and not b.events
    assert len(list((tmp_path / "objects").iterdir())) == 2


def test_verify_in_one_environment_keeps_the_others_entries(tmp_path: Path) -> None:
    a = DiskCache(tmp_path, build_fingerprint="build-a")
    b = DiskCache(tmp_path, build_fingerprint="build-b")
    a.put("k", b"a's plan")
    b.put("k", b"b's plan")
    b.put("k2", b"b's other plan")
    report = b.verify()
    assert report["problems"] == [] and report["quarantined"] == 0
    assert report["refs_ok"] == 2 and report["other_build_refs"] == 1 and report["objects_ok"] == 3
    assert a.get("k") == b"a's plan" and b.get("k") == b"b's plan"
    rows = {(r["key"], r["this_build"]): r for r in b.ls()}
    assert rows[("k", False)]["status"] == "other build" and rows[("k", True)]["status"] == "ok"


def test_verify_still_quarantines_damage_in_another_builds_entry(tmp_path: Path) -> None:
    a = DiskCache(tmp_path, build_fingerprint="build-a")
    obj = a.put("k", b"a's plan" * 10)
    assert obj is not None
    blob = bytearray(obj.read_bytes())
    blob[-1] ^= 1
    obj.write_bytes(blob)
    report = DiskCache(tmp_path, build_fingerprint="build-b").verify()
    assert report["quarantined"] == 1 and "checksum" in report["problems"][0]["reason"]
    assert a.get("k") is None  # gone for A too: it was damaged, and A recompiles


def test_builds_share_one_lru_bound(tmp_path: Path) -> None:
    payload = b"p" * 1000
    entry = len(disk.encode_entry(payload, "build-0"))
    builds = [DiskCache(tmp_path, build_fingerprint=f"build-{i}", max_bytes=2 * entry) for i in range(3)]
    for i, cache in enumerate(builds):
        path = cache.put("k", payload)
        assert path is not None
        os.utime(path, (1000 + i, 1000 + i))  # build-0 least recently used
    assert builds[0].get("k") is None  # evicted to keep the bound: a plain miss
    assert builds[1].get("k") == payload and builds[2].get("k") == payload
    assert builds[2].info()["size"] <= 2 * entry and builds[2].info()["refs"] == 2
    assert all(c.stats.quarantines == 0 for c in builds)


# -- what a failed compile leaves in the cache --------------------------------------------------
def test_a_mode_nobody_installed_keeps_the_entry(cache_dir: Path, model_path: Path) -> None:
    assert dsp.compile(model_path).stats.disk_writes == 1
    with pytest.raises(DSPError, match="METAL"):
        dsp.compile(model_path, mode="metal")
    again = dsp.compile(model_path)
    assert again.stats.disk_hits == 1 and again.stats.quarantines == 0 and _quarantined(cache_dir) == []


def test_a_strict_failure_keeps_the_entry(tmp_path: Path, model_path: Path) -> None:
    cache_dir, core = tmp_path / "cache", _core_root()
    assert _run_child(model_path, cache_dir, core)["stats"]["disk_writes"] == 1
    # test_null (mode ACL, on with DSP_TEST_BACKENDS=1) declines every slot: strict fails
    failed = _run_child(model_path, cache_dir, core, mode="acl", strict=True, DSP_TEST_BACKENDS="1")
    assert "BackendError" in failed["error"] and "strict" in failed["error"]
    again = _run_child(model_path, cache_dir, core)
    assert again["stats"]["disk_hits"] == 1 and _quarantined(cache_dir) == []


# -- the fingerprint covers what can change the plan ---------------------------------------------
def test_fingerprint_covers_the_plan_making_code(tmp_path: Path) -> None:
    copy = _other_build_dir(tmp_path) / "dsp_core"
    same = tmp_path / "same"
    shutil.copytree(_core_root() / "dsp_core", same, ignore=shutil.ignore_patterns("__pycache__"))
    assert disk.plan_code_digest(same) == disk.plan_code_digest()
    assert disk.plan_code_digest(copy) != disk.plan_code_digest()
    fp = disk.fingerprint()
    assert f"plan-code={disk.plan_code_digest()}" in fp and f"numpy={np.__version__}" in fp
    assert "backend" not in fp and "arch" not in fp


# -- item 6: an unwritable cache says so, once -----------------------------------------------------
def test_unwritable_cache_warns_once_with_the_remedy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("in the way")
    root = tmp_path / "file" / "cache"  # cannot be created, even by root
    monkeypatch.setenv("DSP_CACHE_DIR", str(root))
    diag.disable()
    diag.clear()
    diag.enable("CACHE", "summary")
    try:
        with caplog.at_level(logging.WARNING, logger="dsp.cache"):
            for scale in (1.0, 2.0):
                path = tmp_path / f"m{scale}.onnx"
                path.write_bytes(weight_matmul_model(scale, batch="batch").SerializeToString())
                np.testing.assert_allclose(
                    dsp.compile(path).run({"x": CACHE_X})["y"], weight_matmul_expected(scale), rtol=1e-5
                )
        codes = [e.code for e in diag.events(Category.CACHE)]
    finally:
        diag.disable()
        diag.clear()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(root) in warnings[0] and "DSP_CACHE_DIR" in warnings[0] and "DSP_DISK_CACHE=0" in warnings[0]
    assert codes.count("disk_unwritable") == 1 and "disk_write_error" in codes


def test_unwritable_cache_warns_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_matmul_model(1.0, batch="batch").SerializeToString())
    out = run_cli("run", str(path), "--random-inputs", env={"DSP_CACHE_DIR": str(tmp_path / "file" / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("cannot be written") == 1 and "DSP_DISK_CACHE=0" in out.stderr


@pytest.mark.parametrize("command", ["ls", "info", "verify", "clear"])
def test_cache_commands_with_files_where_directories_belong(tmp_path: Path, command: str) -> None:
    for sub in ("objects", "refs", "weights"):
        (tmp_path / sub).write_text("not a directory")
    out = run_cli("cache", command, env={"DSP_CACHE_DIR": str(tmp_path)})
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    assert out.returncode == (1 if command == "verify" else 0), out.stdout + out.stderr
    if command == "verify":
        assert out.stdout.count("not a directory") == 3
        assert run_cli("cache", "verify", env={"DSP_CACHE_DIR": str(tmp_path)}).returncode == 0  # healed


def test_cache_commands_with_directories_where_files_belong(cache_dir: Path, model_path: Path) -> None:
    dsp.compile(model_path)
    cache = DiskCache.from_config()
    [ref] = list((cache_dir / "refs" / cache.build).iterdir())
    [obj] = list((cache_dir / "objects").iterdir())
    for victim in (ref, obj):
        victim.unlink()
        victim.mkdir()
    env = {"DSP_CACHE_DIR": str(cache_dir)}
    for command in ("ls", "info", "verify"):
        out = run_cli("cache", command, env=env)
        assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    assert "not a regular file" in run_cli("cache", "ls", env=env).stdout or not ref.exists()


# -- item 8: a warm start reads neither the graph nor the model file ------------------------------
def test_random_inputs_on_a_warm_start_never_import_the_model(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cold = dsp.compile(GPT2)
    expected = cli.random_feeds(cold, {}, set())

    def no_import(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was imported on a warm start")

    monkeypatch.setattr(loader, "import_model", no_import)
    warm = dsp.compile(GPT2)
    assert warm.stats.disk_hits == 1
    feeds = cli.random_feeds(warm, {}, set())
    assert list(feeds) == list(expected)
    for name in feeds:
        np.testing.assert_array_equal(feeds[name], expected[name])
    assert cli.main(["run", str(GPT2), "--random-inputs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"]


_WARM_CHILD = textwrap.dedent(
    """
    import json, sys, numpy as np, dsp_core as dsp
    from dsp_core.runtime import loader
    hashed = []
    real = loader._hash_file
    loader._hash_file = lambda p: hashed.append(str(p)) or real(p)
    model = dsp.compile(sys.argv[1])
    x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128)
    y = model.run({"x": x})["y"]
    print(json.dumps({"hashed": hashed, "stats": model.stats.as_dict(), "y0": float(y[0, 0])}))
    """
)


def _warm_child(model: Path, cache_dir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _WARM_CHILD, str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DSP_CACHE_DIR": str(cache_dir)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_new_process_does_not_rehash_a_settled_model(tmp_path: Path, model_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    time.sleep(2.1)  # past the racy window: a file changed less than 2 s before hashing is never memoized
    cold = _warm_child(model_path, cache_dir)
    warm = _warm_child(model_path, cache_dir)
    assert cold["hashed"] == [str(model_path)] and cold["stats"]["disk_writes"] == 1
    assert warm["hashed"] == [] and warm["stats"]["disk_hits"] == 1
    assert warm["y0"] == pytest.approx(float(weight_matmul_expected(1.0)[0, 0]))


def _fresh_process() -> None:
    """What a new process starts with: no in-process digest memo."""
    with loader._memo_lock:
        loader._memo.clear()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file hashed; the racy window off, so a just-written file is memoized at once."""
    monkeypatch.setattr(disk, "RACY_NS", -(10**18))
    seen: list[Path] = []
    real = loader._hash_file
    monkeypatch.setattr(loader, "_hash_file", lambda p: seen.append(p) or real(p))
    return seen


def test_digest_memo_of_a_replaced_model_is_not_trusted(cache_dir: Path, model_path: Path, hashed: list) -> None:
    dsp.compile(model_path)
    _fresh_process()
    assert dsp.compile(model_path).stats.disk_hits == 1 and hashed == [model_path]  # from the on-disk memo
    st = model_path.stat()
    time.sleep(0.05)
    with open(model_path, "r+b") as f:  # same size, same mtime, other weights: only ctime tells
        f.write(weight_matmul_model(4.0, batch="batch").SerializeToString())
    os.utime(model_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _fresh_process()
    model = dsp.compile(model_path)
    np.testing.assert_allclose(model.run({"x": CACHE_X})["y"], weight_matmul_expected(4.0), rtol=1e-5)
    assert model.stats.disk_hits == 0 and hashed == [model_path, model_path]


def test_digest_memo_of_another_boot_is_not_trusted(
    cache_dir: Path, model_path: Path, hashed: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsp.compile(model_path)
    monkeypatch.setattr(disk, "boot_id", lambda: "another-boot")
    _fresh_process()
    assert dsp.compile(model_path).stats.disk_hits == 1 and hashed == [model_path, model_path]


@pytest.mark.parametrize("damage", ["digest", "check", "garbage", "empty", "huge", "symlink", "fifo", "dir"])
def test_damaged_digest_memo_is_ignored(
    cache_dir: Path, model_path: Path, hashed: list, tmp_path: Path, damage: str
) -> None:
    dsp.compile(model_path)
    [memo] = list((cache_dir / "digests").iterdir())
    record = json.loads(memo.read_text())
    memo.unlink()
    if damage == "digest":  # another model's digest, with the check left as it was
        memo.write_text(json.dumps({**record, "digest": "0" * 64}))
    elif damage == "check":
        memo.write_text(json.dumps({**record, "check": "0" * 32}))
    elif damage == "garbage":
        memo.write_bytes(b"\x00\xff{not json")
    elif damage == "empty":
        memo.write_bytes(b"")
    elif damage == "huge":
        memo.write_bytes(b" " * (1 << 20))
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_text(json.dumps(record))
        memo.symlink_to(tmp_path / "elsewhere")
    elif damage == "fifo":
        os.mkfifo(memo)
    else:
        memo.mkdir()
    _fresh_process()
    model = dsp.compile(model_path)
    np.testing.assert_allclose(model.run({"x": CACHE_X})["y"], weight_matmul_expected(1.0), rtol=1e-5)
    assert hashed == [model_path, model_path] and model.stats.disk_hits == 1


def test_just_written_file_is_not_memoized_on_disk(cache_dir: Path, model_path: Path) -> None:
    dsp.compile(model_path)  # written a moment ago: inside the racy window
    assert not (cache_dir / "digests").exists() or not list((cache_dir / "digests").iterdir())


def test_digest_memos_are_bounded(cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "MEMO_KEEP", 3)
    cache = DiskCache.from_config()
    for i in range(6):
        cache.remember_digest((f"/m{i}", 1, i, 10, 0, 0), "ab" * 32, False)
    assert len(list((cache_dir / "digests").iterdir())) == 3
    assert cache.recall_digest(("/m5", 1, 5, 10, 0, 0)) == ("ab" * 32, False)
    assert cache.recall_digest(("/m5", 1, 5, 11, 0, 0)) is None  # another size: another file
