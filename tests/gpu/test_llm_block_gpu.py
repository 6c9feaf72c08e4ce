"""Greedy decode blocks captured as one CUDA graph on the GPU (the default there).

K decode steps (step, ArgMax, KV scatter, advance) are one plan, captured once and
replayed as one graph launch per K tokens; the single-step plan runs only for a last,
shorter block. The same checks run on the CPU in EMULATED_REPLAY (tests/test_llm_block.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsp_core.llm import GenerationPipeline, Sampling
from dsp_core.llm.block import block_key
from dsp_core.runtime.lifecycle import PlanPhase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"])
def test_block_of_k_tokens_is_one_replay_on_the_gpu(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(
        FIXTURES / f"{name}.onnx", max_length=64, mode="cuda_graphs", block_size=8, block_capture=True
    )
    pipe.generate(golden["prompt"], 9)  # warm-up of both plans (1 token from the prefill, 1 block)
    block = pipe._blocks[(1, 8)]
    assert block.resolved_backends() == ["cuda_graphs"] and block.dsp.phase is PlanPhase.REPLAYING
    before, step_before = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    result = pipe.generate(golden["prompt"], 1 + 3 * 8)
    assert result.token_list() == [int(t) for t in golden["greedy_tokens"][:25]]
    after, step_after = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    assert after["replays"] - before["replays"] == 3 and after["recaptures"] == 0
    assert step_after["executions"] == step_before["executions"]


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_sdpa23"])
def test_auto_on_a_gpu_decodes_in_blocks_by_default(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    want = [int(t) for t in golden["greedy_tokens"][:32]]
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="auto", block_size=8)
    assert pipe.captures_blocks(1), "decode state on the device: blocks are the default"
    assert pipe.generate(golden["prompt"], 32).token_list() == want
    block, step = pipe._blocks[(1, 8)], pipe.decode_model
    assert block.dsp.phase is PlanPhase.REPLAYING
    b0, s0 = block.dsp.runtime.counters(), step.dsp.runtime.counters()
    assert pipe.generate(golden["prompt"], 32).token_list() == want
    b1, s1 = block.dsp.runtime.counters(), step.dsp.runtime.counters()
    # 1 token from the prefill, 3 blocks of 8, then 7 single steps
    assert b1["replays"] - b0["replays"] == 3 and s1["executions"] - s0["executions"] == 7, (b0, b1, s0, s1)
    assert b1["captures"] == b0["captures"] and b1["recaptures"] == 0 and s1["recaptures"] == 0


def test_sessions_switching_on_the_gpu_keep_their_tokens() -> None:
    """Two sessions alternate blocks: each switch swaps KV prefixes into the resident
    device arrays (no re-capture of the shared block plan), each session keeps its own
    tokens, and a session continued by 5 tokens equals a fresh prefill of the whole sequence."""
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    pipe = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="auto", block_size=8)
    a, b = pipe.session(), pipe.session()
    a.append(golden["prompt"])
    b.append(np.array([[5, 6, 7]]))
    tokens = a.generate(9).token_list()
    b.generate(9)
    tokens += a.generate(8).token_list()
    assert tokens == [int(t) for t in golden["greedy_tokens"][:17]]
    assert pipe._blocks[(1, 8)].dsp.runtime.counters()["recaptures"] == 0 and pipe.swaps >= 3
    more = np.array([[3, 141, 59, 26, 535]])
    continued = a.append(more)
    fresh = pipe.session()
    reference = fresh.append(np.concatenate([golden["prompt"], np.array([tokens]), more], axis=1))
    np.testing.assert_allclose(continued, reference, rtol=2e-3, atol=2e-3 * max(1.0, float(np.abs(reference).max())))
    assert a.generate(9).token_list() == fresh.generate(9).token_list()


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_sdpa23"])
def test_sampled_blocks_on_the_gpu_choose_the_one_step_paths_tokens(name: str) -> None:
    """Sampling inside the captured block (dsp::Sample on CuPy, uniforms fed per block)."""
    prompt = np.load(FIXTURES / f"{name}.golden.npz")["prompt"]
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    one_step = GenerationPipeline(
        FIXTURES / f"{name}.onnx", max_length=64, mode="cuda_graphs", block_size=8, block_capture=False
    )
    want = one_step.generate(prompt, 1 + 3 * 8, sampling=sampling).token_list()
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="cuda_graphs", block_size=8)
    assert pipe.generate(prompt, 1 + 3 * 8, sampling=sampling).token_list() == want
    block = pipe._blocks[block_key(1, 8, sampling)]
    assert block.resolved_backends() == ["cuda_graphs"] and block.dsp.phase is PlanPhase.REPLAYING
    b0, s0 = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    assert pipe.generate(prompt, 1 + 3 * 8, sampling=sampling).token_list() == want
    b1, s1 = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    assert b1["replays"] - b0["replays"] == 3 and b1["captures"] == b0["captures"] and b1["recaptures"] == 0
    assert s1["executions"] == s0["executions"]
