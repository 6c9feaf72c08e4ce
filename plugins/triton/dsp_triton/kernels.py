"""A fusion group at run time: its reference steps, its generated Triton kernel, the check between them.

``FusedGroup`` is the one step that replaces a group's slots in a TRITON segment. The first
time it meets a layout of its inputs (outside any capture) it:

1. runs the group's reference kernels (the same CuPy kernels CUDA_GRAPHS runs), which gives
   every intermediate value's shape and dtype and the reference outputs;
2. generates the group's Triton source for those shapes (``codegen.generate``), compiles it
   through DSP's checked kernel cache, loads the module, and tunes a small set of block
   configs (the winner cached on disk with the kernel);
3. launches it and checks its outputs against the reference outputs within the contract's
   tolerance. A mismatch demotes the group, loudly: it runs its reference kernels from then
   on (in the same captured graph), and the reason is kept for ``dsp plan explain``.

Later calls launch the compiled kernel with raw pointers on the segment's stream, so inside
a capture nothing is compiled, loaded or tuned. A layout first seen *during* a capture
fails that capture (CaptureFailed) rather than compiling inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dsp_cuda_graphs import attention
from dsp_cuda_graphs.derived import Derived, joined_bias, joined_nk, nk_copy
from dsp_cuda_graphs.fusion import constants_match, mismatch, run_reference, run_step
from dsp_cuda_graphs.greedy import PickLayout

from dsp_core import config as dsp_config
from dsp_core.backends.base import CaptureFailed
from dsp_core.plan.kernelspec import reference_specs
from dsp_triton import binaries, codegen
from dsp_triton.cache import TuneCache, cache_root, scoped, source_key, write_checked

log = logging.getLogger("dsp.triton")

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]
# One kernel of a group: its spec, reference steps before it (a product cuBLAS runs, whose
# epilogue it is), what it reads instead of constant inputs, reference steps after it.
Piece = tuple[codegen.GroupSpec, list[Step], dict[int, "Derived"], list[Step]]
TUNE_RUNS = 5
TUNE_LAUNCHES = 20  # launches per timed graph
# Value ids of a convolution group's bias, viewed [C, 1, ...] to broadcast over the output, and of
# the output with its bias added (the convolution itself, run without its bias, keeps its own id).
CONV_BIAS, CONV_Y = -1101, -1102
MIN_TRANSPOSED_WEIGHT = 1 << 16  # weights of at least this many elements get a [N, K] copy for one-row products
MAX_KEYED_ELEMENTS = 4096  # host inputs up to this size are keyed by value
# Loaded kernels by (source, warps, alignment, device), alive as long as the process: a captured graph holds
# their functions, and a module freed while a graph can still launch it breaks the graph.
_BINARIES: dict[tuple[Any, ...], Any] = {}


@dataclass
class GroupReport:
    """What became of one group: fused into a Triton kernel, or why it runs its reference kernels."""

    index: int
    template: str
    slots: tuple[int, ...]
    status: str = "pending"  # "triton", "reference", "demoted", "pending"
    reason: str = ""
    kernel: str = ""
    config: dict[str, int] = field(default_factory=dict)
    compile_ms: float = 0.0
    kernel_us: float | None = None  # the tuned config's time per launch, in a replayed graph
    # dsp-nvrtc's report when the group is its CUDA C kernel: Triton's templates declined it
    fallback: Any = None

    def as_dict(self) -> dict[str, Any]:
        status, reason, kernel, compile_ms = self.status, self.reason, self.kernel, self.compile_ms
        if self.fallback is not None:  # AUTO's chain per group: Triton declined, NVRTC's kernel (or not)
            f = self.fallback
            status = "nvrtc" if f.status == "fused" else f.status
            reason = f"Triton's templates decline it ({self.reason}); " + (f.reason or "NVRTC_JIT generates it")
            kernel, compile_ms = f.kernel, compile_ms + f.compile_ms
        return {
            "group": self.index,
            "template": self.template,
            "slots": list(self.slots),
            "status": status,
            "reason": reason,
            "kernel": kernel,
            "config": dict(self.config),
            "compile_ms": round(compile_ms, 2),
            "kernel_us": None if self.kernel_us is None else round(self.kernel_us, 3),
        }


class _Compiled:
    """A loaded kernel and its launch geometry."""

    def __init__(self, binary: Any, kernel: codegen.Kernel, shapes: dict[int, tuple[tuple[int, ...], Any]]) -> None:
        self.binary = binary  # binaries.Loaded (or TritonLaunched): the module loaded, never inside a capture
        self.kernel = kernel
        self.shapes = shapes  # output value -> (shape, dtype)
        # input flat -> (the array seen at compile time, its value): inputs whose values the
        # generator baked into the source (slice bounds, exponents, literals)
        self.constants: dict[int, tuple[Any, np.ndarray]] = {}
        # a product the template declined (more than 16 rows): its reference step (cuBLAS)
        # runs first, then this kernel as its fused epilogue
        self.head: list[Step] = []
        # input flat (or a synthetic id) -> what the kernel reads there instead, made once
        # from constant inputs: a weight transposed to [N, K], merged weights joined along N
        self.substitutes: dict[int, Derived] = {}
        # a group run as several kernels (an attention the one-kernel template declines):
        # each part launched in order, the values between them stored
        self.parts: list[_Compiled] = []
        # reference steps after the kernel: a product cuBLAS runs after its norm's kernel
        self.tail: list[Step] = []

    def pointer_args(self) -> set[int]:
        """Value ids the kernel(s) read through pointers."""
        if self.parts:
            return set().union(*(p.pointer_args() for p in self.parts))
        return set(self.kernel.args[: self.kernel.n_inputs])

    def empty_outputs(self, cp: Any) -> dict[int, Any]:
        return {
            v: cp.empty(self.shapes[v][0], dtype=self.shapes[v][1]) for v in self.kernel.args[self.kernel.n_inputs :]
        }

    def launch(self, ptrs: Sequence[int], stream: int) -> None:
        self.binary.launch(self.kernel.grid, ptrs, stream)


class FusedGroup:
    """The step that runs one fusion group."""

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        nodes: list[codegen.NodeSpec],
        constants: Callable[[int, Any], np.ndarray | None],
        tolerance: float,
        cupy: Any,
        capturing: Callable[[], bool],
        fixed: Callable[[int], bool] = lambda flat: False,
    ) -> None:
        self.report = report
        self.steps = steps
        self.fixed = fixed  # True for an input that never changes between steps (a weight)
        self.in_flats = in_flats
        self.out_flats = out_flats
        self.nodes = nodes
        self.constants = constants
        self.tolerance = tolerance
        self.cp = cupy
        self.capturing = capturing
        self.compiled: dict[tuple[Any, ...], _Compiled] = {}
        self.single = len(out_flats) == 1
        self.progress: Any = None  # a dsp_core.progress step while the segment's first runs compile
        # dsp-nvrtc's step for this group, once Triton's templates declined it (None: none)
        self.fallback: Any = None

    # -- the reference path ----------------------------------------------------------------
    def reference(self, inputs: Sequence[Any], keep: bool = False) -> tuple[tuple[Any, ...], dict[int, Any]]:
        """The group's slots on their reference kernels: its outputs (and, with ``keep``, every value)."""
        return run_reference(self.steps, self.in_flats, self.out_flats, inputs, keep)

    def __call__(self, *inputs: Any) -> Any:
        if self.fallback is not None:
            return self.fallback(*inputs)  # builds, checks and demotes on its own, per layout
        try:
            if self.report.status in ("reference", "demoted"):
                outs, _ = self.reference(inputs)
            else:
                outs = self._fused(inputs)
        except CaptureFailed:
            raise
        except Exception as exc:
            shapes = ", ".join(f"v{f}: {getattr(x, 'shape', type(x).__name__)}" for f, x in zip(self.in_flats, inputs))
            raise RuntimeError(
                f"{type(exc).__name__}: {exc} (fusion group {self.report.index}, {self.report.status}, inputs {shapes})"
            ) from exc
        return outs[0] if self.single else outs

    # -- the fused path ----------------------------------------------------------------------
    def _signature(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The layout of the inputs (and the values of host inputs: shape vectors decide output shapes)."""
        sig: list[Any] = []
        for x in inputs:
            if isinstance(x, np.ndarray | np.generic):
                small = x.size <= MAX_KEYED_ELEMENTS
                sig.append((np.shape(x), x.dtype.str, x.tobytes() if small else id(x)))
            elif hasattr(x, "data") and hasattr(x, "strides"):
                sig.append((x.shape, x.strides, x.dtype.str, int(x.data.ptr) % 16 == 0))
            else:
                sig.append((type(x).__name__, repr(x)[:200]))
        return tuple(sig)

    def _fused(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        key = self._signature(inputs)
        compiled = self.compiled.get(key)
        if (
            compiled is not None
            and not self.capturing()
            and not constants_match(self.cp, self.in_flats, compiled.constants, inputs)
        ):
            compiled = None  # a value the kernel baked in changed (a segment run for another signature)
        if compiled is None:
            if self.capturing():
                raise CaptureFailed(
                    f"fusion group {self.report.index} met a new input layout during capture; "
                    "its kernel must be compiled before capture"
                )
            got = self._compile(inputs, key)
            if got is None:
                if self.fallback is not None:
                    outs = self.fallback(*inputs)
                    return (outs,) if self.single else tuple(outs)
                outs, _ = self.reference(inputs)
                return outs
            compiled = got
        return self._launch(compiled, inputs)

    def _launch(self, compiled: _Compiled, inputs: Sequence[Any]) -> tuple[Any, ...]:
        by_flat = dict(zip(self.in_flats, inputs))
        for part in compiled.parts or [compiled]:
            self._launch_part(part, by_flat)
        return tuple(by_flat[o] for o in self.out_flats)

    def _launch_part(self, compiled: _Compiled, by_flat: dict[int, Any]) -> None:
        """Launch one kernel (after its head steps) on the values in ``by_flat``; add what it stores."""
        cp = self.cp
        kernel = compiled.kernel
        reads = dict(by_flat)
        for flat, derived in compiled.substitutes.items():
            sources = [reads[f] for f in derived.sources]
            if derived.moved(sources):
                if self.capturing():
                    raise CaptureFailed(f"fusion group {self.report.index}'s weights moved during capture")
                compiled.substitutes[flat] = derived = Derived.make(cp, derived.sources, sources, derived.build)
            reads[flat] = derived.array
        self._run_steps(compiled.head, reads, by_flat)
        outs = compiled.empty_outputs(cp)
        ptrs = [int(reads[v].data.ptr) for v in kernel.args[: kernel.n_inputs]]
        ptrs += [int(outs[v].data.ptr) for v in kernel.args[kernel.n_inputs :]]
        compiled.launch(ptrs, cp.cuda.get_current_stream().ptr)
        for out, buffer, *_ in kernel.kv_stores:  # written in place: the output is the buffer
            outs[out] = reads[buffer]
        by_flat.update(outs)
        reads.update(outs)
        self._run_steps(compiled.tail, reads, by_flat)

    @staticmethod
    def _run_steps(steps: list[Step], reads: dict[int, Any], by_flat: dict[int, Any]) -> None:
        """Reference steps around a kernel (cuBLAS for a product of more than 16 rows)."""
        for step in steps:
            by_flat.update(run_step(step, reads))

    def _spec(self, inputs: Sequence[Any]) -> tuple[codegen.GroupSpec, tuple[Any, ...], dict[int, Any]]:
        ref_outs, local = self.reference(inputs, keep=True)
        values, device_inputs = reference_specs(local, self.in_flats, inputs)
        spec = codegen.GroupSpec(
            self.report.template,
            self.nodes,
            values,
            device_inputs,
            list(self.out_flats),
            lambda v: self._used(v, local),
        )
        return spec, ref_outs, local

    def _used(self, v: int, local: dict[int, Any]) -> np.ndarray | None:
        """The generator's constants callback: a host value, remembered so reuse can be checked."""
        got = self.constants(v, local.get(v))
        if got is not None:
            self._baked[v] = got
        return got

    def _compile(self, inputs: Sequence[Any], key: tuple[Any, ...]) -> _Compiled | None:
        """Generate, build, tune and check the kernel for this layout; None: run the reference kernels.

        Everything here allocates from CuPy's default pool, never from the allocator in
        effect: a warm-up traces its allocations to plan the captured graph's memory, and
        the capture will only make the launch's allocations (or the reference kernels').
        """
        cp = self.cp
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            got = self._compile_untraced(inputs, key)
        if got is not None:
            self.compiled[key] = got
        if self.progress is not None:
            self.progress.advance()
        return got

    def _compile_untraced(self, inputs: Sequence[Any], key: tuple[Any, ...]) -> _Compiled | None:
        start = time.perf_counter()
        self._baked: dict[int, np.ndarray] = {}
        try:
            spec, ref_outs, local = self._spec(inputs)
        except codegen.Unsupported as exc:
            self._settle("reference", str(exc))
            return None
        try:
            pieces = self._pieces(spec, local)
            kernels = [codegen.generate(piece[0]) for piece in pieces]
        except codegen.Unsupported as exc:
            self._settle("reference", str(exc))
            self.fallback = nvrtc_step(self)
            if self.fallback is not None:
                self.report.fallback = self.fallback.report
            return None
        except Exception as exc:  # noqa: BLE001  (a generator bug costs the group its kernel, never the model)
            self._settle("reference", f"the generator failed: {type(exc).__name__}: {str(exc)[:300]}")
            message = (
                f"DSP TRITON: fusion group {self.report.index} ({self.report.template}, slots "
                f"{list(self.report.slots)}) runs its reference kernels: {self.report.reason} (a DSP bug: report it)"
            )
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            return None
        built: list[_Compiled] = []
        try:
            for (piece, head, substitutes, tail), kernel in zip(pieces, kernels):
                for v in kernel.args[: kernel.n_inputs]:
                    if isinstance(local[v], np.ndarray):
                        self._settle("reference", f"input {v} is a host array")
                        return None
                shapes = {v: (piece.values[v].shape, np.dtype(piece.values[v].dtype)) for v in piece.outputs}
                one = self._tune(piece, self._build(kernel, local, shapes), local, shapes)
                one.head, one.substitutes, one.tail = head, substitutes, tail
                built.append(one)
                for v, (shape, dtype) in shapes.items():  # a later piece reads this one's scratch
                    if v not in local:
                        local[v] = self.cp.empty(shape, dtype=dtype)
        except Exception as exc:  # noqa: BLE001  (a compiler error: this group runs its reference kernels)
            self._settle("reference", f"Triton failed to compile it: {type(exc).__name__}: {str(exc)[:300]}")
            log.warning("DSP TRITON: group %d (%s): %s", self.report.index, self.report.template, self.report.reason)
            return None
        compiled = built[0] if len(built) == 1 else _Compiled(built[-1].binary, built[-1].kernel, {})
        if len(built) > 1:
            compiled.parts = built
        poisoned = _poison_kv_rows([part.kernel for part in built], local, self.cp)
        got = self._launch(compiled, inputs)
        kv_bad = _kv_rows_mismatch(poisoned, self.tolerance, self.cp)  # first: it restores wrong rows
        bad = _mismatch(got, ref_outs, self.tolerance, self.cp) or kv_bad
        if bad is not None and len(built) == 1 and not poisoned:
            alt, bad = self._next_correct(compiled, inputs, ref_outs, bad)
            if alt is not None:
                compiled, bad = alt, None
        self.report.compile_ms += (time.perf_counter() - start) * 1000
        if bad is not None:
            self._settle("demoted", f"its kernel disagreed with the reference kernels: {bad}")
            message = (
                f"DSP TRITON: fusion group {self.report.index} ({self.report.template}, slots "
                f"{list(self.report.slots)}: {'+'.join(n.op for n in self.nodes)}) demoted to its "
                f"reference kernels: {bad}"
            )
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            return None
        fresh = _Compiled(compiled.binary, compiled.kernel, compiled.shapes)  # its own record of constants
        fresh.head, fresh.substitutes, fresh.parts = compiled.head, compiled.substitutes, compiled.parts
        fresh.tail = compiled.tail
        compiled = fresh
        # Inputs whose values shaped the source: shape-like inputs (they fixed the concrete
        # shapes), literals; with a constant computed inside the group, every small input.
        pointers = compiled.pointer_args()
        inside = any(v not in self.in_flats for v in self._baked)
        for flat, x in zip(self.in_flats, inputs):
            if x is None or (flat in pointers and flat not in self._baked and not inside):
                continue
            if getattr(x, "size", MAX_KEYED_ELEMENTS + 1) > MAX_KEYED_ELEMENTS:
                continue
            if flat in pointers:  # read by the kernel: only a value that never changes is baked in
                host = self.constants(flat, x)
            else:
                host = np.asarray(x) if isinstance(x, np.ndarray | np.generic) else self.cp.asnumpy(x)
            if host is not None:
                compiled.constants[flat] = (x, host)
        self.report.status = "triton"
        self.report.kernel = compiled.kernel.name
        if not self.report.config:
            self.report.config = {"block": compiled.kernel.block, "num_warps": compiled.kernel.num_warps}
        if compiled.parts:
            self.report.kernel = "+".join(part.kernel.name for part in compiled.parts)
            self.report.reason = f"{len(compiled.parts)} kernels for this layout: {kernels[0].template} rows"
        elif compiled.head and self.report.template == "conv":
            self.report.reason = (
                "the convolution runs on cuDNN without its bias; the bias and its epilogue as this kernel"
            )
        elif compiled.head:
            self.report.reason = "the product runs on cuBLAS, its epilogue as this kernel"
        elif compiled.tail:
            self.report.reason = "the norm runs as this kernel, the product after it on cuBLAS"
        if self._rejected:
            note = f"faster tuned configs disagreed with the reference kernels, not used: {self._rejected}"
            self.report.reason = f"{self.report.reason}; {note}" if self.report.reason else note
        return compiled

    def _pieces(self, spec: codegen.GroupSpec, local: dict[int, Any]) -> list[Piece]:
        """The kernels that run a group for this layout: one, or an attention's three parts."""
        if spec.template == "decode_attention":
            try:
                codegen.generate(spec)
                splits = self._kv_splits(spec)
                if splits > 1:
                    return [(piece, [], {}, []) for piece in codegen.attention_split_specs(spec, splits)]
                return [(spec, [], {}, [])]
            except codegen.Unsupported as exc:
                if "query rows" not in str(exc) and "(parts)" not in str(exc):
                    raise
            pieces: list[Piece] = []
            for part, idxs in codegen.attention_parts(spec):
                if part.template == "product":
                    pieces.append((*self._product_spec(part, local, [self.steps[j] for j in idxs]), []))
                else:
                    pieces.append((part, [], {}, []))
            return pieces
        if spec.template == "product":
            return self._product_pieces(spec, local, self.steps)
        if spec.template == "conv":
            return [self._conv_piece(spec, local)]
        return [(spec, [], {}, [])]

    def _conv_piece(self, spec: codegen.GroupSpec, local: dict[int, Any]) -> Piece:
        """A convolution group: cuDNN computes the Conv without its bias (the head step), one
        pointwise kernel adds the bias and runs the epilogue (the activation, a residual add).

        The group's check compares it with the reference steps, which add the bias on cuDNN.
        """
        _, _, b, y = conv_operands(spec)
        if not self.fixed(b):
            raise codegen.Unsupported("a bias that may change between steps: cuDNN adds it")
        kernel, ins, outs, releases = self.steps[0]
        head: list[Step] = [(kernel, ins[:2], outs, releases)]  # the Conv kernel without its bias
        epilogue = self._epilogue_spec(spec, local, 0)
        ndim = len(epilogue.values[y].shape)
        bias = Derived.make(self.cp, (b,), [local[b]], functools.partial(_bias_view, ndim))
        local[CONV_BIAS] = bias.array
        name = spec.nodes[0].name
        fused = conv_epilogue(epilogue, y, tuple(int(d) for d in bias.array.shape), str(bias.array.dtype), name)
        return fused, head, {CONV_BIAS: bias}, []

    def _product_pieces(self, spec: codegen.GroupSpec, local: dict[int, Any], steps: list[Step]) -> list[Piece]:
        """A product group for this layout: one kernel, or (more than 16 rows) cuBLAS between kernels.

        Above 16 rows the product's reference step (cuBLAS) runs; a norm prologue runs
        before it as one row kernel that stores the normalised rows, the epilogue after it
        as one pointwise kernel. With no epilogue, the product step is the norm kernel's tail.
        """
        j = codegen.merged_index(spec)
        j = j if j >= 0 else spec.nodes.index(codegen.product_node(spec))
        if not self._over_rows(spec, j):
            return [(*self._product_spec(spec, local, steps), [])]
        prologue = spec.nodes[:j]
        if not any(n.op in codegen.LOOPED_REDUCTIONS for n in prologue):
            if codegen.merged_index(spec) >= 0 and not spec.nodes[j + 1 :]:
                raise codegen.Unsupported("merged products of more than 16 rows: cuBLAS runs each part")
            return [(self._epilogue_spec(spec, local, j), steps[: j + 1], {}, [])]
        a = spec.nodes[j].inputs[0]
        assert a is not None
        made = {v for n in prologue for v in n.outputs if v is not None}
        reads = [r for n in prologue for r in n.inputs if r is not None and r not in made and r in spec.inputs]
        norm = codegen.GroupSpec(
            "row_reduction", prologue, spec.values, list(dict.fromkeys(reads)), [a], spec.constants
        )
        if spec.nodes[j + 1 :]:
            return [(norm, [], {}, []), (self._epilogue_spec(spec, local, j), steps[j : j + 1], {}, [])]
        return [(norm, [], {}, steps[j : j + 1])]  # the product (cuBLAS) after the norm's kernel

    @staticmethod
    def _over_rows(spec: codegen.GroupSpec, j: int) -> bool:
        """True when product node ``j`` has more rows than the skinny template takes (prefill)."""
        node = spec.nodes[j]
        out = next((v for v in node.outputs if v is not None), None)
        if out is None or out not in spec.values:
            return False
        shape = spec.values[out].shape
        form = str(node.attrs.get("form", "MatMul")) if node.op == "MergedMatMul" else node.op
        rows = (shape[0] if form == "Gemm" else shape[-2]) if len(shape) >= 2 else 1
        return rows > codegen.MAX_PRODUCT_ROWS

    def _kv_splits(self, spec: codegen.GroupSpec) -> int:
        """KV splits of a decode attention: DSP_TRITON_KV_SPLITS, or the shared rule (``attention.kv_split_count``)."""
        return attention.spec_splits(spec, self.cp, int(dsp_config.get("triton_kv_splits")))

    def _product_spec(
        self, spec: codegen.GroupSpec, local: dict[int, Any], steps: list[Step]
    ) -> tuple[codegen.GroupSpec, list[Step], dict[int, Derived]]:
        """A product group as the skinny template takes it, or as cuBLAS plus a fused epilogue.

        A one-row product whose weights are a constant laid out along N reads a copy
        transposed once to [N, K] (each program then streams whole rows of K); the
        original stays for the reference kernels.
        """
        if codegen.merged_index(spec) >= 0:
            return self._merged_spec(spec, local)
        node = codegen.product_node(spec)
        try:
            shape = codegen.product_shape(spec)
        except codegen.Unsupported:
            j = spec.nodes.index(node)
            return self._epilogue_spec(spec, local, j), steps[: j + 1], {}
        b = node.inputs[1]
        assert b is not None
        weight = local.get(b)
        substitutes: dict[int, Derived] = {}
        if (
            shape.body == "kn"
            and not shape.trans_b
            and b in spec.inputs
            and b in self.in_flats
            and self.fixed(b)
            and weight is not None
            and getattr(weight, "ndim", 0) == 2
            and weight.size >= MIN_TRANSPOSED_WEIGHT
        ):
            substitutes[b] = Derived.make(self.cp, (b,), [weight], nk_copy)
            local[b] = substitutes[b].array
            values = dict(spec.values)
            values[b] = codegen.TensorSpec(values[b].shape, values[b].dtype, (1, int(weight.shape[0])))
            spec = _fixed_weight(dataclasses.replace(spec, values=values))
        return spec, [], substitutes

    def _merged_spec(
        self, spec: codegen.GroupSpec, local: dict[int, Any]
    ) -> tuple[codegen.GroupSpec, list[Step], dict[int, Derived]]:
        """Merged sibling products as one product over their weights joined along N, read as [N, K]."""
        node = spec.nodes[codegen.merged_index(spec)]
        weights, biases = codegen.merged_operands(node)
        if any(not self.fixed(w) for w in (*weights, *biases)):
            raise codegen.Unsupported("merged products whose weights are not constants")
        arrays = [local[w] for w in weights]
        if any(getattr(x, "ndim", 0) != 2 or isinstance(x, np.ndarray) for x in arrays):
            raise codegen.Unsupported("merged products of other than device matrices")
        trans_b = bool(node.attrs.get("transB", 0)) and str(node.attrs.get("form", "MatMul")) == "Gemm"
        substitutes = {codegen.MERGED_B: Derived.make(self.cp, weights, arrays, _joined_kn(trans_b))}
        if biases:
            cs = [local[c] for c in biases]
            substitutes[codegen.MERGED_C] = Derived.make(self.cp, biases, cs, joined_bias)
        for syn, derived in substitutes.items():
            local[syn] = derived.array
        bias = substitutes.get(codegen.MERGED_C)
        merged = codegen.merged_spec(spec, None if bias is None else tuple(bias.array.shape))
        return _fixed_weight(merged), [], substitutes

    def _epilogue_spec(self, spec: codegen.GroupSpec, local: dict[int, Any], j: int) -> codegen.GroupSpec:
        """The epilogue of a product cuBLAS runs (node ``j``, after its prologue): a pointwise group."""
        head, tail = spec.nodes[: j + 1], spec.nodes[j + 1 :]
        made = {v for n in head for v in n.outputs if v is not None}
        rest = [o for o in spec.outputs if o not in made]
        if not tail or not rest:
            raise codegen.Unsupported("a product cuBLAS runs, with no epilogue to fuse")
        read = [r for n in tail for r in n.inputs if r is not None and r in made]
        values = dict(spec.values)
        for v in dict.fromkeys(read):
            x = local[v]
            item = x.dtype.itemsize
            strides = tuple(int(st) // item for st in x.strides)
            values[v] = codegen.TensorSpec(tuple(int(d) for d in x.shape), str(x.dtype), strides)
        inputs = [*spec.inputs, *dict.fromkeys(read)]
        return codegen.GroupSpec("pointwise", tail, values, inputs, rest, spec.constants)

    def _settle(self, status: str, reason: str) -> None:
        self.report.status = status
        self.report.reason = reason

    def _build(
        self, kernel: codegen.Kernel, local: dict[int, Any], shapes: dict[int, tuple[tuple[int, ...], Any]]
    ) -> _Compiled:
        inputs = [local[v] for v in kernel.args[: kernel.n_inputs]]
        return FusedGroup._build_kernel(kernel, inputs, self.cp, shapes)

    @staticmethod
    def _build_kernel(
        kernel: codegen.Kernel, inputs: Sequence[Any], cp: Any, shapes: dict[int, tuple[tuple[int, ...], Any]]
    ) -> _Compiled:
        """Load (or compile) ``kernel`` specialised for these inputs and outputs of ``shapes``."""
        pdl = dependent_launch(cp) and kernel.dependent
        if pdl:
            kernel = codegen.with_dependent_launch(kernel)
        # Triton specialises a pointer on its 16-byte alignment; outputs are fresh allocations
        aligned = tuple(int(x.data.ptr) % 16 == 0 for x in inputs) + (True,) * (len(kernel.args) - len(inputs))
        # the arguments' element types: Triton compiles them in, the source may not name them
        dtypes = tuple(str(x.dtype) for x in inputs) + tuple(
            str(np.dtype(shapes[v][1])) for v in kernel.args[len(inputs) :]
        )
        dev = cp.cuda.Device()
        memo_key = (kernel.source, kernel.num_warps, aligned, dtypes, dev.id)
        memo = _BINARIES.get(memo_key)
        if memo is not None:
            return _Compiled(memo, kernel, shapes)
        key = binaries.entry_key(kernel.source, kernel.num_warps, pdl, aligned, str(dev.compute_capability), dtypes)
        store = binaries.CubinCache()
        cubin = store.get(key)
        loaded: binaries.Loaded | binaries.TritonLaunched
        if cubin is not None:  # a warm start: no Triton, no torch
            loaded = binaries.Loaded(cp, cubin)
        else:
            compiled = FusedGroup._triton_compile(kernel, inputs, cp, shapes, pdl)
            cubin = binaries.from_compiled(compiled)
            if cubin is None:
                loaded = binaries.TritonLaunched(compiled)
            else:
                loaded = binaries.Loaded(cp, cubin)
                store.put(key, cubin)
        _BINARIES[memo_key] = loaded  # kept for the process: graphs launch it
        return _Compiled(loaded, kernel, shapes)

    @staticmethod
    def _triton_compile(
        kernel: codegen.Kernel,
        inputs: Sequence[Any],
        cp: Any,
        shapes: dict[int, tuple[tuple[int, ...], Any]],
        pdl: bool,
    ) -> Any:
        """Triton's ``CompiledKernel`` of ``kernel`` for these inputs (Triton's own cache under DSP's)."""
        import importlib.util

        path = cache_root() / "src" / f"{source_key(kernel.source, '', binaries.triton_version())}.py"
        try:
            if not path.exists() or path.read_text() != kernel.source:
                write_checked(path, kernel.source.encode())
        except OSError:
            import tempfile

            path = _tmp_dir(tempfile) / path.name
            path.write_text(kernel.source)
        spec = importlib.util.spec_from_file_location(f"dsp_triton_gen_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, kernel.name)
        args = [_Arg(x) for x in inputs]
        scratch = [cp.empty(shapes[v][0], dtype=shapes[v][1]) for v in kernel.args[kernel.n_inputs :]]
        args += [_Arg(x) for x in scratch]
        with scoped():
            options = {"launch_pdl": True} if pdl else {}
            return fn.warmup(*args, grid=kernel.grid, num_warps=kernel.num_warps, **options)

    def _tune(
        self,
        spec: codegen.GroupSpec,
        first: _Compiled,
        local: dict[int, Any],
        shapes: dict[int, tuple[tuple[int, ...], Any]],
        cached: bool = True,
    ) -> _Compiled:
        """A small config set, timed; the winner cached by source and device (row kernels: none).

        The configs in the order of their times stay in ``self._ranked`` (with the cache's key), so
        that a winner the group's check rejects gives way to the next fastest (``_next_correct``).
        """
        self._ranked: tuple[str, list[tuple[dict[str, int], float | None, _Compiled]]] | None = None
        self._rejected: list[dict[str, int]] = []  # faster configs the group's check refused (tune cache)
        self._retime: Callable[[], Any] | None = None
        if spec.template in ("row_reduction", "decode_attention_combine"):
            return first
        if spec.template == "product":
            configs = codegen.product_configs(codegen.product_shape(spec), preload=bool(spec.params.get("fixed_b")))
        elif spec.template == "decode_attention":
            configs = codegen.attention_configs(spec)
        else:
            numel = max(1, math.prod(spec.values[max(spec.outputs, key=lambda v: spec.values[v].numel)].shape))
            configs = [
                {"block": b} for b in (128, 256, 512, 1024, 2048) if b <= max(128, 1 << (numel - 1).bit_length())
            ]
        if len(configs) <= 1:
            return first

        def build(config: dict[str, int]) -> _Compiled:
            if spec.template in ("product", "decode_attention"):
                return self._build(codegen.generate(spec, config=config), local, shapes)
            return self._build(codegen.generate(spec, block=config["block"]), local, shapes)

        default = configs[0]

        def is_first(config: dict[str, int]) -> bool:
            if spec.template in ("product", "decode_attention"):
                return config == default  # generate's default
            return config["block"] == first.kernel.block

        device = _device_name(self.cp) + ("" if dsp_config.get("triton_tune_flush") else ":warm")
        key = source_key(first.kernel.source, device, binaries.triton_version())
        tunes = TuneCache()
        chosen = tunes.get(key) if cached else None
        if chosen is not None and isinstance(chosen.get("config"), dict) and chosen["config"] in configs:
            self.report.config = dict(chosen["config"])
            best_us = chosen.get("best_us")
            self.report.kernel_us = float(best_us) if isinstance(best_us, int | float) else None
            self._retime = lambda: self._tune(spec, first, local, shapes, cached=False)
            rejected = chosen.get("rejected")
            self._rejected = [dict(c) for c in rejected if isinstance(c, dict)] if isinstance(rejected, list) else []
            return first if is_first(chosen["config"]) else build(chosen["config"])
        times: list[float] = []
        built: list[_Compiled] = []
        tried, configs = configs, []
        for config in tried:
            try:
                one = first if is_first(config) else build(config)
                times.append(self._time(one, local))
            except Exception as exc:  # noqa: BLE001  (a config the device refuses: more shared memory than it has)
                if is_first(config):
                    raise
                log.info("DSP TRITON: group %d: config %s left out: %s", self.report.index, config, exc)
                continue
            configs.append(config)
            built.append(one)
        order = sorted(range(len(configs)), key=lambda k: times[k])
        best = order[0]
        self.report.config, self.report.kernel_us = dict(configs[best]), times[best]
        self._ranked = (key, [(configs[k], times[k], built[k]) for k in order])
        tunes.put(
            key,
            {
                "config": configs[best],
                "best_us": round(times[best], 3),
                "times_us": {",".join(f"{a}={b}" for a, b in c.items()): round(t, 3) for c, t in zip(configs, times)},
            },
        )
        return built[best]

    def _next_correct(
        self, winner: _Compiled, inputs: Sequence[Any], ref_outs: Sequence[Any], bad: str
    ) -> tuple[_Compiled | None, str]:
        """After the fastest config disagreed with the reference: the next fastest that agrees.

        A one-kernel group only (an attention's parts, a KV store written in place: the check
        as it was). The winner from the tune cache is re-timed first, every config in the set.
        The config that passes replaces the cached winner; the ones that failed are named in
        the report's reason. (None, why) when none agrees.
        """
        rejected = [*self._rejected, dict(self.report.config)]
        if self._ranked is None and self._retime is not None:
            self._retime()
        if self._ranked is None:
            return None, bad
        key, ranked = self._ranked
        for config, us, alt in ranked:
            if config in rejected:
                continue
            alt.head, alt.substitutes, alt.tail = winner.head, winner.substitutes, winner.tail
            why = _mismatch(self._launch(alt, inputs), ref_outs, self.tolerance, self.cp)
            if why is None:
                self.report.config, self.report.kernel_us = dict(config), us
                self._rejected = rejected
                tunes = TuneCache()
                tunes.put(key, {**(tunes.get(key) or {}), "config": config, "best_us": us, "rejected": rejected})
                return alt, bad
            rejected.append(dict(config))
        return None, f"{bad} (and with every other config of the {len(ranked)} tuned)"

    def _time(self, compiled: _Compiled, local: dict[int, Any]) -> float:
        """Microseconds per launch, timed as a replayed graph of launches (what a step pays).

        Timing eager launches would time the host: a launch costs more host time than a
        small kernel costs the GPU, so every config would look alike. Each launch follows a
        write of more bytes than the L2 cache holds, as in a decode step where every weight
        is read once: a kernel timed on weights left in L2 by its previous launch would be
        tuned for a cache it never has (the write's own time is measured and taken off).
        ``DSP_TRITON_TUNE_FLUSH=0`` times the launches back to back instead, inputs in L2.
        """
        cp = self.cp
        kernel = compiled.kernel
        ptrs = [int(local[v].data.ptr) for v in kernel.args[: kernel.n_inputs]]
        scratch = compiled.empty_outputs(cp)
        ptrs += [int(x.data.ptr) for x in scratch.values()]
        stream = cp.cuda.Stream(non_blocking=True)
        compiled.launch(ptrs, stream.ptr)
        if not dsp_config.get("triton_tune_flush"):  # inputs left in L2, launches back to back
            try:
                return _graph_us(cp, stream, lambda: compiled.launch(ptrs, stream.ptr))
            except Exception:  # noqa: BLE001  (no graphs here: the eager timing below)
                pass
        flush = _l2_flush(cp)

        def flushed_launch() -> None:
            flush(stream)
            compiled.launch(ptrs, stream.ptr)

        try:
            with_kernel = _graph_us(cp, stream, flushed_launch)
            alone = _graph_us(cp, stream, lambda: flush(stream))
            return max(with_kernel - alone, 0.0)
        except Exception:  # noqa: BLE001  (no graphs here: time eager launches instead)
            begin, end = cp.cuda.Event(), cp.cuda.Event()
            begin.record(stream)
            for _ in range(TUNE_RUNS):
                compiled.launch(ptrs, stream.ptr)
            end.record(stream)
            end.synchronize()
            return float(cp.cuda.get_elapsed_time(begin, end)) * 1000 / TUNE_RUNS


_FLUSH: list[Any] = []


def _l2_flush(cp: Any) -> Callable[[Any], None]:
    """A write of twice the device's L2 cache (at least 64 MiB), as a function of the stream."""
    if not _FLUSH:
        try:
            l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 0))
        except Exception:  # noqa: BLE001
            l2 = 0
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            _FLUSH.append(cp.empty(max(2 * l2, 64 << 20), dtype=cp.uint8))
    buf = _FLUSH[0]

    def flush(stream: Any) -> None:
        cp.cuda.runtime.memsetAsync(int(buf.data.ptr), 0, int(buf.nbytes), stream.ptr)

    return flush


def _graph_us(cp: Any, stream: Any, body: Callable[[], Any]) -> float:
    """Microseconds per ``body()``, from a replayed graph of TUNE_LAUNCHES of them."""
    stream.begin_capture()
    try:
        for _ in range(TUNE_LAUNCHES):
            body()
    finally:
        graph = stream.end_capture()
    graph.launch(stream)
    begin, end = cp.cuda.Event(), cp.cuda.Event()
    begin.record(stream)
    for _ in range(TUNE_RUNS):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return float(cp.cuda.get_elapsed_time(begin, end)) * 1000 / (TUNE_RUNS * TUNE_LAUNCHES)


def _joined_kn(trans_b: bool) -> Callable[[Any, list[Any]], Any]:
    """Merged products' weights as one [K, sum N_i] view of their joined [sum N_i, K] copy."""
    joined = joined_nk(trans_b)
    return lambda cp, weights: joined(cp, weights).T


class _Arg:
    """What Triton's specialisation needs of an argument: a pointer and a dtype."""

    def __init__(self, arr: Any) -> None:
        import torch

        self._ptr = int(arr.data.ptr)
        self.dtype = getattr(torch, _TORCH.get(str(arr.dtype), str(arr.dtype)))

    def data_ptr(self) -> int:
        return self._ptr


_TORCH = {"bool": "bool", "float16": "float16", "float32": "float32", "float64": "float64", "bfloat16": "bfloat16"}


def _tmp_dir(tempfile: Any) -> Any:
    from pathlib import Path

    d = Path(tempfile.gettempdir()) / "dsp-triton-src"
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.cache
def nvrtc_backend() -> Any:
    """dsp-nvrtc's NVRTC_JIT backend, if discovery found it (DSP_DISABLE_PLUGINS honoured) and it is
    available, else None; looked up once per process."""
    try:
        from dsp_core.backends.discovery import discover

        return next((b for b in discover().backends if b.name == "nvrtc_jit" and b.availability().ok), None)
    except Exception:  # noqa: BLE001  (a broken plugin is no fallback)
        return None


def conv_operands(spec: codegen.GroupSpec) -> tuple[int, int, int, int]:
    """A conv group's input, weight, bias and output ids; Unsupported where its kernel cannot add the
    bias (no biased Conv first, or the convolution's own output read outside the group)."""
    node = spec.nodes[0]
    x, w, b = (*node.inputs[:3], None, None, None)[:3]
    y = node.outputs[0] if node.outputs else None
    if node.op != "Conv" or x is None or w is None or b is None or y is None:
        raise codegen.Unsupported("a convolution group that does not start with a biased Conv")
    if y in spec.outputs:
        raise codegen.Unsupported("the convolution's output is read outside its group: cuDNN adds its bias")
    return x, w, b, y


def conv_epilogue(
    epilogue: codegen.GroupSpec, y: int, bias_shape: tuple[int, ...], bias_dtype: str, name: str
) -> codegen.GroupSpec:
    """A convolution's epilogue (``y`` its output without the bias) that first adds the bias
    (``CONV_BIAS``, shaped ``bias_shape`` to broadcast over ``y``): every read of ``y`` reads
    ``CONV_Y``, the sum."""
    out = epilogue.values[y]
    values = dict(epilogue.values)
    values[CONV_BIAS] = codegen.TensorSpec(bias_shape, bias_dtype, (1,) * len(bias_shape))
    values[CONV_Y] = codegen.TensorSpec(out.shape, out.dtype)
    add = codegen.NodeSpec("Add", (y, CONV_BIAS), (CONV_Y,), {}, 14, "", f"{name}/bias")
    tail = [dataclasses.replace(n, inputs=tuple(CONV_Y if i == y else i for i in n.inputs)) for n in epilogue.nodes]
    return dataclasses.replace(epilogue, nodes=[add, *tail], values=values, inputs=[*epilogue.inputs, CONV_BIAS])


def _bias_view(ndim: int, cp: Any, biases: list[Any]) -> Any:
    """A convolution's bias [C] as a contiguous [C, 1, ...] that broadcasts over its [N, C, ...] output."""
    return cp.ascontiguousarray(biases[0]).reshape((-1,) + (1,) * (ndim - 2))


def nvrtc_step(group: FusedGroup) -> Any:
    """dsp-nvrtc's step for a group Triton's templates decline: AUTO's chain per group (Triton, then NVRTC).

    The same reference steps, inputs and outputs; NVRTC's generator takes what it can (rows
    longer than Triton's row template holds, for one) and runs its own check and demotion.
    None where dsp-nvrtc is not there, or the group is not one of its templates.
    """
    if nvrtc_backend() is None:
        return None
    from dsp_cuda_graphs.fusion import GroupReport as NvrtcReport
    from dsp_nvrtc.kernels import NvrtcGroup, NvrtcSource
    from dsp_nvrtc.segment import FUSED_TEMPLATES

    r = group.report
    if r.template not in FUSED_TEMPLATES:
        return None
    return NvrtcGroup(
        NvrtcReport(r.index, r.template, r.slots),
        group.steps,
        group.in_flats,
        group.out_flats,
        group.nodes,
        group.constants,
        group.cp,
        group.capturing,
        group.tolerance,
        NvrtcSource(),
        fixed=group.fixed,
    )


def _fixed_weight(spec: codegen.GroupSpec) -> codegen.GroupSpec:
    """A product group that reads its weights from a Derived copy: made once, outside any graph, and
    complete before the kernel first runs, so its kernel may load them before it waits (a
    constant computed by the segment's own kernels each step is not one: its first replay could
    read it early)."""
    return dataclasses.replace(spec, params={**spec.params, "fixed_b": 1})


_DEPENDENT_LAUNCH: dict[int, bool] = {}


def dependent_launch(cp: Any) -> bool:
    """Whether kernels on the current device launch as programmatic dependents (DSP_TRITON_PDL, sm_90+).

    Read once per device for the process: a kernel's source and its launch must agree (a
    dependent launch of a kernel that does not wait would race), and both are decided here.
    """
    dev = cp.cuda.Device()
    got = _DEPENDENT_LAUNCH.get(dev.id)
    if got is None:
        got = False
        if dsp_config.get("triton_pdl") and int(dev.compute_capability) >= 90:
            got = binaries.has_dependent_launch()
        _DEPENDENT_LAUNCH[dev.id] = got
    return got


_DEVICE_NAMES: dict[int, str] = {}


def _device_name(cp: Any) -> str:
    """The current device's name and capability (a tuning choice's key), once per device and process:
    ``getDeviceProperties`` costs about a millisecond, and a decode block plan asks for every group
    (850 calls, 1 s of an H200 warm start, before this was kept)."""
    dev = cp.cuda.Device()
    got = _DEVICE_NAMES.get(dev.id)
    if got is not None:
        return got
    cc = dev.compute_capability
    try:
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        name = "cuda"
    got = _DEVICE_NAMES[dev.id] = f"{name}:sm{cc}"
    return got


def _mismatch(got: Sequence[Any], want: Sequence[Any], tolerance: float, cp: Any) -> str | None:
    """None when every output agrees within ``tolerance`` (relative to the reference's scale), else why not."""
    return mismatch(got, want, tolerance, cp.asnumpy)


def _poison_kv_rows(kernels: Sequence[codegen.Kernel], local: dict[int, Any], cp: Any) -> list[tuple[Any, Any, Any]]:
    """The rows the kernels' KV stores will write, saved (the reference wrote them) and set to NaN.

    The reference kernels wrote the same buffer in place before the check, so comparing the
    buffer after the kernel with the reference's would compare it with itself.
    """
    poisoned = []
    for kernel in kernels:
        for _, buffer, update, position, axis in kernel.kv_stores:
            buf = local[buffer]
            ax = axis % buf.ndim
            p = int(cp.asnumpy(local[position].reshape(-1)[:1])[0])
            rows = (slice(None),) * ax + (slice(max(p, 0), max(p, 0) + local[update].shape[ax]),)
            poisoned.append((buf, rows, buf[rows].copy()))
            buf[rows] = np.nan if buf.dtype.kind == "f" else 0
    return poisoned


def _kv_rows_mismatch(poisoned: list[tuple[Any, Any, Any]], tolerance: float, cp: Any) -> str | None:
    """None when every poisoned row holds the reference's values again, else why (the rows restored)."""
    for buf, rows, saved in poisoned:
        bad = _mismatch([buf[rows]], [saved], tolerance, cp)
        if bad is not None:
            for b, r, keep in poisoned:
                b[r] = keep
            return f"its KV store wrote other rows than the reference's: {bad}"
    return None


class _SingleOpStep:
    """A step that runs one slot as generated kernels, compiled on first use of each input layout.

    ``_built(key, what, build)`` is the shared part: the compiled kernels of ``key``, or ``build()``
    run outside any capture (a layout first met during a capture fails it) on CuPy's own pool,
    its progress reported; None when ``build`` gave up (the slot's reference runs instead).
    """

    def __init__(self, report: GroupReport, reference: Any, cupy: Any, capturing: Callable[[], bool]) -> None:
        self.report = report
        self.reference = reference
        self.cp = cupy
        self.capturing = capturing
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self.progress: Any = None

    def _settle(self, ok: bool, what: str, why_not: str, kernel: str) -> bool:
        """The check's outcome on the report: the kernel's name, or demoted, loudly, with ``why_not``."""
        if not ok:
            self.report.status, self.report.reason = "demoted", why_not
            warnings.warn(
                f"DSP TRITON: {what} (slot {self.report.slots}) demoted to its reference kernel", stacklevel=3
            )
            return False
        self.report.status, self.report.kernel = "triton", kernel
        return True

    def _built(self, key: tuple[Any, ...], what: str, build: Callable[[], Any]) -> Any:
        got = self.compiled.get(key)
        if got is None:
            if self.capturing():
                raise CaptureFailed(f"{what} during capture")
            with self.cp.cuda.using_allocator(self.cp.get_default_memory_pool().malloc):
                got = build()
            if self.progress is not None:
                self.progress.advance()
            if got is not None:
                self.compiled[key] = got
        return got


class KVStore(_SingleOpStep):
    """The step that runs ``dsp::KVScatter`` as one generated Triton kernel (its reference: 4-5 CuPy kernels).

    Compiled on first use outside a capture for the buffer's layout, and checked once: the
    rows it wrote must equal the update (the reference write then runs too, so a wrong
    kernel is demoted before it can leave a wrong row behind).
    """

    def __init__(
        self, report: GroupReport, reference: Any, axis: int, cupy: Any, capturing: Callable[[], bool]
    ) -> None:
        super().__init__(report, reference, cupy, capturing)
        self.axis = axis

    def __call__(self, buffer: Any, update: Any, position: Any) -> Any:
        host = any(isinstance(x, np.ndarray | np.generic) for x in (buffer, update, position))
        if self.report.status in ("reference", "demoted") or host:
            return self.reference(buffer, update, position)
        key = tuple((x.shape, x.strides, x.dtype.str) for x in (buffer, update, position))
        compiled = self._built(
            key, "a KV store met a new buffer layout", lambda: self._compile(buffer, update, position)
        )
        if compiled is None:
            return self.reference(buffer, update, position)
        compiled.launch(
            [int(buffer.data.ptr), int(update.data.ptr), int(position.data.ptr)], self.cp.cuda.get_current_stream().ptr
        )
        return buffer

    def _compile(self, buffer: Any, update: Any, position: Any) -> _Compiled | None:
        start = time.perf_counter()
        specs = []
        for x in (buffer, update, position):
            item = x.dtype.itemsize
            specs.append(codegen.TensorSpec(tuple(x.shape), str(x.dtype), tuple(int(s) // item for s in x.strides)))
        try:
            kernel = codegen.kv_store(specs[0], specs[1], specs[2], axis=self.axis)
            compiled = FusedGroup._build_kernel(kernel, [buffer, update, position], self.cp, {})
        except Exception as exc:  # noqa: BLE001  (Unsupported, or a compiler error)
            self.report.status, self.report.reason = "reference", f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        cp = self.cp
        compiled.launch(
            [int(buffer.data.ptr), int(update.data.ptr), int(position.data.ptr)], cp.cuda.get_current_stream().ptr
        )
        ax = self.axis % buffer.ndim
        p = int(cp.asnumpy(position.reshape(-1)[:1])[0])
        n = update.shape[ax]
        rows = buffer[(slice(None),) * ax + (slice(p, p + n),)]
        ok = rows.shape == update.shape and bool(cp.all(rows == update.astype(buffer.dtype)))
        self.reference(buffer, update, position)  # the reference write: right rows whatever happened
        self.report.compile_ms += (time.perf_counter() - start) * 1000
        if not self._settle(ok, "KV store", "its kernel wrote other values than the update", kernel.name):
            return None
        return compiled


class GreedyPick(_SingleOpStep):
    """The step that runs a greedy pick as two generated Triton kernels (codegen.argmax_rows).

    ``dsp::Sample`` at temperature 0 (the decode loop's token choice) and ``ArgMax`` over
    the last axis: CuPy's argmax reduces a row in one block, ~100 µs for a 128k vocabulary.
    Compiled on first use outside a capture for the logits' layout, and checked once
    against the reference kernel, exactly (an index is right or wrong); a mismatch demotes
    it to the reference, loudly.
    """

    def __init__(
        self, report: GroupReport, reference: Any, cupy: Any, capturing: Callable[[], bool], layout: PickLayout
    ) -> None:
        super().__init__(report, reference, cupy, capturing)
        self.layout = layout

    def __call__(self, logits: Any, *rest: Any) -> Any:
        if self.report.status in ("reference", "demoted") or not self.layout.takes(logits):
            return self.reference(logits, *rest)
        x = self.layout.rows(logits)
        key = (x.shape, x.strides, x.dtype.str, int(x.data.ptr) % 16)  # Triton specialises on alignment
        pair = self._built(key, "a greedy pick met a new logits layout", lambda: self._compile(logits, x, rest))
        if pair is None:
            return self.reference(logits, *rest)
        return self._launch(pair, x).reshape(self.layout.shape(logits))

    def _launch(self, pair: tuple[_Compiled, _Compiled], x: Any) -> Any:
        cp = self.cp
        first, second = pair
        rows, chunks = x.shape[0], first.kernel.grid[0]
        keys = cp.empty((rows, chunks), dtype=cp.int64)
        pos = cp.empty((rows, chunks), dtype=cp.int64)
        out = cp.empty((rows,), dtype=cp.int64)
        stream = cp.cuda.get_current_stream().ptr
        first.launch([int(x.data.ptr), int(keys.data.ptr), int(pos.data.ptr)], stream)
        second.launch([int(keys.data.ptr), int(pos.data.ptr), int(out.data.ptr)], stream)
        return out

    def _compile(self, logits: Any, x: Any, rest: tuple[Any, ...]) -> tuple[_Compiled, _Compiled] | None:
        start = time.perf_counter()
        cp = self.cp
        item = x.dtype.itemsize
        spec = codegen.TensorSpec(tuple(x.shape), str(x.dtype), tuple(int(s) // item for s in x.strides))
        try:
            k1, k2 = codegen.argmax_rows(spec)
            rows, chunks = x.shape[0], k1.grid[0]
            keys = cp.empty((rows, chunks), dtype=cp.int64)
            first = FusedGroup._build_kernel(
                k1, [x], cp, {1: ((rows, chunks), cp.int64), 2: ((rows, chunks), cp.int64)}
            )
            second = FusedGroup._build_kernel(k2, [keys, keys], cp, {3: ((rows,), cp.int64)})
        except Exception as exc:  # noqa: BLE001  (Unsupported, or a compiler error)
            self.report.status, self.report.reason = "reference", f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        got = self._launch((first, second), x).reshape(self.layout.shape(logits))
        want = self.reference(logits, *rest)
        ok = tuple(got.shape) == tuple(want.shape) and bool(cp.all(got == want))
        self.report.compile_ms += (time.perf_counter() - start) * 1000
        if not self._settle(
            ok, "greedy pick", "its kernels picked another index than the reference", f"{k1.name}+{k2.name}"
        ):
            return None
        return first, second
