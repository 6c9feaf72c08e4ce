"""A fusion group of an NVRTC_JIT segment: its generated CUDA C kernel, compiled, cached, loaded.

``NvrtcGroup`` is dsp-cuda-graphs' ``GroupStep`` (reference steps, the check against them,
demotion) with the NVRTC part: for each new input layout it generates the group's CUDA C
(``codegen.generate``), finds the compiled kernel in the segment cache or compiles it with
NVRTC (a CUBIN for the device's architecture), loads the module with ``cuModuleLoadData``
(CuPy's ``Module.load``) and launches it with raw pointers on the segment's stream. Loaded
modules live as long as the process: a captured graph holds their functions.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dsp_cuda_graphs import attention
from dsp_cuda_graphs.derived import Derived, joined_bias, joined_nk, nk_copy
from dsp_cuda_graphs.device import sm_count
from dsp_cuda_graphs.fusion import MAX_KEYED_ELEMENTS, GroupReport, GroupStep, Step, Unfusable, run_step
from dsp_cuda_graphs.greedy import PickLayout

from dsp_core import config
from dsp_core.backends.base import CaptureFailed
from dsp_core.plan.kernelspec import reference_specs
from dsp_nvrtc import codegen, compiler
from dsp_nvrtc.cache import Entry, JitSegmentCacheKey, PtxBundle, SegmentCache, group_digest
from dsp_nvrtc.launch import dependent_launch, launch

# (source, target, device) -> loaded module, for the process: a graph holds the functions it launches.
log = logging.getLogger("dsp.nvrtc")
_MODULES: dict[tuple[str, str, int], Any] = {}
_modules_lock = threading.Lock()
OPTIONS: tuple[str, ...] = ()  # NVRTC options beyond compiler.OPTIONS (part of the cache key)
VECTOR_ALIGNMENT = 16  # bytes: a weight read 16 bytes a load (codegen.VECTOR_ELEMENTS)


@dataclass
class Built:
    """A loaded kernel and what its launch needs."""

    function: Any  # cupy.cuda.function.Function
    kernel: codegen.Kernel
    shapes: dict[int, tuple[tuple[int, ...], np.dtype[Any]]]  # output value -> (shape, dtype)
    # input flat -> (the array seen at build time, its value): inputs whose values shaped the
    # source (GroupStep checks them before reusing the kernel for another signature)
    constants: dict[int, tuple[Any, np.ndarray]] = field(default_factory=dict)
    # argument -> the array the kernel reads there, made from constant inputs: a product's [K, N]
    # weight as an [N, K] copy (``NvrtcGroup._product_layout``), merged siblings' joined weights
    substitutes: dict[int, Derived] = field(default_factory=dict)
    aligned: tuple[int, ...] = ()  # arguments read 16 bytes a load: their address must stay a multiple of 16
    # an attention layout the one-block kernel declines (prefill): the reference steps before the
    # kernel (the scores product) and after it (the weighted sum); the kernel is the softmax's
    head: list[Step] = field(default_factory=list)
    tail: list[Step] = field(default_factory=list)
    # a split decode attention: the combine kernel after this one (the partials' kernel), which reads
    # the per-range maxima, sums and weighted sums this kernel stores (``codegen.attention_combine``)
    combine: tuple[Any, codegen.Kernel] | None = None
    scratch: dict[int, tuple[tuple[int, ...], np.dtype[Any]]] = field(default_factory=dict)


def device_target(cp: Any) -> compiler.Target:
    """A CUBIN for the current device's architecture (no driver JIT, no PTX version to match)."""
    return compiler.Target(f"sm_{cp.cuda.Device().compute_capability}")


def cache_key(kernel: codegen.Kernel, spec: codegen.GroupSpec, target: compiler.Target) -> JitSegmentCacheKey:
    """The segment cache's key of ``kernel`` compiled for ``target``."""
    major, minor = compiler.version()
    return JitSegmentCacheKey(
        group=group_digest(kernel.device_source()),
        shapes=tuple(spec.values[v].shape for v in kernel.args),
        dtypes=tuple(spec.values[v].dtype for v in kernel.args),
        capability=target.arch,
        options=(*compiler.OPTIONS, *OPTIONS),
        compiler=f"nvrtc {major}.{minor}",
    )


