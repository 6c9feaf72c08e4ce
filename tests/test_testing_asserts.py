"""dsp_core.testing: each plan assertion passes on a good model and fails, with the plan dump, on a bad one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.backends.base import CaptureOutOfMemory, CaptureProfile
from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
from dsp_core.runtime.units import UnitKind
from dsp_core.testing import (
    assert_fully_replaying,
    assert_no_address_drift,
    assert_no_capture_failures,
    assert_phase_reached,
    assert_pointers_stable,
    assert_segment_replay_mode,
    plan_dump,
)

RUNS_TO_SETTLE = 8


def _graph() -> dsp.Graph:
    """x[2, 8] -> MatMul -> Add -> Relu -> Mul -> Add -> y: five slots, one segment."""
    g = dsp.GraphBuilder("asserts")
    x = g.placeholder("x", "float32", [2, 8])
    w = g.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4), name="w")
    g.output(g.Relu(g.MatMul(x, w) + 0.5) * 2.0 + 1.0, "y")
    return g.build()


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}


def _settled(mode: str, variable: bool = False, feeds: dict[str, np.ndarray] | None = None) -> dsp.CompiledModel:
    model = dsp.compile(_graph(), mode=mode)
    if variable:
        model.dsp.mark_variable(["x"])
    feeds = feeds if feeds is not None else _feeds()
    for _ in range(RUNS_TO_SETTLE):
        model.run(feeds)
    return model


@pytest.fixture
def replaying() -> dsp.CompiledModel:
    model = _settled("emulated_replay")
    assert model.dsp.phase is PlanPhase.REPLAYING
    return model


@pytest.fixture
def blocked() -> dsp.CompiledModel:
    model = _settled("slot_by_slot")
    assert model.dsp.phase is PlanPhase.REPLAY_BLOCKED
    return model


@pytest.fixture
def one_island_failed(monkeypatch: pytest.MonkeyPatch) -> dsp.CompiledModel:
    """Emulated replay, islands of two slots, the island holding Relu runs out of memory for good."""
    from dsp_cpu_ref.emulated import EmulatedSegment
    from dsp_cpu_ref.plugin import EmulatedReplayBackend

    monkeypatch.setattr(EmulatedReplayBackend, "profile", CaptureProfile(max_island_nodes=2))
    monkeypatch.setenv("DSP_OOM_RETRIES", "0")
    prepare = EmulatedSegment._prepare

    def failing(self: EmulatedSegment, values: list) -> None:
        if any(self._plan.slots[s].op == "Relu" for s in self.segment.slots):
            raise CaptureOutOfMemory("capture refused on purpose: the island holds Relu")
        prepare(self, values)

    monkeypatch.setattr(EmulatedSegment, "_prepare", failing)
    model = _settled("emulated_replay")
    assert model.dsp.phase is PlanPhase.REPLAYING and len(model.dsp.segments) == 3
    return model


@pytest.fixture
def one_slot_gap(monkeypatch: pytest.MonkeyPatch) -> dsp.CompiledModel:
    """Emulated replay, Relu fails to capture: it becomes a gap between islands."""
    monkeypatch.setenv("DSP_CAPTURE_FAULT", "Relu")
    model = _settled("emulated_replay")
    assert model.dsp.phase is PlanPhase.REPLAYING and [s.kind for s in model.dsp.segments][:3] == [
        "island",
        "gap",
        "island",
    ]
    return model


class FreshCopies(Mapping):
    """Feeds that hand out a new copy of each array on every read: a variable whose address always moves."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self._feeds = feeds

    def __getitem__(self, name: str) -> np.ndarray:
        return self._feeds[name].copy()

    def __iter__(self) -> Iterator[str]:
        return iter(self._feeds)

    def __len__(self) -> int:
        return len(self._feeds)


def _fails_with_dump(check, *args) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args)
    message = str(info.value)
    assert "plan state:" in message and '"phase":' in message and '"segments":' in message, message
    return message


# -- assert_phase_reached -----------------------------------------------------------------------
def test_phase_reached_passes_forward(replaying, blocked) -> None:
    for phase in ("slot_by_slot", "SHAPES_FROZEN", PlanPhase.REPLAYING):
        assert_phase_reached(replaying, phase)
    for phase in (PlanPhase.SLOT_BY_SLOT, "shapes_frozen", "replay_blocked"):
        assert_phase_reached(blocked, phase)


