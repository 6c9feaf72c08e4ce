"""`dsp generate` and `dsp validate` through a subprocess, as a user runs them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES
from conftest import run_cli as dsp

pytest.importorskip("tokenizers")

GPT2 = str(FIXTURES / "gpt2_eager.onnx")
TOKENIZER = str(FIXTURES / "tokenizer.json")


def test_generate_streams_text_and_reports_tokens_per_second() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    assert tok.get_vocab_size() == 1000  # the fixtures' vocab: every model token decodes
    r = dsp(
        "generate",
        GPT2,
        "--tokenizer",
        TOKENIZER,
        "--prompt",
        "the quick brown fox",
        "--max-new-tokens",
        "12",
        "--mode",
        "emulated_replay",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the quick brown fox ")
    assert len(r.stdout.split()) == 4 + 12
    assert "12 tokens" in r.stderr and "tokens/s" in r.stderr


def test_generate_json_sampling_and_stop_token() -> None:
    want = np.load(FIXTURES / "gpt2_eager.golden.npz")["greedy_tokens"].tolist()
    prompt = ",".join(str(t) for t in np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"][0])
    r = dsp("generate", GPT2, "--prompt-ids", prompt, "--max-new-tokens", "20", "--stop-token", str(want[5]), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == want[: want.index(want[5]) + 1] and out["stopped"]
    assert {"overall_tokens_per_s", "decode_tokens_per_s", "steady_tokens_per_s"} <= set(out["metrics"])
    seeded = [
        dsp(
            "generate",
            GPT2,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.8",
            "--seed",
            "11",
            "--json",
        )
        for _ in range(2)
    ]
    assert json.loads(seeded[0].stdout)["tokens"] == json.loads(seeded[1].stdout)["tokens"]


def test_validate_passes_against_golden_and_fails_below_threshold(tmp_path) -> None:
    golden = str(FIXTURES / "llama_sdpa23.golden.npz")
    r = dsp("validate", str(FIXTURES / "llama_sdpa23.onnx"), "--golden", golden, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] and {"SLOT_BY_SLOT", "EMULATED_REPLAY", "AUTO"} <= set(report["modes"])
    assert all(m["match_vs_golden"] == 1.0 for m in report["modes"].values())
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros(32, np.int64))
    r = dsp("validate", GPT2, "--golden", str(wrong), "--modes", "emulated_replay", "--max-new-tokens", "8")
    assert r.returncode == 1 and "FAILED" in r.stdout
    r = dsp("generate", GPT2, "--prompt", "hello")
    assert r.returncode == 2 and "--tokenizer" in r.stderr


def test_generate_block_capture_flag() -> None:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    prompt = ",".join(str(t) for t in golden["prompt"][0])
    runs = {
        flag: dsp(
            "generate",
            GPT2,
            "--prompt-ids",
            prompt,
            "--max-new-tokens",
            "17",
            "--mode",
            "emulated_replay",
            "--block-capture",
            flag,
            "--json",
        )
        for flag in ("auto", "on")
    }
    for flag, r in runs.items():
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["tokens"] == golden["greedy_tokens"][:17].tolist(), flag
        assert out["block_capture"] is (flag == "on")  # auto: off where the state is numpy
    bad = dsp("generate", GPT2, "--prompt-ids", prompt, "--block-capture", "sometimes")
    assert bad.returncode == 2 and "--block-capture" in bad.stderr