def compiled(
    kernel: codegen.Kernel, spec: codegen.GroupSpec, target: compiler.Target, cache: SegmentCache
) -> tuple[bytes, bool]:
    """The kernel's binary for ``target`` from the cache, or compiled now and stored; (binary, from the cache)."""
    key = cache_key(kernel, spec, target)
    entry = cache.get(key)
    if entry is not None and entry.name == kernel.name and entry.source == kernel.device_source():
        return entry.binary, True
    binary = compiler.compile_source(kernel.device_source(), kernel.name, target, OPTIONS)
    cache.put(key, Entry(kernel.name, kernel.device_source(), binary))
    return binary, False


def load(cp: Any, kernel: codegen.Kernel, binary: bytes, target: compiler.Target) -> Any:
    """The kernel's function from its module, loaded once per device and process (cuModuleLoadData)."""
    key = (kernel.device_source(), target.arch, int(cp.cuda.runtime.getDevice()))
    with _modules_lock:
        module = _MODULES.get(key)
        if module is None:
            module = cp.cuda.function.Module()
            module.load(binary)
            _MODULES[key] = module
    return module.get_function(kernel.name)


# the virtual architectures NVRTC and the driver know (PTX_JIT looks for the newest the device runs)
PTX_ARCHS = (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)


def ptx_archs(capability: int, dependent: bool) -> list[str]:
    """The PTX architectures a device of ``capability`` may load a generated kernel for, newest first.

    PTX of an architecture before 90 has no ``griddepcontrol.wait`` (``DSP_WAIT()`` is compiled out), so
    where kernels launch as programmatic dependents (``dependent``) only PTX of 90 or later is safe.
    """
    return [f"compute_{a}" for a in reversed(PTX_ARCHS) if a <= capability and (a >= 90 or not dependent)]


class NvrtcSource:
    """Where NVRTC_JIT's kernels come from: the segment cache, else NVRTC now (and, with
    ``DSP_NVRTC_EXPORT_PTX``, their PTX written to the bundle PTX_JIT reads)."""

    backend_name = "NVRTC_JIT"

    def __init__(self, cache: SegmentCache | None = None, bundle: PtxBundle | None = None) -> None:
        self.cache = cache if cache is not None else SegmentCache()
        self._bundle = bundle

    def loaded(self, cp: Any, kernel: codegen.Kernel, spec: codegen.GroupSpec) -> tuple[Any, bool]:
        """``kernel`` compiled for the current device (from the segment cache, or compiled and stored)
        and loaded: (its function, whether the binary came from the cache)."""
        target = device_target(cp)
        binary, hit = compiled(kernel, spec, target, self.cache)
        if config.get("nvrtc_export_ptx"):
            arch = f"compute_{cp.cuda.Device().compute_capability}"
            try:
                self.export(kernel, arch)
            except compiler.NvrtcError as exc:  # the kernel itself is fine (its CUBIN is built): say so, go on
                log.warning("DSP NVRTC_JIT: %s not exported to the PTX bundle: %s", kernel.name, exc)
        return load(cp, kernel, binary, target), hit

    def export(self, kernel: codegen.Kernel, arch: str) -> None:
        """``kernel`` compiled to PTX for ``arch`` into the bundle, unless it is there already."""
        bundle = self._bundle if self._bundle is not None else PtxBundle()
        source = kernel.device_source()
        if bundle.get(kernel.name, source, arch) is None:
            bundle.put(kernel.name, source, arch, compiler.compile_source(source, kernel.name, compiler.Target(arch)))


class PtxSource:
    """Where PTX_JIT's kernels come from: the PTX bundle (no NVRTC); a kernel it lacks is Unfusable."""

    backend_name = "PTX_JIT"

    def __init__(self, bundle: PtxBundle | None = None) -> None:
        self.bundle = bundle if bundle is not None else PtxBundle()

    def loaded(self, cp: Any, kernel: codegen.Kernel, spec: codegen.GroupSpec) -> tuple[Any, bool]:
        """``kernel``'s PTX from the bundle, loaded (the driver compiles it for the device): (its function, True)."""
        ptx, arch = self.find(kernel, int(cp.cuda.Device().compute_capability), dependent_launch(cp))
        return load(cp, kernel, ptx, compiler.Target(arch)), True

    def find(self, kernel: codegen.Kernel, capability: int, dependent: bool) -> tuple[bytes, str]:
        """``kernel``'s PTX for a device of ``capability`` and its architecture; Unfusable: the bundle has none."""
        source = kernel.device_source()
        archs = ptx_archs(capability, dependent)
        for arch in archs:
            ptx = self.bundle.get(kernel.name, source, arch)
            if ptx is not None:
                return ptx, arch
        raise Unfusable(
            f"no PTX of its kernel {kernel.name} for {' or '.join(archs) or 'this device'} in the PTX bundle "
            f"{self.bundle.root}: export it with NVRTC_JIT on a machine with NVRTC (DSP_NVRTC_EXPORT_PTX=1, "
            "docs/nvrtc.md)"
        )


