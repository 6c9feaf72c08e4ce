"""The plugin module named by the entry point: the TRITON backend, its contract, profile and fusion policy."""

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
    GroupView,
    PatternKind,
    ReferencePolicy,
    SlotPattern,
    feeds_only_kv_stores,
    feeds_only_norm_statistics,
    norm_prologue,
)
from dsp_core.plan.merge import is_merged, paired_reason
from dsp_core.plan.plan import Plan, Segment
from dsp_triton import codegen, kernels

OFF = "DSP_TRITON_DECODE_FUSION is off"
FLOAT_OPERANDS = ("float16", "bfloat16", "float32")  # operand dtypes of the product and conv templates


def decode_fusion() -> bool:
    """The decode fusions (a norm as its product's prologue, KV stores as epilogues, one rotary
    kernel): on by default (checked on the H200); DSP_TRITON_DECODE_FUSION=0 turns them off."""
    return bool(config.get("triton_decode_fusion"))


def row_limit() -> float:
    """The longest row a row-reduction group may hold: the row template's (``codegen.MAX_ROW``), or
    any where dsp-nvrtc is available, whose row kernels loop over a row: the generator then
    declines the longer ones and the group is NVRTC's (AUTO's chain per group,
    ``kernels.nvrtc_step``); a plan grouped so and run without dsp-nvrtc runs such a group's
    reference kernels."""
    return math.inf if kernels.nvrtc_backend() is not None else codegen.MAX_ROW


# Ops that only move elements (a bijection of indexes): a product's lanes map forward through them.
# Fused kernels accumulate in fp32 and round once per value, the reference once per op:
# half-precision results differ by an ulp or two of the reference's rounding.
TOLERANCE = 5e-3


def _contract() -> ModeContract:
    tf32 = bool(config.get("cublas_tf32"))
    return ModeContract(
        deterministic=not tf32,  # no atomics in the generated kernels; cuBLAS with fixed algorithms
        needs_stable_addresses=True,
        can_update_in_place=True,
        tf32=tf32,
        dtypes=DTYPES,
        tolerance=max(TOLERANCE, 1e-2 if tf32 else 0.0),
    )


