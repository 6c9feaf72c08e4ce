"""DSP's graph IR: a Graph of Nodes that read and write named Values.

Values are named by strings (as in ONNX); the plan compiler later turns names into
integers. Dims are ints, symbolic names (str) or None (unknown).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsp_core.errors import GraphError

Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass
class Value:
    """A named tensor: its dtype (DSP name) and shape, as far as they are known."""

    name: str
    dtype: str | None = None
    shape: Shape | None = None
    kind: str = "tensor"  # "tensor", "sequence" (a Python list of tensors) or "optional"

    def describe(self) -> str:
        """'name: float32[batch, 16]' for messages and tables."""
        dims = "?" if self.shape is None else ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype or '?'}[{dims}]"


@dataclass
class Node:
    """One op application. Missing optional inputs are named ''."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""

    def label(self) -> str:
        """How messages name this node: 'MatMul node "mm_3"'."""
        return f'{self.op_type} node "{self.name}"' if self.name else f"{self.op_type} node (unnamed)"


@dataclass
class Graph:
    """A computation graph: inputs, constant initializers, nodes in topological order, outputs."""

    name: str = "graph"
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_info: dict[str, Value] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=lambda: {"": 23})
    # Names a subgraph reads from its enclosing graph (If/Loop/Scan bodies).
    outer_names: frozenset[str] = frozenset()
    # Inputs that hold mutable state (KV caches): classed VARIABLE, not PLACEHOLDER.
    variables: set[str] = field(default_factory=set)

    # -- queries ----------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        """Names of the graph inputs a caller must feed (initializers excluded)."""
        return [v.name for v in self.inputs if v.name not in self.initializers]

    @property
    def output_names(self) -> list[str]:
        """Names of the graph outputs."""
        return [v.name for v in self.outputs]

    def info(self, name: str) -> Value | None:
        """What is known about value ``name`` (inputs, outputs, value_info, initializers)."""
        for v in self.inputs:
            if v.name == name:
                return v
        if name in self.value_info:
            return self.value_info[name]
        for v in self.outputs:
            if v.name == name:
                return v
        if name in self.initializers:
            arr = self.initializers[name]
            from dsp_core.ir.dtypes import normalize

            return Value(name, normalize(arr.dtype), tuple(arr.shape))
        return None

    def producers(self) -> dict[str, int]:
        """Map each node output name to the index of its node."""
        out: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for name in node.outputs:
                if name:
                    out[name] = i
        return out

    def subgraphs(self) -> Iterator[tuple[Node, str, Graph]]:
        """Every (node, attribute name, subgraph) directly held by this graph's nodes."""
        for node in self.nodes:
            for key, val in node.attrs.items():
                if isinstance(val, Graph):
                    yield node, key, val

    # -- checks -----------------------------------------------------------------
    def validate(self) -> None:
        """Raise GraphError unless every node input is defined before it is read."""
        defined = set(self.initializers) | {v.name for v in self.inputs} | set(self.outer_names) | {""}
        for node in self.nodes:
            for name in node.inputs:
                if name not in defined:
                    raise GraphError(
                        f"{node.label()} reads {name!r}, which no graph input, initializer or "
                        "earlier node defines (is the graph in topological order?)"
                    )
            for name in node.outputs:
                if name and name in defined and name not in self.outer_names:
                    raise GraphError(f"{node.label()} redefines value {name!r}")
                defined.add(name)
            for _, _, sub in self.subgraphs_of(node):
                sub.validate()
        for v in self.outputs:
            if v.name not in defined:
                raise GraphError(f"graph output {v.name!r} is never computed")

    @staticmethod
    def subgraphs_of(node: Node) -> Iterator[tuple[Node, str, Graph]]:
        """The subgraph attributes of one node."""
        for key, val in node.attrs.items():
            if isinstance(val, Graph):
                yield node, key, val
