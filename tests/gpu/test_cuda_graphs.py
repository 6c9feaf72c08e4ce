"""CUDA_GRAPHS on a GPU: decoders match the reference, steady steps replay, drift is met."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.runtime.units import UnitKind

from .fused_checks import outputs_close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def _backend() -> Any:
    from dsp_cuda_graphs.plugin import CudaGraphsBackend

    return CudaGraphsBackend()


def _close(got: dict[str, Any], want: dict[str, np.ndarray], what: str) -> None:
    outputs_close(got, want, _backend().contract.tolerance, what)


def _units(model: dsp.CompiledModel) -> list[Any]:
    return model.last_live.runtime.units  # type: ignore[union-attr]


def test_available_here() -> None:
    backend = _backend()
    assert backend.availability().ok, backend.availability().reason


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_steps_match_reference_and_replay(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="cuda_graphs", strict=True)
    assert model.resolved_backends() == ["cuda_graphs"]
    for step in (0, 1):
        feeds = {n: golden[f"step{step}.{n}"] for n in model.input_names}
        want = ref.run(feeds)
        for i in range(8):  # eager, freeze, warm, capture, replays
            _close(model.run(feeds), want, f"{name} step {step} run {i}")
        runtime = model.last_live.runtime  # type: ignore[union-attr]
        islands = [u for u in runtime.units if u.kind is UnitKind.ISLAND]
        reasons = [u.reason for u in islands if u.reason]
        assert model.dsp.phase is PlanPhase.REPLAYING, f"{name} step {step}: {model.dsp.phase}; {reasons}"
        before = runtime.counters()
        for _ in range(5):
            _close(model.run(feeds), want, f"{name} step {step} steady")
        after = runtime.counters()
        assert after["recaptures"] == before["recaptures"], f"{name}: recaptured in steady state"
        assert after["replays"] > before["replays"]


def test_forced_address_drift_stays_correct() -> None:
    import cupy as cp

    name = "gpt2_eager"
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="cuda_graphs", strict=True)
    var = "past_key_values.0.key"
    model.dsp.mark_variable([var])
    feeds = {n: golden[f"step1.{n}"] for n in model.input_names}
    want = ref.run(feeds)
    for _ in range(8):
        _close(model.run(feeds), want, "settle")
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert model.dsp.phase is PlanPhase.REPLAYING
    # a host variable fed as a new array: refreshed in place (copied each replay)
    moved = dict(feeds)
    moved[var] = feeds[var].copy()
    c0 = runtime.counters()
    _close(model.run(moved), want, "host variable moved")
    c1 = runtime.counters()
    assert c1["refreshes"] + c1["recaptures"] > c0["refreshes"] + c0["recaptures"]
    # a device variable: read in place; a new device array means a recapture, still correct
    on_device = dict(feeds)
    on_device[var] = cp.asarray(feeds[var])
    _close(model.run(on_device), want, "device variable")
    on_device[var] = cp.asarray(feeds[var])  # a new address
    c2 = runtime.counters()
    _close(model.run(on_device), want, "device variable moved")
    c3 = runtime.counters()
    assert c3["recaptures"] + c3["refreshes"] > c2["recaptures"] + c2["refreshes"]
    # values changed in place, same address: no event, new result
    on_device[var][...] = (
        cp.asarray(golden[f"step2.{var}"][..., : feeds[var].shape[2], :]) if f"step2.{var}" in golden else 0
    )
    feeds2 = dict(feeds)
    feeds2[var] = cp.asnumpy(on_device[var])
    _close(model.run(on_device), ref.run(feeds2), "device variable updated in place")


def test_outputs_on_device() -> None:
    import cupy as cp

    name = "gpt2_eager"
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="cuda_graphs", outputs_on_device=True)
    feeds = {n: golden[f"step1.{n}"] for n in model.input_names}
    for _ in range(6):
        out = model.run(feeds)
    assert all(isinstance(v, cp.ndarray) for v in out.values())


@pytest.mark.parametrize("fed", ["host", "device"])
def test_a_replaying_plan_takes_the_steady_path_with_its_device_staged_feeds(fed: str) -> None:
    """Once replaying, each call copies the feeds into their device buffers and launches the graph
    (PlanRuntime._steady_step): every call's new feeds are read, outputs stay the caller's own."""
    import cupy as cp

    name = "llama_eager"
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="cuda_graphs", strict=True, outputs_on_device=True)
    steps = [{n: golden[f"step{s}.{n}"] for n in model.input_names} for s in (1, 1, 1)]
    rng = np.random.default_rng(3)
    for s in steps[1:]:  # same shapes, other values: the steady path must read each call's feeds
        for n, v in s.items():
            if v.dtype.kind == "f":
                s[n] = (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.1).astype(v.dtype)
    wants = [ref.run(s) for s in steps]

    def feed(s: dict[str, np.ndarray]) -> dict[str, Any]:
        return s if fed == "host" else {n: cp.asarray(v) for n, v in s.items()}

    for _ in range(8):
        model.run(feed(steps[0]))
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime._steady is not None, f"no steady path: {model.dsp.phase}"
    assert model._repeat is not None  # the repeat path (feed checks skipped) takes CuPy feeds too
    kept = []
    for i in range(6):
        out = model.run(feed(steps[i % 3]))
        _close({k: cp.asnumpy(v) for k, v in out.items()}, wants[i % 3], f"steady call {i}")
        kept.append(out)
    assert runtime._steady is not None
    for i, out in enumerate(kept):  # later calls did not write into what earlier calls returned
        _close({k: cp.asnumpy(v) for k, v in out.items()}, wants[i % 3], f"kept output {i}")


@pytest.mark.parametrize("mode", ["cuda_graphs", "triton"])
def test_a_binding_replays_on_its_device_buffers_without_copies(mode: str) -> None:
    """``model.bind``: the inputs are the plan's device staging buffers; each ``run`` launches the
    graph on what was written there and returns the replay buffers (no copy in, none out)."""
    import cupy as cp

    name = "llama_eager"
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    ref = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode=mode, strict=True, outputs_on_device=True)
    base = {n: golden[f"step1.{n}"] for n in model.input_names}
    binding = model.bind({n: cp.asarray(v) for n, v in base.items()})
    assert binding.bound, f"not bound: {model.dsp.phase}"
    assert all(isinstance(v, cp.ndarray) for v in binding.inputs.values())
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    copies = runtime.staging.copies
    rng = np.random.default_rng(5)
    first = None
    for i in range(4):
        step = {
            n: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.1).astype(v.dtype) if v.dtype.kind == "f" else v
            for n, v in base.items()
        }
        for n, v in step.items():
            binding.inputs[n][...] = cp.asarray(v)
        out = binding.run()
        assert all(isinstance(v, cp.ndarray) for v in out.values())
        if first is None:
            first = out
        assert all(out[k] is first[k] for k in out)  # the replay buffers themselves
        _close({k: cp.asnumpy(v) for k, v in out.items()}, ref.run(step), f"{mode} bound step {i}")
    assert runtime.staging.copies == copies and runtime._steady is not None
