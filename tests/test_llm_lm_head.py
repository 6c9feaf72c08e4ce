"""The prefill's last-position rewrite (dsp_core.llm.lm_head) and the pipeline running it.

The rewrite cuts the LM head's input to the last position; everything else of the graph
is untouched, so the presents are bit for bit the original's. The kept logits are the
original's last position's up to the head product's rounding: numpy gives a one-row
product to BLAS's gemv, which sums in another order than the many-row gemm (on the
fixtures, 2e-6 of logits about 1). On a head whose sums are exact (small integers), the
two are bit for bit equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp
from dsp_core.ir.graph import Graph, Node, Value
from dsp_core.llm import GenerationPipeline
from dsp_core.llm.lm_head import LAST, find_lm_head, last_position_logits
from dsp_core.llm.pipeline import PREFILL
from dsp_core.llm.store import REWRITE_CODE
from dsp_core.runtime.loader import import_model

DECODERS = ["gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23"]


def golden(name: str) -> np.lib.npyio.NpzFile:
    return np.load(FIXTURES / f"{name}.golden.npz")


def feeds_of(g: np.lib.npyio.NpzFile, step: str, graph: Graph) -> dict[str, np.ndarray]:
    return {n: g[f"{step}.{n}"] for n in graph.input_names}


# -- the rewrite on the decoder fixtures -----------------------------------------------------
@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("step", ["step0", "batch2"])  # a 7-token prefill; two rows of 7
def test_the_rewritten_prefill_keeps_the_last_position_and_every_present(name: str, step: str) -> None:
    graph = import_model(FIXTURES / f"{name}.onnx")
    cut = last_position_logits(graph)
    assert cut.head is not None and cut.kept == LAST, cut.reason
    assert cut.graph is not graph and cut.graph.info("logits").shape == ("batch", 1, 1000)
    g = golden(name)
    feeds = feeds_of(g, step, graph)
    want = dsp.compile(graph, mode="slot_by_slot").run(feeds)
    got = dsp.compile(cut.graph, mode="slot_by_slot").run(feeds)
    assert got.keys() == want.keys()
    for out in want:
        if out != "logits":
            assert np.array_equal(got[out], want[out]), out  # the rest of the graph is untouched
    rows = feeds["input_ids"].shape[0]
    assert got["logits"].shape == (rows, 1, 1000)
    # the original's last position, up to a one-row product's rounding (module doc), and torch's
    np.testing.assert_allclose(got["logits"][:, -1], want["logits"][:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["logits"][:, -1], g[f"{step}.logits"][:, -1], rtol=1e-4, atol=1e-4)
    assert (got["logits"][:, -1].argmax(-1) == want["logits"][:, -1].argmax(-1)).all()


@pytest.mark.parametrize("name", DECODERS)
def test_the_rewrite_is_kept_as_it_is_when_applied_again(name: str) -> None:
    once = last_position_logits(import_model(FIXTURES / f"{name}.onnx")).graph
    again = last_position_logits(once)
    assert again.graph is once and again.kept == LAST
    assert find_lm_head(once).sliced


# -- exact arithmetic: bit for bit ------------------------------------------------------------
def head_graph(chain: str, seq: int | str = "seq") -> Graph:
    """x [B, n, 8] -> Relu -> MatMul(W 8x16) -> ``chain`` -> logits, and a second output from the hidden states."""
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder("head")
    hidden = g.Relu(g.placeholder("x", "float32", ["batch", seq, 8]))
    y = g.MatMul(hidden, g.constant(rng.integers(-3, 4, (8, 16)).astype(np.float32), name="w"))
    if chain == "bias":
        y = y + g.constant(np.arange(16, dtype=np.float32), name="bias")
    elif chain == "softcap":  # Gemma-style: Tanh(y / c) * c, after a scale, then a Cast
        y = g.Cast(g.Tanh((y * 0.5) / 4.0) * 4.0, to=11)  # float64
    g.output(y, "logits")
    g.output(hidden * 2.0, "present.0.key")
    graph = g.build()
    dtype = "float64" if chain == "softcap" else "float32"
    graph.outputs[0] = Value("logits", dtype, ("batch", seq, 16))
    return graph


@pytest.mark.parametrize("chain", ["plain", "bias", "softcap"])
def test_last_position_logits_are_bit_for_bit_the_originals_on_exact_sums(chain: str) -> None:
    graph = head_graph(chain)
    cut = last_position_logits(graph)
    assert cut.kept == LAST, cut.reason
    x = np.random.default_rng(1).integers(-4, 5, (2, 9, 8)).astype(np.float32)  # products sum exactly
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})
    got = dsp.compile(cut.graph, mode="slot_by_slot").run({"x": x})
    assert got["logits"].shape == (2, 1, 16) and got["logits"].dtype == want["logits"].dtype
    assert np.array_equal(got["logits"], want["logits"][:, -1:])
    assert np.array_equal(got["present.0.key"], want["present.0.key"])


# -- graphs without a recognisable LM head: unchanged -------------------------------------------
def _naming(graph: Graph) -> Node:
    """The builder's Identity that names the logits."""
    return next(n for n in graph.nodes if n.outputs == ["logits"])


