"""Checks the GPU tests share: outputs equal to the reference's within a tolerance, fused backends'
fusion reports, and a model's calls equal to the reference through every phase until it replays."""

from __future__ import annotations

from typing import Any

import numpy as np

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase


def outputs_close(got: dict[str, Any], want: dict[str, np.ndarray], tol: float, what: str) -> None:
    """Every output of ``want`` in ``got``: same shape and dtype, values within ``tol`` (relative, and
    absolute times the output's scale)."""
    for name, ref in want.items():
        out = np.asarray(got[name])
        assert out.shape == ref.shape and out.dtype == ref.dtype, (
            f"{what} {name}: {out.dtype}{out.shape} vs {ref.dtype}{ref.shape}"
        )
        scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale, err_msg=f"{what} {name}")


def fusion_reports(model: dsp.CompiledModel) -> list[dict[str, Any]]:
    """Every fusion group's report of the model's live plan (units that fuse)."""
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    return [r for u in runtime.units if hasattr(u.compiled, "fusion_report") for r in u.compiled.fusion_report()]


def replays_match(
    model: dsp.CompiledModel, ref: dsp.CompiledModel, feeds: list[dict[str, np.ndarray]], tol: float, calls: int = 10
) -> None:
    """``calls`` calls fed ``feeds`` in turn (eager with its compile and check, freeze, warm, capture,
    replays) each equal to ``ref``'s within ``tol`` (relative, and absolute times the output's scale);
    the plan replaying at the end."""
    wants = [ref.run(f) for f in feeds]
    for i in range(calls):
        got = model.run(feeds[i % len(feeds)])
        for name, want in wants[i % len(feeds)].items():
            scale = max(1.0, float(np.abs(want.astype(np.float32)).max()))
            np.testing.assert_allclose(
                got[name].astype(np.float32),
                want.astype(np.float32),
                rtol=tol,
                atol=tol * scale,
                err_msg=f"call {i} {name}",
            )
    assert model.dsp.phase is PlanPhase.REPLAYING
