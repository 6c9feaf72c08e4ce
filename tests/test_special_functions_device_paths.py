"""Device paths for ops that failed or were wrong on the GPU, checked here on the CPU.

- Mod (fmod=0) on floats: Python's %, computed from fmod with numpy's own algorithm, so
  it is bit-equal to np.remainder and needs no CuPy remainder (wrong at inf and -0).
- Freezing keeps every value a live slot reads: sealed slots run once at freeze, and a
  value whose last reader (in plan order) is sealed was released before the live reader
  (the local-window Attention expansions: Concat got None on CUDA).
- Host buffers keep 0-d shapes (Range's scalars: "Shape mismatch. Old shape: (), new (1,)").
- ScatterElements/ScatterND reduction=mul: CuPy has no multiply.at, so CUDA_GRAPHS declines it.
- ``node_suite.py --mode``: every case classed captured / partly captured / eager / wrong / failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.backends.base import DeclineReason, SlotView
from dsp_core.ops.elementwise import _float_remainder
from dsp_core.ops.registry import Trait
from dsp_core.runtime.lifecycle import PlanPhase

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from node_suite import load_cases, run_mode  # noqa: E402

EDGE_A = [0.0, -0.0, 0.0, -0.0, -3.0, 3.0, -1.0, 1.0, np.inf, -np.inf, 1.0, 1.0, np.nan, 1.0, -4.3, 7.2, 5.0]
EDGE_B = [-2.0, 2.0, 2.0, -2.0, np.inf, np.inf, -np.inf, -np.inf, 2.0, 2.0, 0.0, -0.0, 2.0, np.nan, 2.1, -3.4, 8.0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_mod_is_bit_equal_to_numpy_remainder(dtype: type) -> None:
    rng = np.random.default_rng(5)
    a = np.concatenate([EDGE_A, rng.standard_normal(5000) * 20]).astype(dtype)
    b = np.concatenate([EDGE_B, rng.standard_normal(5000) * 4]).astype(dtype)
    with np.errstate(all="ignore"):
        want = np.remainder(a, b)
    g = dsp.GraphBuilder("mod")
    x, y = g.placeholder("a", str(a.dtype), list(a.shape)), g.placeholder("b", str(b.dtype), list(b.shape))
    g.output(g.op("Mod", x, y, fmod=0), "z")
    got = dsp.compile(g.build(), mode="slot_by_slot").run({"a": a, "b": b})["z"]
    assert got.dtype == want.dtype
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all() and np.array_equal(np.signbit(got), np.signbit(want))


def test_float_remainder_helper_is_numpy_free_of_remainder() -> None:
    with np.errstate(all="ignore"):
        r = _float_remainder(np, np.array([3.0, -3.0, -0.0]), np.array([np.inf, np.inf, 5.0]))
    assert r[0] == 3.0 and r[1] == np.inf and r[2] == 0.0 and not np.signbit(r[2])


def test_a_value_read_by_a_live_slot_survives_the_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    """n = Shape(x) is sealed and last read (in plan order) by the sealed Mul; Reshape reads it every step."""
    monkeypatch.setenv("DSP_FREEZE_AFTER", "1")
    g = dsp.GraphBuilder("freeze_keep")
    x = g.placeholder("x", "float32", [2, 3])
    n = g.op("Shape", x)
    r = g.op("Reshape", g.op("Relu", x), n)
    g.output(r, "r")
    g.output(g.op("Mul", n, g.constant(np.array([2, 2], dtype=np.int64), name="two")), "m")
    graph = g.build()
    for mode in ("emulated_replay", "slot_by_slot"):
        model = dsp.compile(graph, mode=mode)
        for step in range(5):
            feed = {"x": np.random.default_rng(step).standard_normal((2, 3)).astype(np.float32)}
            out = model.run(feed)
            np.testing.assert_array_equal(out["r"], np.maximum(feed["x"], 0))
            np.testing.assert_array_equal(out["m"], [4, 6])
        assert model.dsp.phase is not PlanPhase.SLOT_BY_SLOT
        assert model.partition().faults == [], model.partition().faults


def test_host_buffers_keep_zero_dimensional_shapes() -> None:
    from dsp_cuda_graphs.segment import host_contiguous

    scalar = np.array(3.0, dtype=np.float32)
    assert host_contiguous(scalar).shape == () and host_contiguous(scalar) is scalar
    view = np.arange(12.0).reshape(3, 4)[:, ::2]
    out = host_contiguous(view)
    assert out.flags.c_contiguous and out.shape == (3, 2) and np.array_equal(out, view)


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
@pytest.mark.parametrize("reduction", ["mul", "add", "none"])
def test_cuda_graphs_declines_a_multiplying_scatter(op: str, reduction: str) -> None:
    from dsp_cuda_graphs.plugin import CudaGraphsBackend

    view = SlotView(0, op, "", Trait.NONE, {"reduction": reduction}, ("float32", "int64", "float32"), ("float32",))
    decline = CudaGraphsBackend().supports(view)
    if reduction == "mul":
        assert decline is not None and decline.reason is DeclineReason.UNSUPPORTED_ATTRIBUTE
        assert "multiply.at" in decline.detail
    else:
        assert decline is None


LOCAL_WINDOW = r"^test_attention_(local|bidirectional)_window.*_expanded$|^test_range_.*_expanded$|^test_mod_float"


def test_node_cases_that_failed_on_the_gpu_pass_under_capture_on_the_cpu() -> None:
    cases = [c for c in load_cases() if __import__("re").search(LOCAL_WINDOW, c.name)]
    assert len(cases) >= 12
    report = run_mode(cases, "emulated_replay", runs=5)
    bad = {n: r for n, r in report["cases"].items() if r["status"] in ("wrong", "failed")}
    assert bad == {}
    assert report["counts"]["correct"] == len(cases)
    # Range's expansion is a Loop: that slot is a gap (control flow), the rest replays
    for name, r in report["cases"].items():
        want = "partly_captured" if name.startswith("test_range") else "captured"
        assert r["status"] == want, (name, r)


def test_node_suite_mode_writes_a_json_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "node_suite.py"), "--mode", "emulated_replay"]
        + ["--pattern", "^test_(relu|unique_not_sorted_without_axis|if)$", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "emulated_replay" and report["runs"] == 5
    statuses = {n: r["status"] for n, r in report["cases"].items()}
    assert statuses["test_relu"] == "captured"
    assert statuses["test_unique_not_sorted_without_axis"] == "eager"
    assert "dynamic_output_size" in report["cases"]["test_unique_not_sorted_without_axis"]["reason"]
    assert report["counts"]["correct"] == 3 and report["counts"]["wrong"] == 0
    assert "correct 3 (captured" in done.stdout
