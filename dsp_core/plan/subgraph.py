"""A segment of a plan written back out as a self-contained ONNX model.

Backends that hand a whole segment to another runtime (OpenVINO, ONNX Runtime) compile
it from this model: the segment's slots become its nodes, the values it reads from
outside become its graph inputs (with the concrete shapes of this live plan), the
constants and sealed values it reads become initializers, and the values other units
read become its outputs. Every tensor is named ``v<flat index>``, so the runtime's
input and output names map straight back onto the executor's flat value list.

A ``dsp::MergedMatMul`` slot (dsp_core/plan/merge.py) is written in ONNX as what it
means: its weights (and biases) joined by Concat, which the runtime folds once, one
MatMul or Gemm, and a Slice of the last axis for each of the slot's outputs.

A ``dsp::KVScatter`` slot (the decode plan's KV store) is written as the buffer it makes:
ScatterElements of the step's rows into the buffer read as an input, at ``position +
arange(n)`` along its axis (a negative start counts from the end, as the reference's fancy
index wraps it). The runtime computes a new tensor, read by the slots after it in the
segment; the write into the buffer itself is the caller's, after the runtime's call
(``dsp_core.backends.whole.WholeSegment``), so the runtime never writes an input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dsp_core.ir import dtypes
from dsp_core.ir.typecheck import attribute_types
from dsp_core.ops.llm import KV_STORE_OPSET, is_kv_store
from dsp_core.plan.merge import is_merged
from dsp_core.plan.plan import Plan, Slot

# The IR version written: 10 is read by every ONNX Runtime >= 1.17 and OpenVINO >= 2024.
IR_VERSION = 10


@dataclass(frozen=True)
class SubgraphIO:
    """The flat indexes a segment model reads (feeds, in input order) and writes (outputs)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def name_of(flat: int) -> str:
    """The tensor name of flat index ``flat`` in a segment model."""
    return f"v{flat}"


def segment_model(
    plan: Plan,
    slots: Sequence[int],
    io: SubgraphIO,
    feeds: Mapping[int, tuple[str, tuple[int, ...] | None]],
    constants: Mapping[int, np.ndarray],
    tensor_scatter: bool = False,
    attention_window: float = 0.0,
    split_merged: bool = False,
) -> onnx.ModelProto:
    """The ONNX model of ``slots``: inputs ``io.inputs`` typed by ``feeds`` (flat -> (dtype, shape)).

    ``tensor_scatter``: write each KV store as ONNX's TensorScatter (opset 24), which a runtime
    can run in place (ONNX Runtime skips its copy when the output is bound onto the cache; its
    ScatterElements copies the whole buffer either way: GPT-2 124M, 24 stores of 467 KB, about
    24 against 3 µs each), where the model's opset can be raised to 24 without changing what any
    of its ops means (``raises_cleanly``) and every store's buffer shape is known. Else, and by
    default, ScatterElements.

    ``attention_window`` (with TensorScatter; for a runtime that runs tensors of a shape known only
    when it runs): each attention that reads a stored K and V buffer of ``L`` positions reads only
    the positions written so far (``_attention_windows``) while they are fewer than
    ``attention_window * L``, and the whole buffer from there on (``_attention_nodes``); 0: the whole
    buffer always, 1 or more: the window always.

    ``split_merged``: each merged product (``dsp::MergedMatMul``) written as its parts' own products
    on their own weights, for a runtime that fuses the model's products its own way (OpenVINO).
    """
    opsets: dict[str, int] = {}
    for s in slots:
        slot = plan.slots[s]
        if is_kv_store(slot):
            continue  # written as ONNX ops of any opset from 11 (below)
        domain = "" if is_merged(slot) else slot.domain  # written as ONNX ops
        opsets[domain] = max(opsets.get(domain, 1), slot.opset)
    opsets.setdefault("", max(opsets.values(), default=17))
    stores = [s for s in slots if is_kv_store(plan.slots[s])]
    if stores and opsets[""] < KV_STORE_OPSET:
        raise ValueError(
            f"a KV store in a segment of ONNX opset {opsets['']}: it is written with ScatterElements and Range, "
            f"which need opset {KV_STORE_OPSET}"
        )
    shapes = {s: _store_shape(plan, s, feeds) for s in stores} if tensor_scatter else {}
    scatter: set[str] | None = None  # the write positions made so far: once per (position, length, batch)
    if stores and shapes and all(shape is not None for shape in shapes.values()):
        ops = {plan.slots[s].op for s in slots if plan.slots[s].domain in ("", "ai.onnx") and s not in stores}
        if opsets[""] >= TENSOR_SCATTER_OPSET or raises_cleanly(ops, opsets[""], TENSOR_SCATTER_OPSET):
            opsets[""] = max(opsets[""], TENSOR_SCATTER_OPSET)
            scatter = set()
    windowed = attention_window > 0 and scatter is not None
    windows = _attention_windows(plan, slots, shapes, set(io.outputs)) if windowed else {}
    nodes = []
    for s in slots:
        shape = shapes.get(s)
        if scatter is not None and shape is not None:
            nodes.extend(_tensor_scatter_nodes(plan, s, shape, scatter))
        elif s in windows:
            if s == windows[s].region[-1]:  # a layer's attention, where its last slot was
                assert scatter is not None
                nodes.extend(_attention_nodes(plan, windows, windows[s].region, attention_window, scatter))
        else:
            nodes.extend(_nodes(plan, s, opsets[""], split_merged))
    graph_inputs = [_value_info(name_of(f), *feeds[f]) for f in io.inputs]
    graph_outputs = [_value_info(name_of(f), *_out_info(plan, f)) for f in io.outputs]
    graph = helper.make_graph(nodes, f"dsp_segment_{len(slots)}", graph_inputs, graph_outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()], producer_name="dsp"
    )
    model.ir_version = IR_VERSION
    # The constants go in last, straight into the model's own graph: make_graph and make_model
    # copy every initializer they are given, and a segment's weights can be gigabytes.
    for f, a in constants.items():
        _add_initializer(model.graph, name_of(f), c_order(a))
    return model