def _reshaped(graph: Graph) -> Graph:
    """The head's output reshaped before it is the logits (not position-wise)."""
    shape = "dsp_test/same_shape"
    graph.initializers[shape] = np.array([0, 0, -1], np.int64)
    identity = _naming(graph)
    identity.op_type, identity.inputs = "Reshape", [identity.inputs[0], shape]
    return graph


def _read_twice(graph: Graph) -> Graph:
    """The head's output read by another node too."""
    head = next(n for n in graph.nodes if n.op_type == "MatMul")
    graph.nodes.append(Node("ReduceMax", [head.outputs[0]], ["other"], {"keepdims": 0}, "other"))
    graph.outputs.append(Value("other", "float32", None))
    return graph


def _logits_read(graph: Graph) -> Graph:
    """The logits themselves read by a node of the graph (every position of them)."""
    graph.nodes.append(Node("ArgMax", ["logits"], ["best"], {"axis": -1}, "best"))
    graph.outputs.append(Value("best", "int64", None))
    return graph


def _gemm(graph: Graph) -> Graph:
    """A Gemm head over rank-2 rows."""
    head = next(n for n in graph.nodes if n.op_type == "MatMul")
    head.op_type = "Gemm"
    graph.inputs[0] = Value("x", "float32", ("rows", 8))
    graph.outputs[0] = Value("logits", "float32", ("rows", 16))
    return graph


def _positions_in_the_scale(graph: Graph) -> Graph:
    """A scale that differs per position ([1, n, 1]): not the same for the last position alone."""
    graph = head_graph("plain", seq=5)
    identity = _naming(graph)
    graph.initializers["per_position"] = np.arange(5, dtype=np.float32).reshape(1, 5, 1)
    identity.op_type, identity.inputs = "Mul", [identity.inputs[0], "per_position"]
    return graph


def _no_logits(graph: Graph) -> Graph:
    _naming(graph).outputs = ["scores"]
    graph.outputs[0] = Value("scores", "float32", None)
    return graph


def _rank_unknown(graph: Graph) -> Graph:
    graph.outputs[0] = Value("logits", "float32", None)
    return graph


