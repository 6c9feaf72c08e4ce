"""Convolutions on cuDNN inside CUDA_GRAPHS captures: equal to the reference, replaying, algorithms chosen once.

Run on the GPU image: ``python -m pytest -q tests/gpu/test_cudnn_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.runtime.lifecycle import PlanPhase

RUNS = 6
CASES = [
    ("3x3 pad 1 + bias", (2, 8, 16, 16), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    (
        "stride 2, dilation 2",
        (1, 4, 19, 19),
        (6, 4, 3, 3),
        {"strides": [2, 2], "dilations": [2, 2], "pads": [2, 2, 2, 2]},
    ),
    ("depthwise", (1, 8, 12, 12), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1]}),
    ("SAME_UPPER odd kernel", (1, 3, 15, 15), (4, 3, 5, 5), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("1-D", (2, 5, 33), (7, 5, 4), {"strides": [2], "pads": [1, 1]}),
    ("3-D", (1, 2, 6, 7, 8), (3, 2, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),
]


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")


def _model(x_shape, w_shape, attrs, dtype):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(7)
    g = dsp.GraphBuilder("conv")
    x = g.placeholder("x", dtype, list(x_shape))
    w = g.constant((rng.standard_normal(w_shape) * 0.2).astype(dtype))
    b = g.constant(rng.standard_normal(w_shape[0]).astype(dtype))
    g.output(g.op("Relu", g.op("Conv", x, w, b, **attrs)), "y")
    return g.build()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("name", "x_shape", "w_shape", "attrs"), CASES, ids=[c[0] for c in CASES])
def test_convolution_on_cudnn_matches_the_reference_and_replays(name, x_shape, w_shape, attrs, dtype) -> None:  # type: ignore[no-untyped-def]
    from dsp_cuda_graphs import device

    built = _model(x_shape, w_shape, attrs, dtype)
    ref = dsp.compile(built, mode="slot_by_slot")
    gpu = dsp.compile(built, mode="cuda_graphs")
    tol = 2e-3 if dtype == "float32" else 1e-2
    for i in range(RUNS):
        x = np.random.default_rng(i).standard_normal(x_shape).astype(dtype)
        got, want = np.asarray(gpu.run({"x": x})["y"]), ref.run({"x": x})["y"]
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = max(1.0, float(np.abs(want.astype(np.float32)).max()))
        np.testing.assert_allclose(
            got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol * scale, err_msg=f"{name} run {i}"
        )
    assert gpu.dsp.phase is PlanPhase.REPLAYING
    states = [st for st in device._states.values() if st.get("cudnn") is not None]
    assert states, [st.get("cudnn_error") for st in device._states.values()]
    layouts = [c for st in states for k, c in st["cudnn"].layouts.items() if k[1] == tuple(w_shape) and k[2] == dtype]
    assert layouts and all(not isinstance(c, Exception) and c.algo is not None for c in layouts), layouts
