"""DSP1 plan files: round trips of every field, corruption and truncation, constants by reference.

The identity is checked field by field (``assert_plans_equal``) for the committed fixtures,
MiniLM, a plan with control-flow regions and random graphs; every single-byte corruption
and every truncation of a small file must raise a DSPError, with or without the payload
checksum (without it, the parser's own checks and the plan digests must catch it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import ModelProto, TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.errors import DSPError, PlanFormatError
from dsp_core.ir import Tensor, dtypes
from dsp_core.ir.onnx_import import import_model
from dsp_core.ops.registry import Trait
from dsp_core.plan import serialize
from dsp_core.plan.compiler import Declined, compile_plan, content_hash
from dsp_core.plan.plan import Plan, Slot
from dsp_core.plan.serialize import MAGIC, VERSION, dumps, fnv1a64, loads

FIXTURES = Path(__file__).parent / "fixtures"
SETTINGS = settings(max_examples=100, deadline=None, database=None)


# -- comparing plans -----------------------------------------------------------------


def assert_same_value(a: Any, b: Any, where: str) -> None:
    """Attribute values are identical: same types all the way down, same bytes for arrays and floats."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), where
        assert not b.flags.writeable, f"{where}: attribute arrays must come back read-only"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where
    elif isinstance(a, np.generic):
        assert (a.dtype, a.tobytes()) == (b.dtype, b.tobytes()), where
    else:
        assert a == b, where


def assert_slots_equal(a: Slot, b: Slot) -> None:
    """Every field of two slots, attributes by type and bytes."""
    where = f"slot {a.index}"
    assert (a.index, a.op, a.domain, a.opset, a.name) == (b.index, b.op, b.domain, b.opset, b.name), where
    assert (repr(a.inputs), repr(a.outputs)) == (repr(b.inputs), repr(b.outputs)), where
    assert a.traits is b.traits, where
    assert isinstance(b.attrs, MappingProxyType), where
    assert list(a.attrs) == list(b.attrs), where
    for key in a.attrs:
        assert_same_value(a.attrs[key], b.attrs[key], f"{where} attr {key}")


def assert_plans_equal(a: Plan, b: Plan) -> None:
    """Every field of two plans is identical (recursively through regions)."""
    assert len(a.slots) == len(b.slots)
    for sa, sb in zip(a.slots, b.slots):
        assert_slots_equal(sa, sb)
    # repr tells int dims from str dims from numpy ints, and tuples from lists
    for field in ("externals", "values", "outputs", "output_names", "release", "content_hash", "graph_name"):
        assert repr(getattr(a, field)) == repr(getattr(b, field)), field
    assert list(a.constants) == list(b.constants)
    for k, arr in a.constants.items():
        got = b.constants[k]
        assert (arr.dtype, arr.shape, arr.tobytes()) == (got.dtype, got.shape, got.tobytes()), f"constant {k}"
    assert list(a.regions) == list(b.regions)
    for k, region in a.regions.items():
        other = b.regions[k]
        assert (region.slot, region.kind, region.outer) == (other.slot, other.kind, other.outer)
        assert list(region.subplans) == list(other.subplans)
        for attr, sub in region.subplans.items():
            assert_plans_equal(sub, other.subplans[attr])


# -- plans to serialize --------------------------------------------------------------


def compiled(graph: dsp.Graph) -> Plan:
    """The plan of ``graph`` for its outputs (the test fails if the compiler declines)."""
    plan = compile_plan(graph)
    assert not isinstance(plan, Declined), plan
    return plan


def roundtrip(plan: Plan, resolve: Callable[[str], np.ndarray | None] | None = None, **kw: Any) -> Plan:
    """dumps then loads, checking the result is the identity."""
    data = dumps(plan, **kw)
    assert data[:4] == MAGIC
    back = loads(data, resolve=resolve)
    assert_plans_equal(plan, back)
    return back


