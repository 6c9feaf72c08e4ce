"""What a decoder's embedding tables allow: its vocabulary and its learned positions.

A token id indexes the token embedding (``Gather(wte, input_ids)``) and, in GPT-2 style
models, a position indexes a learned position table (``Gather(wpe, position_ids)``). An
id past a table's end is a ``Gather ... index out of bounds`` deep in a kernel; the
pipeline checks the ids and the positions a generation needs against these limits before
it runs anything, and says which limit it would pass (``GenerationPipeline``).

Rotary models (Llama) compute their position encoding and have no position table: no
limit is found for them, and none is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.ir.graph import Graph, Node

# Ops through which an index input reaches its Gather unchanged in value.
INDEX_PASS_THROUGH = ("Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand")


@dataclass(frozen=True)
class TableLimit:
    """An input's values index the first axis of a constant table with ``rows`` rows."""

    input: str  # the graph input: input_ids or position_ids
    rows: int  # valid values are 0 .. rows - 1
    node: str  # the Gather reading the table, as messages name it

    def describe(self) -> str:
        """'the 128-row table of Gather node "x"'."""
        return f"the {self.rows}-row table of {self.node}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``from_json`` reads it back)."""
        return {"input": self.input, "rows": self.rows, "node": self.node}

    @classmethod
    def from_json(cls, data: Any) -> TableLimit | None:
        """The limit ``to_json`` wrote (None stays None); ValueError when it is malformed."""
        if data is None:
            return None
        if not isinstance(data, dict) or set(data) != {"input", "rows", "node"}:
            raise ValueError(f"table limit: expected an object with input, rows, node; got {data!r}")
        if not isinstance(data["input"], str) or type(data["rows"]) is not int or not isinstance(data["node"], str):
            raise ValueError(f"table limit: a field has the wrong type: {data!r}")
        if data["rows"] < 1:
            raise ValueError(f"table limit: {data['rows']} rows")
        return cls(data["input"], data["rows"], data["node"])


def table_limit(graph: Graph, name: str) -> TableLimit | None:
    """The smallest constant table that input ``name`` indexes through a ``Gather`` (axis 0), or None."""
    constants = _constant_shapes(graph)
    same = {name}  # values equal to the input (through INDEX_PASS_THROUGH ops)
    best: TableLimit | None = None
    for node in graph.nodes:
        if node.op_type in INDEX_PASS_THROUGH and node.inputs and node.inputs[0] in same:
            same.update(out for out in node.outputs if out)
        elif _gathers_rows(node, same) and node.inputs[0] in constants:
            shape = constants[node.inputs[0]]
            if shape and (best is None or shape[0] < best.rows):
                best = TableLimit(name, int(shape[0]), node.label())
    return best


def _gathers_rows(node: Node, indices: set[str]) -> bool:
    return (
        node.op_type == "Gather"
        and len(node.inputs) == 2
        and node.inputs[1] in indices
        and int(node.attrs.get("axis", 0)) == 0
    )


def _constant_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The shapes of the graph's initializers and Constant node outputs."""
    shapes = {k: tuple(np.shape(v)) for k, v in graph.initializers.items()}
    for node in graph.nodes:
        if node.op_type == "Constant" and node.outputs and "value" in node.attrs:
            shapes[node.outputs[0]] = tuple(np.shape(node.attrs["value"]))
    return shapes