# numpy dtypes whose bytes are an ONNX tensor's raw_data as they are (little-endian, one element each)
_RAW_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
)


def _add_initializer(graph: onnx.GraphProto, name: str, array: np.ndarray) -> None:
    """``array`` as the initializer ``name`` of ``graph``, its bytes copied once (numpy_helper for other dtypes)."""
    if array.dtype.name not in _RAW_DTYPES or array.dtype.byteorder == ">":
        graph.initializer.append(numpy_helper.from_array(array, name))
        return
    tensor = graph.initializer.add()
    tensor.name = name
    tensor.data_type = dtypes.to_onnx(array.dtype.name)
    tensor.dims.extend(array.shape)
    tensor.raw_data = array.tobytes()


def _nodes(plan: Plan, s: int, opset: int, split_merged: bool = False) -> list[onnx.NodeProto]:
    """The ONNX nodes of slot ``s`` in a model of ONNX opset ``opset``: one, except for a merged
    product (split back into its parts' products with ``split_merged``) and a KV store."""
    if is_merged(plan.slots[s]):
        return _split_nodes(plan, s) if split_merged else _merged_nodes(plan, s, opset)
    if is_kv_store(plan.slots[s]):
        return _kv_store_nodes(plan, s)
    return [_node(plan, s)]


def _int64_constant(name: str, value: Any) -> onnx.NodeProto:
    """A Constant node whose output ``name`` (also the node's name) is ``value`` as int64."""
    tensor = numpy_helper.from_array(np.asarray(value, np.int64), name)
    return helper.make_node("Constant", [], [name], name=name, value=tensor)


