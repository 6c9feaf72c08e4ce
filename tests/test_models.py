"""Small real models exported by torch: a CNN (Conv, BatchNorm, pools, residual add, Gemm)
and an MLP whose weights live in an external data file, against torch's goldens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp


@pytest.mark.parametrize("mode", ["auto", "slot_by_slot"])
def test_cnn_matches_torch(mode: str) -> None:
    golden = np.load(FIXTURES / "cnn.golden.npz")
    model = dsp.compile(FIXTURES / "cnn.onnx", mode=mode)
    ops = {n.op_type for n in model.graph.nodes}
    assert {"Conv", "Relu", "Add"} <= ops and ops & {"MaxPool", "GlobalAveragePool", "AveragePool"}
    out = model.run({model.input_names[0]: golden["input"]})
    np.testing.assert_allclose(out[model.output_names[0]], golden["logits"], rtol=1e-4, atol=1e-4)


def test_cnn_shape_inference_only() -> None:
    model = dsp.compile(FIXTURES / "cnn.onnx", mode="shape_inference_only")
    x = np.zeros((5, 3, 32, 32), np.float32)
    out = model.run({model.input_names[0]: x})[model.output_names[0]]
    assert out.shape == (5, 10) and out.dtype == np.float32


def test_external_data_mlp() -> None:
    path = FIXTURES / "external_data" / "mlp.onnx"
    assert (FIXTURES / "external_data" / "mlp.onnx.data").exists()
    golden = np.load(FIXTURES / "external_data" / "mlp.golden.npz")
    model = dsp.compile(path)
    out = model.run({model.input_names[0]: golden["x"]})
    np.testing.assert_allclose(out[model.output_names[0]], golden["y"], rtol=1e-5, atol=1e-5)
