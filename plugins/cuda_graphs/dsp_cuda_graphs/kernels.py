"""Matrix products through the owned cuBLAS binding, so they can be captured.

``matmul(st, a, b)`` is numpy's matmul (broadcast batch dims, 1-D operands promoted)
for float16/float32/float64 (and bfloat16 where CuPy has it) with fp32 accumulation; other
dtypes and layouts cuBLAS cannot read go through a contiguous copy or, for integers, CuPy's
own matmul (eager only). ``XP`` is cupy with ``matmul`` swapped for this one, handed to
reference kernels that multiply matrices themselves (attention ops).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dsp_cuda_graphs.cublas import batch_stride, gemm_args

FLOAT_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16"})


def _elem_strides(x: Any) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _mat_strides(x: Any) -> tuple[int, int]:
    """(row, column) strides of the last two dims, in elements."""
    rs, cs = _elem_strides(x)[-2:]
    return rs, cs


def matmul(st: dict[str, Any], a: Any, b: Any, out_dtype: Any = None) -> Any:
    """numpy.matmul semantics on the backend's stream through cuBLAS (fp32 accumulation)."""
    cp = st["cupy"]
    dtype = str(a.dtype)
    if dtype != str(b.dtype) or dtype not in FLOAT_DTYPES:
        return cp.matmul(a, b)  # integers / mixed: CuPy's (not capturable; such slots fail capture)
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = a[None, :]
    if squeeze_b:
        b = b[:, None]
    m, k = a.shape[-2], a.shape[-1]
    k2, n = b.shape[-2], b.shape[-1]
    if k != k2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align ({k} != {k2})")
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    out = cp.empty(batch + (m, n), dtype=a.dtype)
    if out.size:
        if k == 0:
            out.fill(0)
        else:
            _gemm_into(st, a, b, out, batch, 1.0, 0.0)
    if squeeze_a:
        out = out[..., 0, :]
    if squeeze_b:
        out = out[..., 0]
    return out


def _gemm_into(st: dict[str, Any], a: Any, b: Any, out: Any, batch: tuple[int, ...], alpha: float, beta: float) -> None:
    """out[...] = alpha * a @ b + beta * out, one cuBLAS call (copies operands cuBLAS cannot read)."""
    cp = st["cupy"]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    count = math.prod(batch)
    # Fold a batched A against a plain B into one taller product when A's rows are uniform.
    if b.ndim == 2 and a.ndim > 2 and count > 1:
        flat = a.reshape(count * m, k) if a.flags.c_contiguous else None
        if flat is not None:
            a, m, count, batch = flat, count * m, 1, ()
    args = sa = sb = None
    for attempt in range(2):
        args = gemm_args(m, n, k, _mat_strides(a), _mat_strides(b), n)
        sa = batch_stride(a.shape[:-2], _elem_strides(a)[:-2], batch)
        sb = batch_stride(b.shape[:-2], _elem_strides(b)[:-2], batch)
        if args is not None and sa is not None and sb is not None:
            break
        if attempt == 1:
            raise RuntimeError(f"matmul: cannot lay out operands {a.shape} {a.strides} / {b.shape} {b.strides}")
        a = cp.ascontiguousarray(cp.broadcast_to(a, batch + (m, k)))
        b = cp.ascontiguousarray(cp.broadcast_to(b, batch + (k, n)))
    assert args is not None and sa is not None and sb is not None
    st["cublas"].gemm(
        args, str(a.dtype), int(a.data.ptr), int(b.data.ptr), int(out.data.ptr), alpha, beta, count, (sa, sb, m * n)
    )


def matmul_kernel(st: dict[str, Any]) -> Any:
    """The MatMul slot kernel: (a, b) -> a @ b through cuBLAS."""

    def kernel(a: Any, b: Any) -> Any:
        return matmul(st, a, b)

    return kernel


