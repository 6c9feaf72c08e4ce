"""The op table: one entry per (domain, op type), registered by one decorator line.

Each entry carries the op's schema (input and output counts, attributes with their
defaults), traits, an optional shape rule and the reference kernel. The kernel is
written once against the Array API: ``ctx.xp`` is numpy on the CPU and cupy on CUDA.

Kernel calling convention::

    @op("Gemm", inputs=(2, 3), traits=Trait.NONE)
    def gemm(ctx, a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
        ...
        return y                      # one output: the array itself

- positional parameters are the node's inputs in order; a missing optional input is None;
- keyword-only parameters are the attributes, their Python defaults are ONNX's defaults
  (a kernel that needs a per-opset default reads ``ctx.opset``);
- an op with one output returns the array; an op with several returns a tuple holding
  every output it can produce, in order (the executor keeps the ones the node names);
- ``ctx.n_outputs`` says how many outputs the node names (Split, TopK, ...).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dsp_core.errors import GraphError, UnsupportedOpError


class Trait(enum.Flag):
    """What an op does that a plan compiler or a backend must know about."""

    NONE = 0
    ELEMENTWISE = enum.auto()  # output[i] depends on input[i] only (after broadcasting)
    REDUCTION = enum.auto()  # reduces one or more axes
    SHAPE_ONLY_OUTPUT = enum.auto()  # output depends on input shapes, not values
    VALUE_DEPENDENT_SHAPE = enum.auto()  # output shape depends on an input's values
    DYNAMIC_OUTPUT_SIZE = enum.auto()  # output size known only after the kernel runs
    FULLY_WRITING = enum.auto()  # writes every element of its output (no accumulate)
    ATTENTION = enum.auto()  # an attention block (fused or a recognised pattern)
    CONTROL_FLOW = enum.auto()  # runs subgraphs (If, Loop, Scan)
    RANDOM = enum.auto()  # output depends on a random state
    FUSABLE = enum.auto()  # a fusing backend may take it into a fused kernel
    MUTATES_INPUT = enum.auto()  # writes its first input in place; its one output aliases that input


@dataclass(frozen=True)
class TensorInfo:
    """What shape inference knows of a value: dims are ints, symbolic names or None."""

    dtype: str | None
    shape: tuple[int | str | None, ...] | None


@dataclass
class KernelContext:
    """Per-node facts a kernel may read; built once per slot at plan compile time."""

    xp: ModuleType
    opset: int
    n_inputs: int
    n_outputs: int
    node_name: str = ""
    # Subgraph attributes (If/Loop/Scan) bound to a callable that runs them:
    # run(feeds: dict[str, array]) -> list[array] in the subgraph's output order.
    subgraphs: dict[str, Any] = field(default_factory=dict)


ShapeRule = Callable[..., Sequence[TensorInfo]]
# check(attrs) -> None when the attributes make sense, else a message; run when a graph is
# imported or compiled, before anything (ONNX's inference, a kernel) reads them.
AttrCheck = Callable[[Mapping[str, Any]], "str | None"]
Kernel = Callable[..., Any]
# specialize(ctx, input dtype names) -> a faster callable taking the inputs, or None.
# Called once per slot at plan compile time, when the inputs' dtypes are known, so a
# kernel's per-call dtype dispatch (half-precision widening, ...) can be decided once.
Specializer = Callable[[KernelContext, tuple[str | None, ...]], Callable[..., Any] | None]


@dataclass(frozen=True)
class OpDef:
    """One op of the table: its schema, traits, shape rule and reference kernel."""

    name: str
    domain: str
    kernel: Kernel
    inputs: tuple[int, int]  # (min, max) number of inputs; max -1 = variadic
    outputs: tuple[int, int]  # (min, max) number of outputs; max -1 = variadic
    attrs: dict[str, Any]  # attribute name -> default (inspect.Parameter.empty = required)
    traits: Trait
    since: int  # first opset version implemented
    until: int | None  # last opset version implemented (None: all later ones)
    shape_rule: ShapeRule | None
    doc: str
    specialize: Specializer | None = None
    check: AttrCheck | None = None  # attributes -> what is wrong with them, or None

    @property
    def single_output(self) -> bool:
        """True when the kernel returns one array rather than a tuple."""
        return self.outputs == (1, 1)

    def has(self, trait: Trait) -> bool:
        """True when this op carries ``trait``."""
        return bool(self.traits & trait)

    def check_arity(self, label: str, n_inputs: int, n_outputs: int, attrs: Mapping[str, Any]) -> None:
        """GraphError unless a node with these inputs, outputs and attributes fits this op."""
        for what, n, (lo, hi) in (("inputs", n_inputs, self.inputs), ("outputs", n_outputs, self.outputs)):
            if n < lo or (hi >= 0 and n > hi):
                want = f"{lo}" if lo == hi else f"{lo}..{'any' if hi < 0 else hi}"
                raise GraphError(f"{label} has {n} {what}; {self.name} has {want}")
        unknown = {k for k, v in attrs.items() if not _is_graph(v)} - set(self.attrs)
        if unknown:
            raise GraphError(f"{label} has attribute(s) {', '.join(sorted(unknown))} that {self.name} does not define")
        problem = self.check(attrs) if self.check is not None else None
        if problem:
            raise GraphError(f"{label}: {problem}")


def _is_graph(value: Any) -> bool:
    from dsp_core.ir.graph import Graph

    return isinstance(value, Graph)


_TABLE: dict[tuple[str, str], OpDef] = {}


def _attrs_of(kernel: Kernel) -> dict[str, Any]:
    params = inspect.signature(kernel).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _input_range(kernel: Kernel) -> tuple[int, int]:
    params = list(inspect.signature(kernel).parameters.values())[1:]  # skip ctx
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (sum(1 for p in positional if p.default is inspect.Parameter.empty), -1)
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    return (required, len(positional))


def op(
    name: str,
    *,
    domain: str = "",
    traits: Trait = Trait.NONE,
    outputs: int | tuple[int, int] = 1,
    inputs: tuple[int, int] | None = None,
    since: int = 1,
    until: int | None = None,
    shape: ShapeRule | None = None,
    specialize: Specializer | None = None,
    check: AttrCheck | None = None,
) -> Callable[[Kernel], Kernel]:
    """Register ``kernel`` as the reference implementation of op ``name``.

    Input counts are read from the kernel's positional parameters unless given;
    attributes and their defaults from its keyword-only parameters.
    """

    def register(kernel: Kernel) -> Kernel:
        key = (domain, name)
        if key in _TABLE:
            raise ValueError(f"op {domain or 'ai.onnx'}::{name} registered twice")
        out_range = (outputs, outputs) if isinstance(outputs, int) else outputs
        _TABLE[key] = OpDef(
            name=name,
            domain=domain,
            kernel=kernel,
            inputs=inputs if inputs is not None else _input_range(kernel),
            outputs=out_range,
            attrs=_attrs_of(kernel),
            traits=traits,
            since=since,
            until=until,
            shape_rule=shape,
            doc=(kernel.__doc__ or "").strip().splitlines()[0] if kernel.__doc__ else "",
            specialize=specialize,
            check=check,
        )
        return kernel

    return register


def alias(name: str, target: str, *, domain: str = "") -> None:
    """Register ``name`` as the same op as ``target`` (e.g. a renamed op)."""
    base = _TABLE[(domain, target)]
    _TABLE[(domain, name)] = OpDef(**{**base.__dict__, "name": name})


_DOMAIN_ALIASES = {"ai.onnx": ""}


def lookup(name: str, domain: str = "", opset: int | None = None) -> OpDef:
    """The op definition for ``domain::name``; raises UnsupportedOpError if absent."""
    _ensure_loaded()
    domain = _DOMAIN_ALIASES.get(domain, domain)
    opdef = _TABLE.get((domain, name))
    if opdef is None:
        where = f" in domain {domain!r}" if domain else ""
        raise UnsupportedOpError(f"op {name!r}{where} is not implemented by DSP")
    if opset is not None and (opset < opdef.since or (opdef.until is not None and opset > opdef.until)):
        upto = opdef.until if opdef.until is not None else "latest"
        raise UnsupportedOpError(
            f"op {name!r} at opset {opset} is not implemented (DSP covers opsets {opdef.since}..{upto})"
        )
    return opdef


def has_op(name: str, domain: str = "") -> bool:
    """True when the table holds ``domain::name``."""
    _ensure_loaded()
    return (_DOMAIN_ALIASES.get(domain, domain), name) in _TABLE


def all_ops() -> list[OpDef]:
    """Every registered op, sorted by domain and name."""
    _ensure_loaded()
    return [_TABLE[k] for k in sorted(_TABLE)]


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import dsp_core.ops  # noqa: F401  (importing the package registers every family)


# ---------------------------------------------------------------------------
# Shape rules shared by many ops. A rule takes (attrs: dict, *inputs: TensorInfo) and
# returns one TensorInfo per output, or None when it cannot tell from shapes and
# attributes alone (e.g. axes given as an input): the caller then runs the kernel.


def broadcast_dims(a: tuple[int | str | None, ...], b: tuple[int | str | None, ...]) -> tuple[int | str | None, ...]:
    """Numpy-style broadcast of two (possibly symbolic) shapes."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out: list[int | str | None] = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif isinstance(x, int) and isinstance(y, int):
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        else:
            out.append(x if isinstance(x, int) else y if isinstance(y, int) else None)
    return tuple(out)


def same_as_first(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of a unary elementwise op: output = first input."""
    return [inputs[0]]


def broadcast_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of an n-ary elementwise op: broadcast shapes, dtype of the first input."""
    shape: tuple[int | str | None, ...] | None = ()
    for info in inputs:
        if info is None:
            continue
        if info.shape is None or shape is None:
            shape = None
        else:
            shape = broadcast_dims(shape, info.shape)
    return [TensorInfo(inputs[0].dtype, shape)]


def broadcast_bool_rule(attrs: dict[str, Any], *inputs: TensorInfo) -> list[TensorInfo]:
    """Shape rule of a comparison: broadcast shapes, bool output."""
    return [TensorInfo("bool", broadcast_rule(attrs, *inputs)[0].shape)]
