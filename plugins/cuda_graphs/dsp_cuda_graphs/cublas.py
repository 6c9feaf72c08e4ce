"""A small owned cuBLAS binding (ctypes), because CuPy refuses cuBLAS during stream capture.

cuBLAS itself captures fine when called directly (see gpu_notes): ``cublasCreate_v2``,
``cublasSetStream_v2`` to the capture stream, a fixed workspace (``cublasSetWorkspace_v2``)
so nothing is allocated inside a capture, then ``cublasGemmEx`` /
``cublasGemmStridedBatchedEx`` with fp32 compute (fp64 for fp64).

cuBLAS is column-major; DSP's arrays are row-major. ``gemm_args`` turns a row-major
product C = A @ B into cuBLAS's C^T = B^T A^T, reading each operand's strides to pick
'N' (rows contiguous) or 'T' (columns contiguous) and its leading dimension. It is pure
Python and unit-tested on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from dataclasses import dataclass
from typing import Any

OP_N, OP_T = 0, 1
# cudaDataType and cublasComputeType_t values (library_types.h, cublas_api.h)
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
GEMM_DEFAULT = -1
DATA_TYPES = {"float32": CUDA_R_32F, "float64": CUDA_R_64F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
WORKSPACE_BYTES = 32 << 20


@dataclass(frozen=True)
class Operand:
    """A matrix operand as cuBLAS takes it: transposition flag and leading dimension (elements)."""

    op: int
    ld: int


def operand(rows: int, cols: int, row_stride: int, col_stride: int) -> Operand | None:
    """How the column-major library reads row-major logical matrix (rows x cols), or None.

    Strides are in elements. Rows contiguous (col_stride 1): cuBLAS sees the transpose,
    no flag, ld = row_stride. Columns contiguous (row_stride 1): cuBLAS sees the matrix
    itself, flag T, ld = col_stride. The stride of a size-1 dimension is free. None when
    neither holds (the caller makes a contiguous copy first).
    """
    if col_stride == 1 or cols == 1:
        ld = row_stride if rows > 1 else max(cols, 1)
        if ld >= max(cols, 1):
            return Operand(OP_N, ld)
    if row_stride == 1 or rows == 1:
        ld = col_stride if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return Operand(OP_T, ld)
    return None


@dataclass(frozen=True)
class GemmArgs:
    """The arguments of one cuBLAS call computing row-major C (M x N) = A (M x K) @ B (K x N)."""

    transa: int  # for cuBLAS's first operand: B
    transb: int  # for its second: A
    m: int  # N
    n: int  # M
    k: int  # K
    lda: int
    ldb: int
    ldc: int


def gemm_args(
    m: int, n: int, k: int, a_strides: tuple[int, int], b_strides: tuple[int, int], ldc: int
) -> GemmArgs | None:
    """cuBLAS arguments for row-major C = A @ B given A's and B's (row, col) strides in elements.

    C^T (N x M, column-major with ld = ldc) = B^T A^T: cuBLAS's A is our B, its B our A.
    None when an operand's layout needs a copy first.
    """
    ob = operand(k, n, *b_strides)
    oa = operand(m, k, *a_strides)
    if ob is None or oa is None:
        return None
    return GemmArgs(ob.op, oa.op, n, m, k, ob.ld, oa.ld, ldc)


def batch_stride(shape: tuple[int, ...], strides: tuple[int, ...], batch: tuple[int, ...]) -> int | None:
    """One element stride stepping through an operand's (broadcast) batch dims, or None.

    ``shape``/``strides`` are the operand's batch dims (elements), right-aligned against
    the output's ``batch``. 0 when the operand is broadcast over the whole batch.
    """
    pad = len(batch) - len(shape)
    full_shape = (1,) * pad + tuple(shape)
    full_strides = (0,) * pad + tuple(strides)
    dims = [(b, (0 if s == 1 else st)) for b, s, st in zip(batch, full_shape, full_strides) if b != 1]
    if not dims:
        return 0
    step = dims[-1][1]
    expected = step
    for b, st in reversed(dims):
        if st != expected:
            return None
        expected = st * b
    return step


# -- the library -------------------------------------------------------------------------


def library_candidates(name: str, wheel_dirs: tuple[str, ...]) -> list[str]:
    """Where lib``name`` may lie: NVIDIA's CUDA wheels (``nvidia/<wheel_dir>``), the toolkit, the system."""
    paths: list[str] = []
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels

        for root in list(getattr(nvidia, "__path__", [])):
            for sub in wheel_dirs:
                paths += sorted(glob.glob(os.path.join(root, sub, f"lib{name}.so*")), reverse=True)
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", f"lib{name}.so*")), reverse=True)
    found = ctypes.util.find_library(name)
    if found:
        paths.append(found)
    return paths