KernelSource = NvrtcSource | PtxSource


class NvrtcGroup(GroupStep):
    """The step that runs one fusion group as one generated CUDA C kernel."""

    backend_name = "NVRTC_JIT"

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        nodes: list[codegen.NodeSpec],
        constants: Any,
        cupy: Any,
        capturing: Any,
        tolerance: float,
        source: KernelSource,
        fixed: Callable[[int], bool] = lambda flat: False,
    ) -> None:
        super().__init__(report, steps, in_flats, out_flats, cupy, capturing, tolerance)
        self.nodes = nodes
        self.constants = constants  # (flat, value) -> host copy of a small input that never changes, or None
        self.source = source  # the segment cache and NVRTC, or the PTX bundle
        self.backend_name = source.backend_name
        self.fixed = fixed  # True for an input that never changes between steps (a weight)

    def spec(self, inputs: Sequence[Any], local: dict[int, Any], asked: set[int] | None = None) -> codegen.GroupSpec:
        """The generator's view of this layout (every value's shape and dtype from a reference run);
        ``asked`` collects the values whose contents the generator read."""
        try:
            values, device_inputs = reference_specs(local, self.in_flats, inputs)
        except codegen.Unsupported as exc:
            raise Unfusable(str(exc)) from exc
        return codegen.GroupSpec(
            self.report.template,
            self.nodes,
            values,
            device_inputs,
            list(self.out_flats),
            lambda v: self._asked(v, local, asked),
        )

    def _asked(self, flat: int, local: dict[int, Any], asked: set[int] | None) -> np.ndarray | None:
        got = self.constants(flat, local.get(flat))
        if got is not None and asked is not None:
            asked.add(flat)
        return got

    def _baked(self, kernel: codegen.Kernel, inputs: Sequence[Any], asked: set[int]) -> dict[int, tuple[Any, Any]]:
        """The small inputs whose values the source depends on: those the kernel does not read
        (their values fixed the shapes or were folded in), those whose contents the generator
        read, and, where it read a value computed inside the group, every small input."""
        pointers = set(kernel.args[: kernel.n_inputs])
        inside = any(v not in self.in_flats for v in asked)
        baked: dict[int, tuple[Any, Any]] = {}
        for flat, x in zip(self.in_flats, inputs):
            if x is None or getattr(x, "size", MAX_KEYED_ELEMENTS + 1) > MAX_KEYED_ELEMENTS:
                continue
            if flat in pointers and flat not in asked and not inside:
                continue
            baked[flat] = (x, np.asarray(x) if isinstance(x, np.ndarray | np.generic) else self.cp.asnumpy(x))
        return baked

    def _product_layout(
        self, spec: codegen.GroupSpec, local: dict[int, Any]
    ) -> tuple[codegen.GroupSpec, dict[int, Derived]]:
        """A product whose weight is bigger than one thread per output should loop over: a warp per
        output (``params["lanes"]``), its lanes reading consecutive elements of K, or a whole block
        where K is long and the outputs few (a warp each would leave most of the GPU idle). A
        [K, N] weight is read through a copy laid out [N, K], made once from the constant (the
        original stays for the reference kernels); a Gemm's transposed [N, K] weight as it is."""
        if spec.template != "product":
            return spec, {}
        node = next(n for n in spec.nodes if n.op in codegen.PRODUCT_OPS)
        b = node.inputs[1]
        if b is not None and b in self.in_flats and self.fixed(b):
            # a constant weight: read before the kernel waits for the one before it
            spec = dataclasses.replace(spec, params={**spec.params, "fixed_b": 1})
        if b is None or spec.values[b].numel <= codegen.MAX_PRODUCT_WEIGHTS:
            return spec, {}
        wb = spec.values[b]
        if b not in self.in_flats or not self.fixed(b) or len(wb.shape) != 2:
            raise Unfusable(f"a product's operand of {list(wb.shape)} that is not a constant weight")
        values: dict[int, codegen.TensorSpec] = dict(spec.values)
        subs: dict[int, Derived] = {}
        trans_b = node.op == "Gemm" and int(node.attrs.get("transB", 0)) == 1
        if not trans_b and wb.strides != (1, wb.shape[0]):
            subs[b] = Derived.make(self.cp, (b,), [local[b]], nk_copy)
            values[b] = codegen.TensorSpec(wb.shape, wb.dtype, (1, int(wb.shape[0])))
        k_len = int(wb.shape[1] if trans_b else wb.shape[0])
        out = node.outputs[0]
        outputs = spec.values[out].numel if out is not None else wb.numel // max(1, k_len)
        lanes = codegen.lanes_for(k_len, outputs, wb.dtype, str(config.get("nvrtc_product_lanes")))
        choice, prologue = int(config.get("nvrtc_product_columns")), codegen.has_norm_prologue(spec)
        cols = codegen.columns_for(choice, lanes, outputs, prologue, sm_count(self.cp))
        params = {**spec.params, "lanes": lanes, "cols": cols}
        if b not in subs and int(local[b].data.ptr) % VECTOR_ALIGNMENT:
            params.pop("fixed_b", None)  # a weight read as it is, at an address 16-byte loads cannot take
        return dataclasses.replace(spec, values=values, params=params), subs

    def _merged(
        self, spec: codegen.GroupSpec, local: dict[int, Any]
    ) -> tuple[codegen.Kernel, codegen.GroupSpec, dict[int, Derived]]:
        """Merged siblings (``dsp::MergedMatMul``) as one kernel over their weights joined once into a
        [sum N, K] copy (and their biases into one vector); the constants stay for the reference.
        With a norm prologue (the norm before Q/K/V or gate/up) or a pairwise epilogue (SiLU(gate) x
        up) the kernel computes those too (``codegen.merged_group``)."""
        node = spec.nodes[codegen.merged_index(spec)]
        weights, biases = codegen.merged_operands(node)
        if any(not self.fixed(w) or w not in self.in_flats for w in (*weights, *biases)):
            raise Unfusable("merged products whose weights are not constants")
        trans_b = str(node.attrs.get("form", "MatMul")) == "Gemm" and int(node.attrs.get("transB", 0)) == 1
        subs = {codegen.MERGED_B: Derived.make(self.cp, weights, [local[w] for w in weights], joined_nk(trans_b))}
        if biases:
            subs[codegen.MERGED_C] = Derived.make(self.cp, biases, [local[c] for c in biases], joined_bias)
        joined = {f: _spec_of(d.array) for f, d in subs.items()}
        columns, lanes = int(config.get("nvrtc_product_columns")), str(config.get("nvrtc_product_lanes"))
        kernel, spec = codegen.merged_group(spec, joined, columns, lanes, sm_count(self.cp))
        return kernel, spec, subs

    def _build(self, inputs: Sequence[Any], local: dict[int, Any]) -> Built:
        asked: set[int] = set()
        spec = self.spec(inputs, local, asked)
        try:
            if codegen.merged_index(spec) >= 0:
                kernel, spec, subs = self._merged(spec, local)
            elif spec.template == "decode_attention" and (splits := self._kv_splits(spec)) > 1:
                return self._split_attention(spec, splits, inputs, asked)
            else:
                spec, subs = self._product_layout(spec, local)
                kernel = codegen.generate(spec)
        except codegen.Unsupported as exc:
            if spec.template == "product" and any(n.op in codegen.PROLOGUE_REDUCTIONS for n in spec.nodes):
                return self._parts(spec, inputs, local, asked, str(exc), codegen.prologue_parts, PROLOGUE_PARTS)
            if spec.template != "decode_attention" or "query rows" not in str(exc):
                raise Unfusable(str(exc)) from exc
            return self._parts(spec, inputs, local, asked, str(exc), codegen.attention_parts, ATTENTION_PARTS)
        for v in kernel.args[: kernel.n_inputs]:
            if isinstance(local.get(v), np.ndarray | np.generic):
                raise Unfusable(f"input {v} is a host array")
        function, hit = self.source.loaded(self.cp, kernel, spec)
        self.report.kernel = kernel.name
        self.report.cached = hit
        shapes = {v: (spec.values[v].shape, np.dtype(spec.values[v].dtype)) for v in spec.outputs}
        return Built(function, kernel, shapes, self._baked(kernel, inputs, asked), subs, kernel.vector_args)

    def _kv_splits(self, spec: codegen.GroupSpec) -> int:
        """KV splits of a decode attention's layout: DSP_NVRTC_KV_SPLITS, or the shared rule
        (``attention.kv_split_count``: none up to 256 positions, then about 64 a block)."""
        try:
            q = codegen.attention_values(spec)[3].q
        except codegen.Unsupported:
            return 1
        if spec.values[q].shape[-2:-1] != (1,):
            return 1  # a prompt's query rows: as parts
        return attention.spec_splits(spec, self.cp, int(config.get("nvrtc_kv_splits")))

    def _split_attention(self, spec: codegen.GroupSpec, splits: int, inputs: Sequence[Any], asked: set[int]) -> Built:
        """A decode attention over more KV positions than one block a head should walk: one block per
        (head, range of positions) stores the range's max, sum and weighted sum, then one combine
        kernel per head merges them (``codegen.attention_split_specs``, ``attention_combine``)."""
        partial, combine = codegen.attention_split_specs(spec, splits)
        kernel = codegen.generate(partial)
        last = codegen.attention_combine(combine)
        function, hit = self.source.loaded(self.cp, kernel, partial)
        function2, hit2 = self.source.loaded(self.cp, last, combine)
        self.report.kernel = f"{kernel.name}+{last.name}"
        self.report.cached = hit and hit2
        self.report.reason = f"{partial.params['kv_splits']} ranges of KV positions a head, then their combine"
        shapes = {v: (partial.values[v].shape, np.dtype(partial.values[v].dtype)) for v in spec.outputs}
        built = Built(function, kernel, shapes, self._baked(kernel, inputs, asked))
        built.combine = (function2, last)
        for v in partial.outputs:
            built.scratch[v] = (partial.values[v].shape, np.dtype(partial.values[v].dtype))
        return built

    def _launch_split(self, built: Built, inputs: Sequence[Any]) -> tuple[Any, ...]:
        cp, kernel = self.cp, built.kernel
        assert built.combine is not None
        function2, last = built.combine
        by_flat = dict(zip(self.in_flats, inputs))
        scratch = [cp.empty(*built.scratch[v]) for v in kernel.args[kernel.n_inputs :]]
        launch(
            cp,
            built.function,
            kernel.grid,
            kernel.threads,
            [by_flat[v] for v in kernel.args[: kernel.n_inputs]] + scratch,
        )
        (out,) = self.out_flats
        result = cp.empty(built.shapes[out][0], dtype=built.shapes[out][1])
        launch(cp, function2, last.grid, last.threads, [*scratch, result])
        return (result,)

    def _parts(
        self,
        spec: codegen.GroupSpec,
        inputs: Sequence[Any],
        local: dict[int, Any],
        asked: set[int],
        why: str,
        split: Callable[[codegen.GroupSpec], tuple[list[int], codegen.GroupSpec, list[int]]],
        what: str,
    ) -> Built:
        """A group for a layout its kernel declines (a prompt's rows), as parts: one generated row
        kernel (``split``'s middle spec) between the reference steps of the nodes before and after
        it. A decode-attention group: the scores and the weighted sum on cuBLAS, the scale, mask,
        softmax and casts between them the kernel (``codegen.attention_parts``); a product with
        a norm prologue: the norm the kernel, the product and its epilogue after it
        (``codegen.prologue_parts``)."""
        try:
            head, part, tail = split(spec)
            kernel = codegen.generate(part)
        except codegen.Unsupported as exc:
            raise Unfusable(f"{why}; as parts: {exc}") from exc
        for v in kernel.args[: kernel.n_inputs]:
            if v in self.in_flats and isinstance(local.get(v), np.ndarray | np.generic):
                raise Unfusable(f"input {v} is a host array")
        function, hit = self.source.loaded(self.cp, kernel, part)
        self.report.kernel, self.report.cached = kernel.name, hit
        self.report.reason = f"{why}: {what}"
        shapes = {v: (part.values[v].shape, np.dtype(part.values[v].dtype)) for v in part.outputs}
        built = Built(function, kernel, shapes, self._baked(kernel, inputs, asked))
        built.head, built.tail = [self.steps[j] for j in head], [self.steps[j] for j in tail]
        return built

    def _launch_parts(self, built: Built, inputs: Sequence[Any]) -> tuple[Any, ...]:
        cp, kernel = self.cp, built.kernel
        local: dict[int, Any] = dict(zip(self.in_flats, inputs))
        for step in built.head:
            run_step(step, local)
        outs = {v: cp.empty(built.shapes[v][0], dtype=built.shapes[v][1]) for v in kernel.args[kernel.n_inputs :]}
        args = [cp.ascontiguousarray(local[v]) for v in kernel.args[: kernel.n_inputs]] + list(outs.values())
        launch(cp, built.function, kernel.grid, kernel.threads, args)
        local.update(outs)
        for step in built.tail:
            run_step(step, local)
        return tuple(local[o] for o in self.out_flats)

    def launch(self, built: Built, inputs: Sequence[Any]) -> tuple[Any, ...]:
        if built.head or built.tail:
            return self._launch_parts(built, inputs)
        if built.combine is not None:
            return self._launch_split(built, inputs)
        cp = self.cp
        kernel = built.kernel
        by_flat = dict(zip(self.in_flats, inputs))
        for arg, derived in list(built.substitutes.items()):
            sources = [by_flat[f] for f in derived.sources]
            if derived.moved(sources):  # a weight was given another buffer
                if self.capturing():
                    raise CaptureFailed(f"fusion group {self.report.index}'s weights moved during capture")
                built.substitutes[arg] = derived = Derived.make(cp, derived.sources, sources, derived.build)
            by_flat[arg] = derived.array
        in_place = dict(kernel.kv_stores)  # a KV store's output is its buffer, written through its pointer
        outs = {
            v: by_flat[in_place[v]] if v in in_place else cp.empty(built.shapes[v][0], dtype=built.shapes[v][1])
            for v in kernel.args[kernel.n_inputs :]
        }
        args = [by_flat[v] for v in kernel.args[: kernel.n_inputs]] + [outs[v] for v in kernel.args[kernel.n_inputs :]]
        for v in built.aligned:
            if v not in built.substitutes and int(by_flat[v].data.ptr) % VECTOR_ALIGNMENT:
                raise CaptureFailed(
                    f"fusion group {self.report.index}'s weight moved to an address its 16-byte loads cannot read"
                )
        launch(cp, built.function, kernel.grid, kernel.threads, args)
        return tuple(outs[o] for o in self.out_flats)

    def check(self, built: Built, inputs: Sequence[Any], want: tuple[Any, ...]) -> str | None:
        """A kernel whose KV stores write their buffers in place is checked on zeroed copies of them."""
        if not built.kernel.kv_stores:
            return super().check(built, inputs, want)
        return self.check_in_place(built, inputs, [self.in_flats.index(b) for _, b in built.kernel.kv_stores])


