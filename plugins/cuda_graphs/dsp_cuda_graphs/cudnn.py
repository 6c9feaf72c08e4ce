"""A small owned cuDNN binding (ctypes) for convolutions inside captured CUDA graphs.

CuPy no longer ships cuDNN bindings, and convolutions as im2col plus a product move far more
bytes than cuDNN's kernels. This binding is the one way DSP calls cuDNN: one handle per
device, bound to the backend's stream (``cudnnSetStream``); per convolution layout (shapes,
dtype, attributes) the descriptors are made and an algorithm is chosen once, by timing the
candidates (``cudnnFindConvolutionForwardAlgorithmEx``) before any capture, and its fixed
workspace is allocated then, so ``cudnnConvolutionForward`` inside a capture allocates
nothing. Where the contract is deterministic only deterministic algorithms are taken.

``conv_geometry`` (pure Python, unit-tested on the CPU) turns ONNX Conv attributes into what
cuDNN takes, or says why cuDNN cannot run that convolution (asymmetric padding, an
unsupported rank or dtype): the caller then runs the reference kernel.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

from dsp_cuda_graphs.cublas import library_candidates

# cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t, cudnnMathType_t (cudnn_graph.h / cudnn_cnn.h)
DATA_FLOAT, DATA_DOUBLE, DATA_HALF, DATA_BFLOAT16 = 0, 1, 2, 9
FORMAT_NCHW = 0
CROSS_CORRELATION = 1
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3
DETERMINISTIC = 1
DATA_TYPES = {"float32": DATA_FLOAT, "float64": DATA_DOUBLE, "float16": DATA_HALF, "bfloat16": DATA_BFLOAT16}
FIND_WORKSPACE_BYTES = 256 << 20  # the most workspace an algorithm may take
ALGO_COUNT = 10
FIND_ROUNDS = 3  # searches per layout; each algorithm keeps its best time (Convolution.choose)


class Unsupported(Exception):
    """cuDNN cannot run this convolution as given; the reference kernel runs it."""


@dataclass(frozen=True)
class Geometry:
    """A convolution as cuDNN takes it: 2-D or 3-D spatial dims (1-D is lifted to 2-D)."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int
    lifted: bool  # a 1-D convolution run as 2-D with a unit height


