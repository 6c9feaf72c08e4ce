"""Compile-time dtype checking: every node's inputs against its op schema's type constraints.

ONNX's op schemas say, per formal input and output, a type parameter (``T``) and the
types it may take (``tensor(float)``, ``seq(tensor(int64))``, ...). ``check_types`` walks
a graph in topological order, binds each node's type parameters from its inputs' element
types and raises DTypeError when an input's type is not allowed, or when two inputs bound
to one parameter disagree (Add(int32, float32)). Output types follow from the bound
parameter or a fixed type; where no input binds the parameter (Cast's ``to``,
RandomNormal's ``dtype``) DSP's own shape rule, the subgraph's outputs or the declared
value_info say; otherwise the type stays unknown, and nothing is checked against it.

Types are kept as ONNX type strings ("tensor(float)"); ops without an ONNX schema at the
model's opset (DSP's own domains, model-local functions) are not checked here: the plan
compiler reports what it cannot run. A model declaring an ONNX opset newer than the
installed onnx knows is refused first (``check_opsets``), as ONNX Runtime refuses it:
the meaning of its ops at that opset is unknown, and running them as an older opset
could be silently wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import defs

from dsp_core.errors import DSPError, DTypeError, GraphError, ModelLoadError
from dsp_core.ir import dtypes
from dsp_core.ir.graph import Graph, Node, Value

# DSP dtype name <-> ONNX element name as type strings spell it ("float32" <-> "float").
_ELEM_OF_DTYPE: dict[str, str] = {
    name: onnx.TensorProto.DataType.Name(dtypes.to_onnx(name)).lower() for name in dtypes.DTYPE_NAMES
}
_DTYPE_OF_ELEM: dict[str, str] = {elem: name for name, elem in _ELEM_OF_DTYPE.items()}
_UNSUPPORTED = "unsupported:"  # how the importer names element types DSP lacks (string, complex)

_VARIADIC = defs.OpSchema.FormalParameterOption.Variadic
_MAX_OPSET = 2**31 - 1


@dataclass(frozen=True)
class _Formal:
    """One formal input or output: its name, type parameter (or fixed type), arity and allowed types."""

    name: str
    param: str
    variadic: bool
    homogeneous: bool
    allowed: frozenset[str]


@dataclass(frozen=True)
class _Signature:
    """What type checking needs of one op schema, read once per (domain, op, opset)."""

    inputs: tuple[_Formal, ...]
    outputs: tuple[_Formal, ...]

    def formal(self, formals: tuple[_Formal, ...], index: int) -> _Formal | None:
        """The formal that actual argument ``index`` binds to (the last one if variadic)."""
        if index < len(formals):
            return formals[index]
        if formals and formals[-1].variadic:
            return formals[-1]
        return None

    def binds(self, formal: _Formal) -> bool:
        """True when arguments of ``formal`` share one type (every non-heterogeneous formal)."""
        return formal.homogeneous or not formal.variadic


def _allowed_by_param(schema: defs.OpSchema) -> dict[str, frozenset[str]]:
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    for param in (*schema.inputs, *schema.outputs):
        # A formal typed directly ("tensor(int64)") rather than by a parameter allows just that type.
        allowed.setdefault(param.type_str, frozenset({param.type_str}))
    return allowed


def _get_schema(domain: str, op_type: str, opset: int | None) -> defs.OpSchema | None:
    try:
        if opset is None:
            return defs.get_schema(op_type, domain)
        # ONNX's C++ side takes an int32 version: a larger one means "the latest schema".
        return defs.get_schema(op_type, min(opset, _MAX_OPSET), domain)
    except (defs.SchemaError, TypeError):  # TypeError: a name that is not valid text
        return None


@functools.lru_cache(maxsize=4096)
def attribute_types(domain: str, op_type: str, opset: int) -> dict[str, int] | None:
    """Attribute name -> its AttributeProto type in the schema in effect at ``opset``; None when ONNX has none."""
    schema = _get_schema(domain, op_type, opset)
    if schema is None:
        return None
    return {name: int(attr.type.value) for name, attr in schema.attributes.items()}  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=4096)
def _signature(domain: str, op_type: str, opset: int) -> _Signature | None:
    """The schema of ``domain::op_type`` in effect at ``opset``, or None when ONNX has none.

    An input also allows what the op's latest schema allows for the same formal: ONNX
    widens type sets across versions (Cast took uint2 from opset 25) and DSP's kernel of
    an op implements the widest, so a type added later runs correctly at any opset.
    """
    schema = _get_schema(domain, op_type, opset)
    if schema is None:
        return None
    allowed = _allowed_by_param(schema)
    latest = _get_schema(domain, op_type, None)
    later: dict[str, frozenset[str]] = {}
    if latest is not None and latest.since_version > schema.since_version:
        latest_allowed = _allowed_by_param(latest)
        later = {p.name: latest_allowed[p.type_str] for p in latest.inputs}

    def formal(p: defs.OpSchema.FormalParameter, widen: bool) -> _Formal:
        types = allowed[p.type_str] | (later.get(p.name, frozenset()) if widen else frozenset())
        return _Formal(p.name, p.type_str, p.option == _VARIADIC, bool(p.is_homogeneous), types)

    return _Signature(
        inputs=tuple(formal(p, True) for p in schema.inputs),
        outputs=tuple(formal(p, False) for p in schema.outputs),
    )


def _type_of_dtype(dtype: str | None) -> str | None:
    """'float32' -> 'tensor(float)'; None for an unknown dtype."""
    if dtype is None:
        return None
    if dtype.startswith(_UNSUPPORTED):
        return f"tensor({dtype[len(_UNSUPPORTED) :]})"
    elem = _ELEM_OF_DTYPE.get(dtype)
    return None if elem is None else f"tensor({elem})"


def _type_of_value(value: Value | None) -> str | None:
    """The type string of a declared value; sequences and optionals without element type are unknown."""
    if value is None or value.kind != "tensor":
        return None
    return _type_of_dtype(value.dtype)


def _dtype_of_type(type_str: str) -> str | None:
    """'tensor(float)' -> 'float32'; None for sequences, optionals and types DSP lacks."""
    if type_str.startswith("tensor(") and type_str.endswith(")"):
        return _DTYPE_OF_ELEM.get(type_str[7:-1])
    return None


def _show(type_str: str) -> str:
    """A type string as messages print it: DSP's dtype names inside ONNX's wrappers."""
    if type_str.startswith("tensor(") and type_str.endswith(")"):
        elem = type_str[7:-1]
        return _DTYPE_OF_ELEM.get(elem, elem)
    for wrapper in ("seq(", "optional("):
        if type_str.startswith(wrapper) and type_str.endswith(")"):
            return f"{wrapper}{_show(type_str[len(wrapper) : -1])})"
    return type_str


def _allowed_text(allowed: frozenset[str]) -> str:
    return ", ".join(sorted(_show(t) for t in allowed))


@functools.lru_cache(maxsize=1)
def known_opsets() -> dict[str, int]:
    """The newest opset of each ONNX domain the installed onnx has schemas for ("" is ai.onnx)."""
    newest: dict[str, int] = {}
    for schema in defs.get_all_schemas_with_history():
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        newest[domain] = max(newest.get(domain, 0), schema.since_version)
    newest[""] = max(newest.get("", 0), defs.onnx_opset_version())
    return newest


def check_opsets(opsets: Mapping[str, int]) -> None:
    """ModelLoadError when a declared opset of an ONNX domain is newer than onnx (so DSP) knows.

    Domains ONNX does not define (com.microsoft, a model's own) are left to the op lookup.
    """
    known = known_opsets()
    for domain, version in opsets.items():
        newest = known.get(domain)
        if newest is None or version <= newest:
            continue
        name = domain or "ai.onnx"
        raise ModelLoadError(
            f"the model declares opset {version} of domain {name!r}, newer than this DSP supports: "
            f"{name} opsets up to {newest} (onnx {onnx.__version__}); export the model with opset {newest} "
            f"or lower (torch.onnx.export(..., opset_version={newest})), or upgrade onnx and dsp-core"
        )


def check_types(graph: Graph, check_declared: bool = False) -> dict[str, str]:
    """Check every node's input dtypes against its op schema; return the dtypes found per value.

    Raises DTypeError naming the node, the input, the expected and the got type. The
    result maps each value whose tensor dtype is known to its DSP dtype name. With
    ``check_declared`` (an imported model, whose value_info and outputs are claims), a
    node output whose declared dtype contradicts the one its op gives is an error too:
    two readers of such a value (the plan and the interpreter) would disagree. A newer
    opset than ONNX knows is a ModelLoadError (``check_opsets``).
    """
    check_opsets(graph.opsets)
    types = _check_graph(graph, {}, {}, check_declared)
    found: dict[str, str] = {}
    for name, type_str in types.items():
        dtype = _dtype_of_type(type_str)
        if dtype is not None:
            found[name] = dtype
    return found


def _check_graph(
    graph: Graph, outer: Mapping[str, str], seeds: Mapping[str, str], check_declared: bool = False
) -> dict[str, str]:
    """Type-check ``graph`` (a subgraph sees ``outer``); return the types of the values it defines."""
    local: dict[str, str] = {}
    for value in graph.inputs:
        type_str = _type_of_value(value) or seeds.get(value.name)
        if type_str is not None:
            local[value.name] = type_str
    for name, array in graph.initializers.items():
        try:
            local[name] = f"tensor({_ELEM_OF_DTYPE[dtypes.normalize(array.dtype)]})"
        except (DSPError, KeyError):
            local.pop(name, None)

    def type_of(name: str) -> str | None:
        found = local.get(name)
        return found if found is not None else outer.get(name)

    declared = {v.name: v for v in graph.outputs}
    declared.update(graph.value_info)
    for node in graph.nodes:
        opset = graph.opsets.get(node.domain)
        sig = None if opset is None else _signature(node.domain, node.op_type, opset)
        in_types = [type_of(name) if name else None for name in node.inputs]
        sub_outputs = _check_subgraphs(node, in_types, {**outer, **local} if outer else local, opset, check_declared)
        out_types = _node_types(node, sig, in_types) if sig is not None else [None] * len(node.outputs)
        fallback: list[str | None] | None = None
        for k, name in enumerate(node.outputs):
            if not name:
                continue
            type_str = out_types[k]
            if type_str is None:
                if fallback is None:
                    fallback = sub_outputs or _rule_types(node, in_types, opset)
                type_str = fallback[k] if k < len(fallback) else None
            claimed = _type_of_value(declared.get(name))
            if check_declared and type_str is not None and claimed is not None and claimed != type_str:
                raise DTypeError(
                    f'{node.label()}: output {k} ("{name}") is {_show(type_str)}, but the model declares it '
                    f"{_show(claimed)}; fix the declaration (value_info or graph output) or the node"
                )
            if type_str is None:
                type_str = claimed
            if type_str is not None:
                local[name] = type_str
    return local


def _node_types(node: Node, sig: _Signature, in_types: list[str | None]) -> list[str | None]:
    """Check one node's inputs against ``sig``; return its output types (None: not bound)."""
    bound: dict[str, tuple[str, int]] = {}  # type parameter -> (type, index of the input that bound it)
    for index, type_str in enumerate(in_types):
        if type_str is None:
            continue
        formal = sig.formal(sig.inputs, index)
        if formal is None:  # more inputs than the schema has: the compiler's arity check reports it
            continue
        allowed = formal.allowed
        if type_str not in allowed:
            raise DTypeError(
                f'{node.label()}: input {index} ("{node.inputs[index]}", {formal.name}) is {_show(type_str)}, '
                f"expected one of {_allowed_text(allowed)} (type {formal.param}); "
                "insert a Cast or fix the model's types"
            )
        if not sig.binds(formal):
            continue
        first = bound.get(formal.param)
        if first is None:
            bound[formal.param] = (type_str, index)
        elif first[0] != type_str:
            raise DTypeError(
                f'{node.label()}: input {index} ("{node.inputs[index]}") is {_show(type_str)}, expected '
                f'{_show(first[0])} like input {first[1]} ("{node.inputs[first[1]]}") '
                f"(type {formal.param}; allowed: {_allowed_text(allowed)})"
            )
    out: list[str | None] = []
    for k in range(len(node.outputs)):
        formal = sig.formal(sig.outputs, k)
        if formal is None or not sig.binds(formal):
            out.append(None)
        elif formal.param in bound:
            out.append(bound[formal.param][0])
        else:
            out.append(next(iter(formal.allowed)) if len(formal.allowed) == 1 else None)
    return out


def _rule_types(node: Node, in_types: list[str | None], opset: int | None) -> list[str | None]:
    """Output types from DSP's shape rule for the op, when it has one and it can tell."""
    from dsp_core.ops.registry import TensorInfo, lookup

    try:
        rule = lookup(node.op_type, node.domain, opset).shape_rule
    except DSPError:
        return []
    if rule is None:
        return []
    infos = [
        None if not name else TensorInfo(_dtype_of_type(t) if t else None, None)
        for name, t in zip(node.inputs, in_types)
    ]
    try:
        results = rule(node.attrs, *infos)
    except Exception:  # noqa: BLE001  (a rule that cannot tell without shapes leaves the type unknown)
        return []
    if not results:
        return []
    return [None if r is None else _type_of_dtype(r.dtype) for r in results]


def _check_subgraphs(
    node: Node, in_types: list[str | None], scope: Mapping[str, str], opset: int | None, check_declared: bool
) -> list[str | None] | None:
    """Check the node's subgraphs; return the node's output types they imply (If/Loop/Scan)."""
    subs = list(Graph.subgraphs_of(node))
    if not subs:
        return None
    implied: list[str | None] | None = None
    for _, key, sub in subs:
        seeds = _body_seeds(node, key, sub, in_types, opset)
        types = _check_graph(sub, scope, seeds, check_declared)
        outs = [types.get(v.name) or scope.get(v.name) or _type_of_value(v) for v in sub.outputs]
        _check_carried(node, key, sub, in_types, outs, opset)
        if node.op_type == "Loop" and key == "body":
            implied = outs[1:]  # the body's first output is its condition
        elif node.op_type in ("If", "Scan") and key in ("then_branch", "body"):
            implied = outs
    return implied


def _body_seeds(node: Node, key: str, sub: Graph, in_types: list[str | None], opset: int | None) -> dict[str, str]:
    """Types of a Loop's or Scan's body inputs, from the node's inputs, for bodies that leave them undeclared."""
    names = [v.name for v in sub.inputs]
    if node.op_type == "Loop" and key == "body":
        fed = ["tensor(int64)", "tensor(bool)", *in_types[2:]]
    elif node.op_type == "Scan" and key == "body" and opset is not None and opset >= 9:
        fed = list(in_types)
    else:
        return {}
    _check_body_inputs(node, sub, fed, first_input=0 if node.op_type == "Scan" else -2)
    return _zip_known(names, fed)


def _check_carried(
    node: Node, key: str, sub: Graph, in_types: list[str | None], outs: list[str | None], opset: int | None
) -> None:
    """DTypeError when a Loop's or Scan's body returns a carried state of another type than it was given."""
    if key != "body":
        return
    if node.op_type == "Loop":
        pairs = [(2 + k, 1 + k) for k in range(len(in_types) - 2)]
    elif node.op_type == "Scan" and opset is not None and opset >= 9:
        n_scan = node.attrs.get("num_scan_inputs", 0)
        if not isinstance(n_scan, int) or not 0 <= n_scan <= len(in_types):
            raise GraphError(f"{node.label()}: num_scan_inputs={n_scan!r}, but the node has {len(in_types)} inputs")
        pairs = [(k, k) for k in range(len(in_types) - n_scan)]
    else:
        return
    for i, o in pairs:
        given = in_types[i] if i < len(in_types) else None
        back = outs[o] if o < len(outs) else None
        if given is not None and back is not None and given != back:
            raise DTypeError(
                f'{node.label()}: the body returns its carried state {o} ("{sub.outputs[o].name}") as '
                f'{_show(back)}, but it is carried in as {_show(given)} (input {i}, "{node.inputs[i]}")'
            )


def _check_body_inputs(node: Node, sub: Graph, fed: list[str | None], first_input: int) -> None:
    """DTypeError when what the node passes its body disagrees with the body's declared input types."""
    for i, (formal, got) in enumerate(zip(sub.inputs, fed)):
        want = _type_of_value(formal)
        if want is None or got is None or want == got:
            continue
        which = i + first_input
        source = f'input {which} ("{node.inputs[which]}")' if which >= 0 else "the iteration counter/condition"
        raise DTypeError(
            f"{node.label()}: {source} is {_show(got)}, but its body declares input "
            f'"{formal.name}" as {_show(want)}; the types must match'
        )


def _zip_known(names: list[str], types: list[str | None]) -> dict[str, str]:
    return {name: t for name, t in zip(names, types) if t is not None}
