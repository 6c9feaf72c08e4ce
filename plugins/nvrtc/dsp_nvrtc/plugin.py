"""The plugin module named by the entry point: NVRTC_JIT and PTX_JIT, their contracts, profiles, policy."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dsp_cuda_graphs import attention, device
from dsp_cuda_graphs.plugin import DTYPES, HOST_READING_OPS, CudaGraphsBackend

from dsp_core import config, hookimpl
from dsp_core.backends.base import Availability, Backend, CaptureProfile, CompiledSegment, ModeContract
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.plan.fusion import (
    LAYOUT_OPS,
    VIEW_OPS,
    FusionLimits,
    Group,
    GroupView,
    PatternKind,
    ReferencePolicy,
    SlotPattern,
    feeds_only_kv_stores,
    feeds_only_norm_statistics,
    norm_prologue,
)
from dsp_core.plan.kernelspec import ROW_VALUED_OPS
from dsp_core.plan.merge import is_merged, paired_reason
from dsp_core.plan.plan import Plan, Segment
from dsp_nvrtc import codegen

# Fused kernels accumulate reductions in fp32 (the reference rounds a half row's sum per
# op): half-precision results differ by an ulp or two of the reference's rounding.
TOLERANCE = 5e-3


def _contract(tolerance: float) -> ModeContract:
    tf32 = bool(config.get("cublas_tf32"))
    return ModeContract(
        deterministic=not tf32,  # no atomics in the kernels; cuBLAS with fixed algorithms
        needs_stable_addresses=True,  # a graph bakes every buffer address in
        can_update_in_place=True,
        tf32=tf32,
        dtypes=DTYPES,
        tolerance=max(tolerance, 1e-2 if tf32 else 0.0),
    )


class NvrtcPolicy(ReferencePolicy):
    """The reference templates (pointwise, row reduction, copy), limited to the ops the generator takes;
    skinny products with their epilogue (T3); decode attention (T4).

    Decode attention forms as dsp-triton's does (``dsp_cuda_graphs.attention``): a MatMul of two
    activations whose scores, through pointwise ops, feed a Softmax seeds a ``scores`` group (it
    takes K's index arithmetic as its prologue, the scale and mask as its epilogue); the Softmax
    makes it ``decode_attention``; casts and the weighted sum with V (V's index arithmetic
    absorbed) join. Nothing after the weighted sum joins: the kernel stores only its output. A
    ``scores`` group the softmax did not join runs its reference kernels.
    """

    name = "nvrtc"
    limits = FusionLimits(max_nodes=64, max_inputs=16)

    def __init__(self) -> None:
        self._ops: dict[int, str] = {}

    def seed(self, plan: Plan, s: int, pattern: SlotPattern) -> str:
        template = super().seed(plan, s, pattern)
        if template == "matmul":
            if product_declined(plan, s, pattern) is None:
                return "product"
            return "scores" if self._scores(plan, s, pattern) is None else template
        if template in ("pointwise", "row_reduction", "copy") and not _generated(plan, s):
            return "opaque"  # no template generates it: alone, on the reference kernels
        return template

    def merge_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        if pattern.kind is PatternKind.STORE:
            return self._store_ok(plan, group, s)
        if group.template == "product":
            return self._product_epilogue(plan, group, s, pattern)
        if group.template == "scores":
            if plan.slots[s].op == "Softmax" and pattern.kind is PatternKind.ROW_REDUCTION:
                return attention.softmax_joins(plan, group, s, pattern, self.readers(plan))
            return self._product_epilogue(plan, group, s, pattern)
        if group.template == "decode_attention":
            if len(attention.products(group)) >= 2:
                return "the decode-attention kernel stores only its weighted sum: what follows is a kernel of its own"
            return attention.weighted_sum_joins(plan, group, s, pattern, self.readers(plan), attention_declined)
        if pattern.kind is PatternKind.MATMUL and group.template == "row_reduction":
            return self._norm_prologue(plan, group, s, pattern)
        if pattern.kind is PatternKind.MATMUL and group.template in ("copy", "view"):
            why = self._scores(plan, s, pattern)
            if why is not None:
                return why
            return attention.index_prologue(plan, group, s, self.readers(plan))  # K's transpose, GQA's expand
        if pattern.kind not in (PatternKind.MATMUL, PatternKind.ATTENTION, PatternKind.OPAQUE) and not _generated(
            plan, s
        ):
            return f"{plan.slots[s].op} has no CUDA C template (dsp-nvrtc generates {len(codegen.SUPPORTED_OPS)} ops)"
        self._ops[s] = plan.slots[s].op
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            return None  # a transpose, slice, concat or gather of a pointwise group's values: index arithmetic
        return super().merge_ok(plan, group, s, pattern)

    @staticmethod
    def _store_ok(plan: Plan, group: GroupView, s: int) -> str | None:
        """A KV store as the last store of the pointwise or copy kernel that computes its row (the core
        checked that the group makes it): GPT-2's split of the QKV product, Llama's rotary of K. The
        kernel writes the row into the buffer at the device-held position (``codegen._kv_store``)."""
        if not config.get("nvrtc_kv_fusion"):
            return "DSP_NVRTC_KV_FUSION is off: a KV store runs as its own kernel"
        if (plan.slots[s].domain, plan.slots[s].op) != ("dsp", "KVScatter"):
            return f"{plan.slots[s].op} has no CUDA C store"
        if group.template == "product" and any(is_merged(plan.slots[m]) for m in group.slots):
            return None  # V's row, through its layout, from the merged Q/K/V product (``_merged_template``)
        if group.template not in ("pointwise", "copy", "view"):
            return f"a {group.template} group takes no KV store (its kernel stores only its own outputs)"
        return None

    def _norm_prologue(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """A norm as the prologue of the one product that reads it (``codegen._norm_prologue``): each
        block of the product's kernel reduces the row itself and stages the normalised row in
        shared memory, so the norm is no kernel of its own. One row (a decode step at batch 1):
        every block's outputs then share it. Symbolic rows are decided per layout: a layout of
        several rows runs the norm as its own row kernel, then the product (``prologue_parts``)."""
        if not config.get("nvrtc_norm_prologue"):
            return "DSP_NVRTC_NORM_PROLOGUE is off: a norm runs as its own kernel before the product"
        why = product_declined(plan, s, pattern)
        if why is not None:
            return why
        why = norm_prologue(plan, group, s, self.readers(plan))
        if why is not None:
            return why
        for m in group.reductions:
            if plan.slots[m].op not in codegen.PROLOGUE_REDUCTIONS:
                return f"{plan.slots[m].op} is not a norm the product's prologue computes"
        shape = pattern.shape
        rows = _fixed_count(shape[:-1]) if shape is not None and len(shape) >= 2 else None
        if rows is not None and rows != 1:  # symbolic rows: decided per layout (a prompt's runs as parts)
            return f"the product has {rows} rows: the norm prologue takes one"
        if group.reduction is not None and group.reduction.row is not None:
            k = group.reduction.row[-1]
            if not isinstance(k, int) or k > codegen.MAX_PROLOGUE_ROW:
                return (
                    f"a row of {k} elements (the prologue stages at most {codegen.MAX_PROLOGUE_ROW} in shared memory)"
                )
        return None

    def _product_epilogue(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """A product's epilogue: generated pointwise ops over its output's elements (bias, activation,
        residual add, cast), each thread computing them on its own dot product."""
        first = next((m for m in group.slots if group.patterns[m].kind is PatternKind.MATMUL), group.slots[0])
        merged = is_merged(plan.slots[first])
        op = plan.slots[s].op
        if merged and op in LAYOUT_OPS and feeds_only_kv_stores(plan, self.readers(plan), s):
            if not config.get("nvrtc_kv_fusion"):
                return "DSP_NVRTC_KV_FUSION is off: a KV store runs as its own kernel"
            return None  # V's reshape and transpose on the way to its KV store: the store's index arithmetic
        if merged:  # gate and up: each warp computes column c of both parts, then the epilogue on the pair
            why = paired_reason(plan, first)
            if why is not None:
                return why
        view = pattern.kind is PatternKind.INJECTIVE and op in VIEW_OPS
        if pattern.kind not in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST) and not view:
            return f"{op} is {pattern.kind.value}: a product's epilogue takes pointwise ops over its elements"
        if not _generated(plan, s):
            return f"{op} has no CUDA C template (dsp-nvrtc generates {len(codegen.SUPPORTED_OPS)} ops)"
        if feeds_only_norm_statistics(plan, group.patterns, self.readers(plan), s):
            return f"{op} feeds only a norm's reduction: it goes with the norm"
        # The same elements (a view may regroup the rows): each thread computes one dot product.
        anchor = group.patterns[first]
        shape, product = pattern.shape, anchor.shape
        numel = anchor.numel
        if merged:  # the elements of one part (the parts are of one width)
            part = plan.ref_info(plan.slots[first].outputs[0])[1]
            product = tuple(part) if part is not None else product
            numel = _fixed_count(product) if product is not None else None
        if (
            shape is None
            or product is None
            or not shape
            or shape[-1] != product[-1]
            or not _same_elements(shape, product, pattern.numel, numel)
        ):
            got = list(shape) if shape is not None else "unknown"
            return f"{op}'s output {got} is not the product's {list(product) if product else 'unknown'} elements"
        return None

    def joined(self, group: GroupView, s: int, pattern: SlotPattern) -> str:
        if pattern.kind is PatternKind.STORE:
            return "copy" if group.template == "view" else group.template  # a view's rows, written: a kernel
        if group.template == "product":
            return "product"
        if group.template == "scores":
            return "decode_attention" if pattern.kind is PatternKind.ROW_REDUCTION else "scores"
        if group.template == "decode_attention":
            return "decode_attention"
        if pattern.kind is PatternKind.MATMUL and group.template == "row_reduction":
            return "product"  # a product whose prologue is the norm (merge_ok checked)
        if pattern.kind is PatternKind.MATMUL and group.template in ("copy", "view"):
            return "scores"  # the scores product reading K through its index arithmetic (merge_ok checked)
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            return group.template if self._ops.get(s) in VIEW_OPS else "copy"
        return super().joined(group, s, pattern)

    def absorbs(self, plan: Plan, group: GroupView, s: int, other: GroupView) -> bool:
        """The scores product takes K's index arithmetic; the weighted sum, V's (GQA's expand); a
        pointwise or copy group, a pointwise or copy group whose values only it reads (rotary's
        x * cos, made apart from the rotated half it is added to: the generator computes a value at
        whatever index its reader asks, so one kernel computes both)."""
        if group.template in ("pointwise", "copy") and other.template in ("pointwise", "copy"):
            members = {*group.slots, *other.slots}
            readers = self.readers(plan)
            return group.reduction is None and attention.only_for(plan, readers, other.slots, members) is None
        if plan.slots[s].op != "MatMul" or group.template not in ("scores", "decode_attention"):
            return False
        return attention.absorbs_operand(plan, group, s, other, self.readers(plan))

    def _scores(self, plan: Plan, s: int, pattern: SlotPattern) -> str | None:
        """Why MatMul slot ``s`` is not an attention's scores (None: it is): a product of two
        activations the decode-attention kernel takes, whose output only pointwise ops read, one
        after the other, up to a Softmax."""
        if not config.get("nvrtc_attention"):
            return "DSP_NVRTC_ATTENTION is off: the scores and the weighted sum are cuBLAS products"
        why = attention_declined(plan, s, pattern)
        if why is not None:
            return why
        b = plan.slots[s].inputs[1]
        if b is None or b < 0:
            return "the product's second operand is a constant (a projection, not attention)"
        readers = self.readers(plan)
        v = plan.slots[s].outputs[0]
        for _ in range(16):
            found = sorted(set(readers.get(v, ()))) if v is not None else []
            if len(found) != 1 or v in plan.outputs:
                break
            slot = plan.slots[found[0]]
            if slot.op == "Softmax" and slot.domain in ("", "ai.onnx"):
                return None
            if not _generated(plan, found[0]) or slot.op in _NOT_POINTWISE or len(slot.outputs) != 1:
                break
            v = slot.outputs[0]
        return "a batched product of two activations whose scores feed no softmax (it runs on cuBLAS)"

    def kernels(self, plan: Plan, template: str, slots: Sequence[int]) -> int:
        if template == "view" or all(plan.slots[s].op in codegen.VIEW_ON_CUPY for s in slots):
            return 0  # views on the reference kernels
        if template == "decode_attention":  # partials and their combine where the KV positions split
            return attention.plan_kernels(plan, slots, int(config.get("nvrtc_kv_splits")))
        return 1

    def unfused(self, plan: Plan, group: Group) -> str | None:
        from dsp_nvrtc.segment import unfused_reason

        return unfused_reason(plan, group)


def product_declined(plan: Plan, s: int, pattern: SlotPattern) -> str | None:
    """Why the skinny-product template (T3) does not take product slot ``s`` (None: it may).

    A MatMul of [..., M, K] by a [K, N] matrix, or a Gemm without transA, in a float dtype, of
    up to 16 rows where the rows are known (symbolic rows are decided per layout, when the
    kernel is generated), whose second operand is a constant weight (one warp per output, its
    lanes over K, for a big one) or holds at most ``codegen.MAX_PRODUCT_WEIGHTS`` elements (one
    thread per output loops over K); merged products (the core's sibling rewrite) of up to 16
    rows are one kernel over their joined weights (``codegen.merged_product``).
    """
    slot = plan.slots[s]
    if is_merged(slot):
        shape = pattern.shape
        rows = _fixed_count(shape[:-1]) if shape is not None and len(shape) >= 2 else None
        if rows is not None and rows > codegen.MAX_PRODUCT_ROWS:
            return f"{rows} rows: cuBLAS runs products of more than {codegen.MAX_PRODUCT_ROWS}"
        return None  # its weights are constants (the rewrite merges only those)
    if slot.op not in codegen.PRODUCT_OPS or slot.domain not in ("", "ai.onnx"):
        return f"{slot.op} is not a MatMul or Gemm the template takes"
    shape = pattern.shape
    if shape is None or len(shape) < 2:
        return "its output is of unknown rank or a vector"
    ins = [plan.ref_info(r) if r is not None else (None, None) for r in slot.inputs[:2]]
    if len(ins) < 2 or ins[1][1] is None or len(ins[1][1]) != 2:
        return "its second operand is not a matrix"
    if any(dt not in codegen.FLOATS for dt, _ in ins):
        return "operands other than floats"
    if slot.op == "Gemm" and int(slot.attrs.get("transA", 0)):
        return "a Gemm with transA"
    weights = ins[1][1]
    size = _fixed_count(weights)
    constant = slot.inputs[1] is not None and slot.inputs[1] < 0
    if not constant and (size is None or size > codegen.MAX_PRODUCT_WEIGHTS):
        return (
            f"a second operand of {list(weights)} computed by the graph: the template takes one of at most "
            f"{codegen.MAX_PRODUCT_WEIGHTS} elements, or a constant weight"
        )
    rows = _fixed_count(shape[:-1])
    if rows is not None and rows > codegen.MAX_PRODUCT_ROWS:
        return f"{rows} rows: cuBLAS runs products of more than {codegen.MAX_PRODUCT_ROWS}"
    return None


def attention_declined(plan: Plan, s: int, pattern: SlotPattern) -> str | None:
    """Why the decode-attention kernel (T4) does not take product slot ``s`` as its scores or its
    weighted sum (None: it may): a MatMul of fp16, bf16 or fp32 operands of rank 2 or more, for one
    query row where the rows are known (symbolic rows are decided per layout, when the kernel is
    generated; a layout it declines runs the group's reference kernels)."""
    slot = plan.slots[s]
    if slot.op != "MatMul" or slot.domain not in ("", "ai.onnx"):
        return f"{slot.op} is not a MatMul"
    shape = pattern.shape
    if shape is None or len(shape) < 2:
        return "its output is of unknown rank or a vector"
    ins = [plan.ref_info(r) if r is not None else (None, None) for r in slot.inputs[:2]]
    if len(ins) < 2 or any(sh is None or len(sh) < 2 for _, sh in ins):
        return "an operand of unknown rank or of rank below 2"
    if any(dt not in codegen.ATTENTION_DTYPES for dt, _ in ins):
        return "operands other than fp16, bf16 or fp32"
    rows = shape[-2]
    if isinstance(rows, int) and rows != 1:
        return f"{rows} query rows: the decode-attention kernel takes one (cuBLAS runs the products)"
    return None


# Generated ops that are not pointwise: they end the walk from a product's scores to their softmax.
_NOT_POINTWISE = codegen.INJECTIVE_OPS | codegen.PRODUCT_OPS | ROW_VALUED_OPS


def _fixed_count(dims: Sequence[object]) -> int | None:
    """The element count of ``dims``, or None when one of them is symbolic."""
    count = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        count *= d
    return count


def _same_elements(a: Sequence[object], b: Sequence[object], numel_a: int | None, numel_b: int | None) -> bool:
    """Whether two shapes (dims may be symbolic) hold as many elements: equal counts, else equal dims but 1s."""
    if numel_a is not None and numel_b is not None:
        return numel_a == numel_b
    return _factors(a) == _factors(b)


def _factors(shape: Sequence[object]) -> tuple[int, tuple[str, ...]]:
    """A shape's element count as (the product of its fixed dims, its symbols sorted): a dim
    ``batch*seq`` and the dims ``batch``, ``seq`` count alike."""
    fixed, names = 1, []
    for d in shape:
        if isinstance(d, int):
            fixed *= d
            continue
        for part in str(d).replace(" ", "").split("*"):
            if part.isdigit():
                fixed *= int(part)
            else:
                names.append(part)
    return fixed, tuple(sorted(names))


def _generated(plan: Plan, s: int) -> bool:
    slot = plan.slots[s]
    return slot.domain in ("", "ai.onnx") and slot.op in codegen.SUPPORTED_OPS


def nvrtc_probe() -> str | None:
    """Why NVRTC_JIT cannot run here (None: it can): no CUDA device or driver, or no NVRTC."""
    reason = device.probe()
    if reason is not None:
        return reason
    from dsp_nvrtc import compiler  # only where a GPU is: its import (ctypes.util, subprocess) costs every start

    return compiler.available()


class NvrtcBackend(CudaGraphsBackend):
    """CUDA_GRAPHS' runtime layer with each fusion group run as one generated CUDA C kernel."""

    name = "nvrtc_jit"
    mode = GraphExecutionMode.NVRTC_JIT
    platform = "cuda"
    captures = True
    contract = _contract(TOLERANCE)
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)
    _policy = NvrtcPolicy()

    def _availability_probe(self) -> Availability:
        reason = nvrtc_probe()
        return Availability.yes() if reason is None else Availability.no(reason)

    def fusion_policy(self) -> NvrtcPolicy:
        return self._policy

    def cost(self, segment: Segment, plan: Plan) -> float:
        return float(math.ceil(len(segment.slots) / 2))  # fused: fewer launches than CUDA_GRAPHS

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_nvrtc.segment import NvrtcSegment

        return NvrtcSegment(self, plan, segment, self.contract.tf32, self.contract.tolerance)


class PtxBackend(CudaGraphsBackend):
    """NVRTC_JIT's fusion groups with their kernels' PTX from the PTX bundle (no NVRTC needed), and
    LayerNormalization and Softmax on PTX committed with the plugin."""

    name = "ptx_jit"
    mode = GraphExecutionMode.PTX_JIT
    platform = "cuda"
    captures = True
    contract = _contract(TOLERANCE)
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)
    _policy = NvrtcPolicy()

    def _availability_probe(self) -> Availability:
        from dsp_nvrtc import rowwise

        reason = device.probe()
        if reason is None and not rowwise.PTX.is_file():
            reason = f"the plugin's PTX is missing ({rowwise.PTX}): reinstall dsp-nvrtc"
        return Availability.yes() if reason is None else Availability.no(reason)

    def fusion_policy(self) -> NvrtcPolicy:
        return self._policy

    def cost(self, segment: Segment, plan: Plan) -> float:
        return float(len(segment.slots)) * 0.9  # groups fused only where the bundle has their PTX

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_nvrtc.segment import PtxSegment

        return PtxSegment(self, plan, segment, self.contract.tf32, self.contract.tolerance)


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """dsp-nvrtc's two backends."""
    return [NvrtcBackend(), PtxBackend()]