def _kv_store_nodes(plan: Plan, s: int) -> list[onnx.NodeProto]:
    """``dsp::KVScatter(buffer, rows, position)`` as the buffer it makes: ScatterElements of ``rows``
    at ``position[0] + arange(n)`` along the axis, as a new tensor (see the module docstring)."""
    slot = plan.slots[s]
    buffer, rows, position = (name_of(plan.flat(r)) if r is not None else "" for r in slot.inputs[:3])
    out = slot.outputs[0]
    assert out is not None and buffer and rows and position, "a KV store reads its buffer, rows and position"
    shape = plan.ref_info(slot.inputs[0])[1]
    assert shape is not None, "a KV buffer of known rank"
    rank = len(shape)
    axis = int(slot.attrs.get("axis", -2)) % rank
    t = f"s{s}_kv_"

    def const(name: str, value: Any) -> onnx.NodeProto:
        return _int64_constant(t + name, value)

    view = [1] * rank
    view[axis] = -1
    return [
        const("axis", axis),
        const("zero", 0),
        const("one", 1),
        const("flat", [-1]),
        const("view", view),
        helper.make_node("Shape", [rows], [t + "shape"], name=t + "shape"),
        helper.make_node("Gather", [t + "shape", t + "axis"], [t + "n"], name=t + "n", axis=0),
        helper.make_node("Cast", [position], [t + "p64"], name=t + "p64", to=onnx.TensorProto.INT64),
        helper.make_node("Reshape", [t + "p64", t + "flat"], [t + "pflat"], name=t + "pflat"),
        helper.make_node("Gather", [t + "pflat", t + "zero"], [t + "start"], name=t + "start", axis=0),
        helper.make_node("Range", [t + "zero", t + "n", t + "one"], [t + "steps"], name=t + "steps"),
        helper.make_node("Add", [t + "steps", t + "start"], [t + "at"], name=t + "at"),
        helper.make_node("Reshape", [t + "at", t + "view"], [t + "atv"], name=t + "atv"),
        helper.make_node("Expand", [t + "atv", t + "shape"], [t + "index"], name=t + "index"),
        helper.make_node(
            "ScatterElements", [buffer, t + "index", rows], [name_of(plan.flat(out))], name=f"s{s}", axis=axis
        ),
    ]


TENSOR_SCATTER_OPSET = 24  # the first ONNX opset with TensorScatter


def raises_cleanly(ops: set[str], base: int, target: int) -> bool:
    """True when every ONNX op of ``ops`` means the same at opset ``target`` as at ``base``: each
    newer version keeps the older one's inputs and outputs (new inputs optional, at the end) and
    attributes (new ones optional), and only adds types. ONNX versions an op anew for each such
    addition (Reshape, Shape, Transpose: 24 for new float types) and does not change what the
    older inputs, attributes and types mean then. An op it cannot look up counts as a change."""
    from onnx import defs

    for op in ops:
        try:
            old, new = defs.get_schema(op, base), defs.get_schema(op, target)
        except Exception:  # noqa: BLE001  (onnx.defs.SchemaError: an op this onnx does not know)
            return False
        if old.since_version == new.since_version:
            continue
        old_in, new_in = [(i.name, i.option) for i in old.inputs], [(i.name, i.option) for i in new.inputs]
        if new_in[: len(old_in)] != old_in or any(
            i.option != defs.OpSchema.FormalParameterOption.Optional for i in new.inputs[len(old_in) :]
        ):
            return False
        if [(o.name, o.option) for o in old.outputs] != [(o.name, o.option) for o in new.outputs]:
            return False
        if not set(old.attributes) <= set(new.attributes) or any(
            new.attributes[a].required for a in set(new.attributes) - set(old.attributes)
        ):
            return False
        allowed = {t.type_param_str: set(t.allowed_type_strs) for t in new.type_constraints}
        if any(not set(t.allowed_type_strs) <= allowed.get(t.type_param_str, set()) for t in old.type_constraints):
            return False
    return True


def _store_shape(plan: Plan, s: int, feeds: Mapping[int, tuple[str, tuple[int, ...] | None]]) -> tuple[int, ...] | None:
    """The concrete shape of KV store ``s``'s buffer (a fed input's, or the plan's), None if unknown
    or one TensorScatter cannot write (rank below 2, or the store's axis the first)."""
    slot = plan.slots[s]
    buffer = slot.inputs[0]
    if buffer is None:
        return None
    fed = feeds.get(plan.flat(buffer))
    shape = fed[1] if fed is not None else plan.ref_info(buffer)[1]
    if shape is None or len(shape) < 2 or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    if int(slot.attrs.get("axis", -2)) % len(shape) == 0:
        return None
    return tuple(d for d in shape if isinstance(d, int))


