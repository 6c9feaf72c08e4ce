"""Greedy decode blocks captured as one CUDA graph (block_capture=True) on the GPU.

Written with the feature, run on a GPU machine by `make gpu-test`; on a CPU machine it
skips like every GPU test. The same checks pass on the CPU (tests/test_llm_block.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsp_core.llm import GenerationPipeline
from dsp_core.runtime.lifecycle import PlanPhase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"])
def test_block_of_k_tokens_is_one_replay_on_the_gpu(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="cuda_graphs", block_size=8,
                              block_capture=True)
    pipe.generate(golden["prompt"], 8)  # warm-up of both plans
    block = pipe._blocks[(1, 8)]
    assert block.resolved_backends() == ["cuda_graphs"] and block.dsp.phase is PlanPhase.REPLAYING
    before, step_before = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    result = pipe.generate(golden["prompt"], 1 + 3 * 8)
    assert result.token_list() == [int(t) for t in golden["greedy_tokens"][:25]]
    after, step_after = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    assert after["replays"] - before["replays"] == 3 and after["recaptures"] == 0
    assert step_after["executions"] == step_before["executions"]
