"""Decoders exported from transformers (GPT-2 and Llama; eager and opset-23 fused attention)
against torch's golden outputs: prefill then 4 decode steps, within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp

DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def golden_steps(golden: np.lib.npyio.NpzFile) -> list[int]:
    return sorted({int(k.split(".")[0][4:]) for k in golden.files if k.startswith("step")})


@pytest.fixture(scope="module", params=DECODERS)
def decoder(request):
    name = request.param
    model = dsp.compile(FIXTURES / f"{name}.onnx")
    return name, model, np.load(FIXTURES / f"{name}.golden.npz")


@pytest.mark.parametrize("mode", ["slot_by_slot", "auto"])
def test_prefill_and_decode_match_torch(decoder, mode: str) -> None:
    name, model, golden = decoder
    if mode != "auto":
        model = dsp.compile(model.graph, mode=mode)
    assert model.declined is None, model.declined
    steps = golden_steps(golden)
    assert len(steps) >= 5  # prefill + 4 decode steps
    for k in steps:
        feeds = {n: golden[f"step{k}.{n}"] for n in model.input_names}
        outs = model.run(feeds)
        for out in model.output_names:
            np.testing.assert_allclose(
                outs[out], golden[f"step{k}.{out}"], rtol=1e-4, atol=1e-4, err_msg=f"{name} step {k} output {out}"
            )


def test_chained_decode_reproduces_greedy_tokens(decoder) -> None:
    """Feed DSP's own presents back (not torch's): the greedy tokens must match torch's."""
    name, model, golden = decoder
    past_names = [n for n in model.input_names if n.startswith("past_key_values.")]
    feeds = {n: golden[f"step0.{n}"] for n in model.input_names}
    tokens = []
    length = feeds["input_ids"].shape[1]
    want = golden["greedy_tokens"].reshape(-1)
    for _ in range(8):
        outs = model.run(feeds)
        nxt = int(outs["logits"][0, -1].argmax())
        tokens.append(nxt)
        feeds = {
            "input_ids": np.array([[nxt]], np.int64),
            "attention_mask": np.ones((1, length + 1), np.int64),
            "position_ids": np.array([[length]], np.int64),
            **{n: outs[n.replace("past_key_values.", "present.")] for n in past_names},
        }
        feeds = {n: v for n, v in feeds.items() if n in model.input_names}
        length += 1
    assert tokens == list(want[: len(tokens)]), f"{name}: {tokens} vs torch {list(want[:8])}"


def test_fused_exports_use_the_fused_ops() -> None:
    ops = {n.op_type for n in dsp.compile(FIXTURES / "llama_sdpa23.onnx").graph.nodes}
    assert "Attention" in ops
    ops = {n.op_type for n in dsp.compile(FIXTURES / "gpt2_sdpa23.onnx").graph.nodes}
    assert "Attention" in ops


def test_batch2_right_padded_prefill(decoder) -> None:
    name, model, golden = decoder
    feeds = {n: golden[f"batch2.{n}"] for n in model.input_names}
    outs = model.run(feeds)
    for out in model.output_names:
        np.testing.assert_allclose(outs[out], golden[f"batch2.{out}"], rtol=1e-4, atol=1e-4, err_msg=f"{name} {out}")
