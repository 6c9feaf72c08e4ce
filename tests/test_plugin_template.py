"""`dsp plugin new` (issue 17 item 10): the project it writes installs, lints clean and passes
its own tests and the conformance kit; the kit warns when two backends claim one mode.

The generated distributions are installed into a throwaway venv layered on this one (a .pth
adds this venv's site-packages), so the venv running the suite never sees them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from dsp_core.backends.base import Backend, ModeContract, Registry
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.cli import main
from dsp_core.errors import ConfigError
from dsp_core.plugin_template import PluginNames, PluginTemplateError, render
from dsp_core.testing.conformance.plugin import shared_mode_note

# The mode the generated backend serves. dsp-openvino, which `make test` installs, claims it
# too: the generated project's venv switches that plugin off (DSP_DISABLE_PLUGINS), so
# nothing else claims the mode there and the kit runs clean.
MODE = "openvino"


def test_names_derive_from_one_backend_name() -> None:
    names = PluginNames.of("my_jit", "onednn")
    assert (names.dist, names.module, names.cls, names.mode) == (
        "dsp-my-jit",
        "dsp_my_jit",
        "MyJit",
        GraphExecutionMode.ONEDNN,
    )
    files = render(names)
    assert set(files) == {
        "pyproject.toml",
        "README.md",
        "dsp_my_jit/__init__.py",
        "dsp_my_jit/kernels.py",
        "dsp_my_jit/plugin.py",
        "dsp_my_jit/segment.py",
        "tests/test_my_jit.py",
        "tests/test_conformance.py",
    }
    assert not [f for f, text in files.items() if "{{" in text], "a template token was left unreplaced"
    assert 'my_jit = "dsp_my_jit.plugin"' in files["pyproject.toml"]


@pytest.mark.parametrize(
    ("name", "mode", "error", "message"),
    [
        ("My-Backend", "onednn", PluginTemplateError, "not a lower-case Python identifier"),
        ("class", "onednn", PluginTemplateError, "not a lower-case Python identifier"),
        ("fine", "cuda_graphs", PluginTemplateError, "mode CUDA_GRAPHS is not one the template can serve"),
        ("fine", "slot_by_slot", PluginTemplateError, "choose one of openvino, onnxruntime, onednn"),
        ("fine", "bogus", ConfigError, "unknown execution mode 'bogus'"),
    ],
)
def test_bad_names_and_modes_are_refused_with_the_remedy(name: str, mode: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        PluginNames.of(name, mode)


def test_cli_refuses_a_directory_that_is_not_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["plugin", "new", "acme", "--dir", str(tmp_path)]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


class _Twin(Backend):
    mode = GraphExecutionMode.ACL
    platform = "cpu"
    contract = ModeContract(True, False, True, False, frozenset({"float32"}), 0.0)


def test_kit_note_when_two_backends_claim_one_mode() -> None:
    one = type("One", (_Twin,), {"name": "one"})()
    two = type("Two", (_Twin,), {"name": "two"})()
    alone = type("Alone", (_Twin,), {"name": "alone", "mode": GraphExecutionMode.ONEDNN})()
    registry = Registry(backends=[one, two, alone])
    note = shared_mode_note(two, registry)
    assert note is not None and "2 installed backends claim mode ACL: one (unknown) -> two (unknown)" in note
    assert "this run may test another backend than two" in note
    assert shared_mode_note(alone, registry) is None


# -- the generated project, for real ----------------------------------------------------------
def _layered_venv(root: Path) -> Path:
    """A venv that sees this venv's packages (site.addsitedir, so editable installs work too)."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    parent = sysconfig.get_paths()["purelib"]
    Path(site, "_dsp_parent_venv.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return py


def _env(tmp_path: Path) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTEST_ADDOPTS", "DSP_TEST_BACKENDS", "DSP_TEST_FAULT", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "DSP_CACHE_DIR": str(tmp_path / "cache"), "DSP_DISABLE_PLUGINS": "openvino"}


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(map(str, done.args))} exited {done.returncode}\n{out[-6000:]}"
    return out


def _counts(output: str) -> dict[str, int]:
    return {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output.splitlines()[-1])}


@pytest.mark.slow
def test_generated_backend_installs_and_passes_its_tests_and_the_kit(tmp_path: Path) -> None:
    env = _env(tmp_path)
    py = _layered_venv(tmp_path)
    dsp = [str(py), "-m", "dsp_core.cli"]
    project = tmp_path / "dsp-acme"
    out = _ok(_run([*dsp, "plugin", "new", "acme", "--mode", MODE, "--dir", str(project)], env))
    assert "pip install -e" in out and "note:" not in out, out  # nothing else claims the mode

    _ok(_run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], env, cwd=project))
    _ok(_run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], env, cwd=project))
    install = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(project)]
    _ok(_run(install, env))

    listed = _run([*dsp, "backends", "list", "--json"], env)
    _ok(listed)
    table = json.loads(listed.stdout)
    acme = {r["name"]: r for r in table["backends"]}["acme"]
    assert (acme["distribution"], acme["mode"], acme["available"]) == ("dsp-acme", "OPENVINO", True), acme
    assert table["auto"][0] == "acme", table  # first of the CPU chain

    # Its own pytest: its tests plus the whole kit (addopts = --dsp-backend acme).
    out = _ok(_run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"], env, cwd=project))
    counts = _counts(out)
    assert counts.get("passed", 0) >= 60 and not counts.get("failed") and not counts.get("error"), out[-3000:]
    assert "claim mode" not in out, out[-3000:]
    # The lifecycle ran on acme's captures, not on a fallback: the kit skips cases acme declines.
    out = _ok(_run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "lifecycle"], env, cwd=project))
    assert _counts(out).get("passed", 0) >= 10, out[-3000:]

    # A second backend claiming the same mode: the kit warns.
    twin = tmp_path / "dsp-twin"
    out = _ok(_run([*dsp, "plugin", "new", "twin", "--mode", MODE, "--dir", str(twin)], env))
    assert "note: installed backends already serve OPENVINO: acme (dsp-acme)" in out, out
    _ok(_run([*install[:-1], str(twin)], env))
    out = _ok(_run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "well_formed"], env, cwd=project))
    assert "2 installed backends claim mode OPENVINO: acme (dsp-acme) -> twin (dsp-twin)" in out, out[-3000:]

    # The venv running this suite never saw them.
    here = _run(
        [sys.executable, "-c", "import importlib.metadata as m; print(sorted(d.name for d in m.distributions()))"], env
    )
    assert "dsp-acme" not in _ok(here) and "dsp-twin" not in here.stdout
