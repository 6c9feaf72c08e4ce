"""WholeSegment: a segment run as one model of another inference runtime.

The pattern shared by the OpenVINO and ONNX Runtime backends (plugins/openvino,
plugins/onnxruntime): the segment's slots are written out as one ONNX model
(``dsp_core.plan.subgraph``) for the concrete shapes of its inputs, the runtime compiles
it, and

- ``run`` (before freezing, and for an eager unit) feeds the inputs and writes the
  runtime's outputs into the flat value list; one compiled model per input-shape key;
- ``prepare`` (after freezing) allocates one output buffer per output, with the shapes
  the warm-up run produced;
- ``capture`` binds the runtime's inputs to the arrays in ``values`` (DSP's staged or
  bridged buffers, or a variable read in place) and its outputs to those buffers, once:
  no copy on either side;
- ``replay`` is one call of the runtime on the pre-bound tensors;
- ``refresh`` re-binds the inputs whose arrays moved (same shapes), so drift costs a
  bind, not a recompile.

A subclass writes ``_build`` (compile the model bytes), ``_infer`` (one eager call) and
``_bind`` (a zero-argument callable that runs on bound buffers).

A decode plan's KV stores (``dsp::KVScatter``, which write a KV buffer in place) run inside
the segment as what they mean (``plan/subgraph.py``: the updated buffer as a new tensor the
later slots read), so a decode step is one runtime call, not one per layer between the
stores. The segment returns each store's rows and position, and after the call writes the
rows into the buffer itself (``store_rows``) and gives the store's output the buffer, as the
reference does (``DSP_RUNTIME_KV_STORE=0``: the stores end segments and run on the
reference, as before).

A runtime whose scatter writes in place when its output is its input's memory
(``in_place_stores``: ONNX Runtime) replays with each store's updated buffer bound as an
output onto the buffer itself, where the store's buffer is read by nothing else in the
segment, and nothing is written after the call. Its ScatterElements still passes over the
whole buffer so bound; its TensorScatter (ONNX opset 24, used where the segment's ops allow
it: ``_tensor_scatter``) writes only the new rows, where a copy into a new tensor moved the
whole buffer every step (GPT-2 124M: 24 buffers, 11.8 MB a token at 160 positions). Eager
calls keep the rows' path.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dsp_core import config
from dsp_core.backends.base import (
    Backend,
    CaptureFailed,
    CompiledSegment,
    Decline,
    DeclineReason,
    ReplayStatus,
    SlotView,
)
from dsp_core.cache.disk import default_cache_dir
from dsp_core.ir import dtypes
from dsp_core.ops.llm import KV_STORE_OPSET, is_kv_store, store_rows
from dsp_core.ops.registry import KernelContext, Trait, lookup
from dsp_core.plan.fusion import sealed_slots
from dsp_core.plan.merge import is_merged
from dsp_core.plan.plan import Plan, Segment
from dsp_core.runtime.hugepages import HugePageAdvice, huge_pages_for_new_memory
from dsp_core.runtime.units import unit_io  # a segment's I/O is split as a capturing unit's is

if TYPE_CHECKING:  # plan.subgraph imports onnx: loaded when a segment is built, not when a plugin is
    from dsp_core.plan.subgraph import SubgraphIO

# (shape, dtype) of each input: which compiled model a call uses.
ShapeKey = tuple[tuple[tuple[int, ...], str], ...]


def _nothing() -> None:
    """The bound call of a segment with no model (its slots all sealed)."""


# Compiled models by what decides them but the sealed values they embed (WholeSegment._shared_key),
# each with those values, while a segment holds the model: see WholeSegment.compiled_for.
_SHARED: dict[tuple[Any, ...], list[tuple[weakref.ref[Any], dict[int, np.ndarray]]]] = {}


def segment_io(
    plan: Plan, slots: tuple[int, ...], sealed: frozenset[int] | None = None
) -> tuple[SubgraphIO, tuple[int, ...]]:
    """(the model's fed inputs and outputs, the flat indexes it embeds as initializers).

    Embedded: the plan's constants and the values of sealed slots (computed once at
    freeze from constants alone), so the runtime can fold and pre-pack them. Everything
    else the slots read from outside is a graph input; outputs are the values read by
    slots outside the segment, or requested by the caller.
    """
    from dsp_core.plan.subgraph import SubgraphIO

    frozen = frozenset(sealed_slots(plan)) if sealed is None else sealed
    inputs, outputs, embedded = unit_io(plan, slots, frozen)
    return SubgraphIO(inputs, outputs), embedded


class WholeSegment(CompiledSegment):
    """A segment compiled into one model of another runtime; see the module docstring."""

    # True where ``_bind`` may bind an output onto an input's memory and the runtime's scatter
    # then writes in place (the KV stores' updated buffers onto the buffers)
    in_place_stores = False
    # True: merged products are written as their parts' own products (subgraph.segment_model)
    split_merged = False

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        from dsp_core.plan import subgraph

        super().__init__(backend, segment)
        self.plan = plan
        self._subgraph = subgraph
        # threads per call: the auction's choice for this segment, else DSP_CPU_THREADS (0: the runtime's default)
        self.threads = segment.threads or cpu_threads()
        sealed = frozenset(sealed_slots(plan))
        # The slots a frozen plan seals (computed once from constants and frozen shapes) are computed
        # here too, on the reference kernels, and the runtime's model is the other slots with their
        # values embedded: the model a frozen unit of the same slots compiles, so freezing finds it
        # compiled (compiled_for) instead of compiling a second model (seconds for a big one).
        # A segment of sealed slots only (a frozen plan computes them once) is no model at all.
        inner = tuple(s for s in segment.slots if s in sealed)
        live = tuple(s for s in segment.slots if s not in sealed)
        if any(s in plan.regions for s in inner):
            inner, live = (), segment.slots  # a subgraph among them: one model, as before
        self._inner = inner
        self._slots = live  # the slots the runtime's model computes
        made = {plan.flat(v) for s in inner for v in plan.slots[s].outputs if v is not None}
        reads = (plan.flat(r) for s in inner for r in plan.slots[s].inputs if r is not None)
        self._inner_reads = tuple(f for f in dict.fromkeys(reads) if f not in made)  # from outside them
        self._inner_values: dict[tuple[Any, ...], dict[int, Any]] = {}
        self.io, self.embedded = segment_io(plan, live, sealed)
        # KV stores: (buffer, rows, position, axis, output) flat indexes; the runtime returns each
        # one's rows (and its position, where the segment computes it), the segment writes them
        self.stores = kv_stores(plan, live)
        # output flat -> its buffer's: the stores a replay binds in place (output onto buffer)
        self.in_place: dict[int, int] = {}
        if self.stores:
            if self.in_place_stores and config.get("runtime_kv_in_place"):
                self.in_place = _in_place_stores(plan, live, self.stores, self.io)
            self.io = _store_io(self.io, self.stores, self.embedded, tuple(self.in_place))
        # Every other slot of the plan is sealed (computed once at freeze): once frozen, a
        # step runs this segment's model and nothing else (a runtime may keep its threads hot).
        mine = set(segment.slots)
        self.alone = all(s in mine or s in sealed for s in range(len(plan.slots)))
        self._models: dict[ShapeKey, Any] = {}
        self._buffers: list[np.ndarray] = []
        self._bound: Callable[[], Any] | None = None
        self._bound_inputs: tuple[Any, ...] = ()
        self._bound_outputs: tuple[Any, ...] = ()
        self._warm_outputs: list[Any] | None = None
        self.page_advice: list[HugePageAdvice] = []  # per compile: its new memory's huge pages
        self._inputs = self.io.inputs
        self._outputs = self.io.outputs

    # -- what a subclass writes ---------------------------------------------------------
    def _build(self, model: bytes, key: ShapeKey) -> Any:
        """Compile ``model`` (ONNX bytes) for the input shapes of ``key``."""
        raise NotImplementedError

    def _infer(self, compiled: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """One eager call: the outputs, in ``io.outputs`` order."""
        raise NotImplementedError

    def _bind(self, compiled: Any, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> Callable[[], Any]:
        """A callable that runs ``compiled`` reading ``inputs`` and writing ``outputs`` in place."""
        raise NotImplementedError

    def _attention_window(self) -> float:
        """Up to which fraction of a KV buffer's positions a decode step's attention reads only the
        positions written so far (with TensorScatter; ``subgraph._attention_windows``), for a
        runtime whose tensors inside a model may take their shape when it runs; 0: never."""
        return 0.0

    def _tensor_scatter(self) -> bool:
        """Whether the KV stores are written as TensorScatter (opset 24, where the segment's ops
        allow it: ``subgraph.segment_model``), for a runtime that runs it; ScatterElements if not."""
        return False

    # -- the model for this call's shapes -----------------------------------------------
    def _share(self, compiled: Any) -> Any:
        """This segment's handle on a model another segment compiled (the same model: its slots, I/O,
        shapes and embedded values): the model itself where its calls keep no per-caller state."""
        return compiled

    def compiled_for(self, values: list[Any]) -> Any:
        """The compiled model for the shapes of the inputs in ``values`` (built on first use).

        Another segment's model of the same plan content, slots, I/O, shapes and options is shared
        (``_share``), not compiled again: a plan's segments are compiled anew when it freezes and
        when the measured auction times them, and a whole-model runtime's compile of a big segment
        takes seconds (GPT-2 124M: about 5 s on ONNX Runtime, 9 s on OpenVINO, each time).
        """
        self._seal(values)
        arrays = [values[i] for i in self._inputs]
        key: ShapeKey = tuple((tuple(a.shape), a.dtype.str) for a in arrays)
        compiled = self._models.get(key)
        if compiled is None:
            constants = {f: np.asarray(values[f]) for f in self.embedded}
            shared, sealed = self._shared_key(key, constants)
            base = _find_shared(shared, sealed) if shared is not None else None
            if base is not None:
                compiled = self._share(base)
            else:
                feeds = {f: (dtypes.normalize(a.dtype), tuple(a.shape)) for f, a in zip(self._inputs, arrays)}
                model = self._subgraph.segment_model(
                    self.plan,
                    self._slots,
                    self.io,
                    feeds,
                    constants,
                    tensor_scatter=self._tensor_scatter(),
                    attention_window=self._attention_window(),
                    split_merged=self.split_merged,
                )
                with huge_pages_for_new_memory() as advice:
                    compiled = self._build(self._subgraph.serialized(model), key)
                self.page_advice.append(advice)
                if shared is not None:
                    _keep_shared(shared, sealed, compiled)
            self._models[key] = compiled
        return compiled

    def _seal(self, values: list[Any]) -> None:
        """The sealed slots inside this segment, computed on the reference kernels into ``values``
        (once per shape of what they read: a shape-only op reads a feed's shape)."""
        if not self._inner:
            return
        key = tuple(np.shape(values[f]) if values[f] is not None else None for f in self._inner_reads)
        got = self._inner_values.get(key)
        if got is None:
            plan = self.plan
            for s in self._inner:
                slot = plan.slots[s]
                opdef = lookup(slot.op, slot.domain)
                ctx = KernelContext(np, slot.opset, len(slot.inputs), len(slot.outputs), slot.name)
                args = [values[plan.flat(r)] if r is not None else None for r in slot.inputs]
                out = opdef.kernel(ctx, *args, **slot.attrs)
                outs = [out] if opdef.single_output else list(out)
                for v, x in zip(slot.outputs, outs):
                    if v is not None:
                        values[plan.flat(v)] = x
            made = [plan.flat(v) for s in self._inner for v in plan.slots[s].outputs if v is not None]
            got = {f: values[f] for f in made}
            self._inner_values[key] = got
        else:
            for f, x in got.items():
                values[f] = x

    def _shared_key(
        self, key: ShapeKey, constants: dict[int, np.ndarray]
    ) -> tuple[tuple[Any, ...] | None, dict[int, np.ndarray]]:
        """What decides the model this segment compiles for ``key``: the backend and DSP's options, the
        plan's content (its constants included), the slots and I/O, the shapes; and the embedded values
        that are not plan constants (sealed slots' values), which a shared model must equal. The key is
        None (nothing shared) for a plan with no content hash."""
        plan_constants = {self.plan.flat(self.plan.external_ref(k)): a for k, a in self.plan.constants.items()}
        sealed = {f: a for f, a in constants.items() if plan_constants.get(f) is not a}
        if not self.plan.content_hash:
            return None, sealed
        options = tuple((o.name, repr(config.get(o.name))) for o in config.OPTIONS)
        io = (tuple(self.io.inputs), tuple(self.io.outputs), tuple(sorted(self.in_place.items())), self.alone)
        embedded = tuple((f, a.dtype.str, a.shape) for f, a in sorted(sealed.items()))
        shared = (
            type(self).__name__,
            self.backend.name,
            self.plan.content_hash,
            self._slots,
            io,
            key,
            embedded,
            options,
            self.threads,
        )
        return shared, sealed

    # -- lifecycle -----------------------------------------------------------------------
    def run(self, values: list[Any]) -> None:
        """One eager call on the arrays in ``values``."""
        if not self._slots:
            self._seal(values)
            return
        compiled = self.compiled_for(values)
        outs = self._infer(compiled, [self._eager_input(values[i]) for i in self._inputs])
        for flat, out in zip(self._outputs, outs):
            if flat not in self.in_place:  # an updated buffer: the real one gets the rows below
                values[flat] = self._eager_output(flat, out)
        self._store(values)

    def _eager_input(self, x: Any) -> Any:
        """An input as ``_infer`` takes it: a C-ordered host array (a device runtime copies device arrays)."""
        return self._subgraph.c_order(x)

    def _eager_output(self, flat: int, out: Any) -> Any:
        """An eager output as the plan keeps it (a device runtime moves it to the device)."""
        return out

    def _store(self, values: list[Any], skip: dict[int, int] | None = None) -> None:
        """The KV stores' writes, after the runtime's call: their rows into their buffers, in place
        (those in ``skip`` the bound call wrote itself)."""
        for buffer, rows, position, axis, out in self.stores:
            if skip is None or out not in skip:
                values[out] = store_rows(values[buffer], np.asarray(values[rows]), np.asarray(values[position]), axis)

    def _warm(self, values: list[Any]) -> None:
        self.run(values)
        # The outputs' final shapes and dtypes: prepare (on the next step) allocates them.
        self._warm_outputs = [values[o] for o in self._outputs if o not in self.in_place]

    def _prepare(self, values: list[Any]) -> None:
        current = self._warm_outputs
        if current is None or any(not isinstance(a, np.ndarray) for a in current):
            raise CaptureFailed(f"{self.backend.name}: an output of segment {self.segment.index} is not an array")
        if len(self._buffers) != len(current) or any(
            b.shape != a.shape or b.dtype != a.dtype for b, a in zip(self._buffers, current)
        ):
            self._buffers = [np.empty(a.shape, a.dtype) for a in current]
        self._warm_outputs = None

    def _capture(self, values: list[Any]) -> None:
        if not self._slots:
            self._bound = _nothing
            return
        inputs = [values[i] for i in self._inputs]
        for flat, a in zip(self._inputs, inputs):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise CaptureFailed(
                    f"{self.backend.name}: input v{flat} of segment {self.segment.index} is not a C-contiguous "
                    "array, so it cannot be bound in place"
                )
        own = iter(self._buffers)
        outputs = [values[self.in_place[o]] if o in self.in_place else next(own) for o in self._outputs]
        self._bound = self._bind(self.compiled_for(values), inputs, outputs)
        self._bound_inputs = tuple(inputs)
        self._bound_outputs = tuple(outputs)

    def _replay(self, values: list[Any]) -> ReplayStatus:
        if not self._slots:
            self._seal(values)
            return ReplayStatus.OK
        # Hot path: one identity test per input, one runtime call, one store per output.
        for i, a in zip(self._inputs, self._bound_inputs):
            if values[i] is not a:
                return ReplayStatus.STALE_BUFFER
        self._bound()  # type: ignore[misc]
        for o, b in zip(self._outputs, self._bound_outputs):
            values[o] = b
        if len(self.in_place) < len(self.stores):
            self._store(values, skip=self.in_place)
        return ReplayStatus.OK

    def _replay_call(self, values: list[Any]) -> Callable[[], Any] | None:
        # The runtime call itself, when ``values`` holds the bound inputs and this segment's buffers
        # (and the segment writes no KV store after it: every store, if any, is bound in place).
        if self._bound is None or not self._slots or len(self.in_place) < len(self.stores):
            return None
        if any(values[i] is not a for i, a in zip(self._inputs, self._bound_inputs)):
            return None
        if any(values[o] is not b for o, b in zip(self._outputs, self._bound_outputs)):
            return None
        return self._bound

    def _rival_call(self, values: list[Any], holder: CompiledSegment) -> Callable[[], Any] | None:
        # Bound like ``_capture``, but onto the holder's outputs: the same slots, inputs and outputs
        # (shapes and dtypes), neither with a KV store to write after the call (a pure function of
        # its inputs, so a step may run either). Own buffers are not allocated.
        if not isinstance(holder, WholeSegment) or holder._bound is None or not self._slots:
            return None
        if self.stores or holder.stores or self._slots != holder._slots:
            return None
        if self._inputs != holder._inputs or self._outputs != holder._outputs:
            return None
        inputs = [values[i] for i in self._inputs]
        if any(a is not b for a, b in zip(inputs, holder._bound_inputs)):
            return None  # the holder is bound to other arrays than ``values`` holds
        outputs = list(holder._bound_outputs)
        compiled = self.compiled_for(list(values))  # a copy: sealed slots inside are not written into values
        self._bound = self._bind(compiled, inputs, outputs)
        self._bound_inputs = tuple(inputs)
        self._bound_outputs = tuple(outputs)
        return self._bound

    def _refresh(self, values: list[Any], changed: list[int]) -> bool:
        inputs = [values[i] for i in self._inputs]
        if any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(inputs, self._bound_inputs)):
            return False  # another compiled model: recapture
        try:
            self._capture(values)
        except CaptureFailed:
            return False
        return True

    def _release(self) -> None:
        self._models.clear()
        self._buffers = []
        self._bound = None
        self._bound_inputs = ()
        self._bound_outputs = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the output buffers this segment holds."""
        return sum(b.nbytes for b in self._buffers)


def kv_stores(plan: Plan, slots: tuple[int, ...]) -> tuple[tuple[int, int, int, int, int], ...]:
    """The KV stores among ``slots``: (buffer, rows, position, axis, output) as flat indexes."""
    found = []
    for s in slots:
        slot = plan.slots[s]
        if not is_kv_store(slot):
            continue
        buffer, rows, position = slot.inputs[:3]
        out = slot.outputs[0]
        assert buffer is not None and rows is not None and position is not None and out is not None
        axis = int(slot.attrs.get("axis", -2))
        found.append((plan.flat(buffer), plan.flat(rows), plan.flat(position), axis, plan.flat(out)))
    return tuple(found)


def _in_place_stores(
    plan: Plan, slots: tuple[int, ...], stores: tuple[tuple[int, int, int, int, int], ...], io: SubgraphIO
) -> dict[int, int]:
    """The stores a replay may bind in place (output flat -> buffer flat): a buffer the segment is
    fed, that only its store reads in the segment and that is no output of it (the old contents
    would be read after the write), written by one store only."""
    readers: dict[int, int] = {}
    for s in slots:
        for r in plan.slots[s].inputs:
            if r is not None:
                f = plan.flat(r)
                readers[f] = readers.get(f, 0) + 1
    buffers = [buffer for buffer, *_ in stores]
    return {
        out: buffer
        for buffer, _, _, _, out in stores
        if buffer in io.inputs and buffer not in io.outputs and readers.get(buffer) == 1 and buffers.count(buffer) == 1
    }


def _store_io(
    io: SubgraphIO,
    stores: tuple[tuple[int, int, int, int, int], ...],
    embedded: tuple[int, ...],
    in_place: tuple[int, ...] = (),
) -> SubgraphIO:
    """The segment model's I/O with KV stores: a store's output is the buffer (the segment gives it,
    not the runtime), except where a replay binds it onto the buffer (``in_place``: an output); its
    rows, and its position where the segment computes it, are outputs."""
    from dsp_core.plan.subgraph import SubgraphIO

    made = {out for *_, out in stores} - set(in_place)
    outputs = [o for o in io.outputs if o not in made]
    outputs += [o for o in in_place if o not in outputs]
    for _, rows, position, _, _ in stores:
        for flat in (rows, position):
            if flat not in outputs and flat not in io.inputs and flat not in embedded:
                outputs.append(flat)
    return SubgraphIO(io.inputs, tuple(outputs))


def runtime_kv_store() -> bool:
    """DSP_RUNTIME_KV_STORE: whole-segment backends take the decode plan's KV stores (on by default)."""
    return bool(config.get("runtime_kv_store"))


