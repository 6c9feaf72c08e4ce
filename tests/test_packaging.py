"""Packaging (issue 17 items 9 and 11): remedies name real distributions, `make dist` wheels
install in a fresh venv, and `make demo` never leaves the test distributions installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from dsp_core.backends.discovery import discover
from dsp_core.backends.modes import PROVIDERS, GraphExecutionMode, provider_hint

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def _dist_name(project: Path) -> str:
    return tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"]


BUILT = {_dist_name(ROOT), *(_dist_name(p) for p in PLUGIN_DIRS)}


def test_remedies_name_only_distributions_this_repository_builds() -> None:
    assert set(PROVIDERS.values()) <= BUILT, f"PROVIDERS names {set(PROVIDERS.values()) - BUILT}; built: {BUILT}"
    for mode in GraphExecutionMode:
        hint = provider_hint(mode)
        named = set(re.findall(r"\bdsp-[a-z0-9-]+", hint))
        assert named <= BUILT, f"{mode.name}: {hint!r} names {named - BUILT}"
        if mode not in PROVIDERS:
            assert f"no distribution of this repository provides {mode.name} yet" in hint


def test_every_mode_a_built_plugin_serves_names_its_distribution() -> None:
    plugin_dists = {_dist_name(p) for p in PLUGIN_DIRS}
    served = {b.mode: b.distribution for b in discover().backends if b.distribution in plugin_dists}
    assert served, "no backend of this repository's plugins is installed"
    assert {m: PROVIDERS.get(m) for m in served} == served


def _clean_env(tmp_path: Path) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "DSP_TEST_BACKENDS", "DSP_TEST_FAULT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["DSP_CACHE_DIR"] = str(tmp_path / "cache")
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: int = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


_SMOKE = textwrap.dedent(
    """
    import json, numpy as np, dsp_core as dsp
    g = dsp.GraphBuilder("smoke")
    x = g.placeholder("x", "float32", ["batch", 3])
    g.output(g.Relu(x) * 2.0, "y")
    model = dsp.compile(g.build())
    y = model.run({"x": np.array([[-1.0, 0.5, 2.0]], np.float32)})["y"]
    print(json.dumps({"y": y.tolist(), "backends": model.resolved_backends()}))
    """
)


@pytest.mark.slow
def test_make_dist_wheels_install_with_find_links_in_a_fresh_venv(tmp_path: Path) -> None:
    """`make dist`, then `pip install --find-links dist dsp-core` (and dsp-cuda-graphs) in a new venv."""
    env = _clean_env(tmp_path)
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    stamp = Path(sys.prefix) / ".installed"  # -o: never rebuild the venv running these tests
    _run(["make", "-o", str(stamp), "dist", f"VENV={sys.prefix}", f"DIST={dist}"], env, cwd=ROOT)
    wheels = {w.name.split("-")[0].replace("_", "-") for w in dist.glob("*.whl")}
    assert wheels == BUILT, f"make dist wrote {sorted(wheels)}, expected {sorted(BUILT)}"

    _run([sys.executable, "-m", "venv", str(venv)], env)
    py = str(venv / "bin" / "python")
    dsp = [py, "-m", "dsp_core.cli"]
    _run([py, "-m", "pip", "install", "-q", "--find-links", str(dist), "dsp-core"], env)
    table = json.loads(_run([*dsp, "backends", "list", "--json"], env))
    rows = {r["name"]: r for r in table["backends"]}
    assert set(rows) == {"slot_by_slot", "emulated_replay", "numpy_replay", "shape_inference_only"}, rows
    assert {r["distribution"] for r in rows.values()} == {"dsp-cpu-ref"} and all(r["available"] for r in rows.values())
    assert table["failures"] == [] and table["auto"] == ["slot_by_slot"], table
    smoke = json.loads(_run([py, "-c", _SMOKE], env, cwd=tmp_path))
    assert smoke == {"y": [[0.0, 1.0, 4.0]], "backends": ["slot_by_slot"]}
    # The backend template is package data: it must be in the wheel.
    _run([*dsp, "plugin", "new", "from_wheel", "--dir", str(tmp_path / "from_wheel")], env)
    assert (tmp_path / "from_wheel" / "dsp_from_wheel" / "segment.py").is_file()

    # The GPU combination this repository builds: dsp-core + dsp-cuda-graphs (CuPy is an extra).
    _run([py, "-m", "pip", "install", "-q", "--find-links", str(dist), "dsp-core", "dsp-cuda-graphs"], env)
    table = json.loads(_run([*dsp, "backends", "list", "--json"], env))
    cuda = {r["name"]: r for r in table["backends"]}["cuda_graphs"]
    assert cuda["distribution"] == "dsp-cuda-graphs" and table["failures"] == [], table
    if not cuda["available"]:  # a machine without CuPy or a GPU: listed, with its reason
        assert cuda["reason"], cuda
    smoke = json.loads(_run([py, "-c", _SMOKE], env, cwd=tmp_path))
    assert smoke["y"] == [[0.0, 1.0, 4.0]]


# -- make demo / make test: the test distributions (item 11) ----------------------------------
# The Makefile runs against a fake venv whose python and pip are shell scripts that log what
# they are asked and keep a list of "installed" distributions, so its stamp logic is tested in
# both orders without a real install.
_PIP = """#!/bin/sh
echo "pip $*" >> "$V/log"
case "$*" in
  *uninstall*) for d in "$@"; do grep -vxF -e "$d" "$V/installed" > "$V/tmp"; mv "$V/tmp" "$V/installed"; done ;;
  *install*)
    case "$*" in *tests/dists/dsp_test_backends*) echo dsp-test-backends >> "$V/installed" ;; esac
    case "$*" in *".[test,dev]"*) echo dsp-core >> "$V/installed" ;; esac ;;
