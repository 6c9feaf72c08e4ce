"""Fusion analysis: pattern kinds, iteration spaces and greedy fusion groups of a segment.

Backend-neutral (docs/fusion.md). Every live slot gets a pattern kind (TVM's
OpPatternKind) and an iteration space ``(numel, rnumel)`` (Inductor's). ``propose_groups``
walks a segment's slots in topological order and puts each slot into the group of one
of its producers when the core's legality rules and the backend's ``FusionPolicy`` both
allow it, else opens a new group:

- no cycle between groups (Inductor's ``will_fusion_create_cycle``), counting the
  ordering edges of MUTATES_INPUT slots (a reader of a buffer runs before its in-place write);
- one reduction stage per group (tinygrad's grouper): reductions of one group share the
  row space and none reads another's result;
- the output of an injective op (transpose, slice, gather, ...) fuses only when every
  read of it is the same index: here, when its one reader is the slot joining (a view
  op, reshape and friends, only relabels indexes and may have any number of readers);
- an opaque slot (control flow, random, dynamic output size, unknown) is a group alone.

Groups are *dependency-ordered*, not necessarily contiguous: ``FusionResult.schedule()``
gives an order (groups in topological order, each group's slots in plan order) that
respects every data and mutation edge, and the reference backend runs a grouped segment
in exactly that order, so grouping is tested on a CPU against the ungrouped plan.

Groups are a pure function of (plan, the segment's live slots, the policy); they are
computed when a segment is compiled (``Backend.compile``) and carried on the Segment.
"""

from __future__ import annotations

import collections
import enum
import heapq
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Dim, ExternalClass, Plan


class PatternKind(enum.Enum):
    """How a slot's output indexes relate to its inputs' (TVM's OpPatternKind)."""

    ELEMENTWISE = "elementwise"  # out[i] = f(in[i]), every input of the output's shape
    BROADCAST = "broadcast"  # elementwise after broadcasting a smaller input
    INJECTIVE = "injective"  # out[i] = in[g(i)]: reshape, transpose, slice, concat, gather, expand
    ROW_REDUCTION = "row_reduction"  # reduces the last axis (Reduce*, Softmax, LayerNorm, ArgMax)
    MATMUL = "matmul"
    ATTENTION = "attention"
    STORE = "store"  # an in-place write of a computed value into a buffer (dsp::KVScatter)
    OPAQUE = "opaque"  # anything a template cannot take: control flow, random, other reductions


# Injective ops that only relabel indexes (a view on a contiguous buffer): no kernel of their own.
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
LAYOUT_OPS = VIEW_OPS | frozenset({"Transpose"})  # ops that relabel or permute a value's elements
INJECTIVE_OPS = VIEW_OPS | frozenset(
    {
        "Transpose",
        "Slice",
        "Concat",
        "Gather",
        "GatherND",
        "Expand",
        "Split",
        "Pad",
        "Tile",
        "DepthToSpace",
        "SpaceToDepth",
    }
)
MATMUL_OPS = frozenset(
    {"MatMul", "Gemm", "MergedMatMul", "MatMulInteger", "QLinearMatMul", "Conv", "ConvTranspose", "Einsum"}
)  # MergedMatMul: sibling products merged by dsp_core/plan/merge.py
# Ops that reduce the axis named by their ``axis`` attribute (default last) row by row.
ROW_OPS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"})
OPAQUE_TRAITS = Trait.CONTROL_FLOW | Trait.RANDOM | Trait.DYNAMIC_OUTPUT_SIZE
# In-place writes whose meaning the core knows: (domain, op) -> (buffer, update, position) inputs.
# The decode plan's KV store writes the step's row at a device-held position (dsp_core/llm/kv.py).
STORE_OPS = {("dsp", "KVScatter"): (0, 1, 2)}


@dataclass(frozen=True)
class SlotPattern:
    """A slot's pattern kind and iteration space: ``numel`` outer points x ``rnumel`` reduced ones."""

    kind: PatternKind
    numel: int | None  # elements of the output (of the outer space, for a reduction); None: not static
    rnumel: int | None = 1  # elements reduced per output point (1 unless a row reduction)
    shape: tuple[Dim, ...] | None = None  # the output's shape (dims may be symbolic)
    row: tuple[Dim, ...] | None = None  # a row reduction's input shape: outer dims, then the row


@dataclass(frozen=True)
class FusionLimits:
    """What a backend's templates can hold."""

    max_nodes: int = 64  # slots per group
    max_inputs: int = 16  # distinct values a group reads from outside (kernel arguments)


@dataclass(frozen=True)
class Group:
    """A fusion group: slots (plan order), the template that would run them, values it publishes."""

    index: int
    template: str
    slots: tuple[int, ...]
    outputs: tuple[int, ...]  # value ids that must be stored: read outside, plan outputs, mutated buffers
    kernels: int  # kernels a step launches for it (0: a pure view)

    def as_dict(self, plan: Plan) -> dict[str, Any]:
        """JSON-able form for `dsp plan fuse` and `dsp plan explain`."""
        return {
            "index": self.index,
            "template": self.template,
            "slots": list(self.slots),
            "ops": [plan.slots[s].op for s in self.slots],
            "outputs": [plan.values[v].name for v in self.outputs],
            "kernels": self.kernels,
        }