# -- what every whole-segment backend declines, and where its runtime caches -----------
# Slots with these traits end a segment or cannot be replayed from bound buffers (their
# output size is known only after they run, they run subgraphs, draw random numbers, or
# write an input in place, which a runtime computing new tensors cannot): the reference
# runs them.
NOT_WHOLE = Trait.DYNAMIC_OUTPUT_SIZE | Trait.CONTROL_FLOW | Trait.RANDOM | Trait.MUTATES_INPUT


def written_view(slot: SlotView) -> SlotView:
    """``slot`` as the segment model writes it (plan/subgraph.py): a merged product is its MatMul or
    Gemm, a KV store its ScatterElements (unless DSP_RUNTIME_KV_STORE is off).

    A whole-segment backend asks its op table about this view, not the slot: the runtime
    reads the product (Concat of constant weights, one product, a Slice per part), never
    ``dsp::MergedMatMul`` itself; and a ScatterElements into a new tensor, never an in-place
    write (the segment writes the buffer after the call), so the view has no MUTATES_INPUT.
    """
    if is_kv_store(slot) and runtime_kv_store():
        return replace(
            slot, op="ScatterElements", domain="", opset=KV_STORE_OPSET, traits=slot.traits & ~Trait.MUTATES_INPUT
        )
    if not is_merged(slot):
        return slot
    k = len(slot.output_dtypes)
    form = str(slot.attrs.get("form", "MatMul"))
    attrs = {key: slot.attrs[key] for key in ("alpha", "beta", "transB") if form == "Gemm" and key in slot.attrs}
    ins = slot.input_dtypes[:2] + (slot.input_dtypes[1 + k : 2 + k] if slot.attrs.get("bias") else ())
    return replace(slot, op=form, domain="", attrs=attrs, input_dtypes=ins, output_dtypes=slot.output_dtypes[:1])


