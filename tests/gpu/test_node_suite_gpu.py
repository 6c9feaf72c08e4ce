"""ONNX's node cases with modes cuda_graphs and triton on a GPU: counts per status asserted, the
report kept as JSON.

Targets (issue 15): no wrong output, at least 1,750 correct. The JSON goes to
``$OUT/node_suite_<mode>.json`` when OUT is set (the GPU run's output folder), else to
``benchmarks/results/node_suite_<mode>.json``. Equivalent command:
``python scripts/node_suite.py --mode cuda_graphs --json $OUT/node_suite_cuda_graphs.json``
(TRITON compiles a kernel per fusion group, so its run is split over processes: ``--jobs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    monkeypatch.delenv("DSP_CAPTURE_FAULT", raising=False)


def test_node_suite_on_cuda_graphs_meets_its_targets() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from node_suite import load_cases, run_mode

    cases = load_cases()
    report = run_mode(cases, "cuda_graphs", runs=5)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_suite_cuda_graphs.json").write_text(json.dumps(report, indent=1))
    counts = report["counts"]
    print(json.dumps(counts))
    wrong = {n: r["reason"] for n, r in report["cases"].items() if r["status"] == "wrong"}
    assert counts["wrong"] == 0, wrong
    assert counts["correct"] >= 1750, counts


def test_node_suite_on_triton_meets_its_targets() -> None:
    """The same targets with every fusion group a generated kernel (checked, demoted when it disagrees)."""
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    path = out / "node_suite_triton.json"
    jobs = str(max(1, min(14, (os.cpu_count() or 2) - 2)))
    cmd = [sys.executable, str(ROOT / "scripts" / "node_suite.py"), "--mode", "triton", "--jobs", jobs]
    done = subprocess.run([*cmd, "--json", str(path)], capture_output=True, text=True, timeout=1200)
    assert path.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(path.read_text())
    counts = report["counts"]
    print(json.dumps(counts))
    wrong = {n: r["reason"] for n, r in report["cases"].items() if r["status"] == "wrong"}
    assert counts["wrong"] == 0, wrong
    assert counts["correct"] >= 1750, counts
