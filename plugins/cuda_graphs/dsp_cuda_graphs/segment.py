"""A segment on the GPU: reference kernels with ``xp = cupy``, captured into one CUDA graph.

Where values live:
- constants (weights) are copied to the device once per segment and kept (by identity);
- values computed on the device stay there; outputs read by a slot this backend declines
  (it runs on the CPU reference) are published as host copies;
- *shape-like* inputs (Reshape's shape, Slice's starts, ...: ``HOST_INPUTS``) are read by
  the kernels on the host; when such a value is a constant or a frozen (sealed) value its
  host copy is made once, so a capture never synchronises. A shape-like input computed on
  the device every step cannot be baked into a graph: that island fails to capture (and
  runs eagerly, its reason recorded).

Lifecycle (the core drives it; see dsp_core.runtime.plan_runtime):
- ``run``: eager, every op launched on the backend's stream;
- ``warm``: eager, under a tracing allocator (buffers.py) that records every allocation;
- ``prepare``: lays the trace out in one device block (interval allocator) and allocates
  device buffers for inputs fed from the host: everything the capture touches exists
  before it starts;
- ``capture``: under the capture lock, on the backend's non-default stream, the same
  code runs with the block's planned offsets; the graph is kept with the block;
- ``replay``: host-fed inputs are copied into their buffers, then one graph launch;
- ``refresh``: a host-fed input that moved needs nothing (it is copied every replay);
  a device input that moved needs a recapture (False).

MUTATES_INPUT (``dsp::KVScatter``): the slot writes its first input in place and returns
it, so its output is that very device array: no buffer of its own, nothing planned for
it, and later readers (and the published value) get the input array. A device-resident
variable (a CuPy array fed by the caller, e.g. a fixed KV buffer) is therefore written
where it lives, inside the captured graph, and never copied. A mutated input fed as a
*host* array is first copied to the device like any host input; its new contents are
copied back into the caller's array after each run (correct, but a device-to-host copy
and a synchronisation per step: feed such state as device arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from dsp_cpu_ref.slot_by_slot import bind_steps, generate, run_order

from dsp_core.backends.auction import slot_view
from dsp_core.backends.base import Backend, CaptureFailed, CaptureOutOfMemory, CompiledSegment, ReplayStatus
from dsp_core.errors import DSPError, KernelError
from dsp_core.ops.registry import Trait
from dsp_core.plan.merge import is_merged
from dsp_core.plan.plan import ExternalClass, Plan, Segment
from dsp_cuda_graphs import device
from dsp_cuda_graphs.buffers import PlannedAllocator, TracingAllocator
from dsp_cuda_graphs.kernels import (
    CublasXP,
    conv_kernel,
    gemm_kernel,
    matmul_kernel,
    max_pool_kernel,
    merged_matmul_kernel,
)

# Inputs (by position) that the reference kernels read as Python ints/floats on the host.
HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1, 2, 3),
    "Split": (1,),
    "OneHot": (1,),
    "TopK": (1,),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,),
    "Col2Im": (1, 2),
    "CenterCropPad": (1,),
    "AffineGrid": (1,),
    "Trilu": (1,),
    "CumSum": (1,),
    "CumProd": (1,),
    "Range": (0, 1, 2),
    "Dropout": (1, 2),
    "DFT": (1, 2),  # dft_length, axis
    "STFT": (1, 3),  # frame_step, frame_length
    "HannWindow": (0,),
    "HammingWindow": (0,),
    "BlackmanWindow": (0,),
    "MelWeightMatrix": (0, 1, 2, 3, 4),
}


def tainted_flats(plan: Plan) -> set[int]:
    """Flat indexes of values that change between steps (the complement of what freezing seals)."""
    tainted = {plan.external_ref(k) for k, e in enumerate(plan.externals) if e.cls is not ExternalClass.CONSTANT}
    for slot in plan.slots:
        if slot.traits & Trait.SHAPE_ONLY_OUTPUT:
            continue
        if slot.traits & Trait.RANDOM or any(r in tainted for r in slot.inputs if r is not None):
            tainted.update(v for v in slot.outputs if v is not None)
    return {plan.flat(r) for r in tainted}


def host_contiguous(x: np.ndarray) -> np.ndarray:
    """``x`` in C order with its own shape (``np.ascontiguousarray`` makes a 0-d array 1-d)."""
    return x if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(x.shape)


class _HostArgs:
    """A kernel whose shape-like arguments are handed over as host arrays."""

    def __init__(self, kernel: Any, positions: tuple[tuple[int, int], ...], segment: CudaGraphSegment) -> None:
        self.kernel = kernel
        self.positions = positions
        self.segment = segment

    def __call__(self, *args: Any) -> Any:
        given = list(args)
        for pos, flat in self.positions:
            if pos < len(given):
                given[pos] = self.segment.host_value(flat, given[pos])
        return self.kernel(*given)


class _ShapeOf:
    """Shape or Size on the device: one device array per input shape, made outside the plan's memory.

    The value is the input's shape, fixed for a plan's input signature, but making it is a
    host-to-device copy, which a capture refuses: the array made on the first run (eager or
    warm-up) is handed out again, allocated from CuPy's default pool so the warm-up's
    allocation trace (replayed by the capture) never includes it.
    """

    def __init__(self, kernel: Any, cupy: Any) -> None:
        self.kernel = kernel
        self.cp = cupy
        self.memo: dict[tuple[int, ...], Any] = {}

    def __call__(self, x: Any) -> Any:
        key = tuple(x.shape)
        got = self.memo.get(key)
        if got is None:
            with self.cp.cuda.using_allocator(self.cp.get_default_memory_pool().malloc):
                got = self.memo[key] = self.kernel(x)
        return got


class CudaGraphSegment(CompiledSegment):
    """One segment (or island) of a plan on the GPU."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment, tf32: bool) -> None:
        super().__init__(backend, segment)
        self._plan = plan
        self._tf32 = tf32
        slots = [plan.slots[s] for s in segment.slots]
        produced = {plan.flat(v) for sl in slots for v in sl.outputs if v is not None}
        self._constants = {plan.flat(plan.external_ref(k)) for k in plan.constants}
        self._tainted = tainted_flats(plan)
        self._device_reads: list[int] = []  # external flats some kernel reads on the device
        for sl in slots:
            shape_only = bool(sl.traits & Trait.SHAPE_ONLY_OUTPUT)
            host = HOST_INPUTS.get(sl.op, ()) if sl.domain in ("", "ai.onnx") else ()
            for pos, r in enumerate(sl.inputs):
                if r is None or shape_only or pos in host:
                    continue
                flat = plan.flat(r)
                if flat not in produced and flat not in self._device_reads:
                    self._device_reads.append(flat)
        inside = set(segment.slots)
        readers: dict[int, list[int]] = {}
        for sl in plan.slots:
            if sl.index not in inside:
                for r in sl.inputs:
                    if r is not None and r >= 0 and plan.flat(r) in produced:
                        readers.setdefault(plan.flat(r), []).append(sl.index)
        # MUTATES_INPUT slots: their output is their first input, written in place.
        self._mutated = sorted(
            {
                plan.flat(sl.inputs[0])
                for sl in slots
                if sl.traits & Trait.MUTATES_INPUT and sl.inputs and sl.inputs[0] is not None
            }
            - produced
        )
        plan_outputs = {plan.flat(r) for r in plan.outputs}
        self._outputs = sorted(o for o in produced if o in readers or o in plan_outputs)
        self._host_outputs = {
            o
            for o in self._outputs
            if any(backend.supports(slot_view(plan, s)) is not None for s in readers.get(o, ()))
        }
        self._st: dict[str, Any] | None = None
        self._run_fn: Any = None  # dsp_cpu_ref.slot_by_slot.Program
        self._host_memo: dict[int, tuple[Any, Any]] = {}
        self._device_memo: dict[int, tuple[Any, Any]] = {}
        self._capturing = False
        self._tracer: TracingAllocator | None = None
        self._trace: Any = None
        self._alloc: PlannedAllocator | None = None
        self._in_bufs: dict[int, Any] = {}
        self._host_inputs: dict[int, Any] = {}
        self._baked: list[Any] = []
        self._graph: Any = None
        self._out_arrays: dict[int, Any] = {}

    # -- binding (first use: needs CuPy and the device) -------------------------------
    def _ensure(self) -> dict[str, Any]:
        if self._st is None:
            st = device.state(self._tf32)
            steps = bind_steps(self._plan, self.segment, xp=CublasXP(st))
            bound = []
            for s, (kernel, ins, outs, releases) in zip(run_order(self.segment), steps):  # steps follow the groups
                slot = self._plan.slots[s]
                if slot.domain in ("", "ai.onnx") and slot.op == "MatMul":
                    kernel = matmul_kernel(st)
                elif slot.domain in ("", "ai.onnx") and slot.op == "Gemm":
                    kernel = gemm_kernel(st, **slot.attrs)
                elif is_merged(slot):  # sibling products merged by the core: each part through cuBLAS
                    kernel = merged_matmul_kernel(st, **slot.attrs)
                elif slot.domain in ("", "ai.onnx") and slot.op == "Conv":
                    kernel = conv_kernel(st, kernel, **slot.attrs)
                elif (
                    slot.domain in ("", "ai.onnx") and slot.op == "MaxPool" and all(o is None for o in slot.outputs[1:])
                ):
                    kernel = max_pool_kernel(st, kernel, len(slot.outputs), **slot.attrs)
                elif slot.domain in ("", "ai.onnx") and slot.op in ("Shape", "Size"):
                    kernel = _ShapeOf(kernel, st["cupy"])
                else:
                    kernel = self._slot_kernel(st, slot, kernel)
                host = HOST_INPUTS.get(slot.op, ()) if slot.domain in ("", "ai.onnx") else ()
                positions = tuple((p, ins[p]) for p in host if p < len(ins) and slot.inputs[p] is not None)
                if positions:
                    kernel = _HostArgs(kernel, positions, self)
                bound.append((kernel, ins, outs, releases))
            bound = self._fuse(st, bound)
            self._run_fn = generate(bound, f"{self._plan.graph_name}#cuda{self.segment.index}")
            self._st = st
        return self._st

    def _slot_kernel(self, st: dict[str, Any], slot: Any, kernel: Any) -> Any:
        """Hook for a backend with its own kernel for some ops: the kernel that runs ``slot``.

        ``kernel`` is the op's reference kernel bound to CuPy; this backend runs it as it is
        (PTX_JIT, in dsp-nvrtc, swaps in its LayerNormalization and Softmax kernels).
        """
        return kernel

    def _fuse(self, st: dict[str, Any], bound: list[Any]) -> list[Any]:
        """Hook for a fusing backend: the bound steps (one per slot, in ``run_order``) with some replaced.

        A backend built on this segment (dsp-triton) swaps each fusion group's steps for one
        step that launches its fused kernel; this backend runs every slot as bound.
        """
        return bound

    # -- value placement ---------------------------------------------------------------
    def host_value(self, flat: int, x: Any) -> Any:
        """``x`` as a host array for a shape-like argument (copied once for frozen values)."""
        if x is None or isinstance(x, np.ndarray | np.generic | int | float | list | tuple):
            return x
        memo = self._host_memo.get(flat)
        if memo is not None and memo[0] is x:
            return memo[1]
        if self._capturing:
            raise CaptureFailed(
                f"a shape-like input (value {flat}: axes, sizes, indices read on the host) is fed or computed "
                "every step: its value (and the output shape it decides) cannot be baked into a CUDA graph"
            )
        host = self._cp.asnumpy(x)
        if flat not in self._tainted:
            self._host_memo[flat] = (x, host)
        return host

    @property
    def _cp(self) -> Any:
        assert self._st is not None
        return self._st["cupy"]

    def _device_value(self, flat: int, x: np.ndarray) -> Any:
        """A host array as a device array; constants and frozen values are copied once."""
        if flat in self._tainted:
            return self._cp.asarray(x)
        memo = self._device_memo.get(flat)
        if memo is None or memo[0] is not x:
            memo = (x, self._cp.asarray(x))
            self._device_memo[flat] = memo
        return memo[1]

    def _enter(self, values: list[Any]) -> list[Any]:
        local = list(values)
        for flat in self._device_reads:
            x = local[flat]
            if isinstance(x, np.ndarray):
                local[flat] = self._device_value(flat, x)
        return local

    def _publish(self, values: list[Any], produced: dict[int, Any] | list[Any]) -> None:
        for o in self._outputs:
            v = produced[o]
            values[o] = self._cp.asnumpy(v) if o in self._host_outputs and v is not None else v

    def _execute(self, local: list[Any]) -> None:
        try:
            self._run_fn(local)
        except (DSPError, CaptureFailed):
            raise
        except Exception as exc:
            if self._capturing:
                raise
            raise self._error(exc) from exc

    def _error(self, exc: Exception) -> KernelError:
        failing = self._failing_slot(exc)
        slot = self._plan.slots[failing if failing is not None else self.segment.slots[0]]
        return KernelError(
            f'{slot.op} node "{slot.name}" (slot {slot.index}) failed on CUDA: {type(exc).__name__}: {exc}'
        )

    def _failing_line(self, exc: BaseException) -> tuple[int, ...] | None:
        """The slots of the generated step function's line that raised ``exc`` (None: not raised there)."""
        k = self._run_fn.failing_step(exc) if self._run_fn is not None else None
        lines = self._line_slots()
        if k is None or not lines:
            return None
        return lines[min(k, len(lines) - 1)]

    def _failing_slot(self, exc: BaseException) -> int | None:
        """The plan slot whose line of the generated step function raised ``exc`` (None: not raised there)."""
        slots = self._failing_line(exc)
        return slots[0] if slots is not None and len(slots) == 1 else None  # a fused group: the core bisects it

    def _line_slots(self) -> list[tuple[int, ...]]:
        """The slots each line of the generated step function runs (the islands hook names slots with it).

        One slot per line, in ``run_order``; a backend whose ``_fuse`` puts a fusion group on
        one line overrides this to say so.
        """
        return [(s,) for s in run_order(self.segment)]

    # -- eager -------------------------------------------------------------------------
    def run(self, values: list[Any]) -> None:
        """Every op launched eagerly on the backend's stream."""
        st = self._ensure()
        with st["stream"]:
            device.fence_in(st)
            local = self._enter(values)
            self._execute(local)
            self._publish(values, local)
            self._write_back(values, local)
            device.fence_out(st)

    def _write_back(self, values: list[Any], device_values: Any) -> None:
        """Mutated inputs fed as host arrays: the device copy's new contents go back to the caller's array."""
        for flat in self._mutated:
            x = values[flat]
            if isinstance(x, np.ndarray):
                arr = device_values.get(flat) if isinstance(device_values, dict) else device_values[flat]
                if arr is not None and arr is not x:
                    x[...] = arr.get(stream=self._st["stream"] if self._st else None)

    def _warm(self, values: list[Any]) -> None:
        """An eager run whose allocations are traced (the capture will replay them from one block)."""
        st = self._ensure()
        cp = st["cupy"]
        if self._tracer is not None:
            self._tracer.close()
        with st["stream"]:
            device.fence_in(st)
            local = self._enter(values)
            tracer = TracingAllocator(cp)
            with cp.cuda.using_allocator(tracer.allocator.malloc):
                self._execute(local)
            trace = tracer.trace
            self._trace = type(trace)(list(trace.sizes), list(trace.starts), list(trace.ends), trace.clock)
            self._publish(values, local)
            self._write_back(values, local)
            device.fence_out(st)
        self._tracer = tracer

    # -- capture -----------------------------------------------------------------------
    def _prepare(self, values: list[Any]) -> None:
        """The block for the traced allocations, and device buffers for host-fed inputs."""
        if self._trace is None:
            raise CaptureFailed("prepare before warm-up: no allocation trace")
        st = self._ensure()
        cp = st["cupy"]
        self._graph = None
        try:
            with st["stream"]:
                self._alloc = PlannedAllocator(cp, self._trace)
                for flat in self._device_reads:
                    x = values[flat]
                    if isinstance(x, np.ndarray) and flat in self._tainted:
                        self._input_buffer(flat, x)
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise CaptureOutOfMemory(f"segment {self.segment.index}: {exc}") from exc

    def _input_buffer(self, flat: int, x: np.ndarray) -> Any:
        buf = self._in_bufs.get(flat)
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
            buf = self._cp.empty(x.shape, dtype=x.dtype)
            self._in_bufs[flat] = buf
        return buf

    def _capture(self, values: list[Any]) -> None:
        """Record the segment into a CUDA graph against stable buffers."""
        st = self._ensure()
        cp = st["cupy"]
        if self._alloc is None:
            raise CaptureFailed("capture before prepare")
        stream = st["stream"]
        local = list(values)
        host_inputs: dict[int, Any] = {}
        try:
            with stream:
                device.fence_in(st)
                for flat in self._device_reads:
                    x = local[flat]
                    if isinstance(x, np.ndarray):
                        if flat in self._tainted:
                            buf = self._input_buffer(flat, x)
                            buf.set(host_contiguous(x), stream=stream)
                            host_inputs[flat] = buf
                            local[flat] = buf
                        else:
                            local[flat] = self._device_value(flat, x)
                graph = self._record(cp, stream, local)
                self._publish(values, local)
                self._write_back(values, local)
                device.fence_out(st)
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise CaptureOutOfMemory(f"segment {self.segment.index}: {exc}") from exc
        self._graph = graph
        self._host_inputs = host_inputs
        self._baked = [local[f] for f in self._device_reads]  # what the graph reads: kept alive with it
        self._out_arrays = {o: local[o] for o in self._outputs}

    def _record(self, cp: Any, stream: Any, local: list[Any]) -> Any:
        assert self._alloc is not None
        try:
            with device.CaptureLock():
                self._alloc.rewind()
                stream.begin_capture()
                self._capturing = True
                try:
                    with cp.cuda.using_allocator(self._alloc.allocator.malloc):
                        self._execute(local)
                except BaseException:
                    try:
                        stream.end_capture()
                    except Exception:  # noqa: BLE001, S110  (the capture is already broken)
                        pass
                    raise
                finally:
                    self._capturing = False
                graph = stream.end_capture()
        except CaptureFailed as exc:
            if exc.slot is None:  # the island hook: name the slot, the core captures around it
                exc.slot = self._failing_slot(exc)
            raise
        except cp.cuda.memory.OutOfMemoryError:
            raise
        except Exception as exc:
            slot = self._failing_slot(exc)  # None (the graph was invalidated, seen at end_capture): the core bisects
            where = f" at {self._plan.slots[slot].op} (slot {slot})" if slot is not None else ""
            raise CaptureFailed(
                f"segment {self.segment.index}: capture failed{where}: {type(exc).__name__}: {exc}", slot=slot
            ) from exc
        # The capture only recorded: run it once so the outputs hold this step's values.
        graph.launch(stream)
        return graph

    def _replay(self, values: list[Any]) -> ReplayStatus:
        """Copy host-fed inputs into their buffers, launch the graph."""
        st = self._st
        if self._graph is None or st is None:
            return ReplayStatus.STALE_BUFFER
        stream = st["stream"]
        device.fence_in(st)
        for flat, buf in self._host_inputs.items():
            x = values[flat]
            if not isinstance(x, np.ndarray) or x.shape != buf.shape or x.dtype != buf.dtype:
                return ReplayStatus.STALE_BUFFER
            buf.set(host_contiguous(x), stream=stream)
        self._graph.launch(stream)
        if self._host_outputs:
            with stream:
                self._publish(values, self._out_arrays)
        else:
            for o, arr in self._out_arrays.items():
                values[o] = arr
        if self._mutated and self._host_inputs:
            self._write_back(values, self._host_inputs)
        device.fence_out(st)
        return ReplayStatus.OK

    def _replay_call(self, values: list[Any]) -> Callable[[], None] | None:
        """The steady replay: fence in, launch, fence out (no host-fed input, outputs on the device)."""
        st = self._st
        if self._graph is None or st is None or self._host_inputs or self._host_outputs:
            return None
        if any(values[o] is not arr for o, arr in self._out_arrays.items()):
            return None
        graph, stream, null = self._graph, st["stream"], st["null"]
        ev_in, ev_out = st["ev_in"], st["ev_out"]

        def call() -> None:
            ev_in.record(null)
            stream.wait_event(ev_in)
            graph.launch(stream)
            ev_out.record(stream)
            null.wait_event(ev_out)

        return call

    def _refresh(self, values: list[Any], changed: list[int]) -> bool:
        """In place when every moved input is host-fed (copied each replay anyway); else recapture."""
        for flat in changed:
            buf = self._host_inputs.get(flat)
            x = values[flat]
            if buf is None or not isinstance(x, np.ndarray) or x.shape != buf.shape or x.dtype != buf.dtype:
                return False
        return True

    def _release(self) -> None:
        self._graph = None
        self._alloc = None
        self._in_bufs.clear()
        self._host_inputs = {}
        self._baked = []
        self._out_arrays = {}
        if self._tracer is not None:
            self._tracer.close()
            self._tracer = None

    @property
    def nbytes(self) -> int:
        """Bytes of the planned block and the input buffers."""
        block = self._alloc.nbytes if self._alloc is not None else 0
        return block + sum(int(b.nbytes) for b in self._in_bufs.values())
