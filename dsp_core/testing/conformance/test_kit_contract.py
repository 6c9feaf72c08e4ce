"""The truth of the backend's declarations: its records, determinism and dtypes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from onnx import TensorProto

from dsp_core.backends.auction import slot_view
from dsp_core.backends.base import Backend, CaptureProfile, DeclineReason, ModeContract
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ir import dtypes
from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph
from dsp_core.testing import plan_dump
from dsp_core.testing.conformance.cases import CASES, Case
from dsp_core.testing.conformance.helpers import (
    assert_matches,
    compile_for,
    drive,
    reference,
    require_backend_ran,
    settle_steps,
)

DETERMINISM_RUNS = 5
# Dtypes DSP only stores and casts (no arithmetic op claims them): checked through a Cast to float32.
_STORAGE_FLOAT = dtypes.FLOAT8_DTYPES | {"float4_e2m1fn", "float8_e8m0fnu"}
_STORAGE_INT = dtypes.LOW_BIT_INT_DTYPES


def test_records_are_well_formed(dsp_backend: Backend) -> None:
    """Name, mode, platform, ModeContract, CaptureProfile and describe() hold what the core relies on."""
    b, c, p = dsp_backend, dsp_backend.contract, dsp_backend.profile
    problems = []
    if not (isinstance(b.name, str) and b.name):
        problems.append(f"name {b.name!r} is not a non-empty string")
    if not isinstance(b.mode, GraphExecutionMode) or b.mode is GraphExecutionMode.AUTO:
        problems.append(f"mode {b.mode!r} is not a concrete GraphExecutionMode")
    if not (isinstance(b.platform, str) and b.platform):
        problems.append(f"platform {b.platform!r} is not a non-empty string")
    if not isinstance(c, ModeContract):
        problems.append(f"contract is a {type(c).__name__}, not a ModeContract")
    else:
        flags = ("deterministic", "needs_stable_addresses", "can_update_in_place", "tf32", "computes_values")
        problems += [f"contract.{f} is not a bool" for f in flags if not isinstance(getattr(c, f), bool)]
        unknown = sorted(set(c.dtypes) - set(dtypes.DTYPE_NAMES))
        if not c.dtypes or unknown:
            problems.append(f"contract.dtypes must be non-empty DSP dtype names (unknown: {unknown})")
        if not (isinstance(c.tolerance, int | float) and math.isfinite(c.tolerance) and 0 <= c.tolerance < 1):
            problems.append(f"contract.tolerance {c.tolerance!r} is not a relative error in [0, 1)")
    if not isinstance(p, CaptureProfile):
        problems.append(f"profile is a {type(p).__name__}, not a CaptureProfile")
    elif p.max_island_nodes is not None and p.max_island_nodes < 1:
        problems.append(f"profile.max_island_nodes {p.max_island_nodes} must be None or >= 1")
    if not isinstance(b.captures, bool):
        problems.append(f"captures {b.captures!r} is not a bool")
    try:
        json.dumps(b.describe())
    except (TypeError, ValueError) as exc:
        problems.append(f"describe() is not JSON-able: {exc}")
    assert not problems, f"backend {b.name}: " + "; ".join(problems)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_deterministic_means_bit_equal(dsp_backend: Backend, dsp_rng: np.random.Generator, case: Case) -> None:
    """A backend declared deterministic gives bit-equal outputs across runs on the same inputs."""
    if not dsp_backend.contract.deterministic:
        pytest.skip(f"{dsp_backend.name}'s contract says deterministic=False")
    graph = case.build()
    model = compile_for(dsp_backend, graph)
    require_backend_ran(dsp_backend, model, f"case {case.name}")
    feeds = case.feeds(dsp_rng)
    drive(dsp_backend, model, reference(graph), lambda _: feeds, settle_steps(), case.name)
    first = model.run(feeds)
    for run in range(2, DETERMINISM_RUNS + 1):
        again = model.run(feeds)
        differ = [n for n in first if not _bit_equal(first[n], again[n])]
        assert not differ, (
            f"case {case.name}: {dsp_backend.name} is declared deterministic, but outputs {differ} differ "
            f"between run 1 and run {run} on the same inputs\n{plan_dump(model)}"
        )


def _bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", dtypes.DTYPE_NAMES)
def test_declared_dtype_works(dsp_backend: Backend, dsp_rng: np.random.Generator, dtype: str) -> None:
    """Each declared dtype runs: never declined for its dtype, outputs equal to the reference."""
    if dtype not in dsp_backend.contract.dtypes:
        pytest.skip(f"{dsp_backend.name} does not declare {dtype}")
    graph = _dtype_graph(dtype)
    model = compile_for(dsp_backend, graph)
    _no_dtype_decline_contradicts(dsp_backend, model, dtype)
    require_backend_ran(dsp_backend, model, f"the {dtype} graph")
    ref = reference(graph)
    for run in range(3):
        feeds = _dtype_feeds(dtype, dsp_rng)
        assert_matches(dsp_backend, model.run(feeds), ref.run(feeds), f"the {dtype} graph, run {run + 1}", model)


def _dtype_graph(dtype: str) -> Graph:
    g = GraphBuilder(f"kit_dtype_{dtype}")
    x = g.placeholder("x", dtype, [3, 4])
    y = g.placeholder("y", dtype, [3, 4])
    if dtype == "bool":
        out = g.Or(g.And(x, y), g.Not(x))
    elif dtype in _STORAGE_FLOAT or dtype in _STORAGE_INT:
        out = g.Add(g.Cast(x, to=TensorProto.FLOAT), g.Cast(y, to=TensorProto.FLOAT))
    else:
        out = (x + y) * y
    g.output(out, "out")
    return g.build()


def _dtype_feeds(dtype: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    np_dtype = dtypes.to_numpy(dtype)
    return {name: np.asarray(_draw(dtype, rng)).astype(np_dtype) for name in ("x", "y")}


def _draw(dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Values every backend can hold exactly in ``dtype``."""
    shape = (3, 4)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in _STORAGE_INT:
        return rng.integers(0, 2, shape)  # 0 and 1 fit every low-bit int
    if dtype in _STORAGE_FLOAT:
        return rng.choice([1.0, 2.0], shape)  # exact in every float8 / float4 / e8m0
    if dtype in dtypes.INT_DTYPES:
        return rng.integers(0, 8, shape)
    return rng.standard_normal(shape)


def _no_dtype_decline_contradicts(backend: Backend, model, dtype: str) -> None:
    """A backend may not decline a slot for its dtype when the contract declares every dtype the slot uses."""
    part, plan = model.partition(), model.plan()
    if part is None or plan is None:
        pytest.fail(f"the {dtype} graph was declined by the plan compiler: {model.declined}")
    wrong = []
    for index, declines in part.declines.items():
        for name, decline in declines:
            if name != backend.name or decline.reason is not DeclineReason.UNSUPPORTED_DTYPE:
                continue
            view = slot_view(plan, index)
            used = {d for d in view.input_dtypes + view.output_dtypes if d is not None}
            if used <= backend.contract.dtypes:
                wrong.append(f"slot {index} {view.op} ({sorted(used)}): {decline}")
    assert not wrong, (
        f"{backend.name} declares {sorted(backend.contract.dtypes)} but declined slots for their dtype: "
        + "; ".join(wrong)
        + f"\n{plan_dump(model) if model.last_live is not None else ''}"
    )