def common_decline(backend: Backend, slot: SlotView, domains: frozenset[str] = frozenset({""})) -> Decline | None:
    """The declines every whole-segment backend shares: traits and op domains (of ``written_view``)."""
    if slot.traits & NOT_WHOLE:
        return Decline(
            DeclineReason.DYNAMIC_SHAPE if slot.traits & Trait.DYNAMIC_OUTPUT_SIZE else DeclineReason.CONTROL_FLOW,
            f"{slot.op} ends a segment (dynamic output size, control flow or random): the reference runs it",
        )
    if slot.domain not in domains:
        return Decline(DeclineReason.UNSUPPORTED_OP, f"domain {slot.domain!r} is not one {backend.name} reads")
    return None


def runtime_cache_dir(name: str) -> Path | None:
    """``<DSP cache dir>/runtimes/<name>`` (created), or None when the disk cache is off."""
    if not config.get("disk_cache"):
        return None
    root = config.get("cache_dir") or str(default_cache_dir(os.environ))
    path = Path(root) / "runtimes" / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable cache: the runtime compiles without one
    return path


def cpu_threads() -> int:
    """DSP_CPU_THREADS: threads per runtime call (0: the runtime's default)."""
    return int(config.get("cpu_threads"))


def _find_shared(key: tuple[Any, ...], sealed: dict[int, np.ndarray]) -> Any:
    """A live compiled model under ``key`` whose sealed values equal ``sealed`` (compared only when
    there is a candidate: a first compile pays nothing), or None."""
    for ref, values in _SHARED.get(key, ()):
        model = ref()
        if model is not None and all(np.array_equal(values[f], a) for f, a in sealed.items()):
            return model
    return None


def _keep_shared(key: tuple[Any, ...], sealed: dict[int, np.ndarray], model: Any) -> None:
    """Offer ``model`` to later segments of the same key, for as long as a segment holds it."""
    entries = _SHARED.setdefault(key, [])

    def gone(ref: weakref.ref[Any]) -> None:
        entries[:] = [e for e in entries if e[0] is not ref]
        if not entries and _SHARED.get(key) is entries:
            del _SHARED[key]

    entries.append((weakref.ref(model, gone), sealed))
