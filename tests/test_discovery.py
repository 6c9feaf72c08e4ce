"""Discovery through real entry points, failure isolation, the AUTO chain and the auction."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.backends.discovery import discover
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import BackendError, BackendUnavailableError, ConfigError


def test_cpu_ref_registers_through_entry_points() -> None:
    reg = discover()
    ref = {b.name: b for b in reg.backends if b.distribution == "dsp-cpu-ref"}
    assert set(ref) == {"slot_by_slot", "emulated_replay", "numpy_replay", "shape_inference_only"}
    assert ref["slot_by_slot"].mode is GraphExecutionMode.SLOT_BY_SLOT
    assert ref["slot_by_slot"].version == "0.1.0"
    assert ref["slot_by_slot"].availability().ok


def test_broken_plugins_are_recorded_and_isolated(test_backends) -> None:
    reg = test_backends
    failures = {f.entry_point: f for f in reg.failures}
    assert failures["test_broken_import"].stage == "import"
    assert "fails on purpose" in failures["test_broken_import"].error
    assert failures["test_broken_hook"].stage == "hook"
    assert failures["test_broken_hook"].distribution == "dsp-test-backends"
    # the healthy plugins of the same distribution still loaded
    assert {"test_null", "test_eltwise", "test_bad_probe"} <= {b.name for b in reg.backends}


def test_probe_that_raises_is_unavailable_with_reason() -> None:
    bad = next(b for b in discover().backends if b.name == "test_bad_probe")
    avail = bad.availability()
    assert not avail.ok and "probe exploded" in avail.reason


def test_test_backends_off_by_default(mlp_graph: dsp.Graph) -> None:
    assert dsp.compile(mlp_graph).resolved_backends() == ["slot_by_slot"]


def test_auto_cuts_segments_around_a_partial_backend(test_backends, mlp_graph: dsp.Graph) -> None:
    from dsp_test_backends.null import EltwiseSegment

    model = dsp.compile(mlp_graph)
    report = model.explain()
    assert report["chain"][:2] == ["test_eltwise", "test_null"]
    owners = [(s["backend"], s["n_slots"]) for s in report["segments"]]
    # MatMul | Add Relu | MatMul | Identity
    assert owners == [("slot_by_slot", 1), ("test_eltwise", 2), ("slot_by_slot", 1), ("test_eltwise", 1)]
    declines = report["segments"][0]["declines"]
    assert {d["backend"] for d in declines} == {"test_eltwise", "test_null"}
    assert all(d["reason"] == "unsupported_op" for d in declines)
    before = EltwiseSegment.runs
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], model.run_legacy({"x": x})["y"])
    assert EltwiseSegment.runs == before + 2
    assert report["fallback_fraction"] == pytest.approx(2 / 5)


def test_strict_auto_refuses_fallback(test_backends, mlp_graph: dsp.Graph) -> None:
    with pytest.raises(BackendError, match="strict AUTO"):
        dsp.compile(mlp_graph, strict=True)


def test_mode_nobody_installed_names_the_distribution(mlp_graph: dsp.Graph) -> None:
    with pytest.raises(BackendUnavailableError, match="no distribution of this repository provides MLX yet"):
        dsp.compile(mlp_graph, mode="mlx")
    with pytest.raises(BackendUnavailableError, match="no distribution of this repository provides METAL yet"):
        dsp.compile(mlp_graph, mode="metal")


def test_installed_but_unavailable_mode_says_why(mlp_graph: dsp.Graph) -> None:
    with pytest.raises(BackendUnavailableError, match="set DSP_TEST_BACKENDS=1"):
        dsp.compile(mlp_graph, mode="acl")


def test_unknown_mode_lists_allowed(mlp_graph: dsp.Graph) -> None:
    with pytest.raises(ConfigError, match="slot_by_slot"):
        dsp.compile(mlp_graph, mode="warp_drive")


def test_every_mode_of_the_seed_exists() -> None:
    names = {m.name for m in GraphExecutionMode}
    assert names == {
        "AUTO",
        "SLOT_BY_SLOT",
        "CUDA_GRAPHS",
        "TRITON",
        "NVRTC_JIT",
        "PTX_JIT",
        "EMULATED_REPLAY",
        "NUMPY_REPLAY",
        "SHAPE_INFERENCE_ONLY",
        "HIP_GRAPHS",
        "LEVEL_ZERO",
        "VULKAN",
        "METAL",
        "MLX",
        "NNAPI",
        "ARM_HYBRID",
        "MLIR_CPU_JIT",
        "ONEDNN",
        "OPENVINO",
        "ONNXRUNTIME",
        "ACL",
    }


def test_dynamic_output_size_and_control_flow_end_segments() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [6])
    nz = g.NonZero(g.Relu(x))  # DYNAMIC_OUTPUT_SIZE: its size is known only after it runs
    g.output(g.Neg(g.Cast(nz, to=1)), "y")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    segments = [s["slots"] for s in model.explain()["segments"]]
    assert segments == [[0, 1], [2, 4]]  # Relu NonZero | Cast Neg Identity
    x_val = np.array([1, -1, 2, 0, 3, -2], np.float32)
    np.testing.assert_array_equal(model.run({"x": x_val})["y"], -np.array([[0, 2, 4]], np.float32))


def test_disabled_plugins_are_skipped_as_if_not_installed() -> None:
    from conftest import run_cli

    table = json.loads(run_cli("backends", "list", "--json", env={"DSP_DISABLE_PLUGINS": "openvino"}).stdout)
    names = {r["name"] for r in table["backends"]}
    assert "openvino" not in names and "onnxruntime" in names and "slot_by_slot" in names
    assert table["failures"] == [] or all(f["entry_point"] != "openvino" for f in table["failures"])
