"""Graph + requested outputs -> Plan, or a decline with a reason.

Steps: keep the nodes the outputs need; merge sibling products (dsp_core/plan/merge.py,
unless DSP_MERGE_PRODUCTS=0); fold Constant nodes into constant externals; class every
external input; number values; freeze attributes; compute liveness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from dsp_core.errors import GraphError, InputError, UnsupportedOpError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Dim, Graph, Node
from dsp_core.ops.registry import KernelContext, OpDef, TensorInfo, Trait, lookup
from dsp_core.plan import merge as merging
from dsp_core.plan.plan import External, ExternalClass, Plan, Region, Slot, ValueInfo


@dataclass(frozen=True)
class Declined:
    """The compiler's 'no': the graph runs on the legacy interpreter, for this reason."""

    reason: str
    node: str = ""

    def __str__(self) -> str:
        return f"{self.reason} (at {self.node})" if self.node else self.reason


def required_nodes(graph: Graph, outputs: Sequence[str]) -> list[Node]:
    """The nodes needed to compute ``outputs``, in graph (topological) order."""
    producers = graph.producers()
    needed: set[int] = set()
    stack = [producers[name] for name in outputs if name in producers]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        node = graph.nodes[i]
        reads = list(node.inputs)
        for _, _, sub in Graph.subgraphs_of(node):
            reads.extend(sub.outer_names)
        stack.extend(producers[name] for name in reads if name in producers)
    return [graph.nodes[i] for i in sorted(needed)]


def check_outputs(graph: Graph, outputs: Sequence[str] | None) -> tuple[str, ...]:
    """The requested output names, defaulting to the graph's; InputError for unknown names."""
    if outputs is None:
        return tuple(graph.output_names)
    known = set(graph.output_names) | set(graph.producers()) | set(graph.input_names)
    unknown = [name for name in outputs if name not in known]
    if unknown:
        raise InputError(
            f"requested output {unknown[0]!r} is not a value of graph {graph.name!r}; "
            f"graph outputs are {', '.join(graph.output_names)}"
        )
    return tuple(outputs)


def compile_plan(
    graph: Graph, outputs: Sequence[str] | None = None, merge_products: bool | None = None
) -> Plan | Declined:
    """Compile ``graph`` for ``outputs`` into a Plan, or return why it declines.

    Subgraphs (If/Loop/Scan bodies, ...) are compiled into sub-plans recorded as the
    plan's regions; a subgraph that cannot be compiled declines the whole graph.
    ``merge_products``: run the sibling-product rewrite (None: DSP_MERGE_PRODUCTS, on).
    """
    out_names = check_outputs(graph, outputs)
    return _compile(graph, out_names, outer=(), merge=merging.enabled(merge_products))


def _compile(graph: Graph, out_names: tuple[str, ...], outer: tuple[str, ...], merge: bool) -> Plan | Declined:
    nodes = required_nodes(graph, out_names)
    if merge:
        nodes, _ = merging.merge_products(graph, nodes)
    opdefs: list[OpDef] = []
    regions: dict[int, tuple[dict[str, Plan], tuple[str, ...]]] = {}  # node position -> sub-plans
    for pos, node in enumerate(nodes):
        opset = graph.opsets.get(node.domain, graph.opsets.get("", 1))
        try:
            opdef = lookup(node.op_type, node.domain, opset)
        except UnsupportedOpError as exc:
            raise UnsupportedOpError(f"{node.label()}: {exc}") from None
        subs = list(Graph.subgraphs_of(node))
        if subs:
            reads = tuple(sorted({name for _, _, sub in subs for name in sub.outer_names}))
            subplans: dict[str, Plan] = {}
            for _, attr, sub in subs:
                subplan = _compile(sub, tuple(sub.output_names), tuple(sorted(sub.outer_names)), merge)
                if isinstance(subplan, Declined):
                    return Declined(f"subgraph {attr!r} of {node.label()}: {subplan.reason}", node.name)
                subplans[attr] = subplan
            regions[pos] = (subplans, reads)
        opdefs.append(opdef)
    return _Builder(graph, out_names, outer).build(nodes, opdefs, regions)


