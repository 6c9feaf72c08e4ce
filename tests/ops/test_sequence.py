"""Sequence and optional ops through ``dsp.compile``: lists in, lists out, None for empty optionals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core.errors import KernelError
from dsp_core.ops.registry import KernelContext, Trait, lookup

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

FLOAT = TensorProto.FLOAT
FLOAT_SEQ = helper.make_tensor_sequence_value_info


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], opset: int = 18) -> Any:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _both(model: Any, feeds: dict[str, Any]) -> list[dict[str, Any]]:
    """Run on the compiled plan and on the legacy interpreter (both must agree with ONNX)."""
    compiled = dsp.compile(model)
    return [compiled.run(feeds), compiled.run_legacy(feeds)]


def test_construct_insert_concat_returns_a_list() -> None:
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "y"], ["s"]),
        helper.make_node("SequenceInsert", ["s", "z", "front"], ["s2"]),
        helper.make_node("ConcatFromSequence", ["s2"], ["cat"], axis=0),
        helper.make_node("ConcatFromSequence", ["s2"], ["stacked"], axis=-1, new_axis=1),
        helper.make_node("SequenceLength", ["s2"], ["n"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info(k, FLOAT, [2, 3]) for k in "xyz"]
        + [helper.make_tensor_value_info("front", TensorProto.INT64, [])],
        [
            FLOAT_SEQ("s2", FLOAT, None),
            helper.make_tensor_value_info("cat", FLOAT, None),
            helper.make_tensor_value_info("stacked", FLOAT, None),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
    )
    rng = np.random.default_rng(0)
    x, y, z = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
    for out in _both(model, {"x": x, "y": y, "z": z, "front": np.array(0, np.int64)}):
        assert isinstance(out["s2"], list) and len(out["s2"]) == 3
        for got, want in zip(out["s2"], [z, x, y]):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(out["cat"], np.concatenate([z, x, y], axis=0))
        np.testing.assert_array_equal(out["stacked"], np.stack([z, x, y], axis=-1))
        assert out["n"].dtype == np.int64 and int(out["n"]) == 3


def test_sequence_feed_at_erase() -> None:
    nodes = [
        helper.make_node("SequenceAt", ["s", "last"], ["at"]),
        helper.make_node("SequenceErase", ["s"], ["erased"]),
    ]
    model = _model(
        nodes,
        [FLOAT_SEQ("s", FLOAT, None), helper.make_tensor_value_info("last", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("at", FLOAT, None), FLOAT_SEQ("erased", FLOAT, None)],
    )
    seq = [np.full((2,), k, np.float32) for k in range(3)]
    for out in _both(model, {"s": seq, "last": np.array(-1, np.int64)}):
        np.testing.assert_array_equal(out["at"], seq[2])
        assert [float(v[0]) for v in out["erased"]] == [0.0, 1.0]
    assert len(seq) == 3  # the fed list is not changed


def test_kernels_return_new_lists() -> None:
    ctx = KernelContext(np, 18, 2, 1)
    seq = [np.zeros(2, np.float32)]
    inserted = lookup("SequenceInsert").kernel(ctx, seq, np.ones(2, np.float32))
    erased = lookup("SequenceErase").kernel(ctx, inserted, np.array(0))
    assert len(seq) == 1 and len(inserted) == 2 and len(erased) == 1
    with pytest.raises(KernelError, match="out of range"):
        lookup("SequenceAt").kernel(ctx, seq, np.array(1))


@pytest.mark.parametrize(
    ("split", "keepdims", "shapes"),
    [
        (None, 1, [(1, 4)] * 5),
        (None, 0, [(4,)] * 5),
        (np.array(2, np.int64), 0, [(2, 4), (2, 4), (1, 4)]),  # keepdims ignored; last chunk smaller
        (np.array([1, 4], np.int64), 1, [(1, 4), (4, 4)]),
    ],
)
def test_split_to_sequence(split: Any, keepdims: int, shapes: list[tuple[int, ...]]) -> None:
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    parts = lookup("SplitToSequence").kernel(KernelContext(np, 18, 2, 1), x, split, keepdims=keepdims)
    assert [p.shape for p in parts] == shapes
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1, 4) for p in parts]), x)


def test_sequence_map_runs_body_per_element() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Add", ["elem", "bias"], ["plus"]),
            helper.make_node("Shape", ["elem"], ["shape"]),
        ],
        "body",
        [helper.make_tensor_value_info("elem", FLOAT, None), helper.make_tensor_value_info("bias", FLOAT, None)],
        [
            helper.make_tensor_value_info("plus", FLOAT, None),
            helper.make_tensor_value_info("shape", TensorProto.INT64, None),
        ],
    )
    model = _model(
        [helper.make_node("SequenceMap", ["s", "b"], ["plus", "shapes"], body=body)],
        [FLOAT_SEQ("s", FLOAT, None), helper.make_tensor_value_info("b", FLOAT, [])],
        [FLOAT_SEQ("plus", FLOAT, None), FLOAT_SEQ("shapes", TensorProto.INT64, None)],
    )
    seq = [np.ones((k + 1,), np.float32) for k in range(3)]
    out = dsp.compile(model).run({"s": seq, "b": np.array(2, np.float32)})
    assert [v.tolist() for v in out["plus"]] == [[3.0] * (k + 1) for k in range(3)]
    assert [v.tolist() for v in out["shapes"]] == [[1], [2], [3]]


def test_optionals() -> None:
    nodes = [
        helper.make_node("OptionalHasElement", ["opt"], ["has"]),
        helper.make_node("OptionalGetElement", ["opt"], ["got"]),
    ]
    opt_seq = helper.make_optional_type_proto(
        helper.make_sequence_type_proto(helper.make_tensor_type_proto(FLOAT, None))
    )
    model = _model(
        nodes,
        [helper.make_value_info("opt", opt_seq)],
        [helper.make_tensor_value_info("has", TensorProto.BOOL, []), FLOAT_SEQ("got", FLOAT, None)],
    )
    compiled = dsp.compile(model)
    out = compiled.run({"opt": [np.ones(2, np.float32)]})
    assert bool(out["has"]) and isinstance(out["got"], list) and len(out["got"]) == 1
    assert not bool(compiled.run({"opt": None}, outputs=["has"])["has"])
    with pytest.raises(KernelError, match="empty"):
        compiled.run({"opt": None})


def test_optional_of_absent_input_is_empty() -> None:
    ctx = KernelContext(np, 18, 0, 1)
    assert lookup("Optional").kernel(ctx) is None
    assert not bool(lookup("OptionalHasElement").kernel(ctx))


@pytest.mark.parametrize(
    ("name", "trait"),
    [
        ("SequenceMap", Trait.CONTROL_FLOW),
        ("SplitToSequence", Trait.DYNAMIC_OUTPUT_SIZE | Trait.VALUE_DEPENDENT_SHAPE),
        ("ConcatFromSequence", Trait.DYNAMIC_OUTPUT_SIZE),
    ],
)
def test_traits(name: str, trait: Trait) -> None:
    assert lookup(name).has(trait) and (lookup(name).traits & trait) == trait
