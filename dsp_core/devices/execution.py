"""Running a placed plan: each segment on its device, values moved between devices as they cross.

The auction never lets a segment straddle two devices (dsp_core.backends.auction cuts
segments where the placement changes), so each compiled segment belongs to one device.
``Backend.compile`` hands every segment of a placed plan to ``wrap``: the PlacedSegment
it returns makes sure, before each lifecycle call of the backend's segment (run, warm,
prepare, capture, replay, refresh), that every value the segment reads from outside lies
on its device, copying those that do not through the plan's Mover and recording each copy
with its reason (dsp_core.devices.transfers); afterwards the flat value list is restored,
so a value keeps its home copy for readers on its own device.

Copies are cached: an activation once per (value, device) and step, a constant (or a
value computed only from constants) once for as long as its source array is the same
object. Destination buffers are kept per (value, device), so a captured segment that reads
a copy reads the same address at every replay.

Movers: StubMover (stub topologies: a numpy copy, timed, with the topology's modelled
time) and CupyMover (CUDA: a peer copy, ``cudaMemcpyPeerAsync``, on the destination
device's legacy stream after an event recorded on the source device's, so no host
synchronisation per step; through pinned host memory where the devices have no peer access).
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import numpy as np

from dsp_core.backends.base import CompiledSegment, ReplayStatus
from dsp_core.devices.placement import Placement
from dsp_core.devices.topology import HOST, Topology
from dsp_core.devices.transfers import Copy, Reason, TransferRecorder
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import ExternalClass, Plan, Segment

CALLER = 0  # the caller's device: feeds arrive there, outputs return there


class StubMover:
    """Copies between stub devices: numpy copies, timed on the host, modelled by the topology."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def device_context(self, device: int) -> AbstractContextManager[Any]:
        """Nothing to enter on a stub device."""
        return nullcontext()

    def move(self, array: Any, src: int, dst: int, into: Any | None) -> tuple[Any, float | None]:
        """A copy of ``array`` on ``dst`` (into ``into`` when it fits), and the seconds it took."""
        # The copy keeps the source's strides (order "K"): numpy then takes the same kernel
        # paths, so outputs are bit-equal to one device. ``into`` (a kept buffer, for a
        # recording that baked its address) is written in place when its shape and dtype match.
        start = time.perf_counter()
        if not isinstance(array, np.ndarray):
            return array, time.perf_counter() - start  # sequences, scalars: as they are
        if into is not None and into.shape == array.shape and into.dtype == array.dtype:
            np.copyto(into, array)
            return into, time.perf_counter() - start
        return np.copy(array, order="K"), time.perf_counter() - start

    def location(self, array: Any, modelled: int) -> int:
        """Where ``array`` lies: on stub devices, where the model says."""
        return modelled

    def sync_back(self, copy: Any, original: Any) -> None:
        """Write a copy written in place back into the original (KV state read away from home)."""
        if isinstance(original, np.ndarray) and isinstance(copy, np.ndarray) and copy is not original:
            np.copyto(original, copy)


