"""The replay contest: a short segment's close runner-up in the auction's trial is timed against the
winner again, on real steps, while the plan replays, and the faster runs (dsp_core.runtime.contest).

The duel's rules are tested on a fake clock (each call advances it by what that variant "costs"),
so a verdict does not depend on this machine's load; the runtimes' contests run ONNX Runtime and
OpenVINO for real, and their outputs are checked against the reference step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.backends import auction
from dsp_core.runtime import contest as contest_mod
from dsp_core.runtime.contest import DUEL_ROUNDS, Contest


class FakeClock:
    """A clock that only the variants' calls move: each advances it by its current cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _variant(clock: FakeClock, cost: dict[str, float], name: str, ran: list[str]) -> Callable[[], None]:
    def call() -> None:
        ran.append(name)
        clock.now += cost[name]

    return call


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(contest_mod, "_clock", fake)
    return fake


def _contest(clock: FakeClock, cost: dict[str, float], ran: list[str], released: list[str] | None = None) -> Contest:
    names = sorted(cost)
    calls = [_variant(clock, cost, n, ran) for n in names]
    keep = released if released is not None else []
    return Contest(names, calls, cost["a"], names[1:], keep.append)


def test_a_contest_moves_to_the_faster_variant_and_back_when_the_machine_changes(clock: FakeClock) -> None:
    cost = {"a": 100e-6, "b": 60e-6}
    ran: list[str] = []
    c = _contest(clock, cost, ran)
    first = c.left
    assert first == contest_mod.DUEL_GAP * c.duel_steps and c.burst >= contest_mod.BURST_MIN
    for _ in range(first - 1):  # between duels: the holder alone
        c()
    assert set(ran) == {"a"} and c.duels == 0
    ran.clear()
    for _ in range(c.duel_steps):  # a duel: real steps, half of them on each variant
        c()
    assert ran.count("a") == ran.count("b") == DUEL_ROUNDS * c.burst == c.duel_steps // 2
    assert c.duels == 1 and c.running == 1 and c.switches == 1, c.as_dict()
    assert c.as_dict()["running"] == "b" and c.as_dict()["last"]["times_us"] == {"a": 100.0, "b": 60.0}
    ran.clear()
    for _ in range(c.left - 1):
        c()
    assert set(ran) == {"b"}  # the faster runs the steps between duels
    cost["b"] = 150e-6  # the machine changed: b is now the slower
    while c.duels < 2:
        c()
    assert c.running == 0 and c.switches == 2


def test_a_tie_keeps_the_running_variant_and_duels_come_less_often(clock: FakeClock) -> None:
    cost = {"a": 100e-6, "b": 98e-6}  # within the auction's TIE, b the faster in every round
    ran: list[str] = []
    c = _contest(clock, cost, ran)
    gaps = []
    while c.duels < 3:
        before = c.duels
        c()
        if c.duels > before:
            gaps.append(c.left)
    assert c.running == 0 and c.switches == 0  # a tie keeps the running variant
    assert gaps[-1] == 2 * gaps[-2] == 4 * gaps[-3], gaps  # a duel that changes nothing doubles the gap
    cost["b"] = 80e-6  # clearly faster now: it runs, and the gap is back to the shortest
    while c.duels < 4:
        c()
    assert c.running == 1 and c.switches == 1 and c.left == contest_mod.DUEL_GAP * c.duel_steps


def test_three_variants_the_fastest_runs(clock: FakeClock) -> None:
    cost = {"a": 100e-6, "b": 80e-6, "c": 50e-6}
    ran: list[str] = []
    c = _contest(clock, cost, ran)
    while c.duels < 1:
        c()
    assert c.as_dict()["running"] == "c" and c.as_dict()["rivals"] == ["b", "c"]
    assert ran.count("b") == ran.count("c") == DUEL_ROUNDS * c.burst


def _rounds(wins: int) -> dict[str, list[float]]:
    """A duel's rounds where b (90 us) had the lower median than a (100 us) in ``wins`` of 10."""
    return {"a": [100e-6] * 10, "b": [90e-6] * wins + [101e-6] * (10 - wins)}