def _tensor_scatter_nodes(plan: Plan, s: int, shape: tuple[int, ...], made: set[str]) -> list[onnx.NodeProto]:
    """``dsp::KVScatter(buffer, rows, position)`` as one TensorScatter of ``rows`` into the buffer at
    ``position[0]`` (a negative start counted from the end, as the reference wraps it), every batch
    entry at the same start; ``shape`` is the buffer's (``_store_shape``). The write positions are
    made once per (position, length, batch), the keys in ``made``, and shared by the stores that
    read them (a decode step's 24 stores: one set of nodes)."""
    slot = plan.slots[s]
    buffer, rows, position = (name_of(plan.flat(r)) if r is not None else "" for r in slot.inputs[:3])
    out = slot.outputs[0]
    assert out is not None and buffer and rows and position, "a KV store reads its buffer, rows and position"
    axis = int(slot.attrs.get("axis", -2)) % len(shape)
    length, batch = shape[axis], shape[0]
    key = _position_key(position, length, batch)
    nodes: list[onnx.NodeProto] = []
    if key not in made:
        t = key + "_"

        def const(name: str, value: Any) -> onnx.NodeProto:
            return _int64_constant(t + name, value)

        nodes = [
            const("flat", [-1]),
            const("zero", 0),
            const("length", length),
            const("batch", [batch]),
            helper.make_node("Cast", [position], [t + "p64"], name=t + "p64", to=onnx.TensorProto.INT64),
            helper.make_node("Reshape", [t + "p64", t + "flat"], [t + "pflat"], name=t + "pflat"),
            helper.make_node("Gather", [t + "pflat", t + "zero"], [t + "start"], name=t + "start", axis=0),
            helper.make_node("Less", [t + "start", t + "zero"], [t + "neg"], name=t + "neg"),
            helper.make_node("Add", [t + "start", t + "length"], [t + "wrapped"], name=t + "wrapped"),
            helper.make_node("Where", [t + "neg", t + "wrapped", t + "start"], [t + "s"], name=t + "s"),
            helper.make_node("Expand", [t + "s", t + "batch"], [key], name=key),
        ]
        made.add(key)
    nodes.append(
        helper.make_node("TensorScatter", [buffer, rows, key], [name_of(plan.flat(out))], name=f"s{s}", axis=axis)
    )
    return nodes


def _position_key(position: str, length: int, batch: int) -> str:
    """The name of a store's write positions (and the prefix of the nodes that make them)."""
    return f"{position}_kvw{length}x{batch}"


# The ops an attention's scores pass through between the Q.K product and the Softmax: each other
# operand of theirs is a scalar, broadcast along the positions, or sliced with them (a mask).
_SCORE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Max", "Min", "Cast"})
# The ops a K or V buffer passes through before the attention reads it, its positions kept on the
# same axis from the end (grouped-query attention repeats each head: Unsqueeze, Expand, Reshape)
_LAYOUT_OPS = frozenset({"Unsqueeze", "Expand", "Reshape", "Identity"})


@dataclass(frozen=True)
class _Window:
    """What one slot of a windowed attention reads sliced: input index -> (axis, the end's name)."""

    cuts: tuple[tuple[int, int, str], ...]  # (input index, axis, end value name)
    ends: tuple[tuple[str, str, str, int, int], ...]  # (end name, position key, rows, axis, length): made once
    # the layer's attention, in order: K's transpose, Q.K, the score ops, the Softmax, the product by V
    region: tuple[int, ...] = ()