class CupyMover:
    """Copies between CUDA devices on their streams, ordered by events (no host synchronisation)."""

    def __init__(self, topology: Topology) -> None:
        import cupy

        self.cp = cupy
        self.topology = topology
        self.events: dict[int, Any] = {}
        self.staging: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id of dst buffer, bytes) -> (pinned, done event)
        self.keep: dict[int, Any] = {}  # id of a dst buffer -> the contiguous source copy its copy reads
        self._enable_peers()
        self._cap_pools()

    def _enable_peers(self) -> None:
        rt = self.cp.cuda.runtime
        for d in self.topology.devices:
            for p in d.peers:
                with self.cp.cuda.Device(d.index):
                    try:
                        rt.deviceEnablePeerAccess(p)
                    except Exception:  # noqa: BLE001  (already enabled is an error code too)
                        pass

    def _cap_pools(self) -> None:
        """DSP_MAX_DEVICE_MEMORY caps each device's CuPy memory pool too."""
        from dsp_core import config

        cap = int(config.get("max_device_memory"))
        if cap:
            for d in self.topology.devices:
                with self.cp.cuda.Device(d.index):
                    self.cp.get_default_memory_pool().set_limit(size=cap)

    def device_context(self, device: int) -> AbstractContextManager[Any]:
        """CuPy's device context for ``device`` (and torch's, once imported: Triton launches follow it)."""
        stack = ExitStack()
        stack.enter_context(self.cp.cuda.Device(device))
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            stack.enter_context(torch.cuda.device(device))
        return stack

    def location(self, array: Any, modelled: int) -> int:
        """The device a CuPy array lies on; HOST for host arrays."""
        dev = getattr(array, "device", None)
        return int(dev.id) if dev is not None and hasattr(dev, "id") else HOST

    def _event(self, device: int) -> Any:
        if device not in self.events:
            with self.cp.cuda.Device(device):
                self.events[device] = self.cp.cuda.Event(disable_timing=True)
        return self.events[device]

    def move(self, array: Any, src: int, dst: int, into: Any | None) -> tuple[Any, float | None]:
        """A copy of ``array`` on ``dst``, queued on ``dst``'s legacy stream after ``src``'s work."""
        cp = self.cp
        if not hasattr(array, "__cuda_array_interface__"):  # a host array: the device's backend stages it
            return array, None
        with cp.cuda.Device(dst):
            if into is None or into.shape != array.shape or into.dtype != array.dtype:
                into = cp.empty(array.shape, array.dtype)
            stream = cp.cuda.Stream.null
        src_array = array
        if not array.flags.c_contiguous:
            with cp.cuda.Device(src):
                src_array = cp.ascontiguousarray(array)
            self.keep[id(into)] = src_array  # alive until this buffer's next copy: the copy is asynchronous
        event = self._event(src)
        with cp.cuda.Device(src):
            event.record(cp.cuda.Stream.null)
        with cp.cuda.Device(dst):
            stream.wait_event(event)
            nbytes = int(array.nbytes)
            if self.topology.peer(src, dst):
                cp.cuda.runtime.memcpyPeerAsync(into.data.ptr, dst, src_array.data.ptr, src, nbytes, stream.ptr)
            else:
                self._through_host(src_array, src, into, dst, nbytes)
        return into, None

    def _through_host(self, src_array: Any, src: int, into: Any, dst: int, nbytes: int) -> None:
        """Device -> pinned host on ``src``'s stream, then host -> device on ``dst``'s, ordered by an event."""
        cp = self.cp
        key = (id(into), nbytes)
        staged = self.staging.get(key)
        if staged is None:
            with cp.cuda.Device(dst):
                done = cp.cuda.Event(disable_timing=True)
                done.record(cp.cuda.Stream.null)
            staged = self.staging[key] = (cp.cuda.alloc_pinned_memory(nbytes), done)
        pinned, done = staged
        kind_d2h, kind_h2d = cp.cuda.runtime.memcpyDeviceToHost, cp.cuda.runtime.memcpyHostToDevice
        with cp.cuda.Device(src):
            cp.cuda.Stream.null.wait_event(done)  # the previous step's host -> device read of ``pinned`` is over
            cp.cuda.runtime.memcpyAsync(pinned.ptr, src_array.data.ptr, nbytes, kind_d2h, cp.cuda.Stream.null.ptr)
            event = self._event(src)
            event.record(cp.cuda.Stream.null)
        with cp.cuda.Device(dst):
            cp.cuda.Stream.null.wait_event(event)
            cp.cuda.runtime.memcpyAsync(into.data.ptr, pinned.ptr, nbytes, kind_h2d, cp.cuda.Stream.null.ptr)
            done.record(cp.cuda.Stream.null)

    def sync_back(self, copy: Any, original: Any) -> None:
        """Write a copy written in place back into the original (KV state read away from home)."""
        if copy is original or not hasattr(original, "__cuda_array_interface__"):
            return
        src, dst = self.location(copy, 0), self.location(original, 0)
        self.move(copy, src, dst, original)


