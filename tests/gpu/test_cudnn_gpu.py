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


POOLS = [
    ("ResNet's 3x3 stride 2 pad 1", (2, 8, 15, 15), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("2x2 stride 2", (1, 4, 8, 9), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("1-D", (2, 3, 17), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ("3-D", (1, 2, 5, 6, 7), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
    ("ceil_mode (reference)", (1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("name", "x_shape", "attrs"), POOLS, ids=[c[0] for c in POOLS])
def test_max_pool_on_cudnn_is_the_references_and_replays(name, x_shape, attrs, dtype) -> None:  # type: ignore[no-untyped-def]
    from dsp_cuda_graphs import device
    from dsp_cuda_graphs.cudnn import pool_geometry

    g = dsp.GraphBuilder("pool")
    x = g.placeholder("x", dtype, list(x_shape))
    g.output(g.op("MaxPool", x, **attrs), "y")
    built = g.build()
    ref = dsp.compile(built, mode="slot_by_slot")
    gpu = dsp.compile(built, mode="cuda_graphs")
    for i in range(RUNS):
        x_np = np.random.default_rng(i).standard_normal(x_shape).astype(dtype)
        x_np.flat[i * 7] = np.nan  # NaN propagates as numpy's max does
        got, want = np.asarray(gpu.run({"x": x_np})["y"]), ref.run({"x": x_np})["y"]
        np.testing.assert_array_equal(got, want, err_msg=f"{name} run {i}")  # a max is exact
    assert gpu.dsp.phase is PlanPhase.REPLAYING
    pools = [k[:2] for st in device._states.values() if st.get("cudnn") is not None for k in st["cudnn"].pools]
    try:
        pool_geometry(x_shape, dtype, **attrs)
        assert (tuple(x_shape), dtype) in pools, pools
    except Exception:  # noqa: BLE001 - what cuDNN pools differently stays on the reference kernel
        assert (tuple(x_shape), dtype) not in pools


@pytest.mark.parametrize("search", ["timed", "find", "heuristic"])
@pytest.mark.parametrize("bias", [True, False])
def test_every_search_chooses_an_algorithm_that_computes_the_convolution(search: str, bias: bool) -> None:
    import cupy as cp
    from dsp_cuda_graphs.cudnn import Cudnn, conv_geometry

    from dsp_core.ops.conv import conv
    from dsp_core.ops.registry import KernelContext

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16, 14, 14)).astype(np.float16)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float16)
    b = rng.standard_normal(32).astype(np.float16) if bias else None
    want = conv(KernelContext(np, 22, 3, 1, "c"), x.astype(np.float32), w.astype(np.float32),
                None if b is None else b.astype(np.float32), pads=[1, 1, 1, 1])  # fmt: skip
    stream = cp.cuda.Stream(non_blocking=True)
    dnn = Cudnn(stream, False, True, search)
    with stream:
        g = conv_geometry(x.shape, w.shape, "float16", pads=[1, 1, 1, 1])
        xd, wd = cp.asarray(x), cp.asarray(w)
        bd = None if b is None else cp.asarray(b)
        y = cp.empty(g.y_shape, cp.float16)
        layout = dnn.layout(("k", bias), g, "float16", cp, xd, wd, y, bd)
        y.fill(np.nan)
        layout.forward(dnn.handle, xd, wd, y, bd)
        stream.synchronize()
    assert layout.algo is not None and (search == "heuristic" or layout.timings_ms)
    np.testing.assert_allclose(cp.asnumpy(y).astype(np.float32), want, rtol=1e-2, atol=2e-2)


def test_convolutions_of_equal_shapes_and_other_attributes_each_keep_their_own_layout() -> None:
    """The device's layouts are shared by every Conv slot: pads and strides are part of the key."""
    rng = np.random.default_rng(5)
    g = dsp.GraphBuilder("twins")
    x = g.placeholder("x", "float16", [1, 8, 16, 16])
    w = g.constant((rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float16))
    a = g.op("Conv", x, w, pads=[1, 1, 1, 1])  # 16x16
    b = g.op("Conv", x, w, pads=[0, 0, 0, 0], dilations=[1, 1], strides=[1, 1])  # 14x14, same shapes in
    c = g.op("Conv", x, w, pads=[1, 1, 1, 1], strides=[2, 2])  # 8x8
    g.output(a, "a")
    g.output(b, "b")
    g.output(c, "c")
    built = g.build()
    ref = dsp.compile(built, mode="slot_by_slot")
    gpu = dsp.compile(built, mode="cuda_graphs")
    for i in range(RUNS):
        x_np = np.random.default_rng(i).standard_normal((1, 8, 16, 16)).astype(np.float16)
        got, want = gpu.run({"x": x_np}), ref.run({"x": x_np})
        for name in "abc":
            np.testing.assert_allclose(
                np.asarray(got[name]).astype(np.float32), want[name].astype(np.float32), rtol=1e-2, atol=2e-2
            )
    assert gpu.dsp.phase is PlanPhase.REPLAYING


def test_weights_fed_each_step_are_read_as_given() -> None:
    """Weights that are an input (not a constant) change each step: each replay reads the new ones."""
    g = dsp.GraphBuilder("fed")
    x = g.placeholder("x", "float16", [2, 4, 10, 10])
    w = g.placeholder("w", "float16", [6, 4, 3, 3])
    g.output(g.op("Conv", x, w, pads=[1, 1, 1, 1]), "y")
    built = g.build()
    ref = dsp.compile(built, mode="slot_by_slot")
    gpu = dsp.compile(built, mode="cuda_graphs")
    for i in range(RUNS):
        rng = np.random.default_rng(i)
        feeds = {
            "x": rng.standard_normal((2, 4, 10, 10)).astype(np.float16),
            "w": (rng.standard_normal((6, 4, 3, 3)) * 0.3).astype(np.float16),
        }
        np.testing.assert_allclose(
            np.asarray(gpu.run(feeds)["y"]).astype(np.float32),
            ref.run(feeds)["y"].astype(np.float32),
            rtol=1e-2,
            atol=2e-2,
            err_msg=f"run {i}",
        )
    assert gpu.dsp.phase is PlanPhase.REPLAYING