def test_phase_reached_fails_with_dump(replaying, blocked) -> None:
    model = dsp.compile(_graph(), mode="emulated_replay")
    model.run(_feeds())
    assert "SLOT_BY_SLOT has not reached REPLAYING" in _fails_with_dump(assert_phase_reached, model, "replaying")
    assert "REPLAY_BLOCKED has not reached REPLAYING" in _fails_with_dump(assert_phase_reached, blocked, "REPLAYING")
    _fails_with_dump(assert_phase_reached, replaying, PlanPhase.REPLAY_BLOCKED)
    with pytest.raises(ValueError, match="unknown plan phase"):
        assert_phase_reached(replaying, "warm")


def test_no_plan_yet_is_an_assertion_error() -> None:
    model = dsp.compile(_graph(), mode="emulated_replay")
    with pytest.raises(AssertionError, match="no plan has run yet"):
        assert_phase_reached(model, "slot_by_slot")


# -- assert_fully_replaying ----------------------------------------------------------------------
def test_fully_replaying(replaying, blocked, one_island_failed) -> None:
    assert_fully_replaying(replaying)
    assert "plan phase is REPLAY_BLOCKED" in _fails_with_dump(assert_fully_replaying, blocked)
    message = _fails_with_dump(assert_fully_replaying, one_island_failed)
    assert "1 island(s) not replaying" in message and "capture refused on purpose" in message


# -- assert_pointers_stable ----------------------------------------------------------------------
def test_pointers_stable(replaying) -> None:
    assert_pointers_stable(replaying, _feeds(), runs=3)
    assert_pointers_stable(replaying, FreshCopies(_feeds()), runs=2)  # placeholders are staged: fine


def test_pointers_moving_fail_with_dump() -> None:
    feeds = _feeds()
    model = _settled("emulated_replay", variable=True, feeds=feeds)
    assert_pointers_stable(model, feeds, runs=2)  # the variable is the same array each run: stable
    message = _fails_with_dump(assert_pointers_stable, model, FreshCopies(feeds))
    assert "recaptures 0 -> 1" in message and "run 1 of 3" in message


# -- assert_no_capture_failures ------------------------------------------------------------------
def test_no_capture_failures(replaying, blocked, one_island_failed) -> None:
    assert_no_capture_failures(replaying)
    assert_no_capture_failures(blocked)  # eager units of a backend that does not capture are fine
    message = _fails_with_dump(assert_no_capture_failures, one_island_failed)
    assert "1 island(s) could not capture" in message and "FAILED" in message


def test_a_slot_that_failed_to_capture_is_a_capture_failure(one_slot_gap) -> None:
    assert_fully_replaying(one_slot_gap)  # its islands replay around the gap
    message = _fails_with_dump(assert_no_capture_failures, one_slot_gap)
    assert "1 slot(s) failed to capture" in message and "DSP_CAPTURE_FAULT" in message


# -- assert_no_address_drift ---------------------------------------------------------------------
def test_no_address_drift() -> None:
    model = _settled("emulated_replay", variable=True)
    assert_no_address_drift(model)
    model.run(FreshCopies(_feeds()))  # a new array for the variable: one recapture
    assert "recaptures=1" in _fails_with_dump(assert_no_address_drift, model)


# -- assert_segment_replay_mode ------------------------------------------------------------------
def test_segment_replay_mode(replaying, blocked, one_island_failed) -> None:
    assert_segment_replay_mode(replaying, 0, "island")
    assert_segment_replay_mode(replaying, 0, UnitKind.ISLAND)
    assert_segment_replay_mode(replaying, 0, SegmentPhase.REPLAYING)
    assert_segment_replay_mode(replaying, 0, "replaying")
    assert_segment_replay_mode(blocked, 0, "eager")
    assert_segment_replay_mode(one_island_failed, 1, "failed")
    assert_segment_replay_mode(one_island_failed, 2, "REPLAYING")
    assert "is 'island', expected 'gap'" in _fails_with_dump(assert_segment_replay_mode, replaying, 0, "gap")
    assert "is REPLAYING, expected FAILED" in _fails_with_dump(assert_segment_replay_mode, replaying, 0, "FAILED")
    assert "no unit 5" in _fails_with_dump(assert_segment_replay_mode, replaying, 5, "island")
    with pytest.raises(ValueError, match="neither a unit kind nor a segment phase"):
        assert_segment_replay_mode(replaying, 0, "sideways")


# -- the dump ------------------------------------------------------------------------------------
def test_dump_is_trimmed() -> None:
    model = _settled("emulated_replay", variable=True)
    moving = FreshCopies(_feeds())
    for _ in range(30):  # a recapture every step: a long transition history
        model.run(moving)
    dump = plan_dump(model)
    assert "earlier transitions" in dump and len(dump) <= 8200