def mover_for(topology: Topology) -> StubMover | CupyMover:
    """The mover of a topology's kind."""
    return CupyMover(topology) if topology.kind == "cuda" else StubMover(topology)


class Placed:
    """A plan's placement with what running it needs: the mover, the copy caches, the recorder."""

    def __init__(self, plan: Plan, placement: Placement, variables: set[str] | None = None) -> None:
        self.placement = placement
        self.topology = placement.topology
        self.mover = mover_for(placement.topology)
        self.recorder = TransferRecorder()
        self._step_values: list[Any] | None = None
        self._activations: dict[tuple[int, int], tuple[Any, Any]] = {}  # (flat, dst) -> (source, copy), this step
        self._replicas: dict[tuple[int, int], tuple[Any, Any]] = {}  # (flat, dst) -> (source, copy), kept
        # (flat, dst, shape, dtype) -> the kept copy a recording reads (one per shape: live plans differ)
        self._buffers: dict[tuple[int, int, tuple[int, ...], str], Any] = {}
        n_ext = len(plan.externals)
        self.n_ext = n_ext
        self.output_flats = frozenset(plan.flat(r) for r in plan.outputs)
        self.names = {plan.flat(plan.external_ref(k)): e.name for k, e in enumerate(plan.externals)}
        self.names.update({plan.flat(v): info.name for v, info in enumerate(plan.values)})
        # The model's set of inputs marked variable (shared, it grows with mark_variable): KV state.
        self.variables = variables if variables is not None else set()
        self.feed_names = {
            plan.flat(plan.external_ref(k)): e.name
            for k, e in enumerate(plan.externals)
            if e.cls is ExternalClass.PLACEHOLDER
        }
        # Flat index -> (home device, reason a read elsewhere copies it, cached across steps?).
        # A fed input's home is the device of its first reader: it goes straight there.
        self.homes: dict[int, tuple[int, Reason, bool]] = {}
        for k, ext in enumerate(plan.externals):
            flat = plan.flat(plan.external_ref(k))
            if ext.cls is ExternalClass.CONSTANT:
                self.homes[flat] = (placement.externals[k], Reason.CONSTANT_REPLICATION, True)
            elif ext.cls is ExternalClass.VARIABLE:
                self.homes[flat] = (placement.externals[k], Reason.KV_CACHE, False)
            elif ext.cls is ExternalClass.PLACEHOLDER:
                self.homes[flat] = (placement.externals[k], Reason.INPUT_MIGRATION, False)
        for slot in plan.slots:
            sealed = slot.index in placement.sealed
            reason = Reason.CONSTANT_REPLICATION if sealed else Reason.ACTIVATION
            for v in slot.outputs:
                if v is not None:
                    self.homes[plan.flat(v)] = (placement.slots[slot.index], reason, sealed)

    def feed_devices(self, flats: frozenset[int]) -> dict[int, Any]:
        """For staged feeds away from the caller's device: flat -> a factory of its home device's context."""
        out = {}
        for flat in flats:
            home = self.homes.get(flat, (CALLER, Reason.INPUT_MIGRATION, False))[0]
            if home != CALLER:
                out[flat] = lambda home=home: self.mover.device_context(home)
        return out

    def device_of(self, segment: Segment) -> int:
        """The device of a segment's slots (they share one: segments never straddle devices)."""
        return self.placement.slots[segment.slots[0]] if segment.slots else CALLER

    def _new_step(self, values: list[Any]) -> None:
        if values is not self._step_values:
            self._step_values = values
            self._activations.clear()
            self.recorder.begin_step()

    def stage(
        self, values: list[Any], reads: tuple[int, ...], device: int, segment: int, keep: bool
    ) -> list[tuple[int, Any]]:
        """Put every value ``reads`` names on ``device``; returns (flat, original) to restore.

        ``keep``: copy into the buffers kept per (value, device, shape, dtype), as a recording
        (prepare, capture, replay) needs: it reads the addresses it baked in. An eager run gets
        fresh copies, so no view of a kept buffer can leave in an output a later step overwrites.
        """
        self._new_step(values)
        self.recorder.enter(device, segment)
        saved: list[tuple[int, Any]] = []
        for flat in reads:
            array = values[flat]
            if array is None:
                continue
            home, reason, cached = self.homes.get(flat, (device, Reason.ACTIVATION, False))
            if reason is Reason.INPUT_MIGRATION and self.feed_names.get(flat) in self.variables:
                reason = Reason.KV_CACHE  # a fed input marked variable: state the caller keeps
            src = self.mover.location(array, home)
            if src == device or (src == HOST and home == device):
                continue
            cache = self._replicas if cached else self._activations
            hit = cache.get((flat, device))
            if hit is not None and hit[0] is array:
                copy = hit[1]
            else:
                copy = self._copy(array, flat, src if src != HOST else home, device, reason, segment, keep)
                cache[(flat, device)] = (array, copy)
            saved.append((flat, array))
            values[flat] = copy
        return saved

    def _copy(self, array: Any, flat: int, src: int, dst: int, reason: Reason, segment: int, keep: bool) -> Any:
        key = (flat, dst, tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", "")))
        copy, seconds = self.mover.move(array, src, dst, self._buffers.get(key) if keep else None)
        if keep:
            self._buffers[key] = copy
        nbytes = int(getattr(array, "nbytes", 0))
        modelled = self.topology.modelled_seconds(src, dst, nbytes)
        name = self.names.get(flat, f"flat {flat}")
        self.recorder.copy(Copy(self.recorder.step, segment, reason, name, src, dst, nbytes, modelled, seconds))
        return copy

    def restore(self, values: list[Any], saved: list[tuple[int, Any]], written: frozenset[int]) -> None:
        """Put the home arrays back; state a slot wrote in place (``written``) is copied home first."""
        for flat, original in saved:
            if flat in written:
                copy = values[flat]
                self.mover.sync_back(copy, original)
            values[flat] = original

    def return_outputs(self, values: list[Any], outputs: tuple[int, ...], device: int, segment: int) -> None:
        """Requested outputs ``outputs`` (read by no other segment) computed away from the caller's device come back.

        A fresh copy each step: it goes to the caller, and no other segment reads it (so no
        recording bakes its address).
        """
        if device == CALLER:
            return
        for flat in outputs:
            array = values[flat]
            if array is not None:
                values[flat] = self._copy(array, flat, device, CALLER, Reason.OUTPUT_RETURN, segment, keep=False)


class PlacedSegment(CompiledSegment):
    """A backend's compiled segment run on its device: inputs moved there first, outputs returned."""

    def __init__(self, inner: CompiledSegment, plan: Plan, placed: Placed) -> None:
        super().__init__(inner.backend, inner.segment)
        self.inner = inner
        self.placed = placed
        self.device = placed.device_of(inner.segment)
        mine = set(inner.segment.slots)
        made = {plan.flat(v) for s in mine for v in plan.slots[s].outputs if v is not None}
        # A shape-only slot (Shape, Size) reads no data: its input need not move.
        reads = [
            plan.flat(r)
            for s in inner.segment.slots
            if not plan.slots[s].traits & Trait.SHAPE_ONLY_OUTPUT
            for r in plan.slots[s].inputs
            if r is not None
        ]
        self.reads = tuple(dict.fromkeys(f for f in reads if f not in made and f != 0))
        # Requested outputs it computes that no other slot reads: they return to the caller's
        # device right after it runs (an output another segment reads stays where it is made).
        read_elsewhere = {
            plan.flat(r) for slot in plan.slots if slot.index not in mine for r in slot.inputs if r is not None
        }
        self.returned = tuple(sorted(f for f in made if f in placed.output_flats and f not in read_elsewhere))
        # Inputs written in place (dsp::KVScatter's first input): copied back home after a run.
        self.written = frozenset(
            plan.flat(plan.slots[s].inputs[0])
            for s in mine
            if plan.slots[s].traits & Trait.MUTATES_INPUT
            and plan.slots[s].inputs
            and plan.slots[s].inputs[0] is not None
        )
        self.compile_seconds = getattr(inner, "compile_seconds", 0.0)

    def __getattr__(self, name: str) -> Any:  # what a backend's own code reads of its segment
        return getattr(self.__dict__["inner"], name)

    def _around(self, values: list[Any], call: Any, *args: Any, runs: bool = True, keep: bool = True) -> Any:
        """``call(values, *args)`` on the segment's device with its inputs there.

        ``runs``: the call computes the slots, so state written in place goes back home and
        requested outputs return to the caller's device (``prepare`` and ``capture`` only read
        the inputs' addresses). ``keep``: the inputs go through the kept buffers (a recording).
        """
        placed = self.placed
        index = self.segment.index
        with placed.mover.device_context(self.device):
            saved = placed.stage(values, self.reads, self.device, index, keep)
            try:
                result = call(values, *args)
            finally:
                placed.restore(values, saved, self.written if runs else frozenset())
            if runs:
                placed.return_outputs(values, self.returned, self.device, index)
        return result

    def run(self, values: list[Any]) -> None:
        """Run on the segment's device."""
        self._around(values, self.inner.run, keep=False)

    def warm(self, values: list[Any]) -> None:
        """Warm up on the segment's device."""
        self._around(values, self.inner.warm, keep=False)

    def prepare(self, values: list[Any]) -> None:
        """Plan buffers on the segment's device (its inputs there, as the capture will read them)."""
        self._around(values, self.inner.prepare, runs=False)

    def capture(self, values: list[Any]) -> None:
        """Capture on the segment's device, against the kept copies of its inputs."""
        self._around(values, self.inner.capture, runs=False)

    def replay(self, values: list[Any]) -> ReplayStatus:
        """Copy what crosses in (into the kept buffers), replay on the segment's device, return the outputs."""
        status: ReplayStatus = self._around(values, self.inner.replay)
        return status

    def refresh(self, values: list[Any], changed: list[int]) -> bool:
        """Refresh on the segment's device."""
        result: bool = self._around(values, self.inner.refresh, changed)
        return result

    def release(self) -> None:
        """Release the backend's segment."""
        with self.placed.mover.device_context(self.device):
            self.inner.release()

    @property
    def nbytes(self) -> int:
        """The backend's buffers."""
        return self.inner.nbytes


def wrap(plan: Plan, compiled: CompiledSegment) -> CompiledSegment:
    """``compiled`` run on its device when ``plan`` is placed on several; as it is otherwise."""
    placed = getattr(plan, "placement", None)
    if placed is None or isinstance(compiled, PlacedSegment) or not compiled.segment.slots:
        return compiled
    return PlacedSegment(compiled, plan, placed)


def device_context(plan: Plan, segment: Segment) -> AbstractContextManager[Any]:
    """The device a segment of ``plan`` is compiled on (nothing to enter when the plan is not placed)."""
    placed = getattr(plan, "placement", None)
    if placed is None or not segment.slots:
        return nullcontext()
    return placed.mover.device_context(placed.device_of(segment))  # type: ignore[no-any-return]


def input_devices(model: Any) -> dict[str, int]:
    """Fed input name -> the device its readers run on (its home), for a model placed on several devices."""
    plan = model.plan()
    placed = getattr(plan, "placement", None) if plan is not None else None
    if placed is None:
        return {}
    homes = placed.placement.externals
    return {e.name: homes[k] for k, e in enumerate(plan.externals) if e.cls is not ExternalClass.CONSTANT}


def on_device(xp: Any, device: int, make: Any) -> Any:
    """``make()`` with ``device`` current when ``xp`` is CuPy (numpy: the host has one device)."""
    if xp is np or device <= 0:
        return make()
    with xp.cuda.Device(device):
        return make()


def device_of(array: Any) -> AbstractContextManager[Any]:
    """The device context of a CuPy array (its ``device``); nothing to enter for a host array."""
    dev = getattr(array, "device", None)
    return dev if dev is not None and hasattr(dev, "__enter__") and hasattr(dev, "id") else nullcontext()  # type: ignore[no-any-return]
