"""Pipeline stages and replicas on a local Ray instance with CPU actors (dsp-core[ray]).

The stages are the placement's devices; each actor compiles its stage's model with the CPU
reference, so outputs are bit-equal to one process running the reference with the actors'
BLAS threads (one: an actor of one CPU). Skipped, with the reason, where Ray is
not installed (``pip install 'dsp-core[ray]'``; the test extra installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.devices import PlacementError, stub_topology
from dsp_core.errors import DSPError
from tests.test_devices import FIXTURES, fixture_feeds, mlp, topology

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'dsp-core[ray]'")

from dsp_core.devices.distributed import RayPipeline, RayReplicas, stages_of  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One local Ray instance for the module (8 logical CPUs: the actors mostly wait)."""
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_pipeline_stages_on_actors_equal_one_process(stages: int) -> None:
    graph = mlp([64, 128, 128, 96, 128, 128, 64, 128, 32])
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
    pipe = RayPipeline(graph, stages=stages)
    try:
        assert len(pipe.stages) == stages
        for _ in range(4):  # the stage plans freeze on their own
            got = pipe.run({"x": x})["y"]
        assert np.array_equal(got, want)
        assert [s.slots[0] for s in pipe.stages] == sorted(s.slots[0] for s in pipe.stages)
        for before, after in zip(pipe.stages, pipe.stages[1:]):  # what one stage writes, the next reads
            assert set(after.io.inputs) - set(pipe.feed_flats) <= set(before.io.outputs) | {
                f for s in pipe.stages[: after.index] for f in s.io.outputs
            }
    finally:
        pipe.shutdown()


def _one_thread_reference(path: str, feeds: dict[str, np.ndarray], tmp: Path) -> dict[str, np.ndarray]:
    """The reference's outputs in a process whose BLAS runs one thread, as a Ray actor of one CPU
    does (Ray sets OMP_NUM_THREADS to the actor's CPUs): OpenBLAS's sums are grouped by its thread
    count, so a convolution's last bits differ between one thread and two."""
    np.savez(tmp / "feeds.npz", **feeds)
    code = (
        "import sys, numpy as np, dsp_core as dsp; f = dict(np.load(sys.argv[2])); "
        "np.savez(sys.argv[3], **dsp.compile(sys.argv[1], mode='slot_by_slot').run(f))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    args = [sys.executable, "-c", code, path, str(tmp / "feeds.npz"), str(tmp / "want.npz")]
    subprocess.run(args, env=env, check=True, timeout=300)
    return dict(np.load(tmp / "want.npz"))


@pytest.mark.parametrize("name", ["cnn", "gpt2_eager", "llama_eager"])
def test_fixtures_through_three_stages(name: str, tmp_path: Path) -> None:
    path = str(FIXTURES / f"{name}.onnx")
    feeds = fixture_feeds(name)
    want = _one_thread_reference(path, feeds, tmp_path)
    pipe = RayPipeline(path, stages=3)
    try:
        got = pipe.run(feeds)
        assert set(got) == set(want)
        for k in want:
            assert np.array_equal(got[k], want[k]), k
    finally:
        pipe.shutdown()


def test_stages_follow_a_given_placement_and_refuse_non_contiguous_ones() -> None:
    graph = mlp([16, 16, 16, 16])
    names = [n.name for n in graph.nodes]
    with stub_topology(topology(2, 2**30, True)):
        model = dsp.compile(graph, placement={names[3]: 1})
        stages = stages_of(model.plan(), model.dsp.placement)
        assert [st.slots[0] for st in stages] == [0, 3]
        interleaved = dsp.compile(graph, placement={names[1]: 1, names[2]: 0})
        with pytest.raises(PlacementError, match="not contiguous"):
            stages_of(interleaved.plan(), interleaved.dsp.placement)
    pipe = RayPipeline(graph, stages=2, placement={names[3]: 1})
    try:
        assert [st.slots[0] for st in pipe.stages] == [0, 3]
        with pytest.raises(DSPError, match="missing \\['x'\\]"):
            pipe.run({})
    finally:
        pipe.shutdown()


def test_replicas_spread_calls_and_agree() -> None:
    graph = mlp([32, 64, 32])
    model = dsp.compile(graph, mode="slot_by_slot")
    batch = [{"x": np.full((2, 32), i, np.float32)} for i in range(6)]
    want = [model.run(f)["y"] for f in batch]
    replicas = RayReplicas(graph, replicas=2)
    try:
        got = replicas.map(batch)
        assert all(np.array_equal(g["y"], w) for g, w in zip(got, want))
        assert np.array_equal(replicas.run(batch[0])["y"], want[0])
    finally:
        replicas.shutdown()


def test_a_placement_group_that_cannot_be_placed_says_so(monkeypatch: Any) -> None:
    import dsp_core.devices.distributed as distributed

    monkeypatch.setattr(distributed, "GROUP_TIMEOUT_S", 2.0)
    with pytest.raises(DSPError, match="could not place 2 stage"):
        RayPipeline(mlp([8, 8, 8]), stages=2, bundle={"CPU": 64})
