"""dsp-cuda-graphs on a machine without CUDA: it installs, lists as unavailable with its
reason, AUTO falls through, and its pure-Python parts (the interval buffer planner, the
island split against its profile, the cuBLAS arguments for row-major products) are right."""

from __future__ import annotations

import dis
import itertools
import weakref
from typing import Any

import numpy as np
import pytest
from dsp_cuda_graphs.buffers import AllocationTrace, Interval, _free_callback, align, overlaps, plan_intervals
from dsp_cuda_graphs.cublas import OP_N, OP_T, batch_stride, gemm_args, operand
from dsp_cuda_graphs.plugin import CudaGraphsBackend

import dsp_core as dsp
from dsp_core.backends.discovery import discover
from dsp_core.plan.plan import Segment
from dsp_core.runtime.units import UnitKind, split_units


def _cuda_missing() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() < 1
    except Exception:  # noqa: BLE001
        return True


needs_no_gpu = pytest.mark.skipif(not _cuda_missing(), reason="checks the CPU-only behaviour")


# -- discovery -------------------------------------------------------------------------


def test_registered_through_its_entry_point() -> None:
    backend = next(b for b in discover().backends if b.name == "cuda_graphs")
    assert backend.distribution == "dsp-cuda-graphs"
    assert backend.platform == "cuda" and backend.captures
    assert backend.contract.needs_stable_addresses
    assert not backend.contract.tf32 and backend.contract.deterministic


@needs_no_gpu
def test_unavailable_with_a_reason_and_auto_falls_through() -> None:
    backend = next(b for b in discover().backends if b.name == "cuda_graphs")
    avail = backend.availability()
    assert not avail.ok
    assert "cupy not installed" in avail.reason or "CUDA" in avail.reason
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2, 3])
    g.output(g.Relu(x), "y")
    model = dsp.compile(g.build())
    assert "cuda_graphs" not in model.resolved_backends()


def test_tf32_option_is_in_the_config_table() -> None:
    from dsp_core import config

    opt = next(o for o in config.OPTIONS if o.name == "cublas_tf32")
    assert opt.env == "DSP_CUBLAS_TF32" and opt.default is False


# -- the interval planner --------------------------------------------------------------


def _check_layout(intervals: list[Interval], offsets: list[int], total: int) -> None:
    for i, j in itertools.combinations(range(len(intervals)), 2):
        a, b = intervals[i], intervals[j]
        if overlaps(a, b):
            ea, eb = offsets[i] + align(a.size), offsets[j] + align(b.size)
            assert ea <= offsets[j] or eb <= offsets[i], f"{a}@{offsets[i]} and {b}@{offsets[j]} share memory"
    for iv, off in zip(intervals, offsets):
        assert off % 256 == 0 and off + iv.size <= total


def test_disjoint_lifetimes_share_memory() -> None:
    ivs = [Interval(1000, 0, 2), Interval(1000, 2, 4), Interval(1000, 4, 6)]
    offsets, total = plan_intervals(ivs)
    assert offsets == [0, 0, 0] and total == align(1000)


def test_overlapping_lifetimes_do_not() -> None:
    ivs = [Interval(1000, 0, 5), Interval(500, 1, 3), Interval(300, 2, 6)]
    offsets, total = plan_intervals(ivs)
    _check_layout(ivs, offsets, total)
    assert total == align(1000) + align(500) + align(300)


def test_random_traces_never_alias_and_beat_no_reuse() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        trace = AllocationTrace()
        live: list[int] = []
        for _ in range(60):
            if live and rng.random() < 0.45:
                trace.free(live.pop(int(rng.integers(len(live)))))
            else:
                live.append(trace.alloc(int(rng.integers(1, 5000))))
        ivs = trace.intervals()
        offsets, total = plan_intervals(ivs)
        _check_layout(ivs, offsets, total)
        assert total <= sum(align(iv.size) for iv in ivs)


def test_the_tracer_s_free_callback_records_each_free_once() -> None:
    trace = AllocationTrace()
    live = {0x2000: (trace.alloc(64), object())}
    free = _free_callback(live, trace)
    assert free(0x1000) is None  # not traced (allocated before the warm-up): nothing to record
    free(0x2000, 0)
    free(0x2000, 0)  # freed twice: the second finds nothing
    assert trace.ends == [1] and live == {}


