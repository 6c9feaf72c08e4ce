"""CUDA_GRAPHS islands and gaps on a GPU: erf-GELU encoders and a CNN replay, gaps carry their reasons.

Run on the GPU image: ``python -m pytest -q tests/gpu/test_islands_gpu.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.units import UnitKind

ROOT = Path(__file__).resolve().parents[2]
RUNS = 6


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")  # learned gaps are kept on disk: every test starts cold
    monkeypatch.delenv("DSP_CAPTURE_FAULT", raising=False)


def _init(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)


def erf_gelu_encoder(layers: int = 2, hidden: int = 64) -> onnx.ModelProto:
    """x[b, s, h] -> per layer: MatMul, Add, torch's erf GELU (Div, Erf, Add, Mul, Mul), MatMul, residual Add."""
    scalars = {"sqrt2": 1.4142135, "one": 1.0, "half": 0.5}
    nodes, inits = [], [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in scalars.items()]
    x = "x"
    for k in range(layers):
        inits += [_init(f"w1_{k}", (hidden, 4 * hidden), k), _init(f"b1_{k}", (4 * hidden,), 10 + k)]
        inits += [_init(f"w2_{k}", (4 * hidden, hidden), 20 + k)]
        p = f"l{k}_"
        nodes += [
            helper.make_node("MatMul", [x, f"w1_{k}"], [p + "h"]),
            helper.make_node("Add", [p + "h", f"b1_{k}"], [p + "hb"]),
            helper.make_node("Div", [p + "hb", "sqrt2"], [p + "d"]),
            helper.make_node("Erf", [p + "d"], [p + "e"]),
            helper.make_node("Add", [p + "e", "one"], [p + "e1"]),
            helper.make_node("Mul", [p + "hb", p + "e1"], [p + "m"]),
            helper.make_node("Mul", [p + "m", "half"], [p + "g"]),
            helper.make_node("MatMul", [p + "g", f"w2_{k}"], [p + "o"]),
            helper.make_node("Add", [x, p + "o"], [p + "y" if k < layers - 1 else "y"]),
        ]
        x = p + "y"
    graph = helper.make_graph(
        nodes,
        "erf_gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def small_cnn() -> onnx.ModelProto:
    """x[b, 3, 32, 32] -> Conv, Relu, MaxPool, Conv, Relu, GlobalAveragePool, Flatten, Gemm -> y[b, 10]."""
    inits = [_init("c1", (16, 3, 3, 3), 1), _init("c1b", (16,), 2), _init("c2", (32, 16, 3, 3), 3)]
    inits += [_init("c2b", (32,), 4), _init("fc", (10, 32), 5), _init("fcb", (10,), 6)]
    nodes = [
        helper.make_node("Conv", ["x", "c1", "c1b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("MaxPool", ["ar"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "c2", "c2b"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["b"], ["br"]),
        helper.make_node("GlobalAveragePool", ["br"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model_proto: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> tuple[dsp.CompiledModel, list[Any]]:
    gpu = dsp.compile(model_proto, mode="cuda_graphs")
    ref = dsp.compile(model_proto, mode="slot_by_slot")
    for f in feeds:
        got, want = gpu.run(f)["y"], ref.run(f)["y"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-3 * max(1.0, float(np.abs(want).max())))
    return gpu, gpu.dsp.runtime.units


def _feeds(shape: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(RUNS)]


def _report(model: dsp.CompiledModel) -> str:
    plan = model.dsp.runtime.plan
    return "; ".join(
        f"{u.kind.value} {u.phase.name} [{', '.join(plan.slots[s].op for s in u.segment.slots)}] {u.reason}"
        for u in model.dsp.runtime.units
    )


def test_erf_gelu_encoder_captures_whole() -> None:
    """Erf runs on the device (cupyx.scipy.special): nothing in the encoder needs a gap."""
    model, units = _run(erf_gelu_encoder(), _feeds((2, 16, 64)))
    assert model.dsp.phase is PlanPhase.REPLAYING, _report(model)
    assert all(u.kind is UnitKind.ISLAND and u.phase is SegmentPhase.REPLAYING for u in units), _report(model)
    assert model.dsp.runtime.plan.capture_gaps == {}


def test_injected_erf_faults_become_gaps_and_the_rest_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_CAPTURE_FAULT", "Erf")
    model, units = _run(erf_gelu_encoder(layers=3), _feeds((1, 8, 64)))
    assert model.dsp.phase is PlanPhase.REPLAYING, _report(model)
    gaps = [u for u in units if u.kind is UnitKind.GAP]
    plan = model.dsp.runtime.plan
    assert [plan.slots[s].op for g in gaps for s in g.segment.slots] == ["Erf"] * 3, _report(model)
    assert all("DSP_CAPTURE_FAULT" in g.reason for g in gaps)
    islands = [u for u in units if u.kind is UnitKind.ISLAND]
    assert len(islands) == 4 and all(u.phase is SegmentPhase.REPLAYING for u in islands), _report(model)
    assert model.dsp.runtime.counters()["capture_failures"] == 3  # the CUDA capture named each slot


def test_a_shape_fed_every_step_is_a_gap_with_its_reason() -> None:
    """Reshape's shape is a fed input: the real capture failure names the slot, the rest is captured."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["t"]),
        helper.make_node("Tanh", ["t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fed_shape",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [
        {"x": np.random.default_rng(i).standard_normal((4, 6)).astype(np.float32), "shape": np.array([6, 4])}
        for i in range(RUNS)
    ]
    model, units = _run(proto, feeds)
    plan = model.dsp.runtime.plan
    kinds = [(u.kind, [plan.slots[s].op for s in u.segment.slots]) for u in units]
    assert (UnitKind.GAP, ["Reshape"]) in kinds, _report(model)
    gap = next(u for u in units if u.kind is UnitKind.GAP)
    assert "shape-like input" in gap.reason
    assert model.dsp.phase is PlanPhase.REPLAYING, _report(model)


def test_small_cnn_replays() -> None:
    model, _ = _run(small_cnn(), _feeds((2, 3, 32, 32)))
    print(_report(model))  # the gaps, if any, with their reasons (-s shows them)
    assert model.dsp.phase is PlanPhase.REPLAYING, _report(model)


def test_the_split_survives_a_disk_cache_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "1")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "enc.onnx"
    onnx.save(erf_gelu_encoder(), path)
    monkeypatch.setenv("DSP_CAPTURE_FAULT", "Erf")
    cold = dsp.compile(str(path), mode="cuda_graphs")
    for f in _feeds((1, 8, 64)):
        cold.run(f)
    monkeypatch.delenv("DSP_CAPTURE_FAULT")
    warm = dsp.compile(str(path), mode="cuda_graphs")
    assert warm.stats.disk_hits == 1
    for f in _feeds((1, 8, 64)):
        warm.run(f)
    assert warm.dsp.runtime.counters()["capture_failures"] == 0
    assert sum(u.kind is UnitKind.GAP for u in warm.dsp.runtime.units) == 2
    assert warm.dsp.phase is PlanPhase.REPLAYING


# -- node cases that were wrong or failing on CUDA ---------------------------------------------------
FIXED = (
    r"^test_mod_float_edge_cases|^test_mod_mixed_sign|^test_attention_(local|bidirectional)_window.*_expanded$"
    r"|^test_range_.*_expanded$|^test_affine_grid_.*_expanded$|^test_scatter_elements_with_reduction_mul"
    r"|^test_scatternd_multiply|^test_erf$|^test_gelu"
)


def test_the_node_cases_fixed_for_cuda_are_correct() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from node_suite import load_cases, run_mode

    cases = [c for c in load_cases() if re.search(FIXED, c.name)]
    assert len(cases) >= 30
    report = run_mode(cases, "cuda_graphs", runs=5)
    bad = {n: r for n, r in report["cases"].items() if r["status"] in ("wrong", "failed")}
    assert bad == {}, bad
    mods = {n: r for n, r in report["cases"].items() if n.startswith("test_mod_float_edge")}
    assert all(r["status"] == "captured" for r in mods.values()), mods


def test_shape_of_a_computed_value_and_constant_axes_capture() -> None:
    """Shape of a computed value feeding a device op, Trilu/CumSum with constant k/axis, GridSample, Dropout
    with a constant ratio: captured whole (no host copy inside the capture), equal to slot_by_slot."""
    g = dsp.GraphBuilder("device_paths")
    x = g.placeholder("x", "float32", [2, 3, 5, 5])
    grid = g.placeholder("grid", "float32", [2, 4, 4, 2])
    t = g.op("Relu", x)
    shape = g.op("Cast", g.op("Shape", t), to=TensorProto.FLOAT)
    tri = g.op("Trilu", t, g.constant(np.array(1, np.int64)), upper=0)
    cum = g.op("CumSum", tri, g.constant(np.array(2, np.int64)))
    drop, _ = g.op("Dropout", cum, g.constant(np.array(0.5, np.float32)), outputs=2)
    sampled = g.op("GridSample", drop, grid, align_corners=1, padding_mode="border")
    g.output(g.op("Add", g.op("ReduceSum", sampled, keepdims=0), g.op("ReduceSum", shape, keepdims=0)), "y")
    built = g.build()
    rng = np.random.default_rng(3)
    feeds = [
        {
            "x": rng.standard_normal((2, 3, 5, 5)).astype(np.float32),
            "grid": rng.uniform(-1.1, 1.1, (2, 4, 4, 2)).astype(np.float32),
        }
        for _ in range(RUNS)
    ]
    want = dsp.compile(built, mode="slot_by_slot")
    model = dsp.compile(built, mode="cuda_graphs")
    for f in feeds:
        np.testing.assert_allclose(np.asarray(model.run(f)["y"]), want.run(f)["y"], rtol=1e-4, atol=1e-4)
    assert model.dsp.phase is PlanPhase.REPLAYING, _report(model)
    assert "gap" not in _report(model), _report(model)


CAPTURE_SAFE = r"^test_(lstm|gru|rnn|simple_rnn|tril|triu|cumsum|cumprod|gridsample|dropout)"


def test_recurrent_scan_and_sampling_cases_never_copy_to_the_host_inside_a_capture() -> None:
    """Their products go through the owned cuBLAS, their scalar inputs are read on the host:
    a case may still run eagerly for a real reason (an input fed every step), never for a
    host copy or a CuPy cuBLAS call inside the capture."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from node_suite import load_cases, run_mode

    cases = [c for c in load_cases() if re.search(CAPTURE_SAFE, c.name)]
    assert len(cases) >= 60
    report = run_mode(cases, "cuda_graphs", runs=5)
    bad = {n: r for n, r in report["cases"].items() if r["status"] in ("wrong", "failed")}
    assert bad == {}, bad
    host = {
        n: r["reason"]
        for n, r in report["cases"].items()
        if re.search("transfers are disallowed|cuBLAS API", r["reason"])
    }
    assert host == {}, host
