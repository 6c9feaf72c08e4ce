"""Merged sibling products: products that read one input become one product (docs/merge.md).

A compile-time rewrite of the graph's nodes, run by the plan compiler before it numbers
anything (so every backend, the plan cache key, DSP1 and the fusion analysis see the
rewritten plan). Products that read the SAME input value with CONSTANT weights of the
same K become one ``dsp::MergedMatMul`` node whose outputs are the old outputs, with
their old names: the product over the weights concatenated along N, cut back into the
parts along the last axis. Q, K and V of an attention layer, gate and up of a gated MLP
are the usual case; nothing here looks at names.

A product is a candidate when it is ``MatMul(x, W)`` with ``W`` a rank-2 initializer,
or ``Gemm(x, W[, C])`` with ``transA=0``, ``W`` and ``C`` initializers, ``C`` absent
or one value per column (``[N]`` or ``[1, N]``). Candidates reading one ``x`` are merged
when they agree on the form (MatMul or Gemm), K, the weights' dtype and, for Gemm,
``alpha``, ``beta``, ``transB`` and whether they have a bias. Anything else is left as
it is, with the reason (``analyse``). The merged node takes the place of the first of
its products: it reads only ``x`` (computed before that place) and constants, and its
outputs are only made earlier, so no cycle can form and every reader still follows its
producer. The weights are not touched: they stay the same constants (same names, same
digests), so a weight another node also reads is not copied or changed.

The on/off switch is ``DSP_MERGE_PRODUCTS`` (config ``merge_products``, on by default);
the rewrite is deterministic, it changes the plan's content hash when it merges, and the
disk cache keys models with the switch (``plan_options``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Node
from dsp_core.ops.registry import Trait, lookup

MERGED_OP = "MergedMatMul"
MERGED_DOMAIN = "dsp"
_ONNX = ("", "ai.onnx")


@dataclass(frozen=True)
class Part:
    """One product a merge replaced: its node, its output and its N."""

    node: str
    output: str
    weight: str
    n: int


@dataclass(frozen=True)
class Merge:
    """One merged product: the input it reads, its form, K, and its parts in output order."""

    node: str
    input: str
    form: str  # "MatMul" or "Gemm"
    k: int
    dtype: str
    parts: tuple[Part, ...]
    slot: int = -1  # the merged slot in a compiled plan (-1: not compiled yet)

    @property
    def n(self) -> int:
        """N of the merged product: the parts' N added up."""
        return sum(p.n for p in self.parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for `dsp plan fuse` and `dsp plan explain`."""
        return {
            "slot": self.slot,
            "node": self.node,
            "input": self.input,
            "form": self.form,
            "k": self.k,
            "n": self.n,
            "dtype": self.dtype,
            "parts": [asdict(p) for p in self.parts],
        }


@dataclass(frozen=True)
class Unmerged:
    """A product that shares its input with another product and was not merged, and why."""

    node: str
    input: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


@dataclass(frozen=True)
class _Candidate:
    position: int
    node: Node
    key: tuple[Any, ...]  # what siblings must share to be merged
    k: int
    n: int
    dtype: str


def enabled(explicit: bool | None = None) -> bool:
    """Whether the rewrite runs: ``explicit``, else DSP_MERGE_PRODUCTS (on by default)."""
    from dsp_core import config

    return bool(config.get("merge_products", explicit=explicit))


def plan_options(explicit: bool | None = None) -> str:
    """The compile options that change a plan, spelled for cache keys made before compiling."""
    return f"merge_products={int(enabled(explicit))}"


def _label(node: Node) -> str:
    return node.name or f"{node.op_type}->{node.outputs[0] if node.outputs else '?'}"


def _product_input(node: Node) -> str | None:
    """The input ``x`` of a product node (MatMul, Gemm), None for any other node."""
    if node.domain not in _ONNX or node.op_type not in ("MatMul", "Gemm") or not node.inputs:
        return None
    return node.inputs[0] or None


def _candidate(graph: Graph, position: int, node: Node) -> _Candidate | str:
    """The merge key of a product node, or why it cannot be merged with anything."""
    weight = node.inputs[1] if len(node.inputs) > 1 else ""
    w = graph.initializers.get(weight)
    if w is None:
        return f"its weight {weight!r} is not a constant (an initializer)"
    if w.ndim != 2:
        return f"its weight {weight!r} has rank {w.ndim}: only rank-2 weights are merged"
    if len(node.outputs) != 1 or not node.outputs[0]:
        return "its output is unnamed"
    dtype = dtypes.normalize(w.dtype)
    if node.op_type == "MatMul":
        return _Candidate(position, node, ("MatMul", w.shape[0], dtype), int(w.shape[0]), int(w.shape[1]), dtype)
    attrs = node.attrs
    if int(attrs.get("transA", 0)):
        return "Gemm with transA=1 is not merged"
    trans_b = int(attrs.get("transB", 0))
    k, n = (int(w.shape[1]), int(w.shape[0])) if trans_b else (int(w.shape[0]), int(w.shape[1]))
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    bias_rank = 0  # 0: no bias; else the bias's rank, which the siblings' biases share (they are joined)
    if bias:
        c = graph.initializers.get(bias)
        if c is None:
            return f"its bias {bias!r} is not a constant (an initializer)"
        if tuple(c.shape) not in ((n,), (1, n)) or dtypes.normalize(c.dtype) != dtype:
            shape = f"{c.dtype}{list(c.shape)}"
            return f"its bias {bias!r} is {shape}, not one {dtype} value per column ([{n}] or [1, {n}])"
        bias_rank = c.ndim
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    return _Candidate(position, node, ("Gemm", k, dtype, alpha, beta, trans_b, bias_rank), k, n, dtype)


def _written_in_place(nodes: Sequence[Node], name: str, lo: int, hi: int, opsets: dict[str, int]) -> bool:
    """True when a node between positions ``lo`` and ``hi`` writes ``name`` in place (MUTATES_INPUT)."""
    for node in nodes[lo + 1 : hi]:
        if node.inputs and node.inputs[0] == name:
            try:
                opdef = lookup(node.op_type, node.domain, opsets.get(node.domain, opsets.get("", 1)))
            except Exception:  # noqa: BLE001  (an unknown op: the compiler names it; do not merge across it)
                return True
            if opdef.traits & Trait.MUTATES_INPUT:
                return True
    return False


def _describe(key: tuple[Any, ...]) -> str:
    if key[0] == "MatMul":
        return f"MatMul K={key[1]} {key[2]}"
    form, k, dtype, alpha, beta, trans_b, bias_rank = key
    bias = f"a rank-{bias_rank} bias" if bias_rank else "no bias"
    return f"Gemm K={k} {dtype} alpha={alpha} beta={beta} transB={trans_b} {bias}"


def analyse(graph: Graph, nodes: Sequence[Node]) -> tuple[list[list[_Candidate]], list[Unmerged]]:
    """The sets of sibling products to merge (each in node order), and the products left alone with why."""
    readers: dict[str, list[tuple[int, Node]]] = {}
    for position, node in enumerate(nodes):
        x = _product_input(node)
        if x is not None:
            readers.setdefault(x, []).append((position, node))
    merges: list[list[_Candidate]] = []
    unmerged: list[Unmerged] = []
    for x, products in readers.items():
        if len(products) < 2:
            continue
        by_key: dict[tuple[Any, ...], list[_Candidate]] = {}
        for position, node in products:
            found = _candidate(graph, position, node)
            if isinstance(found, str):
                unmerged.append(Unmerged(_label(node), x, found))
            else:
                by_key.setdefault(found.key, []).append(found)
        keys = list(by_key)
        for key, group in by_key.items():
            if len(group) < 2:
                others = "; ".join(_describe(k) for k in keys if k != key) or "no other candidate"
                why = f"no sibling of the same kind ({_describe(key)}; the others: {others})"
                unmerged.append(Unmerged(_label(group[0].node), x, why))
            elif _written_in_place(nodes, x, group[0].position, group[-1].position, graph.opsets):
                for c in group:
                    unmerged.append(Unmerged(_label(c.node), x, f"{x!r} is written in place between the products"))
            else:
                merges.append(group)
    return merges, unmerged


def merge_products(graph: Graph, nodes: Sequence[Node]) -> tuple[list[Node], list[Merge]]:
    """``nodes`` with every set of sibling products replaced by one ``dsp::MergedMatMul`` node.

    The merged node stands where the first product of its set stood; the others are
    dropped. Its outputs are the products' outputs, same names, in the set's order.
    """
    groups, _ = analyse(graph, nodes)
    if not groups:
        return list(nodes), []
    replaced: dict[int, Node | None] = {}
    merges: list[Merge] = []
    for group in groups:
        first = group[0].node
        names = [_label(c.node) for c in group]
        inputs = [first.inputs[0]] + [c.node.inputs[1] for c in group]
        attrs: dict[str, Any] = {"form": first.op_type, "merged": tuple(names)}
        if first.op_type == "Gemm":
            has_bias = bool(group[0].key[-1])
            if has_bias:
                inputs += [c.node.inputs[2] for c in group]
            attrs.update(
                bias=int(has_bias),
                alpha=float(first.attrs.get("alpha", 1.0)),
                beta=float(first.attrs.get("beta", 1.0)),
                transB=int(first.attrs.get("transB", 0)),
            )
        name = "+".join(names)
        outputs = [c.node.outputs[0] for c in group]
        replaced[group[0].position] = Node(MERGED_OP, inputs, outputs, attrs, name, MERGED_DOMAIN)
        for c in group[1:]:
            replaced[c.position] = None
        parts = tuple(Part(_label(c.node), c.node.outputs[0], c.node.inputs[1], c.n) for c in group)
        merges.append(Merge(name, first.inputs[0], first.op_type, group[0].k, group[0].dtype, parts))
    out: list[Node] = []
    for position, node in enumerate(nodes):
        if position not in replaced:
            out.append(node)
        elif replaced[position] is not None:
            out.append(replaced[position])  # type: ignore[arg-type]
    return out, merges


def is_merged(slot: Any) -> bool:
    """True for a slot (or SlotView) of the rewrite's ``dsp::MergedMatMul``."""
    return bool(slot.op == MERGED_OP and slot.domain == MERGED_DOMAIN)


def paired_reason(plan: Any, s: int) -> str | None:
    """Why merged product slot ``s`` takes no epilogue (None: two MatMuls of one width, whose column c of
    both parts one kernel program computes pairwise, then the epilogue on the pair: gate and up)."""
    slot = plan.slots[s]
    outs = [v for v in slot.outputs if v is not None]
    if len(outs) != 2 or str(slot.attrs.get("form", "MatMul")) != "MatMul":
        return "an epilogue fuses only into two merged MatMuls (gate and up), each column of both in one program"
    weights = slot.inputs[1:3]  # [K, N_i]: a part's width is its weight's
    widths = [(plan.ref_info(w)[1] or (None,))[-1] if w is not None else None for w in weights]
    if widths[0] is None or widths[0] != widths[1]:
        return "merged products of different widths take no epilogue"
    return None


def merges_of(plan: Any) -> list[Merge]:
    """The merged products of a compiled plan (read from its ``dsp::MergedMatMul`` slots)."""
    found: list[Merge] = []
    for slot in plan.slots:
        if not is_merged(slot):
            continue
        k_parts = len(slot.outputs)
        weights = slot.inputs[1 : 1 + k_parts]
        form = str(slot.attrs.get("form", "MatMul"))
        trans_b = int(slot.attrs.get("transB", 0))
        names = tuple(slot.attrs.get("merged", ())) or tuple(plan.ref_name(v) for v in slot.outputs)
        parts: list[Part] = []
        k = 0
        dtype = ""
        for node, out, w in zip(names, slot.outputs, weights):
            wdtype, shape = plan.ref_info(w)
            shape = tuple(shape or (0, 0))
            k, n = (int(shape[1]), int(shape[0])) if trans_b else (int(shape[0]), int(shape[1]))
            dtype = wdtype or ""
            parts.append(Part(str(node), plan.ref_name(out), plan.ref_name(w), n))
        found.append(Merge(slot.name, plan.ref_name(slot.inputs[0]), form, k, dtype, tuple(parts), slot.index))
    return found


def unmerged_of(graph: Graph | None, nodes: Sequence[Node] | None = None) -> list[Unmerged]:
    """Products of ``graph`` that share an input with another product and are not merged, and why."""
    if graph is None:
        return []
    return analyse(graph, graph.nodes if nodes is None else nodes)[1]


def merge_report(plan: Any, graph: Graph | None = None) -> dict[str, Any]:
    """What `dsp plan fuse` and `dsp plan explain` show of the rewrite."""
    merges = merges_of(plan)
    return {
        "enabled": enabled(),
        "merged": [m.as_dict() for m in merges],
        "products_merged": sum(len(m.parts) for m in merges),
        "unmerged": [u.as_dict() for u in unmerged_of(graph)],
    }


def concatenated_weight(weights: Sequence[np.ndarray], trans_b: int = 0) -> np.ndarray:
    """The weights of a merge joined along N (axis 1, or axis 0 when stored transposed): what one product reads."""
    return np.concatenate(list(weights), axis=0 if trans_b else 1)


__all__ = [
    "MERGED_DOMAIN",
    "MERGED_OP",
    "Merge",
    "Part",
    "Unmerged",
    "analyse",
    "concatenated_weight",
    "enabled",
    "is_merged",
    "merge_products",
    "merge_report",
    "merges_of",
    "plan_options",
    "unmerged_of",
]
