"""EMULATED_REPLAY: the full capture/replay lifecycle on the CPU, with numpy buffers.

It runs the reference kernels but behaves like a CUDA graph: ``prepare`` allocates one
fixed buffer per value the segment produces (shapes from the warm-up), ``capture``
records the slot sequence against the buffers and the input arrays present at capture
time (their addresses baked in), and ``replay`` runs that recording, writing results into
the fixed buffers. A replay never reads ``values`` for its inputs: if an input array was
replaced since the capture, the recording would read the old one, so the replay checks
and reports STALE_BUFFER instead. Address drift, recapture and staleness therefore
behave exactly as they would on a GPU, and are testable without one.

A slot with the MUTATES_INPUT trait (``dsp::KVScatter``) writes its first input in place
and returns it: its output gets no buffer of its own. The recording passes the input
array itself to the kernel and to every later reader of the output, and a replay
publishes that same array, so a KV buffer is written where it lives and never copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dsp_core.backends.base import Backend, CaptureFailed, ReplayStatus
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Plan, Segment
from dsp_cpu_ref.slot_by_slot import SlotBySlotSegment, Step

# kernel, argument arrays, output buffers, whether the kernel returns one array (not a tuple)
Recorded = tuple[Any, tuple[Any, ...], tuple[Any, ...], bool]


class EmulatedSegment(SlotBySlotSegment):
    """A segment that can be warmed, prepared, captured and replayed against fixed buffers."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        # MUTATES_INPUT slots: output flat index -> flat index of the input it aliases.
        self._aliases = {
            outs: ins[0]
            for s, (_, ins, outs, _) in zip(self._order, self._steps)
            if plan.slots[s].traits & Trait.MUTATES_INPUT and isinstance(outs, int) and outs != plan.scratch
        }
        produced = {o for _, _, outs, _ in self._steps for o in _as_tuple(outs)} - {plan.scratch}
        self._produced = sorted(produced - set(self._aliases))
        self._alias_arrays: dict[int, Any] = {}  # alias output -> the array it is, at capture
        self._specs: dict[int, tuple[tuple[int, ...], Any, tuple[int, ...]]] = {}
        self._buffers: dict[int, np.ndarray] = {}
        self._recording: list[Recorded] = []
        self._recorded_inputs: dict[int, Any] = {}

    def _warm(self, values: list[Any]) -> None:
        """Run the slots eagerly, noting the shape and dtype of every value produced.

        A slot that reads or writes something other than an array (a sequence) cannot be
        recorded against fixed buffers: CaptureFailed names it, and the core runs it in a
        gap between islands.
        """
        local = list(values)
        for s, (kernel, ins, outs, _) in zip(self._order, self._steps):
            args = [local[i] for i in ins]
            if any(isinstance(a, list | tuple) for a in args):
                raise CaptureFailed(f"{self._plan.slots[s].op} (slot {s}) reads a sequence, not an array", slot=s)
            result = kernel(*args)
            for o, r in zip(_as_tuple(outs), _as_tuple(result) if not isinstance(outs, int) else (result,)):
                local[o] = r
                if o != self._plan.scratch:
                    if not isinstance(r, np.ndarray | np.generic):
                        op = self._plan.slots[s].op
                        raise CaptureFailed(f"{op} (slot {s}) output is a {type(r).__name__}, not an array", slot=s)
                    arr = np.asarray(r)
                    self._specs[o] = (arr.shape, arr.dtype, arr.strides)
        for o in [*self._produced, *self._aliases]:  # publish the values as an eager run would
            values[o] = local[o]

    def _prepare(self, values: list[Any]) -> None:
        """Allocate one fixed buffer per produced value (kept across recaptures when shapes match)."""
        if not self._specs:
            raise CaptureFailed("prepare before warm-up: no shapes known")
        for o in self._produced:
            shape, dtype, strides = self._specs[o]
            buf = self._buffers.get(o)
            if buf is None or buf.shape != shape or buf.dtype != dtype or buf.strides != _layout(shape, dtype, strides):
                self._buffers[o] = _strided_empty(shape, dtype, strides)

    def _capture(self, values: list[Any]) -> None:
        """Record every step against the fixed buffers and the inputs present now."""
        recording: list[Recorded] = []
        inputs: dict[int, Any] = {}
        aliased: dict[int, Any] = {}
        for kernel, ins, outs, _ in self._steps:
            args = []
            for i in ins:
                if i in self._buffers:
                    args.append(self._buffers[i])
                elif i in aliased:
                    args.append(aliased[i])
                else:
                    inputs[i] = values[i]
                    args.append(values[i])
            if isinstance(outs, int) and outs in self._aliases:
                aliased[outs] = args[0]  # written in place: the output is the input array
            out_bufs = tuple(None if o in self._aliases else self._buffers.get(o) for o in _as_tuple(outs))
            recording.append((kernel, tuple(args), out_bufs, isinstance(outs, int)))
        self._recording = recording
        self._recorded_inputs = inputs
        self._alias_arrays = aliased

    def _replay(self, values: list[Any]) -> ReplayStatus:
        """Run the recording; STALE_BUFFER if an input array it baked in was replaced."""
        for i, array in self._recorded_inputs.items():
            if values[i] is not array:
                return ReplayStatus.STALE_BUFFER
        self._run_recording()
        for o in self._produced:
            values[o] = self._buffers[o]
        for o, array in self._alias_arrays.items():
            values[o] = array
        return ReplayStatus.OK

    def _run_recording(self) -> None:
        """Run the recorded steps, each result copied into its fixed buffer."""
        for kernel, args, out_bufs, single in self._recording:
            result = kernel(*args)
            for buf, r in zip(out_bufs, (result,) if single else result):
                if buf is not None:
                    np.copyto(buf, r, casting="no")

    def _release(self) -> None:
        self._buffers.clear()
        self._recording = []
        self._recorded_inputs = {}
        self._alias_arrays = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the fixed buffers."""
        return sum(b.nbytes for b in self._buffers.values())


def _layout(shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...]) -> tuple[int, ...]:
    """The strides a buffer gets: the warm-up's when they can be reproduced, else C order."""
    if all(st > 0 for st in strides) or not shape:
        return strides
    return np.empty(shape, dtype=dtype).strides


def _strided_empty(shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...]) -> np.ndarray:
    """A writable buffer with the layout the eager kernel produced (views keep their strides).

    Kernels such as MatMul take different code paths for different layouts, so a buffer
    with the eager run's strides keeps replayed results bit-equal to the reference.
    """
    layout = _layout(shape, dtype, strides)
    if any(d == 0 for d in shape):
        return np.empty(shape, dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    span = sum((d - 1) * st for d, st in zip(shape, layout)) + itemsize
    base = np.empty(span // itemsize + 1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=layout, writeable=True)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


__all__ = ["EmulatedSegment", "Step"]
