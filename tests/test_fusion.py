"""Fusion analysis (dsp_core/plan/fusion.py): grouping rules on crafted graphs, and the
grouped reference run bit-equal to the ungrouped one on every fixture."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES
from dsp_cpu_ref.plugin import EmulatedReplayBackend, SlotBySlotBackend

import dsp_core as dsp
from dsp_core.backends.base import Registry
from dsp_core.backends.modes import GraphExecutionMode as M
from dsp_core.llm.pipeline import GenerationPipeline
from dsp_core.plan.fusion import (
    NO_FUSION,
    REFERENCE_POLICY,
    FusionLimits,
    FusionResult,
    PatternKind,
    ReferencePolicy,
    classify,
    propose_groups,
    sealed_slots,
)
from dsp_core.plan.plan import Plan
from dsp_core.runtime.model import CompiledModel

FIXTURE_MODELS = ["cnn", "gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23"]
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


class GroupedSlotBySlot(SlotBySlotBackend):
    """The reference backend with the reference grouping policy: runs each group node by node."""

    def fusion_policy(self) -> ReferencePolicy:
        return REFERENCE_POLICY


class GroupedEmulated(EmulatedReplayBackend):
    def fusion_policy(self) -> ReferencePolicy:
        return REFERENCE_POLICY


def grouped_registry() -> Registry:
    return Registry(backends=[GroupedSlotBySlot(), GroupedEmulated()])


def plan_of(graph: dsp.Graph) -> Plan:
    plan = dsp.compile(graph, mode="slot_by_slot").plan()
    assert plan is not None
    return plan


def group_all(plan: Plan, policy: Any = REFERENCE_POLICY) -> FusionResult:
    return propose_groups(plan, range(len(plan.slots)), policy)


def ops_by_group(plan: Plan, result: FusionResult) -> list[list[str]]:
    """Each group's ops, leaving out the Identity the builder adds to name an output."""
    ops = [[plan.slots[s].op for s in g.slots if plan.slots[s].op != "Identity"] for g in result.groups]
    return [o for o in ops if o]


def boundary(result: FusionResult, producer_op: str, consumer_op: str, plan: Plan) -> str:
    found = [
        b.reason
        for b in result.boundaries
        if plan.slots[b.producer].op == producer_op and plan.slots[b.consumer].op == consumer_op
    ]
    assert found, f"no boundary {producer_op} -> {consumer_op} in {result.boundaries}"
    return found[0]


# -- crafted graphs ---------------------------------------------------------------------
def test_a_pointwise_chain_is_one_kernel_and_no_fusion_keeps_every_slot() -> None:
    g = dsp.GraphBuilder("chain")
    x = g.placeholder("x", "float32", [4, 8])
    y = g.Tanh((x + 1.0) * 3.0)
    g.output(g.Cast(y, to=10), "y")  # float16
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert ops_by_group(plan, fused) == [["Add", "Mul", "Tanh", "Cast"]]
    assert fused.groups[0].template == "pointwise" and fused.kernels == 1
    assert fused.boundaries == []
    assert fused.groups[0].outputs == (plan.slots[-1].outputs[0],)  # only the graph output is stored
    none = group_all(plan, NO_FUSION)
    assert none.kernels == len(plan.slots) == len(none.groups)
    assert {b.reason for b in none.boundaries} == {"policy none fuses nothing"}


def test_a_diamond_of_pointwise_ops_fuses_but_a_shared_transpose_is_materialised() -> None:
    g = dsp.GraphBuilder("diamond")
    x = g.placeholder("x", "float32", [4, 8])
    a = x * 2.0
    g.output(g.Exp(a) + g.Tanh(a), "y")
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert ops_by_group(plan, fused) == [["Mul", "Exp", "Tanh", "Add"]]

    g = dsp.GraphBuilder("diamond_t")
    x = g.placeholder("x", "float32", [4, 8])
    t = g.Transpose(x, perm=[1, 0])
    g.output(g.Exp(t) + g.Tanh(t), "y")
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert ops_by_group(plan, fused)[0] == ["Transpose"]
    assert "every read uses the same index" in boundary(fused, "Transpose", "Exp", plan)
    assert fused.groups[0].outputs  # the copy is stored: two groups read it


def test_a_reduction_fuses_same_row_consumers_but_not_a_different_row() -> None:
    g = dsp.GraphBuilder("rows")
    x = g.placeholder("x", "float32", [4, 8])
    axes = g.constant(np.array([-1], np.int64))
    r = g.ReduceSum(x * x, axes, keepdims=1)  # [4, 1]
    same = x * g.Sqrt(r)  # [4, 8]: the reduction's rows
    other = r + g.constant(np.ones((1, 6), np.float32))  # [4, 6]: a different row
    g.output(same, "same")
    g.output(other, "other")
    plan = plan_of(g.build())
    fused = group_all(plan)
    red = next(grp for grp in fused.groups if grp.template == "row_reduction")
    assert [plan.slots[s].op for s in red.slots if plan.slots[s].op != "Identity"] == [
        "Mul",
        "ReduceSum",
        "Sqrt",
        "Mul",
    ]
    assert "a different row" in boundary(fused, "ReduceSum", "Add", plan)
    assert classify(plan, red.slots[1]).kind is PatternKind.ROW_REDUCTION
    assert (classify(plan, red.slots[1]).numel, classify(plan, red.slots[1]).rnumel) == (4, 8)


