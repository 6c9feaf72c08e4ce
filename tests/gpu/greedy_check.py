"""The greedy-pick GPU check both kernel generators pass (dsp-triton's and dsp-nvrtc's tests call it)."""

from __future__ import annotations

from typing import Any

import numpy as np

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase


def greedy_pick_reports(mode: str, shape: tuple[int, ...], dtype: str) -> list[dict[str, Any]]:
    """ArgMax over the last axis in ``mode``: numpy's index at every run (ties, a NaN), replaying; the reports."""
    g = dsp.GraphBuilder()
    x = g.placeholder("x", dtype, list(shape))
    g.output(g.ArgMax(x, axis=-1, keepdims=0), "token")
    model = dsp.compile(g.build(), mode=mode, strict=True)
    rng = np.random.default_rng(3)
    for run in range(8):  # eager (compile and check), freeze, warm-up, capture, replays
        logits = rng.standard_normal(shape).astype(dtype)
        logits[..., -1] = logits.max()  # a tie with an earlier maximum: the first index wins
        if run == 7:
            logits[..., shape[-1] // 3] = np.nan  # numpy's argmax takes the first NaN
        np.testing.assert_array_equal(model.run({"x": logits})["token"], np.argmax(logits, axis=-1))
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime.phase is PlanPhase.REPLAYING
    return [r for u in runtime.units if hasattr(u.compiled, "fusion_report") for r in u.compiled.fusion_report()]