class _Builder:
    def __init__(self, graph: Graph, out_names: tuple[str, ...], outer: tuple[str, ...]) -> None:
        self.graph = graph
        self.out_names = out_names
        self.outer = outer
        self.externals: list[External] = []
        self.constants: dict[int, np.ndarray] = {}
        self.refs: dict[str, int] = {}  # graph name -> wiring ref
        self.values: list[ValueInfo] = []

    def _external(self, name: str, cls: ExternalClass, array: np.ndarray | None = None) -> int:
        info = self.graph.info(name)
        k = len(self.externals)
        dtype: str | None
        shape: tuple[Dim, ...] | None
        if array is not None:
            dtype, shape = dtypes.normalize(array.dtype), tuple(array.shape)
            self.constants[k] = array
        else:
            dtype = info.dtype if info else None
            shape = info.shape if info else None
        self.externals.append(External(name, cls, dtype, shape))
        self.refs[name] = Plan.external_ref(k)
        return self.refs[name]

    def _ref(self, name: str) -> int | None:
        if not name:
            return None
        if name in self.refs:
            return self.refs[name]
        if name in self.graph.initializers:
            return self._external(name, ExternalClass.CONSTANT, self.graph.initializers[name])
        cls = ExternalClass.VARIABLE if name in self.graph.variables else ExternalClass.PLACEHOLDER
        return self._external(name, cls)

    def _value(self, name: str) -> int:
        info = self.graph.info(name)
        self.values.append(ValueInfo(name, info.dtype if info else None, info.shape if info else None))
        self.refs[name] = len(self.values) - 1
        return self.refs[name]

    def build(
        self, nodes: list[Node], opdefs: list[OpDef], subs: dict[int, tuple[dict[str, Plan], tuple[str, ...]]]
    ) -> Plan:
        # Every graph input is an external, even when no requested output reads it, so
        # feeds are validated the same way whatever the requested outputs; then the
        # enclosing values a sub-plan reads.
        for v in self.graph.inputs:
            if v.name not in self.graph.initializers:
                self._ref(v.name)
        for name in self.outer:
            if name not in self.refs:
                self._external(name, ExternalClass.OUTER)
        slots: list[Slot] = []
        opdefs_by_slot: list[OpDef] = []
        regions: dict[int, Region] = {}
        for pos, (node, opdef) in enumerate(zip(nodes, opdefs)):
            if node.op_type == "Constant" and node.domain == "":
                self._fold_constant(node, opdef)
                continue
            _check_arity(node, opdef)
            subplans, reads = subs.get(pos, ({}, ()))
            inputs = tuple(self._ref(name) for name in [*node.inputs, *reads])
            if subplans:
                regions[len(slots)] = Region(len(slots), node.op_type, subplans, reads)
            outputs = tuple(self._value(name) if name else None for name in node.outputs)
            opset = self.graph.opsets.get(node.domain, self.graph.opsets.get("", 1))
            slots.append(
                Slot(
                    index=len(slots),
                    op=node.op_type,
                    domain=node.domain,
                    opset=opset,
                    name=node.name,
                    inputs=inputs,
                    outputs=outputs,
                    attrs=MappingProxyType(_frozen_attrs(node, opdef)),
                    traits=opdef.traits,
                )
            )
            opdefs_by_slot.append(opdef)
        check_mutations(slots, self.externals)
        self._infer_static(slots, opdefs_by_slot)
        out_refs: list[int] = []
        for name in self.out_names:
            if name not in self.refs:
                raise GraphError(f"output {name!r} is not computed by graph {self.graph.name!r}")
            out_refs.append(self.refs[name])
        plan = Plan(
            slots=tuple(slots),
            externals=tuple(self.externals),
            values=tuple(self.values),
            outputs=tuple(out_refs),
            output_names=self.out_names,
            release=liveness(slots, len(self.values), out_refs),
            constants=self.constants,
            graph_name=self.graph.name,
            regions=regions,
        )
        plan.content_hash = content_hash(plan)
        return plan

    def _infer_static(self, slots: list[Slot], opdefs: list[OpDef]) -> None:
        """Fill dtypes and shapes the graph did not declare, from the ops' shape rules."""
        for slot, opdef in zip(slots, opdefs):
            missing = [
                v
                for v in slot.outputs
                if v is not None and (self.values[v].dtype is None or self.values[v].shape is None)
            ]
            if not missing or opdef.shape_rule is None:
                continue
            infos = [TensorInfo(*self._info(r)) if r is not None else None for r in slot.inputs]
            if any(i is not None and i.dtype is None for i in infos):
                continue
            try:
                rule_out = list(opdef.shape_rule(dict(slot.attrs), *infos))
            except Exception:  # noqa: BLE001  (a rule that cannot conclude leaves the value unknown)
                continue
            for v, info in zip(slot.outputs, rule_out):
                if v is None or info is None:
                    continue
                old = self.values[v]
                self.values[v] = ValueInfo(
                    old.name, old.dtype or info.dtype, old.shape if old.shape is not None else info.shape
                )

    def _info(self, ref: int) -> tuple[str | None, tuple[Dim, ...] | None]:
        if ref < 0:
            ext = self.externals[-ref - 1]
            return (ext.dtype, ext.shape)
        return (self.values[ref].dtype, self.values[ref].shape)

    def _fold_constant(self, node: Node, opdef: OpDef) -> None:
        import numpy

        _check_arity(node, opdef)
        ctx = KernelContext(numpy, self.graph.opsets.get("", 1), 0, 1, node.name)
        try:
            array = np.asarray(opdef.kernel(ctx, **node.attrs))
        except (TypeError, ValueError) as exc:
            raise GraphError(f"{node.label()}: {exc}") from None
        self._external(node.outputs[0], ExternalClass.CONSTANT, array)