def test_a_duel_moves_the_segment_only_to_a_variant_clearly_faster() -> None:
    """More than 5% faster by median and the faster in 9 of 10 rounds: a tie, or 8 rounds of 10 (enough
    for the trial's sign test at 10%), keeps the running variant; 8 of 10 leaves a doubt."""
    clearly = contest_mod._clearly_faster
    times = {"a": 100e-6, "b": 90e-6}
    for wins, moves in ((8, False), (9, True), (10, True)):
        kept, doubt = clearly("a", times, _rounds(wins))
        assert kept == ("b" if moves else "a") and (doubt is None) == moves
    ties = {"a": [100e-6] * 10, "b": [97e-6] * 10}
    assert clearly("a", {"a": 100e-6, "b": 97e-6}, ties) == ("a", None)  # 3% in every round: a tie, no doubt
    assert auction._pick(["a", "b"], {"a": 100e-6, "b": 97e-6}, ties) == "b"  # the trial's rule would move
    three = {"a": [100e-6] * 10, "b": [80e-6] * 10, "c": [70e-6] * 10}
    assert clearly("a", {"a": 100e-6, "b": 80e-6, "c": 70e-6}, three) == ("c", None)


def test_a_doubt_pools_its_rounds_with_the_next_duel_s() -> None:
    """8 of 10 twice is 16 of 20, enough to move; 7 of 10 three times (21 of 30) is not; a tie, or another
    variant the fastest, does not count the doubt's rounds; only the last 30 rounds are pooled."""
    clearly = contest_mod._clearly_faster
    times = {"a": 100e-6, "b": 90e-6}
    kept, doubt = clearly("a", times, _rounds(8))
    assert kept == "a" and doubt == ("b", [True] * 8 + [False] * 2)
    assert clearly("a", times, _rounds(8), doubt) == ("b", None)
    doubt = None
    for _ in range(3):
        kept, doubt = clearly("a", times, _rounds(7), doubt)
        assert kept == "a"
    assert doubt is not None and (sum(doubt[1]), len(doubt[1])) == (21, 30)
    kept, later = clearly("a", times, _rounds(7), doubt)  # still 21 of the last 30
    assert kept == "a" and later is not None and len(later[1]) == contest_mod.DOUBT_ROUNDS
    assert clearly("a", {"a": 100e-6, "b": 98e-6}, _rounds(8), doubt) == ("a", None)  # a tie clears it
    three = {"a": [100e-6] * 10, "b": [90e-6] * 8 + [101e-6] * 2, "c": [85e-6] * 8 + [101e-6] * 2}
    kept, other = clearly("a", {"a": 100e-6, "b": 90e-6, "c": 85e-6}, three, ("b", [True] * 10))
    assert kept == "a" and other == ("c", [True] * 8 + [False] * 2)  # b's rounds do not count for c


def test_a_doubt_brings_the_next_duel_soon_and_a_second_moves(clock: FakeClock) -> None:
    """A variant faster by more than 5% in 8 rounds of 10 (the other two rounds noisy): the first duel
    keeps the running one and the gap does not grow; the second pools 16 of 20 rounds and moves."""
    cost = {"a": 100e-6, "b": 80e-6}
    ran: list[str] = []
    c = _contest(clock, cost, ran)
    slow = {"count": 0}
    b_call = c.calls[1]

    def b_noisy() -> None:  # b's steps in two rounds of each duel take 150 us
        slow["count"] += 1
        in_round = (slow["count"] - 1) // c.burst % DUEL_ROUNDS
        cost["b"] = 150e-6 if in_round in (0, 1) else 80e-6
        b_call()

    c.calls[1] = b_noisy
    while c.duels < 1:
        c()
    assert c.running == 0 and c.last["doubt"] == "b the faster in 8 of 10 rounds", c.last
    assert c.left == contest_mod.DUEL_GAP * c.duel_steps  # not doubled: asked again soon
    while c.duels < 2:
        c()
    assert c.running == 1 and c.switches == 1 and "doubt" not in c.last, c.last


