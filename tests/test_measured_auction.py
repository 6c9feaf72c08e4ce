"""The measured auction: a timed trial at freeze gives a contested segment to the fastest backend.

Also: a plan split across openvino, onnxruntime and slot_by_slot gives the reference's outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

import dsp_core as dsp
from dsp_core.backends.auction import SIGN_P, THREADS_TRIAL_MAX_S, TIE, full_threads, on_threads, sign_test


@pytest.fixture
def cpu_runtimes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AUTO with both CPU runtimes in it (numpy_replay, the third CPU bidder, left out: its own
    trials are in test_numpy_replay.py), and a disk cache of this test's own."""
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "numpy_replay")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def _trials(model: dsp.CompiledModel) -> list[dict]:
    return [t for seg in model.explain()["segments"] for t in seg.get("trials", [])]


def _freeze(model: dsp.CompiledModel, x: np.ndarray, runs: int = 4) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for _ in range(runs):
        out = model.run({"x": x})
    return out


def test_the_trial_picks_the_fastest_and_explain_shows_the_timings(cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    out = _freeze(model, x)
    reference = dsp.compile(mlp_graph, mode="slot_by_slot").run({"x": x})
    np.testing.assert_allclose(out["y"], reference["y"], rtol=1e-5, atol=1e-5)
    (trial,) = _trials(model)
    times = {n: t for n, t in trial["times_us"].items() if "@" not in n}  # the backends at the full threads
    assert set(times) == {"openvino", "onnxruntime"}, times  # the reference is the fallback, not a bidder
    assert trial["source"] == "measured" and all(t > 0 for t in trial["times_us"].values())
    # a short winner was timed at fewer threads too, against itself ("winner@threads")
    counts = {n for n in trial["times_us"] if "@" in n}
    if full_threads() > 1 and times[trial["winner"]] < THREADS_TRIAL_MAX_S * 1e6:
        assert counts == {f"{trial['winner']}@{t}" for t in (full_threads(), *_halves(full_threads()))}, counts
    else:
        assert counts == set() and trial["threads"] == 0
    assert times[trial["winner"]] <= min(times.values()) * (1 + TIE) + 1e-9
    # the chain's order breaks ties: a backend earlier in the chain within the tie band lost only
    # to one that was the faster in enough rounds to pass the sign test (_pick)
    chain = model.explain()["chain"]
    rounds = trial["rounds_us"]
    for b in chain[: chain.index(trial["winner"])]:
        if b in times and times[b] <= min(times.values()) * (1 + TIE):
            pairs = list(zip(rounds[trial["winner"]], rounds[b]))
            assert pairs and sign_test(sum(w < o for w, o in pairs), len(pairs)) <= SIGN_P, (b, rounds)
    # the winner is what runs
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert {(u.backend.name, u.segment.threads) for u in runtime.units} == {(trial["winner"], trial["threads"])}
    assert model.explain()["segments"][0]["backend"] == trial["winner"]


def _halves(full: int) -> list[int]:
    counts, t = [], full // 2
    while t >= 1:
        counts.append(t)
        t //= 2
    return counts


def test_the_choice_is_cached_in_memory_and_on_disk(cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    x = np.ones((2, 8), np.float32)
    first = dsp.compile(mlp_graph)
    _freeze(first, x)
    (trial,) = _trials(first)
    part = first.partition()
    assert part is not None
    kept = dict(part.trials)
    first.last_live.runtime.demote("test: freeze again")  # type: ignore[union-attr]
    _freeze(first, x)
    assert part.trials == kept  # the same trial object: not timed again
    second = dsp.compile(mlp_graph)  # a new model, as in another process: the disk record
    _freeze(second, x)
    (again,) = _trials(second)
    assert again["source"] == "disk" and again["winner"] == trial["winner"]
    assert again["times_us"] == trial["times_us"]


def test_other_shapes_get_their_own_trial(cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph)
    _freeze(model, np.ones((1, 8), np.float32))
    _freeze(model, np.ones((8, 8), np.float32))
    feeds = {t["feeds"] for t in _trials(model)}
    assert feeds == {"1:float32[1, 8]", "1:float32[8, 8]"}


@pytest.mark.parametrize("env", [{"DSP_AUCTION_TRIALS": "0"}, {"DSP_STRICT": "1"}])
def test_without_trials_the_fixed_chain_decides(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = dsp.compile(mlp_graph, strict=bool(env.get("DSP_STRICT")))
    _freeze(model, np.ones((2, 8), np.float32))
    assert _trials(model) == []
    assert model.resolved_backends() == ["openvino"]  # first in the CPU chain


def _three_way_graph() -> dsp.Graph:
    """MatMul + light float32 ops (openvino), float64 work (onnxruntime: openvino declines float64),
    an ai.onnx.ml Binarizer (only the reference), then float32 again."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder("three_way")
    x = g.placeholder("x", "float32", ["batch", 16])
    h = g.Relu(g.MatMul(x, g.constant(rng.standard_normal((16, 16)).astype(np.float32), name="w1")))
    d = g.Cast(h, to=TensorProto.DOUBLE)
    d = g.Sqrt(g.Add(g.Mul(d, g.constant(np.full(16, 0.5), name="half")), g.constant(np.ones(16), name="one")))
    f = g.Cast(d, to=TensorProto.FLOAT)
    b = g.op("Binarizer", f, domain="ai.onnx.ml", threshold=1.2)
    y = g.MatMul(b, g.constant(rng.standard_normal((16, 4)).astype(np.float32), name="w2"))
    g.output(y, "y")
    return g.build()


def test_a_plan_split_across_openvino_onnxruntime_and_the_reference_gives_its_outputs(
    cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_AUCTION_TRIALS", "0")  # the chain alone: each backend keeps what it takes
    graph = _three_way_graph()
    model = dsp.compile(graph)
    assert set(model.resolved_backends()) == {"openvino", "onnxruntime", "slot_by_slot"}, model.explain()
    reference = dsp.compile(graph, mode="slot_by_slot")
    rng = np.random.default_rng(4)
    for _ in range(6):
        x = rng.standard_normal((3, 16)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime.phase.name == "REPLAYING"
    assert {u.backend.name for u in runtime.units} == {"openvino", "onnxruntime", "slot_by_slot"}


def test_dsp_plan_explain_shows_the_timings(tmp_path: Path) -> None:
    from conftest import run_cli, write_tiny_mlp

    path = write_tiny_mlp(tmp_path / "tiny.onnx")
    env = {"DSP_AUTO_EXCLUDE": "none", "DSP_CACHE_DIR": str(tmp_path / "cache")}
    done = run_cli("plan", "explain", str(path), "--runs", "4", "--dim", "n=2", env=env)
    assert done.returncode == 0, done.stderr
    trial = next(line for line in done.stdout.splitlines() if "trial (measured)" in line)
    assert "openvino" in trial and "onnxruntime" in trial and " us" in trial and "->" in trial
    without_runs = run_cli("plan", "explain", str(path), env=env)  # compiled only: no freeze, no trial
    assert "trial" not in without_runs.stdout


def test_a_winner_other_than_the_chains_choice_is_handed_over_without_a_second_compile(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial's compiled segment of the winner is the one handed over (the executor's segment,
    which runs eagerly and feeds the next segment's trial): a whole-model runtime's compile of a
    big segment takes seconds. The freeze then compiles its units (the live slots) once more."""
    from dsp_core.backends import auction

    monkeypatch.setenv("DSP_CPU_THREADS", "1")  # one thread: no trial at fewer threads, no compile for it
    model = dsp.compile(mlp_graph)
    x = np.ones((2, 8), np.float32)
    model.run({"x": x})
    current = model.explain()["segments"][0]["backend"]
    other = "onnxruntime" if current == "openvino" else "openvino"
    monkeypatch.setattr(
        auction,
        "_timed_turns",
        lambda steps, runs, index, settle=None: ({n: (1e-6 if n == other else 1.0) for n in steps}, {}),
    )
    winner_class = type(next(b for b in model.partition().backends.values() if b.name == current))  # type: ignore[union-attr]
    compiles: list[str] = []
    from dsp_core.backends.discovery import discover

    other_class = type(next(b for b in discover().backends if b.name == other))
    original = other_class.compile

    def counted(self: object, plan: object, segment: object) -> object:
        compiles.append(other)
        return original(self, plan, segment)

    monkeypatch.setattr(other_class, "compile", counted)
    out = _freeze(model, x)
    (trial,) = _trials(model)
    assert trial["winner"] == other and winner_class is not other_class
    assert compiles == [other, other], compiles  # the trial's (handed over), then the frozen unit's
    np.testing.assert_allclose(out["y"], dsp.compile(mlp_graph, mode="slot_by_slot").run({"x": x})["y"], rtol=1e-5)
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert {u.backend.name for u in runtime.units} == {other}


def test_a_segment_no_runtime_can_build_goes_to_the_reference(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both runtimes fail to build the model (as OpenVINO's frontend failed on a Split it misread):
    the trial has no time, the chain's backend fails when the trial's step runs it, and the freeze
    gives the unit to the reference instead of raising out of the auction."""
    from dsp_onnxruntime.segment import OnnxRuntimeSegment
    from dsp_openvino.segment import OpenVinoSegment

    def broken(self: object, model: bytes, key: object) -> None:
        raise RuntimeError("the runtime's frontend refused the model (test)")

    monkeypatch.setattr(OnnxRuntimeSegment, "_build", broken)
    monkeypatch.setattr(OpenVinoSegment, "_build", broken)
    model = dsp.compile(mlp_graph)
    model.dsp.freeze()  # the first run freezes (as a decode plan does): the trial runs before any eager run
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    out = _freeze(model, x)
    reference = dsp.compile(mlp_graph, mode="slot_by_slot").run({"x": x})
    np.testing.assert_allclose(out["y"], reference["y"], rtol=1e-6, atol=1e-6)
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert {u.backend.name for u in runtime.units} == {"slot_by_slot"}


def test_the_trial_judges_each_candidate_by_its_median_run_taken_in_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate with a lucky run (every core free) but slower steps as a rule loses to one that is
    steadily faster: its best run does not decide. Candidates take turns in bursts of ``runs`` + 1
    runs (the order rotating round by round), each burst's first run not counted; at least one round
    is taken, then rounds while the budget lasts."""
    from dsp_core.backends import auction

    clock = [0.0]
    monkeypatch.setattr(auction.time, "perf_counter", lambda: clock[0])
    lucky = iter([0.010, 0.001] + [0.010] * 100)  # the lucky run is the burst's second: it counts
    order: list[str] = []

    def step(name: str, cost: Any) -> Any:
        def run() -> None:
            order.append(name)
            clock[0] += cost() if callable(cost) else cost

        return run

    steps = {"lucky": step("lucky", lambda: next(lucky)), "steady": step("steady", 0.005)}
    times, rounds = auction._timed_turns(steps, 5, 0)
    assert times == pytest.approx({"lucky": 0.010, "steady": 0.005})
    assert rounds["lucky"] == pytest.approx([0.010] * 6) and rounds["steady"] == pytest.approx([0.005] * 6)
    assert order[:12] == ["lucky"] * 6 + ["steady"] * 6
    assert order[12:24] == ["steady"] * 6 + ["lucky"] * 6  # the next round's order rotated
    # rounds while the budget lasts: 0.09 s each, the sixth passes 0.5 s
    assert auction.TRIAL_BUDGET_S == 0.5 and len(order) == 6 * 2 * 6
    # steps that cost nothing: TRIAL_ROUNDS rounds, then the trial stops
    clock[0], order[:] = 0.0, []
    free = {"a": step("a", 0.0), "b": step("b", 0.0)}
    auction._timed_turns(free, 5, 0)
    assert len(order) == auction.TRIAL_ROUNDS * 2 * 6
    # long steps: TRIAL_MIN_ROUNDS rounds past the budget (0.3 s each: 4 rounds, 1.2 s)
    clock[0], order[:] = 0.0, []
    long = {"a": step("a", 0.02), "b": step("b", 0.03)}
    assert auction._timed_turns(long, 5, 0)[0] == pytest.approx({"a": 0.02, "b": 0.03})
    assert auction.TRIAL_MIN_ROUNDS == 4 and len(order) == 4 * 2 * 6
    # slow steps: rounds until TRIAL_MAX_S has passed (1.8 s each: two), then the trial stops
    clock[0], order[:] = 0.0, []
    slow = {"a": step("a", 0.1), "b": step("b", 0.2)}
    assert auction._timed_turns(slow, 5, 0)[0] == pytest.approx({"a": 0.1, "b": 0.2})
    assert auction.TRIAL_MAX_S == 3.0 and len(order) == 2 * 2 * 6


def test_a_tie_goes_to_the_chain_unless_the_faster_passes_a_sign_test_over_the_rounds() -> None:
    """Within TIE the chain's order decides, unless the fastest had the lower median in so many
    rounds that two equally fast candidates would give as many at most SIGN_P of the time. GPT-2
    124M's decode step, ONNX Runtime 3% under OpenVINO in every round of its trial, went to
    OpenVINO and ran 5% slower over a run; the Llama (eager) decode step at batch 8, two threads,
    ONNX Runtime's by 4% in 9 of 12 rounds, went to OpenVINO and ran 1.3x ONNX Runtime's call."""
    from dsp_core.backends.auction import _pick

    assert sign_test(4, 4) == pytest.approx(1 / 16) and sign_test(0, 3) == 1.0
    assert sign_test(9, 12) == pytest.approx(299 / 4096) and sign_test(8, 12) == pytest.approx(794 / 4096)
    order = ["openvino", "onnxruntime"]
    times = {"openvino": 0.0230, "onnxruntime": 0.0223}
    steady = {"openvino": [0.0231, 0.0229, 0.0230, 0.0232], "onnxruntime": [0.0224, 0.0222, 0.0223, 0.0221]}
    assert _pick(order, times, steady) == "onnxruntime"
    mixed = {"openvino": [0.0231, 0.0220, 0.0230, 0.0232], "onnxruntime": [0.0224, 0.0222, 0.0223, 0.0221]}
    assert _pick(order, times, mixed) == "openvino"  # 3 of 4: a tie, the chain decides
    equal = {"openvino": [0.0231, 0.0222, 0.0230, 0.0232], "onnxruntime": [0.0224, 0.0222, 0.0223, 0.0221]}
    assert _pick(order, times, equal) == "openvino"  # an equal round counts against the faster
    few = {name: rounds[:3] for name, rounds in steady.items()}
    assert _pick(order, times, few) == "openvino"  # 3 of 3: too few rounds to tell
    assert _pick(order, times, {}) == "openvino"  # a trial kept without its rounds
    # the Llama (eager) step's trial of 00:34 (us): ONNX Runtime the lower in 9 of 12 rounds
    ov = [131.3, 133.3, 127.6, 134.6, 127.9, 133.2, 123.7, 130.5, 132.8, 132.3, 134.6, 135.0]
    ort = [124.7, 134.4, 136.5, 127.6, 127.3, 124.9, 128.2, 125.9, 125.3, 124.6, 126.3, 124.4]
    llama = {"openvino": 132.53, "onnxruntime": 126.95}
    assert _pick(order, llama, {"openvino": ov, "onnxruntime": ort}) == "onnxruntime"
    ort[0] = 131.4  # 8 of 12: a tie
    assert _pick(order, llama, {"openvino": ov, "onnxruntime": ort}) == "openvino"
    apart = {"openvino": 0.030, "onnxruntime": 0.0223}  # outside TIE: the fastest, rounds or not
    assert _pick(order, apart, mixed) == "onnxruntime"
    assert _pick(order, {"openvino": 0.0223, "onnxruntime": 0.0230}, {}) == "openvino"


def test_the_trial_does_not_count_a_run_slowed_by_the_candidate_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime whose threads spin on after its call (ONNX Runtime's) slows the run that follows it
    on shared cores: the candidate timed next pays. Run-by-run turns charged that to the other
    candidate at every run; a burst's first run is dropped, so each is judged on its own steps."""
    from dsp_core.backends import auction

    clock = [0.0]
    monkeypatch.setattr(auction.time, "perf_counter", lambda: clock[0])
    last: list[str] = [""]

    def step(name: str, cost: float) -> Any:
        def run() -> None:
            after_other = last[0] not in ("", name)
            clock[0] += cost * (2.0 if after_other else 1.0)  # the other's spinning threads hold the cores
            last[0] = name

        return run

    times, _ = auction._timed_turns({"spinner": step("spinner", 0.010), "fast": step("fast", 0.008)}, 5, 0)
    assert times == pytest.approx({"spinner": 0.010, "fast": 0.008})


def test_the_trial_waits_for_a_candidates_spinning_threads_before_timing_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ONNX Runtime's pool threads at several threads keep a core for tens of milliseconds after a
    call: every run of the candidate timed next inside that window is slowed, not only the first.
    The trial sleeps the spinner's ``settle_s`` after its burst (the sleep not counted against the
    budget), so the other candidate is timed on cores of its own."""
    from dsp_core.backends import auction

    clock = [0.0]
    quiet_at = [0.0]
    monkeypatch.setattr(auction.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(auction.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def step(name: str, cost: float) -> Any:
        def run() -> None:
            slowed = name != "spinner" and clock[0] < quiet_at[0]
            clock[0] += cost * (2.0 if slowed else 1.0)
            if name == "spinner":
                quiet_at[0] = clock[0] + 0.1  # its threads spin 100 ms after each call

        return run

    def trial(settle: dict[str, float] | None) -> tuple[dict[str, float], list[float]]:
        clock[0], quiet_at[0] = 0.0, 0.0
        steps = {"spinner": step("spinner", 0.010), "other": step("other", 0.008)}
        times, rounds = auction._timed_turns(steps, 5, 0, settle)
        return times, rounds["other"]

    unsettled, unsettled_rounds = trial(None)
    # judged on the spinner's leftovers: each burst right after the spinner's is slowed throughout
    assert 0.016 in unsettled_rounds and unsettled["other"] > 0.008 * 1.4
    settled, settled_rounds = trial({"spinner": 0.12, "other": 0.0})
    assert settled == pytest.approx({"spinner": 0.010, "other": 0.008})
    assert settled_rounds == pytest.approx([0.008] * len(settled_rounds))
    # the sleeps do not eat the budget: as many rounds as a trial of unslowed steps takes (0.108 s each)
    assert len(settled_rounds) == 5 and len(unsettled_rounds) < 5


def test_an_onnxruntime_session_declares_its_settle_only_where_its_pool_spins(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session that is a whole step spins (ONNX Runtime's default); a session beside other
    segments does not (dsp_onnxruntime.segment.session_options); at one thread there is no pool."""
    from dsp_onnxruntime.segment import SPIN_SETTLE_S

    def settles(graph: dsp.Graph, x: np.ndarray, mode: str = "onnxruntime") -> set[float]:
        model = dsp.compile(graph, mode=mode)
        _freeze(model, x)
        units = model.last_live.runtime.units  # type: ignore[union-attr]
        return {u.compiled.settle_s for u in units if u.backend.name == "onnxruntime"}

    x = np.ones((2, 8), np.float32)
    monkeypatch.setenv("DSP_CPU_THREADS", "2")
    assert settles(mlp_graph, x) == {SPIN_SETTLE_S} and SPIN_SETTLE_S > 0
    monkeypatch.setenv("DSP_AUCTION_TRIALS", "0")
    assert settles(_three_way_graph(), np.ones((3, 16), np.float32), "auto") == {0.0}  # beside others
    monkeypatch.setenv("DSP_CPU_THREADS", "1")
    assert settles(mlp_graph, x) == {0.0}


def _runtime_threads(unit: Any) -> int:
    """The threads the unit's runtime was built with, read back from the runtime itself."""
    compiled = unit.compiled
    model = next(iter(compiled._models.values()))
    if unit.backend.name == "onnxruntime":
        return int(model.get_session_options().intra_op_num_threads)
    return int(model.model.get_property("INFERENCE_NUM_THREADS"))


@pytest.mark.parametrize("faster", ["@1", "@2"])
def test_a_short_winner_is_timed_at_fewer_threads_and_runs_on_the_faster_count(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    """At DSP_CPU_THREADS=2 the winner is timed against itself on one thread; the count that was the
    faster in every round is what the frozen unit's runtime is built with, and a second model (as in
    another process) takes it from the disk record without timing again."""
    from dsp_core.backends import auction

    monkeypatch.setenv("DSP_CPU_THREADS", "2")
    timed: list[list[str]] = []

    def turns(steps: dict[str, Any], runs: int, index: int, settle: Any = None) -> tuple[dict, dict]:
        timed.append(list(steps))
        for step in steps.values():
            step()  # each candidate really runs
        times = {n: 1e-5 if n.endswith(faster) or ("@" not in n and n == "onnxruntime") else 2e-5 for n in steps}
        return times, {n: [t] * 12 for n, t in times.items()}

    monkeypatch.setattr(auction, "_timed_turns", turns)
    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    model = dsp.compile(mlp_graph)
    out = _freeze(model, x)
    np.testing.assert_allclose(out["y"], dsp.compile(mlp_graph, mode="slot_by_slot").run({"x": x})["y"], rtol=1e-5)
    assert timed == [["openvino", "onnxruntime"], ["onnxruntime@2", "onnxruntime@1"]], timed
    (trial,) = _trials(model)
    want = 1 if faster == "@1" else 0
    assert trial["winner"] == "onnxruntime" and trial["threads"] == want, trial
    (unit,) = model.last_live.runtime.units  # type: ignore[union-attr]
    assert unit.segment.threads == want and _runtime_threads(unit) == (want or 2)
    second = dsp.compile(mlp_graph)
    np.testing.assert_allclose(_freeze(second, x)["y"], out["y"], rtol=1e-6)
    (again,) = _trials(second)
    assert again["source"] == "disk" and again["threads"] == want and len(timed) == 2
    (unit,) = second.last_live.runtime.units  # type: ignore[union-attr]
    assert _runtime_threads(unit) == (want or 2)


def test_a_lone_runtime_is_still_timed_at_fewer_threads(
    cpu_runtimes: None, mlp_graph: dsp.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OpenVINO left out, ONNX Runtime has no rival for the segment, but its thread count is
    still a choice: the trial times it at 2 threads and at 1 (real timings)."""
    monkeypatch.setenv("DSP_CPU_THREADS", "2")
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "openvino,numpy_replay")
    model = dsp.compile(mlp_graph)
    x = np.ones((3, 8), np.float32)
    _freeze(model, x)
    (trial,) = _trials(model)
    assert set(trial["times_us"]) == {"onnxruntime", "onnxruntime@2", "onnxruntime@1"}, trial
    (unit,) = model.last_live.runtime.units  # type: ignore[union-attr]
    assert unit.segment.threads == trial["threads"] and _runtime_threads(unit) == (trial["threads"] or 2)


def test_which_thread_counts_a_trial_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_core.backends import auction

    class Runtime:
        threads_variants = True

    class Other:
        threads_variants = False

    short = THREADS_TRIAL_MAX_S / 2
    for setting, counts in [("16", [8, 4, 2, 1]), ("12", [6, 3, 1]), ("2", [1]), ("1", [])]:
        monkeypatch.setenv("DSP_CPU_THREADS", setting)
        assert auction._fewer_threads(Runtime(), short) == counts, setting  # type: ignore[arg-type]
    monkeypatch.setenv("DSP_CPU_THREADS", "8")
    # a long step keeps its threads
    assert auction._fewer_threads(Runtime(), THREADS_TRIAL_MAX_S * 2) == []  # type: ignore[arg-type]
    assert auction._fewer_threads(Other(), short) == []  # type: ignore[arg-type]


def test_reports_name_a_variant_s_thread_count() -> None:
    """``dsp plan explain``'s trial line and the CPU race's ``ran_on`` name a thread count alike."""
    assert on_threads(0) == ""  # DSP_CPU_THREADS: no label
    assert on_threads(1) == " on 1 thread"
    assert on_threads(2) == " on 2 threads"
