"""dsp-onnxruntime on ONNX Runtime's CUDA provider (onnxruntime-gpu): right against the reference,
bound once to device buffers, replayed, and split with the CPU reference where an op needs it.

Skipped, with the reason, where onnxruntime-gpu is not installed (the GPU image's onnxruntime is
the CPU build; ``scripts/gpu_setup.sh`` installs a carried onnxruntime-gpu wheel when there is one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

import dsp_core as dsp
from dsp_core.backends.discovery import discover

from .fused_checks import outputs_close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _backend() -> Any:
    return next(b for b in discover().backends if b.name == "onnxruntime-cuda")


@pytest.fixture(autouse=True)
def _needs_the_cuda_provider(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    avail = _backend().availability()
    if not avail.ok:
        pytest.skip(f"onnxruntime-cuda is unavailable here: {avail.reason}")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def _close(got: dict[str, Any], want: dict[str, np.ndarray], what: str) -> None:
    outputs_close(got, want, _backend().contract.tolerance, what)


def _replayed(model: dsp.CompiledModel) -> list[Any]:
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime.phase.name == "REPLAYING", runtime.phase
    return [u for u in runtime.units if u.backend.name == "onnxruntime-cuda"]


def test_the_cuda_provider_runs_the_session() -> None:
    from dsp_onnxruntime.segment import cuda_probe

    assert cuda_probe() is None
    assert _backend().platform == "cuda"


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_sdpa23"])
def test_decoder_steps_match_the_reference_and_replay_on_device_buffers(name: str) -> None:
    import cupy as cp

    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="onnxruntime", strict=True)
    assert model.resolved_backends() == ["onnxruntime-cuda"], model.explain()
    for step in (0, 1):
        feeds = {n: golden[f"step{step}.{n}"] for n in model.input_names}
        want = ref.run(feeds)
        for i in range(8):  # eager, freeze, warm, capture, replays
            _close(model.run(feeds), want, f"{name} step {step} run {i}")
        units = _replayed(model)
        assert units and all(u.counters.captures >= 1 for u in units)
        before = sum(u.counters.replays for u in units)
        for _ in range(4):
            _close(model.run(feeds), want, f"{name} step {step} steady")
        assert sum(u.counters.replays for u in units) >= before + 4
        # the session reads and writes device memory: its bound outputs are CuPy arrays
        segment = units[0].compiled
        assert any(isinstance(b, cp.ndarray) for b in segment._bound_outputs)


def test_new_inputs_each_step_are_read_not_the_bound_copy() -> None:
    """A host feed is staged into a device buffer each step (ONNX Runtime's own bind of a host
    array copies it once, at bind time: a replay would read the first step's values)."""
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder("mlp")
    x = g.placeholder("x", "float32", ["batch", 8])
    w = g.constant(rng.standard_normal((8, 16)).astype(np.float32), name="w")
    g.output(g.Relu(g.MatMul(x, w)), "y")
    graph = g.build()
    model = dsp.compile(graph, mode="onnxruntime", strict=True)
    ref = dsp.compile(graph, mode="slot_by_slot")
    for i in range(12):
        feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
        _close(model.run(feeds), ref.run(feeds), f"run {i}")
    assert sum(u.counters.replays for u in _replayed(model)) >= 6


def test_a_plan_split_with_the_reference_copies_only_what_the_cpu_reads() -> None:
    """A Binarizer (ai.onnx.ml: only the reference has it) between two products: the first
    session's output goes to the host for it, the second session reads the host result."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder("split")
    x = g.placeholder("x", "float32", ["batch", 16])
    h = g.Relu(g.MatMul(x, g.constant(rng.standard_normal((16, 16)).astype(np.float32), name="w1")))
    b = g.op("Binarizer", h, domain="ai.onnx.ml", threshold=0.5)
    w2 = g.constant(rng.standard_normal((16, 4)).astype(np.float32), name="w2")
    y = g.MatMul(g.Cast(b, to=TensorProto.FLOAT), w2)
    g.output(y, "y")
    graph = g.build()
    model = dsp.compile(graph, mode="onnxruntime")
    assert set(model.resolved_backends()) == {"onnxruntime-cuda", "slot_by_slot"}, model.explain()
    ref = dsp.compile(graph, mode="slot_by_slot")
    for i in range(10):
        feeds = {"x": rng.standard_normal((3, 16)).astype(np.float32)}
        _close(model.run(feeds), ref.run(feeds), f"run {i}")
    units = _replayed(model)
    assert len(units) == 2 and all(u.counters.replays >= 3 for u in units)
    first = min(units, key=lambda u: u.compiled.segment.index).compiled
    assert first.host_outputs, "the output the reference reads was not kept on the host"


def test_the_cnn_matches_the_reference() -> None:
    model = dsp.compile(FIXTURES / "cnn.onnx", mode="onnxruntime", strict=True)
    ref = dsp.compile(FIXTURES / "cnn.onnx", mode="slot_by_slot")
    rng = np.random.default_rng(5)
    for i in range(8):
        feeds = {"input": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
        _close(model.run(feeds), ref.run(feeds), f"cnn run {i}")
    assert _replayed(model)


def test_a_binding_replays_the_steady_program() -> None:
    """The sessions compute deterministically, so a unit's outputs are checked only on its first
    runs and the plan settles into its steady program: ``bind`` then replays without copies."""
    golden = np.load(FIXTURES / "gpt2_sdpa23.golden.npz")
    model = dsp.compile(FIXTURES / "gpt2_sdpa23.onnx", mode="onnxruntime", strict=True)
    ref = dsp.compile(FIXTURES / "gpt2_sdpa23.onnx", mode="slot_by_slot")
    feeds = {n: golden[f"step1.{n}"] for n in model.input_names}
    binding = model.bind(feeds)
    assert binding.bound
    for _ in range(3):
        _close(binding.run(), ref.run(feeds), "bound")
