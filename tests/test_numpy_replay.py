"""NUMPY_REPLAY (dsp-cpu-ref): the reference kernels captured as one generated function.

It promises the reference's bits (tolerance 0): every fixture run through it equals
slot_by_slot exactly, step after step, with the steady replay on. Its in-place forms
(``out=``) are taken only where the capture saw them give the reference kernel's bits;
segments it cannot hold in fixed buffers it declines, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, mlp_reference
from dsp_cpu_ref.numpy_replay import NUMPY_REPLAY_MAX_BYTES, NumpyReplaySegment, into_form
from test_conformance_kit import _counts, _run_kit

import dsp_core as dsp
from dsp_core.runtime.plan_runtime import PlanRuntime

DECODERS = ("gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23")


@pytest.fixture(autouse=True)
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def _units(model: dsp.CompiledModel) -> list[NumpyReplaySegment]:
    assert model.last_live is not None and isinstance(model.last_live.runtime, PlanRuntime)
    return [u.compiled for u in model.last_live.runtime.units if isinstance(u.compiled, NumpyReplaySegment)]


def _bits_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key in want:
        a, b = np.asarray(got[key]), np.asarray(want[key])
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.tobytes() == b.tobytes(), f"{key}: not the reference's bits (max diff {np.abs(a - b).max()})"


def test_passes_the_conformance_kit(tmp_path: Path) -> None:
    done = _run_kit(tmp_path, "--dsp-backend", "numpy_replay")
    output = done.stdout + done.stderr
    counts = _counts(output.splitlines()[-1] if output.strip() else "")
    assert done.returncode == 0, output[-6000:]
    assert counts.get("passed", 0) >= 50 and not counts.get("failed") and not counts.get("error"), output[-3000:]


def test_the_mlp_replays_in_place_and_equals_the_reference(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="numpy_replay")
    reference = dsp.compile(mlp_graph, mode="slot_by_slot")
    rng = np.random.default_rng(3)
    for _ in range(8):  # freeze, capture, the steady replay
        x = rng.standard_normal((3, 8)).astype(np.float32)
        got = model.run({"x": x})
        _bits_equal(got, reference.run({"x": x}))
        np.testing.assert_allclose(got["y"], mlp_reference(mlp_graph, x), rtol=1e-5, atol=1e-5)
    (unit,) = _units(model)
    assert unit.in_place_steps == 4  # MatMul, Add, Relu, MatMul: each writes its buffer, none copies
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime._steady is not None and runtime._steady.units[0][1] is not None  # its generated replay


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_every_decoder_fixture_equals_the_reference_bit_for_bit(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    feeds = []
    for step in (0, 1):
        prefix = f"step{step}."
        fed = {k[len(prefix) :]: golden[k] for k in golden.files if k.startswith(prefix)}
        feeds.append({k: v for k, v in fed.items() if not k.startswith(("logits", "present"))})
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="numpy_replay")
    reference = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    for fed in [feeds[0]] * 4 + [feeds[1]] * 5:
        _bits_equal(model.run(fed), reference.run(fed))
    assert _units(model), "nothing ran on numpy_replay"
    assert not model.explain()["faults"], model.explain()["faults"]


def test_the_cnn_equals_the_reference_bit_for_bit() -> None:
    x = np.load(FIXTURES / "cnn.golden.npz")["input"]
    model = dsp.compile(FIXTURES / "cnn.onnx", mode="numpy_replay")
    reference = dsp.compile(FIXTURES / "cnn.onnx", mode="slot_by_slot")
    for _ in range(6):
        _bits_equal(model.run({"input": x}), reference.run({"input": x}))
    assert _units(model)


def test_a_bound_step_is_the_generated_replay_and_reads_what_was_written(mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="numpy_replay")
    rng = np.random.default_rng(5)
    with model.bind({"x": rng.standard_normal((2, 8)).astype(np.float32)}) as binding:
        assert binding.bound
        for _ in range(4):
            x = rng.standard_normal((2, 8)).astype(np.float32)
            binding.inputs["x"][...] = x
            np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-5, atol=1e-5)
    assert not binding.bound  # closed: the full path, still correct
    x = rng.standard_normal((2, 8)).astype(np.float32)
    binding.inputs["x"][...] = x
    np.testing.assert_allclose(binding.run()["y"], mlp_reference(mlp_graph, x), rtol=1e-5, atol=1e-5)


def test_into_forms_are_the_reference_s_own_numpy_calls() -> None:
    f32 = np.ones((2, 3), np.float32)
    assert into_form("Add", np.add, (f32, f32)) == (np.add, (), True)
    assert into_form("Relu", object(), (f32,)) == (np.maximum, (0,), True)
    assert into_form("MatMul", object(), (f32, f32.T.copy()))[0] is np.dot  # type: ignore[index]
    assert into_form("MatMul", object(), (f32, f32.T))[0] is np.matmul  # type: ignore[index]  (not C-ordered)
    f16 = f32.astype(np.float16)
    assert into_form("MatMul", object(), (f16, f16.T.copy())) is None  # the reference widens float16
    assert into_form("Softmax", object(), (f32,)) is None
    assert into_form("Split", np.divmod, (f32, f32)) is None  # two outputs


def test_a_form_whose_bits_differ_is_refused_at_capture() -> None:
    """The capture compares each in-place form's result with the reference kernel's: a kernel
    that is not what its op's form computes keeps the copying form, and its result."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = np.empty((2, 3), np.float32)
    not_relu = lambda x: np.abs(x) + 1  # noqa: E731  (a "Relu" slot whose kernel is something else)
    assert NumpyReplaySegment._checked_into("Relu", not_relu, (a - 3,), buf) is None
    np.testing.assert_array_equal(buf, np.abs(a - 3) + 1)
    assert NumpyReplaySegment._checked_into("Relu", lambda x: np.maximum(x, 0), (a - 3,), buf) is not None
    np.testing.assert_array_equal(buf, np.maximum(a - 3, 0))


