"""What a user of `dsp generate` / GenerationPipeline meets at the edges (issue 17, items 2, 6, 7).

- a stop token ends the stream where it ends the result: nothing decoded after it reaches
  ``on_tokens`` or stdout, with and without decode blocks, K tokens per host call;
- a decoder exported by torch's TorchScript (legacy) exporter generates torch's tokens;
- a bad tokenizer file, ids past the vocabulary and a generation past the learned positions
  are one-line errors that say which limit, before anything runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES
from conftest import run_cli as dsp

import dsp_core as dsp_api
from dsp_core.errors import InputError
from dsp_core.ir.graph import Node
from dsp_core.llm import GenerationPipeline
from dsp_core.llm.kv import KVTransformError, find_kv_growth, fixed_kv_buffers
from dsp_core.llm.limits import table_limit

GPT2 = FIXTURES / "gpt2_eager.onnx"
TORCHSCRIPT = FIXTURES / "gpt2_torchscript.onnx"
TOKENIZER = FIXTURES / "tokenizer.json"


def golden(name: str) -> np.lib.npyio.NpzFile:
    return np.load(FIXTURES / f"{name}.golden.npz")


def first_at(tokens: list[int], index: int) -> int:
    """The token at ``index``, checked to occur there first (so the stop falls exactly there)."""
    assert tokens.index(tokens[index]) == index
    return tokens[index]


# -- item 2: nothing after a stop token is streamed ---------------------------------------------


@pytest.mark.parametrize("block_capture", [False, True])
@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
@pytest.mark.parametrize(("block_size", "stop_index"), [(8, 1), (4, 6), (3, 9), (1, 2)])
def test_stream_ends_at_the_stop_token(name: str, block_capture: bool, block_size: int, stop_index: int) -> None:
    want = golden(name)["greedy_tokens"].tolist()
    stop = first_at(want, stop_index)
    pipe = GenerationPipeline(
        FIXTURES / f"{name}.onnx",
        max_length=48,
        mode="emulated_replay",
        block_size=block_size,
        block_capture=block_capture,
    )
    blocks: list[np.ndarray] = []
    result = pipe.generate(golden(name)["prompt"], 32, stop_tokens=[stop], on_tokens=blocks.append)
    streamed = np.concatenate(blocks, axis=1)
    assert result.stopped and result.token_list() == want[: stop_index + 1]
    np.testing.assert_array_equal(streamed, result.tokens)  # the stream and the result agree exactly
    assert streamed[0, -1] == stop and all(b.shape[1] >= 1 for b in blocks)
    assert all(b.shape[1] <= block_size for b in blocks)
    assert pipe.position == 7 + stop_index  # rolled back to just after the stop


def test_a_session_continues_after_a_streamed_stop() -> None:
    want = golden("gpt2_eager")["greedy_tokens"].tolist()
    pipe = GenerationPipeline(GPT2, max_length=48, mode="emulated_replay", block_size=8, block_capture=True)
    session = pipe.session()
    session.append(golden("gpt2_eager")["prompt"])
    blocks: list[np.ndarray] = []
    first = session.generate(20, stop_tokens=[first_at(want, 3)], on_tokens=blocks.append)
    more = session.generate(10, on_tokens=blocks.append)
    assert first.token_list() + more.token_list() == want[:14]
    assert np.concatenate(blocks, axis=1)[0].tolist() == want[:14]


def test_batch_rows_hold_their_stop_token_until_every_row_stops() -> None:
    prompts = np.array([golden("gpt2_eager")["prompt"][0], [250, 8, 731, 64, 999, 3, 141]])
    pipe = GenerationPipeline(GPT2, max_length=48, mode="emulated_replay", block_size=8, block_capture=True)
    free = pipe.generate(prompts, 24)
    rows = [free.token_list(r) for r in range(2)]
    # row 0 stops first, row 1 later (each at the first token the other row never makes before)
    stop0 = next(t for i, t in enumerate(rows[0]) if i >= 1 and rows[0].index(t) == i and t not in rows[1][: i + 4])
    i0 = rows[0].index(stop0)
    stop1 = next(t for i, t in enumerate(rows[1]) if i > i0 + 2 and rows[1].index(t) == i and t not in rows[0][: i + 1])
    i1 = rows[1].index(stop1)
    blocks: list[np.ndarray] = []
    result = pipe.generate(prompts, 24, stop_tokens=[stop0, stop1], on_tokens=blocks.append)
    streamed = np.concatenate(blocks, axis=1)
    np.testing.assert_array_equal(streamed, result.tokens)
    assert result.lengths.tolist() == [i0 + 1, i1 + 1] and result.tokens.shape[1] == i1 + 1
    assert result.token_list(0) == rows[0][: i0 + 1] and result.token_list(1) == rows[1][: i1 + 1]
    assert (streamed[0, i0:] == stop0).all()  # nothing row 0 decoded after its stop


@pytest.mark.parametrize("block_capture", ["off", "on"])
def test_cli_prints_nothing_after_the_stop_token(block_capture: str) -> None:
    g = golden("gpt2_eager")
    want = g["greedy_tokens"].tolist()
    prompt = ",".join(str(t) for t in g["prompt"][0])
    args = ["--max-new-tokens", "20", "--mode", "emulated_replay", "--block-capture", block_capture]
    r = dsp("generate", str(GPT2), "--prompt-ids", prompt, "--stop-token", str(first_at(want, 1)), *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(t) for t in want[:2]]  # the issue: 7 more ids reached stdout
    assert "2 tokens" in r.stderr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    r = dsp("generate", str(GPT2), "--tokenizer", str(TOKENIZER), "--prompt", "the quick brown fox", *args[:2])
    assert r.returncode == 0, r.stderr
    free = r.stdout.split()[4:]
    stop_word = next(w for i, w in enumerate(free) if i >= 1 and free.index(w) == i)
    r = dsp(
        "generate",
        str(GPT2),
        "--tokenizer",
        str(TOKENIZER),
        "--prompt",
        "the quick brown fox",
        "--stop-token",
        stop_word,
        *args,
    )
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()[4:]
    assert words == free[: free.index(stop_word) + 1] and tok.token_to_id(stop_word) is not None
    assert f"{len(words)} tokens" in r.stderr


# -- item 7: the TorchScript (legacy) export --------------------------------------------------


def test_torchscript_fixture_is_the_legacy_export_form() -> None:
    """The fixture keeps what made the rewrite fail: layer 0's past read through a one-input Concat."""
    graph = dsp_api.compile(TORCHSCRIPT, mode="slot_by_slot").graph
    copies = [n for n in graph.nodes if n.op_type == "Concat" and n.inputs == ["past_key_values.0.key"]]
    assert len(copies) == 1
    growth = {g.past: g for g in find_kv_growth(graph)}
    assert growth["past_key_values.0.key"].aliases == tuple(copies[0].outputs)
    assert all(g.present == f"present.{g.layer}.{g.kind}" and g.axis == -2 for g in growth.values())
    fixed = fixed_kv_buffers(graph, batch=1, max_length=16).graph
    assert not any(n.op_type == "Concat" and "past_key_values.0.key" in n.inputs for n in fixed.nodes)
    assert sum(n.op_type == "KVScatter" for n in fixed.nodes) == 4