def test_a_rival_that_raises_is_dropped_and_released_and_the_holder_runs_on(clock: FakeClock) -> None:
    ran: list[str] = []
    released: list[str] = []
    cost = {"a": 100e-6, "b": 10e-6, "c": 50e-6}
    calls = [_variant(clock, cost, "a", ran), _variant(clock, cost, "b", ran), _variant(clock, cost, "c", ran)]
    c = Contest(["a", "b", "c"], calls, 100e-6, ["b", "c"], released.append)
    while c.duels < 1:
        c()
    assert c.as_dict()["running"] == "b"

    def broken() -> None:
        raise RuntimeError("rival broke")

    c.calls[1] = c.call = broken  # the running rival breaks between duels
    ran.clear()
    c()  # never raises: the step the rival failed is run by the holder
    assert ran == ["a"] and released == ["b"] and "rival broke" in c.dropped[0]
    assert c.live and c.as_dict()["rivals"] == ["c"] and c.as_dict()["running"] == "a"
    c.calls[1] = broken  # and the other one in a duel: the contest ends, its rivals all released
    while c.live:
        c()
    assert released == ["b", "c"] and c.as_dict()["running"] == "a" and len(c.dropped) == 2
    ran.clear()
    for _ in range(1000):
        c()
    assert set(ran) == {"a"}
    c.release()
    assert released == ["b", "c"]  # once each


def test_the_holders_own_fault_is_raised(clock: FakeClock) -> None:
    def broken() -> None:
        raise RuntimeError("holder broke")

    c = Contest(["a", "b"], [broken, lambda: None], 100e-6, ["b"], lambda r: None)
    with pytest.raises(RuntimeError, match="holder broke"):
        c()


def test_a_trial_keeps_the_close_runners_up_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_CPU_THREADS", "2")
    short = auction.CONTEST_MAX_S / 10
    times = {  # the backends' turns, then the winner's thread counts' turns (a faster moment)
        "onnxruntime": short,
        "openvino": short * 1.2,
        "slot_by_slot": short * 1.3,
        "onnxruntime@2": short / 2,
        "onnxruntime@1": short * 0.6,
    }
    # the other backends and the fastest other thread count, each against the winner in its own turns;
    # the full count is "onnxruntime" and "onnxruntime@2": one variant, never its own rival
    assert auction._rivals(times, "onnxruntime", 0) == ("openvino", "slot_by_slot", "onnxruntime@1")
    assert auction._rivals(times, "onnxruntime", 1) == ("openvino", "slot_by_slot", "onnxruntime@2")
    assert auction.variant("onnxruntime@2") == ("onnxruntime", 0) and auction.variant("openvino") == ("openvino", 0)
    assert auction.variant("onnxruntime@1") == ("onnxruntime", 1)
    # compared across turns, openvino (1.4) would be far from the count chosen (0.5): it is not
    assert auction._rivals({**times, "openvino": short * 1.4}, "onnxruntime", 0)[1] == "openvino"
    far = {"onnxruntime": short, "openvino": short * (auction.CONTEST_RATIO + 0.1), "onnxruntime@2": short}
    far["onnxruntime@1"] = short * 1.4
    assert auction._rivals(far, "onnxruntime", 0) == ("onnxruntime@1",)  # openvino is not close
    long = {"onnxruntime": auction.CONTEST_MAX_S * 2, "openvino": auction.CONTEST_MAX_S * 2.1}
    assert auction._rivals(long, "onnxruntime", 0) == ()  # a long step: its trial's rounds are enough