def test_the_exported_rmsnorm_chain_is_one_row_reduction_and_a_dependent_reduction_is_a_second_stage() -> None:
    g = dsp.GraphBuilder("rms")
    x = g.placeholder("x", "float16", [2, 3, 16])
    axes = g.constant(np.array([-1], np.int64))
    gamma = g.constant(np.ones(16, np.float32))
    h = g.Cast(x, to=1)
    inv = g.Reciprocal(
        g.Sqrt(g.ReduceMean(g.Pow(h, g.constant(np.float32(2))), axes, keepdims=1) + g.constant(np.float32(1e-6)))
    )
    g.output(g.Cast(h * inv * gamma, to=10), "y")
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert len(fused.groups) == 1 and fused.groups[0].template == "row_reduction" and fused.kernels == 1

    g = dsp.GraphBuilder("var")  # mean, then the variance of x - mean: two dependent reductions
    x = g.placeholder("x", "float32", [4, 8])
    axes = g.constant(np.array([-1], np.int64))
    d = x - g.ReduceMean(x, axes, keepdims=1)
    g.output(g.ReduceMean(d * d, axes, keepdims=1), "v")
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert fused.kernels == 2
    assert any("second reduction stage" in b.reason for b in fused.boundaries)


def test_a_store_is_alone_under_the_reference_policy_its_buffer_is_a_group_output_and_earlier_reads_run_first() -> None:
    g = dsp.GraphBuilder("scatter")
    buf = g.variable("buf", "float32", [1, 2, 8, 4])
    new = g.placeholder("new", "float32", [1, 2, 1, 4])
    pos = g.placeholder("pos", "int64", [1])
    g.output(buf * 1.0, "before")  # reads the buffer before the in-place write
    out = g.op("KVScatter", buf, new * 2.0, pos, domain="dsp")
    g.output(out * 3.0, "y")
    graph = g.build()
    plan = plan_of(graph)
    fused = group_all(plan)
    scatter = next(s.index for s in plan.slots if s.op == "KVScatter")
    alone = next(grp for grp in fused.groups if scatter in grp.slots)
    assert alone.slots == (scatter,) and alone.template == "store"
    assert plan.slots[scatter].outputs[0] in alone.outputs
    reasons = [b.reason for b in fused.boundaries if b.consumer == scatter]
    assert any("no reference template fuses it" in r for r in reasons), reasons  # the row it writes: not here
    assert any("joins only the group that makes what it writes" in r for r in reasons), reasons  # the earlier read
    reader = next(s.index for s in plan.slots if s.op == "Mul" and s.inputs[0] == plan.slots[scatter].inputs[0])
    assert fused.order.index(reader) < fused.order.index(scatter)
    # and the grouped run writes the buffer in place exactly like the ungrouped one
    results = []
    for registry in (None, grouped_registry()):
        model = (
            CompiledModel(graph, M.SLOT_BY_SLOT, registry=registry)
            if registry
            else dsp.compile(graph, mode="slot_by_slot")
        )
        array = np.arange(64, dtype=np.float32).reshape(1, 2, 8, 4)
        got = model.run({"buf": array, "new": np.ones((1, 2, 1, 4), np.float32), "pos": np.array([3])})
        results.append((array, got))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for name in ("before", "y"):
        np.testing.assert_array_equal(results[0][1][name], results[1][1][name])


def test_a_merge_that_would_create_a_cycle_is_refused() -> None:
    g = dsp.GraphBuilder("cycle")
    x = g.placeholder("x", "float32", [4, 4])
    a = g.Exp(x)
    b = a @ g.constant(np.eye(4, dtype=np.float32))  # a product: its own group, after a's
    g.output(a + b, "y")  # joining a's group would make a -> product -> a's group
    plan = plan_of(g.build())
    fused = group_all(plan)
    assert "cycle through group" in boundary(fused, "Exp", "Add", plan)
    assert ops_by_group(plan, fused) == [["Exp"], ["MatMul"], ["Add"]]


def test_template_limits_split_a_long_chain() -> None:
    g = dsp.GraphBuilder("long")
    x = g.placeholder("x", "float32", [8])
    for _ in range(5):
        x = x + 1.0
    g.output(x, "y")
    plan = plan_of(g.build())

    class Two(ReferencePolicy):
        limits = FusionLimits(max_nodes=2)

    fused = group_all(plan, Two())
    assert [len(grp.slots) for grp in fused.groups] == [2, 2, 2]  # five Adds and the output's Identity
    assert any("template limit" in b.reason for b in fused.boundaries)