def test_auto_declines_a_segment_too_big_for_fixed_buffers_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "openvino,onnxruntime")  # numpy_replay let in, alone
    side = int((NUMPY_REPLAY_MAX_BYTES // 4) ** 0.5) + 8
    g = dsp.GraphBuilder("big")
    x = g.placeholder("x", "float32", [side, side])
    g.output(g.Relu(g.Neg(x)), "y")
    graph = g.build()
    x_value = np.linspace(-1, 1, side * side, dtype=np.float32).reshape(side, side)
    auto = dsp.compile(graph)
    np.testing.assert_array_equal(auto.run({"x": x_value})["y"], np.maximum(-x_value, 0))
    declines = [d for s in auto.explain()["segments"] for d in s["declines"] if d["backend"] == "numpy_replay"]
    assert auto.resolved_backends() == ["slot_by_slot"], auto.resolved_backends()
    assert declines and all("MiB" in d["detail"] and "native runtime" in d["detail"] for d in declines), declines
    named = dsp.compile(graph, mode="numpy_replay")  # named, it takes the segment as it is
    for _ in range(4):
        np.testing.assert_array_equal(named.run({"x": x_value})["y"], np.maximum(-x_value, 0))
    assert named.resolved_backends() == ["numpy_replay"]


def test_a_value_dependent_shape_is_declined() -> None:
    g = dsp.GraphBuilder("nz")
    x = g.placeholder("x", "float32", [6])
    g.output(g.NonZero(x), "idx")
    model = dsp.compile(g.build(), mode="numpy_replay")
    for values in ([0, 1, 0, 2, 0, 3], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 5]):
        x_value = np.array(values, np.float32)
        np.testing.assert_array_equal(model.run({"x": x_value})["idx"], np.array(np.nonzero(x_value)))
    declines = [d for s in model.explain()["segments"] for d in s["declines"] if d["backend"] == "numpy_replay"]
    assert declines and declines[0]["reason"] == "dynamic_shape", declines


def test_auto_times_it_against_the_native_runtimes_when_let_in(
    monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph
) -> None:
    """With DSP_AUTO_EXCLUDE=none the MLP's segment is contested: the trial times numpy_replay
    too (which wins is this machine's business: not asserted), and the outputs stay right."""
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "none")
    model = dsp.compile(mlp_graph)
    rng = np.random.default_rng(9)
    for _ in range(6):
        x = rng.standard_normal((2, 8)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], mlp_reference(mlp_graph, x), rtol=1e-4, atol=1e-4)
    trials = [t for s in model.explain()["segments"] for t in s.get("trials") or []]
    assert trials and all({"numpy_replay", "slot_by_slot"} <= set(t["times_us"]) for t in trials), trials
    winner = trials[0]["winner"]
    assert model.resolved_backends() == [winner]


