"""Merged sibling products on a GPU: CUDA_GRAPHS and TRITON run the merged plan as the unmerged one.

dsp-cuda-graphs binds ``dsp::MergedMatMul`` to the same cuBLAS calls the separate
products made, so on CUDA_GRAPHS the merged plan's outputs are the unmerged plan's bits.
dsp-triton runs each part as one skinny-product kernel, as it ran the product; it may
group the slots around the merged product otherwise (they are renumbered, and a part
has no fused epilogue), and a fused kernel may contract a multiply-add, so there it is
compared within its contract's tolerance. The decode plan still captures once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.llm import GenerationPipeline
from dsp_core.plan.merge import merges_of
from dsp_core.runtime.lifecycle import PlanPhase

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODES = ["cuda_graphs", "triton"]
_last_reports: list[dict] = []  # the fusion reports of the last model _run ran (TRITON)


def _run(path: Path | dsp.Graph, mode: str, feeds: dict[str, np.ndarray], flag: str, mp: pytest.MonkeyPatch) -> dict:
    mp.setenv("DSP_MERGE_PRODUCTS", flag)
    model = dsp.compile(path, mode=mode, strict=True)
    assert len(merges_of(model.plan())) > 0 if flag == "1" else not merges_of(model.plan())
    out = {}
    for _ in range(6):  # eager, freeze, warm, capture, replays
        out = model.run(feeds)
    assert model.dsp.phase is PlanPhase.REPLAYING
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    _last_reports[:] = [
        r for u in runtime.units if hasattr(u.compiled, "fusion_report") for r in u.compiled.fusion_report()
    ]
    return out


def _same(off: dict, on: dict, mode: str, what: str) -> None:
    """Bit-equal on CUDA_GRAPHS; within the contract's tolerance on TRITON (see the module doc)."""
    assert off.keys() == on.keys(), what
    for key in off:
        if mode == "cuda_graphs":
            assert np.array_equal(off[key], on[key]), f"{what} {key}"
        else:
            from dsp_triton.plugin import TritonBackend

            tol = TritonBackend().contract.tolerance
            scale = max(1.0, float(np.abs(off[key].astype(np.float32)).max()))
            np.testing.assert_allclose(on[key], off[key], rtol=tol, atol=tol * scale, err_msg=f"{what} {key}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["llama_eager", "llama_sdpa23"])
def test_merged_decoder_is_the_unmerged_bits(name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    path = FIXTURES / f"{name}.onnx"
    for step in (0, 1):
        feeds = {n: golden[f"step{step}.{n}"] for n in dsp.compile(path, mode="slot_by_slot").input_names}
        off = _run(path, mode, feeds, "0", monkeypatch)
        on = _run(path, mode, feeds, "1", monkeypatch)
        _same(off, on, mode, f"{name} step {step}")
        if mode == "triton":  # each merged product ran as one skinny-product kernel over its joined weights
            products = [r for r in _last_reports if r["template"] == "product"]
            assert len([r for r in products if r["status"] == "triton"]) >= 8, _last_reports
            assert not [r for r in _last_reports if r["status"] == "demoted"], _last_reports
        np.testing.assert_allclose(on["logits"], golden[f"step{step}.logits"], atol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_half_precision_siblings_are_the_unmerged_bits(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 weights go to cuBLAS as float16 (the reference kernel would widen them on every call)."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder("half")
    x = g.placeholder("x", "float16", [1, 256])
    for i, n in enumerate((256, 64, 64)):
        w = g.constant((rng.standard_normal((256, n)) * 0.05).astype(np.float16), name=f"w{i}")
        g.output(g.MatMul(x, w))
    graph = g.build()
    feeds = {"x": rng.standard_normal((1, 256)).astype(np.float16)}
    off = _run(graph, mode, feeds, "0", monkeypatch)
    on = _run(graph, mode, feeds, "1", monkeypatch)
    _same(off, on, mode, "float16 siblings")


@pytest.mark.parametrize("mode", MODES)
def test_generation_gives_torchs_tokens_with_merged_products(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_MERGE_PRODUCTS", "1")
    golden = np.load(FIXTURES / "llama_eager.golden.npz")
    pipe = GenerationPipeline(FIXTURES / "llama_eager.onnx", max_length=64, mode=mode)
    assert len(merges_of(pipe.decode_model.plan())) == 4
    result = pipe.generate(golden["prompt"], max_new_tokens=32)
    assert result.token_list() == golden["greedy_tokens"].tolist()
    counters = pipe.decode_model.dsp.runtime.counters()
    assert counters["recaptures"] == 0
