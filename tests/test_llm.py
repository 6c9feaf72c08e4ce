"""GenerationPipeline on the four decoder fixtures: torch's greedy tokens, replay, sessions, sampling."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

from dsp_core.errors import DSPError
from dsp_core.llm import DecodeMetrics, GenerationPipeline, Sampling
from dsp_core.runtime.lifecycle import PlanPhase

DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def golden(name: str) -> np.lib.npyio.NpzFile:
    return np.load(FIXTURES / f"{name}.golden.npz")


@pytest.fixture(scope="module")
def gpt2() -> GenerationPipeline:
    return GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=4)


@pytest.mark.parametrize("mode", ["slot_by_slot", "emulated_replay"])
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_tokens_match_torch(name: str, mode: str) -> None:
    g = golden(name)
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=48, mode=mode)
    result = pipe.generate(g["prompt"], max_new_tokens=32)
    assert result.token_list() == g["greedy_tokens"].tolist()
    counters = pipe.decode_model.dsp.runtime.counters()
    if mode == "emulated_replay":
        # after the pipeline's warm-up: REPLAYING, captured once, every decode step a replay
        assert pipe.decode_model.dsp.phase is PlanPhase.REPLAYING
        assert counters["captures"] == 1 and counters["recaptures"] == 0
        assert counters["eager_runs"] == 0 and counters["staging_copies"] == 0
    else:
        assert pipe.decode_model.dsp.phase is PlanPhase.REPLAY_BLOCKED  # nothing captures; still frozen


def test_decode_plan_never_recaptures_across_generations(gpt2: GenerationPipeline) -> None:
    g = golden("gpt2_eager")
    first = gpt2.generate(g["prompt"], 32)
    before = gpt2.decode_model.dsp.runtime.counters()
    second = gpt2.generate(g["prompt"], 32, block_size=7)
    after = gpt2.decode_model.dsp.runtime.counters()
    assert first.token_list() == second.token_list() == g["greedy_tokens"].tolist()
    assert after["captures"] == before["captures"] == 1 and after["recaptures"] == 0
    assert after["replays"] - before["replays"] == 31  # one replay per decode step
    assert gpt2.position == 7 + 31


def test_session_continuation_equals_a_fresh_prefill(gpt2: GenerationPipeline) -> None:
    prompt = golden("gpt2_eager")["prompt"]
    s = gpt2.session()
    s.append(prompt)
    first = s.generate(10)
    more = np.array([[3, 141, 59, 26, 535]])
    continued = s.append(more)
    assert s.position == 7 + 10 + 5
    fresh = gpt2.session()
    whole = np.concatenate([prompt, first.tokens, more], axis=1)
    np.testing.assert_array_equal(s.tokens, whole)
    reference = fresh.append(whole)
    np.testing.assert_allclose(continued, reference, rtol=1e-4, atol=1e-4)
    assert s.generate(8).token_list() == fresh.generate(8).token_list()


def test_sessions_are_independent(gpt2: GenerationPipeline) -> None:
    g = golden("gpt2_eager")
    a, b = gpt2.session(), gpt2.session()
    a.append(g["prompt"])
    b.append(np.array([[5, 6, 7]]))
    ta = a.generate(6).token_list()
    b.generate(6)
    ta += a.generate(6).token_list()
    assert ta == g["greedy_tokens"][:12].tolist()


def test_one_token_appends_use_the_decode_plan(gpt2: GenerationPipeline) -> None:
    prompt = golden("gpt2_eager")["prompt"]
    s = gpt2.session()
    for t in prompt[0]:
        s.append([int(t)])
    whole = gpt2.session().append(prompt)
    np.testing.assert_allclose(s.last_logits, whole, rtol=1e-4, atol=1e-4)


def test_sampling_with_a_seed_is_reproducible(gpt2: GenerationPipeline) -> None:
    prompt = golden("gpt2_eager")["prompt"]
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    a = gpt2.generate(prompt, 20, sampling=sampling).token_list()
    b = gpt2.generate(prompt, 20, sampling=sampling, block_size=3).token_list()
    c = gpt2.generate(prompt, 20, sampling=Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=8)).token_list()
    assert a == b and a != c
    top1 = gpt2.generate(prompt, 20, sampling=Sampling(temperature=1.0, top_k=1, seed=1)).token_list()
    assert top1 == golden("gpt2_eager")["greedy_tokens"][:20].tolist()  # top-k 1 is greedy


def test_stop_tokens_stop_and_roll_back(gpt2: GenerationPipeline) -> None:
    want = golden("gpt2_eager")["greedy_tokens"].tolist()
    stop = want[9]
    result = gpt2.generate(golden("gpt2_eager")["prompt"], 32, stop_tokens=[stop], block_size=4)
    assert result.stopped and result.token_list() == want[: want.index(stop) + 1]
    assert gpt2.position == 7 + want.index(stop)  # the tokens decoded past the stop are forgotten


def test_streaming_and_metrics(gpt2: GenerationPipeline) -> None:
    blocks: list[list[int]] = []
    result = gpt2.generate(
        golden("gpt2_eager")["prompt"], 25, on_tokens=lambda b: blocks.append(b[0].tolist()), block_size=8
    )
    assert [len(b) for b in blocks] == [1, 8, 8, 8]
    assert sum(blocks, []) == result.token_list()
    rates = result.metrics.rates
    assert all(rates[k] is not None and rates[k] > 0 for k in ("overall", "decode", "steady", "lateSteady"))
    assert result.metrics.effective[0] == "lateSteady"
    short = DecodeMetrics((0.5, 0.1, 0.1))
    assert short.effective == ("decode", 10.0) and short.rates["steady"] is None


def test_capacity_and_misuse_errors(gpt2: GenerationPipeline) -> None:
    with pytest.raises(DSPError, match="max_length"):
        gpt2.generate(np.arange(60)[None], 10)
    with pytest.raises(DSPError, match="append"):
        gpt2.session().generate(3)


def test_switching_sessions_swaps_kv_prefixes_instead_of_recapturing() -> None:
    """Sessions share the plans' resident arrays; a switch copies KV prefixes, plans never re-capture."""
    g = golden("gpt2_eager")
    pipe = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_capture=True)
    a, b = pipe.session(), pipe.session()
    a.append(g["prompt"])
    b.append(np.array([[5, 6, 7]]))
    tokens_b = b.generate(9).token_list()
    tokens = a.generate(9).token_list()
    for _ in range(2):  # alternate, a block each
        tokens_b += b.generate(8).token_list()
        tokens += a.generate(8).token_list()
    assert tokens == g["greedy_tokens"][:25].tolist()
    alone = pipe.session()
    alone.append(np.array([[5, 6, 7]]))
    assert tokens_b == alone.generate(25).token_list()
    assert pipe.swaps >= 6
    for model in (pipe.decode_model, *pipe._blocks.values()):
        assert model.dsp.runtime.counters()["recaptures"] == 0, model.dsp.runtime.counters()