@dataclass(frozen=True)
class Boundary:
    """A producer and a consumer slot left in different groups, and the rule that stopped them."""

    producer: int
    consumer: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"producer": self.producer, "consumer": self.consumer, "reason": self.reason}


@dataclass
class FusionResult:
    """The groups of one segment, the boundaries between them, and each slot's pattern."""

    policy: str
    groups: list[Group]
    boundaries: list[Boundary]
    patterns: dict[int, SlotPattern]
    order: tuple[int, ...] = ()  # the schedule: every slot, groups in dependency order

    @property
    def kernels(self) -> int:
        """Kernels per step for this segment."""
        return sum(g.kernels for g in self.groups)

    def slot_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups as slot tuples, in schedule order (what a Segment carries)."""
        return tuple(g.slots for g in self.groups)

    def as_dict(self, plan: Plan) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "policy": self.policy,
            "slots": len(self.order),
            "kernels": self.kernels,
            "groups": [g.as_dict(plan) for g in self.groups],
            "boundaries": [b.as_dict() for b in self.boundaries],
        }


# -- classification ---------------------------------------------------------------------
def _numel(shape: tuple[Dim, ...] | None) -> int | None:
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    total = 1
    for d in shape:
        total *= int(d)  # type: ignore[arg-type]
    return total


def _last_axis_only(plan: Plan, s: int, shape: tuple[Dim, ...]) -> bool:
    """True when a reduction slot reduces exactly the last axis of its input (of ``shape``)."""
    slot = plan.slots[s]
    rank = len(shape)
    if slot.op in ROW_OPS or slot.op in ("ArgMax", "ArgMin"):
        axis = int(slot.attrs.get("axis", -1))
        return axis % max(rank, 1) == rank - 1
    axes = _axes(plan, s)
    if axes is None:
        return rank == 1 and not (len(slot.inputs) > 1 and slot.inputs[1] is not None)
    if not axes:
        return rank == 1  # all axes reduced: a row only when there is one axis
    return [a % max(rank, 1) for a in axes] == [rank - 1]


def _broadcast(shapes: Sequence[tuple[Dim, ...] | None]) -> tuple[Dim, ...] | None:
    """The broadcast of shapes (symbolic dims must match exactly), or None when unknown."""
    if not shapes or any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes if s is not None)
    out: list[Dim] = []
    for k in range(rank):
        dims = {s[len(s) - rank + k] for s in shapes if s is not None and len(s) - rank + k >= 0} - {1}
        if len(dims) > 1 or None in dims:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _axes(plan: Plan, s: int) -> list[int] | None:
    """A reduction's axes from its attribute or its constant second input (None: unknown)."""
    slot = plan.slots[s]
    axes = slot.attrs.get("axes")
    if axes is None and len(slot.inputs) > 1 and slot.inputs[1] is not None:
        ref = slot.inputs[1]
        if ref < 0 and (-ref - 1) in plan.constants:
            return [int(a) for a in plan.constants[-ref - 1].reshape(-1)]
        return None
    return [int(a) for a in axes] if axes is not None else None


