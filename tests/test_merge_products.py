"""Merged sibling products (dsp_core/plan/merge.py): what merges, what must not, and bit-equal outputs.

The reference backend runs a merged plan bit-equal to the unmerged one: on the decoder
fixtures (prefill and decode, directly and through GenerationPipeline) and on crafted
graphs whose part widths make one numpy product over the concatenated weights differ
in the last bits from the separate products.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, run_cli

import dsp_core as dsp
from dsp_core.errors import GraphError
from dsp_core.ir.onnx_export import to_onnx
from dsp_core.ir.onnx_import import import_model
from dsp_core.llm import GenerationPipeline
from dsp_core.plan import serialize
from dsp_core.plan.compiler import compile_plan
from dsp_core.plan.merge import analyse, concatenated_weight, merge_report, merges_of, plan_options
from dsp_core.plan.plan import Plan
from dsp_core.runtime.loader import model_key

DECODERS = {"gpt2_eager": 0, "gpt2_sdpa23": 0, "gpt2_torchscript": 0, "llama_eager": 4, "llama_sdpa23": 4}
RNG = np.random.default_rng(14)


def _plan(graph: dsp.Graph, merge: bool) -> Plan:
    plan = compile_plan(graph, merge_products=merge)
    assert isinstance(plan, Plan)
    return plan


def _run_both(graph: dsp.Graph, feeds: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Outputs of the reference with the rewrite off, then on."""
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DSP_MERGE_PRODUCTS", flag)
        outs.append(dsp.compile(graph, mode="slot_by_slot").run(feeds))
    return outs


