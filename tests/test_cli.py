"""The `dsp` command, run as a real subprocess: output, JSON and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli as dsp
from conftest import write_tiny_mlp
from onnx import TensorProto, helper


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """The tiny MLP (conftest.write_tiny_mlp), written once for this module."""
    return write_tiny_mlp(tmp_path_factory.mktemp("m") / "tiny.onnx")


def test_version() -> None:
    from dsp_core import __version__

    out = dsp("--version")
    assert out.returncode == 0 and __version__ in out.stdout


def test_backends_list_json() -> None:
    out = dsp("backends", "list", "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    ref = next(b for b in table["backends"] if b["name"] == "slot_by_slot")
    assert ref["available"] and ref["distribution"] == "dsp-cpu-ref" and ref["auto_position"] == 1
    assert table["auto"] == ["slot_by_slot"]
    assert {f["entry_point"] for f in table["failures"]} == {"test_broken_import"}
    enabled = json.loads(dsp("backends", "list", "--json", env={"DSP_TEST_BACKENDS": "1"}).stdout)
    assert {f["entry_point"] for f in enabled["failures"]} == {"test_broken_import", "test_broken_hook"}
    assert enabled["auto"] == ["test_eltwise", "test_null", "slot_by_slot"]


def test_backends_list_table() -> None:
    out = dsp("backends", "list")
    assert out.returncode == 0
    assert "AUTO resolves to: slot_by_slot" in out.stdout
    assert "test backend: set DSP_TEST_BACKENDS=1" in out.stdout


def test_run_with_inputs_and_json(model_path: Path, tmp_path: Path) -> None:
    x = np.array([[1, 2, 3]], np.float32)
    np.save(tmp_path / "x.npy", x)
    out = dsp("run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}", "--json", "--save", str(tmp_path / "o"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["backends"] == ["slot_by_slot"] and report["outputs"]["y"]["shape"] == [1, 4]
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    np.testing.assert_allclose(np.load(tmp_path / "o" / "y.npy"), np.maximum(x @ w, 0), rtol=1e-6)


def test_run_random_inputs_with_dims(model_path: Path) -> None:
    out = dsp("run", str(model_path), "--random-inputs", "--dim", "n=5", "--mode", "slot_by_slot")
    assert out.returncode == 0, out.stderr
    assert "(5, 4)" in out.stdout


def test_plan_show_and_explain(model_path: Path) -> None:
    out = dsp("plan", "show", str(model_path), "--json")
    table = json.loads(out.stdout)
    assert [s["op"] for s in table["slots"]] == ["MatMul", "Relu"]
    assert table["slots"][0]["outputs"][0]["released_at"] == 1
    assert table["slots"][1]["outputs"][0]["shape"] == "[n, 4]"
    assert set(table["cache"]) >= {"plan_builds", "memory_hits", "disk_hits", "evictions", "quarantines"}
    assert "elementwise" in dsp("plan", "show", str(model_path)).stdout
    expl = json.loads(dsp("plan", "explain", str(model_path), "--json").stdout)
    assert expl["segments"][0]["backend"] == "slot_by_slot"


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "/nonexistent.onnx", "--random-inputs"], "does not exist"),
        (["run", "{garbage}", "--random-inputs"], "not a valid ONNX model"),
        (["run", "{model}", "--input", "q={x}"], "unknown input 'q'"),
        (["run", "{model}", "--input", "x={x64}"], "dtype float64 given, model expects float32"),
        (["run", "{model}", "--input", "x={bad_shape}"], "dimension 1 is 5, model expects 3"),
        (["run", "{model}", "--random-inputs", "--mode", "warp"], "unknown execution mode"),
    ],
)
def test_errors_exit_2_with_one_line(model_path: Path, tmp_path: Path, args: list[str], message: str) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(np.random.default_rng(1).bytes(2048))
    files = {"x": tmp_path / "x.npy", "x64": tmp_path / "x64.npy", "bad_shape": tmp_path / "bad.npy"}
    np.save(files["x"], np.ones((1, 3), np.float32))
    np.save(files["x64"], np.ones((1, 3), np.float64))
    np.save(files["bad_shape"], np.ones((1, 5), np.float32))
    subst = {"garbage": str(garbage), "model": str(model_path), **{k: str(v) for k, v in files.items()}}
    out = dsp(*[a.format(**subst) for a in args])
    assert out.returncode == 2, (out.stdout, out.stderr)
    err = [line for line in out.stderr.splitlines() if line.startswith("dsp: error:")]
    assert len(err) == 1 and message in err[0], out.stderr
    assert "Traceback" not in out.stderr


def test_ops_list_json() -> None:
    out = dsp("ops", "list", "--json", env={"DSP_TEST_BACKENDS": "1"})
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    ops = {(r["domain"], r["op"]): r for r in table["ops"]}
    assert len(ops) > 190
    add, matmul, shape = ops[("ai.onnx", "Add")], ops[("ai.onnx", "MatMul")], ops[("ai.onnx", "Shape")]
    assert "ELEMENTWISE" in add["traits"] and "SHAPE_ONLY_OUTPUT" in shape["traits"]
    assert add["backends"]["slot_by_slot"] is True and add["backends"]["test_eltwise"] is True
    assert "not elementwise" in matmul["backends"]["test_eltwise"]
    assert ops[("ai.onnx", "If")]["traits"] == ["CONTROL_FLOW"]
    assert "unavailable" in add["backends"]["test_bad_probe"]


def test_gpu_mode_on_cpu_machine_is_remapped_loudly(model_path: Path) -> None:
    out = dsp("run", str(model_path), "--random-inputs", "--mode", "triton", "--json")
    assert out.returncode == 0, out.stderr
    assert "remapped to EMULATED_REPLAY" in out.stderr
    assert "mode TRITON is unavailable here (triton: " in out.stderr  # dsp-triton installed, says why not
    assert json.loads(out.stdout)["backends"] == ["emulated_replay"]


def test_unknown_op_exits_2_naming_the_node(tmp_path: Path) -> None:
    node = helper.make_node("FancyOp", ["x"], ["y"], name="fancy_1", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "fancy.onnx"
    onnx.save(model, str(path))
    out = dsp("run", str(path), "--random-inputs")
    assert out.returncode == 2
    assert 'FancyOp node "fancy_1"' in out.stderr and "Traceback" not in out.stderr


def test_random_inputs_for_a_kv_decoder_are_consistent() -> None:
    from conftest import FIXTURES

    out = dsp(
        "run", str(FIXTURES / "gpt2_eager.onnx"), "--random-inputs", "--dim", "past=5", "--dim", "seq=3", "--json"
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["outputs"]["present.0.key"]["shape"] == [1, 4, 8, 16]  # past 5 + 3 new tokens
    assert dsp("plan", "show", str(FIXTURES / "gpt2_eager.onnx"), "--runs", "3").returncode == 0