def _matmul_shape(a: tuple[Dim, ...] | None, b: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
    """A MatMul's output shape from its operands' (both of rank 2 or more; None: unknown)."""
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    batch = _broadcast([a[:-2], b[:-2]]) if a[:-2] or b[:-2] else ()
    return None if batch is None else (*batch, a[-2], b[-1])


def infer_shapes(plan: Plan) -> dict[int, tuple[Dim, ...] | None]:
    """Value id -> shape, filling what static inference left unknown for the ops fusion reasons about.

    Elementwise ops broadcast their inputs, row ops keep their input's shape, reductions
    with constant axes drop or keep those axes, a MatMul of matrices (or batches of them)
    is their product's; anything else stays as the plan has it.
    """
    shapes: dict[int, tuple[Dim, ...] | None] = {}

    def shape(ref: int | None) -> tuple[Dim, ...] | None:
        if ref is None:
            return None
        known = plan.ref_info(ref)[1]
        return known if known is not None or ref < 0 else shapes.get(ref)

    for slot in plan.slots:
        out = slot.outputs[0] if slot.outputs else None
        if out is None:
            continue
        if slot.op == "MergedMatMul" and slot.attrs.get("form", "MatMul") == "MatMul":  # each part: A @ B_i
            for k, v in enumerate(slot.outputs):
                if v is not None:
                    known = plan.values[v].shape
                    shapes[v] = (
                        known if known is not None else _matmul_shape(shape(slot.inputs[0]), shape(slot.inputs[1 + k]))
                    )
            continue
        got = plan.values[out].shape
        if got is None and slot.inputs:
            first = shape(slot.inputs[0])
            if slot.traits & Trait.ELEMENTWISE:
                got = _broadcast([shape(r) for r in slot.inputs if r is not None])
            elif slot.op in ROW_OPS:
                got = first
            elif slot.op == "MatMul" and len(slot.inputs) == 2:
                got = _matmul_shape(first, shape(slot.inputs[1]))
            elif slot.traits & Trait.REDUCTION and first is not None and slot.op not in ("ArgMax", "ArgMin"):
                axes = _axes(plan, slot.index)
                if axes is not None:
                    rank = len(first)
                    drop = {a % max(rank, 1) for a in axes} if axes else set(range(rank))
                    keep = int(slot.attrs.get("keepdims", 1))
                    got = tuple(1 if k in drop else d for k, d in enumerate(first) if keep or k not in drop)
        shapes[out] = got
    return shapes


def value_readers(plan: Plan) -> dict[int, list[int]]:
    """Value id -> the slots that read it (plan order)."""
    readers: dict[int, list[int]] = {}
    for slot in plan.slots:
        for r in slot.inputs:
            if r is not None and r >= 0:
                readers.setdefault(r, []).append(slot.index)
    return readers


def feeds_only_kv_stores(plan: Plan, readers: Mapping[int, Sequence[int]], s: int) -> bool:
    """True when everything slot ``s`` makes goes, through layout ops only (reshapes, transposes), to
    KV stores (``dsp::KVScatter``) as their row: V's layout on its way to the cache, which a kernel
    computing V can write as the store's index arithmetic."""
    stack, seen = [s], set()
    while stack:
        m = stack.pop()
        for v in plan.slots[m].outputs:
            if v is None:
                continue
            if v in plan.outputs or not readers.get(v):
                return False
            for r in readers[v]:
                slot = plan.slots[r]
                if (slot.domain, slot.op) == ("dsp", "KVScatter") and slot.inputs[1] == v and slot.inputs[0] != v:
                    continue
                if slot.op not in LAYOUT_OPS or r in seen:
                    return False
                seen.add(r)
                stack.append(r)
    return True


def feeds_only_norm_statistics(
    plan: Plan, patterns: Mapping[int, SlotPattern], readers: Mapping[int, Sequence[int]], s: int
) -> bool:
    """True when every reader of slot ``s`` is a last-axis reduction other than a softmax (a norm's statistic).

    The exported RMSNorm squares the residual (``Pow``) before its ``ReduceMean``: kept with
    the reduction, the norm reads only the residual, and a product's epilogue that ends at the
    residual add stores one value instead of two. A softmax's scale and mask stay with the
    scores (attention).
    """
    outs = [v for v in plan.slots[s].outputs if v is not None]
    found = [r for v in outs for r in readers.get(v, ())]
    if not found or any(v in plan.outputs for v in outs):
        return False
    return all(
        r in patterns
        and patterns[r].kind is PatternKind.ROW_REDUCTION
        and plan.slots[r].op not in ("Softmax", "LogSoftmax")
        for r in found
    )


def classify(plan: Plan, s: int, shapes: dict[int, tuple[Dim, ...] | None] | None = None) -> SlotPattern:
    """The pattern kind and iteration space of slot ``s`` (``shapes``: from ``infer_shapes``)."""
    slot = plan.slots[s]
    known = shapes if shapes is not None else {}

    def shape(ref: int | None) -> tuple[Dim, ...] | None:
        if ref is None:
            return None
        info = plan.ref_info(ref)[1]
        return info if info is not None or ref < 0 else known.get(ref)

    out_shape = shape(next((v for v in slot.outputs if v is not None), None))
    numel = _numel(out_shape)
    if (slot.domain, slot.op) in STORE_OPS and not slot.traits & OPAQUE_TRAITS and s not in plan.regions:
        return SlotPattern(PatternKind.STORE, numel, shape=out_shape)
    if slot.traits & OPAQUE_TRAITS or slot.traits & Trait.MUTATES_INPUT or s in plan.regions:
        return SlotPattern(PatternKind.OPAQUE, numel, shape=out_shape)
    if slot.traits & Trait.ATTENTION:
        return SlotPattern(PatternKind.ATTENTION, numel, shape=out_shape)
    if slot.op in MATMUL_OPS:
        return SlotPattern(PatternKind.MATMUL, numel, shape=out_shape)
    if slot.op in ROW_OPS or slot.traits & Trait.REDUCTION:
        row = shape(slot.inputs[0]) if slot.inputs else None
        if row and _last_axis_only(plan, s, row):
            rnumel = row[-1] if isinstance(row[-1], int) else None
            outer = _numel(row[:-1])
            return SlotPattern(PatternKind.ROW_REDUCTION, outer, rnumel, out_shape, row)
        return SlotPattern(PatternKind.OPAQUE, numel, shape=out_shape)
    if slot.op == "BatchNormalization" and len([v for v in slot.outputs if v is not None]) == 1:
        return SlotPattern(PatternKind.BROADCAST, numel, shape=out_shape)  # inference: per-channel scale, shift
    if slot.op in INJECTIVE_OPS:
        return SlotPattern(PatternKind.INJECTIVE, numel, shape=out_shape)
    if slot.traits & Trait.ELEMENTWISE:
        ins = [shape(r) for r in slot.inputs if r is not None]
        same = out_shape is not None and all(sh == out_shape for sh in ins)
        return SlotPattern(PatternKind.ELEMENTWISE if same else PatternKind.BROADCAST, numel, shape=out_shape)
    return SlotPattern(PatternKind.OPAQUE, numel, shape=out_shape)


def sealed_slots(plan: Plan, variables: Iterable[str] = ()) -> set[int]:
    """Slots that depend on no fed input and draw no random numbers: computed once at freeze.

    A shape-only op (Shape, Size) of a fed input does not taint: the shape is frozen; but a
    computed value's shape can only be read once that value exists, at run time.
    """
    names = set(variables)
    tainted = {
        plan.external_ref(k)
        for k, e in enumerate(plan.externals)
        if e.cls is not ExternalClass.CONSTANT or e.name in names
    }
    sealed: set[int] = set()
    for slot in plan.slots:
        reads = [r for r in slot.inputs if r is not None]
        if slot.traits & Trait.SHAPE_ONLY_OUTPUT:
            dirty = any(r >= 0 and r in tainted for r in reads)
        else:
            dirty = bool(slot.traits & Trait.RANDOM) or any(r in tainted for r in reads)
        if dirty:
            tainted.update(v for v in slot.outputs if v is not None)
        else:
            sealed.add(slot.index)
    return sealed


# -- policies ---------------------------------------------------------------------------
@dataclass
class GroupView:
    """A group being formed, as a policy sees it: its slots, their patterns, its template so far."""

    index: int
    slots: list[int]
    template: str
    reduction: SlotPattern | None = None  # the group's reduction stage, if any
    reductions: list[int] = field(default_factory=list)
    patterns: dict[int, SlotPattern] = field(default_factory=dict)  # every slot's pattern (shared)


class FusionPolicy:
    """What a backend's templates can fuse. The default fuses nothing (every slot a kernel).

    A backend returns one from ``Backend.fusion_policy()``. ``merge_ok`` is asked only
    after the core's legality rules passed; it answers None (fuse) or the reason not to.
    ``template_of`` names the template that runs a group and how many kernels it launches.
    """

    name = "none"
    limits = FusionLimits()

    def seed(self, plan: Plan, s: int, pattern: SlotPattern) -> str:
        """The template of a new group that starts with slot ``s``."""
        return "single"

    def merge_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """None when slot ``s`` may join ``group``, else the reason it may not."""
        return f"policy {self.name} fuses nothing"

    def joined(self, group: GroupView, s: int, pattern: SlotPattern) -> str:
        """The group's template once slot ``s`` joined it."""
        return group.template

    def kernels(self, plan: Plan, template: str, slots: Sequence[int]) -> int:
        """Kernels one step launches for a group."""
        return 1

    def absorbs(self, plan: Plan, group: GroupView, s: int, other: GroupView) -> bool:
        """True when ``group``, which slot ``s`` just joined, should take all of ``other`` too.

        ``other`` is another group that produces an input of ``s``; the core asks only when
        the two are independent (neither depends on the other), so the merge makes no
        cycle. A product taking the index arithmetic of its second operand (GQA's expand of
        the V cache) as a prologue is the case. The default never merges.
        """
        return False

    def merged(self, group: GroupView, other: GroupView) -> str:
        """The template of ``group`` once it absorbed ``other``."""
        return group.template

    def unfused(self, plan: Plan, group: Group) -> str | None:
        """Why a formed ``group`` runs its slots' own kernels, not one generated kernel (None: it is one).

        For ``dsp plan explain``, which shows it as the last link of each group's chain.
        """
        return None if len(group.slots) == 1 else f"policy {self.name} fuses nothing"


class ReferencePolicy(FusionPolicy):
    """The reference grouping policy: the Triton templates fusion.md describes, backend-neutral.

    - ``pointwise`` (T1): elementwise and broadcast ops, N inputs, several outputs, plus
      view ops (reshape and friends) that only relabel indexes;
    - ``row_reduction`` (T2): one last-axis reduction stage with its prologue (pointwise ops
      over the row space ``outer x rnumel``) and epilogue (pointwise ops over ``outer`` or
      ``outer x rnumel``): LayerNorm, the exported RMSNorm chain, Softmax with scale and mask;
    - ``copy`` (T5): one materialised injective op (transpose, concat, slice, gather,
      expand) with a pointwise epilogue over its output;
    - ``view``: view ops alone (no kernel); products, attention and opaque ops are alone.
    """

    name = "reference"
    limits = FusionLimits()
    _readers_of: tuple[Plan | None, dict[int, list[int]]] = (None, {})

    def readers(self, plan: Plan) -> dict[int, list[int]]:
        """Value id -> the slots that read it (``value_readers``), memoised for the last plan asked."""
        if self._readers_of[0] is not plan:
            self._readers_of = (plan, value_readers(plan))
        return self._readers_of[1]

    def seed(self, plan: Plan, s: int, pattern: SlotPattern) -> str:
        kind = pattern.kind
        if kind in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST):
            return "pointwise"
        if kind is PatternKind.ROW_REDUCTION:
            return "row_reduction"
        if kind is PatternKind.INJECTIVE:
            return "view" if plan.slots[s].op in VIEW_OPS else "copy"
        return kind.value  # matmul, attention, opaque: alone

    def merge_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        kind = pattern.kind
        if group.template in ("matmul", "attention", "opaque", "store"):
            return f"group {group.index} is a {group.template} slot, which runs alone (no reference template fuses it)"
        if kind in (PatternKind.MATMUL, PatternKind.ATTENTION, PatternKind.OPAQUE, PatternKind.STORE):
            return f"{plan.slots[s].op} is {kind.value}: no reference template fuses it"
        if kind is PatternKind.INJECTIVE and plan.slots[s].op not in VIEW_OPS:
            return f"{plan.slots[s].op} is a materialised copy: it starts a copy group"
        if kind is PatternKind.ROW_REDUCTION:
            if group.template not in ("pointwise", "view"):
                return f"a {group.template} group takes no reduction as prologue"
            return self._row_space(plan, group, pattern, prologue=True)
        if group.template == "row_reduction" and group.reduction is not None:
            return self._epilogue(plan, group, s, pattern)
        return None

    @property
    def regroup_rows(self) -> bool:
        """Whether a reshape that only regroups the outer dims (same rows, same last axis) stays in a
        reduction's row space (``same_rows``); a policy may keep to the exact row space."""
        return True

    def _row_space(self, plan: Plan, group: GroupView, red: SlotPattern, prologue: bool) -> str | None:
        """A prologue must iterate the reduction's row space (outer x row) or its outer space."""
        if red.row is None:
            return "the reduction's rows are not known"
        for m in group.slots:
            if not _in_row_space(group.patterns[m], red, self.regroup_rows):
                return f"prologue slot {m} does not iterate the reduction's row space {_dims(red.row)}"
        return None

    def _epilogue(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        red = group.reduction
        if red is None or red.row is None:
            return "the reduction's rows are not known"
        if not _in_row_space(pattern, red, self.regroup_rows):
            return f"slot {s} iterates {_dims(pattern.shape)}: a different row than the reduction's {_dims(red.row)}"
        return None

    def joined(self, group: GroupView, s: int, pattern: SlotPattern) -> str:
        if pattern.kind is PatternKind.ROW_REDUCTION:
            return "row_reduction"
        if group.template == "view" and pattern.kind in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST):
            return "pointwise"
        return group.template

    def kernels(self, plan: Plan, template: str, slots: Sequence[int]) -> int:
        return 0 if template == "view" else 1

    def unfused(self, plan: Plan, group: Group) -> str | None:
        if group.template in ("matmul", "attention", "opaque", "store"):
            return f"a {group.template} group runs alone"
        if group.kernels == 0:
            return "views only: no kernel"
        return None