# -- real runtimes ----------------------------------------------------------------------------------
@pytest.fixture
def contested(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AUTO with both CPU runtimes, two threads, any runner-up a rival and duels every few steps."""
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "numpy_replay")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DSP_CPU_THREADS", "2")
    monkeypatch.setattr(auction, "CONTEST_RATIO", 1e9)
    monkeypatch.setattr(contest_mod, "DUEL_GAP", 1)
    monkeypatch.setattr(contest_mod, "DUEL_ROUNDS", 2)
    monkeypatch.setattr(contest_mod, "BURST_MAX", 4)  # a duel of 16 steps, every 16 steps


def _contests(model: dsp.CompiledModel) -> list[dict[str, Any]]:
    return [c for seg in model.explain()["segments"] for c in seg.get("contests", [])]


def _trial(model: dsp.CompiledModel) -> dict[str, Any]:
    (trial,) = [t for seg in model.explain()["segments"] for t in seg.get("trials", [])]
    return trial


def _steps_checked(model: dsp.CompiledModel, graph: dsp.Graph, steps: int) -> None:
    """``steps`` bound steps on new inputs, each output checked against the reference's."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    reference = dsp.compile(graph, mode="slot_by_slot")
    with model.bind({"x": x}) as binding:
        assert binding.bound
        for i in range(steps):
            x = rng.standard_normal((3, 8)).astype(np.float32)
            binding.inputs["x"][...] = x
            got = binding.run()["y"]
            if i % 7 == 0 or i > steps - 40:
                np.testing.assert_allclose(got, reference.run({"x": x})["y"], rtol=1e-4, atol=1e-5)


def test_a_close_runner_up_contests_the_replays_and_every_step_stays_right(
    contested: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every duel hands the segment to the other variant: each switch is exercised on real runtimes
    monkeypatch.setattr(
        contest_mod,
        "_clearly_faster",
        lambda running, times, rounds, doubt: (next(n for n in times if n != running), None),
    )
    model = dsp.compile(mlp_graph)
    _steps_checked(model, mlp_graph, 600)
    trial = _trial(model)
    # CONTEST_RATIO lets any runner-up in: the other runtime, and the winner's other thread count
    assert len(trial["rivals"]) == 2, trial
    (c,) = _contests(model)
    holder = trial["winner"] + (f"@{trial['threads']}" if trial["threads"] else "")
    assert (c["holder"], c["rivals"]) == (holder, trial["rivals"])
    assert c["duels"] >= 2 and c["switches"] == c["duels"] and not c["dropped"], c
    # model.run (copies in and out) goes through the same contest
    x = np.full((3, 8), 0.5, np.float32)
    want = dsp.compile(mlp_graph, mode="slot_by_slot").run({"x": x})["y"]
    for _ in range(200):
        np.testing.assert_allclose(model.run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def test_the_rival_is_kept_on_disk_and_a_second_process_contests_without_timing(
    contested: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.ones((3, 8), np.float32)
    first = dsp.compile(mlp_graph)
    for _ in range(4):
        first.run({"x": x})
    rivals = _trial(first)["rivals"]
    assert rivals
    timed: list[Any] = []
    monkeypatch.setattr(auction, "_timed_turns", lambda *a, **k: timed.append(a) or ({}, {}))
    second = dsp.compile(mlp_graph)
    _steps_checked(second, mlp_graph, 300)
    again = _trial(second)
    assert again["source"] == "disk" and again["rivals"] == rivals and timed == []
    (c,) = _contests(second)
    assert c["rivals"] == rivals and c["duels"] >= 1


def test_a_rival_whose_outputs_differ_is_left_out(
    contested: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rival computing other values than the holder on the same inputs (beyond the contracts'
    tolerance) never runs a step: the plan keeps its winner alone and says why in the log."""
    from dsp_core.backends.whole import WholeSegment

    real = WholeSegment._rival_call

    def wrong(self: WholeSegment, values: list[Any], holder: Any) -> Callable[[], Any] | None:
        call = real(self, values, holder)
        if call is None:
            return None
        outputs = self._bound_outputs

        def off() -> None:
            call()
            for out in outputs:
                out += 1.0

        return off

    monkeypatch.setattr(WholeSegment, "_rival_call", wrong)
    model = dsp.compile(mlp_graph)
    with caplog.at_level("INFO", logger="dsp"):
        _steps_checked(model, mlp_graph, 200)
    assert _trial(model)["rivals"] and _contests(model) == []
    assert any("leaves out" in r.message and "differs: max abs error" in r.message for r in caplog.records), caplog.text


def test_without_the_option_there_is_no_contest(
    contested: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_REPLAY_CONTEST", "0")
    model = dsp.compile(mlp_graph)
    _steps_checked(model, mlp_graph, 100)
    assert _trial(model)["rivals"] and _contests(model) == []
    (unit,) = model.last_live.runtime.units  # type: ignore[union-attr]
    assert unit.contest is False


def test_a_trials_shape_key_does_not_depend_on_the_feeds_order() -> None:
    """The contest finds its trial by the staged arrays, the trial was keyed by the step's feeds."""
    a, b = np.zeros((2, 3), np.float32), np.zeros((4,), np.int64)
    assert auction.shape_key([(3, a), (1, b)]) == auction.shape_key([(1, b), (3, a)]) == "1:int64[4];3:float32[2, 3]"