def test_the_free_callback_needs_no_global_at_interpreter_exit() -> None:
    """CuPy calls the free callback for an array that outlived its warm-up whenever it dies, at the
    latest at interpreter exit, after the builtins are torn down: a callback that looked up a global
    or a builtin (``int``, an ``except AttributeError``) there crashed a cold TRITON pipeline's
    process with SIGSEGV on the H200. The callback loads no global at all, so it has nothing to
    look up then."""
    free = _free_callback({}, AllocationTrace())
    loads = [i.opname for i in dis.get_instructions(free) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    assert loads == []


def test_free_callbacks_stay_reachable_while_memory_may_call_them() -> None:
    """A callback reachable only from garbage is cleared by the collector (a function loses its
    closure), and a CuPy memory of the same cycle freed after that called it: SIGSEGV in ``free``
    on the H200. Each callback is kept reachable from the module while anything else refers to it,
    and dropped when nothing does."""
    from dsp_cuda_graphs import buffers

    held = _free_callback({}, AllocationTrace())  # a live memory object's reference, in effect
    dropped = weakref.ref(_free_callback({}, AllocationTrace()))  # nothing refers to it but the module
    assert held in buffers._CALLBACKS and dropped() in buffers._CALLBACKS
    newest = _free_callback({}, AllocationTrace())  # a new one prunes the unreferenced
    assert held in buffers._CALLBACKS and newest in buffers._CALLBACKS
    assert dropped() is None  # pruned, then freed


def test_trace_keeps_unfreed_buffers_to_the_end() -> None:
    trace = AllocationTrace()
    a = trace.alloc(10)
    b = trace.alloc(20)
    trace.free(a)
    ivs = trace.intervals()
    assert ivs[a].end == 2 and ivs[b].end > trace.clock
    del b


# -- islands against the profile -------------------------------------------------------


def test_island_split_puts_excluded_and_host_sync_ops_in_gaps() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [4, 4])
    w = g.constant(np.eye(4, dtype=np.float32), name="w")
    h = g.Relu(g.MatMul(x, w))
    nz = g.NonZero(h)  # dynamic output size: a host sync
    y = g.Add(h, h)
    g.output(y, "y")
    g.output(nz, "nz")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    plan = model.plan()
    assert plan is not None
    backend = CudaGraphsBackend()
    pieces = split_units(plan, Segment(0, backend.name, "CUDA_GRAPHS", tuple(range(len(plan.slots)))), backend)
    kinds = {plan.slots[s].op: kind for kind, slots in pieces for s in slots}
    assert kinds["NonZero"] is UnitKind.GAP
    assert kinds["MatMul"] is UnitKind.ISLAND and kinds["Relu"] is UnitKind.ISLAND
    assert "RoiAlign" in backend.profile.excluded_ops
    assert backend.supports(_view("RoiAlign")) is None  # excluded ops are gaps here, not declined


def _view(op: str) -> object:
    from dsp_core.backends.base import SlotView
    from dsp_core.ops.registry import Trait

    return SlotView(0, op, "", Trait.NONE, {}, ("float32",), ("float32",))


# -- cuBLAS arguments for row-major products -------------------------------------------


