"""How a decode-attention fusion group forms: the grouping rules dsp-triton and dsp-nvrtc share.

A ``decode_attention`` group is, in plan order: the index arithmetic of K (its transpose,
GQA's Unsqueeze/Expand/Reshape) as the scores product's prologue; the scores product of
two activations; its scale and additive mask (pointwise, its epilogue); the Softmax over
the last axis of exactly those scores; casts of the probabilities; the weighted-sum
product with V, whose index arithmetic the group absorbs. Nothing the group makes before
the weighted sum is read outside it (the kernel never stores scores or probabilities).

Each backend's policy keeps its own seeds, epilogue rules and product rules, and calls these
for the parts that must agree (``TritonPolicy``, ``NvrtcPolicy``). Pure functions of the plan:
no CUDA, no Triton.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dsp_core.plan.fusion import GroupView, PatternKind, SlotPattern
from dsp_core.plan.kernelspec import GroupSpec, attention_nodes
from dsp_core.plan.plan import Plan
from dsp_cuda_graphs.device import sm_count

Readers = dict[int, list[int]]  # value id -> the slots that read it (ReferencePolicy.readers)
# Why a backend's product template declines product slot ``s`` (None: it takes it).
Declined = Callable[[Plan, int, SlotPattern], "str | None"]
CASTS = ("Cast", "Identity")  # the ops an online softmax takes between the probabilities and the weighted sum

# The split rule both backends' decode-attention kernels follow. Measured on the H200 with dsp-triton's
# kernel (benchmarks/attention_gpu.py, benchmarks/results/gpu_2026-12-02f): a program's
# loop over its KV positions is latency-bound (each BLOCK_L step waits for its K and V loads), so
# the time follows the positions per program, not the SMs filled: Llama-1B's shape (32 heads) at
# 4,096 positions took 45.3 us in 4 splits (the old rule: fill the SMs once), 22.2 in 16, 12.6 in
# 32; at 1,024, 17.1 in 4 and 6.5 in 16. At 128 positions one program per head (2.9 us) beats any
# split, whose combine kernel costs about 2 us.
KV_SPLIT_POSITIONS = 64  # positions per program to aim for
KV_SPLIT_FROM = 256  # no split at or below this many positions
KV_SPLIT_MAX = 64  # splits per head at most (the combine kernel reads them in one tile)
KV_SPLIT_WAVES = 16  # programs at most, in multiples of the SMs


def kv_split_count(
    batch_heads: int,
    length: int,
    sms: int | None,
    positions: int = KV_SPLIT_POSITIONS,
    split_from: int = KV_SPLIT_FROM,
    forced: int = 0,
) -> int:
    """KV splits for decode attention, a power of two: none for ``split_from`` positions or fewer, else
    about ``positions`` positions per program, at most KV_SPLIT_MAX per head and KV_SPLIT_WAVES x SMs
    programs in all (a large batch fills the GPU with heads alone; ``sms`` None: the device is not
    known, no such cap). ``forced`` (DSP_TRITON_KV_SPLITS, DSP_NVRTC_KV_SPLITS) overrides, up to one
    position a split."""
    if forced:
        return max(1, min(forced, length))
    if batch_heads <= 0 or length <= split_from:
        return 1
    waves = KV_SPLIT_MAX if sms is None else max(1, KV_SPLIT_WAVES * max(1, sms) // batch_heads)
    want = min(KV_SPLIT_MAX, length // positions, waves)
    return 1 << max(0, want.bit_length() - 1)


def plan_kernels(plan: Plan, slots: Sequence[int], forced: int = 0) -> int:
    """Kernels of a decode-attention group: 2 (partials, then their combine) where its KV positions split,
    else 1, by the rule the kernels use (``kv_split_count``); the device's SM count, which only caps the
    splits of a batch x heads beyond 16 x SMs, is left out (the report runs without a GPU)."""
    softmax = next((s for s in slots if plan.slots[s].op == "Softmax"), None)
    out = plan.slots[softmax].outputs[0] if softmax is not None else None
    shape = plan.ref_info(out)[1] if out is not None else None
    sizes = [d for d in shape or () if isinstance(d, int)]
    if not shape or len(sizes) != len(shape) or (len(sizes) >= 2 and sizes[-2] != 1):
        return 1  # unknown sizes, or a prefill's rows (three kernels, the layout decides)
    heads = max(1, math.prod(sizes[:-2]))
    return 2 if kv_split_count(heads, sizes[-1], None, forced=forced) > 1 else 1


def spec_splits(spec: GroupSpec, cp: object, forced: int = 0) -> int:
    """KV splits of a decode-attention group's layout on the current device: ``forced``, or
    ``kv_split_count``'s rule with the device's SM count (``cp``: CuPy)."""
    p1, _, p2 = attention_nodes(spec)
    scores, out = p1.outputs[0], p2.outputs[0]
    assert scores is not None and out is not None
    if len(spec.values[scores].shape) >= 2 and spec.values[scores].shape[-2] != 1:
        return 1  # several query rows (an encoder's, a prefill's): their blocks fill the GPU, no split
    length = spec.values[scores].shape[-1]
    heads = max(1, math.prod(spec.values[out].shape[:-2]))
    return kv_split_count(heads, length, sm_count(cp) or 1, forced=forced)


def only_for(plan: Plan, readers: Readers, slots: Sequence[int], members: set[int], what: str = "group") -> str | None:
    """None when every value ``slots`` make is read only by ``members`` (and is no plan output)."""
    for m in slots:
        for v in plan.slots[m].outputs:
            if v is None:
                continue
            if v in plan.outputs or any(r not in members for r in readers.get(v, ())):
                return f"slot {m}'s output is read outside the {what}: it must be stored"
    return None


def index_prologue(plan: Plan, group: GroupView, s: int, readers: Readers) -> str | None:
    """Why product slot ``s`` may not take ``group`` as index arithmetic on its operand (None: it may).

    Only when that group computes nothing (injective ops) and nothing it makes is read by
    anyone but the product: the kernel reads the operand through the indexes, never stores it.
    """
    if group.template not in ("copy", "view"):
        return f"a {group.template} group is not index arithmetic a product can read through"
    members = {*group.slots, s}
    for m in group.slots:
        if group.patterns[m].kind is not PatternKind.INJECTIVE:
            return f"slot {m} computes values: a product reads only index arithmetic as its prologue"
        why = only_for(plan, readers, [m], members, "product")
        if why is not None:
            return why
    return None


def products(group: GroupView) -> list[int]:
    """The group's product slots (MATMUL patterns), in plan order."""
    return [m for m in group.slots if group.patterns[m].kind is PatternKind.MATMUL]