def _bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- the decoder fixtures ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_fixture_merges_and_stays_bit_equal(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = import_model(FIXTURES / f"{name}.onnx")
    merged, plain = _plan(graph, True), _plan(graph, False)
    merges = merges_of(merged)
    assert len(merges) == DECODERS[name] and not merges_of(plain)
    if merges:  # Llama: Q/K/V (64 + 32 + 32, GQA) and gate/up (128 + 128) in each of the 2 layers
        assert (
            sorted((m.k, tuple(p.n for p in m.parts)) for m in merges)
            == [(64, (64, 32, 32))] * 2 + [(64, (128, 128))] * 2
        )
        assert len(merged.slots) == len(plain.slots) - 6 and merged.content_hash != plain.content_hash
    else:
        assert merged.content_hash == plain.content_hash  # nothing merged: the same plan
    gold = np.load(FIXTURES / f"{name}.golden.npz")
    for step in range(5):  # the prefill, then 4 decode steps with the grown past
        feeds = {n: gold[f"step{step}.{n}"] for n in graph.input_names}
        off, on = _run_both(graph, feeds, monkeypatch)
        assert _bit_equal(off, on), f"{name} step {step}"
        np.testing.assert_allclose(on["logits"], gold[f"step{step}.logits"], atol=1e-4)


@pytest.mark.parametrize("name", ["llama_eager", "llama_sdpa23"])
def test_generation_pipeline_prefill_decode_and_blocks_are_bit_equal(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gold = np.load(FIXTURES / f"{name}.golden.npz")
    tokens = gold["greedy_tokens"].tolist()
    logits, blocks = {}, {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DSP_MERGE_PRODUCTS", flag)
        pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=48, mode="slot_by_slot")
        session = pipe.session()
        steps = [session.append(gold["prompt"])] + [session.append([[t]]) for t in tokens[:6]]
        logits[flag] = np.stack(steps)
        assert len(merges_of(pipe.decode_model.plan())) == (4 if flag == "1" else 0)
        block = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=48, mode="slot_by_slot", block_size=4)
        blocks[flag] = block.generate(gold["prompt"], max_new_tokens=16).token_list()
    assert np.array_equal(logits["0"], logits["1"])
    assert blocks["0"] == blocks["1"] == tokens[:16]


# -- crafted graphs: what merges ----------------------------------------------------------------
def _siblings(widths: tuple[int, ...], k: int = 64, opset: int = 23) -> dsp.Graph:
    """Three (or more) MatMuls of one x; the first's output is a graph output itself, the others feed a Tanh."""
    g = dsp.GraphBuilder("siblings", opset=opset)
    x = g.placeholder("x", "float32", ["b", 5, k])
    ys = [g.MatMul(x, g.constant(_w(k, n), name=f"w{i}")) for i, n in enumerate(widths)]
    g.output(ys[0])
    for i, y in enumerate(ys[1:], 1):
        g.output(g.Tanh(y), f"t{i}")
    return g.build()


def test_three_siblings_merge_keep_their_names_and_stay_bit_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    widths = (17, 5, 33)  # odd widths: one numpy product over the concatenation differs in the last bits
    graph = _siblings(widths)
    plan = _plan(graph, True)
    (merge,) = merges_of(plan)
    assert merge.n == sum(widths) and merge.k == 64 and [p.n for p in merge.parts] == list(widths)
    assert [s.op for s in plan.slots if s.op != "Identity"] == ["MergedMatMul", "Tanh", "Tanh"]
    first = graph.nodes[0].outputs[0]
    assert plan.output_names == (first, "t1", "t2")
    assert plan.ref_name(plan.outputs[0]) == first  # a product's graph output keeps its name
    assert [plan.ref_name(v) for v in plan.slots[0].outputs] == [n.outputs[0] for n in graph.nodes[:3]]
    x = RNG.standard_normal((3, 5, 64)).astype(np.float32)
    off, on = _run_both(graph, {"x": x}, monkeypatch)
    assert _bit_equal(off, on)
    # what it means: column blocks of one product over the weights joined along N
    joined = x @ concatenated_weight([graph.initializers[f"w{i}"] for i in range(3)])
    np.testing.assert_allclose(on[first], joined[..., :17], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on["t2"], np.tanh(joined[..., 22:]), rtol=1e-5, atol=1e-5)


def _gemm_siblings(
    trans_b: int, bias_shape: str = "1d", alpha: float = 0.5, beta: float = 2.0, opset: int = 23
) -> dsp.Graph:
    g = dsp.GraphBuilder("gemms", opset=opset)
    x = g.placeholder("x", "float32", ["m", 63])
    outs = []
    for i, n in enumerate((7, 9)):
        w = g.constant(_w(n, 63) if trans_b else _w(63, n), name=f"w{i}")
        c = g.constant(_w(n) if bias_shape == "1d" else _w(1, n), name=f"c{i}")
        outs.append(g.Gemm(x, w, c, alpha=alpha, beta=beta, transB=trans_b))
    g.output(outs[0])  # the products' outputs are the graph's
    g.output(outs[1])
    return g.build()


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias_shape", ["1d", "row"])
def test_two_gemm_siblings_with_bias_merge(trans_b: int, bias_shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _gemm_siblings(trans_b, bias_shape)
    plan = _plan(graph, True)
    (merge,) = merges_of(plan)
    assert merge.form == "Gemm" and merge.n == 16 and merge.k == 63 and len(plan.slots) == 1  # one slot, two outputs
    assert dict(plan.slots[0].attrs)["transB"] == trans_b and dict(plan.slots[0].attrs)["bias"] == 1
    x = RNG.standard_normal((1, 63)).astype(np.float32)  # one row, as in decode
    off, on = _run_both(graph, {"x": x}, monkeypatch)
    assert _bit_equal(off, on) and list(on) == graph.output_names == [n.outputs[0] for n in graph.nodes]


def test_a_shared_weight_is_merged_and_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    g = dsp.GraphBuilder("shared")
    x = g.placeholder("x", "float32", [3, 8])
    w, v = g.constant(_w(8, 8), name="w"), g.constant(_w(8, 6), name="v")
    a, b = g.MatMul(x, w), g.MatMul(x, v)
    g.output(g.MatMul(a, w), "aa")  # w is read again, by a product of another input
    g.output(b, "b")
    graph = g.build()
    plan = _plan(graph, True)
    assert len(merges_of(plan)) == 1 and [s.op for s in plan.slots if s.op != "Identity"] == ["MergedMatMul", "MatMul"]
    off, on = _run_both(graph, {"x": RNG.standard_normal((3, 8)).astype(np.float32)}, monkeypatch)
    assert _bit_equal(off, on)


# -- crafted graphs: what must not merge --------------------------------------------------------
def _pair(second: str) -> dsp.Graph:
    g = dsp.GraphBuilder(second)
    x = g.placeholder("x", "float32", [2, 8])
    first = g.MatMul(x, g.constant(_w(8, 4), name="w0"))
    if second == "different_k":
        other = g.MatMul(x, g.constant(_w(6, 4), name="w1"))  # K 6 != 8 (it would fail at run time, as before)
    elif second == "non_constant":
        other = g.MatMul(x, g.placeholder("w1", "float32", [8, 4]))
    elif second == "different_input":
        other = g.MatMul(g.Tanh(x), g.constant(_w(8, 4), name="w1"))
    elif second == "reads_the_other":
        other = g.MatMul(first, g.constant(_w(4, 4), name="w1"))
    elif second == "bias_is_the_other":
        other = g.Gemm(x, g.constant(_w(8, 4), name="w1"), first)
    elif second == "batched":
        other = g.MatMul(x, g.constant(_w(3, 8, 4), name="w1"))
    elif second == "trans_a":
        other = g.Gemm(g.Transpose(x), g.constant(_w(2, 4), name="w1"), transA=1)
    elif second == "gemm_and_matmul":
        other = g.Gemm(x, g.constant(_w(8, 4), name="w1"))
    elif second == "other_dtype":
        other = g.MatMul(x, g.constant(_w(8, 4).astype(np.float64), name="w1"))
    else:
        raise AssertionError(second)
    g.output(first, "first")
    g.output(other, "other")
    return g.build()


NOT_MERGED = {
    "different_k": "no sibling of the same kind",
    "non_constant": "is not a constant",
    "different_input": None,  # not siblings at all: nothing to report
    "reads_the_other": None,
    "bias_is_the_other": "bias",
    "batched": "rank 3",
    "trans_a": None,  # reads the transpose, another input
    "gemm_and_matmul": "no sibling of the same kind",
    "other_dtype": "no sibling of the same kind",
}


@pytest.mark.parametrize("case", sorted(NOT_MERGED))
def test_must_not_merge(case: str) -> None:
    graph = _pair(case)
    plan = _plan(graph, True)
    assert not merges_of(plan) and plan.content_hash == _plan(graph, False).content_hash
    merges, unmerged = analyse(graph, graph.nodes)
    assert not merges
    why = NOT_MERGED[case]
    if why is None:
        assert not unmerged
    else:
        assert unmerged and any(why in u.reason for u in unmerged), unmerged


def test_no_read_moves_across_an_in_place_write() -> None:
    """Products of a buffer around its KVScatter: merging would move the second read before the write."""
    g = dsp.GraphBuilder("written")
    buf = g.variable("buf", "float32", [2, 8])
    first = g.MatMul(buf, g.constant(_w(8, 3), name="w0"))
    written = g.op(
        "KVScatter", buf, g.placeholder("new", "float32", [1, 8]), g.placeholder("pos", "int64", [1]), domain="dsp"
    )
    second = g.MatMul(buf, g.constant(_w(8, 5), name="w1"))  # reads the buffer after the write: invalid
    for t in (first, written, second):
        g.output(t)
    graph = g.build()
    merges, unmerged = analyse(graph, graph.nodes)
    assert not merges and all("written in place" in u.reason for u in unmerged) and len(unmerged) == 2
    for merge in (False, True):  # rejected as it was, not made valid by the rewrite
        with pytest.raises(GraphError, match="after KVScatter"):
            compile_plan(graph, merge_products=merge)


def test_products_of_the_same_weight_kind_only_merge_among_themselves() -> None:
    g = dsp.GraphBuilder("mixed")
    x = g.placeholder("x", "float32", [2, 8])
    for i, n in enumerate((3, 4, 5)):
        g.output(g.MatMul(x, g.constant(_w(8, n), name=f"w{i}")), f"m{i}")
    g.output(g.MatMul(x, g.placeholder("fed", "float32", [8, 2])), "fed_out")
    graph = g.build()
    plan = _plan(graph, True)
    (merge,) = merges_of(plan)
    assert [p.n for p in merge.parts] == [3, 4, 5]
    assert [u.reason for u in analyse(graph, graph.nodes)[1]] == ["its weight 'fed' is not a constant (an initializer)"]


def test_a_merged_product_bad_input_count_is_a_clear_error() -> None:
    g = dsp.GraphBuilder("bad")
    x = g.placeholder("x", "float32", [2, 8])
    a, b = g.op("MergedMatMul", x, g.constant(_w(8, 3)), domain="dsp", outputs=2)
    g.output(a, "a")
    g.output(b, "b")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    with pytest.raises(dsp.DSPError, match="1 weight and bias inputs for 2 outputs"):
        model.run({"x": np.ones((2, 8), np.float32)})


# -- keys, DSP1, the CLI, the whole-segment backends -------------------------------------------
def test_the_switch_is_part_of_the_plan_cache_and_disk_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = FIXTURES / "llama_eager.onnx"
    keys, hashes = {}, {}
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    for flag in ("1", "0", "1"):
        monkeypatch.setenv("DSP_MERGE_PRODUCTS", flag)
        keys[flag] = model_key(path, dsp.__version__)
        assert plan_options() == f"merge_products={flag}"
        model = dsp.compile(path, mode="slot_by_slot")  # the second "1" is a disk-cache hit
        hashes[flag] = model.plan().content_hash
        assert len(merges_of(model.plan())) == (4 if flag == "1" else 0)
        feeds = {n: np.load(FIXTURES / "llama_eager.golden.npz")[f"step0.{n}"] for n in model.input_names}
        model.run(feeds)
        assert model.last_live is not None and model.last_live.signature.plan_hash == hashes[flag]
    assert keys["0"] != keys["1"] and hashes["0"] != hashes["1"]


def test_dsp1_round_trip_of_a_merged_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = import_model(FIXTURES / "llama_sdpa23.onnx")
    plan = _plan(graph, True)
    # the weights stay the model's own initializers: DSP1 keeps them by reference and they resolve by name
    loaded = serialize.loads(serialize.dumps(plan), resolve=graph.initializers.get)
    assert loaded.content_hash == plan.content_hash and loaded.slots == plan.slots
    assert merges_of(loaded) == merges_of(plan)
    gold = np.load(FIXTURES / "llama_sdpa23.golden.npz")
    feeds = {n: gold[f"step1.{n}"] for n in graph.input_names}
    fresh = dsp.compile(graph, mode="slot_by_slot").run(feeds)
    mode = dsp.GraphExecutionMode.SLOT_BY_SLOT
    again = dsp.CompiledModel(None, mode, plan=loaded, load_graph=lambda: graph).run(feeds)
    assert _bit_equal(fresh, again)


def test_plan_fuse_and_explain_show_the_merges(tmp_path: Path) -> None:
    path = str(FIXTURES / "llama_eager.onnx")
    fused = json.loads(run_cli("plan", "fuse", path, "--json").stdout)["merges"]
    assert fused["enabled"] and fused["products_merged"] == 10
    assert sorted(m["n"] for m in fused["merged"]) == [128, 128, 256, 256]
    assert [p["n"] for p in fused["merged"][0]["parts"]] == [64, 32, 32]
    text = run_cli("plan", "fuse", path).stdout
    assert "merged products: 4 merge(s) of 10 products" in text and "K=64 N=128" in text
    explained = json.loads(run_cli("plan", "explain", path, "--json").stdout)["merges"]
    assert explained["merged"] == fused["merged"]
    off = run_cli("plan", "explain", path, env={"DSP_MERGE_PRODUCTS": "0"}).stdout
    assert "merged products: off (DSP_MERGE_PRODUCTS=0)" in off


@pytest.mark.parametrize("opset", [11, 23])  # Split's sizes: an attribute before opset 13, an input after
@pytest.mark.parametrize("form", ["MatMul", "Gemm"])
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_whole_segment_backends_run_a_merged_plan_as_one_segment(backend: str, form: str, opset: int) -> None:
    graph = _gemm_siblings(1, opset=opset) if form == "Gemm" else _siblings((17, 5, 33), opset=opset)
    merged = dsp.compile(graph, mode=backend, strict=True)
    report = merged.explain()
    assert [s["backend"] for s in report["segments"]] == [backend]
    assert report["merges"]["products_merged"] == (2 if form == "Gemm" else 3)
    x = RNG.standard_normal((4, 63) if form == "Gemm" else (2, 5, 64)).astype(np.float32)
    reference = dsp.compile(graph, mode="slot_by_slot").run({"x": x})
    got = merged.run({"x": x})
    assert list(got) == list(reference) == graph.output_names
    for name in graph.output_names:
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-5)


def test_merge_report_of_a_graph_without_siblings() -> None:
    graph = import_model(FIXTURES / "gpt2_eager.onnx")
    report = merge_report(_plan(graph, True), graph)
    assert report["merged"] == [] and report["products_merged"] == 0


def test_the_rewrite_leaves_the_graph_as_it_is() -> None:
    """The rewrite lives in the plan only: the graph (the legacy interpreter's, its ONNX export) keeps the products."""
    graph = _siblings((3, 4, 5))
    before = to_onnx(graph).SerializeToString()
    _plan(graph, True)
    assert [n.op_type for n in graph.nodes].count("MatMul") == 3
    assert to_onnx(graph).SerializeToString() == before


@pytest.mark.parametrize(("form", "trans_b"), [("MatMul", 0), ("Gemm", 0), ("Gemm", 1)])
def test_split_merged_writes_each_part_as_its_own_product_and_openvino_runs_it(form: str, trans_b: int) -> None:
    """``segment_model(split_merged=True)`` writes a merged product as its parts' own products on
    their own weights (no Concat, no Slice): OpenVINO's segments are written so (it fuses products
    its own way); its step equals the reference's."""
    from dsp_openvino.segment import OpenVinoSegment

    from dsp_core.backends.whole import segment_io
    from dsp_core.plan.subgraph import segment_model

    graph = _gemm_siblings(trans_b) if form == "Gemm" else _siblings((17, 5, 33))
    plan = _plan(graph, True)
    (merge,) = merges_of(plan)
    slots = tuple(range(len(plan.slots)))
    io, _ = segment_io(plan, slots)
    feeds = {f: ("float32", None) for f in io.inputs}
    ops = [n.op_type for n in segment_model(plan, slots, io, feeds, {}, split_merged=True).graph.node]
    assert ops.count(form) == len(merge.parts) and "Concat" not in ops and "Slice" not in ops, ops
    joined = [n.op_type for n in segment_model(plan, slots, io, feeds, {}).graph.node]
    assert joined.count(form) == 1 and "Concat" in joined  # the default: one product, a Slice per part
    assert OpenVinoSegment.split_merged
    x = RNG.standard_normal((4, 63) if form == "Gemm" else (2, 5, 64)).astype(np.float32)
    got = dsp.compile(graph, mode="openvino", strict=True).run({"x": x})
    reference = dsp.compile(graph, mode="slot_by_slot").run({"x": x})
    for name in graph.output_names:
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-5)