def test_sessions_in_threads_are_serialised_and_keep_their_tokens() -> None:
    import threading

    g = golden("gpt2_eager")
    pipe = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=4)
    prompts = [g["prompt"], np.array([[5, 6, 7]]), np.array([[11, 12]]), np.array([[40, 41, 42, 43]])]
    want = []
    for prompt in prompts:
        s = pipe.session()
        s.append(prompt)
        want.append(s.generate(20).token_list())
    got: dict[int, list[int]] = {}

    def work(i: int) -> None:
        s = pipe.session()
        s.append(prompts[i])
        got[i] = []
        for _ in range(5):
            got[i] += s.generate(4).token_list()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(prompts))] == want
    assert want[0] == g["greedy_tokens"][:20].tolist()


def test_the_first_token_is_out_before_the_decode_plans_warm_up() -> None:
    """The first token needs the prefill alone: the decode plan's warm-up (a capture on a GPU) runs
    after it reaches ``on_tokens``, and the tokens are the same as with the warm-up done first."""
    pipe = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=4)
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    seen: list[tuple[int, bool, bool]] = []

    def on_tokens(tokens: np.ndarray) -> None:
        seen.append((tokens.shape[1], pipe.decoder(1).warmed, "decode warm-up" in pipe.timings))

    result = pipe.generate(golden["prompt"], 12, on_tokens=on_tokens)
    assert seen[0] == (1, False, False), seen
    assert all(warmed for _, warmed, _ in seen[1:]) and pipe.decode_model.dsp.phase is PlanPhase.REPLAYING
    assert result.tokens[0].tolist() == golden["greedy_tokens"][:12].tolist()
    ahead = GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=64, mode="emulated_replay", block_size=4)
    ahead.warmup(1)
    assert ahead.generate(golden["prompt"], 12).tokens.tolist() == result.tokens.tolist()
