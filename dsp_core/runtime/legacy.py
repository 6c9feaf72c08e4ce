"""The legacy interpreter: walks the graph by name at every call.

It runs what the plan compiler declines (control flow with subgraphs), and it is the
baseline the plan's executors are measured against. Nothing is cached between calls:
each call looks up every op, applies attribute defaults and builds a kernel context.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dsp_core.errors import DSPError, KernelError
from dsp_core.ir.graph import Graph, Node, Value
from dsp_core.ops.registry import KernelContext, lookup


def run_graph(
    graph: Graph,
    feeds: Mapping[str, Any],
    outputs: Sequence[str] | None = None,
    outer: Mapping[str, Any] | None = None,
    xp: Any = np,
) -> list[Any]:
    """Run ``graph`` on ``feeds`` and return the requested outputs in order."""
    env: dict[str, Any] = dict(outer) if outer else {}
    env[""] = None
    env.update(graph.initializers)
    env.update(feeds)
    for node in graph.nodes:
        _run_node(graph, node, env, xp)
    names = outputs if outputs is not None else graph.output_names
    return [env[name] for name in names]


def _run_node(graph: Graph, node: Node, env: dict[str, Any], xp: Any) -> None:
    opset = graph.opsets.get(node.domain, graph.opsets.get("", 1))
    opdef = lookup(node.op_type, node.domain, opset)
    ctx = KernelContext(xp, opset, len(node.inputs), len(node.outputs), node.name)
    attrs: dict[str, Any] = {}
    for key, val in node.attrs.items():
        if isinstance(val, Graph):
            ctx.subgraphs[key] = _subgraph_runner(val, env, xp)
        else:
            attrs[key] = val
    args = [env[name] for name in node.inputs]
    try:
        result = opdef.kernel(ctx, *args, **attrs)
    except DSPError:
        raise
    except Exception as exc:
        raise KernelError(f"{node.label()} failed: {type(exc).__name__}: {exc}") from exc
    if opdef.single_output:
        result = (result,)
    for name, value in zip(node.outputs, result):
        if name:
            env[name] = value


def _subgraph_runner(sub: Graph, env: dict[str, Any], xp: Any) -> Any:
    """A callable running ``sub`` with the enclosing scope visible, as ONNX requires."""

    def run(feeds: Mapping[str, Any]) -> list[Any]:
        return run_graph(sub, feeds, outer=env, xp=xp)

    run.graph = _Declared(sub)  # type: ignore[attr-defined]
    return run


class _Declared:
    """What a control-flow kernel reads of its body: formal inputs and outputs, with the
    static dtypes and shapes the plan's sub-plans know (declarations, then DSP's shape
    rules), so the interpreter and the plan agree even on a zero-trip Loop's empty outputs."""

    def __init__(self, sub: Graph) -> None:
        self._sub = sub
        self.inputs = [sub.info(v.name) or v for v in sub.inputs]

    @functools.cached_property
    def outputs(self) -> list[Value]:
        """The body's outputs as the plan compiler types them (only read on a zero-trip Loop)."""
        from dsp_core.plan.compiler import compile_plan
        from dsp_core.plan.plan import Plan

        declared = [self._sub.info(v.name) or v for v in self._sub.outputs]
        try:
            plan = compile_plan(self._sub)
        except DSPError:
            return declared
        if not isinstance(plan, Plan):  # declined: what the model declares is all there is
            return declared
        return [Value(v.name, *plan.ref_info(r)) for v, r in zip(declared, plan.outputs)]