class TritonPolicy(ReferencePolicy):
    """The reference templates, limited to what the generator takes: its ops, rows it holds in registers."""

    name = "triton"
    limits = FusionLimits(max_nodes=64, max_inputs=16)

    def __init__(self) -> None:
        self._ops: dict[int, str] = {}

    def seed(self, plan: Plan, s: int, pattern: SlotPattern) -> str:
        template = super().seed(plan, s, pattern)
        if template in ("pointwise", "row_reduction", "copy") and not self._generated(plan, s, pattern):
            return "opaque"  # no template generates it: alone, on the reference kernels
        if template == "matmul" and product_declined(plan, s, pattern) is None:
            return "product"  # the skinny-product template, its epilogue fused
        if template == "matmul" and flash_declined(plan, s, pattern) is None:
            return "product"  # a product of two activations: scores or weighted sum of a flash attention
        if template == "matmul" and conv_declined(plan, s) is None:
            return "conv"  # cuDNN without the bias, then the bias and the epilogue as one kernel
        return template

    @property
    def regroup_rows(self) -> bool:
        """A norm's rows regrouped by a reshape (GPT-2's [batch*seq, K]) join it only with the decode fusions."""
        return decode_fusion()

    def merge_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        if pattern.kind is PatternKind.STORE:
            if not decode_fusion():
                return f"{OFF}: a KV store runs as its own kernel"
            return self._store_ok(plan, group, s)
        if group.template == "product":
            if plan.slots[s].op == "Softmax":
                return self._softmax_ok(plan, group, s, pattern)
            return self._epilogue_ok(plan, group, s, pattern)
        if group.template == "decode_attention":
            return self._attention_ok(plan, group, s, pattern)
        if group.template == "conv":
            return self._conv_epilogue_ok(plan, group, s, pattern)
        if pattern.kind is PatternKind.MATMUL:
            return self._prologue_ok(plan, group, s, pattern)
        if not self._generated(plan, s, pattern):
            slot = plan.slots[s]
            return f"{slot.op} has no Triton template (dsp-triton generates {len(codegen.SUPPORTED_OPS)} ops)"
        limit = row_limit()
        if pattern.kind is PatternKind.ROW_REDUCTION and pattern.rnumel is not None and pattern.rnumel > limit:
            return f"a row of {pattern.rnumel} elements exceeds the row template's {limit}"
        self._ops[s] = plan.slots[s].op  # for joined(), which is not given the plan
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            # The generator computes every value at the index its reader asks for, so a
            # transpose, slice, concat or gather of a pointwise group's values is index
            # arithmetic in the same kernel (a value read at two indexes is computed twice).
            return None
        return super().merge_ok(plan, group, s, pattern)

    def joined(self, group: GroupView, s: int, pattern: SlotPattern) -> str:
        if group.template == "decode_attention" or (
            group.template == "product" and pattern.kind is PatternKind.ROW_REDUCTION
        ):
            return "decode_attention"  # scores, softmax, weighted sum: one decode-attention kernel
        if pattern.kind is PatternKind.MATMUL:
            return "product"  # a product reading through its prologue's indexes
        if pattern.kind is PatternKind.INJECTIVE and group.template in ("pointwise", "copy", "view"):
            if self._ops.get(s) in VIEW_OPS:  # a view relabels: the group keeps its template
                return group.template
            return "copy"
        return super().joined(group, s, pattern)

    def _prologue_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """A product may take a group of index arithmetic on its operand (a transpose, GQA's expand).

        Only when that group computes nothing (injective ops) and nothing it makes is read
        by anyone but the product: the kernel reads the operand through the indexes, never
        stores it.
        """
        why = product_declined(plan, s, pattern)
        if why is not None:
            return why
        if group.template == "row_reduction":  # a norm: each program computes the row statistic itself
            if not decode_fusion():
                return f"{OFF}: a norm runs as its own kernel before the product"
            return norm_prologue(plan, group, s, self.readers(plan)) or self._looped(plan, group)
        if is_merged(plan.slots[s]):
            return "a merged product reads its joined weights: no prologue of index arithmetic is fused"
        return attention.index_prologue(plan, group, s, self.readers(plan))

    def _store_ok(self, plan: Plan, group: GroupView, s: int) -> str | None:
        """The KV store as the last store of the kernel that computes the row it writes (the core
        checked that this group makes the row): the rotary of K, a product's K or V part."""
        if (plan.slots[s].domain, plan.slots[s].op) != ("dsp", "KVScatter"):
            return f"{plan.slots[s].op} has no Triton store"
        if group.template not in ("pointwise", "copy", "product"):
            return f"a {group.template} group takes no KV store"
        return None

    @staticmethod
    def _looped(plan: Plan, group: GroupView) -> str | None:
        """None when every reduction of a norm group is one the product's prologue loops compute."""
        for m in group.reductions:
            if plan.slots[m].op not in codegen.LOOPED_REDUCTIONS:
                return f"{plan.slots[m].op} is not a reduction the product's prologue computes"
        return None

    def absorbs(self, plan: Plan, group: GroupView, s: int, other: GroupView) -> bool:
        """A product takes the index arithmetic of its other operand; a weighted sum, its attention;
        a pointwise group, a pointwise group whose values only it reads.

        The second: ``s`` joined V's index arithmetic (GQA's expand) as a product, and
        ``other`` is the scores-and-softmax group its probabilities come from.
        """
        members = {*group.slots, *other.slots}
        if group.template in ("pointwise", "copy") and other.template in ("pointwise", "copy") and decode_fusion():
            # Rotary's x*cos, made apart from the rotate-half it is added to: one kernel computes
            # both (a value the generator computes at whatever index its reader asks).
            return group.reduction is None and self._only_for(plan, other.slots, members) is None
        if plan.slots[s].op not in codegen.PRODUCT_OPS or group.template not in ("product", "decode_attention"):
            return False
        return attention.absorbs_operand(plan, group, s, other, self.readers(plan))

    def merged(self, group: GroupView, other: GroupView) -> str:
        return "decode_attention" if other.template == "decode_attention" else group.template

    def _only_for(self, plan: Plan, slots: Sequence[int], members: set[int]) -> str | None:
        """None when every value ``slots`` make is read only by ``members`` (and is no plan output)."""
        return attention.only_for(plan, self.readers(plan), slots, members)

    def _softmax_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """Scores (a product of two activations, with scale and mask) followed by their softmax."""
        if not config.get("triton_attention"):
            return "DSP_TRITON_ATTENTION is off: softmax and products run as separate kernels"
        return attention.softmax_joins(plan, group, s, pattern, self.readers(plan))

    def _attention_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """After the softmax: casts of the probabilities, their product with V, then its epilogue."""
        anchors = attention.products(group)
        if len(anchors) >= 2 and _query_rows(group, anchors[-1]) > 1:
            return self._flash_epilogue_ok(plan, group, s, pattern, anchors[-1])
        if len(anchors) >= 2:
            return self._epilogue_ok(plan, group, s, pattern, anchor=anchors[-1])
        declined = flash_declined if _query_rows(group, anchors[0]) > 1 else product_declined
        return attention.weighted_sum_joins(plan, group, s, pattern, self.readers(plan), declined)

    def _epilogue_ok(
        self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern, anchor: int | None = None
    ) -> str | None:
        """A product's epilogue: pointwise ops over its output's lanes (bias, activation, residual, cast)."""
        op = plan.slots[s].op
        if op in LAYOUT_OPS and decode_fusion() and feeds_only_kv_stores(plan, self.readers(plan), s):
            return None  # V's reshape and transpose on the way to its KV store: the store's index arithmetic
        merged = [m for m in group.slots if is_merged(plan.slots[m])]
        if merged and not self._only_stores_after(plan, group, merged[0]):
            why = paired_reason(plan, merged[0])
            if why is not None:
                return why
        view = pattern.kind is PatternKind.INJECTIVE and op in VIEW_OPS
        if pattern.kind not in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST) and not view:
            return f"{op} is {pattern.kind.value}: a product's epilogue takes pointwise ops over its lanes"
        if not self._generated(plan, s, pattern):
            return f"{op} has no Triton template"
        if decode_fusion() and self._feeds_a_norm(plan, group, s):
            return f"{op} feeds only a norm's reduction: it goes with the norm, which a product may take as prologue"
        if anchor is None:
            anchor = next(m for m in group.slots if group.patterns[m].kind is PatternKind.MATMUL)
        product = group.patterns[anchor].shape
        if merged:  # lanes are one part's columns (the first part's: the parts are of one width)
            part = plan.ref_info(plan.slots[merged[0]].outputs[0])[1] or group.patterns[merged[0]].shape
            product = tuple(part) if part is not None else None
        # Same last axis: lanes stay the product's columns (a reshape that splits heads would not).
        if pattern.shape is None or product is None or not pattern.shape or pattern.shape[-1] != product[-1]:
            return (
                f"slot {s} iterates {list(pattern.shape) if pattern.shape else 'an unknown shape'}, "
                f"not the product's {list(product) if product else 'unknown'} lanes"
            )
        return None

    def _flash_epilogue_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern, anchor: int) -> str | None:
        """After the weighted sum of a flash attention: its output's layout ops (the heads' transpose
        and merge back to the hidden size), which the kernel stores through; or pointwise ops over
        its lanes before any of them."""
        op = plan.slots[s].op
        if pattern.kind not in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST, PatternKind.INJECTIVE):
            return (
                f"{op} is {pattern.kind.value}: after the weighted sum an attention takes its layout ops "
                "or pointwise ops over its lanes"
            )
        after = [m for m in group.slots if m > anchor]
        if op in LAYOUT_OPS:
            made = {plan.slots[anchor].outputs[0], *(plan.slots[m].outputs[0] for m in after)}
            if after and any(plan.slots[m].op not in LAYOUT_OPS for m in after):
                return f"{op} of a value computed after the weighted sum (the kernel stores through layout ops only)"
            if plan.slots[s].inputs[0] not in made:
                return f"{op} of a value the weighted sum does not make"
            return None
        if any(plan.slots[m].op in LAYOUT_OPS for m in after):
            return f"{op} after the attention output's layout ops (the kernel stores through them)"
        return self._epilogue_ok(plan, group, s, pattern, anchor=anchor)

    def _conv_epilogue_ok(self, plan: Plan, group: GroupView, s: int, pattern: SlotPattern) -> str | None:
        """A convolution's epilogue: pointwise ops over every element of its output (activation, residual)."""
        op = plan.slots[s].op
        if pattern.kind not in (PatternKind.ELEMENTWISE, PatternKind.BROADCAST):
            return f"{op} is {pattern.kind.value}: a convolution's epilogue takes pointwise ops over its output"
        if not self._generated(plan, s, pattern):
            return f"{op} has no Triton template"
        conv = group.patterns[group.slots[0]].shape
        if pattern.shape is None or conv is None or tuple(pattern.shape) != tuple(conv):
            return (
                f"slot {s} iterates {list(pattern.shape) if pattern.shape else 'an unknown shape'}, "
                f"not the convolution's output {list(conv) if conv else '(unknown)'}"
            )
        return None

    @staticmethod
    def _only_stores_after(plan: Plan, group: GroupView, product: int) -> bool:
        """True when a merged product's group holds, after it, only layout ops and KV stores."""
        after = [m for m in group.slots if m > product]
        return all(plan.slots[m].op in LAYOUT_OPS or plan.slots[m].op == "KVScatter" for m in after)

    def _feeds_a_norm(self, plan: Plan, group: GroupView, s: int) -> bool:
        """True when every reader of ``s`` is a norm's statistic (``feeds_only_norm_statistics``)."""
        return feeds_only_norm_statistics(plan, group.patterns, self.readers(plan), s)

    @staticmethod
    def _generated(plan: Plan, s: int, pattern: SlotPattern) -> bool:
        slot = plan.slots[s]
        if slot.domain not in ("", "ai.onnx") or slot.op not in codegen.SUPPORTED_OPS:
            return False
        if pattern.kind is PatternKind.ROW_REDUCTION:
            return pattern.rnumel is None or pattern.rnumel <= row_limit()  # unknown: the generator decides
        return True

    def kernels(self, plan: Plan, template: str, slots: Sequence[int]) -> int:
        if template == "view" or all(plan.slots[s].op in codegen.VIEW_ON_CUPY for s in slots):
            return 0  # views on the reference kernels (segment.unfused_reason)
        if template == "decode_attention":
            return attention_kernels(plan, slots)
        return 1