def _attention_windows(
    plan: Plan, slots: Sequence[int], shapes: Mapping[int, tuple[int, ...] | None], exported: set[int]
) -> dict[int, _Window]:
    """Where a decode step's attention reads only the KV positions written so far.

    A KV buffer holds ``L`` positions; the step writes ``n`` rows at ``p`` and its attention mask
    leaves out every position from ``p + n`` on (the fixed-KV decode graph's contract:
    ``dsp_core/llm/kv.py``), so their softmax weights are exactly 0 and reading ``[0, p + n)``
    alone gives the same output. Matched per layer, in the segment's slots:

        K store -> [_LAYOUT_OPS] -> Transpose of the last two axes -> MatMul(Q, .) -> scores
        scores -> one or more of _SCORE_OPS -> Softmax(last axis) -> MatMul(., V store [-> _LAYOUT_OPS])

    each value on the way read by the next slot alone (and by no other unit: ``exported``). The
    stores' buffers are sliced to ``[0, p + n)`` along their positions (second last) where the
    attention reads them (after the layout ops: their shapes hold ``L``), and each other
    operand on the scores' way whose last axis is ``L`` (the masks) along that axis; anything
    else leaves the layer as it was. A start counted from the end (negative) reads the whole
    buffer. Returns each slot of a matched attention -> its window (its cuts, the layer's slots).
    """
    mine = set(slots)
    readers: dict[int, list[tuple[int, int]]] = {}
    for s in slots:
        for j, r in enumerate(plan.slots[s].inputs):
            if r is not None:
                readers.setdefault(plan.flat(r), []).append((s, j))

    def only_reader(flat: int, own: bool = True) -> tuple[int, int] | None:
        """The one slot reading ``flat``; ``own``: and no other unit (the stores' buffers are read
        by the caller too: they stay as they are, sliced into new values)."""
        got = readers.get(flat, [])
        return got[0] if len(got) == 1 and got[0][0] in mine and not (own and flat in exported) else None

    def onnx_slot(s: int) -> bool:
        slot = plan.slots[s]
        return slot.domain in ("", "ai.onnx") and not is_merged(slot) and not is_kv_store(slot)

    stores: dict[int, tuple[int, int, str, int]] = {}  # store output flat -> (axis, L, end name, rank)
    ends: dict[str, tuple[str, str, str, int, int]] = {}
    for s, shape in shapes.items():
        slot = plan.slots[s]
        out, rows = slot.outputs[0], slot.inputs[1]
        if shape is None or out is None or rows is None or slot.inputs[2] is None:
            continue
        axis = int(slot.attrs.get("axis", -2)) % len(shape)
        length = shape[axis]
        key = _position_key(name_of(plan.flat(slot.inputs[2])), length, shape[0])
        end = f"{key}_end"  # the stores of one step write as many rows at one position: one end
        ends.setdefault(end, (end, key, name_of(plan.flat(rows)), axis, length))
        stores[plan.flat(out)] = (axis, length, end, len(shape))
    # each store's buffer, through the layout ops that repeat it for grouped heads, to the slot
    # that reads it for the attention: (slot, input index) -> (store flat, the read value's rank)
    reads: dict[tuple[int, int], tuple[int, int]] = {}
    for flat, (axis, _, _, rank) in stores.items():
        if axis != rank - 2:
            continue  # positions second last, as the attention's products read them
        value, at = flat, only_reader(flat, own=False)
        while at is not None and onnx_slot(at[0]) and plan.slots[at[0]].op in _LAYOUT_OPS and at[1] == 0:
            value = plan.flat(plan.slots[at[0]].outputs[0])
            at = only_reader(value)
        read = plan.ref_info(plan.slots[at[0]].inputs[at[1]])[1] if at is not None else None
        if at is not None and onnx_slot(at[0]) and read is not None and len(read) >= 2:
            reads[at] = (flat, len(read))
    found: dict[int, _Window] = {}
    for (s, j), (flat, rank) in reads.items():
        slot, end = plan.slots[s], stores[flat][2]
        # K: its positions second last, moved last by the transpose, read as MatMul(Q, .)'s B
        perm = [int(x) for x in slot.attrs.get("perm", range(rank - 1, -1, -1))]
        if slot.op != "Transpose" or perm != [*range(rank - 2), rank - 1, rank - 2]:
            continue
        cuts: dict[int, list[tuple[int, int, str]]] = {s: [(j, rank - 2, end)]}
        region = [s]
        nxt = only_reader(plan.flat(slot.outputs[0]))
        if nxt is None or not onnx_slot(nxt[0]) or plan.slots[nxt[0]].op != "MatMul" or nxt[1] != 1:
            continue
        # the scores, through _SCORE_OPS, to the Softmax over the positions
        slot = plan.slots[nxt[0]]
        region.append(nxt[0])
        ok = True
        while ok:
            nxt = only_reader(plan.flat(slot.outputs[0]))
            if nxt is None or not onnx_slot(nxt[0]):
                ok = False
                break
            s, slot = nxt[0], plan.slots[nxt[0]]
            region.append(s)
            if slot.op == "Softmax":
                break
            if slot.op not in _SCORE_OPS:
                ok = False
                break
            for k, r in enumerate(slot.inputs):
                if k == nxt[1] or r is None:
                    continue
                other = plan.ref_info(r)[1]
                if other is None:
                    ok = False  # its rank unknown: its last axis cannot be named
                elif len(other) >= 1:
                    # broadcast against the scores, its last axis is the positions' or 1: a Slice
                    # clamps its end to the axis, so either way [0, end) is what it reads
                    cuts.setdefault(s, []).append((k, len(other) - 1, end))
        if not ok or int(slot.attrs.get("axis", -1 if slot.opset >= 13 else 1)) % rank != rank - 1:
            continue
        # the probabilities into MatMul(., V), V another store's buffer of the same step
        nxt = only_reader(plan.flat(slot.outputs[0]))
        v = reads.get((nxt[0], 1)) if nxt is not None and nxt[1] == 0 else None
        # (length, end): a buffer of the same length, written at the same position
        if nxt is None or v is None or plan.slots[nxt[0]].op != "MatMul" or stores[v[0]][1:3] != stores[flat][1:3]:
            continue
        cuts.setdefault(nxt[0], []).append((1, v[1] - 2, end))
        region.append(nxt[0])
        for t in region:
            found[t] = _Window(tuple(cuts.get(t, ())), (ends[end],), tuple(region))
    return found