def _strip(shape: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """``shape`` without its leading 1s (they do not change the iteration order)."""
    k = 0
    while k < len(shape) and shape[k] == 1:
        k += 1
    return tuple(shape[k:])


def _dims(shape: tuple[Dim, ...] | None) -> str:
    return "an unknown shape" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _in_row_space(pattern: SlotPattern, red: SlotPattern, regroup: bool = True) -> bool:
    """True when a slot iterates a reduction's rows (outer x row) or its outer space."""
    if pattern.shape is None or red.row is None:
        return False
    outer = tuple(red.row[:-1])
    shape = tuple(pattern.shape)
    rows = {_strip(tuple(red.row)), _strip(outer), _strip((*outer, 1))}
    return _strip(shape) in rows or (regroup and same_rows(shape, red.row))


def _factors(dims: Sequence[Dim]) -> tuple[int, tuple[str, ...]] | None:
    """The product of ``dims``: its integer part and its symbolic factors (``"batch*seq"`` is two)."""
    number, names = 1, []
    for d in dims:
        if d is None:
            return None
        if isinstance(d, int):
            number *= d
            continue
        for part in str(d).split("*"):
            part = part.strip()
            if part.isdigit():
                number *= int(part)
            else:
                names.append(part)
    return number, tuple(sorted(names))


def same_rows(shape: Sequence[Dim], row: Sequence[Dim]) -> bool:
    """True when ``shape`` is ``row`` with its outer dims regrouped: the same last axis, as many rows.

    A reshape of ``[batch, seq, K]`` to ``[batch*seq, K]`` (GPT-2's Conv1D as a Gemm)
    only relabels the rows; symbolic dims compare by their factors.
    """
    if not shape or not row or shape[-1] != row[-1]:
        return False
    a, b = _factors(shape[:-1]), _factors(row[:-1])
    return a is not None and a == b


def norm_prologue(plan: Plan, group: GroupView, s: int, readers: dict[int, list[int]]) -> str | None:
    """None when row-reduction ``group`` may run as the prologue of product slot ``s``, else why not.

    The legal merge of a norm into the product that reads it (docs/fusion.md): the
    product's first operand (A) is made in the group and is the reduction's row space,
    so the rows are the product's rows and the reduced axis is the product's K; no other
    operand of the product is made in the group; and nothing the group makes is read
    outside it (its values exist only inside the product's K loop, so a value read
    elsewhere would have to be stored: the norm then stays its own kernel).
    """
    red = group.reduction
    if group.template != "row_reduction" or red is None or red.row is None:
        return f"a {group.template} group is not a row reduction a product can take as its prologue"
    slot = plan.slots[s]
    if slot.op == "Gemm" and int(slot.attrs.get("transA", 0)):
        return "a Gemm with transA=1 reads A along its rows: no norm prologue"
    members = set(group.slots)
    made = {v: m for m in group.slots for v in plan.slots[m].outputs if v is not None}
    a = slot.inputs[0] if slot.inputs else None
    if a is None or a not in made:
        return f"group {group.index} does not make the product's first operand"
    if any(r in made for r in slot.inputs[1:] if r is not None):
        return f"group {group.index} makes an operand of the product other than A"
    a_shape = group.patterns[made[a]].shape
    if a_shape is None or not same_rows(a_shape, red.row):
        return (
            f"the product's A iterates {_dims(a_shape)}, not the rows {_dims(red.row)} the norm reduces "
            "(the reduced axis must be the product's K)"
        )
    for v, m in made.items():
        if v in plan.outputs or any(r not in members and r != s for r in readers.get(v, ())):
            return f"slot {m}'s output is read outside the norm and the product: the norm stays its own kernel"
    return None


NO_FUSION = FusionPolicy()
REFERENCE_POLICY = ReferencePolicy()


# -- grouping ---------------------------------------------------------------------------
def _dependencies(plan: Plan, slots: Sequence[int]) -> dict[int, set[int]]:
    """For each slot, the slots of ``slots`` it must follow: data edges plus mutation ordering."""
    inside = set(slots)
    producer = {v: s for s in slots for v in plan.slots[s].outputs if v is not None}
    deps: dict[int, set[int]] = {s: set() for s in slots}
    readers: dict[int, list[int]] = {}  # ref -> slots that read it
    for s in slots:
        for r in plan.slots[s].inputs:
            if r is None:
                continue
            if r >= 0 and r in producer and producer[r] != s:
                deps[s].add(producer[r])
            readers.setdefault(r, []).append(s)
    for m in slots:  # an in-place write follows every other read of its buffer
        slot = plan.slots[m]
        if slot.traits & Trait.MUTATES_INPUT and slot.inputs and slot.inputs[0] is not None:
            for r in readers.get(slot.inputs[0], []):
                if r != m and r in inside:
                    (deps[m] if r < m else deps[r]).add(r if r < m else m)
    return deps


class _Grouper:
    """The greedy pass; groups only ever grow, so a group's index is stable."""

    def __init__(self, plan: Plan, slots: Sequence[int], policy: FusionPolicy) -> None:
        self.plan, self.policy = plan, policy
        self.slots = sorted(slots)
        self.deps = _dependencies(plan, self.slots)
        self.readers = value_readers(plan)
        shapes = infer_shapes(plan)
        self.patterns = {s: classify(plan, s, shapes) for s in self.slots}
        self.group_of: dict[int, int] = {}
        self.groups: list[GroupView] = []
        self.ancestors: list[set[int]] = []  # group -> groups it depends on, transitively
        self.reasons: dict[tuple[int, int], str] = {}  # (producer group, consumer slot) -> why not

    def run(self) -> None:
        for s in self.slots:
            pattern = self.patterns[s]
            preds = [self.group_of[p] for p in sorted(self.deps[s])]
            chosen = None
            for g in dict.fromkeys(reversed(preds)):  # the nearest producer's group first
                reason = self._legal(g, s, pattern)
                if reason is None:
                    chosen = g
                    break
                self.reasons[(g, s)] = reason
            if chosen is None:
                chosen = self._open(s, pattern)
            else:
                self._join(chosen, s, pattern)
            for g in dict.fromkeys(reversed(preds)):
                if g != chosen and self.groups[g].slots and self._absorbable(chosen, g, s):
                    self._merge(chosen, g)
            for g in set(preds) - {chosen}:
                if self.groups[g].slots:
                    self.reasons.setdefault((g, s), f"slot {s} joined group {chosen} first")

    def _legal(self, g: int, s: int, pattern: SlotPattern) -> str | None:
        """The core's rules, then the policy's; None when slot ``s`` may join group ``g``."""
        group, plan = self.groups[g], self.plan
        if pattern.kind is PatternKind.OPAQUE:
            return f"{plan.slots[s].op} is opaque ({_opaque_why(plan, s)}): always a group alone"
        if len(group.slots) >= self.policy.limits.max_nodes:
            return f"group {g} holds {len(group.slots)} slots, the template limit"
        why = self._store_rules(g, s, pattern)
        if why is not None:
            return why
        others = {self.group_of[p] for p in self.deps[s]} - {g}
        cyclic = sorted(h for h in others if g in self.ancestors[h])
        if cyclic:
            return f"fusing would create a cycle through group {cyclic[0]}"
        if pattern.kind is PatternKind.ROW_REDUCTION and group.reduction is not None:
            red = group.reduction
            if red.row != pattern.row:
                return f"group {g} already reduces rows of {_dims(red.row)} (one reduction stage per kernel)"
            if any(self._reads_through(s, r, group) for r in group.reductions):
                return f"slot {s} reads group {g}'s reduction: a second reduction stage"
        members = set(group.slots)
        for r in plan.slots[s].inputs:
            if r is None or r < 0 or self._producer_in(r, members) is None:
                continue
            p = self._producer_in(r, members)
            assert p is not None
            # A view (reshape and friends) only relabels indexes: reading it at several
            # indexes reads its input at several indexes, nothing is recomputed.
            if (
                self.patterns[p].kind is PatternKind.INJECTIVE
                and plan.slots[p].op not in VIEW_OPS
                and len(set(self.readers.get(r, []))) > 1
            ):
                return (
                    f"{plan.slots[p].op} slot {p}'s output has {len(set(self.readers[r]))} readers: "
                    "an injective op fuses only when every read uses the same index"
                )
        if len(self._inputs_with(group, s)) > self.policy.limits.max_inputs:
            return f"the group would read more than {self.policy.limits.max_inputs} inputs, the template limit"
        return self.policy.merge_ok(plan, group, s, pattern)

    def _store_rules(self, g: int, s: int, pattern: SlotPattern) -> str | None:
        """A store joins only the group that makes what it writes; nothing reads a group's store inside it.

        The buffer written in place is read whole after the write (attention reads every
        position): rows other programs write, which one kernel cannot wait for.
        """
        plan, members = self.plan, set(self.groups[g].slots)
        made = {v: m for m in members for v in plan.slots[m].outputs if v is not None}
        if pattern.kind is PatternKind.STORE:
            buffer, update, position = (
                plan.slots[s].inputs[k] for k in STORE_OPS[(plan.slots[s].domain, plan.slots[s].op)]
            )
            if update not in made:
                return f"{plan.slots[s].op} joins only the group that makes what it writes, not group {g}"
            if buffer in made or position in made:
                return f"group {g} makes {plan.slots[s].op}'s buffer or position, not only what it writes"
        for r in plan.slots[s].inputs:
            m = made.get(r) if r is not None else None
            if m is not None and self.patterns[m].kind is PatternKind.STORE:
                return f"slot {s} reads the buffer slot {m} writes in place: rows other programs write"
        return None

    def _absorbable(self, g: int, h: int, s: int) -> bool:
        """True when group ``h`` may merge into ``g`` (which ``s`` just joined): independent, within limits."""
        if g in self.ancestors[h]:
            return False  # h depends on g (other than through s): one kernel cannot hold both
        others = self.ancestors[g] - {h}
        if h in self.ancestors[g] and any(h in self.ancestors[k] for k in others):
            return False  # g depends on h through another group: merging would make a cycle
        group, other = self.groups[g], self.groups[h]
        if len(group.slots) + len(other.slots) > self.policy.limits.max_nodes:
            return False
        if any(self.patterns[m].kind in (PatternKind.OPAQUE, PatternKind.STORE) for m in other.slots):
            return False
        return self.policy.absorbs(self.plan, group, s, other)

    def _merge(self, g: int, h: int) -> None:
        """Group ``h``'s slots into ``g``; ``h`` is left empty (result() drops it)."""
        group, other = self.groups[g], self.groups[h]
        group.template = self.policy.merged(group, other)
        for m in other.slots:
            self.group_of[m] = g
            group.slots.append(m)
        group.slots.sort()
        group.reductions = sorted({*group.reductions, *other.reductions})
        group.reduction = group.reduction or other.reduction
        other.slots = []
        merged = (self.ancestors[g] | self.ancestors[h]) - {g, h}
        self.ancestors[g] = merged
        self.ancestors[h] = set()
        for k, anc in enumerate(self.ancestors):
            if k != g and (h in anc or g in anc):
                anc.discard(h)
                anc |= {g} | merged

    def _producer_in(self, r: int, members: set[int]) -> int | None:
        return next((m for m in members if r in self.plan.slots[m].outputs), None)

    def _reads_through(self, s: int, r: int, group: GroupView) -> bool:
        """True when slot ``s`` depends on slot ``r`` through slots of ``group`` (or directly)."""
        members, seen, stack = set(group.slots), set(), [s]
        while stack:
            x = stack.pop()
            for p in self.deps.get(x, ()):
                if p == r:
                    return True
                if p in members and p not in seen:
                    seen.add(p)
                    stack.append(p)
        return False

    def _inputs_with(self, group: GroupView, s: int) -> set[int]:
        members = set(group.slots) | {s}
        produced = {v for m in members for v in self.plan.slots[m].outputs if v is not None}
        return {r for m in members for r in self.plan.slots[m].inputs if r is not None and r not in produced}

    def _open(self, s: int, pattern: SlotPattern) -> int:
        g = len(self.groups)
        view = GroupView(g, [s], self.policy.seed(self.plan, s, pattern), patterns=self.patterns)
        if pattern.kind is PatternKind.ROW_REDUCTION:
            view.reduction, view.reductions = pattern, [s]
        self.groups.append(view)
        preds = {self.group_of[p] for p in self.deps[s]}
        self.ancestors.append(set(preds).union(*(self.ancestors[h] for h in preds)) if preds else set())
        self.group_of[s] = g
        return g

    def _join(self, g: int, s: int, pattern: SlotPattern) -> None:
        group = self.groups[g]
        group.template = self.policy.joined(group, s, pattern)
        group.slots.append(s)
        if pattern.kind is PatternKind.ROW_REDUCTION:
            group.reduction = group.reduction or pattern
            group.reductions.append(s)
        self.group_of[s] = g
        preds = {self.group_of[p] for p in self.deps[s]} - {g}
        if preds:
            added = set(preds).union(*(self.ancestors[h] for h in preds))
            self.ancestors[g] |= added
            for k, anc in enumerate(self.ancestors):  # whoever depends on g now depends on those too
                if g in anc and k != g:
                    anc |= added

    def result(self) -> FusionResult:
        plan = self.plan
        order = self._schedule()
        inside: dict[int, set[int]] = {g.index: set(g.slots) for g in self.groups}
        mutated = {v for s in self.slots if plan.slots[s].traits & Trait.MUTATES_INPUT for v in plan.slots[s].outputs}
        groups: list[Group] = []
        for new, g in enumerate(order):
            view = self.groups[g]
            members = sorted(view.slots)
            produced = sorted({v for m in members for v in plan.slots[m].outputs if v is not None})
            outputs = tuple(
                v
                for v in produced
                if v in plan.outputs or v in mutated or any(r not in inside[g] for r in self.readers.get(v, []))
            )
            kernels = self.policy.kernels(plan, view.template, members)
            groups.append(Group(new, view.template, tuple(members), outputs, kernels))
        renumber = {g: new for new, g in enumerate(order)}
        boundaries = [
            Boundary(p, s, self.reasons.get((self.group_of[p], s), "not fused"))
            for s in self.slots
            for p in sorted(self.deps[s])
            if self.group_of[p] != self.group_of[s]
        ]
        boundaries = [Boundary(b.producer, b.consumer, _renumbered(b.reason, renumber)) for b in boundaries]
        schedule = tuple(s for g in groups for s in g.slots)
        return FusionResult(self.policy.name, groups, boundaries, self.patterns, schedule)

    def _schedule(self) -> list[int]:
        """Groups in dependency order, the one holding the earliest slot first among those ready."""
        n = len(self.groups)
        live = sum(1 for g in self.groups if g.slots)  # merged groups are empty
        succ: list[set[int]] = [set() for _ in range(n)]
        indegree = [0] * n
        for s in self.slots:
            for p in self.deps[s]:
                a, b = self.group_of[p], self.group_of[s]
                if a != b and b not in succ[a]:
                    succ[a].add(b)
                    indegree[b] += 1
        ready = [(min(g.slots), g.index) for g in self.groups if g.slots and indegree[g.index] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, g = heapq.heappop(ready)
            order.append(g)
            for h in succ[g]:
                indegree[h] -= 1
                if indegree[h] == 0:
                    heapq.heappush(ready, (min(self.groups[h].slots), h))
        if len(order) != live:  # the cycle check makes this unreachable; say so loudly if it is not
            from dsp_core.errors import DSPError

            raise DSPError(
                f"fusion grouping of {self.plan.graph_name} made a cycle between groups "
                f"(policy {self.policy.name}); this is a DSP bug: report it with the model, "
                "and run without the fusing backend meanwhile"
            )
        return order


def _renumbered(reason: str, renumber: dict[int, int]) -> str:
    """Group numbers in reasons follow the schedule's numbering."""
    import re

    return re.sub(r"group (\d+)", lambda m: f"group {renumber.get(int(m.group(1)), int(m.group(1)))}", reason)


def _opaque_why(plan: Plan, s: int) -> str:
    slot = plan.slots[s]
    if slot.traits & Trait.MUTATES_INPUT:
        return "writes its input in place"
    if slot.traits & Trait.CONTROL_FLOW or s in plan.regions:
        return "control flow"
    if slot.traits & Trait.RANDOM:
        return "random"
    if slot.traits & Trait.DYNAMIC_OUTPUT_SIZE:
        return "its output size is known only after it runs"
    if slot.traits & Trait.REDUCTION:
        return "a reduction over other than the last axis"
    return "no pattern a template takes"


# The last groupings made, by (plan, policy, slots, the DSP_* settings a policy may read): the
# core groups a segment when a backend compiles it and the backend's segment asks again for each
# group's template, and a plan is never changed once made (a rewrite makes a new one). Plan and
# policy are held weakly (an id reused by a new object is a miss); a few plans at a time.
_MemoKey = tuple[int, int, tuple[int, ...], tuple[tuple[str, str], ...]]
_MEMO: collections.OrderedDict[_MemoKey, tuple[Any, Any, FusionResult]] = collections.OrderedDict()
_MEMO_SIZE = 32
_memo_lock = threading.Lock()


def propose_groups(plan: Plan, slots: Sequence[int], policy: FusionPolicy | None = None) -> FusionResult:
    """Fusion groups of ``slots`` (one segment's live slots) under ``policy`` (None: no fusion).

    Computed once per plan, policy object and slots (``_MEMO``): the result is not to be changed.
    """
    chosen = policy or NO_FUSION
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("DSP_")))
    key = (id(plan), id(chosen), tuple(slots), settings)
    with _memo_lock:
        hit = _MEMO.get(key)
        if hit is not None and hit[0]() is plan and hit[1]() is chosen:
            _MEMO.move_to_end(key)
            return hit[2]
    grouper = _Grouper(plan, slots, chosen)
    grouper.run()
    result = grouper.result()
    with _memo_lock:
        _MEMO[key] = (weakref.ref(plan), weakref.ref(chosen), result)
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return result


