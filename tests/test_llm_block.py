"""Greedy decode blocks of K steps as one plan (dsp_core/llm/block.py): one replay per K tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp
from dsp_core.llm import GenerationPipeline, Sampling
from dsp_core.llm.block import TOKENS, BlockUnrollError, block_key, unroll
from dsp_core.llm.kv import fixed_kv_buffers
from dsp_core.llm.sampling import Sampler
from dsp_core.ops.registry import Trait
from dsp_core.runtime.lifecycle import PlanPhase

DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def test_unrolled_graph_chains_k_copies() -> None:
    graph = dsp.compile(FIXTURES / "gpt2_eager.onnx").graph
    fixed = fixed_kv_buffers(graph, batch=1, max_length=32)
    block = unroll(fixed, 4)
    assert block.output_names == [TOKENS] and block.outputs[0].shape == (1, 4)
    assert {v.name for v in block.inputs} == {v.name for v in fixed.graph.inputs}
    scatters = [n for n in block.nodes if n.op_type == "KVScatter"]
    assert len(scatters) == 4 * len(fixed.growth)
    # copy 1 writes the buffer through copy 0's alias, and reads copy 0's token
    one = [n for n in scatters if n.name.startswith("b1/")][0]
    assert one.inputs[0].startswith("b0/")
    assert any(n.op_type == "Add" and n.name == "b1/dsp_advance_position" for n in block.nodes)
    with pytest.raises(BlockUnrollError):
        unroll(fixed, 0)


@pytest.mark.parametrize("mode", ["emulated_replay", "slot_by_slot"])
@pytest.mark.parametrize("name", DECODERS)
def test_block_capture_gives_torchs_greedy_tokens(name: str, mode: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode=mode, block_capture=True)
    result = pipe.generate(golden["prompt"], 32)
    assert result.token_list() == [int(t) for t in golden["greedy_tokens"][:32]]
    block = pipe._blocks[(1, pipe.block_size)]
    want = PlanPhase.REPLAYING if mode == "emulated_replay" else PlanPhase.REPLAY_BLOCKED
    assert block.dsp.phase is want


def test_one_replay_per_block_and_no_per_step_runs() -> None:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    pipe = GenerationPipeline(
        FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=8, block_capture=True
    )
    pipe.generate(golden["prompt"], 9)  # warm-up of both plans (1 token from the prefill, 1 block)
    block, step = pipe._blocks[(1, 8)], pipe.decode_model
    before_block, before_step = block.dsp.runtime.counters(), step.dsp.runtime.counters()
    result = pipe.generate(golden["prompt"], 1 + 3 * 8)  # one token from the prefill, then 3 full blocks
    assert result.token_list() == [int(t) for t in golden["greedy_tokens"][:25]]
    after_block, after_step = block.dsp.runtime.counters(), step.dsp.runtime.counters()
    assert after_block["replays"] - before_block["replays"] == 3
    assert after_block["captures"] == before_block["captures"] and after_block["recaptures"] == 0
    assert after_step["executions"] == before_step["executions"]  # no single-step run at all


def test_sampled_generation_keeps_the_per_step_path() -> None:
    from dsp_core.llm import Sampling

    pipe = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_capture=True)
    a = pipe.generate(np.array([17, 402, 93]), 10, sampling=Sampling(temperature=0.8, seed=3)).token_list()
    b = pipe.generate(np.array([17, 402, 93]), 10, sampling=Sampling(temperature=0.8, seed=3)).token_list()
    assert a == b and len(a) == 10


@pytest.mark.parametrize("name", DECODERS)
def test_shape_computations_are_not_repeated_so_the_block_seals_like_a_step(name: str) -> None:
    """Copies i >= 1 read copy 0's shape-static values: every shape a kernel reads on the host
    is sealed at freeze, as in the single-step plan (a shape computed every step cannot be
    held in a CUDA graph)."""
    graph = dsp.compile(FIXTURES / f"{name}.onnx").graph
    fixed = fixed_kv_buffers(graph, batch=1, max_length=32)
    block = unroll(fixed, 4)
    shapes = sum(n.op_type in ("Shape", "Size") for n in fixed.graph.nodes)
    assert shapes and sum(n.op_type in ("Shape", "Size") for n in block.nodes) == shapes
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="emulated_replay", block_capture=True)
    pipe.generate(golden["prompt"], 9)
    step, blk = pipe.decode_model.last_live.runtime, pipe._blocks[(1, pipe.block_size)].last_live.runtime
    assert blk.sealed and len(blk.sealed) == len(step.sealed)
    for slot in blk.plan.slots:
        if slot.traits & Trait.SHAPE_ONLY_OUTPUT:
            reads = [r for r in slot.inputs if r is not None and r >= 0]
            assert slot.index in blk.sealed or not reads, f"{slot.name} reads a live value's shape every step"


def test_blocks_are_the_default_only_where_the_state_lives_on_a_device() -> None:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    default = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay")
    assert not default.captures_blocks(1)  # numpy state: a block replay saves nothing on the CPU
    assert default.generate(golden["prompt"], 12).token_list() == [int(t) for t in golden["greedy_tokens"][:12]]
    assert default._blocks == {}
    forced = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_capture=True)
    assert forced.captures_blocks(1)
    off = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_capture=False)
    assert not off.captures_blocks(1)


SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)


@pytest.mark.parametrize("name", DECODERS)
def test_sampled_blocks_give_the_one_step_paths_tokens(name: str) -> None:
    """The token is drawn inside the block plan (dsp::Sample, the block's uniforms fed):
    with the same seed, blocks and one-step decoding choose the same tokens."""
    prompt = np.load(FIXTURES / f"{name}.golden.npz")["prompt"]
    runs = {}
    for blocks in (False, True):
        pipe = GenerationPipeline(
            FIXTURES / f"{name}.onnx", max_length=64, mode="emulated_replay", block_size=8, block_capture=blocks
        )
        runs[blocks] = pipe.generate(prompt, 1 + 3 * 8, sampling=SAMPLED).token_list()
    assert runs[True] == runs[False]
    assert len(set(runs[True])) > 3  # sampled, not a repeated argmax
    block = pipe._blocks[block_key(1, 8, SAMPLED)]
    assert block.dsp.phase is PlanPhase.REPLAYING
    assert "Sample" in {s.op for s in block.last_live.runtime.plan.slots}


def test_sampled_block_plans_are_one_per_setting_not_per_seed() -> None:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    pipe = GenerationPipeline(
        FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=8, block_capture=True
    )
    pipe.generate(golden["prompt"], 9, sampling=SAMPLED)
    block = pipe._blocks[block_key(1, 8, SAMPLED)]
    before, step_before = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    other_seed = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=8)
    pipe.generate(golden["prompt"], 1 + 2 * 8, sampling=other_seed)
    after, step_after = block.dsp.runtime.counters(), pipe.decode_model.dsp.runtime.counters()
    assert after["replays"] - before["replays"] == 2 and after["captures"] == before["captures"]
    assert step_after["executions"] == step_before["executions"]  # no one-step run
    assert set(pipe._blocks) == {block_key(1, 8, SAMPLED)}  # built when first used, for that sampling
    pipe.generate(golden["prompt"], 9, sampling=Sampling(temperature=0.5, seed=1))
    assert len(pipe._blocks) == 2  # another temperature: another plan


def test_sample_op_in_a_graph_matches_the_sampler() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 1, 300)).astype(np.float32)
    uniforms = rng.random(2)
    b = dsp.GraphBuilder("sample")
    x = b.placeholder("logits", "float32", (2, 1, 300))
    u = b.placeholder("u", "float64", (2,))
    b.output(b.op("Sample", x, u, domain="dsp", temperature=0.7, top_k=20, top_p=0.8), name="token")
    out = dsp.compile(b.build(), mode="slot_by_slot").run({"logits": logits, "u": uniforms})["token"]
    want = Sampler(Sampling(temperature=0.7, top_k=20, top_p=0.8), 2).pick(logits[:, -1], uniforms)
    assert out.shape == (2, 1) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, 0], want)
