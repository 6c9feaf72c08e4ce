"""One plan over two CUDA devices: placement on the real topology, peer and host-staged copies, decode.

Skipped below two GPUs (the reason says how many were seen). On the CUDA_GRAPHS backend:
outputs equal to one device's (the same kernels on the same architecture), each segment's
buffers on its own device, every copy recorded, the decode plan replaying with its KV
buffers on the device of their layers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.devices import Reason, cuda_topology, use_topology
from dsp_core.ir.graph import Graph
from dsp_core.llm import GenerationPipeline
from dsp_core.runtime.lifecycle import PlanPhase
from dsp_core.testing import models

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001  (tests/gpu/conftest.py skips without CuPy or a device)
        return 0


pytestmark = pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 CUDA devices, this machine has {_gpus()}")


def mlp(width: int = 512, layers: int = 8) -> Graph:
    """``layers`` square layers of ``width`` (1 MiB of float32 weights each at 512)."""
    return models.mlp([width] * (layers + 1), bias=False)


def _run(model: Any, feeds: dict[str, Any], steps: int = 8) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(steps):
        out = model.run(feeds)
    return out


def test_the_cuda_topology_lists_the_devices() -> None:
    topo = cuda_topology()
    assert topo is not None and topo.kind == "cuda" and len(topo) >= 2
    for d in topo.devices:
        assert d.platform == "cuda" and d.capability and d.memory > 0


@pytest.mark.parametrize("peers", [True, False])
def test_pipeline_over_two_gpus_equals_one_gpu(peers: bool) -> None:
    graph = mlp()
    x = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    want = _run(dsp.compile(graph, mode="cuda_graphs"), {"x": x})["y"]
    topo = cuda_topology()
    assert topo is not None
    if not peers:  # copies staged through pinned host memory
        topo = dataclasses.replace(topo, devices=tuple(dataclasses.replace(d, peers=frozenset()) for d in topo.devices))
    with use_topology(topo):
        model = dsp.compile(graph, mode="cuda_graphs", placement="pipeline_parallel")
        got = _run(model, {"x": x})["y"]
    assert np.array_equal(got, want)
    assert model.dsp.phase is PlanPhase.REPLAYING
    placement = model.dsp.placement
    assert placement.devices_used == tuple(range(len(topo)))
    last = model.dsp.transfers()[-1]
    acts = [c for c in last.copies if c.reason is Reason.ACTIVATION]
    assert sum(c.nbytes for c in acts) == sum(4 * c.nbytes for c in placement.cuts)  # batch 4
    counters = model.dsp.runtime.counters()
    assert counters["recaptures"] == 0 and counters["replays"] > 0


def test_segment_buffers_live_on_their_device() -> None:
    graph = mlp()
    x = np.ones((2, 512), np.float32)
    with use_topology(cuda_topology()):  # type: ignore[arg-type]
        model = dsp.compile(graph, mode="cuda_graphs", placement="pipeline_parallel", outputs_on_device=True)
        y = _run(model, {"x": x})["y"]
    assert int(y.device.id) == 0  # the output came back to the caller's device
    for unit in model.dsp.runtime.units:
        device = model.dsp.placement[unit.segment.slots[0]]
        assert unit.compiled.device == device


def test_memory_fit_spills_under_a_cap(monkeypatch: Any) -> None:
    graph = mlp()  # 8 x 1 MiB of weights
    monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", "5M")
    x = np.ones((1, 512), np.float32)
    want = _run(dsp.compile(graph, mode="cuda_graphs"), {"x": x})["y"]
    with use_topology(cuda_topology()):  # type: ignore[arg-type]
        model = dsp.compile(graph, mode="cuda_graphs", placement="memory_fit")
        got = _run(model, {"x": x})["y"]
    assert np.array_equal(got, want)
    assert model.dsp.placement.devices_used == (0, 1) and max(model.dsp.placement.weights) <= 5 << 20


def test_generation_on_two_gpus_keeps_each_kv_buffer_on_its_device() -> None:
    path = str(FIXTURES / "gpt2_eager.onnx")
    prompt = np.array([[3, 14, 15, 92, 65]], np.int64)
    want = GenerationPipeline(path, max_length=48, mode="cuda_graphs").generate(prompt, max_new_tokens=24)
    with use_topology(cuda_topology()):  # type: ignore[arg-type]
        pipe = GenerationPipeline(
            path, max_length=48, mode="cuda_graphs", placement={"node_layer_norm_2": 1}, block_capture=False
        )
        got = pipe.generate(prompt, max_new_tokens=24)
    assert got.token_list() == want.token_list()
    decode = pipe.decoder(1)
    buffers = pipe._resident[1].buffers  # the batch-1 decode state the plans read
    homes = decode.model.dsp.placement
    plan = decode.model.plan()
    seen = set()
    for k, ext in enumerate(plan.externals):
        if ext.name in buffers:
            assert int(buffers[ext.name].device.id) == homes.externals[k], ext.name
            seen.add(homes.externals[k])
    assert seen == {0, 1}
    assert decode.model.dsp.phase is PlanPhase.REPLAYING
    copied = {c.name for s in decode.model.dsp.transfers() for c in s.copies if c.reason is Reason.KV_CACHE}
    assert not any(n.startswith("past_key_values") for n in copied)