@pytest.mark.parametrize(
    ("mode", "block_capture"), [("slot_by_slot", False), ("emulated_replay", False), ("emulated_replay", True)]
)
def test_torchscript_export_generates_torchs_greedy_tokens(mode: str, block_capture: bool) -> None:
    g = golden("gpt2_torchscript")
    pipe = GenerationPipeline(TORCHSCRIPT, max_length=48, mode=mode, block_size=4, block_capture=block_capture)
    result = pipe.generate(g["prompt"], 32)
    assert result.token_list() == g["greedy_tokens"].tolist()
    # the same weights as gpt2_eager: torch's tokens are the same
    assert g["greedy_tokens"].tolist() == golden("gpt2_eager")["greedy_tokens"].tolist()


def test_torchscript_export_validates_from_the_command_line() -> None:
    golden_file = str(FIXTURES / "gpt2_torchscript.golden.npz")
    r = dsp("validate", str(TORCHSCRIPT), "--golden", golden_file, "--modes", "emulated_replay", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] and all(m["match_vs_golden"] == 1.0 for m in report["modes"].values())


def test_a_cache_read_the_rewrite_cannot_place_names_what_it_found_and_what_it_needs() -> None:
    graph = dsp_api.compile(TORCHSCRIPT, mode="slot_by_slot").graph
    copy = next(n for n in graph.nodes if n.op_type == "Concat" and n.inputs == ["past_key_values.0.key"])
    graph.nodes[graph.nodes.index(copy)] = Node("Neg", copy.inputs, copy.outputs, {}, copy.name)
    with pytest.raises(KVTransformError) as err:
        find_kv_growth(graph)
    message = str(err.value)
    assert "'past_key_values.0.key'" in message
    assert "needs exactly one Concat(past_key_values.0.key, new, axis=-2)" in message
    assert f'found no two-input Concat among its readers: Neg node "{copy.name}"' in message


