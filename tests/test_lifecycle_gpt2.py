"""The lifecycle on a real decoder: GPT-2 prefill and decode as two live plans in EMULATED_REPLAY.

Feeds come from the committed goldens (step0 = a 7-token prefill with an empty past,
step1 = a decode step); every output is compared bit for bit with SLOT_BY_SLOT on the
same feeds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.units import UnitKind

MODEL = FIXTURES / "gpt2_eager.onnx"


@pytest.fixture(scope="module")
def golden() -> Any:
    return np.load(FIXTURES / "gpt2_eager.golden.npz")


@pytest.fixture(autouse=True)
def _freeze_after_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FREEZE_AFTER", "2")


def step_feeds(golden: Any, model: dsp.CompiledModel, step: int) -> dict[str, np.ndarray]:
    return {n: golden[f"step{step}.{n}"] for n in model.input_names}


def fresh(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same values in new array objects (new addresses)."""
    return {n: a.copy() for n, a in feeds.items()}


def check(model: dsp.CompiledModel, reference: dsp.CompiledModel, feeds: dict[str, np.ndarray]) -> None:
    got, want = model.run(feeds), reference.run(feeds)
    assert got.keys() == want.keys()
    for name in got:
        assert np.array_equal(got[name], want[name]), name


def runtimes(model: dsp.CompiledModel) -> dict[tuple[int, ...], Any]:
    """Each live plan's runtime, keyed by its input_ids shape."""
    out = {}
    for signature in model.cache.signatures():
        live = model.cache.acquire(signature)
        assert live is not None
        try:
            feeds = dict(zip(signature.feed_names, signature.feeds))
            out[feeds["input_ids"][0]] = live.runtime
        finally:
            model.cache.release(live)
    return out


def recaptures(runtime: Any) -> int:
    return sum(u.counters.recaptures for u in runtime.units)


def replays(runtime: Any) -> int:
    return sum(u.counters.replays for u in runtime.units)


def test_prefill_and_decode_alternating_replay_bit_equal(golden) -> None:
    model, ref = dsp.compile(MODEL, "emulated_replay"), dsp.compile(MODEL, "slot_by_slot")
    prefill, decode = step_feeds(golden, model, 0), step_feeds(golden, model, 1)
    assert prefill["input_ids"].shape == (1, 7) and decode["input_ids"].shape == (1, 1)
    for step in range(12):
        check(model, ref, fresh(prefill if step % 2 == 0 else decode))
    assert model.stats.plan_builds == 2
    plans = runtimes(model)
    assert set(plans) == {(1, 7), (1, 1)}
    for runtime in plans.values():
        assert runtime.phase is PlanPhase.REPLAYING
        islands = [u for u in runtime.units if u.kind is UnitKind.ISLAND]
        assert islands and all(u.phase is SegmentPhase.REPLAYING for u in islands)
    steady = {k: (recaptures(r), replays(r)) for k, r in plans.items()}
    for step in range(10):  # steady state: new feed objects every step, no recapture
        check(model, ref, fresh(prefill if step % 2 == 0 else decode))
    for key, runtime in plans.items():
        assert recaptures(runtime) == steady[key][0] == 0
        assert replays(runtime) == steady[key][1] + 5 * len([u for u in runtime.units if u.kind is UnitKind.ISLAND])
        assert runtime.flags == []
    assert model.stats.plan_builds == 2


def test_forced_address_drift_recaptures_once(golden) -> None:
    model, ref = dsp.compile(MODEL, "emulated_replay"), dsp.compile(MODEL, "slot_by_slot")
    past = [n for n in model.input_names if n.startswith("past_key_values.")]
    assert len(past) == 4
    model.dsp.mark_variable(past)
    decode = step_feeds(golden, model, 1)
    for _ in range(6):
        check(model, ref, decode)
    runtime = model.dsp.runtime
    assert runtime.phase is PlanPhase.REPLAYING and recaptures(runtime) == 0
    assert {e["name"] for e in model.dsp.external_inputs if e["class"] == "variable"} == set(past)
    moved = dict(decode, **{n: decode[n].copy() for n in past})  # the KV cache at new addresses, once
    check(model, ref, moved)
    assert recaptures(runtime) == 1
    drifted = [u for u in runtime.units if u.counters.recaptures]
    assert len(drifted) == 1 and drifted[0].phase is SegmentPhase.REPLAYING
    assert drifted[0].machine.history[-4].demotion  # NEEDS_WARMUP, then forward to REPLAYING again
    for _ in range(3):
        check(model, ref, moved)  # the new arrays stay put: no further recapture
    assert recaptures(runtime) == 1 and runtime.flags == []
    assert model.stats.plan_builds == 1
