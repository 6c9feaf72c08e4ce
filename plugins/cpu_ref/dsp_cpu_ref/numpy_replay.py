"""NUMPY_REPLAY: a segment captured as one generated numpy function over fixed buffers.

EMULATED_REPLAY's lifecycle (warm-up, one fixed buffer per produced value, a recording
with the input arrays baked in), made fast for the steady replay: ``capture`` turns the
recording into straight-line code whose every argument is a bound name::

    def replay():
        f0(a0_0, a0_1, o0)                  # np.dot(x, w1, h): written in place
        f1(a1_0, c1_0, out=o1)              # np.maximum(h, 0, out=r)
        copyto(o2, k2(a2_0), casting='no')  # a kernel without an in-place form: copied once

No dict, no list of values, no per-step lookup. A step runs in place when its kernel has a
form that writes a given buffer (a bare numpy ufunc, MatMul, Relu: ``into_form``)
and that form's result, computed at capture on the real inputs, is bit-equal to the
reference kernel's: the replay is the reference, bit for bit, with fewer allocations.
Every other step calls its reference kernel and copies the result into its buffer.

What it is for: a small model, or a short segment, whose cost is the per-call overhead of a
native runtime (the 3-node MLP of the CPU race: ONNX Runtime's bound call is ~3.5 us, this
replay's three numpy calls ~2 us). It holds a buffer for every value it produces (the
reference frees them as it goes), so it declines segments whose values would hold more than
``NUMPY_REPLAY_MAX_BYTES``: there the kernels' cost dominates and a native runtime wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dsp_core.backends.base import Backend, CaptureFailed
from dsp_core.plan.plan import Plan, Segment
from dsp_cpu_ref.emulated import EmulatedSegment, Recorded

# The largest total of value bytes a segment's fixed buffers may hold (the values it produces).
NUMPY_REPLAY_MAX_BYTES = 1 << 20

_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


# An in-place form: the numpy function, constants passed after the step's inputs, and whether
# the buffer goes as ``out=`` (a ufunc) or as the last positional argument (np.dot, np.matmul).
Into = tuple[Callable[..., Any], tuple[Any, ...], bool]


def into_form(op: str, kernel: Any, args: tuple[Any, ...]) -> Into | None:
    """The form of a step that writes its one result into a given buffer, or None.

    Only where it is the reference's own numpy call: a specialized kernel that is a bare
    ufunc, Relu (``np.maximum(x, 0)``), MatMul of two equal float32/float64 operands
    (float16 is widened by the reference, not here): ``np.dot`` for two C-ordered matrices
    (the same BLAS call as ``np.matmul`` there, at half the call's cost), else ``np.matmul``.
    The capture still checks each form's result against the reference kernel's, bit for bit.
    """
    if isinstance(kernel, np.ufunc):
        return (kernel, (), True) if kernel.nout == 1 else None
    arrays = all(isinstance(a, np.ndarray) for a in args)
    if op == "Relu" and len(args) == 1 and arrays:
        return np.maximum, (0,), True
    if op == "MatMul" and len(args) == 2 and arrays and args[0].dtype == args[1].dtype and args[0].dtype in _FLOATS:
        a, b = args
        if a.ndim == 2 and b.ndim == 2 and a.flags.c_contiguous and b.flags.c_contiguous:
            return np.dot, (), False
        return np.matmul, (), False
    return None


def _same_bits(a: Any, b: Any) -> bool:
    """Bit-equal arrays (NaNs, signed zeros and all)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.hasobject:
        return bool(np.array_equal(a, b))
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


class NumpyReplaySegment(EmulatedSegment):
    """EmulatedSegment whose capture also generates the replay as one straight-line function."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        self._fast: Callable[[], Any] | None = None
        self.in_place_steps = 0  # steps of the recording that write their buffer with out= (the rest copy)

    def _prepare(self, values: list[Any]) -> None:
        specs = [self._specs[o] for o in self._produced if o in self._specs]  # an alias (a KV store) has no buffer
        size = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype, _ in specs)
        if size > NUMPY_REPLAY_MAX_BYTES:
            raise CaptureFailed(
                f"its values hold {size / 2**20:.1f} MiB (> {NUMPY_REPLAY_MAX_BYTES >> 20} MiB) of fixed buffers: "
                "it runs eagerly, as the reference does"
            )
        super()._prepare(values)

    def _capture(self, values: list[Any]) -> None:
        super()._capture(values)
        self._fast = self._generate(self._recording)

    def _generate(self, recording: list[Recorded]) -> Callable[[], Any]:
        """The recording as one function; each step runs once here, in order, so that the
        in-place check of a step reads the real values of the steps before it."""
        with np.errstate(all="ignore"):  # as the reference kernels run: warnings are not DSP's to raise
            return self._generate_steps(recording)

    def _generate_steps(self, recording: list[Recorded]) -> Callable[[], Any]:
        namespace: dict[str, Any] = {"copyto": np.copyto}
        lines: list[str] = []
        in_place = 0
        for n, ((kernel, args, out_bufs, single), s) in enumerate(zip(recording, self._order)):
            names = []
            for j, a in enumerate(args):
                namespace[f"a{n}_{j}"] = a
                names.append(f"a{n}_{j}")
            call = f"k{n}({', '.join(names)})"
            namespace[f"k{n}"] = kernel
            if single and out_bufs[0] is None:  # writes its first input in place (a KV store)
                lines.append(f"    {call}")
                continue
            if single:
                namespace[f"o{n}"] = out_bufs[0]
                into = self._checked_into(self._plan.slots[s].op, kernel, args, out_bufs[0])
                if into is not None:
                    fn, extra, keyword = into
                    namespace[f"f{n}"] = fn
                    for j, c in enumerate(extra):
                        namespace[f"c{n}_{j}"] = c
                    params = [*names, *(f"c{n}_{j}" for j in range(len(extra))), f"out=o{n}" if keyword else f"o{n}"]
                    lines.append(f"    f{n}({', '.join(params)})")
                    in_place += 1
                else:
                    lines.append(f"    copyto(o{n}, {call}, casting='no')")
                continue
            lines.append(f"    r = {call}")
            results = kernel(*args)
            for j, buf in enumerate(out_bufs):
                if buf is not None:
                    np.copyto(buf, results[j], casting="no")
                    namespace[f"o{n}_{j}"] = buf
                    lines.append(f"    copyto(o{n}_{j}, r[{j}], casting='no')")
        source = "def replay():\n" + ("\n".join(lines) if lines else "    pass") + "\n"
        code = compile(source, f"<dsp numpy_replay {self._plan.graph_name}#{self.segment.index}>", "exec")
        exec(code, namespace)  # noqa: S102  (source made of integers and fixed names only)
        self.in_place_steps = in_place
        fast: Callable[[], Any] = namespace["replay"]
        return fast

    @staticmethod
    def _checked_into(op: str, kernel: Any, args: tuple[Any, ...], buf: np.ndarray) -> Into | None:
        """The step's in-place form when, on the capture's inputs, it gives the reference's bits.

        Either way ``buf`` holds the step's result afterwards (the reference's, when the form is refused).
        """
        expected = kernel(*args)
        into = into_form(op, kernel, args)
        if into is not None and isinstance(expected, np.ndarray):
            fn, extra, keyword = into
            try:
                if expected.dtype == buf.dtype and expected.shape == buf.shape:
                    if keyword:
                        fn(*args, *extra, out=buf)
                    else:
                        fn(*args, *extra, buf)
                    if _same_bits(buf, expected):
                        return into
            except Exception:  # noqa: BLE001  (no in-place form for these operands: the copying form)
                pass
        np.copyto(buf, expected, casting="no")
        return None

    def _run_recording(self) -> None:
        assert self._fast is not None
        self._fast()

    def _replay_call(self, values: list[Any]) -> Callable[[], Any] | None:
        # The steady replay: the inputs are the ones baked in (nothing can move there) and the
        # buffers are already in ``values`` (the last replay put them there).
        return self._fast

    def _release(self) -> None:
        super()._release()
        self._fast = None


def segment_bytes(plan: Plan, segment: Segment) -> int | None:
    """Bytes of the values ``segment`` produces (its fixed buffers), or None when a shape is not static."""
    total = 0
    for s in segment.slots:
        for v in plan.slots[s].outputs:
            if v is None:
                continue
            dtype, shape = plan.ref_info(v)
            if dtype is None or shape is None or not all(isinstance(d, int) for d in shape):
                return None
            try:
                itemsize = np.dtype(dtype).itemsize
            except TypeError:
                itemsize = 8
            total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


__all__ = ["NUMPY_REPLAY_MAX_BYTES", "NumpyReplaySegment", "into_form", "segment_bytes"]
