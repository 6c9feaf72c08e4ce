"""The op table's reference kernels are written once against the Array API: run whole plans
with ``xp = cupy`` on the GPU and compare with the numpy reference on the same inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.plan.plan import Segment

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def run_on_cupy(model: dsp.CompiledModel, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the model's plan slot by slot with cupy arrays and cupy kernels."""
    import cupy as cp
    from dsp_cpu_ref.slot_by_slot import bind_steps, generate

    plan = model.plan()
    assert plan is not None
    steps = bind_steps(plan, Segment(0, "cupy", "SLOT_BY_SLOT", tuple(range(len(plan.slots)))), xp=cp)
    values: list[Any] = [None] * plan.n_flat
    for k, arr in plan.constants.items():
        values[plan.flat(plan.external_ref(k))] = cp.asarray(arr)
    for k, ext in enumerate(plan.externals):
        if ext.name in feeds:
            values[plan.flat(plan.external_ref(k))] = cp.asarray(feeds[ext.name])
    run = generate(steps, f"{plan.graph_name}#cupy")  # cpu_ref's straight-line runner, cupy kernels
    run(values)
    return {name: cp.asnumpy(values[plan.flat(r)]) for name, r in zip(plan.output_names, plan.outputs)}


@pytest.mark.parametrize("name", ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"])
def test_decoders_on_cupy_match_numpy(name: str) -> None:
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    for step in (0, 1):
        feeds = {n: golden[f"step{step}.{n}"] for n in model.input_names}
        want = model.run(feeds)
        got = run_on_cupy(model, feeds)
        for out in want:
            np.testing.assert_allclose(got[out], want[out], rtol=1e-4, atol=1e-4, err_msg=f"{name} {out}")


def test_cnn_on_cupy_matches_numpy() -> None:
    model = dsp.compile(FIXTURES / "cnn.onnx", mode="slot_by_slot")
    golden = np.load(FIXTURES / "cnn.golden.npz")
    feeds = {model.input_names[0]: golden["input"]}
    want = model.run(feeds)
    got = run_on_cupy(model, feeds)
    for out in want:
        np.testing.assert_allclose(got[out], want[out], rtol=1e-4, atol=1e-4)
