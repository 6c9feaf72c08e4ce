"""Node cases that ran eagerly on CUDA_GRAPHS for a missing device path, not a limit of capture:
each is now captured whole, with the reference's outputs.

- Einsum: CuPy's einsum calls cuBLAS itself, which a capture refuses; it now runs as sums,
  transposes and batched products through DSP's own cuBLAS binding.
- MaxPool's Indices: CuPy's unravel_index checked its bounds on the host.
- ConvInteger, QLinearConv: their zero points were read with ``float()`` (a device-to-host copy).
- Det: CuPy's det calls cuSOLVER and cuBLAS; it now runs as Gaussian elimination in array ops.
- TreeEnsemble: its forest was copied to the device every call and its walk asked the device
  after each step whether it was done; the forest is now made once, its depth found on the host.

Run on the GPU image: ``python -m pytest -q tests/gpu/test_device_paths_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    "test_einsum_inner_prod",
    "test_einsum_batch_matmul",
    "test_einsum_sum",
    "test_einsum_transpose",
    "test_maxpool_with_argmax_2d_precomputed_pads",
    "test_maxpool_with_argmax_2d_precomputed_strides",
    "test_convinteger_without_padding",
    "test_convinteger_with_padding",
    "test_qlinearconv",
    "test_det_2d",
    "test_det_nd",
    "test_ai_onnx_ml_tree_ensemble_single_tree",
    "test_ai_onnx_ml_tree_ensemble_set_membership",
]


@pytest.fixture(autouse=True)
def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    monkeypatch.delenv("DSP_CAPTURE_FAULT", raising=False)


def test_these_node_cases_are_captured_whole_and_correct() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from node_suite import load_cases, run_mode

    cases = [c for c in load_cases() if c.name in CASES]
    assert sorted(c.name for c in cases) == sorted(CASES)
    report = run_mode(cases, "cuda_graphs", runs=5)
    got = {name: (r["status"], r["reason"]) for name, r in report["cases"].items()}
    assert all(status == "captured" for status, _ in got.values()), got