def conv_geometry(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    dtype: str,
    *,
    auto_pad: str = "NOTSET",
    dilations: Any = None,
    group: int = 1,
    kernel_shape: Any = None,
    pads: Any = None,
    strides: Any = None,
) -> Geometry:
    """ONNX Conv attributes as cuDNN arguments; ``Unsupported`` with the reason where it cannot."""
    if dtype not in DATA_TYPES:
        raise Unsupported(f"dtype {dtype}")
    nd = len(x_shape) - 2
    if nd not in (1, 2, 3) or len(w_shape) != len(x_shape):
        raise Unsupported(f"{nd}-D convolution")
    if kernel_shape is not None and tuple(kernel_shape) != tuple(w_shape[2:]):
        raise Unsupported(f"kernel_shape {kernel_shape} differs from the weight's {w_shape[2:]}")
    ks = tuple(int(k) for k in w_shape[2:])
    st = tuple(int(s) for s in strides) if strides else (1,) * nd
    dl = tuple(int(d) for d in dilations) if dilations else (1,) * nd
    spatial = tuple(int(v) for v in x_shape[2:])
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d in zip(spatial, ks, st, dl):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            small, big = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else big)
            end.append(big if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    else:
        p = [int(v) for v in pads] if pads else [0] * (2 * nd)
        begin, end = p[:nd], p[nd:]
    if begin != end:
        raise Unsupported(f"asymmetric padding {begin} / {end}")
    if int(group) < 1 or x_shape[1] != w_shape[1] * int(group) or w_shape[0] % int(group):
        raise Unsupported(f"channels {x_shape[1]} / weight {w_shape} with group {group}")
    out = tuple((n + 2 * p - ((k - 1) * d + 1)) // s + 1 for n, p, k, s, d in zip(spatial, begin, ks, st, dl))
    if any(o < 1 for o in out) or 0 in x_shape:
        raise Unsupported(f"an empty output {out}")
    y_shape = (int(x_shape[0]), int(w_shape[0]), *out)
    if nd == 1:  # as 2-D, height 1
        return Geometry(
            (*x_shape[:2], 1, spatial[0]), (*w_shape[:2], 1, ks[0]), (*y_shape[:2], 1, out[0]),
            (0, begin[0]), (1, st[0]), (1, dl[0]), int(group), True,
        )  # fmt: skip
    return Geometry(
        tuple(int(v) for v in x_shape), tuple(int(v) for v in w_shape), y_shape,
        tuple(begin), st, dl, int(group), False,
    )  # fmt: skip


def packed_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def load_library() -> ctypes.CDLL:
    """libcudnn (9 or 8), from the first candidate that loads."""
    paths = library_candidates("cudnn", ("cu13/lib", "cudnn/lib", "cu12/lib")) + ["libcudnn.so.9", "libcudnn.so.8"]
    errors = []
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise OSError("libcudnn not found; tried " + "; ".join(errors[:6]))


class CudnnError(RuntimeError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS."""


class _AlgoPerf(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_int),
        ("status", ctypes.c_int),
        ("time", ctypes.c_float),
        ("memory", ctypes.c_size_t),
        ("determinism", ctypes.c_int),
        ("mathType", ctypes.c_int),
        ("reserved", ctypes.c_int * 3),
    ]


def _ints(values: tuple[int, ...]) -> Any:
    return (ctypes.c_int * len(values))(*values)


@dataclass(frozen=True)
class Timing:
    """One algorithm's result of a cuDNN search (``cudnnConvolutionFwdAlgoPerf_t``)."""

    algo: int
    status: int  # 0: it ran
    time: float  # ms
    memory: int  # workspace bytes
    determinism: int


def pick_algorithm(
    rounds: list[list[Timing]], max_workspace: int, deterministic: bool
) -> tuple[Timing, dict[int, float]]:
    """The algorithm with the best time over every round of the search that ran, fits the workspace
    and is deterministic where asked; with each algorithm's best time (ms). Unsupported: none."""
    best: dict[int, Timing] = {}
    for timing in (t for r in rounds for t in r):
        if timing.status == 0 and (timing.algo not in best or timing.time < best[timing.algo].time):
            best[timing.algo] = timing
    usable = [
        t for t in best.values() if t.memory <= max_workspace and (t.determinism == DETERMINISTIC or not deterministic)
    ]
    if not usable:
        raise Unsupported("no cuDNN algorithm for this convolution" + (" is deterministic" if deterministic else ""))
    return min(usable, key=lambda t: t.time), {a: t.time for a, t in best.items()}


class Convolution:
    """One convolution layout: its descriptors, chosen algorithm and fixed workspace."""

    def __init__(self, lib: ctypes.CDLL, geometry: Geometry, dtype: str, tf32: bool, deterministic: bool) -> None:
        self.lib, self.geometry, self.dtype = lib, geometry, dtype
        self.deterministic = deterministic
        dt = DATA_TYPES[dtype]
        g = geometry
        self.x_desc = self._tensor(dt, g.x_shape)
        self.y_desc = self._tensor(dt, g.y_shape)
        self.w_desc = ctypes.c_void_p()
        _check(lib.cudnnCreateFilterDescriptor(ctypes.byref(self.w_desc)), "cudnnCreateFilterDescriptor")
        _check(
            lib.cudnnSetFilterNdDescriptor(self.w_desc, dt, FORMAT_NCHW, len(g.w_shape), _ints(g.w_shape)),
            "cudnnSetFilterNdDescriptor",
        )
        self.conv_desc = ctypes.c_void_p()
        _check(lib.cudnnCreateConvolutionDescriptor(ctypes.byref(self.conv_desc)), "cudnnCreateConvolutionDescriptor")
        compute = DATA_DOUBLE if dtype == "float64" else DATA_FLOAT
        n = len(g.pads)
        _check(
            lib.cudnnSetConvolutionNdDescriptor(
                self.conv_desc, n, _ints(g.pads), _ints(g.strides), _ints(g.dilations), CROSS_CORRELATION, compute
            ),
            "cudnnSetConvolutionNdDescriptor",
        )
        _check(lib.cudnnSetConvolutionGroupCount(self.conv_desc, g.groups), "cudnnSetConvolutionGroupCount")
        math_type = TENSOR_OP_MATH if dtype in ("float16", "bfloat16") or tf32 else FMA_MATH
        if dtype == "float64":
            math_type = DEFAULT_MATH
        _check(lib.cudnnSetConvolutionMathType(self.conv_desc, math_type), "cudnnSetConvolutionMathType")
        scale = ctypes.c_double if dtype == "float64" else ctypes.c_float
        self.one, self.zero = scale(1.0), scale(0.0)
        self.algo: int | None = None
        self.workspace: Any = None
        self.workspace_bytes = 0
        self.timings_ms: dict[int, float] = {}

    def _tensor(self, dt: int, shape: tuple[int, ...]) -> ctypes.c_void_p:
        desc = ctypes.c_void_p()
        _check(self.lib.cudnnCreateTensorDescriptor(ctypes.byref(desc)), "cudnnCreateTensorDescriptor")
        _check(
            self.lib.cudnnSetTensorNdDescriptor(desc, dt, len(shape), _ints(shape), _ints(packed_strides(shape))),
            "cudnnSetTensorNdDescriptor",
        )
        return desc

    def choose(self, handle: ctypes.c_void_p, cp: Any, x: Any, w: Any, y: Any) -> None:
        """Time the algorithms on these buffers (outside any capture); keep the fastest that fits.

        The search runs ``FIND_ROUNDS`` times and each algorithm keeps its best time: an
        algorithm's first timing can include loading its kernels (CUDA loads modules lazily) or
        another process's work on a shared GPU, and one such timing made the slowest algorithm
        look fastest for a third of ResNet-50's layers (benchmarks/results/gpu_2026-12-03e/).
        """
        scratch = cp.empty(FIND_WORKSPACE_BYTES, dtype=cp.uint8)
        rounds: list[list[Timing]] = []
        for _ in range(FIND_ROUNDS):
            found = ctypes.c_int(0)
            perf = (_AlgoPerf * ALGO_COUNT)()
            _check(
                self.lib.cudnnFindConvolutionForwardAlgorithmEx(
                    handle, self.x_desc, _ptr(x), self.w_desc, _ptr(w), self.conv_desc, self.y_desc, _ptr(y),
                    ALGO_COUNT, ctypes.byref(found), perf, _ptr(scratch), ctypes.c_size_t(FIND_WORKSPACE_BYTES),
                ),
                "cudnnFindConvolutionForwardAlgorithmEx",
            )  # fmt: skip
            rounds.append(
                [
                    Timing(int(p.algo), int(p.status), float(p.time), int(p.memory), int(p.determinism))
                    for p in perf[: found.value]
                ]
            )
        best, self.timings_ms = pick_algorithm(rounds, FIND_WORKSPACE_BYTES, self.deterministic)
        self.algo, self.workspace_bytes = best.algo, best.memory
        self.workspace = cp.empty(max(self.workspace_bytes, 1), dtype=cp.uint8)

    def forward(self, handle: ctypes.c_void_p, x: Any, w: Any, y: Any) -> None:
        """y = conv(x, w): one cuDNN call on the handle's stream, nothing allocated."""
        assert self.algo is not None
        _check(
            self.lib.cudnnConvolutionForward(
                handle, ctypes.byref(self.one), self.x_desc, _ptr(x), self.w_desc, _ptr(w), self.conv_desc,
                self.algo, _ptr(self.workspace), ctypes.c_size_t(self.workspace_bytes), ctypes.byref(self.zero),
                self.y_desc, _ptr(y),
            ),
            "cudnnConvolutionForward",
        )  # fmt: skip

    def close(self) -> None:
        """Destroy the descriptors."""
        for fn, desc in (
            (self.lib.cudnnDestroyTensorDescriptor, self.x_desc),
            (self.lib.cudnnDestroyTensorDescriptor, self.y_desc),
            (self.lib.cudnnDestroyFilterDescriptor, self.w_desc),
            (self.lib.cudnnDestroyConvolutionDescriptor, self.conv_desc),
        ):
            if desc:
                fn(desc)


class Cudnn:
    """One cuDNN handle bound to one stream; convolution layouts made and tuned on first use."""

    def __init__(self, stream_ptr: int, tf32: bool, deterministic: bool) -> None:
        self.lib = load_library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cudnnCreate(ctypes.byref(self.handle)), "cudnnCreate")
        _check(self.lib.cudnnSetStream(self.handle, ctypes.c_void_p(stream_ptr)), "cudnnSetStream")
        self.tf32, self.deterministic = tf32, deterministic
        self.layouts: dict[tuple[Any, ...], Convolution | Unsupported] = {}

    def layout(
        self, key: tuple[Any, ...], geometry: Geometry, dtype: str, cp: Any, x: Any, w: Any, y: Any
    ) -> Convolution:
        """The tuned layout for ``key``, made now (outside a capture) the first time; Unsupported is remembered."""
        got = self.layouts.get(key)
        if got is None:
            conv = Convolution(self.lib, geometry, dtype, self.tf32, self.deterministic)
            try:
                conv.choose(self.handle, cp, x, w, y)
                got = conv
            except (Unsupported, CudnnError) as exc:
                conv.close()
                got = exc if isinstance(exc, Unsupported) else Unsupported(str(exc))
            self.layouts[key] = got
        if isinstance(got, Unsupported):
            raise got
        return got


def _ptr(x: Any) -> ctypes.c_void_p:
    return ctypes.c_void_p(int(x.data.ptr))


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CudnnError(f"{what} returned cuDNN status {status}")
