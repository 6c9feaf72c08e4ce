"""CUDA C for one fusion group, from its slots and the concrete shapes of one step.

Pure Python: nothing here needs CUDA, NVRTC or a GPU, so the generator is tested on any
machine (and its output compiled by NVRTC where the ``nvidia-cuda-nvrtc`` wheel is
installed, and run on the host by a C++ compiler: ``HOST_PRELUDE``). A group is described
by a ``GroupSpec`` (its nodes, every value's shape and dtype, the element strides of what
it reads, small constant inputs read on the host); ``generate`` returns one ``extern "C"``
kernel and how to launch it, or raises ``Unsupported`` with the reason (the group then
runs on its reference kernels).

How a kernel is built: every value is computed *at an index* (one C expression per dim).
An output is asked for at the index of the thread that stores it and each op asks its
inputs for the index it needs: an elementwise op the broadcast of its own index, a
transpose the permuted index, a reshape the same flat position in the input's shape, a
slice the shifted one, a gather the row the index tensor names. Reads from outside the
group are loads through the input's real strides. So injective ops cost no kernel: they
are index arithmetic. Shapes, strides and small constants are literals: a kernel is
specialised to one step's layout (a plan is for one shape signature); its parameters are
pointers only. Half-precision values are held as their bits (``unsigned short``) and
computed in float, rounded to their dtype after every op as the reference kernels round:
the generated source needs no CUDA header.

Templates (docs/fusion.md):
- ``pointwise`` and ``copy`` (T1, T5): one thread per element of the iteration space (the
  largest output), 256 threads a block;
- ``row_reduction`` (T2): one block per row of the reduction's input; each reduction stage
  is a loop of the block's threads over the row (fp32 accumulation, a warp-shuffle block
  reduction), then the row-space outputs are stored by a last loop and the outer-space
  outputs (a mean, a max) by thread 0;
- ``decode_attention`` (T4): one block per (batch, head) of a decode step's attention, the
  scores and probabilities in shared memory (``_attention_template``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.plan.kernelspec import ATT_ACC as ATT_ACC
from dsp_core.plan.kernelspec import ATT_L as ATT_L
from dsp_core.plan.kernelspec import ATT_M as ATT_M
from dsp_core.plan.kernelspec import (  # the group spec's types, re-exported: codegen.GroupSpec, ...
    INDEX_OPS,
    ORDERED_KEY_BITS,
    ROW_VALUED_OPS,
    attention_values,
    gather_nd_layout,
    pick_rows,
    row_major,
    value_side,
)
from dsp_core.plan.kernelspec import LAYOUT_OPS as LAYOUT_OPS
from dsp_core.plan.kernelspec import MERGED_B as MERGED_B
from dsp_core.plan.kernelspec import MERGED_C as MERGED_C
from dsp_core.plan.kernelspec import MERGED_Y as MERGED_Y
from dsp_core.plan.kernelspec import GroupSpec as GroupSpec
from dsp_core.plan.kernelspec import NodeSpec as NodeSpec
from dsp_core.plan.kernelspec import TensorSpec as TensorSpec
from dsp_core.plan.kernelspec import Unsupported as Unsupported
from dsp_core.plan.kernelspec import attention_nodes as attention_nodes
from dsp_core.plan.kernelspec import attention_split_specs as attention_split_specs
from dsp_core.plan.kernelspec import kv_store_nodes as kv_store_nodes
from dsp_core.plan.kernelspec import merged_index as merged_index
from dsp_core.plan.kernelspec import merged_operands as merged_operands
from dsp_core.plan.kernelspec import merged_spec as merged_spec

# numpy dtype -> (C storage type, C compute type)
C_TYPES: dict[str, tuple[str, str]] = {
    "float16": ("unsigned short", "float"),
    "bfloat16": ("unsigned short", "float"),
    "float32": ("float", "float"),
    "float64": ("double", "double"),
    "int8": ("signed char", "int"),
    "int16": ("short", "int"),
    "int32": ("int", "int"),
    "int64": ("long long", "long long"),
    "uint8": ("unsigned char", "unsigned int"),
    "uint16": ("unsigned short", "unsigned int"),
    "uint32": ("unsigned int", "unsigned int"),
    "uint64": ("unsigned long long", "unsigned long long"),
    "bool": ("unsigned char", "bool"),
}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
HALF = frozenset({"float16", "bfloat16"})
MAX_ROW = 1 << 20  # rows are looped over, not held in registers: the limit only bounds a block's work
THREADS = 256  # threads per block, both templates
ROW_CACHE_STEPS = 8  # a row of at most this many elements a thread is read once, into registers
ATTENTION_THREADS = 512  # threads of a decode-attention block (one block per head: its latency is the kernel's)
# threads of a split decode attention's block (a range of about 64 positions: many blocks fill the GPU)
SPLIT_ATTENTION_THREADS = 128
ATTENTION_LANES = 8  # lanes per KV position sharing the scores' dot product over the head dim
ATTENTION_ROUNDS = 8  # rounds of K's positions whose loads a decode-attention thread has in flight
ATTENTION_UNROLL = 16  # positions of V whose loads a decode-attention thread has in flight
WARP = 32  # lanes of a warp product's output
MAX_SOURCE_LINES = 4000  # a group whose kernel would be larger runs unfused

# Helpers every kernel may call, for the device (NVRTC) and for the host check (a C++
# compiler running a kernel's blocks one after another, one thread per row block).
DEVICE_PRELUDE = r"""
#define DSP_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float dsp_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short dsp_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float dsp_bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short dsp_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float dsp_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double dsp_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define DSP_LANES(n) (n)  // a product's lanes (a warp, or a block) share one output's dot product
#define DSP_BLOCK(n) (n)  // a block's threads (the templates that fix their block size)
#define DSP_TID threadIdx.x  // a thread's place in a loop the block's threads share (a row)
#define DSP_NTID blockDim.x
// the sum over groups of ``n`` adjacent lanes (n a power of two up to 32; every lane of the warp calls it)
__device__ __forceinline__ float dsp_lanes_sum(float v, int n) {
    for (int o = n >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Programmatic dependent launch (sm_90+): every kernel waits for the kernel before it (its
// completion and memory flush) before it touches memory that kernel may write, then lets the
// next one launch; launched without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DSP_WAIT() \
    asm volatile("griddepcontrol.wait;" ::: "memory"); \
    asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define DSP_WAIT()
#endif
// A row loop's steps: the row's elements per thread (a block's threads share the row)
#define DSP_STEPS(steps, n) (steps)
// 16 bytes of a constant weight, one vector load (its address is a multiple of 16)
struct alignas(16) dsp_v16 { unsigned int w[4]; };
__device__ __forceinline__ float dsp_u2f(unsigned int u) { return __uint_as_float(u); }
// A constant weight's 16 bytes read before the kernel waits for the one before it: a plain global
// load. Through a const __restrict__ pointer it would be a non-coherent (.nc) load, and ptxas
// keeps griddepcontrol.wait above every .nc load: the preload would wait for the kernel before.
__device__ __forceinline__ dsp_v16 dsp_pre16(const void* p) {
    dsp_v16 q;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q.w[0]), "=r"(q.w[1]), "=r"(q.w[2]), "=r"(q.w[3]) : "l"(p));
    return q;
}
// 16 bytes from an address that may not be a multiple of 16: four 4-byte loads, or eight 2-byte ones
template <typename T> __device__ __forceinline__ dsp_v16 dsp_v16_at(const T* p) {
    dsp_v16 q;
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    for (int i = 0; i < 4; ++i) q.w[i] = (unsigned int)h[2 * i] | ((unsigned int)h[2 * i + 1] << 16);
    return q;
}
__device__ __forceinline__ float dsp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float dsp_warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// op 0: sum, 1: max, 2: min, over the block; every thread gets the result.
__device__ float dsp_block_reduce(float v, float* sh, int op) {
    v = op == 0 ? dsp_warp_sum(v) : op == 1 ? dsp_warp_max(v) : dsp_warp_min(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // sh[] may still be read by the previous reduction
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float neutral = op == 0 ? 0.f : op == 1 ? -DSP_INF : DSP_INF;
        float w = threadIdx.x < warps ? sh[threadIdx.x] : neutral;
        w = op == 0 ? dsp_warp_sum(w) : op == 1 ? dsp_warp_max(w) : dsp_warp_min(w);
        if (threadIdx.x == 0) sh[0] = w;
    }
    __syncthreads();
    return sh[0];
}
#define DSP_KEY_MIN (-9223372036854775807LL - 1)
#define DSP_KEY_MAX 9223372036854775807LL
// The greedy pick's (key, index) pair over the block: the largest key, its smallest index.
__device__ __forceinline__ void dsp_pick(long long* k, long long* p, long long k2, long long p2) {
    if (k2 > *k || (k2 == *k && p2 < *p)) { *k = k2; *p = p2; }
}
__device__ void dsp_block_argmax(long long* key, long long* pos, long long* sk, long long* sp) {
    long long k = *key, p = *pos;
    for (int o = 16; o > 0; o >>= 1)
        dsp_pick(&k, &p, __shfl_xor_sync(0xffffffffu, k, o), __shfl_xor_sync(0xffffffffu, p, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) { sk[warp] = k; sp[warp] = p; }
    __syncthreads();
    if (warp == 0) {
        k = threadIdx.x < warps ? sk[threadIdx.x] : DSP_KEY_MIN;
        p = threadIdx.x < warps ? sp[threadIdx.x] : DSP_KEY_MAX;
        for (int o = 16; o > 0; o >>= 1)
            dsp_pick(&k, &p, __shfl_xor_sync(0xffffffffu, k, o), __shfl_xor_sync(0xffffffffu, p, o));
        if (threadIdx.x == 0) { sk[0] = k; sp[0] = p; }
    }
    __syncthreads();
    *key = sk[0];
    *pos = sp[0];
}
"""

HOST_PRELUDE = r"""
#include <math.h>
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __shared__ static
struct dsp_dim3 { unsigned int x, y, z; };
static dsp_dim3 threadIdx, blockIdx, blockDim;
#define DSP_INF INFINITY
static inline float dsp_h2f(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short dsp_f2h(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    memcpy(&h, &x, 2);
    return h;
}
static inline float dsp_bf2f(unsigned short h) {
    unsigned int u = ((unsigned int)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned short dsp_f2bf(float f) {
    unsigned int u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// One lane a product's output: its own sum is the warp's (or the block's).
#define DSP_LANES(n) 1
#define DSP_BLOCK(n) 1
#define DSP_TID 0u  // every host thread walks a shared loop whole (its own value is the block's)
#define DSP_NTID 1u
#define DSP_WAIT()
#define __syncthreads()  // one thread a block: nothing to wait for
#define DSP_STEPS(steps, n) (n)  // one thread walks the whole row
struct alignas(16) dsp_v16 { unsigned int w[4]; };
static inline float dsp_u2f(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline dsp_v16 dsp_pre16(const void* p) { dsp_v16 q; memcpy(&q, p, 16); return q; }
template <typename T> static inline dsp_v16 dsp_v16_at(const T* p) { dsp_v16 q; memcpy(&q, p, 16); return q; }
static inline float dsp_warp_sum(float v) { return v; }
static inline double dsp_warp_sum(double v) { return v; }
static inline float dsp_lanes_sum(float v, int n) { (void)n; return v; }
// One thread a block: its own value is the block's.
static inline float dsp_block_reduce(float v, float* sh, int op) { (void)sh; (void)op; return v; }
#define DSP_KEY_MIN (-9223372036854775807LL - 1)
#define DSP_KEY_MAX 9223372036854775807LL
static inline void dsp_block_argmax(long long* key, long long* pos, long long* sk, long long* sp) {
    (void)key; (void)pos; (void)sk; (void)sp;
}
"""

COMMON_PRELUDE = r"""
__device__ __forceinline__ float dsp_rh(float f) { return dsp_h2f(dsp_f2h(f)); }
__device__ __forceinline__ float dsp_rbf(float f) { return dsp_bf2f(dsp_f2bf(f)); }
"""


@dataclass(frozen=True)
class Kernel:
    """Generated source (without the prelude) and how to launch it."""

    source: str
    name: str
    args: tuple[int, ...]  # value ids, in parameter order: inputs read, then outputs stored
    n_inputs: int
    grid: int  # blocks
    threads: int  # threads per block
    template: str
    vector_args: tuple[int, ...] = ()  # inputs read 16 bytes a load (their addresses: multiples of 16)
    # KV stores the kernel makes (``dsp::KVScatter`` as a store of a row it computes): (output, buffer);
    # the output is the buffer, written in place: its parameter is the buffer's pointer
    kv_stores: tuple[tuple[int, int], ...] = ()

    def device_source(self) -> str:
        """The whole translation unit NVRTC compiles."""
        return DEVICE_PRELUDE + COMMON_PRELUDE + self.source

    def host_source(self) -> str:
        """The same kernel for a host C++ compiler (rows run by one thread each)."""
        return HOST_PRELUDE + COMMON_PRELUDE + self.source


def data_inputs(node: NodeSpec) -> tuple[int, ...]:
    """Which inputs of an op are data (loaded); the rest are shape-like (read on the host)."""
    if node.op in _SHAPE_ARGS:
        return (0,)
    return tuple(k for k, r in enumerate(node.inputs) if r is not None)


@dataclass(frozen=True)
class Idx:
    """An index into a value: one C expression per dim (``"0"`` where the dim is 1 or fixed)."""

    dims: tuple[str, ...]


def _kept(shape: Sequence[int], idx: Idx) -> tuple[str, ...]:
    """The index's expressions of the dims that are not 1 (they decide the position)."""
    return tuple(idx.dims[k] for k, d in enumerate(shape) if d != 1)


class _Scope:
    """Lines of one block of the kernel body, with common subexpressions named once."""

    def __init__(self, indent: str) -> None:
        self.lines: list[str] = []
        self.names: dict[str, str] = {}
        self.memo: dict[tuple[int, tuple[str, ...]], str] = {}
        self.indent = indent


def _is_int(s: str) -> bool:
    return s.lstrip("-").isdigit()


class _Gen:
    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.scope = _Scope("    ")
        self.top = self.scope
        self.count = 0
        self.producer: dict[int, tuple[NodeSpec, int]] = {}
        for node in spec.nodes:
            for k, v in enumerate(node.outputs):
                if v is not None:
                    self.producer[v] = (node, k)
        self.inputs = set(spec.inputs)
        self.args: list[int] = []  # input value ids in parameter order
        self.row: tuple[int, ...] | None = None
        self.row_idx: Idx | None = None
        self.scalars: dict[int, str] = {}  # row template: per-row values (a mean, a max), top-level names
        self.row_recipes: dict[int, Callable[[Idx], str]] = {}  # Softmax/LayerNorm outputs at an index
        # row template, rows of at most ROW_CACHE_STEPS elements a thread: each input read at the
        # row's own index is loaded once, by the first loop over the row, into registers
        # (``row_cache``: input -> its array) that the later loops read
        self.row_steps = 0
        self.row_cache: dict[int, str] = {}
        # product template, ``spec.params["lanes"]`` (a warp's 32, or a block's THREADS) per output:
        # they split K, then sum (0: one thread per output)
        self.lanes = int(spec.params.get("lanes", 0)) if spec.template == "product" else 0
        if self.lanes not in (0, WARP, THREADS):
            raise Unsupported(f"{self.lanes} lanes per output (the template takes {WARP} or {THREADS})")
        # ``spec.params["fixed_b"]``: the product's weight is a constant no kernel writes, so it is
        # read before the kernel waits for the one before it (a dependent launch's overlap)
        self.fixed_b = bool(spec.params.get("fixed_b")) and spec.template == "product"
        self.constant_inputs: set[int] = set()
        self.vector_args: list[int] = []
        self.waited = False
        # values held in a named local at one index (decode attention's scores and probabilities):
        # value -> (the index's non-1 dims, the name)
        self.pinned: dict[int, tuple[tuple[str, ...], str]] = {}
        # product template: a norm's row staged in shared memory by the block (``_norm_prologue``),
        # emitted once, after the weight's preload; value -> the shared array (one row, read at K)
        self.prologue: Callable[[], None] | None = None
        self.staged: dict[int, str] = {}
        # product template, ``spec.params["cols"]``: adjacent output columns one lane group computes
        # (``_columns_template``); value -> its name for the column being stored (any index asked)
        self.cols = int(spec.params.get("cols", 1)) if spec.template == "product" else 1
        self.pinned_any: dict[int, str] = {}

    def wait(self) -> None:
        """``DSP_WAIT()`` once, in the kernel's top scope, before the first statement that touches
        memory the kernel before it may write (a load of an input that is not a constant weight,
        a store). Appended to the top scope now: ahead of the nested block being generated."""
        if not self.waited:
            self.waited = True
            self.top_line("DSP_WAIT();")

    def top_line(self, text: str) -> None:
        """``text`` appended to the kernel's top scope now (ahead of the nested block being generated),
        before any ``#pragma`` that ends it: a pragma stays with its loop."""
        lines = self.top.lines
        at = len(lines)
        while at and lines[at - 1].lstrip().startswith("#pragma"):
            at -= 1
        lines.insert(at, f"{self.top.indent}{text}")

    # -- lines ----------------------------------------------------------------------------
    def let(self, expr: str, ctype: str = "long long", prefix: str = "t") -> str:
        """``expr`` as a named local of the current scope (once per scope)."""
        if expr.isidentifier() or _is_int(expr):
            return expr
        sc = self.scope
        name = sc.names.get(expr)
        if name is None:
            name = f"{prefix}{self.count}"
            self.count += 1
            sc.names[expr] = name
            sc.lines.append(f"{sc.indent}const {ctype} {name} = {expr};")
        return name

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """A nested block (a loop over the row, thread 0's stores) with its own names and values."""
        outer = self.scope
        inner = _Scope(outer.indent + "    ")
        self.scope = inner
        try:
            yield
        finally:
            self.scope = outer
        outer.lines.append(f"{outer.indent}{header} {{")
        outer.lines.extend(inner.lines)
        outer.lines.append(f"{outer.indent}}}")

    def line(self, text: str) -> None:
        self.scope.lines.append(f"{self.scope.indent}{text}")

    # -- indexes --------------------------------------------------------------------------
    def unflatten(self, flat: str, shape: Sequence[int]) -> Idx:
        st = row_major(shape)
        dims: list[str] = []
        for k, d in enumerate(shape):
            if d == 1:
                dims.append("0")
                continue
            expr = flat if st[k] == 1 else f"({flat} / {st[k]})"
            if k > 0 and any(shape[j] != 1 for j in range(k)):
                expr = f"({expr} % {d})"
            dims.append(self.let(expr, prefix="i"))
        return Idx(tuple(dims))

    def flatten(self, idx: Idx, shape: Sequence[int], strides: Sequence[int] | None = None) -> str:
        st = row_major(shape) if strides is None else list(strides)
        terms = [
            d if st[k] == 1 else f"{d} * {st[k]}"
            for k, d in enumerate(idx.dims)
            if shape[k] != 1 and d != "0" and st[k] != 0
        ]
        return self.let(" + ".join(terms), prefix="f") if terms else "0"

    def reshape(self, idx: Idx, out_shape: Sequence[int], in_shape: Sequence[int]) -> Idx:
        """The index into a reshape's input of its output's element at ``idx``.

        The two shapes' dims (1s aside) pair up into runs of equal product; a run of one dim on
        each side passes its expression through, and only a run that merges or splits dims is
        flattened and unflattened, within the run. (Flattening the whole index, as a reshape's
        definition reads, costs a 64-bit division per dim of every load: decode attention's K,
        read through GQA's expand, spent most of its time there.)
        """
        out_nz = [k for k, d in enumerate(out_shape) if d != 1]
        in_nz = [k for k, d in enumerate(in_shape) if d != 1]
        if math.prod(out_shape) != math.prod(in_shape) or 0 in out_shape:
            return self.unflatten(self.flatten(idx, out_shape), in_shape)
        dims = ["0"] * len(in_shape)
        i = j = 0
        while i < len(out_nz) and j < len(in_nz):
            run_out, run_in = [out_nz[i]], [in_nz[j]]
            p_out, p_in = out_shape[out_nz[i]], in_shape[in_nz[j]]
            i, j = i + 1, j + 1
            while p_out != p_in:
                if p_out < p_in:
                    run_out.append(out_nz[i])
                    p_out *= out_shape[out_nz[i]]
                    i += 1
                else:
                    run_in.append(in_nz[j])
                    p_in *= in_shape[in_nz[j]]
                    j += 1
            if len(run_out) == 1 and len(run_in) == 1:
                dims[run_in[0]] = idx.dims[run_out[0]]
                continue
            sub_out = [out_shape[k] for k in run_out]
            flat = self.flatten(Idx(tuple(idx.dims[k] for k in run_out)), sub_out)
            sub = self.unflatten(flat, [in_shape[k] for k in run_in])
            for k, e in zip(run_in, sub.dims):
                dims[k] = e
        return Idx(tuple(dims))

    @staticmethod
    def broadcast(idx: Idx, out_shape: Sequence[int], in_shape: Sequence[int]) -> Idx:
        off = len(out_shape) - len(in_shape)
        if off < 0:
            raise Unsupported(f"broadcast of {list(in_shape)} to the smaller {list(out_shape)}")
        dims = []
        for k, d in enumerate(in_shape):
            o = out_shape[off + k]
            if d == 1:
                dims.append("0")
            elif d == o:
                dims.append(idx.dims[off + k])
            else:
                raise Unsupported(f"shapes {list(in_shape)} and {list(out_shape)} do not broadcast")
        return Idx(tuple(dims))

    # -- values ----------------------------------------------------------------------------
    def ctype(self, v: int) -> str:
        return _c(self.spec.values[v].dtype)[1]

    def value(self, v: int, idx: Idx) -> str:
        """The name (or literal) of value ``v`` at ``idx`` in the current scope, in its compute type."""
        if v in self.scalars:
            return self._scalar_at(v, idx)
        if v in self.staged:
            return f"{self.staged[v]}[{idx.dims[-1]}]"
        if v in self.pinned_any:  # a product's value for the column being stored (_columns_template)
            return self.pinned_any[v]
        paired = int(self.spec.params.get("paired", 0))
        if paired and v in (self.spec.params.get("y0"), self.spec.params.get("y1")):
            # merged siblings of one width (gate, up): a part's column c is the joined product's
            # column c, or c + width for the second (each warp computes both, then the epilogue)
            col = idx.dims[-1] if v == self.spec.params["y0"] else f"({idx.dims[-1]} + {paired})"
            return self.value(MERGED_Y, Idx((*idx.dims[:-1], col)))
        pin = self.pinned.get(v)
        if pin is not None:
            if _kept(self.spec.values[v].shape, idx) != pin[0]:
                raise Unsupported(f"value {v} read at another index than the one the kernel holds it at")
            return pin[1]
        key = (v, idx.dims)
        got = self.scope.memo.get(key)
        if got is None:
            got = self._load(v, idx) if v in self.inputs else self._compute(v, idx)
            self.scope.memo[key] = got
        return got

    def _load(self, v: int, idx: Idx) -> str:
        spec = self.spec.values[v]
        literal = self._literal(v)
        if literal is not None:
            return literal
        if v not in self.args:
            self.args.append(v)
        off = self.flatten(idx, spec.shape, spec.strides)
        # element j of the row (a vector of the row's length read at j, the norm's scale, is too)
        in_row = self.row_steps and self.row_idx is not None and (idx.dims == self.row_idx.dims or off == "j")
        if in_row and v in self.row_cache:
            return f"{self.row_cache[v]}[r]"
        if v not in self.constant_inputs:
            self.wait()
        raw = f"in{self.args.index(v)}[{off}]"
        x = self.let(_from_storage(raw, spec.dtype), self.ctype(v), "x")
        if in_row and self.scope is not self.top:  # the first loop over the row: keep it
            assert self.row is not None
            name = f"rc{self.count}"
            self.count += 1
            self.top_line(f"{self.ctype(v)} {name}[DSP_STEPS({self.row_steps}, {self.row[-1]})];")
            self.line(f"{name}[r] = {x};")
            self.row_cache[v] = name
        return x

    @contextmanager
    def row_loop(self) -> Iterator[None]:
        """A loop of the block's threads over the row, element ``j``: for rows a thread holds in
        registers, ``row_steps`` unrolled steps ``r`` (``j = threadIdx.x + r * blockDim.x``, the
        same in every loop, so the registers of step ``r`` hold element ``j``), else a plain loop."""
        assert self.row is not None
        n = self.row[-1]
        if not self.row_steps:
            with self.block(f"for (long long j = DSP_TID; j < {n}; j += DSP_NTID)"):
                yield
            return
        self.line("#pragma unroll")
        with self.block(f"for (int r = 0; r < DSP_STEPS({self.row_steps}, {n}); ++r)"):
            self.line("const long long j = DSP_TID + (long long)r * DSP_NTID;")
            self.line(f"if (j >= {n}) break;")
            yield

    def _literal(self, v: int) -> str | None:
        """A one-element constant input as a literal of its dtype (no parameter, no load)."""
        spec = self.spec.values[v]
        if spec.numel != 1:
            return None
        got = self.spec.constants(v)
        if got is None:
            return None
        x = np.asarray(got).reshape(-1)[0]
        return _literal_of(x, spec.dtype)

    def _compute(self, v: int, idx: Idx) -> str:
        if v not in self.producer:
            raise Unsupported(f"value {v} is neither read nor computed by the group")
        node, k = self.producer[v]
        out = self.spec.values[v]
        op = node.op
        if op in _ROW_VALUED:
            return self._row_valued(node, v, idx)
        src = node.inputs[0]
        if op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"):
            assert src is not None
            return self.value(src, self.reshape(idx, out.shape, self.spec.values[src].shape))
        if op == "Expand":
            assert src is not None
            return self.value(src, self.broadcast(idx, out.shape, self.spec.values[src].shape))
        if op == "Transpose":
            assert src is not None
            rank = len(out.shape)
            perm = [int(p) for p in node.attrs.get("perm", list(range(rank - 1, -1, -1)))]
            dims = ["0"] * rank
            for j, p in enumerate(perm):
                dims[p] = idx.dims[j]
            return self.value(src, Idx(tuple(dims)))
        if op == "Slice":
            return self._slice(node, idx)
        if op == "Split":
            return self._split(node, k, idx)
        if op == "Concat":
            return self._concat(node, v, idx)
        if op == "Gather":
            return self._gather(node, idx)
        if op == "GatherND":
            return self._gather_nd(node, idx)
        if op in PRODUCT_OPS:
            return self._product(node, v, idx)
        return self._elementwise(node, v, idx)

    # -- the skinny product (T3): one output element per thread, K looped -------------------
    def _product(self, node: NodeSpec, v: int, idx: Idx) -> str:
        """``v`` (a MatMul or Gemm of up to MAX_PRODUCT_ROWS rows) at ``idx``: the dot product over K,
        accumulated in float (double for float64), then rounded to the output's dtype as the
        reference rounds the product's result; the epilogue reads it like any other value."""
        out = self.spec.values[v]
        a, b = node.inputs[0], node.inputs[1]
        if a is None or b is None:
            raise Unsupported(f"a {node.op} without both operands")
        sa, sb = self.spec.values[a].shape, self.spec.values[b].shape
        if len(sb) != 2 or len(sa) < 2 or len(out.shape) != len(sa):
            raise Unsupported(f"a {node.op} of {list(sa)} and {list(sb)} (the template takes [..., M, K] x [K, N])")
        gemm = node.op == "Gemm"
        trans_a = gemm and int(node.attrs.get("transA", 0)) == 1
        trans_b = gemm and int(node.attrs.get("transB", 0)) == 1
        if trans_a:
            raise Unsupported("a Gemm with transA")
        rows = math.prod(out.shape[:-1])
        if rows > MAX_PRODUCT_ROWS:
            raise Unsupported(f"{rows} rows: cuBLAS runs products of more than {MAX_PRODUCT_ROWS}")
        k_len = sa[-1]
        if k_len != (sb[1] if trans_b else sb[0]):
            raise Unsupported(f"operands of {list(sa)} and {list(sb)} do not share K")
        ct = "double" if out.dtype == "float64" else "float"
        acc = f"acc{self.count}"
        kv = f"k{self.count}"
        self.count += 1
        if self.fixed_b:
            self.constant_inputs.add(b)
        if self._vector(b, k_len, trans_b):  # the weight 16 bytes a load: one column of ``multi_dot``
            return self.multi_dot(node, [idx.dims[-1]], idx.dims[:-1])[0]
        self.run_prologue()
        self.line(f"{ct} {acc} = 0;")
        first, step = ("lane", f"DSP_LANES({self.lanes})") if self.lanes else ("0", "1")
        if self.lanes:
            self.line("#pragma unroll 8")  # loads of several K steps in flight per lane
        with self.block(f"for (long long {kv} = {first}; {kv} < {k_len}; {kv} += {step})"):
            xa = self.value(a, Idx((*idx.dims[:-1], kv)))
            xb = self.value(b, Idx((idx.dims[-1], kv) if trans_b else (kv, idx.dims[-1])))
            self.line(f"{acc} += ({ct})({xa}) * ({ct})({xb});")
        return self._dot_result(node, v, acc, idx)

    def _dot_result(self, node: NodeSpec, v: int, acc: str, idx: Idx) -> str:
        """Product ``v``'s value at ``idx`` from this lane's partial sum ``acc``: the lanes' sum (a warp's
        shuffles, or a block's reduction), then rounded to the dtype as the reference rounds it (the
        product, then a Gemm's alpha and bias)."""
        out = self.spec.values[v]
        ct = "double" if out.dtype == "float64" else "float"
        if self.lanes == WARP:
            self.line(f"{acc} = dsp_warp_sum({acc});  // every lane holds the whole dot product")
        elif self.lanes:
            if ct != "float":
                raise Unsupported("a block's lanes per output sum floats only")
            self.line(f"{acc} = dsp_block_reduce({acc}, dsp_red, 0);  // every thread holds the whole dot product")
        expr = acc
        if node.op == "Gemm":
            alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
            if alpha != 1.0:
                expr = f"({ct})({alpha!r}) * {expr}"
            c = node.inputs[2] if len(node.inputs) > 2 else None
            if c is not None and beta != 0.0:
                xc = self.value(c, self.broadcast(idx, out.shape, self.spec.values[c].shape))
                term = f"({ct})({xc})" if beta == 1.0 else f"({ct})({beta!r}) * ({ct})({xc})"
                # the reference rounds the product before the bias where it computes in halves
                expr = f"{_round(expr, out.dtype)} + {term}"
        return self.let(_round(expr, out.dtype), self.ctype(v), "p")

    def _vector(self, b: int, k_len: int, trans_b: bool) -> int:
        """Elements of the weight one 16-byte load reads (0: none): where lanes share an output, the
        weight is a constant read directly, K is its unit stride and both K and the row stride are
        multiples of the vector (every load aligned: the caller checks the weight's address)."""
        wb = self.spec.values[b]
        if not (self.lanes and self.fixed_b and b in self.inputs) or wb.dtype not in VECTOR_ELEMENTS:
            return 0
        if self._literal(b) is not None or wb.strides is None or len(wb.shape) != 2:
            return 0
        k_stride, n_stride = (wb.strides[1], wb.strides[0]) if trans_b else (wb.strides[0], wb.strides[1])
        v = VECTOR_ELEMENTS[wb.dtype]
        return v if k_stride == 1 and n_stride % v == 0 and k_len % v == 0 else 0

    def _a_vector(self, a: int, idx: Idx, v: int, dtype: str) -> tuple[list[str], str] | None:
        """A's ``v`` elements at ``kb`` as 16-byte loads, where A is the norm prologue's row staged in
        shared memory (floats: ``v`` / 4 loads) or an input of the weight's dtype whose K is its unit
        stride and whose rows start at multiples of ``v`` (one load; its address is checked where the
        kernel runs, ``dsp_aok``: a misaligned view takes the element loads); None: element loads.
        Returns the loads (``ra0``, ``ra1``, ...) and element ``j``'s expression."""
        staged = self.staged.get(a)
        if staged is not None:
            if v % 4:
                return None
            loads = [f"*reinterpret_cast<const dsp_v16*>(&{staged}[kb + {4 * h}])" for h in range(v // 4)]
            return loads, "dsp_u2f(ra0.w[j])" if v == 4 else "dsp_u2f((j < 4 ? ra0 : ra1).w[j & 3])"
        sa = self.spec.values[a]
        if a not in self.inputs or sa.dtype != dtype or sa.strides is None or sa.strides[-1] != 1:
            return None
        if self._literal(a) is not None or any(st % v for st, n in zip(sa.strides[:-1], sa.shape[:-1]) if n != 1):
            return None
        if a not in self.args:
            self.args.append(a)
        self.wait()
        row = self.flatten(Idx((*idx.dims[:-1], "0")), sa.shape, sa.strides)
        ptr = f"in{self.args.index(a)}"
        self.top_line(f"const bool dsp_aok = (reinterpret_cast<unsigned long long>({ptr}) & 15) == 0;")
        load = f"*reinterpret_cast<const dsp_v16*>({ptr} + {row} + kb)"
        return [f"dsp_aok ? {load} : dsp_v16_at({ptr} + {row} + kb)"], _vector_element("ra0", "j", dtype)

    def multi_dot(self, node: NodeSpec, cols: list[str], row: tuple[str, ...]) -> list[str]:
        """Product ``node`` (by a constant weight read 16 bytes a load, ``_vector``) at columns ``cols`` of
        the row ``row`` (A's leading index): each lane's first loads of every column's weight into
        registers before the kernel waits for the one before it (their DRAM latency overlaps that
        kernel's work; ``PRELOAD_VECTORS`` shared among the columns), then one loop over K reading A's
        elements once a step for all the columns (the rest of K after the preload: none on the device
        where the preload covers it; on the host check, whose one lane an output preloads only its
        first vectors, the remainder); the lanes' sums, rounded as ``_product`` rounds (the product,
        then a Gemm's bias). The columns' names, in order."""
        a, b = node.inputs[0], node.inputs[1]
        out = node.outputs[0]
        assert a is not None and b is not None and out is not None
        os_ = self.spec.values[out]
        gemm = node.op == "Gemm"
        trans_b = gemm and int(node.attrs.get("transB", 0)) == 1
        k_len = self.spec.values[a].shape[-1]
        v = self._vector(b, k_len, trans_b)
        if not v:
            raise Unsupported("several columns a lane group need the weight read 16 bytes a load")
        wb = self.spec.values[b]
        assert wb.strides is not None
        self.constant_inputs.add(b)
        if b not in self.args:
            self.args.append(b)
        if b not in self.vector_args:
            self.vector_args.append(b)
        ct = "double" if os_.dtype == "float64" else "float"
        lanes = f"DSP_LANES({self.lanes})"
        n_stride = wb.strides[0] if trans_b else wb.strides[1]
        ptr = f"in{self.args.index(b)}"
        per_lane = -(-k_len // (self.lanes * v))
        pre = min(per_lane, max(1, PRELOAD_VECTORS // len(cols)))
        tag = self.count
        self.count += 1
        bases = [self.let(f"{c} * {n_stride}LL", prefix="w") for c in cols]

        def weight(base: str, at: str) -> str:  # 16 bytes of the weight, after the wait
            return f"*reinterpret_cast<const dsp_v16*>({ptr} + {base} + {at})"

        for i, base in enumerate(bases):
            self.line(f"dsp_v16 wq{tag}_{i}[{pre}];")
            self.line("#pragma unroll")
            with self.block(f"for (int it = 0; it < {pre}; ++it)"):
                self.line(f"const long long kb = (lane + it * {lanes}) * {v}LL;")
                self.line(f"if (kb < {k_len}) wq{tag}_{i}[it] = dsp_pre16({ptr} + {base} + kb);")
        self.run_prologue()  # after the preloads: the weights' loads overlap the kernel before
        accs = [f"acc{tag}_{i}" for i in range(len(cols))]
        for acc in accs:
            self.line(f"{ct} {acc} = 0;")
        a_vector = self._a_vector(a, Idx((*row, "0")), v, wb.dtype)

        def step(weights: list[str]) -> None:
            if a_vector is not None:
                loads, elem = a_vector
                for h, load in enumerate(loads):
                    self.line(f"const dsp_v16 ra{h} = {load};")
            self.line("#pragma unroll")
            with self.block(f"for (int j = 0; j < {v}; ++j)"):
                xa = elem if a_vector is not None else self.value(a, Idx((*row, "(kb + j)")))
                xa = self.let(f"({ct})({xa})", ct, "xa")
                for acc, q in zip(accs, weights):
                    self.line(f"{acc} += {xa} * ({ct})({_vector_element(q, 'j', wb.dtype)});")

        # Where the preload does not cover a lane's K (more columns, a longer K), a rolling window:
        # each step refills the registers it used with the vector ``pre`` steps ahead, so ``pre``
        # vectors a column stay in flight to the end (a loop that loaded a step's vectors only after
        # the step before had used its own would wait for DRAM once a step).
        rolled = per_lane if pre < per_lane <= MAX_ROLLED_STEPS else pre
        self.line("#pragma unroll")
        with self.block(f"for (int it = 0; it < {rolled}; ++it)"):
            self.line(f"const long long kb = (lane + it * {lanes}) * {v}LL;")
            slot = "it" if rolled == pre else f"it % {pre}"
            with self.block(f"if (kb < {k_len})"):
                step([f"wq{tag}_{i}[{slot}]" for i in range(len(cols))])
            if rolled > pre:
                with self.block(f"if (it + {pre} < {rolled})"):
                    self.line(f"const long long kn = (lane + (it + {pre}) * {lanes}) * {v}LL;")
                    for i, base in enumerate(bases):
                        self.line(f"if (kn < {k_len}) wq{tag}_{i}[{slot}] = {weight(base, 'kn')};")
        # the rest of K: none on the device; the host check's one lane an output walks it here
        start, stride = f"(lane + {rolled} * {lanes}) * {v}LL", f"{lanes} * {v}LL"
        with self.block(f"for (long long kb = {start}; kb < {k_len}; kb += {stride})"):
            for i, base in enumerate(bases):
                self.line(f"const dsp_v16 q{i} = {weight(base, 'kb')};")
            step([f"q{i}" for i in range(len(cols))])
        return [self._dot_result(node, out, acc, Idx((*row, c))) for acc, c in zip(accs, cols)]

    def run_prologue(self) -> None:
        """The product's norm prologue (``_norm_prologue``), once, where the product's code begins."""
        if self.prologue is not None:
            body, self.prologue = self.prologue, None
            body()

    # -- injective ops -----------------------------------------------------------------------
    def _host(self, node: NodeSpec, k: int) -> list[int]:
        r = node.inputs[k] if k < len(node.inputs) else None
        got = self.spec.constants(r) if r is not None else None
        if got is None:
            raise Unsupported(f"{node.op} input {k} is not a constant: its value changes per step")
        return [int(x) for x in np.asarray(got).reshape(-1)]

    def _slice(self, node: NodeSpec, idx: Idx) -> str:
        src = node.inputs[0]
        assert src is not None
        in_shape = self.spec.values[src].shape
        rank = len(in_shape)
        if node.opset < 10:
            starts, ends = node.attrs.get("starts", []), node.attrs.get("ends", [])
            axes, steps = node.attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
        else:
            starts, ends = self._host(node, 1), self._host(node, 2)
            has = [len(node.inputs) > k and node.inputs[k] is not None for k in (3, 4)]
            axes = self._host(node, 3) if has[0] else list(range(len(starts)))
            steps = self._host(node, 4) if has[1] else [1] * len(starts)
        dims = list(idx.dims)
        for st, en, ax, sp in zip(starts, ends, axes, steps):
            a = int(ax) % rank
            begin, _, step = slice(int(st), int(en), int(sp)).indices(in_shape[a])
            if dims[a] == "0":
                dims[a] = str(begin)
            else:
                expr = dims[a] if step == 1 else f"{dims[a]} * {step}"
                dims[a] = self.let(f"{expr} + {begin}" if begin else expr, prefix="i")
        return self.value(src, Idx(tuple(dims)))

    def _split(self, node: NodeSpec, k: int, idx: Idx) -> str:
        src = node.inputs[0]
        assert src is not None
        axis = int(node.attrs.get("axis", 0)) % len(self.spec.values[src].shape)
        if any(o is None for o in node.outputs[:k]):
            raise Unsupported("Split with an unused output before this one")
        offset = sum(self.spec.values[o].shape[axis] for o in node.outputs[:k] if o is not None)
        dims = list(idx.dims)
        if offset:
            dims[axis] = self.let(f"{dims[axis]} + {offset}", prefix="i")
        return self.value(src, Idx(tuple(dims)))

    def _concat(self, node: NodeSpec, v: int, idx: Idx) -> str:
        out = self.spec.values[v]
        axis = int(node.attrs.get("axis", 0)) % len(out.shape)
        parts: list[tuple[int, int, str]] = []
        offset = 0
        for r in node.inputs:
            if r is None or self.spec.values[r].shape[axis] == 0:
                continue
            size = self.spec.values[r].shape[axis]
            dims = list(idx.dims)
            at = f"{idx.dims[axis]} - {offset}" if offset else idx.dims[axis]
            if parts or size != out.shape[axis]:  # every part is read in bounds; the select picks one
                at = f"dsp_clamp({at}, {size - 1})"
            dims[axis] = self.let(at, prefix="i")
            parts.append((offset, size, self.value(r, Idx(tuple(dims)))))
            offset += size
        expr = parts[-1][2]
        for start, size, name in reversed(parts[:-1]):
            expr = f"({idx.dims[axis]} < {start + size} ? {name} : {expr})"
        return self.let(expr, self.ctype(v), "v")

    def _gather(self, node: NodeSpec, idx: Idx) -> str:
        data, ind = node.inputs[0], node.inputs[1]
        assert data is not None and ind is not None
        d_shape = self.spec.values[data].shape
        n_i = len(self.spec.values[ind].shape)
        axis = int(node.attrs.get("axis", 0)) % len(d_shape)
        pos = self.value(ind, Idx(idx.dims[axis : axis + n_i]))
        at = self._index_in(pos, d_shape[axis])
        return self.value(data, Idx((*idx.dims[:axis], at, *idx.dims[axis + n_i :])))

    def _index_in(self, pos: str, size: int) -> str:
        """An index read from a tensor as a position along a dim of ``size``: negative ones count
        from the end, and it is clamped into the dim (a gathered load never leaves its tensor)."""
        return self.let(
            f"dsp_clamp((long long)({pos}) < 0 ? (long long)({pos}) + {size} : (long long)({pos}), {size - 1})"
        )

    def _gather_nd(self, node: NodeSpec, idx: Idx) -> str:
        """GatherND: the output's leading dims walk ``indices`` (its last axis: the coordinates
        picked from ``data`` after ``batch_dims``), its trailing dims walk the rest of ``data``."""
        data, ind = node.inputs[0], node.inputs[1]
        assert data is not None and ind is not None
        d_shape = self.spec.values[data].shape
        i_shape = self.spec.values[ind].shape
        b = int(node.attrs.get("batch_dims", 0))
        k, m = gather_nd_layout(d_shape, i_shape, b)
        picks = [self._index_in(self.value(ind, Idx((*idx.dims[:m], str(j)))), d_shape[b + j]) for j in range(k)]
        return self.value(data, Idx((*idx.dims[:b], *picks, *idx.dims[m:])))

    # -- elementwise ops ----------------------------------------------------------------------
    def _elementwise(self, node: NodeSpec, v: int, idx: Idx) -> str:
        out = self.spec.values[v]
        if node.op not in _UNARY and node.op not in _BINARY and node.op not in _OTHER:
            raise Unsupported(f"no template for {node.op}")
        args: list[tuple[str, str]] = []  # (name, dtype)
        for k in data_inputs(node):
            r = node.inputs[k]
            if r is None:
                continue
            spec = self.spec.values[r]
            args.append((self.value(r, self.broadcast(idx, out.shape, spec.shape)), spec.dtype))
        expr = _round(self._op_expr(node, out.dtype, args), out.dtype)
        return self.let(expr, self.ctype(v), "v")

    def _op_expr(self, node: NodeSpec, dtype: str, args: list[tuple[str, str]]) -> str:
        op = node.op
        ct = _c(dtype)[1]
        if op in ("Cast", "CastLike"):
            return f"(({args[0][0]}) != 0)" if dtype == "bool" else f"({ct})({args[0][0]})"
        if op in _CMP:
            a, b = args[0][0], args[1][0]
            return f"({a} {_CMP[op]} {b})"
        if op in _LOGIC:
            return f"({args[0][0]} {_LOGIC[op]} {args[1][0]})"
        if op == "Not":
            return f"(!{args[0][0]})"
        if op == "Where":
            return f"({args[0][0]} ? ({ct})({args[1][0]}) : ({ct})({args[2][0]}))"
        if op in ("Max", "Min"):
            acc = f"({ct})({args[0][0]})"
            for other in args[1:]:
                b = f"({ct})({other[0]})"
                acc = f"dsp_{op.lower()}({acc}, {b})"
            return acc
        if op == "Clip":
            return self._clip(node, ct, args)
        if op == "Pow":
            return self._pow(node, dtype, args)
        if op in _BINARY:
            if dtype not in FLOATS and op == "Div":
                raise Unsupported(f"integer {op}")
            a, b = f"({ct})({args[0][0]})", f"({ct})({args[1][0]})"
            if op == "PRelu":
                return f"({a} < 0 ? {a} * {b} : {a})"
            return f"({a} {_BINARY[op]} {b})"
        if op in _UNARY:
            if dtype not in FLOATS and op not in ("Neg", "Abs", "Relu", "Identity", "Sign"):
                raise Unsupported(f"{op} on {dtype}")
            return _UNARY[op](f"({ct})({args[0][0]})", ct, node.attrs)
        raise Unsupported(f"no template for {op}")

    def _clip(self, node: NodeSpec, ct: str, args: list[tuple[str, str]]) -> str:
        x = f"({ct})({args[0][0]})"
        if node.opset >= 11:
            present = [k for k in data_inputs(node) if node.inputs[k] is not None]
            bounds = [args[present.index(k)][0] if k in present else None for k in (1, 2)]
        else:
            lo, hi = node.attrs.get("min"), node.attrs.get("max")
            bounds = [None if b is None else _literal_of(np.float64(b), "float64") for b in (lo, hi)]
        if bounds[0] is not None:
            x = f"dsp_max({x}, ({ct})({bounds[0]}))"
        if bounds[1] is not None:
            x = f"dsp_min({x}, ({ct})({bounds[1]}))"
        return x

    def _pow(self, node: NodeSpec, dtype: str, args: list[tuple[str, str]]) -> str:
        if dtype not in FLOATS:
            raise Unsupported("integer Pow")
        ct = _c(dtype)[1]
        base = f"({ct})({args[0][0]})"
        e = node.inputs[1]
        exp = self.spec.constants(e) if e is not None else None
        if exp is not None and np.asarray(exp).size == 1:
            p = float(np.asarray(exp).reshape(-1)[0])
            special = {2.0: f"({base} * {base})", 1.0: base, 0.5: f"{_fn('sqrt', ct)}({base})"}
            special[3.0] = f"({base} * {base} * {base})"
            if p in special:
                return special[p]
        return f"{_fn('pow', ct)}({base}, ({ct})({args[1][0]}))"

    # -- the row template ---------------------------------------------------------------------
    def _row_valued(self, node: NodeSpec, v: int, idx: Idx) -> str:
        """A Softmax/LayerNorm output at ``idx`` (its own row's index), from its row's scalars."""
        recipe = self.row_recipes.get(v)
        if recipe is None or self.row is None or self.row_idx is None:
            raise Unsupported(f"{node.op} outside a row-reduction group, or read before its row is reduced")
        if _kept(self.spec.values[v].shape, idx) != _kept(self.row, self.row_idx):
            raise Unsupported(f"{node.op}'s output read at another index than its row")
        return self.let(recipe(idx), self.ctype(v), "v")

    def _scalar_at(self, v: int, idx: Idx) -> str:
        assert self.row is not None and self.row_idx is not None
        want = _kept(self.row[:-1], Idx(self.row_idx.dims[:-1]))
        if _kept(self.spec.values[v].shape, idx) != want:
            raise Unsupported("a reduced value read at another row than its own")
        return self.scalars[v]

    def _stage(self, body: Callable[[], str], op: int, dtype: str = "float") -> str:
        """One loop of the block's threads over the row accumulating ``body()``; its block-wide result."""
        acc = f"a{self.count}"
        self.count += 1
        neutral = {0: "0.f", 1: "-DSP_INF", 2: "DSP_INF"}[op]
        self.line(f"float {acc} = {neutral};")
        with self.row_loop():
            x = body()
            step = {0: f"{acc} += {x};", 1: f"{acc} = fmaxf({acc}, {x});", 2: f"{acc} = fminf({acc}, {x});"}[op]
            self.line(step)
        return self.let(f"dsp_block_reduce({acc}, dsp_red, {op})", "float", "s")

    def _reduce(self, node: NodeSpec) -> None:
        assert self.row is not None and self.row_idx is not None
        row_idx = self.row_idx
        src = node.inputs[0]
        assert src is not None
        if tuple(self.spec.values[src].shape) != self.row:
            raise Unsupported(f"{node.op} reduces rows of {list(self.spec.values[src].shape)}, not the group's")
        if self.spec.values[src].dtype not in ("float16", "bfloat16", "float32"):
            raise Unsupported(f"{node.op} over {self.spec.values[src].dtype} (the row template accumulates in fp32)")
        op, out0, n = node.op, node.outputs[0], self.row[-1]

        def xf(idx: Idx = row_idx) -> str:
            return f"(float)({self.value(src, idx)})"

        if op in ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2"):
            body = {
                "ReduceSumSquare": lambda: f"{xf()} * {xf()}",
                "ReduceL2": lambda: f"{xf()} * {xf()}",
                "ReduceL1": lambda: f"fabsf({xf()})",
            }.get(op, xf)
            s = self._stage(body, 0)
            if op == "ReduceMean":
                s = self.let(f"{s} / {float(n)}f", "float", "s")
            if op == "ReduceL2":
                s = self.let(f"sqrtf({s})", "float", "s")
            self._set_scalar(out0, s)
        elif op in ("ReduceMax", "ReduceMin"):
            self._set_scalar(out0, self._stage(xf, 1 if op == "ReduceMax" else 2))
        elif op == "ReduceLogSumExp":
            m = self._stage(xf, 1)
            s = self._stage(lambda: f"expf({xf()} - {m})", 0)
            self._set_scalar(out0, self.let(f"{m} + logf({s})", "float", "s"))
        elif op in ("Softmax", "LogSoftmax"):
            m = self._stage(xf, 1)
            s = self._stage(lambda: f"expf({xf()} - {m})", 0)
            if op == "Softmax":
                self._set_recipe(out0, lambda idx: f"expf({xf(idx)} - {m}) / {s}")
            else:
                self._set_recipe(out0, lambda idx: f"{xf(idx)} - {m} - logf({s})")
        elif op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
            self._norm(node, xf)
        else:
            raise Unsupported(f"no row template for {op}")

    def _norm(self, node: NodeSpec, xf: Callable[..., str]) -> None:
        assert self.row is not None
        op, n, row = node.op, self.row[-1], self.row
        eps = float(node.attrs.get("epsilon", 1e-5))
        if op == "LayerNormalization":
            mean = self.let(f"{self._stage(xf, 0)} / {float(n)}f", "float", "s")
            sq = self._stage(lambda: f"({xf()} - {mean}) * ({xf()} - {mean})", 0)
        else:
            mean = "0.f"
            sq = self._stage(lambda: f"{xf()} * {xf()}", 0)
        inv = self.let(f"1.f / sqrtf({sq} / {float(n)}f + {eps!r}f)", "float", "s")
        weights = [r if k < len(node.inputs) else None for k, r in ((1, _at(node.inputs, 1)), (2, _at(node.inputs, 2)))]
        if op != "LayerNormalization":
            weights[1] = None

        def recipe(idx: Idx) -> str:
            y = f"({xf(idx)} - {mean}) * {inv}" if op == "LayerNormalization" else f"{xf(idx)} * {inv}"
            for j, r in enumerate(weights):
                if r is None:
                    continue
                w = self.value(r, self.broadcast(idx, row, self.spec.values[r].shape))
                y = f"({y}) * (float)({w})" if j == 0 else f"({y}) + (float)({w})"
            return y

        outs = node.outputs
        self._set_recipe(outs[0], recipe)
        if len(outs) > 1:
            self._set_scalar(outs[1], mean)
        if len(outs) > 2:
            self._set_scalar(outs[2], inv)

    def _set_scalar(self, v: int | None, expr: str) -> None:
        if v is not None:
            dtype = self.spec.values[v].dtype
            self.scalars[v] = self.let(_round(f"({self.ctype(v)})({expr})", dtype), self.ctype(v), "s")

    def _set_recipe(self, v: int | None, recipe: Callable[[Idx], str]) -> None:
        if v is not None:
            dtype = self.spec.values[v].dtype
            self.row_recipes[v] = lambda idx: _round(f"({self.ctype(v)})({recipe(idx)})", dtype)


def _at(seq: Sequence[int | None], k: int) -> int | None:
    return seq[k] if k < len(seq) else None


def _c(dtype: str) -> tuple[str, str]:
    got = C_TYPES.get(dtype)
    if got is None:
        raise Unsupported(f"dtype {dtype}")
    return got


def _fn(name: str, ct: str) -> str:
    """The C math function for compute type ``ct`` (``expf`` for float, ``exp`` for double)."""
    return f"{name}f" if ct == "float" else name


# Half dtypes: held as their bits, computed in float. dtype -> (round a float to it, bits to
# float, float to bits), the prelude's helpers.
_HALF_FNS = {"float16": ("dsp_rh", "dsp_h2f", "dsp_f2h"), "bfloat16": ("dsp_rbf", "dsp_bf2f", "dsp_f2bf")}


def _round(expr: str, dtype: str) -> str:
    """``expr`` rounded to ``dtype`` where the compute type is wider (halves), as the reference rounds."""
    return f"{_HALF_FNS[dtype][0]}({expr})" if dtype in _HALF_FNS else expr


def _from_storage(raw: str, dtype: str) -> str:
    if dtype in _HALF_FNS:
        return f"{_HALF_FNS[dtype][1]}({raw})"
    return f"({raw} != 0)" if dtype == "bool" else raw


def _vector_element(q: str, j: str, dtype: str) -> str:
    """Element ``j`` of the 16-byte vector ``q`` (``dsp_v16``) of ``dtype``, in its compute type."""
    if dtype in _HALF_FNS:
        return _from_storage(f"(unsigned short)({q}.w[{j} >> 1] >> (({j} & 1) * 16))", dtype)
    return f"dsp_u2f({q}.w[{j}])"


def _to_storage(name: str, dtype: str) -> str:
    if dtype in _HALF_FNS:
        return f"{_HALF_FNS[dtype][2]}({name})"
    return f"({_c(dtype)[0]})({name})"


def _literal_of(x: Any, dtype: str) -> str:
    """A C literal of value ``x`` in the compute type of ``dtype``."""
    ct = _c(dtype)[1]
    if dtype == "bool":
        return "true" if bool(x) else "false"
    if dtype in FLOATS:
        f = float(x)
        if math.isnan(f):
            return "(0.f / 0.f)" if ct == "float" else "(0.0 / 0.0)"
        if math.isinf(f):
            return "DSP_INF" if f > 0 else "-DSP_INF"
        text = repr(f)
        return f"{text}f" if ct == "float" else text
    i = int(x)
    suffix = "ll" if ct == "long long" else "ull" if ct == "unsigned long long" else ""
    return f"(({ct}){i}{suffix})" if i >= 0 else f"(({ct})({i}{suffix}))"


_CMP = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}
_LOGIC = {"And": "&&", "Or": "||", "Xor": "!="}
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "PRelu": ""}
_ROW_VALUED = ROW_VALUED_OPS
# Ops whose inputs after the first are shape-like (read on the host, never loaded).
_SHAPE_ARGS = frozenset(
    {"Reshape", "Expand", "Squeeze", "Unsqueeze", "Slice", "Split", "Transpose", "Flatten", "Identity"}
) | (_ROW_VALUED - {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"})


def _gelu(x: str, ct: str, attrs: dict[str, Any]) -> str:
    f = "f" if ct == "float" else ""
    if attrs.get("approximate", "none") == "tanh":
        return f"(0.5{f} * {x} * (1.0{f} + tanh{f}(0.7978845608028654{f} * ({x} + 0.044715{f} * {x} * {x} * {x}))))"
    return f"(0.5{f} * {x} * (1.0{f} + erf{f}({x} * 0.7071067811865476{f})))"


def _unary(name: str) -> Callable[[str, str, dict[str, Any]], str]:
    return lambda x, ct, a: f"{_fn(name, ct)}({x})"


_UNARY: dict[str, Callable[[str, str, dict[str, Any]], str]] = {
    "Identity": lambda x, ct, a: x,
    "Neg": lambda x, ct, a: f"(-{x})",
    "Abs": lambda x, ct, a: f"({x} < 0 ? -{x} : {x})",
    "Exp": _unary("exp"),
    "Log": _unary("log"),
    "Sqrt": _unary("sqrt"),
    "Reciprocal": lambda x, ct, a: f"(({ct})1 / {x})",
    "Tanh": _unary("tanh"),
    "Sigmoid": lambda x, ct, a: f"(({ct})1 / (({ct})1 + {_fn('exp', ct)}(-{x})))",
    "Relu": lambda x, ct, a: f"({x} > 0 ? {x} : ({ct})0)",
    "Erf": _unary("erf"),
    "Sin": _unary("sin"),
    "Cos": _unary("cos"),
    "Floor": _unary("floor"),
    "Ceil": _unary("ceil"),
    "Softplus": lambda x, ct, a: f"({x} > ({ct})20 ? {x} : {_fn('log1p', ct)}({_fn('exp', ct)}({x})))",
    "Gelu": _gelu,
    "LeakyRelu": lambda x, ct, a: f"({x} < 0 ? {x} * ({ct}){float(a.get('alpha', 0.01))!r} : {x})",
    "HardSigmoid": lambda x, ct, a: (
        f"dsp_min(dsp_max({x} * ({ct}){float(a.get('alpha', 0.2))!r} + ({ct}){float(a.get('beta', 0.5))!r}, "
        f"({ct})0), ({ct})1)"
    ),
    "Sign": lambda x, ct, a: f"(({ct})(({x} > 0) - ({x} < 0)))",
}
_OTHER = frozenset({"Cast", "CastLike", *_CMP, *_LOGIC, "Not", "Where", "Max", "Min", "Clip", "Pow"})
INJECTIVE_OPS = INDEX_OPS
PRODUCT_OPS = frozenset({"MatMul", "Gemm"})
MAX_PRODUCT_ROWS = 16  # rows of a product the template takes; above, cuBLAS (prefill)
MERGED_OP = ("dsp", "MergedMatMul")  # the core's merged sibling products
PROLOGUE_NORMS = frozenset({"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"})
# what a product's norm prologue reduces: a norm op, or the one reduction of an exported norm's chain
# (the exported RMSNorm: Cast, Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul, Cast)
PROLOGUE_REDUCTIONS = PROLOGUE_NORMS | frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare"})
MAX_PROLOGUE_ROW = 8192  # elements of the row a norm prologue stages in shared memory (32 KB)
ATTENTION_DTYPES = frozenset({"float16", "bfloat16", "float32"})  # operands of decode attention (T4)
MAX_ATTENTION_POSITIONS = 8192  # KV positions of one decode attention: their scores in shared memory (32 KB)
MAX_ATTENTION_DIM = 256  # head dims of q, K and V one decode-attention block takes
VECTOR_ELEMENTS = {"float16": 8, "bfloat16": 8, "float32": 4}  # a 16-byte load of a constant weight
PRELOAD_VECTORS = 16  # of them, per lane, read before the kernel waits (64 registers at most)
MAX_ROLLED_STEPS = 32  # a lane's K steps a product unrolls to keep its preload's window in flight
MAX_PRODUCT_WEIGHTS = (
    1 << 18
)  # weight elements of a product the policy gives the template (above: cuBLAS; see docs/nvrtc.md)
SUPPORTED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | _OTHER | _ROW_VALUED | INJECTIVE_OPS | PRODUCT_OPS
# Ops whose reference kernel is a view on CuPy (no kernel at all): a group of only these
# runs them; inside a bigger group they are index arithmetic.
VIEW_ON_CUPY = frozenset(
    {"Slice", "Transpose", "Expand", "Split", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity"}
)

# Helpers the kernels call, after the type conversions.
_HELPERS = r"""
template <typename T> __device__ __forceinline__ T dsp_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> __device__ __forceinline__ T dsp_min(T a, T b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ long long dsp_clamp(long long i, long long hi) { return i < 0 ? 0 : i > hi ? hi : i; }
"""


def generate(spec: GroupSpec) -> Kernel:
    """The CUDA C kernel for ``spec``, named after its template and a hash of its source.

    Identical groups (the same layer's norm in every layer) share one kernel and one compile.
    """
    kv_nodes = kv_store_nodes(spec)
    if kv_nodes and spec.template not in ("pointwise", "copy") and not (spec.template == "product" and spec.splits):
        raise Unsupported(f"a KV store in a {spec.template} kernel")
    for node in spec.nodes:
        if node in kv_nodes:
            continue
        if node.domain not in ("", "ai.onnx") or node.op not in SUPPORTED_OPS:
            raise Unsupported(f"no template for {node.domain + '::' if node.domain else ''}{node.op}")
    if not spec.outputs:
        raise Unsupported("the group stores nothing")
    for v in spec.outputs:
        _c(spec.values[v].dtype)
        if spec.values[v].numel == 0:
            raise Unsupported("an empty output (nothing to compute; the reference kernels make it)")
    gen = _Gen(spec)
    if spec.template == "row_reduction":
        stores, grid = _row_template(gen, spec)
    elif spec.template in ("pointwise", "copy", "product"):
        stores, grid = _pointwise_template(gen, spec)
    elif spec.template == "decode_attention":
        stores, grid = _attention_template(gen, spec)
    else:
        raise Unsupported(f"no CUDA C template for a {spec.template} group")
    gen.wait()  # a kernel that stored nothing before this point still waits (once, here)
    threads = THREADS
    if spec.template == "decode_attention":
        threads = SPLIT_ATTENTION_THREADS if int(spec.params.get("kv_splits", 1)) > 1 else ATTENTION_THREADS
    body = gen.top.lines
    if len(body) > MAX_SOURCE_LINES:
        raise Unsupported(f"the kernel would have {len(body)} lines")
    params = [f"const {_c(spec.values[v].dtype)[0]}* __restrict__ in{k}" for k, v in enumerate(gen.args)]
    params += [f"{_c(spec.values[v].dtype)[0]}* __restrict__ out{k}" for k, (v, _) in enumerate(stores)]
    source = "\n".join(
        [
            _HELPERS,
            f'extern "C" __global__ void __launch_bounds__({threads}) KERNEL({", ".join(params)}) {{',
            *body,
            "}",
            "",
        ]
    )
    tag = hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
    prefix = {"row_reduction": "row", "copy": "cp", "product": "mm", "decode_attention": "attn"}.get(
        spec.template, "pw"
    )
    name = f"dsp_{prefix}_{tag}"
    source = source.replace(" KERNEL(", f" {name}(", 1)
    args = (*gen.args, *(v for v, _ in stores))
    kv = tuple((int(n.outputs[0]), int(n.inputs[0])) for n in kv_nodes)  # type: ignore[arg-type]
    return Kernel(source, name, tuple(args), len(gen.args), grid, threads, spec.template, tuple(gen.vector_args), kv)


def _store(gen: _Gen, k: int, v: int, idx: Idx) -> None:
    spec = gen.spec.values[v]
    name = gen.value(v, idx)
    off = gen.flatten(idx, spec.shape)
    gen.wait()
    gen.line(f"out{k}[{off}] = {_to_storage(name, spec.dtype)};")


def _kv_store(gen: _Gen, k: int, node: NodeSpec, idx: Idx) -> None:
    """``node``'s update (computed at ``idx``, the update's index) written into its buffer in place,
    through ``out{k}`` (the buffer's pointer), at the device-held position plus the index along the
    axis: a start that is negative counts from the end, a row past the buffer is not written (as
    ``kv_store`` does)."""
    buffer, update, position, ax = _kv_operands(node, gen.spec.values)
    b = gen.spec.values[buffer]
    if position not in gen.inputs or buffer not in gen.inputs or b.strides is None or node.outputs[0] is None:
        raise Unsupported("a KV store whose buffer or position the group computes")
    name = gen.value(update, idx)
    if position not in gen.args:
        gen.args.append(position)
    gen.wait()
    start = gen.let(f"(long long)in{gen.args.index(position)}[0]", prefix="kp")
    at = start if idx.dims[ax] == "0" else f"({idx.dims[ax]} + {start})"
    row = gen.let(f"({at} < 0 ? {at} + {b.shape[ax]} : {at})", prefix="kr")
    dims = tuple(row if j == ax else d for j, d in enumerate(idx.dims))
    strides = [int(st) for st in b.strides]
    terms = [d if strides[j] == 1 else f"{d} * {strides[j]}LL" for j, d in enumerate(dims) if d != "0"]
    off = gen.let(" + ".join(terms), prefix="f") if terms else "0"
    gen.line(f"if ({row} >= 0 && {row} < {b.shape[ax]}) out{k}[{off}] = {_to_storage(name, b.dtype)};")


def _pointwise_template(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], int]:
    if spec.splits:
        return _merged_template(gen, spec)
    kv_nodes = kv_store_nodes(spec)
    if kv_nodes:
        return _store_template(gen, spec, kv_nodes)
    if gen.cols > 1:
        got = _columns_template(gen, spec)
        if got is not None:
            return got
    space = max(spec.outputs, key=lambda v: spec.values[v].numel)
    numel = max(1, spec.values[space].numel)
    staged = _norm_prologue(gen, spec)
    if gen.lanes == THREADS or staged:
        gen.line("__shared__ float dsp_red[32];")
    at = "((long long)blockIdx.x * blockDim.x + threadIdx.x)"
    if gen.lanes:  # a warp (or block) per element returns together: its shuffles and barriers stay whole
        at = f"{at} / DSP_LANES({gen.lanes})"
    live = ""
    if staged:  # every thread stays for the prologue's barriers; one past the end computes the last element
        gen.line(f"const long long dsp_at = {at};")
        gen.line(f"const bool dsp_live = dsp_at < {numel};")
        gen.line(f"const long long lin = dsp_live ? dsp_at : {numel - 1};")
        live = "dsp_live && "
    else:
        gen.line(f"const long long lin = {at};")
    if gen.lanes:
        gen.line(f"const int lane = threadIdx.x % DSP_LANES({gen.lanes});")
    if not staged:
        gen.line(f"if (lin >= {numel}) return;")
    stores: list[tuple[int, Idx]] = []
    for v in spec.outputs:
        oshape = spec.values[v].shape
        size = max(1, math.prod(oshape))
        # A smaller output is stored by the first threads, and again (the same values) by
        # the threads past its size: every index stays in bounds, no store disagrees.
        flat = "lin" if size == numel else gen.let(f"lin % {size}", prefix="i")
        stores.append((v, gen.unflatten(flat, oshape)))
    if gen.lanes or staged:
        # Every lane computes every value (the shuffles and barriers need all of them); lane 0 stores.
        names = [gen.value(v, idx) for v, idx in stores]
        lane0 = "lane == 0" if gen.lanes else ""
        guard = f"{live}{lane0}".removesuffix(" && ")
        for k, ((v, idx), name) in enumerate(zip(stores, names)):
            off = gen.flatten(idx, spec.values[v].shape)
            gen.wait()
            gen.line(f"if ({guard}) out{k}[{off}] = {_to_storage(name, spec.values[v].dtype)};")
        lanes = gen.lanes or 1
        return stores, (numel * lanes + THREADS - 1) // THREADS
    for k, (v, idx) in enumerate(stores):
        _store(gen, k, v, idx)
    return stores, (numel + THREADS - 1) // THREADS


def _column_groups(gen: _Gen, numel: int, staged: bool, cols: int) -> str:
    """The lane group's first element (``numel`` elements, ``cols`` a group). With a norm prologue every
    thread stays for its barriers (a spare group computes the last one again and stores nothing:
    ``dsp_live``); without, a spare group leaves (live is the same for every lane of a group, and a
    block's reduction has the whole block as one group)."""
    groups = numel // cols
    if gen.lanes == THREADS or staged:
        gen.line("__shared__ float dsp_red[32];")
    gen.line(f"const long long dsp_at = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / DSP_LANES({gen.lanes});")
    gen.line(f"const bool dsp_live = dsp_at < {groups};")
    gen.line(f"const long long lin = dsp_live ? dsp_at : {groups - 1};")
    gen.line(f"const int lane = threadIdx.x % DSP_LANES({gen.lanes});")
    if not staged:
        gen.line("if (!dsp_live) return;")
    return "lin" if cols == 1 else gen.let(f"lin * {cols}", prefix="c")


def _columns_template(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], int] | None:
    """A product whose lane group computes ``gen.cols`` adjacent columns of one row (``multi_dot``: A read
    once for all of them), then each column's epilogue and stores, one scope each, the product's value
    pinned for it. The epilogue is over the product's elements in their order (the policy's rule: views
    that keep the flat order, pointwise ops), so output element f is the product's element f. None:
    the layout does not divide into such groups (the one-column template runs)."""
    products = [n for n in spec.nodes if n.op in PRODUCT_OPS]
    if len(products) != 1 or not gen.lanes:
        return None
    node = products[0]
    pv = node.outputs[0]
    assert pv is not None
    paired = int(spec.params.get("paired", 0))
    shape = tuple(spec.values[pv].shape)
    if paired:
        shape = (*shape[:-1], paired)
    numel = max(1, math.prod(shape))
    if shape[-1] % gen.cols or any(spec.values[v].numel != numel for v in spec.outputs):
        return None
    b = node.inputs[1]
    trans_b = node.op == "Gemm" and int(node.attrs.get("transB", 0)) == 1
    if b is None or node.inputs[0] is None or not gen._vector(b, spec.values[node.inputs[0]].shape[-1], trans_b):
        return None
    staged = _norm_prologue(gen, spec)
    base = _column_groups(gen, numel, staged, gen.cols)
    idx = gen.unflatten(base, shape)
    row, c0 = idx.dims[:-1], idx.dims[-1]
    cols = [c0 if i == 0 else f"({c0} + {i})" for i in range(gen.cols)]
    if paired:
        names = gen.multi_dot(node, cols + [f"({c} + {paired})" for c in cols], row)
        pins = [
            {int(spec.params["y0"]): names[i], int(spec.params["y1"]): names[gen.cols + i]} for i in range(gen.cols)
        ]
    else:
        names = gen.multi_dot(node, cols, row)
        pins = [{pv: name} for name in names]
    stores: list[tuple[int, Idx]] = []
    for i, pin in enumerate(pins):
        with gen.block(f"/* column {i} */"):
            gen.pinned_any = pin
            flat = gen.let(f"{base} + {i}", prefix="f")
            for k, v in enumerate(spec.outputs):
                at = gen.unflatten(flat, spec.values[v].shape)
                name = gen.value(v, at)
                off = gen.flatten(at, spec.values[v].shape)
                gen.wait()
                gen.line(f"if (dsp_live && lane == 0) out{k}[{off}] = {_to_storage(name, spec.values[v].dtype)};")
                if i == 0:
                    stores.append((v, at))
            gen.pinned_any = {}
    return stores, (numel // gen.cols * gen.lanes + THREADS - 1) // THREADS


def _merged_template(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], int]:
    """Merged siblings (Q/K/V) as one product over their joined weights (``merged_spec``): a warp (or
    a block) per column of the joined product ``MERGED_Y``, its value stored to the part whose
    columns hold it (``spec.splits``: output -> (offset, width)), after the norm prologue if any."""
    if MERGED_Y not in spec.values or not gen.lanes:
        raise Unsupported("merged products as one product need the joined product's lanes")
    product = next(n for n in spec.nodes if n.op in PRODUCT_OPS)
    kv_nodes = kv_store_nodes(spec)
    for node in spec.nodes[spec.nodes.index(product) + 1 :]:
        if node.op not in LAYOUT_OPS and node not in kv_nodes:
            raise Unsupported(
                "merged products that store their parts take no epilogue but a part's way to its KV store"
            )
    joined = spec.values[MERGED_Y]
    numel = max(1, joined.numel)
    a, b = product.inputs[0], product.inputs[1]
    if gen.cols > 1 and joined.shape[-1] % gen.cols == 0 and a is not None and b is not None:
        if gen._vector(b, spec.values[a].shape[-1], False):
            return _merged_columns(gen, spec, product, numel)
    staged = _norm_prologue(gen, spec)
    idx = gen.unflatten(_column_groups(gen, numel, staged, 1), joined.shape)
    name = gen.value(MERGED_Y, idx)
    stores = _merged_stores(gen, spec, product, idx.dims[:-1], idx.dims[-1], name)
    return stores, (numel * gen.lanes + THREADS - 1) // THREADS


def _merged_stores(
    gen: _Gen, spec: GroupSpec, product: NodeSpec, row: tuple[str, ...], col: str, name: str
) -> list[tuple[int, Idx]]:
    """Column ``col`` of the joined product (its value ``name``) stored to the part whose columns hold it,
    and to what the group makes of that part: a layout (reshape, transpose; its index mapped forward
    from the part's) read outside, or a KV store's row written into its buffer. The outputs in
    parameter order: the stored values, then the KV buffers."""
    at: dict[int, Idx] = {}
    part_of: dict[int, int] = {}
    for v, (offset, _) in spec.splits.items():
        at[v], part_of[v] = Idx((*row, f"({col} - {offset})")), v
    for node in spec.nodes[spec.nodes.index(product) + 1 :]:  # layouts, mapped forward from their part
        src, out = node.inputs[0] if node.inputs else None, node.outputs[0] if node.outputs else None
        if node.op not in LAYOUT_OPS or src not in at or out is None:
            continue
        assert src is not None
        if node.op == "Transpose":
            rank = len(spec.values[out].shape)
            perm = [int(p) for p in node.attrs.get("perm", list(range(rank - 1, -1, -1)))]
            at[out] = Idx(tuple(at[src].dims[p] for p in perm))
        else:
            at[out] = gen.reshape(at[src], spec.values[src].shape, spec.values[out].shape)
        part_of[out] = part_of[src]

    def held(v: int) -> str:  # this lane group's column lies in the part ``v`` comes from
        offset, width = spec.splits[part_of[v]]
        return f"dsp_live && lane == 0 && {col} >= {offset} && {col} < {offset + width}"

    kv_nodes = kv_store_nodes(spec)
    buffers = {n.outputs[0] for n in kv_nodes}
    stores: list[tuple[int, Idx]] = []
    for v in spec.outputs:
        if v in buffers:
            continue
        if v not in at:
            raise Unsupported("a merged product's group stores other than its parts and their layouts")
        off = gen.flatten(at[v], spec.values[v].shape)
        gen.wait()
        gen.line(f"if ({held(v)}) out{len(stores)}[{off}] = {_to_storage(name, spec.values[v].dtype)};")
        stores.append((v, at[v]))
    for node in kv_nodes:
        update, buffer_out = node.inputs[1], node.outputs[0]
        if update is None or update not in at or buffer_out is None:
            raise Unsupported("a KV store of a merged product's value that is not a part or its layout")
        with gen.block(f"if ({held(update)})"):
            gen.pinned_any[update] = name
            _kv_store(gen, len(stores), node, at[update])
            del gen.pinned_any[update]
        stores.append((buffer_out, at[update]))
    return stores


def _merged_columns(gen: _Gen, spec: GroupSpec, product: NodeSpec, numel: int) -> tuple[list[tuple[int, Idx]], int]:
    """``_merged_template`` with ``gen.cols`` adjacent columns of the joined product a lane group (A read
    once for all of them, ``multi_dot``), each column stored to the part that holds it."""
    joined = spec.values[MERGED_Y]
    staged = _norm_prologue(gen, spec)
    base = _column_groups(gen, numel, staged, gen.cols)
    idx = gen.unflatten(base, joined.shape)
    row, c0 = idx.dims[:-1], idx.dims[-1]
    cols = [c0 if i == 0 else gen.let(f"{c0} + {i}", prefix="c") for i in range(gen.cols)]
    names = gen.multi_dot(product, cols, row)
    stores: list[tuple[int, Idx]] = []
    for i, (col, name) in enumerate(zip(cols, names)):
        with gen.block(f"/* column {i} */"):
            got = _merged_stores(gen, spec, product, row, col, name)
        stores = stores or got
    return stores, (numel // gen.cols * gen.lanes + THREADS - 1) // THREADS


def _store_template(gen: _Gen, spec: GroupSpec, kv_nodes: list[NodeSpec]) -> tuple[list[tuple[int, Idx]], int]:
    """A pointwise or copy group whose KV stores write rows it computes: one thread per element of the
    largest of its outputs and rows (the buffers themselves are not iterated), each output and row
    stored at its own index, the rows into their buffers in place."""
    buffers = {int(n.outputs[0]): n for n in kv_nodes}  # type: ignore[arg-type]
    plain = [v for v in spec.outputs if v not in buffers]
    rows = [int(n.inputs[1]) for n in kv_nodes]  # type: ignore[arg-type]
    space = max([*plain, *rows], key=lambda v: spec.values[v].numel)
    numel = max(1, spec.values[space].numel)
    gen.line("const long long lin = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    gen.line(f"if (lin >= {numel}) return;")

    def at(shape: Sequence[int]) -> Idx:
        # A smaller output is stored by the first threads, and again (the same values) by the
        # threads past its size: every index stays in bounds, no store disagrees.
        size = max(1, math.prod(shape))
        return gen.unflatten("lin" if size == numel else gen.let(f"lin % {size}", prefix="i"), shape)

    stores: list[tuple[int, Idx]] = []
    for v in plain:
        idx = at(spec.values[v].shape)
        _store(gen, len(stores), v, idx)
        stores.append((v, idx))
    for buffer_out, node in buffers.items():
        idx = at(spec.values[int(node.inputs[1])].shape)  # type: ignore[arg-type]
        _kv_store(gen, len(stores), node, idx)
        stores.append((buffer_out, idx))
    return stores, (numel + THREADS - 1) // THREADS


def _norm_prologue(gen: _Gen, spec: GroupSpec) -> bool:
    """A product group that begins with a norm of its one row (``NvrtcPolicy._norm_prologue``).

    Every block reduces the row itself (the row template's stages: its threads over the row,
    block-wide sums) and stages the normalised row, rounded as the reference rounds the norm's
    output and through the ops between it and the product, in shared memory; the product reads
    A from there (``_Gen.staged``). The prologue is emitted where the product's code begins,
    after the weight's preload (``_Gen.run_prologue``), so those loads still overlap the kernel
    before. True when the group has one (the caller keeps every thread to the end).
    """
    norms = [n for n in spec.nodes if n.op in _ROW_VALUED]
    if not norms:
        return False
    products = [n for n in spec.nodes if n.op in PRODUCT_OPS]
    if spec.template != "product" or len(products) != 1:
        raise Unsupported("a row-valued op in a pointwise group")
    node, product = norms[0], products[0]
    if len(norms) != 1 or node.op not in PROLOGUE_REDUCTIONS:
        raise Unsupported("a product's prologue computes one norm (LayerNorm, RMSNorm, or an exported chain's mean)")
    if spec.nodes.index(node) > spec.nodes.index(product):
        raise Unsupported("a norm after the product (its epilogue takes pointwise ops only)")
    src, a = node.inputs[0], product.inputs[0]
    if src is None or a is None:
        raise Unsupported("a norm or product without its input")
    row, a_shape = tuple(spec.values[src].shape), tuple(spec.values[a].shape)
    if not row or math.prod(row[:-1]) != 1 or math.prod(a_shape[:-1]) != 1 or a_shape[-1] != row[-1]:
        raise Unsupported("the norm prologue takes one row, reduced over the product's K")
    n = row[-1]
    if not 1 <= n <= MAX_PROLOGUE_ROW:
        raise Unsupported(f"a row of {n} elements (the prologue stages 1 to {MAX_PROLOGUE_ROW})")

    def body() -> None:
        gen.row = row
        gen.row_idx = Idx((*("0" for _ in row[:-1]), "j"))
        gen.row_steps = -(-n // THREADS) if n <= ROW_CACHE_STEPS * THREADS else 0
        gen.line(f"alignas(16) __shared__ float dsp_pro[{n}];  // the norm's row, as the product reads it")
        if gen.row_steps:  # the row and the vectors read with it (a scale, a bias) in registers, loaded at once
            weights = {r for r in product.inputs[1:] if r is not None}
            vectors = [
                v
                for v in spec.inputs
                if v not in weights and spec.values[v].numel == n and spec.values[v].shape[-1] == n
            ]
            with gen.row_loop():
                for v in vectors:
                    gen.value(v, Idx((*("0" for _ in spec.values[v].shape[:-1]), "j")))
        gen._reduce(node)
        with gen.row_loop():
            x = gen.value(a, Idx((*("0" for _ in a_shape[:-1]), "j")))
            gen.line(f"dsp_pro[j] = (float)({x});")
        gen.line("__syncthreads();")
        gen.staged[a] = "dsp_pro"
        gen.row_steps, gen.row_cache = 0, {}

    gen.prologue = body
    return True


def _row_template(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], int]:
    reductions = [n for n in spec.nodes if n.op in _ROW_VALUED]
    src = reductions[0].inputs[0] if reductions else None
    if src is None:
        raise Unsupported("a row-reduction group without its reduction")
    row = tuple(spec.values[src].shape)
    if not row or row[-1] > MAX_ROW or row[-1] == 0:
        raise Unsupported(f"a row of {row[-1] if row else 0} elements (the template takes 1 to {MAX_ROW})")
    gen.row = row
    if row[-1] <= ROW_CACHE_STEPS * THREADS:
        gen.row_steps = -(-row[-1] // THREADS)
    n_rows = math.prod(row[:-1])
    gen.line("__shared__ float dsp_red[32];")
    gen.line("const long long row = blockIdx.x;")
    outer = gen.unflatten("row", row[:-1]) if row[:-1] else Idx(())
    gen.row_idx = Idx((*outer.dims, "j"))
    for node in reductions:  # every stage before the stores: a store reads any stage's result
        gen._reduce(node)
    in_row: list[tuple[int, int]] = []
    in_outer: list[tuple[int, int]] = []
    stores: list[tuple[int, Idx]] = []
    for v in spec.outputs:
        numel = spec.values[v].numel
        if numel == math.prod(row):
            in_row.append((len(stores), v))
            stores.append((v, gen.row_idx))
        elif numel == n_rows:
            in_outer.append((len(stores), v))
            stores.append((v, outer))
        else:
            raise Unsupported(f"an output of {list(spec.values[v].shape)} in a group over rows of {list(row)}")
    if in_row:
        with gen.row_loop():
            for k, v in in_row:
                _store(gen, k, v, gen.reshape(gen.row_idx, row, spec.values[v].shape))
    if in_outer:
        with gen.block("if (threadIdx.x == 0)"):
            for k, v in in_outer:
                _store(gen, k, v, gen.reshape(outer, row[:-1], spec.values[v].shape))
    return stores, n_rows


# -- decode attention (T4): one block per (batch, head) --------------------------------------
def _attention_template(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], int]:
    """Decode attention: one block of ATTENTION_THREADS threads per (batch, head), for one query row.

    q (through its index arithmetic) is read once into shared memory. Phase 1: ATTENTION_LANES
    adjacent lanes per KV position (the block's slots take positions ``l0 + slot``, round after
    round), the lanes splitting the dot product q . K[l] over the head dim (K
    read through the group's index arithmetic: GQA's expand and the transpose cost no copy),
    summed in fp32 and rounded to the scores' dtype as the reference rounds the product; the
    scale and mask (the scores' epilogue) are computed on it and the result kept in shared
    memory. Phase 2: the block's max and sum of exponentials, the probabilities rounded to the
    softmax's dtype, the casts after it; kept in shared memory in place of the scores. Phase 3:
    threads over V's head dim (coalesced), the positions split among groups of them, each
    group's fp32 sums combined through shared memory, rounded to the output's dtype, stored.
    Every value between the products stays in the block: the kernel stores only the weighted
    sum. Positions are the KV buffer's (fixed per plan); the valid ones are the mask's business.
    """
    p1, sm, p2, at_ = attention_values(spec)
    q, k, scores, a, v, out, x_in, probs = at_.q, at_.k, at_.scores, at_.a, at_.v, at_.out, at_.x_in, at_.probs
    sv, ov = spec.values[scores], spec.values[out]
    qv, kv, vv, av = spec.values[q], spec.values[k], spec.values[v], spec.values[a]
    if min(len(qv.shape), len(kv.shape), len(vv.shape), len(av.shape), len(ov.shape)) < 2:
        raise Unsupported("attention over operands of rank below 2")
    if qv.shape[-2] != 1:
        raise Unsupported(f"attention for {qv.shape[-2]} query rows (the decode template takes one)")
    d, length, d2 = qv.shape[-1], kv.shape[-1], vv.shape[-1]
    if kv.shape[-2] != d or vv.shape[-2] != length or av.shape[-1] != length:
        raise Unsupported("attention operands whose sizes do not chain")
    rank = len(spec.values[x_in].shape)
    if int(sm.attrs.get("axis", -1)) % rank != rank - 1:
        raise Unsupported("a softmax over other than the last axis")
    if tuple(spec.values[x_in].shape) != tuple(sv.shape) or tuple(av.shape) != tuple(spec.values[probs].shape):
        raise Unsupported("ops between the products and the softmax change the shape")
    batch = tuple(ov.shape[:-2])
    if tuple(sv.shape[:-2]) != batch or ov.shape[-2] != 1 or ov.shape[-1] != d2:
        raise Unsupported("scores and output of different batch shapes")
    for x in (q, k, v, scores, x_in, probs, a, out):
        if spec.values[x].dtype not in ATTENTION_DTYPES:
            raise Unsupported(f"attention over {spec.values[x].dtype} (the template takes fp16, bf16, fp32)")
    if not (1 <= d <= MAX_ATTENTION_DIM and 1 <= d2 <= MAX_ATTENTION_DIM):
        raise Unsupported(f"head dims {d} and {d2} (the template takes up to {MAX_ATTENTION_DIM})")
    at_value: int | None = a
    while at_value != probs:  # the ops from the probabilities to the weighted sum's operand
        found = gen.producer.get(at_value) if at_value is not None else None
        if found is None or found[0].op not in ("Cast", "CastLike", "Identity"):
            raise Unsupported("ops other than casts between the softmax and the weighted sum")
        at_value = found[0].inputs[0]
    if list(spec.outputs) != [out] and int(spec.params.get("kv_splits", 1)) == 1:
        raise Unsupported("an attention group that stores other than its weighted sum")
    n_split = int(spec.params.get("kv_splits", 1))
    split = n_split > 1
    chunk = -(-length // n_split)  # positions a block takes: all of them, or one range of a split
    if not 1 <= chunk <= MAX_ATTENTION_POSITIONS:
        raise Unsupported(
            f"{chunk} KV positions a block (the template holds 1 to {MAX_ATTENTION_POSITIONS} in shared memory)"
        )
    if split and list(spec.outputs) != [ATT_M, ATT_L, ATT_ACC]:
        raise Unsupported("a split attention's partial kernel stores its partial max, sum and weighted sum")
    if split:  # block (head, range): the range's positions [lo, lo + n_here) of the buffer's
        gen.line(f"const long long bh = (long long)blockIdx.x / {n_split}, sk = (long long)blockIdx.x % {n_split};")
        gen.line(f"const long long lo = sk * {chunk};")
        gen.line(f"const long long n_here = {length} - lo < {chunk} ? {length} - lo : {chunk};")
        head_flat = "bh"
    else:
        gen.line("const long long lo = 0;")
        gen.line(f"const long long n_here = {length};")
        head_flat = "(long long)blockIdx.x"
    bidx = gen.unflatten(head_flat, batch) if batch else Idx(())

    def at(x: int, pair: tuple[str, str]) -> Idx:
        shape = spec.values[x].shape
        head = gen.broadcast(bidx, batch, shape[:-2]) if batch else Idx(tuple("0" for _ in shape[:-2]))
        tail = tuple(e if shape[len(shape) - 2 + j] != 1 else "0" for j, e in enumerate(pair))
        return Idx((*head.dims, *tail))

    if split:
        return _split_attention_body(gen, spec, at, SPLIT_ATTENTION_THREADS, chunk, n_split)
    block = ATTENTION_THREADS
    vw = min(block, _pow2(d2))  # threads over V's head dim; the other groups split the positions
    gen.line("__shared__ float dsp_red[32];")
    gen.line(f"__shared__ float att_q[{d}];")
    gen.line(f"__shared__ float att_x[{chunk}];  // the scores, then the probabilities")
    gen.line(f"__shared__ float att_part[{block // vw * d2}];")
    with gen.block(f"for (long long d = threadIdx.x; d < {d}; d += blockDim.x)"):
        gen.line(f"att_q[d] = (float)({gen.value(q, at(q, ('0', 'd')))});")
    gen.wait()
    gen.line("__syncthreads();")
    # phase 1: the scores and their epilogue, ATTENTION_LANES lanes per position over the head dim
    # (adjacent lanes read adjacent elements of K's row: a warp's load touches a few lines, where
    # a thread per position makes every load of a warp touch 32 lines, each an L1 wavefront);
    # every lane runs the same rounds, so the lanes' shuffle sees the whole warp
    # Every loop's trip count is a constant of the kernel and every load's index is clamped into
    # the buffer (a position past it is weighted zero, not branched around), so the compiler
    # issues a chunk's loads together: a loop that tests its bound between loads waits out one
    # memory latency per load.
    gen.line(f"constexpr int T = DSP_BLOCK({block}), PL = DSP_LANES({ATTENTION_LANES});")
    gen.line(f"constexpr int SLOTS = T / PL, DPL = ({d} + PL - 1) / PL, ROUNDS = ({chunk} + SLOTS - 1) / SLOTS;")
    gen.line(f"constexpr int R = ROUNDS < {ATTENTION_ROUNDS} ? ROUNDS : {ATTENTION_ROUNDS};  // rounds in flight")
    gen.line("const int plane = threadIdx.x % PL, slot = threadIdx.x / PL;")

    def position(expr: str) -> None:  # position ``l`` (its index into ``att_x``) and ``lc``, where it is read
        _position(gen, expr, length)

    with gen.block(f"for (int l0 = 0; l0 < {chunk}; l0 += SLOTS * R)"):
        gen.line("float att_k[R][DPL];")
        gen.line("#pragma unroll")
        with gen.block("for (int r = 0; r < R; ++r)"):
            position("l0 + r * SLOTS + slot")
            gen.line("#pragma unroll")
            with gen.block("for (int j = 0; j < DPL; ++j)"):
                gen.line("const long long d = plane + j * PL;")
                gen.line(f"const long long dc = d < {d} ? d : {d - 1};")
                kx = gen.value(k, at(k, ("dc", "lc")))
                gen.line(f"att_k[r][j] = d < {d} ? att_q[dc] * (float)({kx}) : 0.f;")
        gen.line("#pragma unroll")
        with gen.block("for (int r = 0; r < R; ++r)"):
            position("l0 + r * SLOTS + slot")
            gen.line("float att_s = 0.f;")
            gen.line("#pragma unroll")
            gen.line("for (int j = 0; j < DPL; ++j) att_s += att_k[r][j];")
            xs = _scored(gen, at, scores, x_in)
            gen.line(f"if (l < n_here && plane == 0) att_x[l] = (float)({xs});")
    gen.line("__syncthreads();")
    # phase 2: the softmax over the block's positions (of its range: unnormalised, against the
    # range's own max, which the combine kernel rescales), then the casts before the weighted sum
    gen.line("float mx = -DSP_INF;")
    with gen.block("for (long long l = threadIdx.x; l < n_here; l += blockDim.x)"):
        gen.line("mx = fmaxf(mx, att_x[l]);")
    gen.line("mx = dsp_block_reduce(mx, dsp_red, 1);")
    gen.line("const float mu = mx == -DSP_INF ? 0.f : mx;  // a row of -inf: exp(-inf) = 0, then 0 / 0")
    gen.line("float se = 0.f;")
    with gen.block("for (long long l = threadIdx.x; l < n_here; l += blockDim.x)"):
        gen.line("se += expf(att_x[l] - mu);")
    gen.line("se = dsp_block_reduce(se, dsp_red, 0);")
    with gen.block("for (long long l = threadIdx.x; l < n_here; l += blockDim.x)"):
        pv = spec.values[probs]
        at_p = at(probs, ("0", "lc"))
        gen.line("const long long lc = lo + l;")
        p_expr = "expf(att_x[l] - mu)" if split else _round("expf(att_x[l] - mu) / se", pv.dtype)
        gen.pinned[probs] = (_kept(pv.shape, at_p), gen.let(p_expr, "float", "p"))
        xa = gen.value(a, at(a, ("0", "lc")))
        gen.line(f"att_x[l] = (float)({xa});  // this thread's own positions: no other thread reads them yet")
        del gen.pinned[probs]
    gen.line("__syncthreads();")
    # phase 3: the weighted sum, threads over V's head dim, groups of them over the positions
    gen.line(f"constexpr int VW = T < {vw} ? T : {vw}, NG = T / VW, PER = ({chunk} + NG - 1) / NG;")
    gen.line(f"constexpr int U = PER < {ATTENTION_UNROLL} ? PER : {ATTENTION_UNROLL};  // V's loads in flight")
    gen.line("const int tv = threadIdx.x % VW, tg = threadIdx.x / VW;")
    with gen.block(f"for (long long dv = tv; dv < {d2}; dv += VW)"):
        gen.line("float att_o = 0.f;")
        with gen.block(f"for (int l0 = 0; l0 < {chunk}; l0 += NG * U)"):
            gen.line("float att_v[U];")
            gen.line("#pragma unroll")
            with gen.block("for (int u = 0; u < U; ++u)"):
                position("l0 + u * NG + tg")
                gen.line(f"att_v[u] = (float)({gen.value(v, at(v, ('lc', 'dv')))});")
            gen.line("#pragma unroll")
            with gen.block("for (int u = 0; u < U; ++u)"):
                gen.line("const long long l = l0 + u * NG + tg;")
                gen.line("if (l < n_here) att_o += att_x[l] * att_v[u];")
        gen.line(f"att_part[tg * {d2} + dv] = att_o;")
    gen.line("__syncthreads();")
    if split:  # the range's max, sum and unnormalised weighted sum: attention_combine merges them
        bh = max(1, math.prod(batch))
        with gen.block(f"for (long long dv = threadIdx.x; dv < {d2}; dv += blockDim.x)"):
            gen.line("float att_o = 0.f;")
            gen.line(f"for (int g = 0; g < NG; ++g) att_o += att_part[g * {d2} + dv];")
            gen.line(f"out2[(bh * {n_split} + sk) * {d2} + dv] = att_o;")
        with gen.block("if (threadIdx.x == 0)"):
            gen.line(f"out0[bh * {n_split} + sk] = mx;")
            gen.line(f"out1[bh * {n_split} + sk] = se;")
        part = Idx(("bh", "sk"))
        return [(ATT_M, part), (ATT_L, part), (ATT_ACC, Idx(("bh", "sk", "dv")))], bh * n_split
    out_idx = at(out, ("0", "dv"))
    with gen.block(f"for (long long dv = threadIdx.x; dv < {d2}; dv += blockDim.x)"):
        gen.line("float att_o = 0.f;")
        gen.line(f"for (int g = 0; g < NG; ++g) att_o += att_part[g * {d2} + dv];")
        off = gen.flatten(out_idx, ov.shape)
        gen.wait()
        gen.line(f"out0[{off}] = {_to_storage('att_o', ov.dtype)};")
    return [(out, out_idx)], max(1, math.prod(batch))


def _scored(gen: _Gen, at: Callable[[int, tuple[str, str]], Idx], scores: int, x_in: int) -> str:
    """Decode attention's score at position ``lc`` (the lanes' partial dot products ``att_s`` summed,
    rounded as the reference rounds the product), through its epilogue (scale, mask): its expression."""
    gen.line("att_s = dsp_lanes_sum(att_s, PL);  // every lane of the position holds the dot product")
    sv = gen.spec.values[scores]
    lane_l = at(scores, ("0", "lc"))
    gen.pinned[scores] = (_kept(sv.shape, lane_l), gen.let(_round("att_s", sv.dtype), "float", "p"))
    xs = gen.value(x_in, at(x_in, ("0", "lc")))
    del gen.pinned[scores]
    return xs


def _position(gen: _Gen, expr: str, length: int) -> None:
    """Position ``l`` of a block's range (``expr``), and ``lc``, the buffer's position it reads
    (``lo + l``, clamped into the buffer)."""
    gen.line(f"const long long l = {expr};")
    gen.line(f"const long long lc = lo + l < {length} ? lo + l : {length - 1};")


def _split_attention_body(
    gen: _Gen, spec: GroupSpec, at: Callable[[int, tuple[str, str]], Idx], block: int, chunk: int, n_split: int
) -> tuple[list[tuple[int, Idx]], int]:
    """One range of a split decode attention in one pass (the partials' kernel).

    The block's threads form groups of ATTENTION_LANES lanes, one group per position of a round
    (``SLOTS`` positions a round, every round's K and V loads issued together, before any
    arithmetic: one memory latency, not one per phase). A group's lanes split q . K[l] over the
    head dim and V[l]'s row over the value dim; each group keeps a running max, sum of
    exponentials and weighted sum of V (rescaled when the max grows). Then the groups' results
    are merged through shared memory and the range's max, sum and unnormalised weighted sum are
    stored for ``attention_combine``. q is read by each lane into registers: no barrier before
    the loads.
    """
    _, _, _, at_ = attention_values(spec)
    q, k, scores, a, v, x_in, probs = at_.q, at_.k, at_.scores, at_.a, at_.v, at_.x_in, at_.probs
    pv = spec.values[probs]
    d, d2 = spec.values[q].shape[-1], spec.values[v].shape[-1]
    ov = spec.values[at_.out]
    bh = max(1, math.prod(tuple(ov.shape[:-2])))
    slots = block // ATTENTION_LANES
    gen.line(f"__shared__ float att_m[{slots}], att_l[{slots}];")
    gen.line(f"__shared__ float att_acc[{slots * d2}];")
    gen.line(f"constexpr int T = DSP_BLOCK({block}), PL = DSP_LANES({ATTENTION_LANES}), SLOTS = T / PL;")
    gen.line(f"constexpr int DPL = ({d} + PL - 1) / PL, VPL = ({d2} + PL - 1) / PL;")
    gen.line(f"constexpr int ROUNDS = ({chunk} + SLOTS - 1) / SLOTS;")
    gen.line(f"constexpr int R = ROUNDS < {ATTENTION_ROUNDS} ? ROUNDS : {ATTENTION_ROUNDS};  // rounds in flight")
    gen.line("const int plane = threadIdx.x % PL, slot = threadIdx.x / PL;")
    gen.wait()
    gen.line("float att_qr[DPL];")
    gen.line("#pragma unroll")
    with gen.block("for (int j = 0; j < DPL; ++j)"):
        gen.line("const long long d = plane + j * PL;")
        gen.line(f"const long long dc = d < {d} ? d : {d - 1};")
        gen.line(f"att_qr[j] = d < {d} ? (float)({gen.value(q, at(q, ('0', 'dc')))}) : 0.f;")
    gen.line("float att_mg = -DSP_INF, att_lg = 0.f, att_o[VPL];")
    gen.line("#pragma unroll")
    gen.line("for (int j = 0; j < VPL; ++j) att_o[j] = 0.f;")
    with gen.block("for (int r0 = 0; r0 < ROUNDS; r0 += R)"):
        gen.line("float att_k[R][DPL], att_v[R][VPL];")
        gen.line("#pragma unroll")
        with gen.block("for (int r = 0; r < R; ++r)"):
            _position(gen, "(long long)(r0 + r) * SLOTS + slot", spec.values[k].shape[-1])
            gen.line("#pragma unroll")
            with gen.block("for (int j = 0; j < DPL; ++j)"):
                gen.line("const long long d = plane + j * PL;")
                gen.line(f"const long long dc = d < {d} ? d : {d - 1};")
                gen.line(f"att_k[r][j] = (float)({gen.value(k, at(k, ('dc', 'lc')))});")
            gen.line("#pragma unroll")
            with gen.block("for (int j = 0; j < VPL; ++j)"):
                gen.line("const long long dv = plane + j * PL;")
                gen.line(f"const long long dvc = dv < {d2} ? dv : {d2 - 1};")
                gen.line(f"att_v[r][j] = (float)({gen.value(v, at(v, ('lc', 'dvc')))});")
        gen.line("#pragma unroll")
        with gen.block("for (int r = 0; r < R; ++r)"):
            _position(gen, "(long long)(r0 + r) * SLOTS + slot", spec.values[k].shape[-1])
            gen.line("float att_s = 0.f;")
            gen.line("#pragma unroll")
            gen.line("for (int j = 0; j < DPL; ++j) att_s += att_qr[j] * att_k[r][j];")
            xs = _scored(gen, at, scores, x_in)
            gen.line(f"const float att_x = l < n_here ? (float)({xs}) : -DSP_INF;")
            gen.line("const float att_mn = fmaxf(att_mg, att_x);")
            gen.line("const float att_mu = att_mn == -DSP_INF ? 0.f : att_mn;")
            gen.line("const float att_al = expf(att_mg - att_mu);  // the old terms, rescaled to the new max")
            at_p = at(probs, ("0", "lc"))
            gen.pinned[probs] = (_kept(pv.shape, at_p), gen.let("expf(att_x - att_mu)", "float", "p"))
            xa = gen.value(a, at(a, ("0", "lc")))
            del gen.pinned[probs]
            gen.line(f"const float att_p = (float)({xa});")
            gen.line("att_lg = att_lg * att_al + att_p;")
            gen.line("#pragma unroll")
            gen.line("for (int j = 0; j < VPL; ++j) att_o[j] = att_o[j] * att_al + att_p * att_v[r][j];")
            gen.line("att_mg = att_mn;")
    # the groups' partial results, merged: every lane of a group holds its group's max and sum
    with gen.block("if (plane == 0)"):
        gen.line("att_m[slot] = att_mg;")
        gen.line("att_l[slot] = att_lg;")
    gen.line("#pragma unroll")
    with gen.block("for (int j = 0; j < VPL; ++j)"):
        gen.line("const long long dv = plane + j * PL;")
        gen.line(f"if (dv < {d2}) att_acc[slot * {d2} + dv] = att_o[j];")
    gen.line("__syncthreads();")
    gen.line("float att_top = -DSP_INF;")
    gen.line("for (int g = 0; g < SLOTS; ++g) att_top = fmaxf(att_top, att_m[g]);")
    gen.line("const float att_tu = att_top == -DSP_INF ? 0.f : att_top;")
    with gen.block(f"for (long long dv = threadIdx.x; dv < {d2}; dv += blockDim.x)"):
        gen.line("float o = 0.f;")
        gen.line(f"for (int g = 0; g < SLOTS; ++g) o += att_acc[g * {d2} + dv] * expf(att_m[g] - att_tu);")
        gen.line(f"out2[(bh * {n_split} + sk) * {d2} + dv] = o;")
    with gen.block("if (threadIdx.x == 0)"):
        gen.line("float sum = 0.f;")
        gen.line("for (int g = 0; g < SLOTS; ++g) sum += att_l[g] * expf(att_m[g] - att_tu);")
        gen.line(f"out0[bh * {n_split} + sk] = att_top;")
        gen.line(f"out1[bh * {n_split} + sk] = sum;")
    part = Idx(("bh", "sk"))
    return [(ATT_M, part), (ATT_L, part), (ATT_ACC, Idx(("bh", "sk", "dv")))], bh * n_split


def attention_combine(spec: GroupSpec) -> Kernel:
    """The combine kernel of a split decode attention (``attention_split_specs``' second spec): one
    block per (batch, head) rescales each range's sum and weighted sum by exp(its max - the head's
    max), sums them and stores the weighted sum divided by the sum, rounded to the output's dtype.

    Arguments: (ATT_M, ATT_L, ATT_ACC, the output). Template ``decode_attention_combine``.
    """
    n_split, out = int(spec.params["kv_splits"]), int(spec.params["out"])
    if spec.nodes:
        raise Unsupported("a split attention with ops after its weighted sum (the combine stores only it)")
    ov = spec.values[out]
    _c(ov.dtype)
    bh, d2 = max(1, math.prod(ov.shape[:-2])), int(ov.shape[-1])
    threads = min(THREADS, max(WARP, _pow2(d2)))
    storage = C_TYPES[ov.dtype][0]
    lines = [
        f'extern "C" __global__ void __launch_bounds__({threads}) KERNEL(const float* __restrict__ in0, '
        f"const float* __restrict__ in1, const float* __restrict__ in2, {storage}* __restrict__ out0) {{",
        "    const long long bh = blockIdx.x;",
        "    DSP_WAIT();",
        "    float top = -DSP_INF;",
        f"    for (int s = 0; s < {n_split}; ++s) top = fmaxf(top, in0[bh * {n_split} + s]);",
        "    const float mu = top == -DSP_INF ? 0.f : top;",
        "    float sum = 0.f;",
        f"    for (int s = 0; s < {n_split}; ++s) {{",
        f"        const float m = in0[bh * {n_split} + s];",
        f"        sum += m == -DSP_INF ? 0.f : expf(m - mu) * in1[bh * {n_split} + s];",
        "    }",
        f"    for (long long dv = threadIdx.x; dv < {d2}; dv += blockDim.x) {{",
        "        float o = 0.f;",
        f"        for (int s = 0; s < {n_split}; ++s) {{",
        f"            const float m = in0[bh * {n_split} + s];",
        f"            o += m == -DSP_INF ? 0.f : expf(m - mu) * in2[(bh * {n_split} + s) * {d2} + dv];",
        "        }",
        "        const float att_o = o / sum;",
        f"        out0[bh * {d2} + dv] = {_to_storage('att_o', ov.dtype)};",
        "    }",
        "}",
        "",
    ]
    source = "\n".join(lines)
    name = "dsp_attc_" + hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
    return Kernel(
        source.replace(" KERNEL(", f" {name}(", 1),
        name,
        (ATT_M, ATT_L, ATT_ACC, out),
        3,
        bh,
        threads,
        "decode_attention_combine",
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def attention_parts(spec: GroupSpec) -> tuple[list[int], GroupSpec, list[int]]:
    """An attention group as parts, for layouts the one-block kernel declines (prefill's query rows).

    (the nodes before the softmax's row kernel: K's and q's index arithmetic and the scores
    product, run on their reference kernels; the scale, mask, softmax and casts as one
    ``row_reduction`` spec reading the stored scores, row-major; the nodes after: V's index
    arithmetic and the weighted sum, on their reference kernels). Node lists are indexes into
    ``spec.nodes``.
    """
    p1, sm, p2 = attention_nodes(spec)
    nodes = spec.nodes
    i_p1, i_p2 = nodes.index(p1), nodes.index(p2)
    v_side = value_side(nodes, p2)
    head = [j for j in range(i_p1 + 1) if j not in v_side]
    row = [j for j in range(i_p1 + 1, i_p2) if j not in v_side]
    tail = sorted(v_side | set(range(i_p2, len(nodes))))
    scores, a = p1.outputs[0], p2.inputs[0]
    if scores is None or a is None:
        raise Unsupported("an attention group that does not split into scores, softmax and weighted sum")
    made = {v for j in row for v in nodes[j].outputs if v is not None}
    reads = list(dict.fromkeys(r for j in row for r in nodes[j].inputs if r is not None and r not in made))
    if any(r != scores and r not in spec.inputs for r in reads) or a not in made:
        raise Unsupported("the softmax part reads values its group makes elsewhere")
    values = dict(spec.values)
    values[scores] = TensorSpec(values[scores].shape, values[scores].dtype, tuple(row_major(values[scores].shape)))
    part = GroupSpec("row_reduction", [nodes[j] for j in row], values, reads, [a], spec.constants)
    return head, part, tail


def prologue_parts(spec: GroupSpec) -> tuple[list[int], GroupSpec, list[int]]:
    """A product group with a norm prologue as parts, for layouts its kernel declines (a prompt's
    rows): the norm and the ops before the product as one ``row_reduction`` spec that stores the
    product's first operand, row-major; the product and its epilogue after it, on their
    reference kernels (cuBLAS for the product). As ``attention_parts``: node lists index
    ``spec.nodes`` (head, part, tail; the head is empty)."""
    products = [j for j, n in enumerate(spec.nodes) if n.op in PRODUCT_OPS or (n.domain, n.op) == MERGED_OP]
    if len(products) != 1 or not any(n.op in _ROW_VALUED for n in spec.nodes[: products[0]]):
        raise Unsupported("not a product group with a norm prologue")
    cut = products[0]
    a = spec.nodes[cut].inputs[0]
    row = list(range(cut))
    made = {v for j in row for v in spec.nodes[j].outputs if v is not None}
    if a is None or a not in made:
        raise Unsupported("the prologue does not make the product's first operand")
    for n in spec.nodes[cut:]:
        if any(r in made and r != a for r in n.inputs if r is not None):
            raise Unsupported("the product's epilogue reads a value of its prologue")
    reads = list(dict.fromkeys(r for j in row for r in spec.nodes[j].inputs if r is not None and r not in made))
    values = dict(spec.values)
    values[a] = TensorSpec(values[a].shape, values[a].dtype, tuple(row_major(values[a].shape)))
    part = GroupSpec("row_reduction", [spec.nodes[j] for j in row], values, reads, [a], spec.constants)
    return [], part, list(range(cut, len(spec.nodes)))


# -- merged sibling products (dsp::MergedMatMul): one product over their joined weights ------
# A big product takes a block's lanes per output (not a warp's) where K is longer than this and
# it has at most this many outputs: the MLP down projections (GPT-2's K 3,072 by 768, Llama-1B's
# 8,192 by 2,048); at K 2,048 a warp is the faster (benchmarks/results/gpu_2026-12-03b/).
BLOCK_LANES_MIN_K = 2048
BLOCK_LANES_MAX_OUTPUTS = 4096
MANY_OUTPUTS = 8192  # outputs of a product whose warps compute two columns each (columns_for)
# Blocks of a product kernel with a norm prologue one multiprocessor holds at once (256 threads of
# about 100 registers each, measured with ptxas on Llama-1B's merged Q/K/V and gate/up) and the
# multiprocessors of the GPU the rule was measured on, where the device is not known (the host check).
PROLOGUE_BLOCKS_PER_SM = 2
H200_SMS = 132


def lanes_for(k_len: int, outputs: int, dtype: str, choice: str = "auto") -> int:
    """Lanes sharing one output of a product by a big constant weight (``choice``: the option
    ``nvrtc_product_lanes``): auto, a block's where K is long and the outputs few (a warp would walk
    K alone), else a warp's (a block's reduction costs more than it saves at K 2,048 on an H200:
    benchmarks/products_nvrtc.py)."""
    if dtype == "float64" or choice == "warp":
        return WARP
    if choice == "block":
        return THREADS
    block = k_len > BLOCK_LANES_MIN_K and outputs <= BLOCK_LANES_MAX_OUTPUTS
    return THREADS if block else WARP


def has_norm_prologue(spec: GroupSpec) -> bool:
    """Whether a product group computes a norm before its product (``_norm_prologue``)."""
    return any(n.op in _ROW_VALUED for n in spec.nodes)


def columns_for(choice: int, lanes: int, outputs: int, prologue: bool, sms: int | None = None) -> int:
    """Adjacent columns a lane group computes (``choice``: the option ``nvrtc_product_columns``, 0:
    auto). Auto, where the lanes are a warp: with a norm prologue, the fewest columns (1, 2, 4 or 8)
    that leave no more blocks than the GPU holds at once (``PROLOGUE_BLOCKS_PER_SM`` a multiprocessor,
    ``sms`` of them, an H200's where unknown), so the prologue, which every block computes before its
    product, is paid in one wave; without one, two where the outputs are many (A read once for both);
    else one."""
    if choice:
        return choice
    if lanes != WARP:
        return 1
    if prologue:
        room = PROLOGUE_BLOCKS_PER_SM * (sms or H200_SMS)
        return next((c for c in (1, 2, 4) if -(-outputs // (c * (THREADS // WARP))) <= room), 8)
    return 2 if outputs >= MANY_OUTPUTS else 1


def merged_group(
    spec: GroupSpec, joined: dict[int, TensorSpec], cols: int = 0, lanes_choice: str = "auto", sms: int | None = None
) -> tuple[Kernel, GroupSpec]:
    """A merged products' group (``dsp::MergedMatMul`` after its prologue) as one kernel, given the specs
    of its joined weights and biases (``MERGED_B`` as a contiguous [sum N, K], ``MERGED_C``): alone,
    ``merged_product``; with a norm prologue or a pairwise epilogue, the joined product as one product
    node (``merged_spec``) through the product template, each lane group computing one column of the
    joined product, or the same column of both parts where the epilogue reads them pairwise (``cols``
    adjacent columns a lane group, alone too: ``_columns_template``, ``_merged_columns``)."""
    spec = GroupSpec(
        spec.template,
        spec.nodes,
        {**spec.values, **joined},
        spec.inputs,
        spec.outputs,
        spec.constants,
        spec.splits,
        spec.params,
    )
    node = spec.nodes[merged_index(spec)]
    bias = joined.get(MERGED_C)
    try:
        merged = merged_spec(spec, None if bias is None else tuple(bias.shape))
    except Unsupported:
        if len(spec.nodes) == 1:
            return merged_product(node, spec.values), spec
        raise
    k_len, width = merged.values[MERGED_B].shape
    outputs = int(merged.params.get("paired", 0)) or int(width)
    lanes = lanes_for(int(k_len), outputs, merged.values[MERGED_B].dtype, lanes_choice)
    cols = columns_for(cols, lanes, outputs, has_norm_prologue(merged), sms)
    if len(spec.nodes) == 1 and cols == 1:  # one column a warp, nothing before or after: the plain kernel
        return merged_product(node, spec.values), spec
    merged = GroupSpec(
        merged.template,
        merged.nodes,
        merged.values,
        merged.inputs,
        merged.outputs,
        merged.constants,
        merged.splits,
        {**merged.params, "lanes": lanes, "fixed_b": 1, "cols": cols},
    )
    return generate(merged), merged


def merged_product(node: NodeSpec, values: dict[int, TensorSpec]) -> Kernel:
    """Sibling products merged by the core (Q/K/V, gate/up) as one kernel over their weights joined
    into one [sum N, K] matrix (``MERGED_B``, K its unit stride; biases joined as ``MERGED_C``):
    a warp per column of the joined product, its lanes over K, each part's columns stored to
    that part's output. Rounded as ``_product`` rounds (the product, then the bias).

    Arguments: (A, MERGED_B[, MERGED_C], the parts' outputs). Template ``product``.
    """
    a = node.inputs[0]
    weights, biases = merged_operands(node)
    assert a is not None
    form = str(node.attrs.get("form", "MatMul"))
    trans_b = form == "Gemm" and int(node.attrs.get("transB", 0)) == 1
    sa = values[a]
    if sa.strides is None or len(sa.shape) < 2 or sa.dtype not in FLOATS:
        raise Unsupported("a merged product's input of unknown strides, a vector, or not floats")
    shapes = [values[w].shape for w in weights]
    if any(len(sh) != 2 for sh in shapes):
        raise Unsupported("merged products of other than matrices")
    widths = [int(sh[0] if trans_b else sh[1]) for sh in shapes]
    k_len = int(sa.shape[-1])
    rows = math.prod(sa.shape[:-1])
    if rows > MAX_PRODUCT_ROWS:
        raise Unsupported(f"{rows} rows: cuBLAS runs products of more than {MAX_PRODUCT_ROWS}")
    outs = [o for o in node.outputs if o is not None]
    dtype = values[outs[0]].dtype
    if any(values[o].dtype != dtype for o in outs) or values[weights[0]].dtype != dtype or sa.dtype != dtype:
        raise Unsupported("merged products of mixed dtypes")
    storage = C_TYPES[dtype][0]
    ct = "double" if dtype == "float64" else "float"
    total = sum(widths)
    load = (lambda x: f"({ct}){x}") if dtype not in HALF else (lambda x: _from_storage(x, dtype))
    params = [f"const {storage}* __restrict__ in0", f"const {storage}* __restrict__ in1"]
    gemm = form == "Gemm"
    if gemm and biases:
        params.append(f"const {storage}* __restrict__ in2")
    params += [f"{storage}* __restrict__ out{k}" for k in range(len(outs))]
    lines = [
        f'extern "C" __global__ void __launch_bounds__({THREADS}) KERNEL({", ".join(params)}) {{',
        f"    const long long lin = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / DSP_LANES({WARP});",
        f"    const int lane = threadIdx.x % DSP_LANES({WARP});",
        f"    if (lin >= {rows * total}) return;",
        f"    const long long m = lin / {total}, c = lin % {total};",
    ]
    # the row's offset in A through its real strides (its leading dims flattened into m)
    terms, rest = [], "m"
    lead = sa.shape[:-1]
    for d, (size, st) in enumerate(zip(lead, sa.strides[:-1])):
        inner = math.prod(lead[d + 1 :])
        if size != 1:
            terms.append(f"(({rest} / {inner}) % {size}) * {st}LL")
    lines.append(f"    const long long arow = {' + '.join(terms) if terms else '0'};")
    v = VECTOR_ELEMENTS.get(dtype, 0) if k_len % VECTOR_ELEMENTS.get(dtype, k_len + 1) == 0 else 0
    if v:  # the joined weight (a fresh [sum N, K] copy, 16-byte aligned) 16 bytes a load, preloaded
        pre = min(-(-k_len // (WARP * v)), PRELOAD_VECTORS)
        lanes = f"DSP_LANES({WARP})"
        a_elem = load(f"in0[arow + (kb + j) * {sa.strides[-1]}LL]")
        dot = [
            "#pragma unroll",
            f"for (int j = 0; j < {v}; ++j) acc += {a_elem} * {_vector_element('q', 'j', dtype)};",
        ]
        lines += [
            f"    dsp_v16 wq[{pre}];",
            "#pragma unroll",
            f"    for (int it = 0; it < {pre}; ++it) {{",
            f"        const long long kb = (lane + it * {lanes}) * {v}LL;",
            f"        if (kb < {k_len}) wq[it] = dsp_pre16(in1 + c * {k_len}LL + kb);",
            "    }",
            "    DSP_WAIT();",
            f"    {ct} acc = 0;",
            "#pragma unroll",
            f"    for (int it = 0; it < {pre}; ++it) {{",
            f"        const long long kb = (lane + it * {lanes}) * {v}LL;",
            f"        if (kb >= {k_len}) continue;",
            "        const dsp_v16 q = wq[it];",
            *(f"        {x}" for x in dot),
            "    }",
            f"    for (long long kb = (lane + {pre} * {lanes}) * {v}LL; kb < {k_len}; kb += {lanes} * {v}LL) {{",
            f"        const dsp_v16 q = *reinterpret_cast<const dsp_v16*>(in1 + c * {k_len}LL + kb);",
            *(f"        {x}" for x in dot),
            "    }",
        ]
    else:
        lines += [
            "    DSP_WAIT();",
            f"    {ct} acc = 0;",
            "#pragma unroll 8",
            f"    for (long long k = lane; k < {k_len}; k += DSP_LANES({WARP}))",
            f"        acc += {load(f'in0[arow + k * {sa.strides[-1]}LL]')} * {load(f'in1[c * {k_len}LL + k]')};",
        ]
    lines.append("    acc = dsp_warp_sum(acc);")
    expr = "acc"
    if gemm:
        alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
        if alpha != 1.0:
            expr = f"({ct})({alpha!r}) * {expr}"
        if biases and beta != 0.0:
            term = load("in2[c]") if beta == 1.0 else f"({ct})({beta!r}) * {load('in2[c]')}"
            expr = f"{_round(expr, dtype)} + {term}"
    lines.append(f"    const {ct} v = {_round(expr, dtype)};")
    lines.append("    if (lane != 0) return;")
    offset = 0
    for k, width in enumerate(widths):
        cond = f"c < {offset + width}" if k < len(widths) - 1 else "true"
        store = f"out{k}[m * {width} + (c - {offset})] = {_to_storage('v', dtype)};"
        lines.append(f"    {'if' if k == 0 else 'else if'} ({cond}) {store}")
        offset += width
    lines += ["}", ""]
    source = "\n".join(lines)
    name = "dsp_mm_" + hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
    args = (a, MERGED_B, *((MERGED_C,) if gemm and biases else ()), *outs)
    grid = (rows * total * WARP + THREADS - 1) // THREADS
    return Kernel(
        source.replace(" KERNEL(", f" {name}(", 1),
        name,
        args,
        len(args) - len(outs),
        grid,
        THREADS,
        "product",
        (MERGED_B,) if v else (),
    )


# -- the KV store (dsp::KVScatter): the step's rows written into the KV buffer in place --------
def _kv_operands(node: NodeSpec, values: dict[int, TensorSpec]) -> tuple[int, int, int, int]:
    """(buffer, rows, position, axis) of a ``dsp::KVScatter`` a kernel can write, or Unsupported:
    rows of the buffer's dtype and rank, the same dims but along the axis (no more rows than the
    buffer holds), an integer position."""
    buffer, update, position = (node.inputs + (None, None, None))[:3]
    if buffer is None or update is None or position is None:
        raise Unsupported("a KVScatter without its buffer, rows and position")
    b, u, p = values[buffer], values[update], values[position]
    if b.dtype != u.dtype:
        raise Unsupported(f"rows of {u.dtype} written into a {b.dtype} buffer (the reference casts)")
    if p.dtype not in ("int64", "int32"):
        raise Unsupported(f"a position of {p.dtype}")
    rank = len(b.shape)
    ax = int(node.attrs.get("axis", -2)) % rank
    if len(u.shape) != rank or any(u.shape[k] != b.shape[k] for k in range(rank) if k != ax):
        raise Unsupported(f"rows of {list(u.shape)} for a buffer of {list(b.shape)} along axis {ax}")
    if u.shape[ax] > b.shape[ax]:
        raise Unsupported(f"rows of {list(u.shape)} for a buffer of {list(b.shape)} along axis {ax}")
    return buffer, update, position, ax


def kv_store(node: NodeSpec, values: dict[int, TensorSpec]) -> Kernel:
    """``dsp::KVScatter(buffer, update, position)`` as one kernel: one thread per element of the
    update, written into the buffer at ``position[0]`` plus its index along ``axis``.

    Arguments: (update, position, buffer), the buffer last (written in place; it is the
    op's output). Both read through their real strides. A start that is negative counts from
    the end (as the reference's fancy index wraps it); an element that would land outside
    the buffer is not written. Template ``store``.
    """
    buffer, update, position, ax = _kv_operands(node, values)
    b, u, p = values[buffer], values[update], values[position]
    if b.strides is None or u.strides is None:
        raise Unsupported("rows or a buffer of unknown strides")
    numel = u.numel
    if numel == 0:
        raise Unsupported("no rows to write")
    storage = C_TYPES[b.dtype][0]
    lines = [
        f'extern "C" __global__ void __launch_bounds__({THREADS}) KERNEL(const {storage}* __restrict__ in0, '
        f"const {C_TYPES[p.dtype][0]}* __restrict__ in1, {storage}* __restrict__ out0) {{",
        "    DSP_WAIT();",
        "    const long long lin = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        f"    if (lin >= {numel}) return;",
    ]
    src, dst = [], []
    for k, (d, st) in enumerate(zip(u.shape, row_major(u.shape))):
        if d == 1 and k != ax:
            continue
        lines.append(f"    const long long i{k} = (lin / {st}) % {d};")
        if k == ax:
            lines.append(f"    long long j = (long long)in1[0] + i{k};")
            lines.append(f"    if (j < 0) j += {b.shape[ax]};")
            lines.append(f"    if (j < 0 || j >= {b.shape[ax]}) return;")
        src.append(f"i{k} * {u.strides[k]}LL")
        dst.append(f"{'j' if k == ax else f'i{k}'} * {b.strides[k]}LL")
    lines.append(f"    out0[{' + '.join(dst)}] = in0[{' + '.join(src)}];")
    lines += ["}", ""]
    source = "\n".join(lines)
    name = "dsp_kv_" + hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
    grid = (numel + THREADS - 1) // THREADS
    return Kernel(
        source.replace(" KERNEL(", f" {name}(", 1), name, (update, position, buffer), 2, grid, THREADS, "store"
    )


# -- the greedy pick (dsp::Sample at temperature 0, ArgMax over the last axis) ----------------
ARGMAX_CHUNK = 1024  # elements of a row one block of the first kernel reads
_KEY_TYPES = {16: "short", 32: "int", 64: "long long"}  # the logits read as signed integers of their width


def argmax_rows(logits: TensorSpec, chunk: int = ARGMAX_CHUNK) -> tuple[Kernel, Kernel]:
    """The first index of each row's largest value of a [B, V] tensor (any strides), as two kernels.

    Values are compared as integer keys that order like the floats (``ORDERED_KEY_BITS``:
    NaN above everything, -0 equal to +0), so the index is exact. The first kernel (one
    block per chunk of a row, blocks row-major) writes each chunk's best key and its first
    index (int64) to two [B, chunks] arrays; the second (one block per row) picks the best
    chunk and writes the row's index (int64 [B]). The logits are read through a pointer of
    the signed integer type of their width. Arguments: (logits, keys, indexes) and (keys,
    indexes, out); template ``argmax`` (a block reduction: the host check runs one thread).
    """
    p = pick_rows(logits, chunk)
    width, magnitude, inf = p.width, p.magnitude, p.inf
    rows, vocab, rs, cs, blk, chunks = p.rows, p.vocab, p.row_stride, p.col_stride, p.chunk, p.chunks
    first = [
        f'extern "C" __global__ void __launch_bounds__({THREADS}) KERNEL('
        f"const {_KEY_TYPES[width]}* __restrict__ in0, long long* __restrict__ out0, long long* __restrict__ out1) {{",
        "    __shared__ long long dsp_sk[32];",
        "    __shared__ long long dsp_sp[32];",
        "    DSP_WAIT();",
        f"    const long long b = blockIdx.x / {chunks}, c = blockIdx.x % {chunks};",
        f"    const long long end = (c + 1) * {blk} < {vocab} ? (c + 1) * {blk} : {vocab};",
        "    long long best = DSP_KEY_MIN, pos = DSP_KEY_MAX;",
        f"    for (long long j = c * {blk} + threadIdx.x; j < end; j += blockDim.x) {{",
        f"        const long long bits = (long long)in0[b * {rs}LL + j * {cs}LL];",
        f"        const long long mag = bits & {magnitude}LL;",
        f"        const long long key = mag > {inf}LL ? DSP_KEY_MAX : bits < 0 ? -mag : mag;",
        "        if (key > best) { best = key; pos = j; }  // j grows: the first index of a tie stays",
        "    }",
        "    dsp_block_argmax(&best, &pos, dsp_sk, dsp_sp);",
        f"    if (threadIdx.x == 0) {{ out0[b * {chunks} + c] = best; out1[b * {chunks} + c] = pos; }}",
        "}",
        "",
    ]
    second = [
        f'extern "C" __global__ void __launch_bounds__({THREADS}) KERNEL('
        "const long long* __restrict__ in0, const long long* __restrict__ in1, long long* __restrict__ out0) {",
        "    __shared__ long long dsp_sk[32];",
        "    __shared__ long long dsp_sp[32];",
        "    DSP_WAIT();",
        "    const long long b = blockIdx.x;",
        "    long long best = DSP_KEY_MIN, pos = DSP_KEY_MAX;",
        f"    for (long long c = threadIdx.x; c < {chunks}; c += blockDim.x) {{",
        f"        const long long k = in0[b * {chunks} + c], p = in1[b * {chunks} + c];",
        "        if (k > best || (k == best && p < pos)) { best = k; pos = p; }",
        "    }",
        "    dsp_block_argmax(&best, &pos, dsp_sk, dsp_sp);",
        "    if (threadIdx.x == 0) out0[b] = pos;",
        "}",
        "",
    ]
    kernels = []
    for lines, prefix, grid, args, n_in in (
        (first, "dsp_argmax_", rows * chunks, (0, 1, 2), 1),
        (second, "dsp_argmax_pick_", rows, (1, 2, 3), 2),
    ):
        source = "\n".join(lines)
        name = prefix + hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
        kernels.append(Kernel(source.replace(" KERNEL(", f" {name}(", 1), name, args, n_in, grid, THREADS, "argmax"))
    return kernels[0], kernels[1]


def argmax_specs(logits: TensorSpec, first: Kernel) -> tuple[GroupSpec, GroupSpec]:
    """The two kernels' arguments as the segment cache and the host check read them (value ids 0..3).

    The logits (0) as the signed integers the first kernel reads; the chunks' keys (1) and
    indexes (2); the rows' indexes (3).
    """
    width = ORDERED_KEY_BITS[logits.dtype][0]
    rows, chunks = logits.shape[0], first.grid // max(1, logits.shape[0])
    values = {
        0: TensorSpec(logits.shape, f"int{width}", logits.strides),
        1: TensorSpec((rows, chunks), "int64"),
        2: TensorSpec((rows, chunks), "int64"),
        3: TensorSpec((rows,), "int64"),
    }
    return (
        GroupSpec("argmax", [], values, [0], [1, 2]),
        GroupSpec("argmax", [], values, [1, 2], [3]),
    )