def release_order(plan: Plan, order: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per slot of ``order``, the values to release after it when the slots run in that order.

    ``plan.release`` is for plan order; a grouped schedule may run a value's last reader
    (in plan order) before another reader of the same segment, so a value is released
    after whichever of its readers within ``order`` runs last.
    """
    last_reader: dict[int, int] = {}  # value -> the slot of ``order`` that touches it last
    for s in order:
        slot = plan.slots[s]
        for v in (*slot.inputs, *slot.outputs):
            if v is not None and v >= 0:
                last_reader[v] = s
    released: dict[int, list[int]] = {s: [] for s in order}
    for s in order:
        for v in plan.release[s]:
            released[last_reader.get(v, s)].append(v)
    return {s: tuple(vs) for s, vs in released.items()}


def segment_fusion(
    plan: Plan, slots: Sequence[int], policy: FusionPolicy | None, variables: Iterable[str] = ()
) -> FusionResult:
    """Groups of a segment's slots once sealed slots (computed once at freeze) are left out."""
    sealed = sealed_slots(plan, variables)
    return propose_groups(plan, [s for s in slots if s not in sealed], policy)


__all__ = [
    "NO_FUSION",
    "REFERENCE_POLICY",
    "Boundary",
    "FusionLimits",
    "FusionPolicy",
    "FusionResult",
    "Group",
    "GroupView",
    "PatternKind",
    "ReferencePolicy",
    "STORE_OPS",
    "SlotPattern",
    "classify",
    "norm_prologue",
    "propose_groups",
    "release_order",
    "same_rows",
    "sealed_slots",
    "segment_fusion",
]