def gemm_kernel(
    st: dict[str, Any], alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0, **_: Any
) -> Any:
    """The Gemm slot kernel: alpha * op(A) @ op(B) + beta * C, the bias folded into cuBLAS's beta."""
    cp = st["cupy"]

    def kernel(a: Any, b: Any, c: Any = None) -> Any:
        a2 = a.T if transA else a
        b2 = b.T if transB else b
        if str(a.dtype) not in FLOAT_DTYPES or a.dtype != b.dtype or a2.ndim != 2 or b2.ndim != 2:
            y = matmul(st, a2, b2) * alpha
            return (y + beta * c).astype(a.dtype) if c is not None and beta != 0.0 else y.astype(a.dtype)
        m, n = a2.shape[0], b2.shape[1]
        out = cp.empty((m, n), dtype=a.dtype)
        use_c = c is not None and beta != 0.0
        if use_c:
            out[...] = cp.broadcast_to(c.astype(a.dtype, copy=False), (m, n))
        if a2.shape[1] == 0:
            out[...] = out * beta if use_c else 0
            return out
        _gemm_into(st, a2, b2, out, (), float(alpha), float(beta) if use_c else 0.0)
        return out

    return kernel


def merged_matmul_kernel(
    st: dict[str, Any],
    form: str = "MatMul",
    bias: int = 0,
    alpha: float = 1.0,
    beta: float = 1.0,
    transB: int = 0,
    **_: Any,
) -> Any:
    """The ``dsp::MergedMatMul`` slot kernel (dsp_core/plan/merge.py): each part as the MatMul or Gemm it replaced.

    The same cuBLAS calls the unmerged plan made (the reference kernel would widen half
    weights to float32 on every call). One product over the weights joined once along N
    is the faster form still to build here (docs/merge.md).
    """
    gemm = gemm_kernel(st, alpha=alpha, beta=beta, transB=transB) if form == "Gemm" else None

    def kernel(a: Any, *inputs: Any) -> tuple[Any, ...]:
        k = len(inputs) // 2 if bias else len(inputs)
        if gemm is None:
            return tuple(matmul(st, a, b) for b in inputs)
        biases = inputs[k:] if bias else (None,) * k
        return tuple(gemm(a, b, c) for b, c in zip(inputs[:k], biases))

    return kernel


def _cudnn(st: dict[str, Any]) -> Any:
    """The device's cuDNN handle, made on first use (outside a capture); None where cuDNN is missing."""
    if "cudnn" not in st:
        from dsp_core import config
        from dsp_cuda_graphs.cudnn import Cudnn, CudnnError

        tf32 = bool(st["cublas"].tf32)
        try:
            st["cudnn"] = Cudnn(st["stream"], tf32, deterministic=not tf32, search=str(config.get("cudnn_algo")))
        except (OSError, CudnnError) as exc:
            st["cudnn"], st["cudnn_error"] = None, f"{type(exc).__name__}: {exc}"
    return st["cudnn"]