CASES = {
    "reshape": (_reshaped, "Reshape"),
    "read twice": (_read_twice, "read elsewhere"),
    "logits read": (_logits_read, "read elsewhere"),
    "gemm": (_gemm, "Gemm"),
    "per-position scale": (_positions_in_the_scale, "Mul"),
    "no logits": (_no_logits, "no output 'logits'"),
    "rank unknown": (_rank_unknown, "rank unknown"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_graph_without_a_recognisable_lm_head_is_left_unchanged(case: str) -> None:
    make, said = CASES[case]
    graph = make(head_graph("plain"))
    nodes, outputs = list(graph.nodes), list(graph.outputs)
    cut = last_position_logits(graph)
    assert cut.graph is graph and cut.head is None
    assert graph.nodes == nodes and graph.outputs == outputs  # not touched either
    assert said in cut.reason and cut.kept.startswith("all positions (")


# -- the pipeline ---------------------------------------------------------------------------------
def _unrecognised(name: str) -> Graph:
    """A decoder fixture whose logits come through a Reshape after the LM head."""
    graph = import_model(FIXTURES / f"{name}.onnx")
    head = find_lm_head(graph)
    product = graph.nodes[head.node]
    shape = "dsp_test/same_shape"
    graph.initializers[shape] = np.array([0, 0, -1], np.int64)
    product.outputs = ["dsp_test/head"]
    graph.nodes.insert(head.node + 1, Node("Reshape", ["dsp_test/head", shape], ["logits"], {}, "dsp_test/reshape"))
    return graph


def test_a_decoder_whose_head_is_not_found_still_generates_and_says_so() -> None:
    g = golden("gpt2_eager")
    pipe = GenerationPipeline(_unrecognised("gpt2_eager"), max_length=48, mode="slot_by_slot")
    assert pipe.prefill_logits.startswith("all positions (") and "Reshape" in pipe.prefill_logits
    assert pipe.generate(g["prompt"], 32).token_list() == g["greedy_tokens"].tolist()
    assert pipe.prefill_model.run(feeds_of(g, "step0", pipe.graph))["logits"].shape == (1, 7, 1000)
    from dsp_core.llm.cli import start_line

    assert "prefill logits: all positions (" in start_line(pipe)


@pytest.mark.parametrize("name", DECODERS)
def test_the_pipelines_prefill_plan_computes_the_last_position_only(name: str) -> None:
    g = golden(name)
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=48, mode="slot_by_slot")
    assert pipe.prefill_logits == LAST
    out = pipe.prefill_model.run(feeds_of(g, "step0", pipe.graph))
    assert out["logits"].shape == (1, 1, 1000)
    assert pipe.graph.info("logits").shape == ("batch", "seq", 1000)  # the graph as given: not rewritten
    session = pipe.session()
    np.testing.assert_allclose(session.append(g["prompt"]), g["step0.logits"][:, -1], rtol=1e-4, atol=1e-4)
    assert session.generate(31).token_list() == g["greedy_tokens"][:31].tolist()


def test_a_compiled_model_runs_as_given_and_is_rewritten_for_another_mode() -> None:
    g = golden("gpt2_eager")
    path = FIXTURES / "gpt2_eager.onnx"
    whole = dsp.compile(path, mode="slot_by_slot")  # every position's logits
    given = GenerationPipeline(whole, max_length=48)
    assert given.prefill_model is whole and given.prefill_logits.startswith("all positions (")
    assert given.generate(g["prompt"], 32).token_list() == g["greedy_tokens"].tolist()
    other = GenerationPipeline(whole, max_length=48, mode="emulated_replay")
    assert other.prefill_logits == LAST and other.prefill_model is not whole
    assert other.generate(g["prompt"], 32).token_list() == g["greedy_tokens"].tolist()
    # another pipeline's prefill plan (benchmarks/decode_gpu.py shares one so): its logits are the last position's
    shared = GenerationPipeline(other.prefill_model, max_length=48)
    assert shared.prefill_model is other.prefill_model and shared.prefill_logits == LAST
    assert shared.generate(g["prompt"], 32).token_list() == g["greedy_tokens"].tolist()


# -- the disk cache: an entry of every position's logits is never the prefill plan ---------------
@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_dsp_compiles_entry_of_the_model_is_not_the_prefill_plan(cache_dir: Path) -> None:
    path = FIXTURES / "gpt2_eager.onnx"
    g = golden("gpt2_eager")
    dsp.compile(path, mode="slot_by_slot")  # the model as exported, every position's logits, stored
    assert dsp.compile(path, mode="slot_by_slot").stats.disk_hits == 1
    pipe = GenerationPipeline(path, max_length=48, mode="slot_by_slot")
    assert pipe.prefill_model.stats.disk_hits == 0 and pipe.warm_stats["graph_imports"] == 1
    assert pipe.prefill_model.run(feeds_of(g, "step0", pipe.graph))["logits"].shape == (1, 1, 1000)
    assert "lm_head.py" in REWRITE_CODE  # an edit of the rewrite is a miss of every pipeline entry


def test_a_prefill_entry_of_every_positions_logits_is_rejected_and_rebuilt(cache_dir: Path) -> None:
    path = FIXTURES / "gpt2_eager.onnx"
    g = golden("gpt2_eager")
    first = GenerationPipeline(path, max_length=48, mode="slot_by_slot")
    assert first.warm_stats["writes"] == 2  # metadata, prefill
    whole = dsp.compile(import_model(path), mode="slot_by_slot").plan()
    first.store.put("prefill", PREFILL, {"logits": LAST}, whole)  # a stale entry that says otherwise
    again = GenerationPipeline(path, max_length=48, mode="slot_by_slot")
    assert again.warm_stats["rejects"] == 1 and again.warm_stats["rewrites"] == 1
    assert again.prefill_logits == LAST
    assert again.prefill_model.run(feeds_of(g, "step0", again.graph))["logits"].shape == (1, 1, 1000)
    assert again.generate(g["prompt"], 32).token_list() == g["greedy_tokens"].tolist()
    healed = GenerationPipeline(path, max_length=48, mode="slot_by_slot")
    assert healed.warm_stats["rejects"] == 0 and healed.warm_stats["rewrites"] == 0
    assert healed.prefill_model.stats.disk_hits == 1