def _candidates() -> list[str]:
    """Where libcublas may lie (nvidia/cu13/lib, nvidia/cublas/lib, ..., then the system); never cublasLt."""
    paths = library_candidates("cublas", ("cu13/lib", "cublas/lib", "cu12/lib"))
    paths += ["libcublas.so.13", "libcublas.so.12"]
    return [p for p in paths if "Lt" not in os.path.basename(p)]


def load_library() -> ctypes.CDLL:
    """libcublas, from the first candidate that loads."""
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise OSError("libcublas not found; tried " + "; ".join(errors[:6]))


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""


class Cublas:
    """One cuBLAS handle bound to one stream, with a fixed workspace (made outside any capture)."""

    def __init__(self, stream_ptr: int, workspace: Any, tf32: bool) -> None:
        lib = load_library()
        self._lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
        self._check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream_v2")
        self.workspace = workspace  # kept alive with the handle
        self._check(
            lib.cublasSetWorkspace_v2(
                self.handle, ctypes.c_void_p(int(workspace.ptr)), ctypes.c_size_t(WORKSPACE_BYTES)
            ),
            "cublasSetWorkspace_v2",
        )
        self.tf32 = tf32
        lib.cublasGemmEx.restype = ctypes.c_int
        lib.cublasGemmStridedBatchedEx.restype = ctypes.c_int
        self._one32, self._zero32 = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} returned cuBLAS status {status}")

    def gemm(
        self,
        args: GemmArgs,
        dtype: str,
        a_ptr: int,
        b_ptr: int,
        c_ptr: int,
        alpha: float = 1.0,
        beta: float = 0.0,
        batch: int = 1,
        strides: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """C = alpha * A @ B + beta * C, row-major, via GemmEx (batch 1) or GemmStridedBatchedEx."""
        dt = DATA_TYPES[dtype]
        compute = COMPUTE_32F_FAST_TF32 if self.tf32 and dtype == "float32" else COMPUTE_32F
        scale: type[ctypes.c_double] | type[ctypes.c_float] = ctypes.c_float
        if dtype == "float64":
            compute, scale = COMPUTE_64F, ctypes.c_double
        al, be = scale(alpha), scale(beta)
        # cuBLAS's A is our B and its B our A (C^T = B^T A^T)
        first, second = ctypes.c_void_p(b_ptr), ctypes.c_void_p(a_ptr)
        if batch == 1:
            status = self._lib.cublasGemmEx(
                self.handle, args.transa, args.transb, args.m, args.n, args.k, ctypes.byref(al),
                first, dt, args.lda, second, dt, args.ldb, ctypes.byref(be),
                ctypes.c_void_p(c_ptr), dt, args.ldc, compute, GEMM_DEFAULT,
            )  # fmt: skip
            self._check(status, "cublasGemmEx")
            return
        sa, sb, sc = strides
        status = self._lib.cublasGemmStridedBatchedEx(
            self.handle, args.transa, args.transb, args.m, args.n, args.k, ctypes.byref(al),
            first, dt, args.lda, ctypes.c_longlong(sb), second, dt, args.ldb, ctypes.c_longlong(sa),
            ctypes.byref(be), ctypes.c_void_p(c_ptr), dt, args.ldc, ctypes.c_longlong(sc), batch, compute, GEMM_DEFAULT,
        )  # fmt: skip
        self._check(status, "cublasGemmStridedBatchedEx")

    def close(self) -> None:
        """Destroy the handle."""
        if self.handle:
            self._lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
