"""Fused kernels for the two row-wise ops that dominate a transformer step's launch count.

The reference LayerNormalization and Softmax are written with array ops: about twenty
and six kernel launches each (widening fp16, two means, the normalisation, narrowing).
Inside a CUDA graph every launch costs GPU time, so the backend swaps them, where it can,
for one kernel per op: one thread block per row, the reductions in shared memory, float
accumulation (as the reference: stash type float32), the result written in the input's
dtype. Anything else (other axes, dtypes, the optional Mean/InvStdDev outputs) falls
back to the reference kernel, so results never depend on which path ran.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BLOCK = 256  # threads per row (a power of two: the tree reductions below need it)

_SOURCE = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half(v); }

// Sum (op 0) or max (op 1) of one value per thread, in shared memory; every thread gets it.
__device__ float block_reduce(float v, float* shared, int op) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float o = shared[threadIdx.x + s];
            shared[threadIdx.x] = op ? fmaxf(shared[threadIdx.x], o) : shared[threadIdx.x] + o;
        }
        __syncthreads();
    }
    float r = shared[0];
    __syncthreads();  // shared[] is reused by the next reduction
    return r;
}

template <typename T>
__device__ void layer_norm(const T* x, const T* scale, const T* bias, T* y, int n, float eps, int has_bias) {
    __shared__ float shared[256];
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    float sum = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += to_f(xr[i]);
    float mean = block_reduce(sum, shared, 0) / n;
    float sq = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float d = to_f(xr[i]) - mean; sq += d * d; }
    float inv_std = 1.f / sqrtf(block_reduce(sq, shared, 0) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = (to_f(xr[i]) - mean) * inv_std * to_f(scale[i]);
        if (has_bias) v += to_f(bias[i]);
        put(yr + i, v);
    }
}

template <typename T>
__device__ void softmax(const T* x, T* y, int n) {
    __shared__ float shared[256];
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    float m = __int_as_float(0xff800000);  // -inf (NVRTC has no math.h INFINITY)
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, to_f(xr[i]));
    m = block_reduce(m, shared, 1);
    float sum = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += expf(to_f(xr[i]) - m);
    sum = block_reduce(sum, shared, 0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) put(yr + i, expf(to_f(xr[i]) - m) / sum);
}

extern "C" __global__ void ln_float32(const float* x, const float* s, const float* b, float* y,
                                      int n, float eps, int hb) { layer_norm<float>(x, s, b, y, n, eps, hb); }
extern "C" __global__ void ln_float16(const __half* x, const __half* s, const __half* b, __half* y,
                                      int n, float eps, int hb) { layer_norm<__half>(x, s, b, y, n, eps, hb); }
extern "C" __global__ void softmax_float32(const float* x, float* y, int n) { softmax<float>(x, y, n); }
extern "C" __global__ void softmax_float16(const __half* x, __half* y, int n) { softmax<__half>(x, y, n); }
"""

_NAMES = ("ln_float32", "ln_float16", "softmax_float32", "softmax_float16")
FUSED_DTYPES = frozenset({"float16", "float32"})


def _module(st: dict[str, Any]) -> Any:
    """The compiled kernels (compiled once per process, before any capture uses them)."""
    mod = st.get("fused_module")
    if mod is None:
        cp = st["cupy"]
        mod = cp.RawModule(code=_SOURCE, options=("--std=c++14",), name_expressions=None)
        st["fused_module"] = mod
    return mod


def _rows(x: Any) -> tuple[int, int]:
    n = x.shape[-1] if x.ndim else 1
    return (x.size // n if n else 0), n


def layer_norm_kernel(
    st: dict[str, Any], reference: Any, n_outputs: int, axis: int = -1, epsilon: float = 1e-5, **_: Any
) -> Any:
    """A LayerNormalization slot kernel: fused over the last axis when it can, else ``reference``."""

    def kernel(x: Any, scale: Any, b: Any = None) -> Any:
        dtype = str(x.dtype)
        last = axis in (-1, x.ndim - 1)
        same = scale.dtype == x.dtype and (b is None or b.dtype == x.dtype)
        if n_outputs != 1 or not last or dtype not in FUSED_DTYPES or not same or scale.size != x.shape[-1]:
            return reference(x, scale, b)
        cp = st["cupy"]
        rows, n = _rows(x)
        xc = cp.ascontiguousarray(x)
        sc = cp.ascontiguousarray(scale.reshape(-1))
        bc = cp.ascontiguousarray(b.reshape(-1)) if b is not None and b.size == n else None
        if b is not None and bc is None:
            return reference(x, scale, b)
        y = cp.empty_like(xc)
        if rows:
            fn = _module(st).get_function(f"ln_{dtype}")
            fn(
                (rows,),
                (_BLOCK,),
                (xc, sc, bc if bc is not None else sc, y, np.int32(n), np.float32(epsilon), np.int32(bc is not None)),
            )
        return (y, None, None)

    return kernel


def softmax_kernel(st: dict[str, Any], reference: Any, opset: int, axis: int | None = None) -> Any:
    """A Softmax slot kernel: fused over the last axis (opset >= 13 semantics), else ``reference``."""

    def kernel(x: Any) -> Any:
        dtype = str(x.dtype)
        ax = (-1 if opset >= 13 else 1) if axis is None else axis
        last = x.ndim >= 1 and ax in (-1, x.ndim - 1) and (opset >= 13 or x.ndim - 1 == ax % max(x.ndim, 1))
        if not last or dtype not in FUSED_DTYPES:
            return reference(x)
        cp = st["cupy"]
        rows, n = _rows(x)
        xc = cp.ascontiguousarray(x)
        y = cp.empty_like(xc)
        if rows and n:
            _module(st).get_function(f"softmax_{dtype}")((rows,), (_BLOCK,), (xc, y, np.int32(n)))
        return y

    return kernel


def row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length) of a row-wise op over the last axis (pure Python, for tests)."""
    n = shape[-1] if shape else 1
    total = int(np.prod(shape)) if shape else 1
    return (total // n if n else 0), n
