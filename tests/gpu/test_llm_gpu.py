"""GenerationPipeline on the GPU: device-resident decode state, KVScatter in the captured graph.

On the four decoder fixtures, in CUDA_GRAPHS, TRITON and AUTO (which resolves to triton, or to
cuda_graphs where dsp-triton is not installed, on a
CUDA machine): torch's 32 greedy tokens; the decode plan's logits within the contract's
tolerance of cpu_ref's; REPLAYING after warm-up with one capture and no recapture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsp_core.llm import GenerationPipeline
from dsp_core.runtime.lifecycle import PlanPhase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]
MODES = ["cuda_graphs", "triton", "auto"]


def _resolves_to(mode: str) -> str:
    """The backend a mode resolves to on this CUDA machine."""
    if mode != "auto":
        return mode
    from dsp_core.backends.discovery import discover

    triton = next((b for b in discover().backends if b.name == "triton"), None)
    return "triton" if triton is not None and triton.availability().ok else "cuda_graphs"


def _golden(name: str) -> Any:
    return np.load(FIXTURES / f"{name}.golden.npz")


def _tolerance() -> float:
    from dsp_triton.plugin import TritonBackend

    return TritonBackend().contract.tolerance  # the looser of the two CUDA contracts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_tokens_on_device_replaying(name: str, mode: str) -> None:
    import cupy as cp

    g = _golden(name)
    want = g["greedy_tokens"][:32].tolist()
    # one replay per token here; K-step block plans (the default on a device): test_llm_block_gpu.py
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode=mode, block_size=8, block_capture=False)
    decoder = pipe.decoder(1)
    assert decoder.model.resolved_backends() == [_resolves_to(mode)]
    assert decoder.xp is cp, "the decode state must live on the device"
    assert decoder.model.outputs_on_device
    result = pipe.generate(g["prompt"], 32)
    assert result.tokens[0].tolist() == want, f"{name} {mode}: tokens differ from torch's"
    state = pipe._session(1).state
    assert all(isinstance(b, cp.ndarray) for b in state.buffers.values())
    assert isinstance(state.input_ids, cp.ndarray) and isinstance(state.attention_mask, cp.ndarray)
    model = pipe.decode_model
    assert model.dsp.phase is PlanPhase.REPLAYING
    c0 = model.dsp.runtime.counters()
    assert c0["recaptures"] == 0 and c0["staging_copies"] == 0, c0
    pointers = {n: int(b.data.ptr) for n, b in state.buffers.items()}
    again = pipe.generate(g["prompt"], 32)  # a second generation: replays only
    assert again.tokens[0].tolist() == want
    c1 = model.dsp.runtime.counters()
    assert c1["captures"] == c0["captures"], (c0, c1)
    assert c1["recaptures"] == 0 and c1["staging_copies"] == 0, c1
    assert c1["replays"] - c0["replays"] >= 31, (c0, c1)
    assert {n: int(b.data.ptr) for n, b in state.buffers.items()} == pointers
    assert model.dsp.phase is PlanPhase.REPLAYING


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DECODERS)
def test_decode_logits_match_cpu_ref(name: str, mode: str) -> None:
    g = _golden(name)
    tokens = g["greedy_tokens"].tolist()
    gpu = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode=mode).session()
    ref = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="slot_by_slot").session()
    tol = _tolerance()
    a, b = gpu.append(g["prompt"]), ref.append(g["prompt"])  # the prefill plans
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())), err_msg="prefill")
    for step in range(6):  # one-token appends run the decode plans (freeze, warm, capture, replay on the GPU)
        a, b = gpu.append([tokens[step]]), ref.append([tokens[step]])
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=f"{name} {mode} decode step {step}")
        assert int(np.argmax(a[0])) == tokens[step + 1]


def test_host_fed_kv_buffers_are_written_back() -> None:
    """A decode plan on CUDA_GRAPHS fed numpy state: KVScatter's write reaches the caller's arrays."""
    name = "gpt2_eager"
    g = _golden(name)
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="cuda_graphs")
    decoder = pipe.decoder(1)
    decoder.xp = np  # what a partition with host readers would choose
    decoder.model.outputs_on_device = False
    result = pipe.generate(g["prompt"], 32)
    assert result.tokens[0].tolist() == g["greedy_tokens"][:32].tolist()
    state = pipe._session(1).state
    assert all(isinstance(b, np.ndarray) for b in state.buffers.values())
    assert any(float(np.abs(b[:, :, :8]).max()) > 0 for b in state.buffers.values())