def _window_end_nodes(window: _Window, made: set[str]) -> list[onnx.NodeProto]:
    """The nodes of each end ``window`` reads (``position + rows``, or the whole length for a start
    counted from the end) not yet in ``made``."""
    nodes: list[onnx.NodeProto] = []
    for end, key, rows, axis, length in window.ends:
        if end in made:
            continue
        t = end + "_"
        nodes += [
            _int64_constant(t + name, value) for name, value in (("length", [length]), ("one", [1]), ("zero", [0]))
        ]
        nodes += [
            helper.make_node("Shape", [rows], [t + "rows"], name=t + "rows", start=axis, end=axis + 1),
            helper.make_node("Reshape", [key + "_s", t + "one"], [t + "start"], name=t + "start"),
            helper.make_node("Add", [t + "start", t + "rows"], [t + "sum"], name=t + "sum"),
            helper.make_node("Where", [key + "_neg", t + "length", t + "sum"], [t + "pick"], name=t + "pick"),
            helper.make_node("Min", [t + "pick", t + "length"], [end], name=end),
        ]
        made.add(end)
    return nodes


def _windowed_node(plan: Plan, s: int, window: _Window) -> list[onnx.NodeProto]:
    """Slot ``s``'s node reading the inputs ``window`` cuts sliced to their end (made before it)."""
    nodes: list[onnx.NodeProto] = []
    node = _node(plan, s)
    for j, axis, end in window.cuts:
        source = node.input[j]
        cut = f"{source}_w{s}_{j}"
        nodes.append(_int64_constant(cut + "_axes", [axis]))
        nodes.append(helper.make_node("Slice", [source, end + "_zero", end, cut + "_axes"], [cut], name=cut))
        node.input[j] = cut
    nodes.append(node)
    return nodes