def _small_model() -> ModelProto:
    """A small model touching most of the format: a region, None wiring, attrs of several kinds, low-bit dtypes."""
    vi = helper.make_tensor_value_info
    then_g = helper.make_graph([helper.make_node("Identity", ["a"], ["t"])], "then", [], [vi("t", 1, [4, "n"])])
    else_g = helper.make_graph([helper.make_node("Neg", ["a"], ["e"])], "else", [], [vi("e", 1, None)])
    const = numpy_helper.from_array(np.array(6.0, np.float32))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("LeakyRelu", ["mm"], ["a"], alpha=0.2),
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
        helper.make_node("Gelu", ["at"], ["g"], approximate="tanh"),
        helper.make_node("Constant", [], ["cmax"], value=const),
        helper.make_node("Clip", ["g", "", "cmax"], ["cl"]),
        helper.make_node("TopK", ["x", "k"], ["vals", ""]),
        helper.make_node("ConstantOfShape", ["k"], ["cos"], value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["big"], ["bs"], keepdims=0),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="the_if"),
    ]
    inits = [
        numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w"),
        numpy_helper.from_array(np.linspace(-1, 1, 64).astype(np.float32), "big"),  # by reference below
        helper.make_tensor("h", TensorProto.BFLOAT16, [4], [1.0, 2.0, -0.5, 3.0]),
        helper.make_tensor("q", TensorProto.INT4, [4], [1, -2, 3, 7]),
        numpy_helper.from_array(np.array([2], np.int64), "k"),
    ]
    graph = helper.make_graph(
        nodes,
        "small",
        [vi("x", 1, ["n", 4]), vi("c", TensorProto.BOOL, [])],
        [vi(n, 0, None) for n in ("y", "vals", "cos", "hf", "qf", "bs", "cl")],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


SMALL_LIMIT = 128  # "big" (256 bytes) goes by reference, the rest inline


@pytest.fixture(scope="module")
def small() -> tuple[dsp.Graph, Plan, bytes]:
    graph = import_model(_small_model())
    plan = compiled(graph)
    return graph, plan, dumps(plan, inline_limit=SMALL_LIMIT)


@pytest.fixture(scope="module")
def gpt2() -> tuple[dsp.Graph, Plan]:
    graph = import_model(FIXTURES / "gpt2_eager.onnx")
    return graph, compiled(graph)


# -- (1) round trips -----------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.onnx")), ids=lambda p: p.stem)
def test_fixture_plans_round_trip(path: Path) -> None:
    graph = import_model(path)
    plan = compiled(graph)
    roundtrip(plan, graph.initializers.get)
    roundtrip(plan, None, inline_limit=1 << 40)  # everything inline: no resolver needed
    # everything by reference, Constant nodes' values too (the TorchScript exports have them)
    values = {**graph.initializers, **{n.outputs[0]: n.attrs["value"] for n in graph.nodes if n.op_type == "Constant"}}
    roundtrip(plan, values.get, inline_limit=0)


def test_minilm_plan_round_trips() -> None:
    from test_minilm import minilm_path

    try:
        path = minilm_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"MiniLM wheel not installed: {exc}")
    graph = import_model(path)
    plan = compiled(graph)
    back = roundtrip(plan, graph.initializers.get)
    assert any(b is graph.initializers.get(plan.externals[k].name) for k, b in back.constants.items())


def test_control_flow_regions_round_trip(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, plan, data = small
    assert plan.regions and any(None in s.inputs for s in plan.slots) and any(None in s.outputs for s in plan.slots)
    back = loads(data, resolve=graph.initializers.get)
    assert_plans_equal(plan, back)
    assert set(back.regions[len(back.slots) - 1].subplans) == {"then_branch", "else_branch"}
    assert {e.dtype for e in back.externals} >= {"bfloat16", "int4", "bool"}


def test_loaded_plan_summarizes_like_the_original(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, plan, data = small
    back = loads(data, resolve=graph.initializers.get)
    assert content_hash(back) == plan.content_hash
    assert back.summary() == plan.summary()


# random graphs ----------------------------------------------------------------------

DTYPES = [
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int8",
    "uint8",
    "bool",
    "int4",
    "uint2",
    "float8_e4m3fn",
    "float8_e5m2",
]


@st.composite
def arrays(draw: st.DrawFn, max_side: int = 4) -> np.ndarray:
    """An array of a DSP dtype with arbitrary bytes (bools 0/1)."""
    dtype = dtypes.to_numpy(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, max_side), max_size=3)))
    size = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize)), np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _scalar(arr: np.ndarray) -> Any:
    return arr.reshape(-1)[0] if arr.size else None


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True, width=64)
    | st.text(max_size=8)
    | arrays()
    | arrays(max_side=2).map(_scalar)
)
ATTR_VALUES = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.tuples(SCALARS, st.lists(SCALARS, max_size=2)), st.lists(arrays())
)

