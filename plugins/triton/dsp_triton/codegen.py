"""Triton source for one fusion group, from its slots and the concrete shapes of one step.

Pure Python: nothing here imports Triton or touches a GPU, so the generator is tested on
any machine. A group is described by a ``GroupSpec`` (its nodes, every value's shape and
dtype, the element strides of what it reads, small constant inputs read on the host);
``generate`` returns the source of one ``@triton.jit`` kernel and how to launch it, or
raises ``Unsupported`` with the reason (the group then runs on the reference kernels).

How a kernel is built. Every value is computed *at an index*: an output is requested at
the index of the lane that stores it, and each op asks its inputs for the index it needs
(an elementwise op the broadcast of its own index, a transpose the permuted index, a
reshape the same flat position in the input's shape, a slice the shifted one, a gather
the row the index tensor names). Reads from outside the group are loads at those
indexes, through the input's real strides; an index asked twice is computed once. So
injective ops cost no kernel: they are index arithmetic. Shapes, strides and constants
are literals in the source: a kernel is specialised to one step's layout (a plan is for
one shape signature), and its only arguments are pointers.

Templates (docs/fusion.md):
- ``pointwise`` (also ``copy``): one lane per element of the iteration space (the largest
  group output), ``BLOCK`` lanes per program;
- ``row_reduction``: one program per row of the reduction's input, the whole row in
  ``RBLOCK`` lanes (fp32 accumulation); values of the row space are lane vectors, values
  of the outer space (a mean, a max) are scalars of the program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core import config
from dsp_core.plan.fusion import VIEW_OPS
from dsp_core.plan.kernelspec import ATT_ACC as ATT_ACC
from dsp_core.plan.kernelspec import ATT_L as ATT_L
from dsp_core.plan.kernelspec import ATT_M as ATT_M
from dsp_core.plan.kernelspec import (  # the group spec's types, re-exported: codegen.GroupSpec, ...
    INDEX_OPS,
    ROW_VALUED_OPS,
    AttentionValues,
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

# numpy dtype name -> Triton dtype
TL_DTYPES = {
    "float16": "tl.float16",
    "bfloat16": "tl.bfloat16",
    "float32": "tl.float32",
    "float64": "tl.float64",
    "int8": "tl.int8",
    "int16": "tl.int16",
    "int32": "tl.int32",
    "int64": "tl.int64",
    "uint8": "tl.uint8",
    "uint16": "tl.uint16",
    "uint32": "tl.uint32",
    "uint64": "tl.uint64",
    "bool": "tl.int1",
}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
HALF = frozenset({"float16", "bfloat16"})

MAX_ROW = 16384  # the row template keeps a whole row in registers
# Ops whose reference kernel is a view on CuPy (no kernel at all): a group of only these
# runs them (a generated copy would add a kernel); inside a bigger group they are index arithmetic.
VIEW_ON_CUPY = frozenset(
    {"Slice", "Transpose", "Expand", "Split", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity"}
)
MAX_SOURCE_LINES = 4000  # a group whose kernel would be larger runs unfused
MAX_FLASH_HEAD = 128  # head size the flash kernel holds in registers (q's block, the accumulator)
MAX_PRELOAD = 8192  # weight elements one program of a product may load before it waits
WAIT_MARKER = "    # the loads above read constants only: a dependent launch waits here"


@dataclass(frozen=True)
class Kernel:
    """Generated source and how to launch it."""

    source: str
    name: str
    args: tuple[int, ...]  # value ids, in argument order: inputs read, then outputs stored
    n_inputs: int
    grid: tuple[int, int, int]
    num_warps: int
    block: int  # BLOCK (pointwise) or RBLOCK (row)
    template: str
    # KV stores the kernel makes (dsp::KVScatter as its last store): (output, buffer, update,
    # position, axis); the output *is* the buffer, written in place through an input pointer
    kv_stores: tuple[tuple[int, int, int, int, int], ...] = ()
    # whether it may launch as a programmatic dependent (DSP_TRITON_PDL); the flash kernel may not
    dependent: bool = True


# Which inputs of an op are data (loaded); the rest are shape-like (read on the host or implied).
def data_inputs(node: NodeSpec) -> tuple[int, ...]:
    op = node.op
    if op in ("Reshape", "Expand", "Squeeze", "Unsqueeze", "Slice", "Split", "Transpose", "Flatten", "Identity"):
        return (0,)
    if op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2"):
        return (0,)
    if op in ("ReduceLogSumExp", "Softmax", "LogSoftmax"):
        return (0,)
    return tuple(k for k, r in enumerate(node.inputs) if r is not None)


# an index along one axis of a 2-D tile (``rl[None, :]``), and a mask term bounding one (``(rl[None, :] < 512)``)
_TILE_AXIS = re.compile(r"^(r[a-z]+)\[(None, :|:, None)\]$")
_TILE_BOUND = re.compile(r"^\(?(?P<name>r[a-z]+)\[(?P<where>None, :|:, None)\] < (?P<bound>\w+)\)?$")


@dataclass(frozen=True)
class Idx:
    """An index into a value: one expression per dim, and whether each varies across lanes."""

    dims: tuple[str, ...]
    lane: tuple[bool, ...]

    @property
    def varies(self) -> bool:
        return any(self.lane)


def _strip(shape: Sequence[int], idx: Idx) -> tuple[tuple[int, ...], tuple[str, ...]]:
    keep = [k for k, d in enumerate(shape) if d != 1]
    return tuple(shape[k] for k in keep), tuple(idx.dims[k] for k in keep)


class _Emitter:
    """Lines of the kernel body with common subexpressions named once."""

    def __init__(self, tag: str = "", indent: str = "    ") -> None:
        self.lines: list[str] = []
        self.names: dict[str, str] = {}
        self.lane_names: set[str] = set()
        self.tag = tag  # names of a nested body (the product's K loop) stay apart from the outer ones
        self.indent = indent

    def let(self, expr: str, lane: bool, prefix: str = "t") -> str:
        if expr.isidentifier() or _is_int(expr):
            return expr
        name = self.names.get(expr)
        if name is None:
            name = f"{prefix}{self.tag}{len(self.names)}"
            self.names[expr] = name
            self.lines.append(f"{self.indent}{name} = {expr}")
            if lane:
                self.lane_names.add(name)
        return name


def _is_int(s: str) -> bool:
    return s.lstrip("-").isdigit()


class _Gen:
    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.em = _Emitter()
        self.producer: dict[int, tuple[NodeSpec, int]] = {}
        for node in spec.nodes:
            for k, v in enumerate(node.outputs):
                if v is not None:
                    self.producer[v] = (node, k)
        self.inputs = set(spec.inputs)
        self.args: list[int] = []  # input value ids in argument order
        self.memo: dict[tuple[int, tuple[str, ...]], tuple[str, bool]] = {}
        self.mask = "mask"
        self.narrow = False  # _narrow_load: a tile's value that varies along one axis loads as a vector
        self.dependent = True  # Kernel.dependent
        self.row: tuple[int, ...] | None = None
        self.row_idx: Idx | None = None
        self.scalars: dict[int, str] = {}  # row template: reduction outputs per program
        self.rowvals: dict[int, str] = {}  # row template: Softmax/LayerNorm outputs (lane vectors)
        # product and attention templates: value -> (its name, the lane index it exists at)
        self.lane_values: dict[int, tuple[str, tuple[str, ...]]] = {}
        self.store_masks: dict[int, str] = {}  # output -> its store mask when not every lane stores it
        # product template with a norm prologue: norm output -> (mean, inverse std) of its row
        self.looped_norms: dict[int, tuple[str, str]] = {}

    # -- indexes -------------------------------------------------------------------------
    def unflatten(self, flat: str, shape: Sequence[int], lane: bool) -> Idx:
        st = row_major(shape)
        dims: list[str] = []
        for k, d in enumerate(shape):
            if d == 1:
                dims.append("0")
                continue
            expr = flat if st[k] == 1 else f"({flat} // {st[k]})"
            if k > 0 and any(shape[j] != 1 for j in range(k)):
                expr = f"({expr} % {d})"
            dims.append(self.em.let(expr, lane, "i"))
        return Idx(tuple(dims), tuple(lane and d != "0" for d in dims))

    def flatten(self, idx: Idx, shape: Sequence[int]) -> tuple[str, bool]:
        st = row_major(shape)
        terms = [d if st[k] == 1 else f"{d} * {st[k]}" for k, d in enumerate(idx.dims) if shape[k] != 1 and d != "0"]
        if not terms:
            return "0", False
        return self.em.let(" + ".join(terms), idx.varies, "f"), idx.varies

    def reshape(self, idx: Idx, out_shape: Sequence[int], in_shape: Sequence[int]) -> Idx:
        s_out, d_out = _strip(out_shape, idx)
        if s_out == tuple(d for d in in_shape if d != 1):
            it = iter(zip(d_out, (idx.lane[k] for k, d in enumerate(out_shape) if d != 1)))
            dims, lane = [], []
            for d in in_shape:
                if d == 1:
                    dims.append("0")
                    lane.append(False)
                else:
                    e, ln = next(it)
                    dims.append(e)
                    lane.append(ln)
            return Idx(tuple(dims), tuple(lane))
        flat, varies = self.flatten(idx, out_shape)
        return self.unflatten(flat, in_shape, varies)

    @staticmethod
    def broadcast(idx: Idx, out_shape: Sequence[int], in_shape: Sequence[int]) -> Idx:
        off = len(out_shape) - len(in_shape)
        if off < 0:
            raise Unsupported(f"broadcast of {list(in_shape)} to the smaller {list(out_shape)}")
        dims, lane = [], []
        for k, d in enumerate(in_shape):
            o = out_shape[off + k]
            if d == 1:
                dims.append("0")
                lane.append(False)
            elif d == o:
                dims.append(idx.dims[off + k])
                lane.append(idx.lane[off + k])
            else:
                raise Unsupported(f"shapes {list(in_shape)} and {list(out_shape)} do not broadcast")
        return Idx(tuple(dims), tuple(lane))

    def batch_index(self, flat: str, batch: Sequence[int]) -> Idx:
        """The index of a program's batch point ``flat`` (a program scalar) in ``batch``."""
        if math.prod(batch) > 1:
            return self.unflatten(flat, batch, lane=False)
        return Idx(tuple("0" for _ in batch), tuple(False for _ in batch))

    def lane_stores(self, outputs: Sequence[int], lane: Idx, shape: Sequence[int], what: str) -> list[tuple[int, Idx]]:
        """Each output stored at ``lane`` (an index into ``shape``), reshaped to its own shape."""
        stores: list[tuple[int, Idx]] = []
        for o in outputs:
            oshape = self.spec.values[o].shape
            if math.prod(oshape) != math.prod(shape):
                raise Unsupported(f"an output of {list(oshape)} in {what} of {list(shape)}")
            stores.append((o, self.reshape(lane, shape, oshape)))
        return stores

    # -- values ---------------------------------------------------------------------------
    def value(self, v: int, idx: Idx) -> tuple[str, bool]:
        """Expression name of value ``v`` at ``idx``, and whether it varies across lanes."""
        key = (v, idx.dims)
        got = self.memo.get(key)
        if got is None:
            got = self._load(v, idx) if v in self.inputs else self._compute(v, idx)
            self.memo[key] = got
        return got

    def _load(self, v: int, idx: Idx) -> tuple[str, bool]:
        spec = self.spec.values[v]
        literal = self._literal(v)
        if literal is not None:
            return literal, False
        if v not in self.args:
            self.args.append(v)
        ptr = f"in{self.args.index(v)}"
        strides = spec.strides if spec.strides is not None else tuple(row_major(spec.shape))
        terms = [
            d if strides[k] == 1 else f"{d} * {strides[k]}"
            for k, d in enumerate(idx.dims)
            if d != "0" and strides[k] != 0 and spec.shape[k] != 1
        ]
        off = " + ".join(terms) if terms else "0"
        narrow = self._narrow_load(ptr, spec, idx, strides) if self.narrow and idx.varies and terms else None
        if narrow is not None:
            expr = narrow
        elif idx.varies and terms:
            expr = f"tl.load({ptr} + ({off}), mask={self.mask}, other=0)"
        else:
            expr = f"tl.load({ptr} + ({off}))"
        varies = idx.varies and bool(terms)
        return self.em.let(expr, varies, "x"), varies

    def _narrow_load(self, ptr: str, spec: TensorSpec, idx: Idx, strides: Sequence[int]) -> str | None:
        """A value of a 2-D tile whose address varies along one of its axes only (an additive mask
        ``[batch, 1, 1, L]`` under a block of query rows): loaded as that axis's vector with that
        axis's bound, then broadcast (``[None, :]``), instead of a load per tile element. None when
        the index or the mask is not of that form (then the load is the tile's)."""
        used = [k for k, d in enumerate(idx.dims) if d != "0" and strides[k] != 0 and spec.shape[k] != 1]
        axes = {_TILE_AXIS.match(idx.dims[k]) for k in used if idx.lane[k]}
        if len(axes) != 1 or None in axes:
            return None
        name, where = next(iter(axes)).groups()  # type: ignore[union-attr]
        bounds = [_TILE_BOUND.match(t.strip()) for t in self.mask.split(" & ")]
        if any(b is None for b in bounds):
            return None  # a mask term this does not read: keep the tile's load and mask
        kept = [f"{b['name']} < {b['bound']}" for b in bounds if b and (b["name"], b["where"]) == (name, where)]
        if not kept:
            return None
        terms = [name if idx.lane[k] else idx.dims[k] for k in used]
        off = " + ".join(t if strides[k] == 1 else f"{t} * {strides[k]}" for t, k in zip(terms, used))
        return f"tl.load({ptr} + ({off}), mask={' & '.join(kept)}, other=0)[{where}]"

    def _literal(self, v: int) -> str | None:
        """A one-element constant input as a literal of its dtype (no argument, no load)."""
        spec = self.spec.values[v]
        if spec.numel != 1 or spec.dtype not in TL_DTYPES:
            return None
        got = self.spec.constants(v)
        if got is None:
            return None
        x = np.asarray(got).reshape(-1)[0]
        if spec.dtype == "bool":
            text = "1" if bool(x) else "0"
        elif spec.dtype in FLOATS:
            f = float(x)
            text = repr(f) if math.isfinite(f) else f"float('{f}')"
        else:
            text = str(int(x))
        return self.em.let(f"tl.full([], {text}, {_tl(spec.dtype)})", False, "c")

    def _compute(self, v: int, idx: Idx) -> tuple[str, bool]:
        if v in self.scalars:
            return self._scalar_at(v, idx)
        if v in self.lane_values:
            name, lane_dims = self.lane_values[v]
            if idx.dims != lane_dims:
                raise Unsupported("a product's value read at another index than its own lane")
            return name, True
        if v not in self.producer:
            raise Unsupported(f"value {v} is neither read nor computed by the group")
        node, k = self.producer[v]
        out = self.spec.values[v]
        op = node.op
        if op in _ROW_VALUED:
            return self._row_valued(node, k, v, idx)
        if op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"):
            src = node.inputs[0]
            assert src is not None
            return self.value(src, self.reshape(idx, out.shape, self.spec.values[src].shape))
        if op == "Expand":
            src = node.inputs[0]
            assert src is not None
            return self.value(src, self.broadcast(idx, out.shape, self.spec.values[src].shape))
        if op == "Transpose":
            src = node.inputs[0]
            assert src is not None
            rank = len(out.shape)
            perm = [int(p) for p in node.attrs.get("perm", list(range(rank - 1, -1, -1)))]
            dims, lane = ["0"] * rank, [False] * rank
            for j, p in enumerate(perm):
                dims[p], lane[p] = idx.dims[j], idx.lane[j]
            return self.value(src, Idx(tuple(dims), tuple(lane)))
        if op == "Slice":
            return self._slice(node, v, idx)
        if op == "Split":
            return self._split(node, k, idx)
        if op == "Concat":
            return self._concat(node, v, idx)
        if op == "Gather":
            return self._gather(node, v, idx)
        if op == "GatherND":
            return self._gather_nd(node, idx)
        if op == "BatchNormalization":
            return self._batch_norm(node, v, idx)
        return self._elementwise(node, v, idx)

    def _batch_norm(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        """Inference batch norm, per channel (axis 1) and in the reference's order and precision:
        (x - mean) / sqrt(var + epsilon) * scale + B, in fp32 (fp64 where an operand is)."""
        if int(node.attrs.get("training_mode", 0)) or not int(node.attrs.get("spatial", 1)):
            raise Unsupported("BatchNormalization in training mode or per activation (spatial=0)")
        if sum(o is not None for o in node.outputs) != 1 or len(node.inputs) < 5 or None in node.inputs[:5]:
            raise Unsupported("BatchNormalization with its running statistics as outputs")
        out = self.spec.values[v]
        if len(out.shape) < 2:
            raise Unsupported("BatchNormalization of rank below 2")
        channel = Idx((idx.dims[1],), (idx.lane[1],))
        args: list[tuple[str, str, bool]] = []
        for k, r in enumerate(node.inputs[:5]):
            assert r is not None
            spec = self.spec.values[r]
            if k and tuple(spec.shape) != (out.shape[1],):
                raise Unsupported(f"BatchNormalization's input {k} of shape {list(spec.shape)}, not [C]")
            name, varies = self.value(r, idx if k == 0 else channel)
            args.append((name, spec.dtype, varies))
        x, scale, b, mean, var = (self._up(a) for a in args)
        eps = float(node.attrs.get("epsilon", 1e-5))
        expr = f"((({x} - {mean}) / tl.sqrt_rn({var} + {eps!r})) * {scale} + {b}).to({_tl(out.dtype)})"
        varies = any(a[2] for a in args)
        return self.em.let(expr, varies, "v"), varies

    # -- injective ops ---------------------------------------------------------------------
    def _slice(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        src = node.inputs[0]
        assert src is not None
        in_shape = self.spec.values[src].shape
        rank = len(in_shape)
        if node.opset < 10:
            starts, ends = node.attrs.get("starts", []), node.attrs.get("ends", [])
            axes, steps = node.attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
        else:
            starts, ends = self._host(node, 1), self._host(node, 2)
            axes = (
                self._host(node, 3) if len(node.inputs) > 3 and node.inputs[3] is not None else list(range(len(starts)))
            )
            steps = self._host(node, 4) if len(node.inputs) > 4 and node.inputs[4] is not None else [1] * len(starts)
        dims, lane = list(idx.dims), list(idx.lane)
        for st, en, ax, sp in zip(starts, ends, axes, steps):
            a = int(ax) % rank
            begin, _, step = slice(int(st), int(en), int(sp)).indices(in_shape[a])
            if dims[a] == "0":
                dims[a] = str(begin)
            else:
                expr = dims[a] if step == 1 else f"{dims[a]} * {step}"
                dims[a] = self.em.let(f"{expr} + {begin}" if begin else expr, lane[a], "i")
        return self.value(src, Idx(tuple(dims), tuple(lane)))

    def _split(self, node: NodeSpec, k: int, idx: Idx) -> tuple[str, bool]:
        src = node.inputs[0]
        assert src is not None
        rank = len(self.spec.values[src].shape)
        axis = int(node.attrs.get("axis", 0)) % rank
        offset = sum(self.spec.values[o].shape[axis] for o in node.outputs[:k] if o is not None)
        if any(o is None for o in node.outputs[:k]):
            raise Unsupported("Split with an unused output before this one")
        dims = list(idx.dims)
        if offset:
            dims[axis] = self.em.let(f"{dims[axis]} + {offset}", idx.lane[axis], "i")
        return self.value(src, Idx(tuple(dims), idx.lane))

    def _concat(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        out = self.spec.values[v]
        axis = int(node.attrs.get("axis", 0)) % len(out.shape)
        parts: list[tuple[int, int, str]] = []
        offset = 0
        for r in node.inputs:
            if r is None:
                continue
            size = self.spec.values[r].shape[axis]
            if size == 0:
                continue
            dims = list(idx.dims)
            clamped = f"{idx.dims[axis]} - {offset}" if offset else idx.dims[axis]
            if len(parts) or size != out.shape[axis]:
                clamped = f"tl.minimum(tl.maximum({clamped}, 0), {size - 1})"
            dims[axis] = self.em.let(clamped, idx.lane[axis], "i")
            name, _ = self.value(r, Idx(tuple(dims), idx.lane))
            parts.append((offset, size, name))
            offset += size
        expr = parts[-1][2]
        for start, size, name in reversed(parts[:-1]):
            expr = f"tl.where({idx.dims[axis]} < {start + size}, {name}, {expr})"
        return self.em.let(expr, idx.varies, "v"), idx.varies

    def _gather(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        data, ind = node.inputs[0], node.inputs[1]
        assert data is not None and ind is not None
        d_shape = self.spec.values[data].shape
        i_shape = self.spec.values[ind].shape
        axis = int(node.attrs.get("axis", 0)) % len(d_shape)
        n_i = len(i_shape)
        ind_idx = Idx(idx.dims[axis : axis + n_i], idx.lane[axis : axis + n_i])
        pos, lane = self.value(ind, ind_idx)
        at = self._index_in(pos, d_shape[axis], lane)
        dims = (*idx.dims[:axis], at, *idx.dims[axis + n_i :])
        lanes = (*idx.lane[:axis], lane, *idx.lane[axis + n_i :])
        return self.value(data, Idx(tuple(dims), tuple(lanes)))

    def _gather_nd(self, node: NodeSpec, idx: Idx) -> tuple[str, bool]:
        """GatherND: the output's leading dims walk ``indices`` (its last axis holds the k
        coordinates picked from ``data`` after ``batch_dims``), the trailing dims walk the rest."""
        data, ind = node.inputs[0], node.inputs[1]
        assert data is not None and ind is not None
        d_shape = self.spec.values[data].shape
        i_shape = self.spec.values[ind].shape
        b = int(node.attrs.get("batch_dims", 0))
        k, m = gather_nd_layout(d_shape, i_shape, b)
        picks: list[str] = []
        lanes: list[bool] = []
        for j in range(k):
            pos, lane = self.value(ind, Idx((*idx.dims[:m], str(j)), (*idx.lane[:m], False)))
            picks.append(self._index_in(pos, d_shape[b + j], lane))
            lanes.append(lane)
        dims = (*idx.dims[:b], *picks, *idx.dims[m:])
        lane_of = (*idx.lane[:b], *lanes, *idx.lane[m:])
        return self.value(data, Idx(tuple(dims), tuple(lane_of)))

    def _index_in(self, pos: str, size: int, lane: bool) -> str:
        """An index read from a tensor as a position along a dim of ``size``: negative ones count
        from the end, and it is clamped into the dim (a gathered load never leaves its tensor)."""
        return self.em.let(
            f"tl.minimum(tl.maximum(tl.where({pos} < 0, {pos} + {size}, {pos}), 0), {size - 1})", lane, "i"
        )

    def _host(self, node: NodeSpec, k: int) -> list[int]:
        r = node.inputs[k] if k < len(node.inputs) else None
        got = self.spec.constants(r) if r is not None else None
        if got is None:
            raise Unsupported(f"{node.op} input {k} is not a constant: its value changes per step")
        return [int(x) for x in np.asarray(got).reshape(-1)]

    # -- elementwise ops -------------------------------------------------------------------
    def _elementwise(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        out = self.spec.values[v]
        op = node.op
        if op not in _UNARY and op not in _BINARY and op not in _OTHER:
            raise Unsupported(f"no template for {op}")
        args: list[tuple[str, str, bool]] = []  # (expr name, dtype, varies)
        for k in data_inputs(node):
            r = node.inputs[k]
            if r is None:
                continue
            spec = self.spec.values[r]
            sub = self.broadcast(idx, out.shape, spec.shape)
            name, varies = self.value(r, sub)
            args.append((name, spec.dtype, varies))
        varies = any(a[2] for a in args)
        expr = self._op_expr(node, out.dtype, args)
        return self.em.let(expr, varies, "v"), varies

    def _op_expr(self, node: NodeSpec, dtype: str, args: list[tuple[str, str, bool]]) -> str:
        op = node.op
        tl_out = _tl(dtype)
        if op == "Cast" or op == "CastLike":
            src = args[0]
            if dtype == "bool":
                return f"({src[0]} != 0)"
            return f"{src[0]}.to({tl_out})"
        if op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"):
            a, b = (self._up(x) for x in args[:2])
            return f"({a} {_CMP[op]} {b})"
        if op in ("And", "Or", "Xor"):
            return f"({args[0][0]} {_LOGIC[op]} {args[1][0]})"
        if op == "Not":
            return f"({args[0][0]} == 0)"
        if op == "Where":
            c = args[0][0]
            return f"tl.where({c}, {self._cast(args[1], dtype)}, {self._cast(args[2], dtype)}).to({tl_out})"
        if op in ("Max", "Min"):
            fn = "tl.maximum" if op == "Max" else "tl.minimum"
            acc = self._up(args[0])
            for other in args[1:]:
                acc = f"{fn}({acc}, {self._up(other)})"
            return f"({acc}).to({tl_out})"
        if op == "Clip":
            x = self._up(args[0])
            lo = node.attrs.get("min")
            hi = node.attrs.get("max")
            if node.opset >= 11:
                lo = self._scalar_input(node, 1, args)
                hi = self._scalar_input(node, 2, args)
            if lo is not None:
                x = f"tl.maximum({x}, {lo})"
            if hi is not None:
                x = f"tl.minimum({x}, {hi})"
            return f"({x}).to({tl_out})"
        if op == "Pow":
            return self._pow(node, dtype, args)
        if op in _BINARY:
            if dtype not in FLOATS and op in ("Div", "Mod"):
                raise Unsupported(f"integer {op}")
            if op == "Mod":
                raise Unsupported("Mod")
            a, b = self._up(args[0]), self._up(args[1])
            if op == "PRelu":
                return f"tl.where({a} < 0, {a} * {b}, {a}).to({tl_out})"
            return f"({a} {_BINARY[op]} {b}).to({tl_out})"
        if op in _UNARY:
            if dtype not in FLOATS and op not in ("Neg", "Abs", "Relu", "Identity", "Sign"):
                raise Unsupported(f"{op} on {dtype}")
            x = self._up(args[0])
            return f"({_UNARY[op](x, node.attrs)}).to({tl_out})"
        raise Unsupported(f"no template for {op}")

    def _scalar_input(self, node: NodeSpec, k: int, args: list[tuple[str, str, bool]]) -> str | None:
        if k >= len(node.inputs) or node.inputs[k] is None:
            return None
        present = [j for j in data_inputs(node) if node.inputs[j] is not None]
        return self._up(args[present.index(k)])

    def _pow(self, node: NodeSpec, dtype: str, args: list[tuple[str, str, bool]]) -> str:
        if dtype not in FLOATS:
            raise Unsupported("integer Pow")
        base = self._up(args[0])
        e = node.inputs[1]
        exp = self.spec.constants(e) if e is not None else None
        tl_out = _tl(dtype)
        if exp is not None and np.asarray(exp).size == 1:
            p = float(np.asarray(exp).reshape(-1)[0])
            if p == 2.0:
                return f"({base} * {base}).to({tl_out})"
            if p == 1.0:
                return f"({base}).to({tl_out})"
            if p == 0.5:
                return f"tl.sqrt_rn({base}).to({tl_out})"
            if p == 3.0:
                return f"({base} * {base} * {base}).to({tl_out})"
        return f"libdevice.pow({base}, {self._up(args[1])}).to({tl_out})"

    @staticmethod
    def _up(arg: tuple[str, str, bool]) -> str:
        name, dtype, _ = arg
        if dtype in HALF or dtype == "bool":
            return f"{name}.to(tl.float32)" if dtype in HALF else name
        return name

    def _cast(self, arg: tuple[str, str, bool], dtype: str) -> str:
        return arg[0] if arg[1] == dtype else f"{arg[0]}.to({_tl(dtype)})"

    # -- a KV store: the row written into its buffer at the device-held position ------------
    def kv_store(self, node: NodeSpec, idx: Idx) -> str:
        """The line that writes ``node``'s update (computed at ``idx``) into its buffer, in place.

        The position is read on the device (one graph serves every step); rows past the
        buffer's end are not written, as ``codegen.kv_store`` does.
        """
        buffer, update, position = (int(r) for r in node.inputs[:3])  # type: ignore[arg-type]
        bspec, uspec, pspec = (self.spec.values[v] for v in (buffer, update, position))
        if pspec.dtype not in ("int32", "int64"):
            raise Unsupported(f"a KV position of {pspec.dtype}")
        rank = len(bspec.shape)
        ax = int(node.attrs.get("axis", -2)) % rank
        if len(uspec.shape) != rank or any(u != b for k, (u, b) in enumerate(zip(uspec.shape, bspec.shape)) if k != ax):
            raise Unsupported(f"a KV update of {list(uspec.shape)} for a buffer of {list(bspec.shape)}")
        value, varies = self.value(update, idx)
        if not varies:
            raise Unsupported("a KV row that is one value for every lane")
        for v in (buffer, position):
            if v not in self.args:
                self.args.append(v)
        ptr, pos = f"in{self.args.index(buffer)}", f"in{self.args.index(position)}"
        p = self.em.let(f"tl.load({pos}).to(tl.int32)", False, "kp")
        row = f"({idx.dims[ax]} + {p})"
        strides = bspec.strides or tuple(row_major(bspec.shape))
        dims = [row if k == ax else d for k, d in enumerate(idx.dims)]
        off = " + ".join(f"{d} * {strides[k]}" for k, d in enumerate(dims) if d != "0") or "0"
        lanes = self.store_masks.get(update, self.mask)
        inside = f"({row} >= 0) & ({row} < {bspec.shape[ax]})"
        # a row that is one value for the program (the position alone) is a scalar condition:
        # selected with tl.where rather than and-ed into the lanes' mask (a block & a scalar bool
        # is a mask of another dtype under Triton's interpreter)
        ok = f"tl.where({inside}, {lanes}, False)" if idx.dims[ax] == "0" else f"{lanes} & {inside}"
        return f"    tl.store({ptr} + ({off}), {value}.to({_tl(bspec.dtype)}), mask={ok})"

    # -- the row template ------------------------------------------------------------------
    def _row_valued(self, node: NodeSpec, k: int, v: int, idx: Idx) -> tuple[str, bool]:
        """A reduction's output at ``idx``: a scalar of this program, or (Softmax, LayerNorm) a row."""
        if self.row is None or self.row_idx is None:
            raise Unsupported(f"{node.op} outside a row-reduction group")
        if v in self.looped_norms:  # a product's prologue: the norm at the K loop's index
            return self._norm_at(node, v, idx)
        if v not in self.scalars and v not in self.rowvals:
            self._reduce(node)
        if v in self.rowvals:
            shape = self.spec.values[v].shape
            if _strip(shape, idx)[1] != _strip(self.row, self.row_idx)[1]:
                raise Unsupported(f"{node.op}'s output read at another index than its row")
            return self.rowvals[v], True
        return self._scalar_at(v, idx)

    def _scalar_at(self, v: int, idx: Idx) -> tuple[str, bool]:
        assert self.row is not None and self.row_idx is not None
        shape = self.spec.values[v].shape
        outer = self.row[:-1]
        want = _strip(outer, Idx(self.row_idx.dims[:-1], self.row_idx.lane[:-1]))[1]
        if _strip(shape, idx)[1] != want:
            raise Unsupported("a reduced value read at another row than its own")
        return self.scalars[v], False

    def _reduce(self, node: NodeSpec) -> None:
        assert self.row is not None and self.row_idx is not None
        src = node.inputs[0]
        assert src is not None
        if tuple(self.spec.values[src].shape) != self.row:
            raise Unsupported(f"{node.op} reduces rows of {list(self.spec.values[src].shape)}, not the group's")
        x, _ = self.value(src, self.row_idx)
        xf = self.em.let(self._up((x, self.spec.values[src].dtype, True)), True, "r")
        rmask = self.mask
        em = self.em
        op = node.op
        out0 = node.outputs[0]
        n = self.row[-1]

        if self.spec.values[src].dtype not in FLOATS:
            raise Unsupported(f"{op} over {self.spec.values[src].dtype}")
        ninf, pinf = "float('-inf')", "float('inf')"

        def masked(expr: str, neutral: str) -> str:
            return em.let(f"tl.where({rmask}, {expr}, {neutral})", True, "r")

        def total(expr: str) -> str:
            return em.let(f"tl.sum({masked(expr, '0.0')}, axis=0)", False, "s")

        if op in ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2"):
            body = {"ReduceSumSquare": f"{xf} * {xf}", "ReduceL2": f"{xf} * {xf}", "ReduceL1": f"tl.abs({xf})"}.get(
                op, xf
            )
            s = total(body)
            if op == "ReduceMean":
                s = em.let(f"{s} / {float(n)}", False, "s")
            if op == "ReduceL2":
                s = em.let(f"tl.sqrt_rn({s})", False, "s")
            self._set_scalar(out0, s)
        elif op in ("ReduceMax", "ReduceMin"):
            fn = "tl.max" if op == "ReduceMax" else "tl.min"
            neutral = ninf if op == "ReduceMax" else pinf
            self._set_scalar(out0, em.let(f"{fn}({masked(xf, neutral)}, axis=0)", False, "s"))
        elif op == "ReduceLogSumExp":
            m = em.let(f"tl.max({masked(xf, ninf)}, axis=0)", False, "s")
            s = total(f"tl.exp({xf} - {m})")
            self._set_scalar(out0, em.let(f"{m} + tl.log({s})", False, "s"))
        elif op in ("Softmax", "LogSoftmax"):
            m = em.let(f"tl.max({masked(xf, ninf)}, axis=0)", False, "s")
            e = em.let(f"tl.exp({xf} - {m})", True, "r")
            s = total(e)
            y = f"{e} / {s}" if op == "Softmax" else f"{xf} - {m} - tl.log({s})"
            self._set_row(out0, y)
        elif op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
            eps = float(node.attrs.get("epsilon", 1e-5))
            if op == "LayerNormalization":
                mean = total(xf)
                mean = em.let(f"{mean} / {float(n)}", False, "s")
                d = em.let(f"{xf} - {mean}", True, "r")
            else:
                mean, d = "0.0", xf
            var = em.let(f"{total(f'{d} * {d}')} / {float(n)}", False, "s")
            inv = em.let(f"1.0 / tl.sqrt_rn({var} + {eps})", False, "s")
            self._set_row(out0, self._affine(node, f"{d} * {inv}", self.row_idx))
            self._norm_stats(node, mean, inv)
        else:
            raise Unsupported(f"no row template for {op}")

    def _affine(self, node: NodeSpec, y: str, idx: Idx) -> str:
        """A norm's normalised value ``y`` at ``idx`` times its scale (plus, for LayerNorm, its bias)."""
        assert self.row is not None
        for j in (1, 2):
            r = node.inputs[j] if j < len(node.inputs) else None
            if r is None or (j == 2 and node.op != "LayerNormalization"):
                continue
            sub = self.broadcast(idx, self.row, self.spec.values[r].shape)
            w, wv = self.value(r, sub)
            wf = self._up((w, self.spec.values[r].dtype, wv))
            y = f"({y}) * {wf}" if j == 1 else f"({y}) + {wf}"
        return y

    def _norm_stats(self, node: NodeSpec, mean: str, inv: str) -> None:
        """A LayerNormalization's optional outputs: its mean and inverse standard deviation."""
        outs = node.outputs
        if len(outs) > 1 and outs[1] is not None:
            self._set_scalar(outs[1], mean)
        if len(outs) > 2 and outs[2] is not None:
            self._set_scalar(outs[2], inv)

    # -- a norm as a product's prologue: row statistics in loops over K ---------------------
    def row_stats(self, stats: Sequence[NodeSpec], row_idx: Idx, mask: str, k: int, bk: int, per_row: bool) -> None:
        """Emit loops over the row (``k`` elements, ``bk`` a step) computing each reduction's statistic.

        ``row_idx`` is the index the product's K loop reads its first operand at (``rk`` the
        loop's lanes, ``mask`` its bounds); ``per_row``: the index spans several rows (the
        ``dot`` body: one statistic per row, a vector over ``rm``), else one (a scalar).
        Every program computes the statistics itself (the row is read once more per pass:
        cheap at 16 rows or fewer); the K loop then reads the normalised row at its index.
        """
        assert self.row is not None
        n = self.row[-1]
        zero = "tl.zeros([16], dtype=tl.float32)" if per_row else "tl.full([], 0.0, tl.float32)"
        sums: dict[int, str] = {}  # node index -> its statistic's accumulator

        def loop(tag: str, terms: dict[int, Callable[[str], str]]) -> None:
            outer = (self.em, self.memo, self.mask)
            self.em, self.memo, self.mask = _Emitter(tag=tag, indent="        "), {}, mask
            body: list[str] = []
            for j, term in terms.items():
                src = stats[j].inputs[0]
                assert src is not None
                x, xv = self.value(src, row_idx)
                xf = self.em.let(self._up((x, self.spec.values[src].dtype, xv)), True, "r")
                axis = ", axis=1" if per_row else ""
                body.append(f"        {sums[j]} += tl.sum(tl.where({mask}, {term(xf)}, 0.0){axis})")
            lines = self.em.lines
            self.em, self.memo, self.mask = outer
            self.em.lines.append(f"    for k0 in range(0, {k}, {bk}):")
            self.em.lines.append(f"        rk = k0 + tl.arange(0, {bk})")
            self.em.lines += [*lines, *body]

        def start(j: int, tag: str) -> None:
            sums[j] = f"{tag}{j}"
            self.em.lines.append(f"    {sums[j]} = {zero}")

        first: dict[int, Callable[[str], str]] = {}
        for j, node in enumerate(stats):
            if node.op not in LOOPED_REDUCTIONS:
                raise Unsupported(f"{node.op} as a product's prologue (it computes {sorted(LOOPED_REDUCTIONS)})")
            src = node.inputs[0]
            if src is None or tuple(self.spec.values[src].shape) != self.row:
                raise Unsupported(f"{node.op} reduces other rows than the product's first operand")
            if self.spec.values[src].dtype not in FLOATS:
                raise Unsupported(f"{node.op} over {self.spec.values[src].dtype}")
            start(j, "st")
            square = node.op in ("ReduceSumSquare", "RMSNormalization", "SimplifiedLayerNormalization")
            first[j] = _square if square else _same
        loop("r", first)
        means = {j: self.em.let(f"{sums[j]} / {float(n)}", False, "s") for j in range(len(stats))}

        def row_scalar(name: str) -> str:
            return f"{name}[:, None]" if per_row else name

        second: dict[int, Callable[[str], str]] = {}
        for j, node in enumerate(stats):
            out0 = node.outputs[0]
            if node.op in ("ReduceSum", "ReduceSumSquare"):
                self._set_scalar(out0, row_scalar(sums[j]))
            elif node.op == "ReduceMean":
                self._set_scalar(out0, row_scalar(means[j]))
            elif node.op == "LayerNormalization":  # the variance of x - mean: a second pass
                start(j, "sv")
                mean = row_scalar(means[j])
                second[j] = _centred_square(mean)
        if second:
            loop("q", second)
        for j, node in enumerate(stats):
            if node.op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
                eps = float(node.attrs.get("epsilon", 1e-5))
                var = self.em.let(f"{sums[j]} / {float(n)}", False, "s") if j in second else means[j]
                inv = self.em.let(f"1.0 / tl.sqrt_rn({var} + {eps})", False, "s")
                mean = row_scalar(means[j]) if node.op == "LayerNormalization" else "0.0"
                assert node.outputs[0] is not None
                self.looped_norms[node.outputs[0]] = (mean, row_scalar(inv))
                self._norm_stats(node, mean, row_scalar(inv))

    def _norm_at(self, node: NodeSpec, v: int, idx: Idx) -> tuple[str, bool]:
        """A looped norm's output at ``idx`` (in the product's K loop): (x - mean) x inv, scaled."""
        assert self.row is not None and self.row_idx is not None
        outer = Idx(self.row_idx.dims[:-1], self.row_idx.lane[:-1])
        if _strip(self.row[:-1], Idx(idx.dims[:-1], idx.lane[:-1]))[1] != _strip(self.row[:-1], outer)[1]:
            raise Unsupported(f"{node.op}'s output read at another row than its own")
        src = node.inputs[0]
        assert src is not None
        mean, inv = self.looped_norms[v]
        x, xv = self.value(src, idx)
        xf = self._up((x, self.spec.values[src].dtype, xv))
        d = xf if mean == "0.0" else f"({xf} - {mean})"
        y = self._affine(node, f"{d} * {inv}", idx)
        return self.em.let(f"({y}).to({_tl(self.spec.values[v].dtype)})", True, "r"), True

    def _set_scalar(self, v: int | None, expr: str) -> None:
        if v is not None:
            self.scalars[v] = self.em.let(f"({expr}).to({_tl(self.spec.values[v].dtype)})", False, "s")

    def _set_row(self, v: int | None, expr: str) -> None:
        if v is not None:
            self.rowvals[v] = self.em.let(f"({expr}).to({_tl(self.spec.values[v].dtype)})", True, "r")


def flash_attention() -> bool:
    """Attention of several query rows as one kernel (``_flash``): DSP_TRITON_FLASH_ATTENTION, on by default."""
    return bool(config.get("triton_flash_attention"))


def _square(x: str) -> str:
    return f"{x} * {x}"


def _same(x: str) -> str:
    return x


def _centred_square(mean: str) -> Callable[[str], str]:
    def term(x: str) -> str:
        return f"({x} - {mean}) * ({x} - {mean})"

    return term


def _tl(dtype: str) -> str:
    got = TL_DTYPES.get(dtype)
    if got is None:
        raise Unsupported(f"dtype {dtype}")
    return got


_CMP = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}
_LOGIC = {"And": "&", "Or": "|", "Xor": "^"}
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Mod": "%", "PRelu": ""}
_ROW_VALUED = ROW_VALUED_OPS


def _gelu(x: str, attrs: dict[str, Any]) -> str:
    if attrs.get("approximate", "none") == "tanh":
        return f"0.5 * {x} * (2.0 * tl.sigmoid(1.5957691216057308 * ({x} + 0.044715 * {x} * {x} * {x})))"
    return f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"


_UNARY: dict[str, Callable[[str, dict[str, Any]], str]] = {
    "Identity": lambda x, a: x,
    "Neg": lambda x, a: f"-{x}",
    "Abs": lambda x, a: f"tl.abs({x})",
    "Exp": lambda x, a: f"tl.exp({x})",
    "Log": lambda x, a: f"tl.log({x})",
    "Sqrt": lambda x, a: f"tl.sqrt_rn({x})",
    "Reciprocal": lambda x, a: f"1.0 / {x}",
    "Tanh": lambda x, a: f"(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",
    "Sigmoid": lambda x, a: f"tl.sigmoid({x})",
    "Relu": lambda x, a: f"tl.maximum({x}, 0)",
    "Erf": lambda x, a: f"tl.erf({x})",
    "Sin": lambda x, a: f"tl.sin({x})",
    "Cos": lambda x, a: f"tl.cos({x})",
    "Floor": lambda x, a: f"tl.floor({x})",
    "Ceil": lambda x, a: f"tl.ceil({x})",
    "Softplus": lambda x, a: f"tl.where({x} > 20.0, {x}, tl.log(1.0 + tl.exp({x})))",
    "Gelu": _gelu,
    "LeakyRelu": lambda x, a: f"tl.where({x} < 0, {x} * {float(a.get('alpha', 0.01))}, {x})",
    "HardSigmoid": lambda x, a: (
        f"tl.minimum(tl.maximum({x} * {float(a.get('alpha', 0.2))} + {float(a.get('beta', 0.5))}, 0.0), 1.0)"
    ),
    "Sign": lambda x, a: f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0))",
}
_OTHER = frozenset(
    {
        "Cast",
        "CastLike",
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "And",
        "Or",
        "Xor",
        "Not",
        "Where",
        "Max",
        "Min",
        "Clip",
        "Pow",
    }
)
SUPPORTED_OPS = (
    frozenset(_UNARY) | frozenset(_BINARY) - {"Mod"} | _OTHER | _ROW_VALUED | INDEX_OPS | {"BatchNormalization"}
)


# -- the skinny-product template (T3) ------------------------------------------------------
PRODUCT_OPS = frozenset({"MatMul", "Gemm"})
# Ops that only move elements: a product's lanes map forward through them (to a KV store).
# Reductions a product's prologue computes in loops over K (a norm feeding the product).
LOOPED_REDUCTIONS = frozenset(
    {
        "ReduceSum",
        "ReduceMean",
        "ReduceSumSquare",
        "LayerNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
    }
)
MAX_PRODUCT_ROWS = 16  # products with more rows stay on cuBLAS (prefill)
_DOT_DTYPES = frozenset({"float16", "bfloat16", "float32"})


@dataclass(frozen=True)
class ProductShape:
    """A product's sizes and how the template streams it.

    ``body``: ``"nk"`` (one row, the weights read along K: each program reduces BLOCK_N
    rows of K contiguous elements), ``"kn"`` (one row, weights read along N), ``"dot"``
    (2..16 rows, ``tl.dot`` with the rows padded to 16).
    """

    batch: tuple[int, ...]
    m: int
    k: int
    n: int
    trans_a: bool
    trans_b: bool
    body: str


def product_node(spec: GroupSpec) -> NodeSpec:
    """The one MatMul or Gemm of a product group (after its prologue of index arithmetic)."""
    found = [n for n in spec.nodes if n.op in PRODUCT_OPS and n.domain in ("", "ai.onnx")]
    if len(found) != 1:
        raise Unsupported(f"a product group holds {len(found)} products (the template takes one)")
    return found[0]


def product_shape(spec: GroupSpec) -> ProductShape:
    """The product of a ``product`` group (its first node), or Unsupported with the reason."""
    node = product_node(spec)
    a, b = node.inputs[0], node.inputs[1]
    if a is None or b is None or a not in spec.values or b not in spec.values:
        raise Unsupported("a product without both operands")
    A, B = spec.values[a], spec.values[b]
    if A.dtype != B.dtype or A.dtype not in FLOATS:
        raise Unsupported(f"a product of {A.dtype} and {B.dtype}")
    if node.op == "Gemm":
        if len(A.shape) != 2 or len(B.shape) != 2:
            raise Unsupported("Gemm of other than matrices")
        ta, tb = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
        m, k = (A.shape[1], A.shape[0]) if ta else (A.shape[0], A.shape[1])
        n = B.shape[0] if tb else B.shape[1]
        batch: tuple[int, ...] = ()
    else:
        if len(A.shape) < 2 or len(B.shape) < 2:
            raise Unsupported("a product of a vector (rank 1): left to cuBLAS")
        ta = tb = False
        m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
        out = node.outputs[0]
        if out is None or out not in spec.values:
            raise Unsupported("a product whose output is unknown")
        batch = tuple(spec.values[out].shape[:-2])
    if m > MAX_PRODUCT_ROWS:
        raise Unsupported(f"a product of {m} rows (the skinny template takes up to {MAX_PRODUCT_ROWS})")
    if k == 0 or n == 0 or m == 0:
        raise Unsupported("an empty product")
    if n == 1:
        raise Unsupported("a product of one column (a dot product): left to cuBLAS")
    strides = B.strides if B.strides is not None else tuple(row_major(B.shape))
    k_stride = strides[-1] if tb else strides[-2]
    if m > 1:
        if A.dtype not in _DOT_DTYPES:
            raise Unsupported(f"a product of {m} rows in {A.dtype} (tl.dot takes fp16, bf16, fp32)")
        body = "dot"
    else:
        body = "nk" if k_stride == 1 and n > 1 else "kn"
    return ProductShape(batch, m, k, n, ta, tb, body)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def product_configs(shape: ProductShape, preload: bool = False) -> list[dict[str, int]]:
    """The block configs the tuner times for a product (the first is the untuned default).

    ``preload``: the weight is a constant, so configs that load a program's whole slice of it
    before the kernel waits for the one before it are timed too (``nk`` products).
    """
    k2, n2 = _pow2(shape.k), _pow2(shape.n)
    if shape.body == "nk":
        pairs = [(4, 256), (2, 256), (8, 256), (4, 512), (2, 512), (1, 512), (8, 128)]
        if shape.k >= 4096:  # long rows: more bytes in flight per program
            pairs += [(8, 1024), (4, 1024), (2, 1024), (16, 512)]
        pairs = [(min(bn, n2), min(bk, max(16, k2))) for bn, bk in pairs]
    elif shape.body == "kn":
        pairs = [(64, 64), (32, 64), (128, 32), (64, 32), (32, 128), (128, 64)]
        pairs = [(min(bn, max(16, n2)), min(bk, max(16, k2))) for bn, bk in pairs]
    else:
        pairs = [(32, 64), (64, 64), (32, 128), (64, 32), (16, 128), (128, 32)]
        pairs = [(max(16, min(bn, n2)), max(16, min(bk, k2))) for bn, bk in pairs]
    configs: list[dict[str, int]] = []
    for bn, bk in pairs:
        for warps in (4, 8) if bn * bk >= 8192 else (4,):
            c = {"block_n": bn, "block_k": bk, "num_warps": warps}
            if c not in configs:
                configs.append(c)
    if preload and shape.body == "nk":  # a constant weight's whole slice per program, loaded first
        for bn in (1, 2, 4, 8):
            if bn <= n2 and bn * k2 <= MAX_PRELOAD:
                for warps in (4, 8) if bn * k2 >= 8192 else (4,):
                    configs.append({"block_n": bn, "block_k": k2, "num_warps": warps, "preload": 1})
    return configs


def _product(
    gen: _Gen, spec: GroupSpec, config: dict[str, int] | None
) -> tuple[list[tuple[int, Idx]], tuple[int, int, int], int, int]:
    """Emit the product's K loop and its epilogue lanes; the stores, grid, BLOCK_N and warps."""
    shape = product_shape(spec)
    node = product_node(spec)
    a, b, out = node.inputs[0], node.inputs[1], node.outputs[0]
    assert a is not None and b is not None and out is not None
    operand_dtype, out_spec = spec.values[a].dtype, spec.values[out]
    cfg = config or product_configs(shape)[0]
    bn, bk, warps = int(cfg["block_n"]), int(cfg["block_k"]), int(cfg.get("num_warps", 4))
    em = gen.em
    # Two merged siblings of one width whose epilogue reads both at one index (gate and up):
    # each program computes the same columns of both parts, so the epilogue has them together.
    paired = int(spec.params.get("paired", 0))
    n_eff = paired or shape.n
    if paired:
        out_spec = TensorSpec((*out_spec.shape[:-1], paired), out_spec.dtype)
    n_blocks = (n_eff + bn - 1) // bn
    batch_numel = math.prod(shape.batch)
    em.lines.append("    pid = tl.program_id(0)")
    if batch_numel > 1:
        em.lines.append(f"    nb = pid % {n_blocks}")
        em.lines.append(f"    bi = pid // {n_blocks}")
    else:
        em.lines.append("    nb = pid")
    bidx = gen.batch_index("bi", shape.batch)
    em.lines.append(f"    rn = nb * {bn} + tl.arange(0, {bn})")
    body = shape.body
    # A constant weight whose slice for this program is one tile: loaded first, before the
    # kernel waits for the one before it (a dependent launch), so its DRAM latency overlaps
    # that kernel's work. Only constants: nothing the kernels before it write is read early.
    preload = bool(cfg.get("preload")) and body == "nk" and bool(spec.params.get("fixed_b")) and bk >= shape.k
    hoist_at = len(em.lines)
    accs = ["acc", "acc2"] if paired else ["acc"]
    if body == "dot":
        em.lines.append(f"    rm = tl.arange(0, {MAX_PRODUCT_ROWS})")
        em.lines += [f"    {acc} = tl.zeros([{MAX_PRODUCT_ROWS}, {bn}], dtype=tl.float32)" for acc in accs]
        a_mk, b_kn = ("rm[:, None]", "rk[None, :]"), ("rk[:, None]", "rn[None, :]")
        a_mask = f"(rm[:, None] < {shape.m}) & (rk[None, :] < {shape.k})"
        b_mask = f"(rk[:, None] < {shape.k}) & (rn[None, :] < {n_eff})"
    elif body == "nk":
        em.lines += [f"    {acc} = tl.zeros([{bn}], dtype=tl.float32)" for acc in accs]
        a_mk, b_kn = ("0", "rk[None, :]"), ("rk[None, :]", "rn[:, None]")
        a_mask = f"rk[None, :] < {shape.k}"
        b_mask = f"(rn[:, None] < {n_eff}) & (rk[None, :] < {shape.k})"
    else:
        em.lines += [f"    {acc} = tl.zeros([{bn}], dtype=tl.float32)" for acc in accs]
        a_mk, b_kn = ("0", "rk[:, None]"), ("rk[:, None]", "rn[None, :]")
        a_mask = f"rk[:, None] < {shape.k}"
        b_mask = f"(rk[:, None] < {shape.k}) & (rn[None, :] < {n_eff})"

    def operand(v: int, pair: tuple[str, str], trans: bool) -> Idx:
        rank = len(spec.values[v].shape)
        if node.op == "Gemm":
            batch_part = Idx((), ())
        else:
            batch_part = gen.broadcast(bidx, shape.batch, spec.values[v].shape[:-2]) if shape.batch else Idx((), ())
        dims = (pair[1], pair[0]) if trans else pair
        tail = tuple(d if spec.values[v].shape[rank - 2 + j] != 1 else "0" for j, d in enumerate(dims))
        return Idx((*batch_part.dims, *tail), (*batch_part.lane, *(d != "0" for d in tail)))

    a_idx = operand(a, a_mk, shape.trans_a)
    stats = [n for n in spec.nodes if n.op in _ROW_VALUED]
    if stats:  # a norm as the prologue: its row statistics first, in loops over K
        if shape.trans_a:
            raise Unsupported("a norm prologue of a product that reads A transposed")
        row_in = stats[0].inputs[0]
        assert row_in is not None
        row, a_shape = tuple(spec.values[row_in].shape), tuple(spec.values[a].shape)
        if tuple(d for d in row if d != 1) != tuple(d for d in a_shape if d != 1):
            raise Unsupported(f"a norm over rows of {list(row)} feeding a product's {list(a_shape)}")
        gen.row, gen.row_idx = row, gen.reshape(a_idx, a_shape, row)  # a relabeling: no new index lines
        gen.row_stats(stats, gen.row_idx, a_mask, shape.k, bk, per_row=body == "dot")
    outer = (gen.em, gen.memo, gen.mask)
    gen.em, gen.memo = _Emitter(tag="k", indent="        "), {}
    gen.mask = a_mask
    xa, _ = gen.value(a, a_idx)
    if stats:  # lanes past K (or past the rows) are zeros, whatever the norm makes of them
        xa = gen.em.let(f"tl.where({a_mask}, {xa}, 0.0).to({_tl(operand_dtype)})", True, "x")
    gen.mask = b_mask
    loop_em, loop_memo = gen.em, gen.memo
    if preload:
        gen.em, gen.memo = _Emitter(tag="w"), {}
        gen.em.lines.append(f"    rk = tl.arange(0, {bk})")
    xbs = [gen.value(b, operand(b, b_kn, shape.trans_b))[0]]
    if paired:  # the second part's same columns: rows paired further along the joined weights
        shifted = (b_kn[0], b_kn[1].replace("rn[", f"({paired} + rn)["))
        xbs.append(gen.value(b, operand(b, shifted, shape.trans_b))[0])
    if preload:
        em.lines[hoist_at:hoist_at] = [*gen.em.lines, WAIT_MARKER]
        gen.em, gen.memo = loop_em, loop_memo
    loop = gen.em.lines
    gen.em, gen.memo, gen.mask = outer
    em.lines.append(f"    for k0 in range(0, {shape.k}, {bk}):")
    em.lines.append(f"        rk = k0 + tl.arange(0, {bk})")
    em.lines.extend(loop)
    for acc, xb in zip(accs, xbs):
        if body == "dot":
            precision = ', input_precision="ieee"' if operand_dtype == "float32" else ""
            em.lines.append(f"        {acc} = tl.dot({xa}, {xb}, {acc}{precision})")
        else:
            axis = 1 if body == "nk" else 0
            em.lines.append(f"        {acc} += tl.sum({xa}.to(tl.float32) * {xb}.to(tl.float32), axis={axis})")
    if body == "dot":
        em.lines.append(f"    mask = (rm[:, None] < {shape.m}) & (rn[None, :] < {n_eff})")
        lane_mn = ("rm[:, None]" if shape.m > 1 else "0", "rn[None, :]" if n_eff > 1 else "0")
    else:
        em.lines.append(f"    mask = rn < {n_eff}")
        lane_mn = ("0", "rn" if n_eff > 1 else "0")
    lane = Idx((*bidx.dims, *lane_mn), (*bidx.lane, *(d != "0" for d in lane_mn)))
    if paired:
        if node.op != "MatMul":
            raise Unsupported("paired merged products of a Gemm")
        for acc, y_part in zip(accs, (int(spec.params["y0"]), int(spec.params["y1"]))):
            gen.lane_values[y_part] = (em.let(f"({acc}).to({_tl(out_spec.dtype)})", True, "p"), lane.dims)
    y = "acc"
    if node.op == "Gemm":
        alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
        if alpha != 1.0:
            y = f"acc * {alpha}"
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and beta != 0.0:
            cv, c_varies = gen.value(c, gen.broadcast(lane, out_spec.shape, spec.values[c].shape))
            cf = gen._up((cv, spec.values[c].dtype, c_varies))
            y = f"{y} + {cf}" if beta == 1.0 else f"{y} + {beta} * {cf}"
    if not paired:
        gen.lane_values[out] = (em.let(f"({y}).to({_tl(out_spec.dtype)})", True, "p"), lane.dims)
    stores: list[tuple[int, Idx]] = []
    at: dict[int, Idx] = {}  # the product (or a part of merged siblings) and its layout ops: the index its lanes hold
    whole: tuple[int, ...] = (out,)  # values that exist at the product's own lanes
    if paired:
        whole = (int(spec.params["y0"]), int(spec.params["y1"]))
    elif spec.splits:
        whole = ()  # each part holds only its own columns (below)
    at.update({held: lane for held in whole})
    for v, (offset, width) in [] if paired else spec.splits.items():  # a part: lanes [offset, offset + width)
        n_expr = "rn[None, :]" if body == "dot" else "rn"
        if tuple(spec.values[v].shape) != (*out_spec.shape[:-1], width):
            raise Unsupported("a merged product's part of another shape")
        dims = (*lane.dims[:-1], gen.em.let(f"({n_expr} - {offset})", True, "i"))
        gen.store_masks[v] = f"mask & ({n_expr} >= {offset}) & ({n_expr} < {offset + width})"
        gen.lane_values[v] = (gen.lane_values[out][0], dims)
        at[v] = Idx(dims, (*lane.lane[:-1], True))
    _forward_layout(gen, spec, node, at)
    buffers = {n.outputs[0] for n in kv_store_nodes(spec)}  # written in place by the KV stores below
    for v in spec.outputs:
        if v in buffers:
            continue
        if v in at:
            stores.append((v, at[v]))
        elif v not in spec.splits or paired:
            stores += gen.lane_stores([v], lane, out_spec.shape, "a product group")
    for n in kv_store_nodes(spec):  # a KV store's row: at the index its lanes hold (generate writes it)
        update = n.inputs[1]
        if update not in at:
            raise Unsupported("a KV store of a product's value that is not a part or its layout")
        stores.append((update, at[update]))  # type: ignore[index]
    grid = (max(1, batch_numel) * n_blocks, 1, 1)
    return stores, grid, bn, warps


def _forward_layout(gen: _Gen, spec: GroupSpec, product: NodeSpec, at: dict[int, Idx]) -> None:
    """Layout ops after a product (reshape, transpose): each lane's value is its input's, at the mapped index.

    A value computed at a lane exists only there; a reshape or transpose of it is the same
    value at another index (the reshape's flat position, the permuted dims), so it is stored
    there rather than asked for at its own index.
    """
    for node in spec.nodes[spec.nodes.index(product) + 1 :]:
        src, out = node.inputs[0] if node.inputs else None, node.outputs[0] if node.outputs else None
        if node.op not in LAYOUT_OPS or src not in at or out is None:
            continue
        idx = at[src]  # type: ignore[index]
        if node.op == "Transpose":
            rank = len(spec.values[out].shape)
            perm = [int(p) for p in node.attrs.get("perm", list(range(rank - 1, -1, -1)))]
            idx = Idx(tuple(idx.dims[p] for p in perm), tuple(idx.lane[p] for p in perm))
        else:
            idx = gen.reshape(idx, spec.values[src].shape, spec.values[out].shape)  # type: ignore[index]
        at[out] = idx
        gen.lane_values[out] = (gen.lane_values[src][0], idx.dims)  # type: ignore[index]
        if src in gen.store_masks:
            gen.store_masks[out] = gen.store_masks[src]  # type: ignore[index]


# -- decode attention (T4): scores, softmax and the weighted sum in one kernel ---------------
def attention_configs(spec: GroupSpec) -> list[dict[str, int]]:
    """KV positions per loop step (BLOCK_L) and warps the tuner times; the first is the default."""
    p1, _, _ = attention_nodes(spec)
    out = p1.outputs[0]
    shape = spec.values[out].shape if out is not None and out in spec.values else (1, 64)
    length, rows = shape[-1], shape[-2] if len(shape) >= 2 else 1
    if rows > 1:  # _flash: query rows and KV positions per program
        ms = [b for b in (64, 32, 128, 16) if b <= max(16, _pow2(rows))]
        ls = [b for b in (64, 32, 128) if b <= max(32, _pow2(length))]
        # 128 KV positions a step only with 8 warps: (64, 128, 4 warps) wrote out of bounds on the
        # H200 (Triton 3.6) while correct under the interpreter, and the tuner launches each config
        # before the group's check compares the winner with the reference
        return [
            {"block_m": m, "block_l": b, "num_warps": w}
            for m in ms
            for b in ls
            for w in (4, 8)
            if m * b <= 8192 and not (b == 128 and w == 4)
        ]
    blocks = [b for b in (64, 32, 128) if b <= max(32, _pow2(length))]
    return [{"block_l": b, "num_warps": w} for b in blocks for w in (4, 2)]


def attention_parts(spec: GroupSpec) -> list[tuple[GroupSpec, list[int]]]:
    """An attention group as separate kernels, for layouts the one-kernel template declines (prefill).

    The scores product with its prologue and epilogue (``product``), the softmax with the
    casts after it (``row_reduction``), the weighted sum with V's index arithmetic and its
    epilogue (``product``; absent from a group that holds no weighted sum); each with the
    indexes of its nodes in ``spec.nodes``. The values between parts are stored (row-major).
    """
    nodes = spec.nodes
    products = [j for j, n in enumerate(nodes) if n.op == "MatMul"]
    softmax = [j for j, n in enumerate(nodes) if n.op == "Softmax"]
    if not products or len(softmax) != 1 or len(products) > 2 or not products[0] < softmax[0]:
        raise Unsupported("an attention group that is not scores, softmax and a weighted sum")
    i_sm = softmax[0]
    i_p2 = products[1] if len(products) == 2 else len(nodes)
    if i_p2 < i_sm:
        raise Unsupported("an attention group whose products and softmax are out of order")
    sm = nodes[i_sm]
    v_side = value_side(nodes, nodes[i_p2]) if i_p2 < len(nodes) else set()
    part_a = [j for j in range(i_sm) if j not in v_side]
    part_b = [j for j in range(i_sm, i_p2) if j not in v_side]
    part_c = sorted(v_side | set(range(i_p2, len(nodes)))) if i_p2 < len(nodes) else []
    x_in = sm.inputs[0]
    a = nodes[i_p2].inputs[0] if part_c else None
    assert x_in is not None
    values = dict(spec.values)
    for v in (x_in, a):
        if v is not None:
            values[v] = TensorSpec(values[v].shape, values[v].dtype, tuple(row_major(values[v].shape)))
    plan: list[tuple[str, list[int], list[int], list[int]]] = [("product", part_a, [], [x_in])]
    if part_c:
        assert a is not None
        plan += [("row_reduction", part_b, [x_in], [a]), ("product", part_c, [a], list(spec.outputs))]
    else:
        plan += [("row_reduction", part_b, [x_in], list(spec.outputs))]
    out: list[tuple[GroupSpec, list[int]]] = []
    for template, idxs, extra_in, outs in plan:
        made = {v for j in idxs for v in nodes[j].outputs if v is not None}
        reads = [r for j in idxs for r in nodes[j].inputs if r is not None and r not in made]
        inputs = [r for r in dict.fromkeys([*extra_in, *reads]) if r in spec.inputs or r in extra_in]
        part = GroupSpec(template, [nodes[j] for j in idxs], values, inputs, outs, spec.constants)
        out.append((part, idxs))
    return out


def _head_index(gen: _Gen, shape: Sequence[int], bidx: Idx, batch: tuple[int, ...], pair: tuple[str, str]) -> Idx:
    """The index into a value of ``shape`` of an attention program's (batch, head) point ``bidx``
    (broadcast to the value's leading dims) and ``pair`` in its last two dims ("0" where size 1)."""
    head = gen.broadcast(bidx, batch, shape[:-2]) if batch else Idx((), ())
    tail = tuple(e if shape[len(shape) - 2 + j] != 1 else "0" for j, e in enumerate(pair))
    return Idx((*head.dims, *tail), (*head.lane, *(e != "0" for e in tail)))


def _attention(
    gen: _Gen, spec: GroupSpec, config: dict[str, int] | None
) -> tuple[list[tuple[int, Idx]], tuple[int, int, int], int, int]:
    """One program per (batch, head): q.K over the KV positions in blocks, online softmax, P@V."""
    p1, sm, p2, at_ = attention_values(spec)
    q, k, scores, a, v, out, x_in, probs = at_.q, at_.k, at_.scores, at_.a, at_.v, at_.out, at_.x_in, at_.probs
    sv, ov = spec.values[scores], spec.values[out]
    qv, kv, vv = spec.values[q], spec.values[k], spec.values[v]
    if min(len(qv.shape), len(kv.shape), len(vv.shape), len(spec.values[a].shape)) < 2:
        raise Unsupported("attention over operands of rank below 2")
    rows = qv.shape[-2]
    if rows != 1 and not flash_attention():
        raise Unsupported(f"attention for {rows} query rows (DSP_TRITON_FLASH_ATTENTION is off)")
    d, length, d2 = qv.shape[-1], kv.shape[-1], vv.shape[-1]
    if kv.shape[-2] != d or vv.shape[-2] != length or spec.values[a].shape[-1] != length:
        raise Unsupported("attention operands whose sizes do not chain")
    if int(sm.attrs.get("axis", -1)) % len(spec.values[x_in].shape) != len(spec.values[x_in].shape) - 1:
        raise Unsupported("a softmax over other than the last axis")
    same = tuple(spec.values[a].shape) == tuple(spec.values[probs].shape)
    if tuple(spec.values[x_in].shape) != tuple(sv.shape) or not same:
        raise Unsupported("ops between the products and the softmax change the shape")
    batch = tuple(ov.shape[:-2])
    if tuple(sv.shape[:-2]) != batch or ov.shape[-2] != rows:
        raise Unsupported("scores and output of different batch shapes")
    if any(spec.values[x].dtype not in FLOATS for x in (q, k, v)):
        raise Unsupported("attention over non-float operands")
    between: list[NodeSpec] = []  # the ops from the probabilities to the weighted sum's operand
    at_value: int | None = a
    while at_value != probs:
        found = gen.producer.get(at_value) if at_value is not None else None
        if found is None:
            raise Unsupported("the weighted sum's operand does not come from the softmax")
        between.append(found[0])
        at_value = found[0].inputs[0]
    if any(n.op not in ("Cast", "CastLike", "Identity") for n in between):
        # an online softmax has the probabilities only up to a positive scale until the end
        raise Unsupported("ops other than casts between the softmax and the weighted sum")
    cfg = config or attention_configs(spec)[0]
    if rows != 1:
        if spec.params.get("kv_splits"):
            raise Unsupported("a split attention of several query rows")
        return _flash(gen, spec, at_, (rows, d, length, d2), batch, cfg)
    bl, warps = int(cfg["block_l"]), int(cfg.get("num_warps", 4))
    bd, bd2 = max(16, _pow2(d)), max(16, _pow2(d2))
    n_split = int(spec.params.get("kv_splits", 1))
    chunk = -(-length // n_split)
    bl = min(bl, max(16, _pow2(chunk)))
    chunk = -(-chunk // bl) * bl  # whole loop steps per split
    em = gen.em
    em.lines.append("    pid = tl.program_id(0)")
    head_flat = "pid"
    if n_split > 1:
        em.lines.append(f"    sk = pid % {n_split}")
        em.lines.append(f"    bh = pid // {n_split}")
        head_flat = "bh"
    bidx = gen.batch_index(head_flat, batch)
    hi = f"tl.minimum(sk * {chunk} + {chunk}, {length})" if n_split > 1 else str(length)

    def at(x: int, pair: tuple[str, str]) -> Idx:
        return _head_index(gen, spec.values[x].shape, bidx, batch, pair)

    em.lines.append(f"    rd = tl.arange(0, {bd})")
    em.lines.append(f"    rv = tl.arange(0, {bd2})")
    gen.mask = f"rd < {d}"
    xq, _ = gen.value(q, at(q, ("0", "rd")))
    em.lines.append(f"    att_hi = {hi}")
    em.lines.append("    att_m = tl.full([], float('-inf'), tl.float32)")
    em.lines.append("    att_l = tl.full([], 0.0, tl.float32)")
    em.lines.append(f"    att_acc = tl.zeros([{bd2}], dtype=tl.float32)")
    outer = (gen.em, gen.memo, gen.mask)
    loop = _Emitter(tag="k", indent="        ")
    gen.em, gen.memo = loop, {}
    gen.mask = f"(rl[:, None] < att_hi) & (rd[None, :] < {d})"
    xk, _ = gen.value(k, at(k, ("rd[None, :]", "rl[:, None]")))
    loop.lines.append(f"        att_s = tl.sum({xq}[None, :].to(tl.float32) * {xk}.to(tl.float32), axis=1)")
    lane_l = at(scores, ("0", "rl"))
    gen.lane_values[scores] = (loop.let(f"att_s.to({_tl(sv.dtype)})", True, "p"), lane_l.dims)
    gen.mask = "rl < att_hi"
    xs, _ = gen.value(x_in, lane_l)
    loop.lines += _online_softmax("rl < att_hi", xs, 0)
    gen.lane_values[probs] = ("att_p", at(probs, ("0", "rl")).dims)
    xa, _ = gen.value(a, at(a, ("0", "rl")))
    gen.mask = f"(rl[:, None] < att_hi) & (rv[None, :] < {d2})"
    xv, _ = gen.value(v, at(v, ("rl[:, None]", "rv[None, :]")))
    loop.lines += [
        f"        att_acc = att_acc * att_alpha + tl.sum({xa}[:, None].to(tl.float32) * {xv}.to(tl.float32), axis=0)",
        "        att_m = att_mnew",
    ]
    gen.em, gen.memo, gen.mask = outer
    span = chunk if n_split > 1 else length
    em.lines.append(f"    for l0 in range(0, {span}, {bl}):")
    start = f"sk * {chunk} + " if n_split > 1 else ""
    em.lines.append(f"        rl = {start}l0 + tl.arange(0, {bl})")
    em.lines.extend(loop.lines)
    em.lines.append(f"    mask = rv < {d2}")
    gen.lane_values.pop(scores, None)
    gen.lane_values.pop(probs, None)
    if n_split > 1:  # partial results of this split: the combine kernel merges them
        part = Idx(("bh", "sk"), (False, False))
        gen.lane_values[ATT_M] = ("att_m", part.dims)
        gen.lane_values[ATT_L] = ("att_l", part.dims)
        gen.lane_values[ATT_ACC] = ("att_acc", ("bh", "sk", "rv"))
        gen.store_masks[ATT_M] = gen.store_masks[ATT_L] = ""  # one scalar per program
        stores_p = [(ATT_M, part), (ATT_L, part), (ATT_ACC, Idx(("bh", "sk", "rv"), (False, False, True)))]
        return stores_p, (max(1, math.prod(batch)) * n_split, 1, 1), bl, warps
    lane = at(out, ("0", "rv"))
    gen.lane_values[out] = (em.let(f"(att_acc / att_l).to({_tl(ov.dtype)})", True, "p"), lane.dims)
    stores = gen.lane_stores(spec.outputs, lane, ov.shape, "an attention group")
    return stores, (max(1, math.prod(batch)), 1, 1), bl, warps


def _online_softmax(valid: str, scores: str, axis: int) -> list[str]:
    """One step of the online softmax over a block of scores (``valid`` where a position exists):
    the running max ``att_m`` and sum ``att_l`` updated, ``att_p`` the block's exponentials and
    ``att_alpha`` the rescale of what was accumulated; per row along ``axis`` (0: one query row)."""
    row = "[:, None]" if axis == 1 else ""
    return [
        f"        att_x = tl.where({valid}, {scores}.to(tl.float32), float('-inf'))",
        f"        att_mnew = tl.maximum(att_m, tl.max(att_x, axis={axis}))",
        "        att_muse = tl.where(att_mnew == float('-inf'), 0.0, att_mnew)",
        "        att_alpha = tl.exp(att_m - att_muse)",
        f"        att_p = tl.exp(att_x - att_muse{row})",
        f"        att_l = att_l * att_alpha + tl.sum(att_p, axis={axis})",
    ]


def _flash(
    gen: _Gen,
    spec: GroupSpec,
    at_: AttentionValues,
    sizes: tuple[int, int, int, int],
    batch: tuple[int, ...],
    cfg: dict[str, int],
) -> tuple[list[tuple[int, Idx]], tuple[int, int, int], int, int]:
    """Attention of several query rows (an encoder's, a prefill's): one program per (batch, head,
    BLOCK_M query rows), the scores of a block of KV positions as ``tl.dot``, their scale and mask
    (the epilogue ops between the product and the softmax, at each score's index), an online
    softmax per row, the weighted sum with V as ``tl.dot``; the output stored through the layout
    ops after it (the heads' transpose and merge), so neither scores nor probabilities are stored."""
    rows, d, length, d2 = sizes
    q, k, scores, a, v, out, x_in, probs = at_.q, at_.k, at_.scores, at_.a, at_.v, at_.out, at_.x_in, at_.probs
    sv, ov, vv = spec.values[scores], spec.values[out], spec.values[v]
    if spec.values[q].dtype not in _DOT_DTYPES or spec.values[k].dtype != spec.values[q].dtype:
        raise Unsupported("attention of several query rows over operands tl.dot does not take")
    bm, bl, warps = int(cfg.get("block_m", 64)), int(cfg["block_l"]), int(cfg.get("num_warps", 4))
    bm = max(16, min(bm, _pow2(rows)))
    bl = max(16, min(bl, _pow2(length)))
    bd, bd2 = max(16, _pow2(d)), max(16, _pow2(d2))
    if max(bd, bd2) > MAX_FLASH_HEAD:
        limit = f"the flash kernel holds {MAX_FLASH_HEAD} (parts)"
        raise Unsupported(f"a head of {max(d, d2)} for {rows} query rows: {limit}")
    n_mb = -(-rows // bm)
    # Launched plainly, not as a programmatic dependent: launched early (while the product before
    # it still runs) it took 27 us a layer in BERT-base seq 512, 15.5 us launched after it (H200,
    # same binary, two runs each way); its few heavy programs are then placed on SMs the product
    # still holds, the likely cause (docs/fusion.md, "Dependent launches").
    gen.dependent = False
    precision = ', input_precision="ieee"' if spec.values[q].dtype == "float32" else ""
    em = gen.em
    em.lines.append("    pid = tl.program_id(0)")
    if n_mb > 1:
        em.lines.append(f"    mb = pid % {n_mb}")
        em.lines.append(f"    bh = pid // {n_mb}")
    else:
        em.lines += ["    mb = 0", "    bh = pid"]
    bidx = gen.batch_index("bh", batch)

    def at(x: int, pair: tuple[str, str]) -> Idx:
        return _head_index(gen, spec.values[x].shape, bidx, batch, pair)

    em.lines += [
        f"    rm = mb * {bm} + tl.arange(0, {bm})",
        f"    rd = tl.arange(0, {bd})",
        f"    rv = tl.arange(0, {bd2})",
    ]
    gen.mask = f"(rm[:, None] < {rows}) & (rd[None, :] < {d})"
    xq, _ = gen.value(q, at(q, ("rm[:, None]", "rd[None, :]")))
    em.lines += [
        f"    att_m = tl.full([{bm}], float('-inf'), tl.float32)",
        f"    att_l = tl.zeros([{bm}], dtype=tl.float32)",
        f"    att_acc = tl.zeros([{bm}, {bd2}], dtype=tl.float32)",
    ]
    outer = (gen.em, gen.memo, gen.mask)
    loop = _Emitter(tag="k", indent="        ")
    gen.em, gen.memo = loop, {}
    gen.mask = f"(rd[:, None] < {d}) & (rl[None, :] < {length})"
    xk, _ = gen.value(k, at(k, ("rd[:, None]", "rl[None, :]")))
    loop.lines.append(f"        att_s = tl.dot({xq}, {xk}{precision})")
    lane_s = at(scores, ("rm[:, None]", "rl[None, :]"))
    gen.lane_values[scores] = (loop.let(f"att_s.to({_tl(sv.dtype)})", True, "p"), lane_s.dims)
    gen.mask = f"(rm[:, None] < {rows}) & (rl[None, :] < {length})"
    gen.narrow = True  # the scores' epilogue: a padding mask is one row of KV positions
    xs, _ = gen.value(x_in, at(x_in, ("rm[:, None]", "rl[None, :]")))
    gen.narrow = False
    loop.lines += _online_softmax(f"rl[None, :] < {length}", xs, 1)
    gen.lane_values[probs] = ("att_p", at(probs, ("rm[:, None]", "rl[None, :]")).dims)
    xa, _ = gen.value(a, at(a, ("rm[:, None]", "rl[None, :]")))
    gen.mask = f"(rl[:, None] < {length}) & (rv[None, :] < {d2})"
    xv, _ = gen.value(v, at(v, ("rl[:, None]", "rv[None, :]")))
    operand = _tl(vv.dtype)
    loop.lines += [
        f"        att_acc = att_acc * att_alpha[:, None] + tl.dot({xa}.to({operand}), {xv}.to({operand}){precision})",
        "        att_m = att_mnew",
    ]
    gen.em, gen.memo, gen.mask = outer
    em.lines.append(f"    for l0 in range(0, {length}, {bl}):")
    em.lines.append(f"        rl = l0 + tl.arange(0, {bl})")
    em.lines.extend(loop.lines)
    em.lines.append(f"    mask = (rm[:, None] < {rows}) & (rv[None, :] < {d2})")
    gen.lane_values.pop(scores, None)
    gen.lane_values.pop(probs, None)
    lane = at(out, ("rm[:, None]", "rv[None, :]"))
    gen.lane_values[out] = (em.let(f"(att_acc / att_l[:, None]).to({_tl(ov.dtype)})", True, "p"), lane.dims)
    held: dict[int, Idx] = {out: lane}  # the output and its layout ops (the heads' transpose and merge)
    _forward_layout(gen, spec, gen.producer[out][0], held)
    stores: list[tuple[int, Idx]] = []
    for o in spec.outputs:
        if o in held:
            stores.append((o, held[o]))
            continue
        node = gen.producer.get(o)
        if node is not None and node[0].op in LAYOUT_OPS - VIEW_OPS:
            raise Unsupported(f"{node[0].op} of a value computed after the weighted sum (stored at its lanes only)")
        stores += gen.lane_stores([o], lane, ov.shape, "an attention group")
    grid = (max(1, math.prod(batch)) * n_mb, 1, 1)
    return stores, grid, bl, warps


def _attention_combine(gen: _Gen, spec: GroupSpec) -> tuple[list[tuple[int, Idx]], tuple[int, int, int], int, int]:
    """One program per (batch, head): the splits' partial results merged, then the epilogue."""
    n_split, out = int(spec.params["kv_splits"]), int(spec.params["out"])
    ov = spec.values[out]
    batch, d2 = tuple(ov.shape[:-2]), ov.shape[-1]
    sp, bd2 = max(2, _pow2(n_split)), max(16, _pow2(d2))
    em = gen.em
    em.lines += [
        "    pid = tl.program_id(0)",
        f"    rs = tl.arange(0, {sp})",
        f"    rv = tl.arange(0, {bd2})",
    ]
    args = {}
    for name, v in (("m", ATT_M), ("l", ATT_L), ("acc", ATT_ACC)):
        if v not in gen.args:
            gen.args.append(v)
        args[name] = f"in{gen.args.index(v)}"
    em.lines += [
        f"    cm = tl.load({args['m']} + pid * {n_split} + rs, mask=rs < {n_split}, other=float('-inf'))",
        f"    cl = tl.load({args['l']} + pid * {n_split} + rs, mask=rs < {n_split}, other=0.0)",
        f"    ca = tl.load({args['acc']} + pid * {n_split * d2} + rs[:, None] * {d2} + rv[None, :],"
        f" mask=(rs[:, None] < {n_split}) & (rv[None, :] < {d2}), other=0.0)",
        "    cmax = tl.max(cm, axis=0)",
        "    cw = tl.where(cm == float('-inf'), 0.0, tl.exp(cm - tl.where(cmax == float('-inf'), 0.0, cmax)))",
        "    csum = tl.sum(cw * cl, axis=0)",
        "    cacc = tl.sum(cw[:, None] * ca, axis=0)",
        f"    mask = rv < {d2}",
    ]
    bidx = gen.batch_index("pid", batch)
    lane = Idx((*bidx.dims, "0", "rv"), (*bidx.lane, False, True))
    gen.lane_values[out] = (em.let(f"(cacc / csum).to({_tl(ov.dtype)})", True, "p"), lane.dims)
    stores = gen.lane_stores(spec.outputs, lane, ov.shape, "an attention group")
    return stores, (max(1, math.prod(batch)), 1, 1), bd2, 4


def _warps(n: int) -> int:
    return 1 if n <= 128 else 2 if n <= 512 else 4 if n <= 2048 else 8 if n <= 8192 else 16


def generate(
    spec: GroupSpec, block: int | None = None, num_warps: int | None = None, config: dict[str, int] | None = None
) -> Kernel:
    """The Triton kernel for ``spec`` (``block``/``num_warps``, or a product's ``config``: a tuning config).

    The kernel is named after its template and a hash of its source, so identical groups
    (the same layer's norm in every layer) share one compiled binary.
    """
    kv_nodes = kv_store_nodes(spec)
    for node in spec.nodes:
        if spec.template in ("product", "decode_attention") and node.op in PRODUCT_OPS:
            continue  # the anchors: product_node / attention_nodes check them
        if node in kv_nodes:
            continue
        if node.domain not in ("", "ai.onnx") or node.op not in SUPPORTED_OPS:
            raise Unsupported(f"no template for {node.domain + '::' if node.domain else ''}{node.op}")
    gen = _Gen(spec)
    if not spec.outputs:
        raise Unsupported("the group stores nothing")
    buffers = {n.outputs[0] for n in kv_nodes}
    plain = [v for v in spec.outputs if v not in buffers]  # stored through their own pointers
    for n in kv_nodes:
        if None in n.inputs[:3] or n.outputs[0] is None or n.inputs[1] not in gen.producer:
            raise Unsupported("a KV store of a row the kernel does not compute")
    for v in spec.outputs:
        _tl(spec.values[v].dtype)
        if spec.values[v].numel == 0:
            raise Unsupported("an empty output (nothing to compute; the reference kernels make it)")
    stores: list[tuple[int, Idx]] = []
    if spec.template == "product":
        stores, grid, block_size, warps = _product(gen, spec, config)
    elif spec.template == "decode_attention":
        stores, grid, block_size, warps = _attention(gen, spec, config)
    elif spec.template == "decode_attention_combine":
        stores, grid, block_size, warps = _attention_combine(gen, spec)
    elif spec.template == "row_reduction":
        reductions = [n for n in spec.nodes if n.op in _ROW_VALUED]
        src = reductions[0].inputs[0] if reductions else None
        if src is None:
            raise Unsupported("a row-reduction group without its reduction")
        row = tuple(spec.values[src].shape)
        if not row or row[-1] > MAX_ROW:
            raise Unsupported(f"a row of {row[-1] if row else 0} elements (the template holds {MAX_ROW})")
        gen.row = row
        n_rows = math.prod(row[:-1])
        rblock = max(16, 1 << (row[-1] - 1).bit_length())
        gen.em.lines.append("    pid = tl.program_id(0)")
        gen.em.lines.append(f"    r = tl.arange(0, {rblock})")
        gen.em.lines.append(f"    mask = r < {row[-1]}")
        outer = gen.unflatten("pid", row[:-1], lane=False) if row[:-1] else Idx((), ())
        gen.row_idx = Idx((*outer.dims, "r"), (*outer.lane, True))
        flat_row = "pid" if n_rows > 1 else "0"
        for v in spec.outputs:
            shape = spec.values[v].shape
            numel = math.prod(shape)
            if numel == math.prod(row):
                idx = gen.reshape(gen.row_idx, row, shape)
            elif numel == n_rows:
                idx = gen.unflatten(flat_row, shape, lane=False)
            else:
                raise Unsupported(f"an output of {list(shape)} in a group over rows of {list(row)}")
            stores.append((v, idx))
        grid = (n_rows, 1, 1)
        block_size = rblock
        warps = num_warps or _warps(rblock)
    else:
        if kv_nodes and spec.template not in ("pointwise", "copy"):
            raise Unsupported(f"a KV store in a {spec.template} kernel")  # the product template writes its own
        # what the lanes store: the outputs, and the rows the KV stores write (not their buffers)
        targets = list(dict.fromkeys([*plain, *(int(n.inputs[1]) for n in kv_nodes)]))  # type: ignore[arg-type]
        space = max(targets, key=lambda v: spec.values[v].numel)
        shape = spec.values[space].shape
        numel = max(1, math.prod(shape))
        block_size = block or min(1024, max(32, 1 << (numel - 1).bit_length()))
        gen.em.lines.append("    pid = tl.program_id(0)")
        gen.em.lines.append(f"    i = pid * {block_size} + tl.arange(0, {block_size})")
        gen.em.lines.append(f"    mask = i < {numel}")
        for v in targets:
            oshape = spec.values[v].shape
            size = max(1, math.prod(oshape))
            # A smaller output is stored by the first lanes, and again (the same values) by
            # the lanes past its size: every index stays in bounds, no store disagrees.
            flat = "i" if size == numel else gen.em.let(f"i % {size}", True, "i")
            stores.append((v, gen.unflatten(flat, oshape, lane=True)))
        grid = ((numel + block_size - 1) // block_size, 1, 1)
        warps = num_warps or (4 if block_size >= 512 else 2 if block_size >= 128 else 1)
    at = dict(stores)  # each stored value (and KV row) at the index its lanes hold
    kv_lines = [gen.kv_store(n, at[int(n.inputs[1])]) for n in kv_nodes]  # type: ignore[arg-type]
    stores = [(v, at[v]) for v in dict.fromkeys(v for v, _ in stores) if v in plain]
    stored: list[tuple[str, bool, str, bool, str, str]] = []  # name, varies, offset, varies, dtype, mask
    for v, idx in stores:
        expr, varies = gen.value(v, idx)
        off, off_varies = gen.flatten(idx, spec.values[v].shape)
        stored.append((expr, varies, off, off_varies, _tl(spec.values[v].dtype), gen.store_masks.get(v, "mask")))
    n_in = len(gen.args)  # the KV stores' buffers and positions are among them
    body = list(gen.em.lines)
    for k, (expr, varies, off, off_varies, tl_dtype, store_mask) in enumerate(stored):
        if spec.template in ("product", "decode_attention") and not varies and not spec.params.get("kv_splits"):
            raise Unsupported("a product group's output that does not depend on the product")
        if off_varies or varies:
            val = f"{expr}.to({tl_dtype})" if varies else f"tl.full([{block_size}], {expr}, {tl_dtype})"
            masked = f", mask={store_mask}" if store_mask else ""
            body.append(f"    tl.store(out{k} + ({off}), {val}{masked})")
        else:
            body.append(f"    tl.store(out{k} + ({off}), {expr}.to({tl_dtype}))")
    body += kv_lines
    params = [f"in{j}" for j in range(n_in)] + [f"out{k}" for k in range(len(stored))]
    if len(body) > MAX_SOURCE_LINES:
        raise Unsupported(f"the kernel would have {len(body)} lines")
    source = "\n".join(
        [
            "import triton",
            "import triton.language as tl",
            "from triton.language.extra import libdevice",
            "",
            "",
            "@triton.jit",
            f"def KERNEL({', '.join(params)}):",
            *body,
            "",
        ]
    )
    args = (*gen.args, *(v for v, _ in stores))
    tag = hashlib.blake2b(source.encode(), digest_size=5).hexdigest()
    prefix = {"row_reduction": "row", "product": "mm", "decode_attention": "attn"}.get(spec.template, "pw")
    if spec.template == "decode_attention_combine":
        prefix = "attn_combine"
    name = f"dsp_{prefix}_{tag}"
    source = source.replace("def KERNEL(", f"def {name}(", 1)
    kv = tuple(
        (int(n.outputs[0]), int(n.inputs[0]), int(n.inputs[1]), int(n.inputs[2]), int(n.attrs.get("axis", -2)))  # type: ignore[arg-type]
        for n in kv_nodes
    )
    return Kernel(source, name, tuple(args), n_in, grid, warps, block_size, spec.template, kv, gen.dependent)


# Programmatic dependent launch (sm_90+): a kernel launched with it may start while the
# kernel before it on the stream is still running, so it first waits for that kernel's
# completion and memory flush (griddepcontrol.wait) before it reads or writes anything, then
# lets the next kernel launch (griddepcontrol.launch_dependents). The next kernel's launch and
# prologue overlap this one's work, where a replayed graph otherwise pays ~1 us per node.
# Every kernel waits before it touches memory, so the order of the graph holds transitively.
# A kernel that reads constants first (a product's preloaded weight) marks where it waits.
DEPENDENT_LAUNCH_LINES = ("    tl.extra.cuda.gdc_wait()", "    tl.extra.cuda.gdc_launch_dependents()")


def with_dependent_launch(kernel: Kernel) -> Kernel:
    """``kernel`` made safe for a programmatic dependent launch: it waits, then releases the next one.

    At its marker (after the loads of constants only), else as its first statements.
    """
    lines = kernel.source.split("\n")
    if any(line in DEPENDENT_LAUNCH_LINES for line in lines):
        return kernel
    if WAIT_MARKER in lines:
        marker = lines.index(WAIT_MARKER)
        lines[marker : marker + 1] = DEPENDENT_LAUNCH_LINES
    else:
        at = next((k for k, line in enumerate(lines) if line.startswith(f"def {kernel.name}(")), None)
        if at is None:
            raise Unsupported(f"no definition of {kernel.name} in its source")
        lines[at + 1 : at + 1] = DEPENDENT_LAUNCH_LINES
    return dataclasses.replace(kernel, source="\n".join(lines))


def kv_store(buffer: TensorSpec, update: TensorSpec, position: TensorSpec, axis: int, block: int = 1024) -> Kernel:
    """``dsp::KVScatter``: ``update`` written into ``buffer`` along ``axis`` from the device-held position.

    Arguments: the buffer, the update, the position (its first element is read on the
    device, so one graph serves every step). Rows past the buffer's end are not written.
    """
    for t in (buffer, update):
        _tl(t.dtype)
    if position.dtype not in ("int32", "int64"):
        raise Unsupported(f"a KV position of {position.dtype}")
    rank = len(buffer.shape)
    ax = axis % rank
    if len(update.shape) != rank:
        raise Unsupported("an update of another rank than its buffer")
    if update.numel == 0 or buffer.numel == 0:
        raise Unsupported("an empty update or buffer")
    gen = _Gen(GroupSpec("copy", [], {}, [], []))
    numel = max(1, update.numel)
    blk = min(block, max(32, 1 << (numel - 1).bit_length()))
    em = gen.em
    em.lines += [
        "    pid = tl.program_id(0)",
        f"    i = pid * {blk} + tl.arange(0, {blk})",
        f"    mask = i < {numel}",
        "    p = tl.load(in2).to(tl.int32)",
    ]
    idx = gen.unflatten("i", update.shape, lane=True)
    ustr = update.strides or tuple(row_major(update.shape))
    bstr = buffer.strides or tuple(row_major(buffer.shape))
    row = em.let(f"{idx.dims[ax]} + p", True, "i")
    u_off = " + ".join(f"{d} * {ustr[k]}" for k, d in enumerate(idx.dims) if d != "0") or "0"
    b_dims = [row if k == ax else d for k, d in enumerate(idx.dims)]
    b_off = " + ".join(f"{d} * {bstr[k]}" for k, d in enumerate(b_dims) if d != "0") or "0"
    body = list(em.lines)
    body.append(f"    ok = mask & ({row} >= 0) & ({row} < {buffer.shape[ax]})")
    body.append(f"    x = tl.load(in1 + ({u_off}), mask=ok, other=0)")
    body.append(f"    tl.store(in0 + ({b_off}), x.to({_tl(buffer.dtype)}), mask=ok)")
    source = "\n".join(
        [
            "import triton",
            "import triton.language as tl",
            "",
            "",
            "@triton.jit",
            "def KERNEL(in0, in1, in2):",
            *body,
            "",
        ]
    )
    tag = hashlib.blake2b(source.encode(), digest_size=5).hexdigest()
    name = f"dsp_kv_{tag}"
    source = source.replace("def KERNEL(", f"def {name}(", 1)
    grid = ((numel + blk - 1) // blk, 1, 1)
    return Kernel(source, name, (0, 1, 2), 3, grid, 4 if blk >= 512 else 2 if blk >= 128 else 1, blk, "kv_store")


# The greedy pick (dsp::Sample at temperature 0, ArgMax over the last axis): each value is
# compared as an integer key that orders like the float (NaN above everything, as numpy's
# argmax takes the first NaN; -0 equal to +0), so the first index of the row's best is exact.
ARGMAX_CHUNK = 1024  # elements of a row one program of the first kernel reads


def argmax_rows(logits: TensorSpec, chunk: int = ARGMAX_CHUNK) -> tuple[Kernel, Kernel]:
    """The first index of each row's largest value of a [B, V] tensor (any strides), as two kernels.

    The first kernel (grid: chunks x rows) writes each chunk's best key (int64) and its first
    index (int64) to two [B, chunks] scratch arrays; the second (grid: rows) picks the best
    chunk and writes the row's index (int64 [B]). A single reduction over a 128k vocabulary
    keeps one block busy for ~100 µs; this spreads the row over the device.
    Arguments: (logits, keys, indexes) and (keys, indexes, out).
    """
    p = pick_rows(logits, chunk)
    bits, magnitude, inf = f"tl.int{p.width}", p.magnitude, p.inf
    rows, vocab, rs, cs, blk, chunks = p.rows, p.vocab, p.row_stride, p.col_stride, p.chunk, p.chunks
    big, small = "9223372036854775807", "-9223372036854775808"
    first = [
        "import triton",
        "import triton.language as tl",
        "",
        "",
        "@triton.jit",
        "def KERNEL(in0, out0, out1):",
        "    c = tl.program_id(0)",
        "    b = tl.program_id(1)",
        f"    j = c * {blk} + tl.arange(0, {blk})",
        f"    mask = j < {vocab}",
        f"    x = tl.load(in0 + b.to(tl.int64) * {rs} + j.to(tl.int64) * {cs}, mask=mask, other=0)",
        f"    bits = x.to({bits}, bitcast=True)",
        f"    mag = (bits & {magnitude}).to(tl.int64)",
        "    key = tl.where(bits < 0, -mag, mag)",
        f"    key = tl.where(mag > {inf}, {big}, key)",
        f"    key = tl.where(mask, key, {small})",
        "    best = tl.max(key, axis=0)",
        "    pos = tl.min(tl.where(key == best, j, 2147483647), axis=0)",
        f"    tl.store(out0 + b * {chunks} + c, best)",
        f"    tl.store(out1 + b * {chunks} + c, pos.to(tl.int64))",
        "",
    ]
    width = max(2, 1 << (chunks - 1).bit_length())
    second = [
        "import triton",
        "import triton.language as tl",
        "",
        "",
        "@triton.jit",
        "def KERNEL(in0, in1, out0):",
        "    b = tl.program_id(0)",
        f"    c = tl.arange(0, {width})",
        f"    mask = c < {chunks}",
        f"    key = tl.load(in0 + b * {chunks} + c, mask=mask, other={small})",
        f"    pos = tl.load(in1 + b * {chunks} + c, mask=mask, other={big})",
        "    best = tl.max(key, axis=0)",
        f"    tl.store(out0 + b, tl.min(tl.where(key == best, pos, {big}), axis=0))",
        "",
    ]
    kernels = []
    for lines, prefix, grid, args, n_in, warps, block in (
        (first, "dsp_argmax_", (chunks, rows, 1), (0, 1, 2), 1, 4, blk),
        (second, "dsp_argmax_pick_", (rows, 1, 1), (1, 2, 3), 2, 1, width),
    ):
        source = "\n".join(lines)
        name = prefix + hashlib.blake2b(source.encode(), digest_size=5).hexdigest()
        source = source.replace("def KERNEL(", f"def {name}(", 1)
        kernels.append(Kernel(source, name, args, n_in, grid, warps, block, "argmax"))
    return kernels[0], kernels[1]


__all__ = [
    "MAX_PRODUCT_ROWS",
    "MERGED_B",
    "MERGED_C",
    "MERGED_Y",
    "PRODUCT_OPS",
    "SUPPORTED_OPS",
    "VIEW_ON_CUPY",
    "ARGMAX_CHUNK",
    "ProductShape",
    "GroupSpec",
    "Kernel",
    "NodeSpec",
    "TensorSpec",
    "Unsupported",
    "argmax_rows",
    "attention_configs",
    "attention_nodes",
    "attention_parts",
    "attention_split_specs",
    "data_inputs",
    "with_dependent_launch",
    "generate",
    "kv_store",
    "merged_operands",
    "merged_spec",
    "product_configs",
    "product_node",
    "product_shape",
]