def _attention_nodes(
    plan: Plan, windows: Mapping[int, _Window], region: tuple[int, ...], below: float, made: set[str]
) -> list[onnx.NodeProto]:
    """One layer's attention (``region``'s slots) reading the window while ``end < below * L``.

    A slice copies what it keeps, so the window costs a pass over the positions written so far
    where the whole buffer costs a read of all ``L``: past a fraction of ``L`` the whole buffer is
    cheaper (GPT-2 124M, 296 positions, ONNX Runtime: at 1 thread the window's 12 layers took 223 µs
    at 51 positions and 676 at 201, the whole buffer about 500 at either; at 2 threads 706 and 1,769
    against 1,000). ``below`` >= 1: the window always, no switch; else an ONNX ``If`` on
    ``end < ceil(below * L)`` runs the windowed nodes or the layer's own, each in a branch of its own
    (their values renamed apart; what they read from outside by its name), and gives the layer's output.
    """
    window = windows[region[-1]]
    nodes = _window_end_nodes(window, made)
    if below >= 1:
        for s in region:
            nodes.extend(_windowed_node(plan, s, windows[s]))
        return nodes
    end, length = window.ends[0][0], window.ends[0][4]
    out_flat = plan.flat(plan.slots[region[-1]].outputs[0])
    out, dtype = name_of(out_flat), _out_info(plan, out_flat)[0]
    cond = f"{end}_below{length}"
    if cond not in made:
        nodes.append(_int64_constant(cond + "_at", [math.ceil(below * length)]))
        nodes.append(helper.make_node("Less", [end, cond + "_at"], [cond], name=cond))
        made.add(cond)

    def branch(tag: str, body: list[onnx.NodeProto]) -> onnx.GraphProto:
        inner = {o for n in body for o in n.output}
        for n in body:
            n.name = f"{n.name}_{tag}"
            n.input[:] = [f"{x}_{tag}" if x in inner else x for x in n.input]
            n.output[:] = [f"{x}_{tag}" for x in n.output]
        return helper.make_graph(body, f"{out}_{tag}", [], [_value_info(f"{out}_{tag}", dtype, None)])

    windowed = [n for s in region for n in _windowed_node(plan, s, windows[s])]
    whole = [_node(plan, s) for s in region]
    nodes.append(
        helper.make_node(
            "If", [cond], [out], name=f"{out}_window", then_branch=branch("w", windowed), else_branch=branch("a", whole)
        )
    )
    return nodes


def _merged_nodes(plan: Plan, s: int, opset: int) -> list[onnx.NodeProto]:
    """``dsp::MergedMatMul`` as ONNX: Concat of the weights (and biases), one product, a Slice per part."""
    slot = plan.slots[s]
    k, names, outs = _merged_names(plan, s)
    trans_b = int(slot.attrs.get("transB", 0))
    tmp = f"s{s}_merged_"
    nodes = [helper.make_node("Concat", names[1 : 1 + k], [tmp + "w"], name=tmp + "w", axis=0 if trans_b else 1)]
    product_inputs = [names[0], tmp + "w"]
    if slot.attrs.get("form") == "Gemm" and slot.attrs.get("bias"):
        nodes.append(helper.make_node("Concat", names[1 + k :], [tmp + "c"], name=tmp + "c", axis=-1))
        product_inputs.append(tmp + "c")
    nodes.append(_product_node(slot, product_inputs, tmp + "y", tmp + "y"))
    # Each part a Slice of the last axis, in the form of the model's opset (not the merged slot's
    # own, which is the dsp domain's: a Split written by that one took opset 1's ``split``
    # attribute into an opset-18 model, which ONNX Runtime refuses and OpenVINO read as even parts)
    start = 0
    for j, n in enumerate(_part_n(plan, r, trans_b) for r in slot.inputs[1 : 1 + k]):
        name = f"s{s}" if j == 0 else f"s{s}_{j}"
        if opset >= 10:  # starts, ends and axes are inputs from opset 10 on
            bounds = []
            for what, value in (("starts", start), ("ends", start + n), ("axes", -1)):
                nodes.append(_int64_constant(f"{tmp}{what}{j}", [value]))
                bounds.append(f"{tmp}{what}{j}")
            nodes.append(helper.make_node("Slice", [tmp + "y", *bounds], [outs[j]], name=name))
        else:
            nodes.append(
                helper.make_node(
                    "Slice", [tmp + "y"], [outs[j]], name=name, starts=[start], ends=[start + n], axes=[-1]
                )
            )
        start += n
    return nodes


def _split_nodes(plan: Plan, s: int) -> list[onnx.NodeProto]:
    """``dsp::MergedMatMul`` as the products it merged: one MatMul (or Gemm) per part, on that part's
    own weight (and bias). OpenVINO's MiniLM-L3 at 2 threads, batch 8: 66.0 ms a step with the
    merged product written as one, 62.2 ms with its parts (59.9 ms for OpenVINO on the model itself)."""
    slot = plan.slots[s]
    k, names, outs = _merged_names(plan, s)
    biased = slot.attrs.get("form") == "Gemm" and bool(slot.attrs.get("bias"))
    nodes = []
    for j, v in enumerate(slot.outputs):
        if v is None:
            continue  # a part nothing reads: no product
        inputs = [names[0], names[1 + j], *([names[1 + k + j]] if biased else [])]
        nodes.append(_product_node(slot, inputs, outs[j], f"s{s}" if j == 0 else f"s{s}_{j}"))
    return nodes


