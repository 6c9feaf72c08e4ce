"""GraphBuilder: build a DSP graph in Python without ONNX.

g = GraphBuilder()
x = g.placeholder("x", "float32", ["batch", 16])
w = g.constant(np.ones((16, 4), np.float32), name="w")
y = g.Relu(g.MatMul(x, w))        # any op of the table, by its ONNX name
z = y * 2.0 + 1.0                 # operators on handles build Mul / Add nodes
g.output(z, "z")
graph = g.build()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.errors import GraphError, UnsupportedOpError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Dim, Graph, Node, Value
from dsp_core.ops.registry import has_op


@dataclass(frozen=True)
class Tensor:
    """A handle on a value of the graph being built; arithmetic operators add nodes."""

    name: str
    builder: GraphBuilder

    def _bin(self, op: str, other: Any, swap: bool = False) -> Tensor:
        rhs = other if isinstance(other, Tensor) else self.builder.scalar_like(other, self)
        a, b = (rhs, self) if swap else (self, rhs)
        return self.builder.op(op, a, b)

    def __add__(self, o: Any) -> Tensor:
        return self._bin("Add", o)

    def __radd__(self, o: Any) -> Tensor:
        return self._bin("Add", o, swap=True)

    def __sub__(self, o: Any) -> Tensor:
        return self._bin("Sub", o)

    def __rsub__(self, o: Any) -> Tensor:
        return self._bin("Sub", o, swap=True)

    def __mul__(self, o: Any) -> Tensor:
        return self._bin("Mul", o)

    def __rmul__(self, o: Any) -> Tensor:
        return self._bin("Mul", o, swap=True)

    def __truediv__(self, o: Any) -> Tensor:
        return self._bin("Div", o)

    def __matmul__(self, o: Any) -> Tensor:
        return self._bin("MatMul", o)

    def __neg__(self) -> Tensor:
        return self.builder.op("Neg", self)


class GraphBuilder:
    """Builds an ir.Graph node by node; ``g.<OpName>(...)`` adds a node of that op."""

    def __init__(self, name: str = "graph", opset: int = 23) -> None:
        self._graph = Graph(name=name, opsets={"": opset})
        self._counter = 0
        self._dtypes: dict[str, str | None] = {}

    # -- values -------------------------------------------------------------------
    def _fresh(self, stem: str) -> str:
        self._counter += 1
        return f"{stem}_{self._counter}"

    def placeholder(self, name: str, dtype: Any, shape: Sequence[Dim] | None) -> Tensor:
        """A per-call input (fed at every ``run``); dims may be ints or symbolic names."""
        return self._input(name, dtype, shape)

    def variable(self, name: str, dtype: Any, shape: Sequence[Dim] | None) -> Tensor:
        """Mutable state fed by the caller (e.g. a KV cache); marked VARIABLE in the plan."""
        tensor = self._input(name, dtype, shape)
        self._graph.variables.add(name)
        return tensor

    def _input(self, name: str, dtype: Any, shape: Sequence[Dim] | None) -> Tensor:
        if any(v.name == name for v in self._graph.inputs):
            raise GraphError(f"input {name!r} is declared twice")
        dt = dtypes.normalize(dtype)
        self._graph.inputs.append(Value(name, dt, None if shape is None else tuple(shape)))
        self._dtypes[name] = dt
        return Tensor(name, self)

    def constant(self, value: Any, name: str | None = None, dtype: Any = None) -> Tensor:
        """A constant (weight) held by the graph."""
        arr = np.asarray(value, dtype=None if dtype is None else dtypes.to_numpy(dtypes.normalize(dtype)))
        dtypes.normalize(arr.dtype)
        cname = name or self._fresh("const")
        if cname in self._graph.initializers:
            raise GraphError(f"constant {cname!r} is declared twice")
        self._graph.initializers[cname] = arr
        self._dtypes[cname] = dtypes.normalize(arr.dtype)
        return Tensor(cname, self)

    def scalar_like(self, value: Any, like: Tensor) -> Tensor:
        """A 0-d constant with the dtype of ``like`` (used by the arithmetic operators)."""
        dt = self._dtypes.get(like.name) or "float32"
        return self.constant(np.asarray(value, dtype=dtypes.to_numpy(dt)))

    # -- nodes --------------------------------------------------------------------
    def op(self, op_type: str, *inputs: Tensor | None, outputs: int = 1, domain: str = "", **attrs: Any) -> Any:
        """Add a node; returns one Tensor, or a tuple when ``outputs`` > 1."""
        if not has_op(op_type, domain):
            raise UnsupportedOpError(f"GraphBuilder: op {op_type!r} is not in DSP's op table")
        names = [self._fresh(op_type.lower()) for _ in range(outputs)]
        in_names = [t.name if t is not None else "" for t in inputs]
        node = Node(op_type, in_names, names, dict(attrs), name=self._fresh(op_type), domain=domain)
        self._graph.nodes.append(node)
        first = next((self._dtypes.get(n) for n in in_names if n), None)
        for n in names:
            self._dtypes[n] = first
        handles = tuple(Tensor(n, self) for n in names)
        return handles[0] if outputs == 1 else handles

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if op_type.startswith("_") or not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **kw: self.op(op_type, *inputs, **kw)

    def output(self, tensor: Tensor, name: str | None = None) -> Tensor:
        """Mark ``tensor`` as a graph output, renamed to ``name`` when given."""
        if name is not None and name != tensor.name:
            tensor = self.op("Identity", tensor)
            node = self._graph.nodes[-1]
            node.outputs = [name]
            self._dtypes[name] = self._dtypes.get(tensor.name)
            tensor = Tensor(name, self)
        self._graph.outputs.append(Value(tensor.name, self._dtypes.get(tensor.name)))
        return tensor

    def build(self) -> Graph:
        """The finished graph, validated."""
        if not self._graph.outputs:
            raise GraphError("GraphBuilder: no outputs; call g.output(tensor, name) first")
        graph = self._graph
        graph.validate()
        return graph
