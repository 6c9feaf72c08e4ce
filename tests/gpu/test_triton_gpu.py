"""TRITON on a GPU: fused groups match the reference, capture and replay; generation gives torch's tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.llm import GenerationPipeline
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.units import UnitKind

from .fused_checks import fusion_reports as _reports
from .fused_checks import outputs_close, replays_match

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def _backend() -> Any:
    from dsp_triton.plugin import TritonBackend

    return TritonBackend()


def _close(got: dict[str, Any], want: dict[str, np.ndarray], what: str) -> None:
    outputs_close(got, want, _backend().contract.tolerance, what)


def test_available_here() -> None:
    backend = _backend()
    assert backend.availability().ok, backend.availability().reason


def test_auto_resolves_to_triton() -> None:
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx")
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    model.run({n: golden[f"step0.{n}"] for n in model.input_names})
    assert model.resolved_backends() == ["triton"]


@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_fixture_matches_reference_fused_and_replaying(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="triton", strict=True)
    steps = (0, 1) if name != "cnn" else (None,)
    for step in steps:
        prefix = f"step{step}." if step is not None else ""
        feeds = {n: golden[f"{prefix}{n}"] for n in model.input_names}
        want = ref.run(feeds)
        for i in range(8):  # eager, freeze, warm (kernels compiled and checked), capture, replays
            _close(model.run(feeds), want, f"{name} step {step} run {i}")
        runtime = model.last_live.runtime  # type: ignore[union-attr]
        islands = [u for u in runtime.units if u.kind is UnitKind.ISLAND]
        reasons = [u.reason for u in islands if u.reason]
        assert model.dsp.phase is PlanPhase.REPLAYING, f"{name} step {step}: {model.dsp.phase}; {reasons}"
        reports = _reports(model)
        fused = [r for r in reports if r["status"] == "triton"]
        demoted = [r for r in reports if r["status"] == "demoted"]
        assert not demoted, demoted
        assert fused, f"{name}: no group ran as a Triton kernel: {reports}"
        before = runtime.counters()
        for _ in range(3):
            _close(model.run(feeds), want, f"{name} step {step} steady")
        after = runtime.counters()
        assert after["recaptures"] == before["recaptures"]
        assert after["replays"] > before["replays"]


@pytest.mark.parametrize("name", DECODERS)
def test_generation_gives_torchs_greedy_tokens(name: str) -> None:
    g = np.load(FIXTURES / f"{name}.golden.npz")
    want = g["greedy_tokens"][:32].tolist()
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="auto")
    assert pipe.decoder(1).model.resolved_backends() == ["triton"]
    result = pipe.generate(g["prompt"], 32)
    assert result.tokens[0].tolist() == want, f"{name}: tokens differ from torch's"
    again = pipe.generate(g["prompt"], 32)
    assert again.tokens[0].tolist() == want


def _gpt2_warned(match: str) -> dsp.CompiledModel:
    """The GPT-2 fixture on TRITON: warns ``match`` while its first runs compile, gives the reference's outputs."""
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    ref = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="triton", strict=True)
    feeds = {n: golden[f"step0.{n}"] for n in model.input_names}
    want = ref.run(feeds)
    with pytest.warns(UserWarning, match=match):
        for _ in range(6):
            _close(model.run(feeds), want, match)
    return model