ATTENTION_PARTS = "the products on cuBLAS, the softmax between them as this kernel"
PROLOGUE_PARTS = "the norm as this kernel, the product and its epilogue on their reference kernels after it"


def _spec_of(x: Any) -> codegen.TensorSpec:
    """A device array's spec (element strides), for the segment cache's key."""
    return codegen.TensorSpec(tuple(x.shape), str(x.dtype), tuple(int(st) // x.itemsize for st in x.strides))


@dataclass
class BuiltStore:
    """The KV store's loaded kernel and where its arguments are among the step's inputs."""

    function: Any
    kernel: codegen.Kernel
    update: int  # index into the step's inputs
    position: int
    buffer: int


class NvrtcKVStore(GroupStep):
    """A KV store (``dsp::KVScatter``) as one CUDA C kernel (``codegen.kv_store``), where the
    reference kernel builds the index on the device in three kernels and scatters in a fourth.

    Its output is its buffer, written in place: the first run of each layout checks the kernel
    on two zeroed copies of the buffer, one written by the reference kernel and one by the
    kernel, which must be equal bit for bit (a store moves values: no tolerance).
    """

    backend_name = "NVRTC_JIT"

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        node: codegen.NodeSpec,
        cupy: Any,
        capturing: Any,
        source: KernelSource,
    ) -> None:
        super().__init__(report, steps, in_flats, out_flats, cupy, capturing, 0.0)
        self.node = node
        self.source = source  # the segment cache and NVRTC, or the PTX bundle
        self.backend_name = source.backend_name

    def _build(self, inputs: Sequence[Any], local: dict[int, Any]) -> BuiltStore:
        buffer, update, position = self.node.inputs[:3]
        if buffer is None or update is None or position is None or {buffer, update, position} - set(self.in_flats):
            raise Unfusable("a KV store whose buffer, rows or position is made inside its group")
        try:
            values, device = reference_specs(local, self.in_flats, inputs)
        except codegen.Unsupported as exc:
            raise Unfusable(str(exc)) from exc
        if {buffer, update, position} - set(device):
            raise Unfusable("a KV store with an input on the host")
        try:
            kernel = codegen.kv_store(self.node, values)
        except codegen.Unsupported as exc:
            raise Unfusable(str(exc)) from exc
        spec = codegen.GroupSpec("store", [self.node], values, [update, position], [buffer])
        function, hit = self.source.loaded(self.cp, kernel, spec)
        self.report.kernel, self.report.cached = kernel.name, hit
        where = {flat: k for k, flat in enumerate(self.in_flats)}
        return BuiltStore(function, kernel, where[update], where[position], where[buffer])

    def launch(self, built: BuiltStore, inputs: Sequence[Any]) -> tuple[Any, ...]:
        buffer = inputs[built.buffer]
        args = (inputs[built.update], inputs[built.position], buffer)
        launch(self.cp, built.function, built.kernel.grid, built.kernel.threads, args)
        return (buffer,)

    def check(self, built: BuiltStore, inputs: Sequence[Any], want: tuple[Any, ...]) -> str | None:
        return self.check_in_place(built, inputs, [built.buffer])  # tolerance 0: a store moves values


@dataclass
class BuiltPick:
    """The greedy pick's two loaded kernels (codegen.argmax_rows)."""

    first: Any
    second: Any
    kernels: tuple[codegen.Kernel, codegen.Kernel]
    chunks: int


class NvrtcGreedyPick(GroupStep):
    """A greedy pick (``dsp::Sample`` at temperature 0, ``ArgMax`` over the last axis) as two CUDA C kernels.

    A one-slot group step: the slot's reference kernel (CuPy's argmax, one block a row) is
    its reference steps; the first run of each logits layout builds the two kernels, runs
    them and compares the indexes with the reference's exactly (GroupStep's check: integers
    must be equal), demoting loudly on any difference.
    """

    backend_name = "NVRTC_JIT"

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        layout: PickLayout,
        cupy: Any,
        capturing: Any,
        source: KernelSource,
    ) -> None:
        super().__init__(report, steps, in_flats, out_flats, cupy, capturing, 0.0)
        self.layout = layout
        self.source = source  # the segment cache and NVRTC, or the PTX bundle
        self.backend_name = source.backend_name

    def _build(self, inputs: Sequence[Any], local: dict[int, Any]) -> BuiltPick:
        logits = inputs[0]
        if not self.layout.takes(logits):
            raise Unfusable("logits on the host, or not reduced over their last axis")
        x = self.layout.rows(logits)
        spec = _spec_of(x)
        try:
            k1, k2 = codegen.argmax_rows(spec)
        except codegen.Unsupported as exc:
            raise Unfusable(str(exc)) from exc
        functions, hits = [], []
        for kernel, kspec in zip((k1, k2), codegen.argmax_specs(spec, k1)):
            function, hit = self.source.loaded(self.cp, kernel, kspec)
            functions.append(function)
            hits.append(hit)
        self.report.kernel = f"{k1.name}+{k2.name}"
        self.report.cached = all(hits)
        return BuiltPick(functions[0], functions[1], (k1, k2), k1.grid // x.shape[0])

    def launch(self, built: BuiltPick, inputs: Sequence[Any]) -> tuple[Any, ...]:
        cp = self.cp
        logits = inputs[0]
        x = self.layout.rows(logits)
        rows = x.shape[0]
        keys = cp.empty((rows, built.chunks), dtype=cp.int64)
        pos = cp.empty((rows, built.chunks), dtype=cp.int64)
        out = cp.empty((rows,), dtype=cp.int64)
        k1, k2 = built.kernels
        launch(cp, built.first, k1.grid, k1.threads, (x, keys, pos))
        launch(cp, built.second, k2.grid, k2.threads, (keys, pos, out))
        return (out.reshape(self.layout.shape(logits)),)
