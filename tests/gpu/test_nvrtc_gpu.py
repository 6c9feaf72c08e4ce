"""NVRTC_JIT and PTX_JIT on a GPU: every fixture matches the reference, captures and replays; the
generated kernels come from the segment cache on a second compile; fewer kernels per replay than
CUDA_GRAPHS; generation with Triton out of the way gives torch's tokens; PTX_JIT runs the kernels
NVRTC_JIT exported as PTX without compiling any.

Run: ``python3 -m pytest -q tests/gpu/test_nvrtc_gpu.py`` (with ``$OUT`` set, the kernel counts
are also written to ``$OUT/nvrtc_kernel_counts.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.llm import GenerationPipeline
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.units import UnitKind

from .fused_checks import fusion_reports as _reports
from .fused_checks import outputs_close as _close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]
MODES = ["nvrtc_jit", "ptx_jit"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dsp-cache"))


@pytest.fixture
def nvrtc_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_NVRTC_ATTENTION", "1")  # the default, whatever the environment says


def _tolerance(mode: str) -> float:
    from dsp_nvrtc.plugin import NvrtcBackend, PtxBackend

    return (NvrtcBackend() if mode == "nvrtc_jit" else PtxBackend()).contract.tolerance


def _feeds(name: str, step: int | None) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    prefix = f"step{step}." if step is not None else ""
    return {k[len(prefix) :]: golden[k] for k in golden.files if k.startswith(prefix)}  # filtered by input_names


@pytest.mark.parametrize("mode", MODES)
def test_available_here(mode: str) -> None:
    from dsp_nvrtc.plugin import NvrtcBackend, PtxBackend

    backend = NvrtcBackend() if mode == "nvrtc_jit" else PtxBackend()
    assert backend.availability().ok, backend.availability().reason


def _run_fixture(name: str, mode: str) -> dsp.CompiledModel:
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode=mode, strict=True)
    tol = _tolerance(mode)
    for step in (0, 1) if name != "cnn" else (None,):
        feeds = {n: v for n, v in _feeds(name, step).items() if n in model.input_names}
        want = ref.run(feeds)
        for i in range(8):  # eager, freeze, warm (kernels built and checked), capture, replays
            _close(model.run(feeds), want, tol, f"{name} {mode} step {step} run {i}")
        runtime = model.last_live.runtime  # type: ignore[union-attr]
        reasons = [u.reason for u in runtime.units if u.kind is UnitKind.ISLAND and u.reason]
        assert model.dsp.phase is PlanPhase.REPLAYING, f"{name} step {step}: {model.dsp.phase}; {reasons}"
        before = runtime.counters()
        for _ in range(3):
            _close(model.run(feeds), want, tol, f"{name} {mode} step {step} steady")
        after = runtime.counters()
        assert after["recaptures"] == before["recaptures"]
        assert after["replays"] > before["replays"]
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_fixture_matches_reference_and_replays(name: str, mode: str) -> None:
    model = _run_fixture(name, mode)
    assert mode in model.resolved_backends()
    if mode == "nvrtc_jit":
        reports = _reports(model)
        assert not [r for r in reports if r["status"] == "demoted"], reports
        fused = [r for r in reports if r["status"] == "fused"]
        assert fused, f"{name}: no group ran as a generated kernel: {reports}"
        assert all(r["kernel"].startswith("dsp_") for r in fused)


def test_a_second_compile_loads_every_kernel_from_the_segment_cache() -> None:
    first = _reports(_run_fixture("llama_eager", "nvrtc_jit"))
    second = _reports(_run_fixture("llama_eager", "nvrtc_jit"))
    fused = [r for r in second if r["status"] == "fused"]
    assert fused and all(r["cached"] for r in fused), second
    assert {r["kernel"] for r in fused} == {r["kernel"] for r in first if r["status"] == "fused"}


def test_a_damaged_cache_entry_is_recompiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_nvrtc.cache import MAGIC, JitSegmentCacheKey, _parse, cache_root

    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))  # only this model's kernels: each is read back

    _run_fixture("gpt2_eager", "nvrtc_jit")
    entries = sorted(cache_root().glob("*.kernel"))
    assert entries
    for path in entries:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # a flipped byte in the binary
        path.write_bytes(bytes(data))
    model = _run_fixture("gpt2_eager", "nvrtc_jit")  # every output still the reference's
    reports = _reports(model)
    assert [r for r in reports if r["status"] == "fused"], reports
    assert not [r for r in reports if r["status"] == "demoted"], reports
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    caches = {id(u.compiled._source): u.compiled._source.cache for u in runtime.units if hasattr(u.compiled, "_source")}
    assert sum(c.damaged for c in caches.values()) >= 1, "no damaged entry was noticed"
    for path in cache_root().glob("*.kernel"):  # what was read back damaged is whole again
        data = path.read_bytes()
        header = json.loads(data[len(MAGIC) : data.index(b"\n", len(MAGIC))])
        entry, why = _parse(data, JitSegmentCacheKey(**header["key"]))
        assert entry is not None, f"{path.name}: {why}"


def test_a_group_that_disagrees_is_demoted_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_nvrtc import codegen

    real = codegen._UNARY["Tanh"]
    monkeypatch.setitem(codegen._UNARY, "Tanh", lambda x, ct, a: f"({real(x, ct, a)} + 1.0f)")
    ref = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="nvrtc_jit", strict=True)
    # a decode step (one row): its MLP up-projection, GELU and all, is one kernel (the norm its
    # prologue); a prompt's rows would run that product and its GELU on the reference path
    feeds = {n: v for n, v in _feeds("gpt2_eager", 1).items() if n in model.input_names}
    want = ref.run(feeds)
    with pytest.warns(UserWarning, match="demoted to its reference kernels"):
        for _ in range(6):
            _close(model.run(feeds), want, _tolerance("nvrtc_jit"), "demoted")
    demoted = [r for r in _reports(model) if r["status"] == "demoted"]
    assert demoted and "disagreed" in demoted[0]["reason"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DECODERS)
def test_generation_without_triton_gives_torchs_greedy_tokens(name: str, mode: str) -> None:
    g = np.load(FIXTURES / f"{name}.golden.npz")
    want = g["greedy_tokens"][:32].tolist()
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode=mode)
    assert pipe.decoder(1).model.resolved_backends() == [mode]
    result = pipe.generate(g["prompt"], 32)
    assert result.tokens[0].tolist() == want, f"{name} {mode}: tokens differ from torch's"


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_ptx_jit_runs_nvrtc_jits_exported_kernels_without_compiling(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsp_nvrtc import compiler

    g = np.load(FIXTURES / f"{name}.golden.npz")
    want = g["greedy_tokens"][:32].tolist()
    monkeypatch.setenv("DSP_PTX_DIR", str(tmp_path / "bundle"))
    monkeypatch.setenv("DSP_NVRTC_EXPORT_PTX", "1")
    built = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="nvrtc_jit")
    assert built.generate(g["prompt"], 32).tokens[0].tolist() == want
    assert list((tmp_path / "bundle").glob("*.compute_*.ptx")), "nothing exported"
    monkeypatch.delenv("DSP_NVRTC_EXPORT_PTX")

    def no_nvrtc(*_: Any) -> bytes:
        raise AssertionError("PTX_JIT compiled a kernel")

    monkeypatch.setattr(compiler, "compile_source", no_nvrtc)
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="ptx_jit")
    assert pipe.decoder(1).model.resolved_backends() == ["ptx_jit"]
    assert pipe.generate(g["prompt"], 32).tokens[0].tolist() == want, f"{name}: PTX_JIT's tokens differ from torch's"
    nvrtc = {r["kernel"] for r in _reports(built.decoder(1).model) if r["status"] == "fused"}
    reports = _reports(pipe.decoder(1).model)
    assert nvrtc and {r["kernel"] for r in reports if r["status"] == "fused"} == nvrtc, [
        r for r in reports if r["status"] != "fused"
    ]


def test_ptx_jit_without_a_bundle_runs_each_group_on_its_reference_kernels_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_PTX_DIR", str(tmp_path / "empty"))
    model = _run_fixture("gpt2_eager", "ptx_jit")
    reports = _reports(model)
    assert reports and not [r for r in reports if r["status"] == "fused"], reports
    assert any("no PTX of its kernel" in r["reason"] for r in reports), reports


def _replays_like_the_reference(
    graph: dsp.Graph, rng: np.random.Generator, shape: tuple[int, ...], dtype: Any, runs: int, what: str
) -> dsp.CompiledModel:
    """``graph`` on NVRTC_JIT, ``runs`` random ``x`` feeds each equal to the reference's, then replaying."""
    want = dsp.compile(graph, mode="slot_by_slot")
    model = dsp.compile(graph, mode="nvrtc_jit", strict=True)
    tol = _tolerance("nvrtc_jit")
    for run in range(runs):
        feeds = {"x": rng.standard_normal(shape).astype(dtype)}
        _close(model.run(feeds), want.run(feeds), tol, f"{what} run {run}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    return model


def _kernels_per_replay(model: dsp.CompiledModel, feeds: dict[str, np.ndarray]) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(8):
        model.run(feeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.run(feeds)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")))


def test_fewer_kernels_per_replay_than_cuda_graphs() -> None:
    pytest.importorskip("torch")
    counts: dict[str, dict[str, int]] = {}
    for name in DECODERS:
        feeds = _feeds(name, 1)
        counts[name] = {}
        for mode in ("cuda_graphs", "ptx_jit", "nvrtc_jit"):
            model = dsp.compile(FIXTURES / f"{name}.onnx", mode=mode, strict=True)
            counts[name][mode] = _kernels_per_replay(model, {n: feeds[n] for n in model.input_names})
    out = os.environ.get("OUT")
    if out:
        Path(out, "nvrtc_kernel_counts.json").write_text(json.dumps(counts, indent=2))
    print(json.dumps(counts))
    for name, c in counts.items():
        assert c["nvrtc_jit"] < c["cuda_graphs"], (name, c)
        assert c["ptx_jit"] <= c["cuda_graphs"], (name, c)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", [(1, 50257), (2, 128256), (2, 3, 5000)])
def test_the_greedy_pick_gives_numpys_argmax_in_two_cuda_c_kernels_while_replaying(
    shape: tuple[int, ...], dtype: str
) -> None:
    from .greedy_check import greedy_pick_reports

    reports = greedy_pick_reports("nvrtc_jit", shape, dtype)
    picks = [r for r in reports if r["template"] == "greedy_pick"]
    assert len(picks) == 1 and picks[0]["status"] == "fused", reports
    assert picks[0]["kernel"].startswith("dsp_argmax_"), picks


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("form", ["matmul", "gemm_trans_b"])
@pytest.mark.parametrize("k, n", [(768, 2304), (3072, 768)])  # a warp per output; a block per output
def test_products_by_big_constant_weights_are_warp_kernels_equal_to_the_reference(
    form: str, rows: int, dtype: str, k: int, n: int
) -> None:
    """A product by a weight too big for one thread per output (GPT-2's QKV projection, its MLP's
    down projection; as a MatMul or a transposed Gemm) is a warp (or, K long and N small, a block)
    per output, its lanes over K, a [K, N] weight read through a copy laid out [N, K]; its
    epilogue (bias, tanh) in the same kernel."""
    rng = np.random.default_rng(rows)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", dtype, [rows, k])
    bias = g.constant((rng.standard_normal(n) * 0.1).astype(dtype))
    if form == "matmul":
        y = x @ g.constant((rng.standard_normal((k, n)) * 0.05).astype(dtype)) + bias
    else:
        w = g.constant((rng.standard_normal((n, k)) * 0.05).astype(dtype))
        y = g.Gemm(x, w, bias, transB=1)
    g.output(g.Tanh(y), "y")
    graph = g.build()
    model = _replays_like_the_reference(graph, rng, (rows, k), dtype, 8, f"{form} rows {rows}")
    products = [r for r in _reports(model) if r["template"] == "product"]
    assert len(products) == 1 and products[0]["status"] == "fused", _reports(model)
    assert products[0]["kernel"].startswith("dsp_mm_")


def _exported_rms(g: Any, x: Any, k: int, rng: np.random.Generator, scale: float, dtype: str) -> Any:
    """RMSNorm over x's last axis (``k`` long) as torch's exporter writes it (fp32 mean of squares,
    reciprocal square root, cast back), times a scale vector near ``scale``."""
    x32 = g.Cast(x, to=1)
    mean = g.ReduceMean(g.Pow(x32, g.constant(np.array(2.0, np.float32))), g.constant(np.array([-1])))
    inv = g.Reciprocal(g.Sqrt(g.Add(mean, g.constant(np.array(1e-6, np.float32)))))
    w = g.constant((scale + 0.1 * rng.standard_normal(k)).astype(dtype))
    return g.Mul(g.Cast(g.Mul(x32, inv), to=10 if dtype == "float16" else 1), w)


@pytest.mark.parametrize("columns", ["0", "1", "2", "4"])
@pytest.mark.parametrize("lanes", ["auto", "warp", "block"])
@pytest.mark.parametrize("case", ["down_8192x2048", "rms_gate_up"])
def test_every_lanes_and_columns_setting_gives_the_reference(
    case: str, lanes: str, columns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every DSP_NVRTC_PRODUCT_LANES x DSP_NVRTC_PRODUCT_COLUMNS the products benchmark times, on
    Llama-1B's down projection (K 8,192: a warp's lanes walk 32 steps, the preload's window rolling
    across them) and its RMSNorm + gate/up + SiLU x up (two or four columns a warp roll the window
    too), replaying, equal to the reference."""
    monkeypatch.setenv("DSP_NVRTC_PRODUCT_LANES", lanes)
    monkeypatch.setenv("DSP_NVRTC_PRODUCT_COLUMNS", columns)
    rng = np.random.default_rng(21)
    g = dsp.GraphBuilder()
    k = 8192 if case.startswith("down") else 2048
    x = g.placeholder("x", "float16", [1, 1, k])
    if case.startswith("down"):
        w = g.constant((rng.standard_normal((k, 2048)) * 0.01).astype(np.float16))
        g.output(g.Add(x @ w, g.constant((rng.standard_normal(2048) * 0.1).astype(np.float16))), "y")
    else:
        h = _exported_rms(g, x, k, rng, 1.0, "float16")
        gate, up = (h @ g.constant((rng.standard_normal((k, 8192)) * 0.02).astype(np.float16)) for _ in range(2))
        g.output(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), "y")
    graph = g.build()
    model = _replays_like_the_reference(graph, rng, (1, 1, k), np.float16, 6, f"{case} lanes {lanes} columns {columns}")
    products = [r for r in _reports(model) if r["template"] == "product"]
    assert len(products) == 1 and products[0]["status"] == "fused", _reports(model)


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager", "llama_sdpa23"])
def test_the_decode_plans_kv_stores_are_written_by_the_kernels_that_make_their_rows(name: str) -> None:
    """Each dsp::KVScatter of the decode plan is written by the generated kernel of the group that
    computes its row (GPT-2's split of the QKV product, Llama's rotary of K and its merged Q/K/V
    product through V's layout: checked on zeroed copies of the buffers against the reference);
    a store whose row an opaque op makes
    (opset 23's RotaryEmbedding) is dsp-nvrtc's store kernel. The tokens stay torch's."""
    g = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="nvrtc_jit")
    result = pipe.generate(g["prompt"], 16)
    assert result.tokens[0].tolist() == g["greedy_tokens"][:16].tolist()
    plan = pipe.decode_model.plan()
    assert plan is not None
    reports = _reports(pipe.decode_model)
    with_kv = [r for r in reports if any(plan.slots[s].op == "KVScatter" for s in r["slots"])]
    assert with_kv and all(r["status"] == "fused" for r in with_kv), with_kv
    alone = [r for r in with_kv if r["template"] == "store"]
    assert all(r["kernel"].startswith("dsp_kv_") for r in alone), alone
    joined = [r for r in with_kv if r["template"] != "store"]
    # Llama's V row: the merged Q/K/V product's kernel writes it through V's layout
    assert len(joined) >= 2 and all(r["kernel"].startswith(("dsp_cp_", "dsp_pw_", "dsp_mm_")) for r in joined), joined
    if name.startswith("llama"):
        assert any(r["template"] == "product" for r in joined), joined
    if name != "llama_sdpa23":
        assert not alone, alone  # every row is made by a pointwise or copy group


@pytest.mark.parametrize("form", ["MatMul", "Gemm"])
def test_merged_sibling_products_are_one_kernel_equal_to_the_reference(form: str) -> None:
    """Q/K/V-like siblings (the core merges them into one dsp::MergedMatMul) run as one NVRTC kernel
    over their weights joined once, each part's epilogue after it; outputs equal the reference's."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, 2048])
    flat = g.Reshape(x, g.constant(np.array([1, 2048], np.int64)))  # one input read by the three Gemms
    for i, n in enumerate((2048, 512, 512)):
        if form == "MatMul":
            y = x @ g.constant((rng.standard_normal((2048, n)) * 0.03).astype(np.float16))
        else:
            w = g.constant((rng.standard_normal((n, 2048)) * 0.03).astype(np.float16))
            y = g.Gemm(flat, w, g.constant((rng.standard_normal(n) * 0.1).astype(np.float16)), transB=1)
        g.output(g.Tanh(y), f"y{i}")
    graph = g.build()
    model = _replays_like_the_reference(graph, rng, (1, 1, 2048), np.float16, 8, f"merged {form}")
    plan = model.plan()
    assert plan is not None
    merged = [r for r in _reports(model) if [plan.slots[s].op for s in r["slots"]] == ["MergedMatMul"]]
    assert len(merged) == 1 and merged[0]["status"] == "fused", _reports(model)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_norm_is_the_merged_products_prologue_and_silu_times_up_its_pairwise_epilogue(dtype: str) -> None:
    """Llama-1B's shapes: RMSNorm (the exported chain) -> Q/K/V (2048, 512, 512) as one kernel; another
    RMSNorm -> gate/up (8192 each) -> SiLU(gate) x up as one kernel; replaying, equal to the reference."""
    rng = np.random.default_rng(11)
    g = dsp.GraphBuilder()
    k = 2048
    x = g.placeholder("x", dtype, [1, 1, k])

    def weight(n: int) -> Any:
        return g.constant((rng.standard_normal((k, n)) * 0.02).astype(dtype))

    h = _exported_rms(g, x, k, rng, 1.0, dtype)
    for i, n in enumerate((2048, 512, 512)):
        g.output(g.Identity(h @ weight(n)), f"qkv{i}")
    h2 = _exported_rms(g, x, k, rng, 0.9, dtype)
    gate, up = h2 @ weight(8192), h2 @ weight(8192)
    g.output(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), "mlp")
    graph = g.build()
    model = _replays_like_the_reference(graph, rng, (1, 1, k), dtype, 8, f"merged with prologue {dtype}")
    plan = model.plan()
    assert plan is not None
    merged = [r for r in _reports(model) if "MergedMatMul" in [plan.slots[s].op for s in r["slots"]]]
    assert len(merged) == 2 and all(r["status"] == "fused" for r in merged), merged
    for r in merged:
        ops = [plan.slots[s].op for s in r["slots"]]
        assert "ReduceMean" in ops and r["kernel"].startswith("dsp_mm_"), (ops, r)
    assert sum("Sigmoid" in [plan.slots[s].op for s in r["slots"]] for r in merged) == 1


def test_a_chain_of_dependent_launches_keeps_the_graphs_order_while_replaying() -> None:
    """48 products in a chain (each reads the one before; its weight preloaded, 16 bytes a load,
    before it waits), a residual and pointwise kernels between them: with DSP_NVRTC_PDL on (the
    default) every NVRTC kernel launches as a programmatic dependent, and the replayed graph still
    gives the reference's values."""
    import cupy as cp
    from dsp_nvrtc import launch

    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    assert launch.dependent_launch(cp), "DSP_NVRTC_PDL is on by default and this GPU supports it"
    from .chain_graph import product_chain

    rng = np.random.default_rng(5)
    graph = product_chain(rng)
    model = _replays_like_the_reference(graph, rng, (1, 1, 768), np.float16, 10, "chain")
    products = [r for r in _reports(model) if r["template"] == "product"]
    assert len(products) == 48 and all(r["status"] == "fused" for r in products), products


@pytest.mark.usefixtures("nvrtc_attention")
# -- decode attention (T4) ---------------------------------------------------------------------
@pytest.mark.parametrize("splits", ["0", "1", "4", "16"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_attention_is_one_kernel_matching_the_reference(
    dtype: str, splits: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GQA ratios 1, 3, 4, valid lengths 1, 255, 257, L-1, L (the rest masked): one block per head
    reading K and V through the group's index arithmetic, or (past 256 positions by the shared rule,
    or as DSP_NVRTC_KV_SPLITS forces) one block per head and range of positions, then a combine
    kernel; captured, replaying."""
    import sys

    from dsp_cuda_graphs import attention

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "triton_interp"))
    import attention_graphs as ag

    monkeypatch.setenv("DSP_NVRTC_KV_SPLITS", splits)
    tol = _tolerance("nvrtc_jit")
    for heads, kv, length, valid, dim in ag.CASES:
        feeds = ag.feeds(heads, kv, length, valid, dim, dtype)
        want = ag.model(heads, kv, length, dim, "slot_by_slot", dtype).run(feeds)
        model = ag.model(heads, kv, length, dim, "nvrtc_jit", dtype, strict=True)
        for i in range(8):  # eager, freeze, warm (compiled and checked), capture, replays
            _close(model.run(feeds), want, tol, f"attention {heads}/{kv} L{length} valid {valid} {dtype} run {i}")
        assert model.dsp.phase is PlanPhase.REPLAYING
        groups = [r for r in _reports(model) if r["template"] == "decode_attention"]
        assert len(groups) == 1 and groups[0]["status"] == "fused", groups
        split = attention.kv_split_count(heads, length, 132, forced=int(splits)) > 1
        kernels = groups[0]["kernel"].split("+")
        assert kernels[0].startswith("dsp_attn_") and len(kernels) == (2 if split else 1), (splits, length, groups)
        if split:
            assert kernels[1].startswith("dsp_attc_")


@pytest.mark.usefixtures("nvrtc_attention")
@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_a_prompts_attention_runs_as_parts_and_the_decode_steps_as_one_kernel(name: str) -> None:
    """The fixture's step 0 (the prompt's rows: products on cuBLAS, the softmax between them one
    generated kernel) and step 1 (one decode token: one attention kernel per layer), both as the
    reference gives them."""
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    tol = _tolerance("nvrtc_jit")
    for step in (0, 1):
        model = dsp.compile(FIXTURES / f"{name}.onnx", mode="nvrtc_jit", strict=True)
        feeds = {n: v for n, v in _feeds(name, step).items() if n in model.input_names}
        want = ref.run(feeds)
        for i in range(8):
            _close(model.run(feeds), want, tol, f"{name} step {step} run {i}")
        assert model.dsp.phase is PlanPhase.REPLAYING
        groups = [r for r in _reports(model) if r["template"] == "decode_attention"]
        assert len(groups) == 2 and all(r["status"] == "fused" for r in groups), groups
        rows = int(feeds["input_ids"].shape[-1]) if "input_ids" in feeds else 1
        prefix = "dsp_attn_" if rows == 1 else "dsp_row_"
        assert all(r["kernel"].startswith(prefix) for r in groups), (step, groups)