def _check_arity(node: Node, opdef: OpDef) -> None:
    opdef.check_arity(node.label(), len(node.inputs), len(node.outputs), node.attrs)


def _frozen_attrs(node: Node, opdef: OpDef) -> dict[str, Any]:
    """The node's attributes; arrays are made read-only so no kernel can change them."""
    attrs: dict[str, Any] = {}
    for key, val in node.attrs.items():
        if isinstance(val, Graph):
            continue  # compiled into a sub-plan (Plan.regions)
        if isinstance(val, np.ndarray):
            val = val.copy()
            val.flags.writeable = False
        attrs[key] = val
    return attrs


def check_mutations(slots: Sequence[Slot], externals: Sequence[External]) -> None:
    """GraphError unless every MUTATES_INPUT slot writes a fed graph input that no later slot reads.

    Such a slot (``dsp::KVScatter``) writes its first input in place and returns it: the
    output *aliases* the input. That is only sound when the input is state the caller
    owns (a VARIABLE, or a PLACEHOLDER the caller marks variable) -- never a weight, a
    sealed value or an enclosing plan's value -- and when every later reader goes through
    the alias, so slot order alone orders the write. The input may itself be such an
    alias (a chain of in-place writes to one buffer, as in an unrolled decode block).
    Liveness needs nothing more: the buffer is an external, never released, and dropping
    an alias frees no memory.
    """
    roots: dict[int, int] = {}  # alias value id -> the external it is
    for slot in slots:
        if not slot.traits & Trait.MUTATES_INPUT:
            continue
        target = slot.inputs[0] if slot.inputs else None
        root = roots.get(target, target) if target is not None and target >= 0 else target
        cls = externals[-root - 1].cls if root is not None and root < 0 else None
        if target is None or root is None or cls not in (ExternalClass.VARIABLE, ExternalClass.PLACEHOLDER):
            what = "a missing input" if target is None else ("a computed value" if cls is None else f"a {cls.value}")
            raise GraphError(
                f'{slot.op} node "{slot.name}" writes its first input in place, which is {what}: '
                "it must be a graph input the caller owns (declare it a variable)"
            )
        readers = [s for s in slots[slot.index + 1 :] if target in s.inputs]
        if readers:
            raise GraphError(
                f'{readers[0].op} node "{readers[0].name}" reads {externals[-root - 1].name!r} after '
                f'{slot.op} node "{slot.name}" wrote it in place: read the {slot.op} output instead'
            )
        if slot.outputs and slot.outputs[0] is not None:
            roots[slot.outputs[0]] = root


def liveness(slots: Sequence[Slot], n_values: int, outputs: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Per slot, the values whose last reader it is (requested outputs are never released).

    A MUTATES_INPUT slot's output aliases its first input, an external (check_mutations):
    releasing the alias drops a reference only, so it is released like any other value.
    """
    last_use = [-1] * n_values
    for slot in slots:
        for v in slot.outputs:
            if v is not None:
                last_use[v] = slot.index  # a value nobody reads dies where it is made
        for r in slot.inputs:
            if r is not None and r >= 0:
                last_use[r] = slot.index
    keep = {r for r in outputs if r >= 0}
    release: list[list[int]] = [[] for _ in slots]
    for v, at in enumerate(last_use):
        if at >= 0 and v not in keep:
            release[at].append(v)
    return tuple(tuple(r) for r in release)


def content_hash(plan: Plan) -> str:
    """A digest of everything that defines what the plan computes."""
    h = hashlib.blake2b(digest_size=16)
    for ext in plan.externals:
        h.update(f"E{ext.name}|{ext.cls.value}|{ext.dtype}|{ext.shape}".encode())
    for k in sorted(plan.constants):
        arr = plan.constants[k]
        h.update(f"C{k}|{arr.dtype}|{arr.shape}".encode())
        h.update(plan.digest_of(k))
    for slot in plan.slots:
        h.update(f"S{slot.op}|{slot.domain}|{slot.opset}|{slot.inputs}|{slot.outputs}".encode())
        for key in sorted(slot.attrs):
            val = slot.attrs[key]
            h.update(key.encode())
            h.update(val.tobytes() if isinstance(val, np.ndarray) else repr(val).encode())
    h.update(repr(plan.outputs).encode())
    for index, region in sorted(plan.regions.items()):
        h.update(f"R{index}|{region.kind}|{region.outer}".encode())
        for attr, sub in sorted(region.subplans.items()):
            h.update(f"{attr}={sub.content_hash}".encode())
    return h.hexdigest()