def test_existing_backends_fuse_nothing_by_default() -> None:
    for backend in (SlotBySlotBackend(), EmulatedReplayBackend()):
        assert backend.fusion_policy() is None
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="slot_by_slot")
    assert all(not c.segment.groups for c in model._prepare(model._default_outputs).segments)  # type: ignore[union-attr]
    assert all("fusion" not in seg for seg in model.explain()["segments"])


def test_a_policy_that_raises_fails_the_compile_and_the_next_backend_takes_the_segment() -> None:
    class Broken(GroupedEmulated):
        def fusion_policy(self) -> ReferencePolicy:
            raise RuntimeError("boom")

    g = dsp.GraphBuilder("broken")
    x = g.placeholder("x", "float32", [4])
    g.output(g.Exp(x + 1.0), "y")
    model = CompiledModel(g.build(), M.EMULATED_REPLAY, registry=Registry(backends=[Broken(), SlotBySlotBackend()]))
    x0 = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(model.run({"x": x0})["y"], np.exp(x0 + 1.0))
    faults = model.explain()["faults"]
    assert faults and "fusion policy failed" in faults[0]["reason"] and faults[0]["fallback"] == "slot_by_slot"


# -- fixtures: grouped reference run == ungrouped, bit for bit ----------------------------
def golden_feeds(name: str, graph: dsp.Graph) -> list[dict[str, np.ndarray]]:
    data = np.load(FIXTURES / f"{name}.golden.npz")
    names = graph.input_names
    prefixes = [p for p in ("step0.", "step1.", "batch2.", "") if all(p + n in data.files for n in names)]
    assert prefixes, f"{name}: no golden feeds"
    return [{n: data[p + n] for n in names} for p in prefixes]


@pytest.mark.parametrize("mode", [M.SLOT_BY_SLOT, M.EMULATED_REPLAY])
@pytest.mark.parametrize("name", FIXTURE_MODELS)
def test_grouped_reference_run_is_bit_equal_to_the_ungrouped_one(name: str, mode: M) -> None:
    plain = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    grouped = CompiledModel(plain.graph, mode, registry=grouped_registry())
    for feeds in golden_feeds(name, plain.graph):
        for _ in range(4):  # through freezing (and, emulated, capture and replay)
            want, got = plain.run(feeds), grouped.run(feeds)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    assert grouped.last_live is not None
    units = grouped.last_live.runtime.units
    live = sum(len(u.compiled.segment.slots) for u in units)
    groups = sum(len(u.compiled.segment.groups) for u in units)
    assert 0 < groups < live  # it really grouped


def test_some_fixture_runs_its_groups_out_of_plan_order() -> None:
    # A schedule equal to plan order everywhere would make the bit-equality test above trivial.
    reordered = 0
    for name in FIXTURE_MODELS:
        plan = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot").plan()
        assert plan is not None
        live = [s for s in range(len(plan.slots)) if s not in sealed_slots(plan)]
        order = propose_groups(plan, live, REFERENCE_POLICY).order
        assert sorted(order) == live
        reordered += list(order) != live
    assert reordered >= 2


def test_sealed_slots_are_those_the_runtime_seals_at_freeze() -> None:
    model = dsp.compile(FIXTURES / "llama_eager.onnx", mode="slot_by_slot")
    feeds = golden_feeds("llama_eager", model.graph)[0]
    model.dsp.freeze()
    model.run(feeds)
    plan = model.plan()
    assert plan is not None
    assert model.dsp.runtime.sealed == frozenset(sealed_slots(plan))


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_sdpa23"])
def test_grouped_decode_gives_the_same_greedy_tokens(name: str) -> None:
    data = np.load(FIXTURES / f"{name}.golden.npz")
    model = CompiledModel(dsp.compile(FIXTURES / f"{name}.onnx").graph, M.EMULATED_REPLAY, registry=grouped_registry())
    pipe = GenerationPipeline(model, max_length=48)
    assert pipe.generate(data["prompt"], max_new_tokens=16).token_list() == data["greedy_tokens"][:16].tolist()
    units = pipe.decode_model.dsp.runtime.units
    assert any(u.compiled.segment.groups for u in units)


def test_explain_shows_a_fusing_winners_groups_and_every_boundary_reason() -> None:
    plain = dsp.compile(FIXTURES / "llama_eager.onnx", mode="slot_by_slot")
    model = CompiledModel(plain.graph, M.SLOT_BY_SLOT, registry=grouped_registry())
    fusion = model.explain()["segments"][0]["fusion"]
    assert fusion["policy"] == "reference" and 0 < fusion["kernels"] < fusion["slots"]
    assert any(g["template"] == "row_reduction" for g in fusion["groups"])
    assert fusion["boundaries"] and all(b["reason"] for b in fusion["boundaries"])
    grouped = {s: g["index"] for g in fusion["groups"] for s in g["slots"]}
    assert all(grouped[b["producer"]] != grouped[b["consumer"]] for b in fusion["boundaries"])