def softmax_joins(plan: Plan, group: GroupView, s: int, pattern: SlotPattern, readers: Readers) -> str | None:
    """Why Softmax slot ``s`` does not join the scores group ``group`` (None: it does).

    The scores are a MatMul of two activations (with scale and mask); the softmax is over
    their last axis, its rows exactly the product's; nothing the group made is read elsewhere.
    """
    anchors = products(group)
    if len(anchors) != 1 or plan.slots[anchors[0]].op != "MatMul":
        return "a softmax joins only a MatMul's scores"
    if plan.is_constant(plan.slots[anchors[0]].inputs[1]):
        return "the scores' second operand is a constant (a projection, not attention)"
    slot = plan.slots[s]
    rank = len(pattern.row) if pattern.row else 0
    if rank == 0 or int(slot.attrs.get("axis", -1)) % rank != rank - 1:
        return "a softmax over other than the last axis"
    scores = group.patterns[anchors[0]].shape
    if scores is None or pattern.row is None or tuple(pattern.row) != tuple(scores):
        return "the softmax's rows are not the product's scores"
    return only_for(plan, readers, group.slots, {*group.slots, s})


def weighted_sum_joins(
    plan: Plan, group: GroupView, s: int, pattern: SlotPattern, readers: Readers, declined: Declined
) -> str | None:
    """Why slot ``s`` does not join a ``decode_attention`` group that holds no weighted sum yet
    (None: it does): a cast of the probabilities, or their product with V."""
    op = plan.slots[s].op
    if op in CASTS:
        return None
    if pattern.kind is not PatternKind.MATMUL or op != "MatMul":
        return f"{op} between the softmax and the weighted sum (an online softmax takes casts only)"
    why = declined(plan, s, pattern)
    if why is not None:
        return why
    produced = {v for m in group.slots for v in plan.slots[m].outputs if v is not None}
    a = plan.slots[s].inputs[0]
    if a is None or a not in produced:
        return "the weighted sum's first operand is not the softmax's probabilities"
    return only_for(plan, readers, group.slots, {*group.slots, s})


def absorbs_operand(
    plan: Plan, group: GroupView, s: int, other: GroupView, readers: Readers, product: str = "product"
) -> bool:
    """Whether product slot ``s``'s group takes ``other``, a producer of one of its operands.

    Index arithmetic (K's transpose, V's GQA expand) whose values only the group reads; or,
    where ``s`` is the weighted sum that joined V's index arithmetic as a ``product`` group,
    the scores-and-softmax group its probabilities come from.
    """
    members = {*group.slots, *other.slots}
    if only_for(plan, readers, other.slots, members) is not None:
        return False
    if all(other.patterns[m].kind is PatternKind.INJECTIVE for m in other.slots):
        return True
    if other.template != "decode_attention" or group.template != product:
        return False
    waiting = len(products(other)) == 1
    prologue = all(group.patterns[m].kind is PatternKind.INJECTIVE for m in group.slots if m != s)
    made = {v for m in other.slots for v in plan.slots[m].outputs if v is not None}
    return waiting and prologue and plan.slots[s].inputs[0] in made and plan.slots[s].op == "MatMul"