def _emulate(args, a: np.ndarray, b: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Run what cuBLAS would compute (column-major) from the flat buffers and the arguments."""

    def colmajor(buf: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
        flat = buf.reshape(-1)
        return np.array([[flat[i + j * ld] for j in range(cols)] for i in range(rows)])

    def op_of(buf: np.ndarray, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
        # op(X) is rows x cols; X itself is cols x rows when transposed
        return colmajor(buf, cols, rows, ld).T if op == OP_T else colmajor(buf, rows, cols, ld)

    first = op_of(_base(b), args.transa, args.m, args.k, args.lda)
    second = op_of(_base(a), args.transb, args.k, args.n, args.ldb)
    c_cm = first @ second  # m x n column-major = C^T
    return c_cm.T


def _base(x: np.ndarray) -> np.ndarray:
    """The buffer a view starts at (views made below start at their base's first element)."""
    return x.base if x.base is not None else x


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(3, 4, 5), (1, 6, 2), (4, 1, 3), (2, 3, 1)])
def test_gemm_args_reproduce_row_major_products(ta: bool, tb: bool, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(1)
    a = np.ascontiguousarray(rng.standard_normal((k, m)) if ta else rng.standard_normal((m, k)))
    b = np.ascontiguousarray(rng.standard_normal((n, k)) if tb else rng.standard_normal((k, n)))
    av, bv = (a.T if ta else a), (b.T if tb else b)
    es = lambda x: tuple(s // x.itemsize for s in x.strides)  # noqa: E731
    args = gemm_args(m, n, k, es(av), es(bv), n)
    assert args is not None
    np.testing.assert_allclose(_emulate(args, av, bv), av @ bv, rtol=1e-12)


def test_operand_layouts() -> None:
    assert operand(3, 4, 4, 1) == operand(3, 4, 4, 1)
    assert operand(3, 4, 4, 1).op == OP_N and operand(3, 4, 4, 1).ld == 4  # type: ignore[union-attr]
    assert operand(3, 4, 1, 3).op == OP_T  # type: ignore[union-attr]
    assert operand(3, 4, 8, 2) is None  # neither rows nor columns contiguous
    assert operand(3, 4, 8, 1).ld == 8  # type: ignore[union-attr]  # a padded row stride


def test_batch_strides() -> None:
    assert batch_stride((2, 3), (30, 10), (2, 3)) == 10
    assert batch_stride((), (), (2, 3)) == 0  # broadcast over the whole batch
    assert batch_stride((1, 3), (99, 10), (2, 3)) is None  # broadcast over one dim only: needs a copy
    assert batch_stride((1, 1), (5, 5), (1, 1)) == 0


def test_every_host_read_input_names_an_input_its_op_takes() -> None:
    """HOST_INPUTS hands these inputs to the reference kernels as host arrays (read once when
    frozen, so a capture never copies them): each entry is an ONNX op DSP has, at input
    positions within the op's (min, max) input count (max -1: variadic)."""
    from dsp_cuda_graphs.segment import HOST_INPUTS

    from dsp_core.ops.registry import lookup

    for op, positions in HOST_INPUTS.items():
        entry = lookup(op, "")
        assert entry is not None, op
        most = entry.inputs[1]
        assert positions and all(0 <= p and (most < 0 or p < most) for p in positions), (op, positions, entry.inputs)


def _store_step(shift: int = 0) -> Any:
    """A GroupStep over numpy (CuPy's stand-in) whose 'kernel' writes rows into a KV buffer in place,
    ``shift`` positions past where the reference writes them."""
    from types import SimpleNamespace

    from dsp_cuda_graphs.fusion import GroupReport, GroupStep

    from dsp_core.ops.llm import store_rows

    def reference(buffer: np.ndarray, rows: np.ndarray, position: np.ndarray) -> np.ndarray:
        return store_rows(buffer, rows, position, axis=1)

    class Store(GroupStep):
        def launch(self, built: Any, inputs: Any) -> tuple[Any, ...]:
            buffer, rows, position = inputs
            return (store_rows(buffer, rows, position + shift, axis=1),)

    cp = SimpleNamespace(zeros_like=np.zeros_like, asnumpy=np.asarray)
    steps = [(reference, (0, 1, 2), 3, ())]
    return Store(GroupReport(0, "store", (0,)), steps, (0, 1, 2), (3,), cp, lambda: False, 0.0)


@pytest.mark.parametrize("shift, ok", [(0, True), (1, False)])
def test_an_in_place_step_is_checked_on_zeroed_copies_of_what_it_writes(shift: int, ok: bool) -> None:
    """GroupStep.check_in_place: the reference and the kernel each write a zeroed copy of the buffer
    (the real one already holds the reference's rows, so comparing it would prove nothing); a kernel
    writing elsewhere disagrees, and only a kernel that agrees writes the real buffer."""
    step = _store_step(shift)
    buffer = np.full((1, 6, 2), 7.0, np.float32)
    rows, position = np.arange(4, dtype=np.float32).reshape(1, 2, 2), np.array([2])
    step.reference([buffer, rows, position])  # what the segment's first run does before the check
    before = buffer.copy()
    bad = step.check_in_place(None, [buffer, rows, position], [0])
    assert (bad is None) is ok, bad
    np.testing.assert_array_equal(buffer, before)  # the rows the reference wrote, written again or untouched
    if not ok:
        assert buffer[0, 4:].tolist() == [[7.0, 7.0], [7.0, 7.0]]  # the wrong rows never reached the real buffer


def test_a_kernels_bfloat16_outputs_are_compared_within_the_tolerance() -> None:
    """ml_dtypes' bfloat16 is a numpy dtype of kind "V": still a float, compared within the tolerance
    (not element for element, as integers and booleans are)."""
    from dsp_cuda_graphs.fusion import mismatch

    want = np.linspace(-3, 3, 50).astype("bfloat16")
    near = (want.astype(np.float32) * (1 + 2**-8)).astype("bfloat16")  # one bf16 step off: 2**-7 of 2..4
    assert mismatch([near], [want], 1e-2, np.asarray) is None
    far = (want.astype(np.float32) + 0.5).astype("bfloat16")
    assert "max abs error" in str(mismatch([far], [want], 5e-3, np.asarray))
    nan = want.copy()
    nan[3] = np.nan
    assert "NaNs" in str(mismatch([nan], [want], 5e-3, np.asarray))


def test_one_rule_of_agreement_for_two_backends_outputs() -> None:
    """``base.disagreement``, the rule a fused kernel (``mismatch``) and a contest's rival are held to:
    the largest absolute error against the expected output's largest finite magnitude; NaNs and
    infinities where the expected output has them; other dtypes equal; shapes equal."""
    from dsp_core.backends.base import disagreement

    want = np.array([100.0, -0.001, np.inf, np.nan], np.float32)
    assert disagreement(want + np.array([0.009, 0.009, 0, 0], np.float32), want, 1e-4) is None  # 0.009 <= 1e-4 x 100
    assert "max abs error" in str(disagreement(want + np.array([0, 0.02, 0, 0], np.float32), want, 1e-4))
    assert "infinities" in str(disagreement(np.array([100.0, -0.001, -np.inf, np.nan], np.float32), want, 1e-4))
    assert "NaNs" in str(disagreement(np.array([100.0, np.nan, np.inf, np.nan], np.float32), want, 1e-4))
    assert disagreement(np.arange(3), np.arange(3), 0.0) is None
    assert "1 of 3 elements differ" == disagreement(np.array([0, 1, 3]), np.arange(3), 0.5)
    assert "shape" in str(disagreement(np.zeros(2), np.zeros(3), 1.0))
