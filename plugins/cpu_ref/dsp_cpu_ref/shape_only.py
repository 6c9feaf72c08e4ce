"""SHAPE_INFERENCE_ONLY: dtypes and shapes flow through the plan; values are not computed.

An *abstract* value is a read-only, zero-strided numpy view (``broadcast_to`` of one zero)
with the right dtype and shape: it costs no memory and every kernel accepts it. A slot
whose inputs are abstract uses its op's shape rule; an op without a rule runs its kernel
on the abstract inputs (the output's shape is right for every op whose output shape does
not depend on input values). Values that shapes depend on (Shape, Size, small integer
arithmetic on them, constants) stay concrete and are computed for real, so Reshape,
Expand, Slice and friends get their true shapes.

The caller's feeds are made abstract as the segment starts (only their dtype and shape
are read), except small integer vectors and scalars (at most ``SHAPE_LIKE_MAX``
elements), which may be shapes, axes or counts that other shapes depend on.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from dsp_core.backends.base import Backend, CompiledSegment
from dsp_core.errors import DSPError, ShapeError
from dsp_core.ir import dtypes
from dsp_core.ops.registry import TensorInfo, Trait, lookup
from dsp_core.plan.plan import ExternalClass, Plan, Segment
from dsp_cpu_ref.slot_by_slot import bind_steps, run_order

Dims = tuple[int, ...]

# Integer feeds up to this many elements (rank 0 or 1) stay concrete: they may be shapes.
SHAPE_LIKE_MAX = 64


def abstract(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A zero-cost stand-in for a tensor of ``dtype`` and ``shape``."""
    return np.broadcast_to(np.zeros((), dtype=dtype), shape)


def is_abstract(x: Any) -> bool:
    """True for a stand-in made by ``abstract`` (or any zero-strided broadcast view)."""
    return isinstance(x, np.ndarray) and x.size > 1 and not x.flags.writeable and all(s == 0 for s in x.strides)


class ShapeOnlySegment(CompiledSegment):
    """Propagates shapes slot by slot."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, segment)
        self._plan = plan
        self._steps = bind_steps(plan, segment)
        self._opdefs = [lookup(plan.slots[s].op, plan.slots[s].domain) for s in run_order(segment)]
        fed = {
            plan.flat(plan.external_ref(k))
            for k, e in enumerate(plan.externals)
            if e.cls in (ExternalClass.PLACEHOLDER, ExternalClass.VARIABLE)
        }
        self._feeds = sorted(fed.intersection(i for _, ins, _, _ in self._steps for i in ins))

    def run(self, values: list[Any]) -> None:
        """Propagate shapes through the segment's slots."""
        for flat in self._feeds:  # the feeds' values are never read: only their dtype and shape
            x = values[flat]
            if isinstance(x, np.ndarray) and not _shape_like(x):
                values[flat] = abstract(x.dtype, x.shape)
        for s, opdef, (kernel, ins, outs, releases) in zip(run_order(self.segment), self._opdefs, self._steps):
            args = [values[i] for i in ins]
            rule = opdef.shape_rule
            slot = self._plan.slots[s]
            try:
                infos = None
                if rule is not None and any(is_abstract(a) for a in args) and not opdef.has(Trait.SHAPE_ONLY_OUTPUT):
                    infos = rule(dict(slot.attrs), *[_info(a) for a in args])  # None: "cannot tell"
                if infos is not None and all(_is_concrete(i) for i in infos):
                    result: Any = [abstract(dtypes.to_numpy(i.dtype or "float32"), cast(Dims, i.shape)) for i in infos]
                    result = result[0] if opdef.single_output else tuple(result)
                else:
                    result = kernel(*args)
                    if any(is_abstract(a) for a in args) and not opdef.has(Trait.SHAPE_ONLY_OUTPUT):
                        result = _abstracted(result, opdef.single_output)
            except DSPError:
                raise
            except Exception as exc:
                raise ShapeError(
                    f'shape inference failed at {slot.op} node "{slot.name}": {type(exc).__name__}: {exc}'
                ) from exc
            if outs.__class__ is int:
                values[outs] = result
            else:
                for o, r in zip(outs, result):
                    values[o] = r
            for i in releases:
                values[i] = None


def _shape_like(x: np.ndarray) -> bool:
    """True for a feed that may hold a shape, axes or a count: a small integer scalar or vector."""
    return x.dtype.kind in "iu" and x.ndim <= 1 and x.size <= SHAPE_LIKE_MAX


def _info(x: Any) -> TensorInfo:
    if x is None:
        return None  # type: ignore[return-value]
    arr = np.asarray(x)
    return TensorInfo(dtypes.normalize(arr.dtype), tuple(arr.shape))


def _is_concrete(info: TensorInfo | None) -> bool:
    """True when a rule's answer has a dtype and only integer dims (else the kernel decides)."""
    return (
        info is not None
        and info.dtype is not None
        and info.shape is not None
        and all(isinstance(d, int) for d in info.shape)
    )


def _abstracted(result: Any, single: bool) -> Any:
    if single:
        arr = np.asarray(result)
        return abstract(arr.dtype, arr.shape)
    return tuple(None if r is None else abstract(np.asarray(r).dtype, np.asarray(r).shape) for r in result)