# op -> (number of inputs (lo, hi), attribute names); the shape rules of these ops never
# allocate from attribute values, so any value is safe to compile.
OPS: dict[str, tuple[tuple[int, int], tuple[str, ...]]] = {
    "Relu": ((1, 1), ()),
    "Identity": ((1, 1), ()),
    "Add": ((2, 2), ()),
    "Mul": ((2, 2), ()),
    "Where": ((3, 3), ()),
    "LeakyRelu": ((1, 1), ("alpha",)),
    "Gelu": ((1, 1), ("approximate",)),
    "HardSigmoid": ((1, 1), ("alpha", "beta")),
    "Softmax": ((1, 1), ("axis",)),
    "Transpose": ((1, 1), ("perm",)),
    "Concat": ((1, 3), ("axis",)),
    "Cast": ((1, 1), ("to", "saturate", "round_mode")),
    "Clip": ((1, 3), ("min", "max")),
    "ConstantOfShape": ((1, 1), ("value",)),
}


@st.composite
def random_graphs(draw: st.DrawFn) -> dsp.Graph:
    """A random DAG of ops from OPS over placeholders, variables and constants of several dtypes."""
    g = dsp.GraphBuilder(draw(st.text(max_size=6)) or "graph")
    dims = st.one_of(st.integers(0, 8), st.sampled_from(["batch", "seq"]), st.none())
    shapes = st.none() | st.lists(dims, max_size=3)
    pool = [g.placeholder("x", draw(st.sampled_from(DTYPES)), draw(shapes))]
    if draw(st.booleans()):
        pool.append(g.variable("v", draw(st.sampled_from(DTYPES)), draw(shapes)))
    pool += [g.constant(a) for a in draw(st.lists(arrays(max_side=6), max_size=3))]
    sinks: list[Tensor] = []  # node outputs no later node reads: the graph's outputs
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(sorted(OPS)))
        (lo, hi), attr_names = OPS[op]
        inputs: list[Tensor | None] = list(draw(st.lists(st.sampled_from(pool), min_size=lo, max_size=hi)))
        if op == "Clip" and len(inputs) == 3 and draw(st.booleans()):
            inputs[1] = None  # a missing optional input
        attrs = {k: draw(ATTR_VALUES) for k in attr_names if draw(st.booleans())}
        sinks = [t for t in sinks if t not in inputs]
        sinks.append(g.op(op, *inputs, **attrs))
        pool.append(sinks[-1])
    for i, t in enumerate(sinks):
        g.output(t, f"out{i}")
    return g.build()


@SETTINGS
@given(graph=random_graphs(), limit=st.sampled_from([0, 16, 1 << 16]))
def test_random_plans_round_trip(graph: dsp.Graph, limit: int) -> None:
    roundtrip(compiled(graph), graph.initializers.get, inline_limit=limit)


# -- (2) corruption and truncation ---------------------------------------------------