def test_a_group_that_disagrees_is_demoted_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generated kernel that computes the wrong thing: the group falls back to its reference kernels."""
    from dsp_triton import codegen

    real = codegen._UNARY["Tanh"]
    monkeypatch.setitem(codegen._UNARY, "Tanh", lambda x, a: f"({real(x, a)} + 1.0)")
    model = _gpt2_warned("demoted to its reference kernels")
    demoted = [r for r in _reports(model) if r["status"] == "demoted"]
    assert demoted and "disagreed" in demoted[0]["reason"]


# -- the skinny-product template (T3) ---------------------------------------------------------
def _product_model(m: int, k: int, n: int, dtype: str, mode: str, residual: bool = True) -> dsp.CompiledModel:
    rng = np.random.default_rng(m * 1000 + k + n)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", dtype, [1, "rows", k])  # rows decided per layout, as in a prefill
    w = g.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype), name="w")
    b = g.constant(rng.standard_normal((n,)).astype(dtype), name="b")
    y = g.Relu(x @ w + b)
    if residual:
        r = g.placeholder("r", dtype, [1, "rows", n])
        y = y + r
    g.output(y, "y")
    return dsp.compile(g.build(), mode=mode, strict=mode != "slot_by_slot")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("m, k, n", [(1, 200, 72), (1, 1000, 130), (5, 333, 70), (16, 64, 1030), (33, 200, 72)])
def test_products_with_their_epilogue_match_the_reference(m: int, k: int, n: int, dtype: str) -> None:
    """Rows 1..16: one kernel (product + bias + Relu + residual); 33 rows: cuBLAS, then the epilogue kernel."""
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((1, m, k)).astype(dtype), "r": rng.standard_normal((1, m, n)).astype(dtype)}
    want = _product_model(m, k, n, dtype, "slot_by_slot").run(feeds)
    model = _product_model(m, k, n, dtype, "triton")
    for i in range(6):
        _close(model.run(feeds), want, f"product {m}x{k}x{n} {dtype} run {i}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    products = [r for r in _reports(model) if r["template"] == "product"]
    assert len(products) == 1 and products[0]["status"] == "triton", products
    if m > 16:
        assert "cuBLAS" in products[0]["reason"]
    else:
        assert products[0]["kernel"].startswith("dsp_mm_") and not products[0]["reason"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_products_for_every_row_count(dtype: str) -> None:
    """Rows 1, 2, 7, 16 (the one-row bodies and tl.dot with rows padded to 16); bf16 has no CuPy kernels."""
    rng = np.random.default_rng(3)
    for m in (1, 2, 7, 16):
        feeds = {"x": rng.standard_normal((1, m, 300)).astype(dtype)}
        want = _product_model(m, 300, 200, dtype, "slot_by_slot", residual=False).run(feeds)
        model = _product_model(m, 300, 200, dtype, "triton", residual=False)
        for i in range(4):
            _close(model.run(feeds), want, f"{dtype} rows {m} run {i}")


def test_the_tuner_takes_the_fastest_config_that_agrees_with_the_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fastest tuned config computes zeros: the next fastest is checked and kept, the cache learns it."""
    from dsp_triton import kernels

    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    timed: list[Any] = []

    def fake_time(self: Any, compiled: Any, local: Any) -> float:
        timed.append(compiled)  # each config timed faster than the one before: the last one wins
        real_launch = compiled.launch

        def launch(ptrs: Any, stream: int) -> None:
            real_launch(ptrs, stream)
            if compiled is timed[-1]:  # the fastest config writes zeros over its outputs
                kernel = compiled.kernel
                for ptr, v in zip(ptrs[kernel.n_inputs :], kernel.args[kernel.n_inputs :]):
                    shape, dtype = compiled.shapes[v]
                    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    cupy.cuda.runtime.memsetAsync(int(ptr), 0, nbytes, stream)

        compiled.launch = launch
        return 100.0 - len(timed)

    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(kernels.FusedGroup, "_time", fake_time)
    rng = np.random.default_rng(11)
    feeds = {
        "x": rng.standard_normal((1, 5, 333)).astype("float32"),
        "r": rng.standard_normal((1, 5, 70)).astype("float32"),
    }
    ref = _product_model(5, 333, 70, "float32", "slot_by_slot")
    model = _product_model(5, 333, 70, "float32", "triton")
    replays_match(model, ref, [feeds], 1e-3, calls=6)
    (product,) = [r for r in _reports(model) if r["template"] == "product"]
    assert len(timed) > 2 and product["status"] == "triton", product
    # The eager run's group timed the configs and checked them fastest first; the replayed plan's
    # group read the winner that agreed from the tune cache, beside the one it rejected.
    entries = [json.loads(p.read_text()) for p in (tmp_path / "triton" / "tune").glob("*.json")]
    (entry,) = [e for e in entries if "rejected" in e]
    times = entry["times_us"]
    fastest = min(times, key=times.get)
    assert entry["rejected"] == [{a: int(b) for a, b in (kv.split("=") for kv in fastest.split(","))}], entry
    assert product["config"] == entry["config"] != entry["rejected"][0], (product, entry)
    assert "disagreed with the reference" in product["reason"], product
    # A new model of the same layout: the tune cache gives the config that agreed, nothing is timed.
    n_timed = len(timed)
    again = _product_model(5, 333, 70, "float32", "triton")
    replays_match(again, ref, [feeds], 1e-3, calls=6)
    (product,) = [r for r in _reports(again) if r["template"] == "product"]
    assert product["status"] == "triton" and product["config"] == entry["config"] and len(timed) == n_timed
    assert "disagreed with the reference" in product["reason"], product


