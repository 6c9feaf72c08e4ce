"""A fusion group as a kernel generator reads it: its slots as nodes wired by flat value ids, and values.

Backend-neutral (no GPU, no compiler): a plugin that generates kernels for the core's fusion
groups (dsp-nvrtc's CUDA C) describes a group with ``node_specs`` and, once one step's shapes
are known, each value with a ``TensorSpec``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsp_core.plan.plan import Plan


@dataclass(frozen=True)
class TensorSpec:
    """A value of one step: shape, dtype (numpy name), element strides (inputs only)."""

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class NodeSpec:
    """One slot of a group."""

    op: str
    inputs: tuple[int | None, ...]  # flat value ids
    outputs: tuple[int | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 17
    domain: str = ""
    name: str = ""


def node_specs(plan: Plan, slots: Sequence[int]) -> list[NodeSpec]:
    """A group's slots as nodes, wired by flat value indexes."""
    return [
        NodeSpec(
            op=plan.slots[s].op,
            inputs=tuple(plan.flat(r) if r is not None else None for r in plan.slots[s].inputs),
            outputs=tuple(plan.flat(v) if v is not None else None for v in plan.slots[s].outputs),
            attrs=dict(plan.slots[s].attrs),
            opset=plan.slots[s].opset,
            domain=plan.slots[s].domain,
            name=plan.slots[s].name,
        )
        for s in slots
    ]


def row_major(shape: Sequence[int]) -> list[int]:
    """Element strides of a C-order array of ``shape``."""
    st, acc = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        st[k] = acc
        acc *= shape[k]
    return st