def attention_kernels(plan: Plan, slots: Sequence[int]) -> int:
    """Kernels of a decode-attention group (``attention.plan_kernels``, DSP_TRITON_KV_SPLITS forcing)."""
    return attention.plan_kernels(plan, slots, int(config.get("triton_kv_splits")))


def product_declined(plan: Plan, s: int, pattern: SlotPattern) -> str | None:
    """Why the skinny-product template does not take product slot ``s`` (None: it may).

    A plan's shapes may be symbolic (rows = batch x seq): such a product is taken, and each
    layout decides when it is first seen. Up to 16 rows the product is the template's
    kernel with its epilogue; above (prefill) it runs on cuBLAS, followed by its epilogue
    as one generated kernel.
    """
    slot = plan.slots[s]
    merged = is_merged(slot)  # sibling products merged by the core: one product over their joined weights
    if not merged and (slot.op not in codegen.PRODUCT_OPS or slot.domain not in ("", "ai.onnx")):
        return f"{slot.op} is not a MatMul or Gemm"
    if not config.get("triton_products"):
        return "DSP_TRITON_PRODUCTS is off: products run on cuBLAS"
    shape = pattern.shape
    if shape is None or len(shape) < 2:
        return "its output is of unknown rank or a vector"
    ins = [plan.ref_info(r) if r is not None else (None, None) for r in slot.inputs[:2]]
    if len(ins) < 2 or any(sh is not None and len(sh) < 2 for _, sh in ins):
        return "an operand of rank below 2"
    if any(dt is not None and dt not in FLOAT_OPERANDS for dt, _ in ins):
        return "operands other than fp16, bf16 or fp32"
    form = str(slot.attrs.get("form", "MatMul")) if merged else slot.op
    rows = shape[0] if form == "Gemm" else shape[-2]
    if isinstance(rows, int) and rows > codegen.MAX_PRODUCT_ROWS:
        return f"{rows} rows: cuBLAS runs products of more than {codegen.MAX_PRODUCT_ROWS}"
    return None