def test_tuning_without_the_l2_flush_has_its_own_winners(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """DSP_TRITON_TUNE_FLUSH=0: configs timed back to back, the model still right and replaying, and
    the winner cached apart from the flushed timing's."""
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(12)
    feeds = {
        "x": rng.standard_normal((1, 5, 333)).astype("float32"),
        "r": rng.standard_normal((1, 5, 70)).astype("float32"),
    }
    ref = _product_model(5, 333, 70, "float32", "slot_by_slot")
    tune = tmp_path / "triton" / "tune"
    counts = []
    for flush in ("1", "0"):
        monkeypatch.setenv("DSP_TRITON_TUNE_FLUSH", flush)
        replays_match(_product_model(5, 333, 70, "float32", "triton"), ref, [feeds], 1e-3, calls=6)
        counts.append(len(list(tune.glob("*.json"))))
    assert counts[0] >= 1 and counts[1] > counts[0], counts


@pytest.mark.parametrize("dtypes", [("float32", "int16", "uint8"), ("int16", "float32", "uint64")])
def test_one_source_over_other_dtypes_is_another_binary(dtypes: tuple[str, ...]) -> None:
    """LessOrEqual expanded (Less, Equal, Or) generates the same source over any input dtype; each
    dtype gets its own binary (a float32 binary reused for int16 inputs was demoted by its check)."""
    for dtype in dtypes:
        g = dsp.GraphBuilder()
        x, y = g.placeholder("x", dtype, [3, 4, 5]), g.placeholder("y", dtype, [3, 4, 5])
        g.output(g.Or(g.Less(x, y), g.Equal(x, y)), "z")
        graph = g.build()
        rng = np.random.default_rng(5)
        feeds = {n: np.abs(rng.standard_normal((3, 4, 5)) * 4).astype(dtype) for n in ("x", "y")}
        feeds["y"].reshape(-1)[:7] = feeds["x"].reshape(-1)[:7]  # some equal pairs
        model = dsp.compile(graph, mode="triton", strict=True)
        for _ in range(10):  # eager with its compile and check, freeze, warm, capture, replays
            np.testing.assert_array_equal(model.run(feeds)["z"], feeds["x"] <= feeds["y"], err_msg=dtype)
        assert model.dsp.phase is PlanPhase.REPLAYING
        (group,) = _reports(model)
        assert group["status"] == "triton", (dtype, group)


# -- decode attention (T4) ---------------------------------------------------------------------
@pytest.mark.parametrize("splits", ["1", "4", "0"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_attention_is_one_kernel_matching_the_reference(
    dtype: str, splits: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GQA ratios 1, 3, 4, valid lengths 1, 255, 257, L-1, L; one kernel per head, or KV split (4, or as
    many as fill the SMs) then combined: captured, replaying."""
    import sys

    monkeypatch.setenv("DSP_TRITON_ATTENTION", "1")
    monkeypatch.setenv("DSP_TRITON_KV_SPLITS", splits)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "triton_interp"))
    import attention_graphs as ag

    for heads, kv, length, valid, dim in ag.CASES:
        feeds = ag.feeds(heads, kv, length, valid, dim, dtype)
        want = ag.model(heads, kv, length, dim, "slot_by_slot", dtype).run(feeds)
        model = ag.model(heads, kv, length, dim, "triton", dtype, strict=True)
        for i in range(8):  # eager, freeze, warm (compiled and checked), capture, replays
            _close(model.run(feeds), want, f"attention {heads}/{kv} L{length} valid {valid} {dtype} run {i}")
        assert model.dsp.phase is PlanPhase.REPLAYING
        groups = [r for r in _reports(model) if r["template"] == "decode_attention"]
        assert len(groups) == 1 and groups[0]["status"] == "triton", groups
        assert groups[0]["kernel"].startswith("dsp_attn_")
        if splits == "4":
            assert "dsp_attn_combine_" in groups[0]["kernel"], groups


def test_a_generator_bug_costs_the_group_its_kernel_never_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception other than Unsupported in the generator: a warning, the reference kernels, right outputs."""
    from dsp_triton import codegen

    monkeypatch.setenv("DSP_TRITON_DECODE_FUSION", "0")  # the norms as row kernels of their own: the ones broken here
    real = codegen.generate

    def broken(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        if spec.template == "row_reduction":
            raise KeyError("a generator bug")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(codegen, "generate", broken)
    model = _gpt2_warned("the generator failed")
    failed = [r for r in _reports(model) if "the generator failed" in r["reason"]]
    assert failed and all(r["status"] == "reference" for r in failed)


# -- the norm as the product's prologue; the KV store as the last store of a kernel ----------
def _norm_model(norm: str, m: int, k: int, widths: tuple[int, ...], dtype: str, mode: str) -> dsp.CompiledModel:
    """x [1, rows, k] -> a norm -> products of ``widths`` (one: + residual; two of one width: SiLU(a) x b;
    three: Q/K/V-like outputs). Siblings are merged by the core (docs/merge.md)."""
    rng = np.random.default_rng(m * 1000 + k + sum(widths))
    g = dsp.GraphBuilder()
    x = g.placeholder("x", dtype, [1, "rows", k])
    gamma = g.constant((1 + 0.1 * rng.standard_normal(k)).astype(dtype), name="gamma")
    if norm == "layer":
        beta = g.constant((0.1 * rng.standard_normal(k)).astype(dtype), name="beta")
        h = g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)
    elif norm == "rms":
        h = g.op("RMSNormalization", x, gamma, axis=-1, epsilon=1e-6)
    else:  # the eager export's chain
        mean = g.ReduceMean(
            g.Pow(x, g.constant(np.array(2.0, dtype))), g.constant(np.array([-1], np.int64)), keepdims=1
        )
        h = gamma * (x * g.Reciprocal(g.Sqrt(mean + g.constant(np.array(1e-6, dtype)))))
    ws = [
        g.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype), name=f"w{j}") for j, n in enumerate(widths)
    ]
    ys = [h @ w for w in ws]
    if len(ys) == 1:
        r = g.placeholder("r", dtype, [1, "rows", widths[0]])
        g.output(ys[0] + r, "y")
    elif len(ys) == 2:
        g.output(g.Sigmoid(ys[0]) * ys[0] * ys[1], "y")
    else:
        for j, y in enumerate(ys):
            g.output(y, f"y{j}")
    return dsp.compile(g.build(), mode=mode, strict=mode != "slot_by_slot")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("norm", ["chain", "layer", "rms"])
@pytest.mark.parametrize(
    "m, k, widths",
    [
        (1, 333, (70,)),
        (3, 1000, (130,)),
        (16, 200, (72, 72)),
        (1, 517, (96, 33, 33)),
        (7, 64, (40, 40)),
        (33, 200, (72,)),
    ],
)
def test_norm_prologue_products_match_the_reference(
    m: int, k: int, widths: tuple[int, ...], norm: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 1..16: one kernel (each program computes its rows' statistics over K, then the product and its
    epilogue); 33 rows: the norm as one row kernel, cuBLAS, the epilogue kernel. Odd K and N throughout."""
    monkeypatch.setenv("DSP_TRITON_DECODE_FUSION", "1")
    rng = np.random.default_rng(11)
    feeds = {"x": (3 * rng.standard_normal((1, m, k)) + 0.5).astype(dtype)}
    if len(widths) == 1:
        feeds["r"] = rng.standard_normal((1, m, widths[0])).astype(dtype)
    want = _norm_model(norm, m, k, widths, dtype, "slot_by_slot").run(feeds)
    model = _norm_model(norm, m, k, widths, dtype, "triton")
    for i in range(6):
        _close(model.run(feeds), want, f"{norm} norm + products {m}x{k}x{widths} {dtype} run {i}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    plan = model.plan()
    assert plan is not None
    norms = {"ReduceMean", "LayerNormalization", "RMSNormalization"}
    groups = [r for r in _reports(model) if any(plan.slots[s].op in norms for s in r["slots"])]
    assert len(groups) == 1 and groups[0]["template"] == "product" and groups[0]["status"] == "triton", groups
    if m > 16:
        assert "+" in groups[0]["kernel"] or "cuBLAS" in groups[0]["reason"], groups  # the norm's kernel, then cuBLAS
    else:
        assert groups[0]["kernel"].startswith("dsp_mm_") and not groups[0]["reason"], groups


@pytest.mark.parametrize("name", DECODERS)
def test_decode_kernels_hold_the_kv_stores_and_norms_and_give_torchs_tokens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode plan on TRITON: each KV store is written by the kernel that computes its row (K's rotary,
    GPT-2's K/V split), each norm by the product it feeds; captured blocks, torch's greedy tokens."""
    monkeypatch.setenv("DSP_TRITON_DECODE_FUSION", "1")
    g = np.load(FIXTURES / f"{name}.golden.npz")
    pipe = GenerationPipeline(FIXTURES / f"{name}.onnx", max_length=64, mode="triton")
    result = pipe.generate(g["prompt"], 24)
    assert result.tokens[0].tolist() == g["greedy_tokens"][:24].tolist(), f"{name}: tokens differ from torch's"
    model = pipe.decoder(1).model
    plan = model.plan()
    assert plan is not None
    reports = _reports(model)
    assert not [r for r in reports if r["status"] == "demoted"], reports
    stores = [r for r in reports if any(plan.slots[s].op == "KVScatter" for s in r["slots"]) and len(r["slots"]) > 1]
    assert stores and all(r["status"] == "triton" for r in stores), stores
    norms = {"ReduceMean", "LayerNormalization", "RMSNormalization"}
    prologues = [
        r for r in reports if r["template"] == "product" and any(plan.slots[s].op in norms for s in r["slots"])
    ]
    assert prologues and all(r["status"] == "triton" for r in prologues), prologues


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", [(1, 50257), (2, 128256), (2, 3, 5000)])
def test_the_greedy_pick_gives_numpys_argmax_in_two_kernels_while_replaying(shape: tuple[int, ...], dtype: str) -> None:
    from .greedy_check import greedy_pick_reports

    reports = greedy_pick_reports("triton", shape, dtype)
    picks = [r for r in reports if r["template"] == "greedy_pick"]
    assert len(picks) == 1 and picks[0]["status"] == "triton", reports


# -- programmatic dependent launch (sm_90+) ----------------------------------------------------
def test_a_chain_of_dependent_launches_keeps_the_graphs_order_while_replaying() -> None:
    """48 products in a chain (each reads the one before; weights preloaded before each waits), a
    norm and pointwise kernels between them: with DSP_TRITON_PDL on (the default) every kernel is
    a programmatic dependent, and the replayed graph still gives the reference's values."""
    import cupy as cp
    from dsp_triton import kernels

    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    assert kernels.dependent_launch(cp), "DSP_TRITON_PDL is on by default and this GPU supports it"
    from .chain_graph import product_chain

    rng = np.random.default_rng(5)
    graph = product_chain(rng)
    want = dsp.compile(graph, mode="slot_by_slot")
    model = dsp.compile(graph, mode="triton", strict=True)
    for run in range(10):
        feeds = {"x": rng.standard_normal((1, 1, 768)).astype(np.float16)}
        _close(model.run(feeds), want.run(feeds), f"chain run {run}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    products = [r for r in _reports(model) if r["template"] == "product"]
    assert len(products) == 48 and all(r["status"] == "triton" for r in products), products
    assert all("gdc_wait" in b.kernel.source for b in _compiled_of(model)), (
        "every kernel of the segment waits for the one before it"
    )


def _compiled_of(model: dsp.CompiledModel) -> list[Any]:
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    out = []
    for unit in runtime.units:
        for group in getattr(unit.compiled, "groups", []):
            for compiled in group.compiled.values():
                out += compiled.parts or [compiled]
    return out


def test_a_group_tritons_templates_decline_is_nvrtcs_kernel_when_dsp_nvrtc_is_there() -> None:
    """AUTO's chain per group: a softmax over rows longer than Triton's row template holds (16,384)
    is dsp-nvrtc's CUDA C row kernel (rows looped over) inside the same TRITON segment, checked,
    captured and replayed; the report names both steps of the chain."""
    from dsp_triton import codegen, kernels

    if kernels.nvrtc_backend() is None:
        pytest.skip("dsp-nvrtc is not installed or not available here")
    width = codegen.MAX_ROW + 7
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2, width])
    g.output(g.Softmax(x * g.constant(np.array(0.5, np.float32)), axis=-1), "p")
    graph = g.build()
    want = dsp.compile(graph, mode="slot_by_slot")
    model = dsp.compile(graph, mode="triton", strict=True)
    rng = np.random.default_rng(2)
    for run in range(8):
        feeds = {"x": rng.standard_normal((2, width)).astype(np.float32)}
        _close(model.run(feeds), want.run(feeds), f"long softmax run {run}")
    assert model.dsp.phase is PlanPhase.REPLAYING
    rows = [r for r in _reports(model) if r["template"] == "row_reduction"]
    assert len(rows) == 1 and rows[0]["status"] == "nvrtc", _reports(model)
    assert rows[0]["kernel"].startswith("dsp_row_") and "Triton's templates decline it" in rows[0]["reason"]