def _flipped(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


def _check_corruption(data: bytes, i: int, plan: Plan, resolve: Callable[[str], Any]) -> None:
    """A flipped byte is always an error; without the checksum, an error or the very same plan."""
    bad = _flipped(data, i)
    with pytest.raises(DSPError):
        loads(bad, resolve=resolve)
    try:
        back = loads(bad, resolve=resolve, _verify_checksum=False)
    except DSPError:
        return
    # Only the checksum field itself (bytes 16..31, which this mode skips) may change harmlessly.
    assert 16 <= i < 32, f"byte {i} was corrupted and the file still loaded"
    assert_plans_equal(plan, back)


def test_every_byte_flip_of_a_small_file_is_rejected(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, plan, data = small
    assert 1000 < len(data) < 8000
    for i in range(len(data)):
        _check_corruption(data, i, plan, graph.initializers.get)


def test_every_truncation_of_a_small_file_is_rejected(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, _, data = small
    for n in range(len(data)):
        with pytest.raises(DSPError):
            loads(data[:n], resolve=graph.initializers.get)
        with pytest.raises(DSPError):
            loads(data[:n], resolve=graph.initializers.get, _verify_checksum=False)


@pytest.mark.parametrize("limit", [1 << 16, 0])
def test_sampled_byte_flips_of_a_fixture_file_are_rejected(gpt2: tuple[dsp.Graph, Plan], limit: int) -> None:
    graph, plan = gpt2
    data = dumps(plan, inline_limit=limit)
    rng = np.random.default_rng(limit)
    for i in rng.choice(len(data), 120, replace=False):
        _check_corruption(data, int(i), plan, graph.initializers.get)


def test_header_errors_name_the_problem(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, _, data = small
    cases = {
        "not a DSP1 plan": b"ONNX" + data[4:],
        "format version 2": data[:4] + struct.pack("<H", VERSION + 1) + data[6:],
        "reserved flags": data[:6] + b"\x01\x00" + data[8:],
        "the file holds": data + b"\x00",
        "blake2b checksum": data[:-1] + bytes([data[-1] ^ 1]),
    }
    for message, bad in cases.items():
        with pytest.raises(PlanFormatError, match=message):
            loads(bad, resolve=graph.initializers.get)
    with pytest.raises(PlanFormatError, match="must be bytes"):
        loads("DSP1")  # type: ignore[arg-type]


def test_op_table_changes_are_detected(small: tuple[dsp.Graph, Plan, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _, data = small
    real = serialize.lookup

    def other_traits(op: str, domain: str = "", opset: int | None = None) -> Any:
        opdef = real(op, domain, opset)
        return opdef if op != "Gelu" else type(opdef)(**{**opdef.__dict__, "traits": Trait.NONE})

    monkeypatch.setattr(serialize, "lookup", other_traits)
    with pytest.raises(PlanFormatError, match=r"op table changed"):
        loads(data, resolve=graph.initializers.get)
    monkeypatch.setattr(serialize, "has_op", lambda op, domain="": op != "Gelu")
    with pytest.raises(PlanFormatError, match=r"Gelu is not in this build's op table"):
        loads(data, resolve=graph.initializers.get)


def test_unserializable_plans_are_refused(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    from dataclasses import replace

    _, plan, _ = small
    odd = replace(plan.slots[1], attrs=MappingProxyType({"alpha": {"not": "storable"}}))
    odd_plan = replace(plan, slots=(plan.slots[0], odd, *plan.slots[2:]))
    odd_plan.content_hash = content_hash(odd_plan)
    with pytest.raises(PlanFormatError, match="attribute value of type dict"):
        dumps(odd_plan)
    with pytest.raises(PlanFormatError, match="stale"):
        dumps(replace(plan, graph_name="renamed", content_hash="0" * 32))


# -- (3) constants by reference ------------------------------------------------------


def test_constants_by_reference_are_resolved_and_checked(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, plan, data = small
    big = graph.initializers["big"]
    assert_plans_equal(plan, loads(data, resolve={"big": big.copy()}.get))
    changed = big.copy()
    changed[3] += 1
    wrong: dict[str, Callable[[str], Any]] = {
        "different bytes": {"big": changed}.get,
        "is missing": {}.get,
        r"plan expects float32\[64\]": {"big": big.astype(np.float64)}.get,
        r"float32\[2, 32\] in the model": {"big": big.reshape(2, 32)}.get,
        "resolving constant 'big' failed": lambda name: {}[name],
    }
    for message, resolve in wrong.items():
        with pytest.raises(PlanFormatError, match=message):
            loads(data, resolve=resolve)
    with pytest.raises(PlanFormatError, match="pass resolve="):
        loads(data)


def test_non_contiguous_resolved_constants_are_accepted(small: tuple[dsp.Graph, Plan, bytes]) -> None:
    graph, plan, data = small
    strided = np.repeat(graph.initializers["big"], 2)[::2]
    assert_plans_equal(plan, loads(data, resolve={"big": strided}.get))


def test_fnv1a64_known_values() -> None:
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_bfloat16_scalar_attributes_keep_their_type() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2])
    g.output(g.LeakyRelu(x, alpha=ml_dtypes.bfloat16(0.5)), "y")
    back = roundtrip(compiled(g.build()))
    assert type(back.slots[0].attrs["alpha"]) is ml_dtypes.bfloat16