def _merged_names(plan: Plan, s: int) -> tuple[int, list[str], list[str]]:
    """A merged product's part count, its inputs' names (the input, the weights, the biases) and its
    outputs' (a placeholder name for a part nothing reads)."""
    slot = plan.slots[s]
    names = [name_of(plan.flat(r)) for r in slot.inputs]
    outs = [name_of(plan.flat(v)) if v is not None else f"s{s}_unused{j}" for j, v in enumerate(slot.outputs)]
    return len(slot.outputs), names, outs


def _product_node(slot: Slot, inputs: list[str], out: str, name: str) -> onnx.NodeProto:
    """The merged slot's product on ``inputs``: a MatMul, or a Gemm with the slot's transB, alpha, beta."""
    if slot.attrs.get("form") != "Gemm":
        return helper.make_node("MatMul", inputs, [out], name=name)
    node = helper.make_node("Gemm", inputs, [out], name=name, transB=int(slot.attrs.get("transB", 0)))
    alpha, beta = float(slot.attrs.get("alpha", 1.0)), float(slot.attrs.get("beta", 1.0))
    node.attribute.extend([helper.make_attribute("alpha", alpha), helper.make_attribute("beta", beta)])
    return node


def _part_n(plan: Plan, weight: int | None, trans_b: int) -> int:
    shape = plan.ref_info(weight)[1]
    assert shape is not None and len(shape) == 2, "a merged product's weights are rank-2 constants"
    return int(shape[0] if trans_b else shape[1])  # type: ignore[arg-type]


def _node(plan: Plan, s: int) -> onnx.NodeProto:
    slot = plan.slots[s]
    ins = ["" if r is None else name_of(plan.flat(r)) for r in slot.inputs]
    outs = ["" if v is None else name_of(plan.flat(v)) for v in slot.outputs]
    while ins and ins[-1] == "":  # trailing missing optionals: leave them out
        ins.pop()
    node = helper.make_node(slot.op, ins, outs, name=f"s{s}", domain=slot.domain or None)
    declared = attribute_types(slot.domain, slot.op, slot.opset) or {}
    node.attribute.extend(_attr(k, v, declared.get(k)) for k, v in slot.attrs.items())
    return node


def _attr(key: str, val: Any, declared: int | None) -> onnx.AttributeProto:
    if isinstance(val, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(val))
    if isinstance(val, (list, tuple)) and val and isinstance(val[0], np.ndarray):
        return helper.make_attribute(key, [numpy_helper.from_array(v) for v in val])
    if isinstance(val, tuple):
        val = list(val)
    # An empty list has no element to infer the type from: the schema says it.
    attr_type = declared if declared is not None and isinstance(val, list) and not val else None
    return helper.make_attribute(key, val, attr_type=attr_type)  # type: ignore[arg-type]


def _value_info(name: str, dtype: str | None, shape: tuple[Any, ...] | None) -> onnx.ValueInfoProto:
    if not dtype:
        return onnx.ValueInfoProto(name=name)  # untyped: the runtime's own inference types it
    elem = dtypes.to_onnx(dtype)
    dims = None if shape is None else [d if isinstance(d, (int, str)) and d != -1 else None for d in shape]
    return helper.make_tensor_value_info(name, elem, dims)


def _out_info(plan: Plan, flat: int) -> tuple[str | None, None]:
    """An output's dtype as the plan knows it; its shape is left to the runtime's inference
    (a model's declared shapes can be stale, and the runtime checks them against its own)."""
    ref = flat - 1 - len(plan.externals)
    return plan.ref_info(ref)[0], None


def c_order(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous ndarray of the same shape (np.ascontiguousarray makes a 0-d array 1-d)."""
    array = np.asarray(array)
    return array if array.flags.c_contiguous else array.copy(order="C")


def serialized(model: onnx.ModelProto) -> bytes:
    """The model's bytes (what ``Core.read_model`` and ``InferenceSession`` read)."""
    return model.SerializeToString()


__all__ = ["SubgraphIO", "c_order", "is_kv_store", "name_of", "segment_model", "serialized"]
