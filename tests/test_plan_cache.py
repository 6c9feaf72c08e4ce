"""The shape-keyed in-memory plan cache: signatures, hits, LRU with pins, budgets, miss explanations."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp
from dsp_core.cache.memory import LivePlan, PlanCache, ShapeSignature
from dsp_core.errors import ConfigError


def _feeds(golden, step: int, model) -> dict[str, np.ndarray]:
    return {n: golden[f"step{step}.{n}"] for n in model.input_names}


@pytest.fixture(scope="module")
def gpt2():
    return dsp.compile(FIXTURES / "gpt2_eager.onnx"), np.load(FIXTURES / "gpt2_eager.golden.npz")


def test_same_shape_same_plan_new_shape_new_plan(mlp_graph) -> None:
    model = dsp.compile(mlp_graph)
    x2, x3 = np.ones((2, 8), np.float32), np.ones((3, 8), np.float32)
    names = tuple(model.output_names)
    entry = model._prepare(names)
    live_a = model.live_plan(names, entry, model._stage({"x": x2}))
    live_b = model.live_plan(names, entry, model._stage({"x": x2 * 5}))
    live_c = model.live_plan(names, entry, model._stage({"x": x3}))
    assert live_a is live_b and live_c is not live_a
    f32 = np.dtype("float32")
    assert live_a.signature.feeds == (((2, 8), f32),) and live_c.signature.feeds == (((3, 8), f32),)
    for live in (live_a, live_b, live_c):
        model.cache.release(live)
    assert model.stats.plan_builds == 2 and model.stats.memory_hits == 1


def test_prefill_decode_alternating_builds_exactly_two_plans() -> None:
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx")
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    prefill, decode = _feeds(golden, 0, model), _feeds(golden, 1, model)
    for step in range(100):
        feeds = prefill if step % 2 == 0 else decode
        out = model.run(feeds)
        want = golden["step0.logits" if step % 2 == 0 else "step1.logits"]
        np.testing.assert_allclose(out["logits"], want, rtol=1e-4, atol=1e-4)
    assert model.stats.plan_builds == 2
    assert model.stats.memory_hits == 98
    assert model.stats.evictions == 0
    assert len(model.cache) == 2


def test_miss_is_explained(gpt2, caplog) -> None:
    model, golden = gpt2
    model.cache.clear()
    model.run(_feeds(golden, 1, model))  # decode: input_ids (1, 1)
    why = model.explain_miss(_feeds(golden, 0, model))  # prefill: input_ids (1, 7)
    assert "placeholder input_ids: shape (1, 7) vs cached (1, 1)" in why
    assert "placeholder past_key_values.0.key: shape (1, 4, 0, 16) vs cached (1, 4, 7, 16)" in why
    assert model.explain_miss(_feeds(golden, 1, model)) == []


def test_explain_env_logs_every_miss(monkeypatch, caplog, mlp_graph) -> None:
    monkeypatch.setenv("DSP_EXPLAIN_CACHE_MISSES", "1")
    model = dsp.compile(mlp_graph)
    with caplog.at_level(logging.WARNING, logger="dsp.cache"):
        model.run({"x": np.ones((2, 8), np.float32)})
        model.run({"x": np.ones((5, 8), np.float32)})
    messages = [r.getMessage() for r in caplog.records if r.name == "dsp.cache"]
    assert messages[0].endswith("cache empty")
    assert "placeholder x: shape (5, 8) vs cached (2, 8)" in messages[1]


def test_invalid_env_value_is_a_config_error(monkeypatch, mlp_graph) -> None:
    monkeypatch.setenv("DSP_EXPLAIN_CACHE_MISSES", "maybe")
    with pytest.raises(ConfigError, match="DSP_EXPLAIN_CACHE_MISSES"):
        dsp.compile(mlp_graph)
    monkeypatch.delenv("DSP_EXPLAIN_CACHE_MISSES")
    monkeypatch.setenv("DSP_PLAN_CACHE_BUDGET", "2.5")
    with pytest.raises(ConfigError, match="plan_cache_budget"):
        dsp.compile(mlp_graph)


def test_cpu_default_capacity_is_four_and_lru_evicts(mlp_graph) -> None:
    model = dsp.compile(mlp_graph)
    assert model.cache.capacity == 4
    for batch in range(1, 7):
        model.run({"x": np.ones((batch, 8), np.float32)})
    assert len(model.cache) == 4 and model.stats.evictions == 2
    kept = [sig.feeds[0][0][0] for sig in model.cache.signatures()]
    assert kept == [3, 4, 5, 6]
    model.run({"x": np.ones((3, 8), np.float32)})  # a hit makes batch 3 most recent
    model.run({"x": np.ones((1, 8), np.float32)})  # a miss evicts the least recent: batch 4
    assert [sig.feeds[0][0][0] for sig in model.cache.signatures()] == [5, 6, 3, 1]


def _sig(n: int) -> ShapeSignature:
    return ShapeSignature(("y",), ("x",), (((n,), np.dtype("float32")),), "AUTO", "h")


def test_pinned_plans_are_never_evicted() -> None:
    cache = PlanCache(capacity=2, budget_bytes=1 << 40)
    pinned = cache.insert(LivePlan(_sig(1), None))  # stays pinned: never released
    for n in range(2, 6):
        cache.release(cache.insert(LivePlan(_sig(n), None)))
    assert _sig(1) in cache and len(cache) == 2
    cache.release(pinned)
    cache.release(cache.insert(LivePlan(_sig(9), None)))
    assert _sig(1) not in cache


def test_budget_bounds_bytes() -> None:
    cache = PlanCache(capacity=100, budget_bytes=1000)
    for n in range(5):
        cache.release(cache.insert(LivePlan(_sig(n), None, nbytes=400)))
    assert cache.nbytes <= 1000 and len(cache) == 2
    assert cache.stats.evictions == 3


def test_clear_keeps_pinned_plans() -> None:
    cache = PlanCache(capacity=4, budget_bytes=1 << 40)
    held = cache.insert(LivePlan(_sig(1), None))
    cache.release(cache.insert(LivePlan(_sig(2), None)))
    cache.clear()
    assert cache.signatures() == [_sig(1)]
    cache.release(held)


def test_hit_dispatch_does_not_rebuild(gpt2) -> None:
    model, golden = gpt2
    feeds = _feeds(golden, 2, model)
    model.run(feeds)
    builds = model.stats.plan_builds
    for _ in range(20):
        model.run(feeds)
    assert model.stats.plan_builds == builds