def test_auto_leaves_it_out_by_default(monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    monkeypatch.delenv("DSP_AUTO_EXCLUDE", raising=False)
    model = dsp.compile(mlp_graph)
    model.run({"x": np.ones((2, 8), np.float32)})
    assert model.resolved_backends() == ["slot_by_slot"]


def test_a_random_op_is_left_to_the_reference() -> None:
    g = dsp.GraphBuilder("rnd")
    x = g.placeholder("x", "float32", [4])
    g.output(g.Add(g.RandomUniformLike(x, seed=3.0), x), "y")
    model = dsp.compile(g.build(), mode="numpy_replay")
    for _ in range(3):
        assert model.run({"x": np.zeros(4, np.float32)})["y"].shape == (4,)
    declines = [d for s in model.explain()["segments"] for d in s["declines"] if d["backend"] == "numpy_replay"]
    assert any(d["op"] == "RandomUniformLike" and "random" in d["detail"] for d in declines), declines


def test_an_eager_unit_s_scalar_output_is_bridged_into_an_array() -> None:
    """Found by fuzzing this mode's capture (``FUZZ_RUNS=4``, the HammingWindow node test with a
    mutated value_info): a unit whose output broke its declared rank fell to the reference and
    ran eagerly, and its 0-d output, a numpy scalar, fed an island. Its bridge buffer was that
    scalar's copy, itself a scalar, and the next step's ``buf[...] = value`` raised TypeError."""
    import os
    import subprocess
    import sys

    case = FIXTURES / "fuzz" / "hammingwindow_scalar_gap_output_bridged_as_a_scalar.onnx"
    env = {**os.environ, "DSP_MODE": "numpy_replay", "DSP_FREEZE_AFTER": "1", "FUZZ_RUNS": "4", "DSP_DISK_CACHE": "0"}
    fuzz = Path(__file__).resolve().parents[1] / "scripts" / "fuzz.py"
    cmd = [sys.executable, str(fuzz), "--fail-on-mismatch", "--replay", str(case)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and ": ok ran" in done.stdout, done.stdout + done.stderr[-3000:]


def test_auto_times_it_against_the_reference_and_gives_the_segment_to_the_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its kernels are the reference's: alone among the bidders it is timed against the reference
    too. A segment of views (the reference returns them for free, numpy_replay copies each into
    its buffer) and one of small products: which wins is this machine's business, but the trial
    has both, the winner is the faster by its own numbers, and the outputs are right."""
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "openvino,onnxruntime")
    g = dsp.GraphBuilder("views")
    x = g.placeholder("x", "float32", [64, 256])
    t = g.Transpose(g.Reshape(x, g.constant(np.array([256, 64], np.int64), name="s")), perm=[1, 0])
    g.output(g.Reshape(t, g.constant(np.array([-1], np.int64), name="flat")), "y")
    model = dsp.compile(g.build())
    x_value = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    for _ in range(5):
        np.testing.assert_array_equal(model.run({"x": x_value})["y"], x_value.reshape(256, 64).T.reshape(-1))
    segments = model.explain()["segments"]
    contested = [(seg, t) for seg in segments for t in seg.get("trials") or []]
    assert contested, segments
    for seg, trial in contested:
        times = trial["times_us"]
        assert set(times) == {"numpy_replay", "slot_by_slot"}, times
        assert times[trial["winner"]] <= min(times.values()) * 1.05 + 1e-9
        assert seg["backend"] == trial["winner"]
