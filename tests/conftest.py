"""Shared fixtures: small graphs built with the builder, and paths to committed fixtures."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from dsp_cpu_ref.plugin import EmulatedReplayBackend
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp

FIXTURES = Path(__file__).parent / "fixtures"

# Tests never touch the user's disk cache: one fresh directory per test session (inherited
# by the CLI subprocesses the tests start), removed when the session's process ends (each
# `make test` left ~100 MB of plans and runtime caches behind in the temp directory).
os.environ["DSP_CACHE_DIR"] = _SESSION_CACHE = tempfile.mkdtemp(prefix="dsp-test-cache-")
atexit.register(shutil.rmtree, _SESSION_CACHE, True)
# The suite tests the core against the reference: the CPU segment runtimes (dsp-openvino,
# dsp-onnxruntime, installed by `make test`) stay out of AUTO unless a test asks for them
# (tests/test_openvino*.py, tests/test_onnxruntime*.py, tests/test_measured_auction.py and the
# conformance kit run them by name).
os.environ.setdefault("DSP_AUTO_EXCLUDE", "openvino,onnxruntime,numpy_replay")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``dsp`` command in a fresh interpreter, as a user runs it (output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


# -- ONNX models the cache and CLI tests write to files -------------------------------------
CACHE_X = np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128)


def weight_matmul_model(scale: float, batch: int | str = 1) -> onnx.ModelProto:
    """y = x @ W with W (128x256 float32, 128 KiB: stored as a weight file) all ``scale``."""
    w = numpy_helper.from_array(np.full((128, 256), scale, np.float32), name="W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 256])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def weight_matmul_expected(scale: float) -> np.ndarray:
    """What ``weight_matmul_model(scale)`` gives for ``CACHE_X``."""
    return CACHE_X @ np.full((128, 256), scale, np.float32)


def write_tiny_mlp(path: Path) -> Path:
    """x[n, 3] -> MatMul(w) -> Relu -> y[n, 4], opset 18, saved at ``path``."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


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


class PlacingEmulated(EmulatedReplayBackend):
    """cpu_ref's capture with a device's staging hook: it allocates its feeds' buffers and fills them."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[np.ndarray] = []
        self.fills = 0

    def stage_buffer(self, value: Any) -> Any:
        buf = np.empty(value.shape, dtype=value.dtype)
        self.made.append(buf)
        return buf

    def stage_into(self, buffer: Any, value: Any) -> None:
        self.fills += 1
        buffer[...] = value


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
