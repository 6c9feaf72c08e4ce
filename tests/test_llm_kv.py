"""The fixed-KV rewrite (dsp_core.llm.kv) and the MUTATES_INPUT core support (dsp::KVScatter)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES

import dsp_core as dsp
from dsp_core.errors import GraphError
from dsp_core.ir.graph import Node
from dsp_core.llm.kv import KVTransformError, find_kv_growth, fixed_kv_buffers
from dsp_core.ops.registry import Trait, lookup
from dsp_core.runtime.lifecycle import PlanPhase

DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


def scatter_graph(read_after: bool = False, constant_target: bool = False) -> dsp.Graph:
    """buf[1, 2, 8, 4] <- new[1, 2, 1, 4] at pos; y = sum of the returned buffer * 2."""
    g = dsp.GraphBuilder("scatter")
    buf = (
        g.constant(np.zeros((1, 2, 8, 4), np.float32), name="w")
        if constant_target
        else g.variable("buf", "float32", [1, 2, 8, 4])
    )
    new = g.placeholder("new", "float32", [1, 2, 1, 4])
    pos = g.placeholder("pos", "int64", [1])
    out = g.op("KVScatter", buf, new, pos, domain="dsp")
    g.output(out * 2.0, "y")
    if read_after:
        g.output(buf * 1.0, "z")
    return g.build()


def test_kv_scatter_op_is_registered_with_the_mutates_input_trait() -> None:
    opdef = lookup("KVScatter", "dsp")
    assert opdef.has(Trait.MUTATES_INPUT)
    assert opdef.inputs == (3, 3)


@pytest.mark.parametrize("mode", ["slot_by_slot", "emulated_replay"])
def test_kv_scatter_writes_in_place_and_replays_without_copying_the_buffer(mode: str) -> None:
    model = dsp.compile(scatter_graph(), mode=mode)
    model.dsp.freeze()
    buf = np.zeros((1, 2, 8, 4), np.float32)
    address = buf.__array_interface__["data"][0]
    pos = np.zeros(1, np.int64)
    for step in range(8):
        pos[0] = step
        new = np.full((1, 2, 1, 4), step + 1, np.float32)
        out = model.run({"buf": buf, "new": new, "pos": pos})
        assert buf[0, 0, step, 0] == step + 1  # written where it lives
        np.testing.assert_array_equal(out["y"], buf * 2)
    assert buf.__array_interface__["data"][0] == address
    np.testing.assert_array_equal(buf[0, 0, :, 0], np.arange(1, 9))
    if mode == "emulated_replay":
        assert model.dsp.phase is PlanPhase.REPLAYING
        assert model.dsp.runtime.counters()["recaptures"] == 0
        scatter = next(s for s in model.plan().slots if s.op == "KVScatter")
        alias = model.plan().flat(scatter.outputs[0])
        for unit in model.dsp.runtime.units:
            assert alias not in getattr(unit.compiled, "_buffers", {})  # no buffer of its own: never copied


def test_kv_scatter_on_the_host_writes_a_slice_where_the_rows_fit_and_keeps_the_index_rules_elsewhere() -> None:
    """The host path (a slice view) writes what the fancy index writes; a negative start still
    wraps and a start past the end still raises, as the device path does."""
    kernel = lookup("KVScatter", "dsp").kernel

    class Ctx:
        xp = np

    rng = np.random.default_rng(1)
    for n in (1, 3):
        update = rng.standard_normal((1, 2, n, 4)).astype(np.float32)
        for p in (0, 2, 8 - n, -1):
            got = np.zeros((1, 2, 8, 4), np.float32)
            want = got.copy()
            want[:, :, np.arange(p, p + n)] = update
            assert kernel(Ctx, got, update, np.array([p])) is got  # in place: the buffer itself
            np.testing.assert_array_equal(got, want, err_msg=f"n={n} p={p}")
        with pytest.raises(IndexError):
            kernel(Ctx, np.zeros((1, 2, 8, 4), np.float32), update, np.array([8 - n + 1]))


def _eight_steps_on_onnxruntime() -> tuple[Any, np.ndarray]:
    """scatter_graph on ONNX Runtime for 8 steps, each writing row ``step`` of one caller's buffer
    (the same array, at the same address, every step) and reading the buffer back through ``y``;
    frozen and replaying without a recapture by the end."""
    model = dsp.compile(scatter_graph(), mode="onnxruntime")
    buf = np.zeros((1, 2, 8, 4), np.float32)
    address = buf.ctypes.data
    pos = np.zeros(1, np.int64)
    for step in range(8):
        pos[0] = step
        out = model.run({"buf": buf, "new": np.full((1, 2, 1, 4), step + 1, np.float32), "pos": pos})
        np.testing.assert_array_equal(out["y"], buf * 2)
    assert model.dsp.phase is PlanPhase.REPLAYING and model.dsp.runtime.counters()["recaptures"] == 0
    assert buf.ctypes.data == address
    return model, buf


def test_an_island_reads_the_kv_buffer_itself_never_a_bridged_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With DSP_RUNTIME_KV_STORE off, KVScatter runs eagerly (ONNX Runtime does not take it) between
    ONNX Runtime islands: the island after it reads the caller's buffer at its address; no bridge
    copies it each step."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DSP_RUNTIME_KV_STORE", "0")
    model, buf = _eight_steps_on_onnxruntime()
    runtime = model.dsp.runtime
    kinds = {u.kind.name for u in runtime.units}
    assert kinds == {"EAGER", "ISLAND"}, kinds  # the eager scatter, then the island that reads it
    assert runtime.aliases and not set(runtime.bridges) & runtime.aliases
    np.testing.assert_array_equal(buf[0, 0, :, 0], np.arange(1, 9))


def test_compiler_rejects_a_mutated_constant_and_a_read_after_the_write() -> None:
    with pytest.raises(GraphError, match="writes its first input in place"):
        dsp.compile(scatter_graph(constant_target=True))
    with pytest.raises(GraphError, match="after KVScatter"):
        dsp.compile(scatter_graph(read_after=True))


@pytest.mark.parametrize("name", DECODERS)
def test_find_kv_growth_on_every_export_style(name: str) -> None:
    graph = dsp.compile(FIXTURES / f"{name}.onnx").graph
    growth = find_kv_growth(graph)
    assert {(g.layer, g.kind) for g in growth} == {(i, k) for i in (0, 1) for k in ("key", "value")}
    assert all(g.present == f"present.{g.layer}.{g.kind}" and g.axis == -2 for g in growth)


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_sdpa23"])
def test_rewritten_decode_step_matches_the_growing_cache(name: str) -> None:
    model = dsp.compile(FIXTURES / f"{name}.onnx")
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    fixed = fixed_kv_buffers(model.graph, batch=1, max_length=16)
    ops = [n.op_type for n in fixed.graph.nodes]
    assert ops.count("KVScatter") == 4 and "Concat" in ops  # the other Concats (shape building) stay
    assert fixed.graph.output_names == ["logits", "next_token"]
    assert set(fixed.buffer_shapes) <= fixed.graph.variables
    decode = dsp.compile(fixed.graph, mode="slot_by_slot")
    bufs = {n: np.zeros(s, np.float32) for n, s in fixed.buffer_shapes.items()}
    for n in bufs:
        bufs[n][:, :, :7] = golden[f"step1.{n}"]
    mask = np.zeros((1, 16), np.int64)
    mask[:, :8] = 1
    feeds = {
        "input_ids": golden["step1.input_ids"],
        "attention_mask": mask,
        "position_ids": golden["step1.position_ids"],
        "kv_position": np.array([7]),
        **bufs,
    }
    out = decode.run(feeds)
    np.testing.assert_allclose(out["logits"], golden["step1.logits"], rtol=1e-4, atol=1e-4)
    assert out["next_token"][0, 0] == golden["step1.logits"][0, -1].argmax()
    for n in bufs:
        present = n.replace("past_key_values.", "present.")
        np.testing.assert_allclose(bufs[n][:, :, :8], golden[f"step1.{present}"], rtol=1e-4, atol=1e-4)


def test_rewrite_declines_with_the_culprit() -> None:
    graph = dsp.compile(FIXTURES / "gpt2_eager.onnx").graph
    with pytest.raises(KVTransformError, match="max_length"):
        fixed_kv_buffers(graph, batch=1, max_length=1)
    graph.nodes.append(Node("Neg", ["past_key_values.0.key"], ["odd"], {}, "odd_read"))
    with pytest.raises(KVTransformError, match="odd_read"):
        fixed_kv_buffers(graph, batch=1, max_length=8)
    # an Identity copy of the cache is the buffer itself (TorchScript exports): what reads the copy is judged
    graph.nodes[-1] = Node("Identity", ["past_key_values.0.key"], ["copy"], {}, "copy")
    graph.nodes.append(Node("Neg", ["copy"], ["odd"], {}, "odd_read_of_a_copy"))
    with pytest.raises(KVTransformError, match="odd_read_of_a_copy"):
        fixed_kv_buffers(graph, batch=1, max_length=8)
    plain = dsp.compile(FIXTURES / "cnn.onnx").graph
    with pytest.raises(KVTransformError, match="no past_key_values"):
        find_kv_growth(plain)


def test_onnx_runtime_takes_the_kv_store_and_writes_the_callers_buffer_after_its_call() -> None:
    """By default the store is inside the runtime's model (ScatterElements of the buffer it reads):
    one island, the reader of the store sees the new rows in the same step, and the segment writes
    them into the caller's buffer, in place, after the call."""
    pytest.importorskip("onnxruntime")
    model, buf = _eight_steps_on_onnxruntime()
    runtime = model.dsp.runtime
    assert [u.kind.name for u in runtime.units] == ["ISLAND"] and runtime.units[0].backend.name == "onnxruntime"
    np.testing.assert_array_equal(buf[0, 0, :, 0], np.arange(1, 9))
