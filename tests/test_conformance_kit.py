"""The backend conformance kit, run as a third party would run it: pytest --pyargs in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

KIT = "dsp_core.testing.conformance"


def _run_kit(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "DSP_TEST_BACKENDS")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pyargs", KIT, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _counts(output: str) -> dict[str, int]:
    """{'passed': n, 'skipped': m, ...} from pytest's summary line."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", output)}


@pytest.mark.parametrize("backend", ["slot_by_slot", "emulated_replay", "shape_inference_only"])
def test_cpu_ref_backends_pass_the_kit(tmp_path: Path, backend: str) -> None:
    done = _run_kit(tmp_path, "--dsp-backend", backend)
    output = done.stdout + done.stderr
    counts = _counts(output.splitlines()[-1] if output.strip() else "")
    assert done.returncode == 0, output[-6000:]
    assert counts.get("passed", 0) >= 50 and not counts.get("failed") and not counts.get("error"), output[-3000:]


def test_without_a_backend_everything_skips_with_the_reason(tmp_path: Path) -> None:
    done = _run_kit(tmp_path)
    output = done.stdout + done.stderr
    counts = _counts(output.splitlines()[-1])
    assert done.returncode == 0, output[-3000:]
    assert counts.get("skipped", 0) > 0 and not counts.get("passed") and not counts.get("failed"), output[-3000:]
    assert "no backend chosen; run with --dsp-backend NAME" in output


def test_unknown_backend_fails_clearly(tmp_path: Path) -> None:
    done = _run_kit(tmp_path, "--dsp-backend", "no_such_backend")
    output = done.stdout + done.stderr
    assert done.returncode not in (0, 5), output[-3000:]  # a usage error, not "passed" nor "nothing collected"
    assert "'no_such_backend': no installed DSP backend has that name" in output
    assert "slot_by_slot (SLOT_BY_SLOT" in output and "emulated_replay (EMULATED_REPLAY" in output