def _query_rows(group: GroupView, product: int) -> int:
    """The rows of product slot ``product``'s output where they are a known number, else 1."""
    shape = group.patterns[product].shape
    rows = shape[-2] if shape is not None and len(shape) >= 2 else 1
    return rows if isinstance(rows, int) else 1


def flash_declined(plan: Plan, s: int, pattern: SlotPattern) -> str | None:
    """Why product slot ``s`` is not a product of a flash attention (None: it may be).

    A MatMul of two activations (no constant operand) of more rows than the skinny template
    takes, a known number: an encoder's scores or weighted sum. Seeded as a product, it
    becomes one kernel with its softmax and weighted sum (codegen's ``_flash``) where the
    attention groups whole, or stays cuBLAS with its epilogue as one kernel.
    """
    slot = plan.slots[s]
    if slot.op != "MatMul" or slot.domain not in ("", "ai.onnx"):
        return f"{slot.op} is not a MatMul"
    if not (config.get("triton_flash_attention") and config.get("triton_attention")):
        return "DSP_TRITON_FLASH_ATTENTION or DSP_TRITON_ATTENTION is off"
    if any(r is None or plan.is_constant(r) for r in slot.inputs[:2]):
        return "a product with a constant operand (a projection, not attention)"
    shape = pattern.shape
    rows = shape[-2] if shape is not None and len(shape) >= 3 else None
    if not isinstance(rows, int) or rows <= codegen.MAX_PRODUCT_ROWS:
        return "not a batched product of more than 16 rows, a known number"
    ins = [plan.ref_info(r)[0] for r in slot.inputs[:2] if r is not None]
    if any(dt not in FLOAT_OPERANDS for dt in ins):
        return "operands other than fp16, bf16 or fp32"
    return None


