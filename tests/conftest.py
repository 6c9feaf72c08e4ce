"""Shared fixtures: small graphs built with the builder, and paths to committed fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import dsp_core as dsp

FIXTURES = Path(__file__).parent / "fixtures"

# Tests never touch the user's disk cache: one fresh directory per test session (inherited
# by the CLI subprocesses the tests start).
os.environ["DSP_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsp-test-cache-")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``dsp`` command in a fresh interpreter, as a user runs it (output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def mlp_graph() -> dsp.Graph:
    """x[batch, 8] -> MatMul -> Add -> Relu -> MatMul -> y[batch, 4]."""
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder("mlp")
    x = g.placeholder("x", "float32", ["batch", 8])
    w1 = g.constant(rng.standard_normal((8, 16)).astype(np.float32), name="w1")
    b1 = g.constant(rng.standard_normal(16).astype(np.float32), name="b1")
    w2 = g.constant(rng.standard_normal((16, 4)).astype(np.float32), name="w2")
    h = g.Relu(g.MatMul(x, w1) + b1)
    g.output(g.MatMul(h, w2), "y")
    return g.build()


def mlp_reference(graph: dsp.Graph, x: np.ndarray) -> np.ndarray:
    """The MLP in plain numpy."""
    w = graph.initializers
    return np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"]


@pytest.fixture
def test_backends(monkeypatch: pytest.MonkeyPatch):
    """Enable the test distribution's backends (null, eltwise) for one test."""
    from dsp_core.backends import discovery

    monkeypatch.setenv("DSP_TEST_BACKENDS", "1")
    yield discovery.discover(refresh=True)
    monkeypatch.delenv("DSP_TEST_BACKENDS")
    discovery.discover(refresh=True)


# -- the ONNX node suite's report line (passed / excluded / failed), at the end of a run ------
_NODE_SUITE: dict[str, int] = {"passed": 0, "failed": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "test_onnx_node_suite.py::test_node_case" in report.nodeid:
        _NODE_SUITE["passed" if report.passed else "failed"] += 1


def pytest_terminal_summary(terminalreporter: object) -> None:
    if _NODE_SUITE["passed"] or _NODE_SUITE["failed"]:
        from conformance.exclusions import EXCLUDED

        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"ONNX node suite: {_NODE_SUITE['passed']} passed, {len(EXCLUDED)} excluded, {_NODE_SUITE['failed']} failed"
        )