esac
"""
_PYTHON = """#!/bin/sh
echo "python $*" >> "$V/log"
case "$*" in
  *importlib.metadata*) eval last=\\${$#}; grep -qx "$last" "$V/installed" ;;
  "-m venv"*) mkdir -p "$3/bin" ;;
esac
"""


def _fake_venv(root: Path) -> Path:
    v = root / "venv"
    (v / "bin").mkdir(parents=True)
    for name, text in (("pip", _PIP), ("python", _PYTHON)):
        (v / "bin" / name).write_text(text)
        (v / "bin" / name).chmod(0o755)
    (v / "installed").write_text("")
    (v / "log").write_text("")
    return v


def _make(v: Path, target: str) -> tuple[str, set[str]]:
    """Run ``make target`` on the fake venv; what python/pip were asked, and what is installed after."""
    (v / "log").write_text("")
    env = {**os.environ, "V": str(v)}
    done = subprocess.run(
        ["make", "-C", str(ROOT), target, f"VENV={v}", f"PYTHON={v}/bin/python"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return (v / "log").read_text(), set((v / "installed").read_text().split())


@pytest.mark.parametrize("order", [("demo", "test", "demo", "test"), ("test", "demo", "test", "demo")])
def test_demo_never_has_the_test_distributions_and_test_always_has(tmp_path: Path, order: tuple[str, ...]) -> None:
    v = _fake_venv(tmp_path)
    for target in order:
        log, installed = _make(v, target)
        assert "dsp-core" in installed, log
        if target == "demo":
            assert "examples/demo.py" in log and "dsp-test-backends" not in installed, log
            assert "install -q --no-deps -e tests/dists" not in log, log
        else:
            assert "-m pytest" in log and "dsp-test-backends" in installed, log


def test_demo_removes_test_distributions_a_venv_got_from_an_older_makefile(tmp_path: Path) -> None:
    v = _fake_venv(tmp_path)
    _make(v, "demo")
    (v / "installed").write_text("dsp-core\ndsp-test-backends\n")  # installed with no stamp saying so
    log, installed = _make(v, "demo")
    assert "uninstall -q -y dsp-test-backends" in log and installed == {"dsp-core"}, log