def conv_declined(plan: Plan, s: int) -> str | None:
    """Why slot ``s`` is not a convolution whose bias dsp-triton adds in its epilogue (None: it is).

    A Conv with a bias of fp16, bf16 or fp32 operands: cuDNN computes it without the bias
    and the kernel of the pointwise ops after it adds the bias first (kernels.CONV_BIAS), one
    ``cudnnAddTensor`` call fewer a convolution.
    """
    slot = plan.slots[s]
    if slot.op != "Conv" or slot.domain not in ("", "ai.onnx"):
        return f"{slot.op} is not a Conv"
    if not config.get("triton_conv_epilogue"):
        return "DSP_TRITON_CONV_EPILOGUE is off: cuDNN adds the bias"
    if len(slot.inputs) < 3 or slot.inputs[2] is None:
        return "a convolution without a bias: its epilogue saves no kernel"
    kinds = [plan.ref_info(r)[0] if r is not None else None for r in slot.inputs[:3]]
    if any(dt not in FLOAT_OPERANDS for dt in kinds):
        return "operands other than fp16, bf16 or fp32"
    return None


def _probe() -> str | None:
    """Why the backend cannot run here (None: it can). Finds triton and torch without importing
    them (importing torch takes seconds); a broken install shows at the first compile instead,
    where the segment falls to the next backend with the error."""
    import importlib.util

    reason = device.probe()
    if reason is not None:
        return reason
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (pip install dsp-triton[gpu], or triton>=3.4)"
    if importlib.util.find_spec("torch") is None:
        return "torch not installed: Triton's NVIDIA driver needs it to find the GPU (pip install torch)"
    return None


class TritonBackend(CudaGraphsBackend):
    """CUDA_GRAPHS' runtime layer with each fusion group run as one generated Triton kernel."""

    name = "triton"
    mode = GraphExecutionMode.TRITON
    platform = "cuda"
    captures = True
    contract = _contract()
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)
    _policy = TritonPolicy()

    def _availability_probe(self) -> Availability:
        reason = _probe()
        return Availability.yes() if reason is None else Availability.no(reason)

    def fusion_policy(self) -> TritonPolicy:
        return self._policy

    def cost(self, segment: Segment, plan: Plan) -> float:
        return float(math.ceil(len(segment.slots) / 2))  # fused: fewer launches than CUDA_GRAPHS for the same slots

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_triton.segment import TritonSegment

        return TritonSegment(self, plan, segment, self.contract.tf32, self.contract.tolerance)


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """dsp-triton's one backend."""
    return [TritonBackend()]