def conv_kernel(st: dict[str, Any], reference: Any, **attrs: Any) -> Any:
    """The Conv slot kernel: one cuDNN convolution with its bias (algorithm chosen once per layout,
    before capture, timed with the bias as it is added); the reference kernel where cuDNN does
    not take it (asymmetric padding, mixed dtypes, no cuDNN here, a layout first met inside a
    capture)."""
    from dsp_cuda_graphs.cudnn import Unsupported, conv_geometry

    cp = st["cupy"]
    geometries: dict[tuple[Any, ...], Any] = {}

    def kernel(x: Any, w: Any, b: Any = None) -> Any:
        dtype = str(x.dtype)
        args = (x, w) if b is None else (x, w, b)
        if str(w.dtype) != dtype or (b is not None and str(b.dtype) != dtype) or not hasattr(w, "data"):
            return reference(*args)
        key = (tuple(x.shape), tuple(w.shape), dtype, b is not None)
        geometry = geometries.get(key)  # this slot's attributes: the same for every call
        if geometry is None:
            try:
                geometry = conv_geometry(key[0], key[1], dtype, **attrs)
                if b is not None and tuple(b.shape) != (geometry.w_shape[0],):
                    raise Unsupported(f"bias of shape {tuple(b.shape)}")
            except Unsupported as exc:
                geometry = exc
            geometries[key] = geometry
        if isinstance(geometry, Unsupported):
            return reference(*args)
        dnn = _cudnn(st)
        if dnn is None:
            return reference(*args)
        capturing = bool(cp.cuda.runtime.streamIsCapturing(st["stream"].ptr))
        # the device's layouts are shared by every Conv slot: the key holds the whole geometry
        layout_key = (*key, geometry)
        if capturing and layout_key not in dnn.layouts:
            return reference(*args)
        xc = cp.ascontiguousarray(x).reshape(geometry.x_shape)
        wc = cp.ascontiguousarray(w).reshape(geometry.w_shape)
        bc = None if b is None else cp.ascontiguousarray(b)
        y = cp.empty(geometry.y_shape, dtype=x.dtype)
        try:
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):  # never the plan's memory
                conv = dnn.layout(layout_key, geometry, dtype, cp, xc, wc, y, bc)
        except Unsupported:
            return reference(*args)
        conv.forward(dnn.handle, xc, wc, y, bc)
        return y.reshape(y.shape[:2] + y.shape[3:]) if geometry.lifted else y

    return kernel


def max_pool_kernel(st: dict[str, Any], reference: Any, n_outputs: int, **attrs: Any) -> Any:
    """The MaxPool slot kernel (no Indices output): one cuDNN pooling call; the reference kernel where
    cuDNN's windows differ from ONNX's (``pool_geometry`` says why) or cuDNN is missing."""
    from dsp_cuda_graphs.cudnn import Unsupported, pool_geometry

    cp = st["cupy"]
    geometries: dict[tuple[Any, ...], Any] = {}
    rest = (None,) * (n_outputs - 1)

    def kernel(x: Any) -> Any:
        dtype = str(x.dtype)
        key = (tuple(x.shape), dtype)
        geometry = geometries.get(key)
        if geometry is None:
            try:
                geometry = pool_geometry(key[0], dtype, **attrs)
            except Unsupported as exc:
                geometry = exc
            geometries[key] = geometry
        dnn = _cudnn(st)
        if isinstance(geometry, Unsupported) or dnn is None:
            return reference(x)
        xc = cp.ascontiguousarray(x).reshape(geometry.x_shape)
        y = cp.empty(geometry.y_shape, dtype=x.dtype)
        dnn.pooling((*key, geometry), geometry, dtype).forward(dnn.handle, xc, y)  # shared: keyed by the geometry
        return (y.reshape(y.shape[:2] + y.shape[3:]) if geometry.lifted else y, *rest)

    return kernel


class CublasXP:
    """cupy, with ``matmul`` going through the owned cuBLAS binding (capturable)."""

    def __init__(self, st: dict[str, Any]) -> None:
        self._st = st
        self._cupy = st["cupy"]

    def matmul(self, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        """numpy.matmul through cuBLAS (extra arguments: CuPy's own)."""
        if args or kwargs:
            return self._cupy.matmul(a, b, *args, **kwargs)
        return matmul(self._st, a, b)

    def einsum_by_matmul(self, equation: str, *operands: Any) -> Any:
        """numpy.einsum with its products through cuBLAS (CuPy's einsum calls cuBLAS itself, which a
        capture refuses)."""
        from dsp_core.ops.linalg import einsum_by_matmul

        return einsum_by_matmul(self, equation, *operands)

    def det_by_elimination(self, a: Any) -> Any:
        """numpy.linalg.det without cuSOLVER (CuPy's det calls it and cuBLAS, which a capture refuses)."""
        from dsp_core.ops.linalg import MAX_ELIMINATION_ORDER, det_by_elimination

        if a.shape[-1] > MAX_ELIMINATION_ORDER:
            return self._cupy.linalg.det(a)
        return det_by_elimination(self._cupy, a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cupy, name)
