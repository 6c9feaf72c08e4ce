"""The greedy pick as the kernel-generating backends (dsp-triton, dsp-nvrtc) recognise and lay it out.

A decode step's token choice, ``dsp::Sample`` at temperature 0, and ``ArgMax`` over the
last axis taking the first best index: its reference (CuPy's argmax) reduces a row in one
block, ~100 µs for a 128k vocabulary, where generated kernels spread the row over the
device. Which slots are one, which rows they reduce and the shape they return are the same
for every backend that generates the kernels, so they live here, beside the runtime layer
those backends share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PickLayout:
    """The rows a greedy pick reduces and the shape of what it returns."""

    sample: bool  # dsp::Sample: [B, V] or [B, S, V] (its last position) -> [B, 1]
    keepdims: bool = True  # ArgMax's keepdims
    axis: int = -1  # ArgMax's axis: the last one is picked by the kernels, another by the reference

    def takes(self, logits: Any) -> bool:
        """Whether the kernels pick this one (a device array, reduced over its last axis)."""
        if isinstance(logits, np.ndarray | np.generic) or not hasattr(logits, "data"):
            return False
        if self.sample:
            return logits.ndim in (2, 3)
        return logits.ndim > 0 and self.axis % logits.ndim == logits.ndim - 1

    def rows(self, logits: Any) -> Any:
        """The [rows, V] the kernels reduce: a view, or a copy where the leading dims do not fold."""
        if self.sample:
            return logits[:, -1] if logits.ndim == 3 else logits
        return logits.reshape(-1, logits.shape[-1])

    def shape(self, logits: Any) -> tuple[int, ...]:
        """The shape of the picked indices (int64)."""
        if self.sample:
            return (logits.shape[0], 1)
        return tuple(logits.shape[:-1]) + ((1,) if self.keepdims else ())


def greedy_pick(slot: Any) -> PickLayout | None:
    """How a slot is a greedy pick, or None: dsp::Sample at temperature 0, ArgMax over the last
    axis taking the first best index."""
    if slot.domain == "dsp" and slot.op == "Sample":
        return PickLayout(sample=True) if float(slot.attrs.get("temperature", 1.0)) <= 0.0 else None
    if slot.domain in ("", "ai.onnx") and slot.op == "ArgMax" and not int(slot.attrs.get("select_last_index", 0)):
        return PickLayout(
            sample=False, keepdims=bool(int(slot.attrs.get("keepdims", 1))), axis=int(slot.attrs.get("axis", 0))
        )
    return None