# -- item 6: bad tokenizers, ids past the vocabulary, generations past the positions ----------


def test_embedding_limits_are_found_on_every_export_form() -> None:
    for name in ["gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager"]:
        graph = dsp_api.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot").graph
        vocab, positions = table_limit(graph, "input_ids"), table_limit(graph, "position_ids")
        assert vocab is not None and vocab.rows == 1000
        if name.startswith("gpt2"):
            assert positions is not None and positions.rows == 128 and positions.node.startswith("Gather node")
        else:
            assert positions is None  # rotary: no table, no limit


@pytest.mark.parametrize("cli_args", [(), ("--block-capture", "on")])
def test_too_long_generation_says_where_the_positions_end(cli_args: tuple[str, ...]) -> None:
    pipe = GenerationPipeline(GPT2, max_length=200, mode="emulated_replay")
    prompt = golden("gpt2_eager")["prompt"]
    with pytest.raises(InputError, match=r"positions end at 128 .*at most 122 new tokens") as err:
        pipe.generate(prompt, 150)
    assert "index out of bounds" not in str(err.value)
    assert pipe.prefill_model.last_live is None and pipe.decode_model.last_live is None  # nothing ran
    assert len(pipe.generate(prompt, 122).token_list()) == 122  # the most that fits: positions 0..127
    with pytest.raises(InputError, match="positions end at 128 .*shorten the prompt"):
        pipe.generate(np.arange(150), 2)
    session = pipe.session()
    session.append(prompt)
    session.generate(100)
    with pytest.raises(InputError, match="positions end at 128"):
        session.generate(30)
    ids = ",".join(str(t) for t in prompt[0])
    r = dsp("generate", str(GPT2), "--prompt-ids", ids, "--max-new-tokens", "150", *cli_args)
    assert r.returncode == 2 and r.stdout == ""
    assert "positions end at 128" in r.stderr and "index out of bounds" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_rotary_models_have_no_position_limit() -> None:
    pipe = GenerationPipeline(FIXTURES / "llama_eager.onnx", max_length=160, mode="slot_by_slot")
    assert pipe.positions is None
    assert len(pipe.generate(golden("llama_eager")["prompt"], 150).token_list()) == 150


def test_ids_past_the_vocabulary_are_named_before_running(tmp_path) -> None:
    pipe = GenerationPipeline(GPT2, max_length=32, mode="emulated_replay")
    with pytest.raises(InputError, match=r"token id 4000 exceeds the model's vocabulary: 1000 tokens"):
        pipe.generate(np.array([5, 4000, 7]), 4)
    with pytest.raises(InputError, match="negative"):
        pipe.generate(np.array([5, -1]), 4)
    session = pipe.session()
    session.append([1, 2, 3])
    with pytest.raises(InputError, match="vocabulary"):
        session.append([1000])
    assert session.position == 3  # the bad append fed nothing

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    wrong = Tokenizer(WordLevel({"[UNK]": 0, "hello": 4000, "world": 4001}, unk_token="[UNK]"))
    wrong.pre_tokenizer = Whitespace()
    wrong.save(str(tmp_path / "wrong.json"))
    r = dsp("generate", str(GPT2), "--tokenizer", str(tmp_path / "wrong.json"), "--prompt", "hello world")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert "exceeds the model's vocabulary: 1000 tokens" in r.stderr and "index out of bounds" not in r.stderr


@pytest.mark.parametrize("content", [b'{"not": "a tokenizer"}', b"\x00\x01 not json", "the onnx model"])
def test_a_file_that_is_not_a_tokenizer_is_a_one_line_error(tmp_path, content: bytes | str) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(GPT2.read_bytes() if isinstance(content, str) else content)
    r = dsp("generate", str(GPT2), "--tokenizer", str(path), "--prompt", "hello")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert str(path) in lines[0] and "not a tokenizer file" in lines[0]
