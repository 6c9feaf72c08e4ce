"""GPU tests: marked ``gpu``, skipped with the reason where CuPy or a CUDA device is missing."""

from __future__ import annotations

import pytest


def cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a CUDA device, else why not."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken CUDA install)
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA device ({exc})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_unavailable_reason()
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))
