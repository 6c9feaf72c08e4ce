"""One plan over several devices, on stub topologies: placement, execution, transfer analytics, budgets."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

import dsp_core as dsp
from dsp_core import diag
from dsp_core.devices import HOST, PlacementError, Reason, Strategy, current_topology, place, stub_topology
from dsp_core.devices.placement import BALANCE, _activation_crossings, _Bytes, nbytes_of, sibling_products
from dsp_core.errors import InputError
from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph
from dsp_core.llm.pipeline import GenerationPipeline
from dsp_core.testing.models import mlp
from tests.conftest import FIXTURES, run_cli

MiB = 2**20


def topology(n: int, memory: int, peers: bool) -> list[dict[str, Any]]:
    """``n`` stub devices of ``memory`` bytes, all peers of each other or none."""
    return [{"memory": memory, "peers": [j for j in range(n) if j != i] if peers else []} for i in range(n)]


def run_steps(model: Any, feeds: dict[str, np.ndarray], steps: int = 5) -> dict[str, np.ndarray]:
    """Run ``steps`` times (through freezing); the last outputs."""
    out: dict[str, np.ndarray] = {}
    for _ in range(steps):
        out = model.run(feeds)
    return out


def check_analytics(model: Any) -> None:
    """Totals equal the sum of the recorded copies; each copy's modelled time is bytes over the link's bandwidth."""
    records = model.dsp.transfers()
    summary = model.dsp.transfer_summary()
    assert summary["steps"] == len(records)  # fewer steps than the recorder keeps
    by_reason: dict[str, int] = {}
    for step in records:
        for c in step.copies:
            by_reason[c.reason.name] = by_reason.get(c.reason.name, 0) + c.nbytes
            topo = model.topology
            assert c.modelled_s == pytest.approx(c.nbytes / topo.bandwidth(c.src, c.dst))
        assert step.nbytes == sum(c.nbytes for c in step.copies)
    assert summary["bytes"] == by_reason
    assert summary["total_bytes"] == sum(s.nbytes for s in records)
    assert summary["switches"] == sum(len(s.switches) for s in records)


MLP_WIDTHS = [64, 128, 128, 96, 128, 128, 64, 128, 32]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("peers", [True, False])
@pytest.mark.parametrize("strategy", ["single_device", "memory_fit", "pipeline_parallel", "custom"])
def test_every_strategy_on_the_mlp_is_bit_equal(n: int, peers: bool, strategy: str, monkeypatch: Any) -> None:
    graph = mlp(MLP_WIDTHS)
    x = np.random.default_rng(1).standard_normal((3, MLP_WIDTHS[0])).astype(np.float32)
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
    request: Any = strategy
    if strategy == "custom":  # each layer's MatMul (and the slots after it) round-robin over the devices
        matmuls = [node.name for node in graph.nodes if node.op_type == "MatMul"]
        request = {name: (k + 1) % n for k, name in enumerate(matmuls)}
    if strategy == "memory_fit":  # a cap that forces spills: each device holds about two layers
        monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", str((250 if n == 2 else 140) * 1024))
    with stub_topology(topology(n, 64 * MiB, peers)):
        model = dsp.compile(graph, placement=request)
        got = run_steps(model, {"x": x})["y"]
    assert np.array_equal(got, want)
    placement = model.dsp.placement
    assert len(placement) == len(model.plan().slots)
    assert dict(placement) == {s: placement[s] for s in range(len(placement))}
    for d in range(n):
        assert placement.weights[d] <= placement.budgets[d]
    if strategy == "single_device":
        assert placement.devices_used == (0,) and model.dsp.transfers() == []
    elif strategy == "pipeline_parallel":
        assert placement.devices_used == tuple(range(n))
        assert list(placement.slots) == sorted(placement.slots)  # contiguous stages in order
    elif strategy == "memory_fit":
        assert len(placement.devices_used) > 1
        assert list(placement.slots) == sorted(placement.slots)
    if placement.multi_device:
        check_analytics(model)
        last = model.dsp.transfers()[-1]
        # every cut's values cross once per step, and the output comes back from the last device
        acts = sum(c.nbytes for c in last.copies if c.reason is Reason.ACTIVATION)
        assert acts == sum(3 * c.nbytes for c in placement.cuts)  # batch 3; the plan models batch as 1
        returned = [c for c in last.copies if c.reason is Reason.OUTPUT_RETURN]
        assert [c.nbytes for c in returned] == ([want.nbytes] if placement[len(placement) - 1] != 0 else [])
        for c in last.copies:
            assert c.src != c.dst and c.src != HOST


def test_peer_and_non_peer_bandwidths_model_copy_time() -> None:
    graph = mlp(MLP_WIDTHS)
    x = np.ones((2, MLP_WIDTHS[0]), np.float32)
    times = {}
    for peers in (True, False):
        with stub_topology(topology(2, 64 * MiB, peers)) as topo:
            assert topo.bandwidth(0, 1) == (300e9 if peers else 12e9)
            assert topo.bandwidth(HOST, 1) == 16e9
            model = dsp.compile(graph, placement="pipeline_parallel")
            run_steps(model, {"x": x}, 3)
        times[peers] = model.dsp.transfers()[-1].modelled_s
    assert times[False] == pytest.approx(times[True] * 25)  # 300 / 12


def test_stub_topology_restores_nests_and_validates() -> None:
    before = current_topology()
    with pytest.raises(RuntimeError):
        with stub_topology([{"memory": MiB}] * 3):
            assert len(current_topology()) == 3
            with stub_topology([{"memory": MiB}, {"memory": MiB, "peers": [0]}]) as inner:
                assert current_topology() is inner
                assert inner.peer(0, 1) and inner.peer(1, 0)  # one side granting access links both
            assert len(current_topology()) == 3
            raise RuntimeError("leaves the block")
    assert current_topology().kind == before.kind and len(current_topology()) == len(before)
    for bad, match in (
        ([], "at least one device"),
        ([{"memory": 0}], "positive number of bytes"),
        ([{"memory": MiB, "peers": [5]}], "peer 5 is not another device"),
        ([{"memory": MiB, "speed": 1}], "unknown key 'speed'"),
        (["1G"], "a dict like"),
    ):
        with pytest.raises(InputError, match=match):
            with stub_topology(bad):
                pass


def bottleneck_mlp() -> Graph:
    """Weights 64x64, 64x4, 4x64, 64x64: the middle boundary splits them evenly and only [batch, 4] crosses it."""
    return mlp([64, 64, 4, 64, 64])


def test_pipeline_cut_lies_where_the_fewest_bytes_cross() -> None:
    graph = bottleneck_mlp()
    with stub_topology(topology(2, 64 * MiB, True)):
        model = dsp.compile(graph, placement="pipeline_parallel")
    plan = model.plan()
    (cut,) = model.dsp.placement.cuts
    assert cut.nbytes == nbytes_of("float32", (1, 4))  # the bottleneck, not a 64-wide activation
    assert plan.slots[cut.after].op in ("Add", "Relu") and plan.values[cut.values[0]].shape[-1] == 4
    # brute force: no boundary inside the balance window has fewer crossing bytes
    info = _Bytes.of(plan)
    crossing, _ = _activation_crossings(plan, info.sealed)
    weights = np.cumsum([info.slot_weight(s) for s in range(len(plan.slots))])
    share = weights[-1] / 2
    window = [b for b in range(len(plan.slots) - 1) if abs(weights[b] - share) <= BALANCE * share]
    assert cut.after in window and crossing[cut.after] == min(crossing[b] for b in window)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    with stub_topology(topology(2, 64 * MiB, True)):
        placed = dsp.compile(graph, placement="pipeline_parallel")
        got = run_steps(placed, {"x": x})["y"]
    assert np.array_equal(got, dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"])
    act = [c for c in placed.dsp.transfers()[-1].copies if c.reason is Reason.ACTIVATION]
    assert [c.nbytes for c in act] == [5 * 4 * 4]


def test_pipeline_balances_weight_bytes() -> None:
    graph = mlp([96] * 9)  # eight equal layers
    for n in (2, 4, 8):
        with stub_topology(topology(n, 64 * MiB, False)):
            placement = dsp.compile(graph, placement="pipeline_parallel").dsp.placement
        share = sum(placement.weights) / n
        assert all(abs(w - share) <= 2 * BALANCE * share for w in placement.weights), placement.weights


def test_constants_a_second_device_reads_are_replicated_once() -> None:
    graph = mlp([32, 32, 32, 32], tied=True)  # the last layer reuses w0
    x = np.ones((2, 32), np.float32)
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
    with stub_topology(topology(2, 64 * MiB, True)):
        model = dsp.compile(graph, placement="pipeline_parallel")
        got = run_steps(model, {"x": x}, 6)["y"]
    assert np.array_equal(got, want)
    placement = model.dsp.placement
    w0 = model.plan().flat(
        model.plan().external_ref(next(k for k, e in enumerate(model.plan().externals) if e.name == "w0"))
    )
    assert placement.replicas[w0] == (1,)
    copies = [c for s in model.dsp.transfers() for c in s.copies if c.reason is Reason.CONSTANT_REPLICATION]
    assert [(c.name, c.src, c.dst, c.step) for c in copies] == [("w0", 0, 1, 1)]
    assert placement.weights[1] >= 32 * 32 * 4  # the replica counts against device 1's budget


def test_custom_placement_by_name_pattern() -> None:
    graph = mlp([16, 16, 16, 16])
    names = [n.name for n in graph.nodes]
    target = names[4]  # the second layer's Add
    with stub_topology(topology(3, 64 * MiB, True)):
        model = dsp.compile(graph, placement={target: 2, names[7]: 1})
        plan = model.plan()
        placement = model.dsp.placement
        slot = next(s.index for s in plan.slots if s.name == target)
        assert placement[slot] == 2 and placement[slot + 1] == 2  # the next slot stays where its predecessor is
        assert placement[0] == 0
        x = np.ones((1, 16), np.float32)
        assert np.array_equal(
            run_steps(model, {"x": x})["y"], dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
        )
        with pytest.raises(PlacementError, match="no pattern .'nothing.'. matches"):
            dsp.compile(graph, placement={"nothing*": 1})
        with pytest.raises(PlacementError, match="devices 0..2"):
            dsp.compile(graph, placement={"*": 3})
    with pytest.raises(InputError, match="unknown placement 'round_robin'"):
        dsp.compile(graph, placement="round_robin")
    with pytest.raises(InputError, match="name_pattern"):
        dsp.compile(graph, placement={"*": "1"})


def test_memory_budget_failure_names_device_need_and_budget(monkeypatch: Any) -> None:
    graph = mlp([64, 64, 64, 64])  # 3 x 16 KiB of weights (+ biases)
    monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", "20K")
    with stub_topology(topology(4, 64 * MiB, True)):
        model = dsp.compile(graph, placement="memory_fit")
        placement = model.dsp.placement
        assert placement.devices_used == (0, 1, 2) and max(placement.weights) <= 0.9 * 20 * 1024
        with pytest.raises(PlacementError) as err:
            dsp.compile(graph, placement="single_device")
    message = str(err.value)
    assert re.search(r"device 0 \(stub\).*needs \d+ bytes.*budget is 18432 bytes.*DSP_MAX_DEVICE_MEMORY=20K", message)
    monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", "10K")  # one layer no longer fits anywhere
    with stub_topology(topology(4, 64 * MiB, True)):
        with pytest.raises(PlacementError, match=r"device 0 \(stub\) cannot take slot 0 .*needs 16384 bytes.*9216"):
            dsp.compile(graph, placement="memory_fit")
    monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", "19K")  # one layer a device, but only two devices
    with stub_topology(topology(2, 64 * MiB, True)):
        with pytest.raises(PlacementError, match="do not fit on the 2 device"):
            dsp.compile(graph, placement="memory_fit")


def test_free_memory_minus_reserve_is_the_budget(monkeypatch: Any) -> None:
    graph = mlp([64, 64, 64, 64])
    with stub_topology([{"memory": 40_000}, {"memory": 40_000}, {"memory": 40_000}]):
        placement = dsp.compile(graph, placement="memory_fit").dsp.placement
        assert placement.budgets == (36_000, 36_000, 36_000)  # 10% reserve
        assert len(placement.devices_used) == 2
        monkeypatch.setenv("DSP_DEVICE_MEMORY_RESERVE", "0.5")
        assert len(dsp.compile(graph, placement="memory_fit").dsp.placement.devices_used) == 3


FIXTURE_CASES = ["cnn", "gpt2_eager", "llama_eager"]


def resident_bytes(path: str) -> int:
    """Bytes of the plan's weights and of the values computed from them alone (what placement charges)."""
    with stub_topology([{"memory": 2**40}]):
        return sum(dsp.compile(path, placement="single_device").dsp.placement.weights)


def fixture_feeds(name: str) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    if name == "cnn":
        return {"input": golden["input"]}
    return {
        k.split(".", 1)[1]: golden[k]
        for k in golden.files
        if k.startswith("step1.") and "present" not in k and "logits" not in k
    }


@pytest.mark.parametrize("name", FIXTURE_CASES)
@pytest.mark.parametrize("strategy", ["memory_fit", "pipeline_parallel", "custom"])
def test_every_strategy_on_the_fixtures_is_bit_equal(name: str, strategy: str, monkeypatch: Any) -> None:
    path = str(FIXTURES / f"{name}.onnx")
    feeds = fixture_feeds(name)
    one = dsp.compile(path, mode="slot_by_slot")
    want = one.run(feeds)
    request: Any = strategy
    if strategy == "custom":  # the second half of the nodes on device 2
        names = [s.name for s in one.plan().slots]
        request = {names[len(names) // 2]: 2}
    if strategy == "memory_fit":  # a cap that forces a spill
        monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", str(int(resident_bytes(path) * 0.77)))
    with stub_topology(topology(4, 2**30, strategy != "custom")):
        model = dsp.compile(path, placement=request)
        got = run_steps(model, feeds, 4)
    assert set(got) == set(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    placement = model.dsp.placement
    assert len(placement.devices_used) >= 2
    assert all(w <= b for w, b in zip(placement.weights, placement.budgets))
    check_analytics(model)


def test_generation_pipeline_on_a_placed_plan_keeps_kv_on_its_device() -> None:
    path = str(FIXTURES / "gpt2_eager.onnx")
    prompt = np.array([[3, 14, 15, 92, 65]], np.int64)
    want = GenerationPipeline(path, max_length=24).generate(prompt, max_new_tokens=10)
    # Layer 1 (from its first LayerNorm on) on device 1: pipeline_parallel would keep both of this
    # fixture's small layers on device 0 (its tied 1000-word embedding outweighs them).
    with stub_topology(topology(2, 2**30, True)):
        pipe = GenerationPipeline(path, max_length=24, placement={"node_layer_norm_2": 1})
        got = pipe.generate(prompt, max_new_tokens=10)
    assert got.token_list() == want.token_list()
    decode = pipe.decoder(1).model
    placement = decode.dsp.placement
    assert placement.devices_used == (0, 1)
    plan = decode.plan()
    homes = {e.name: placement.externals[k] for k, e in enumerate(plan.externals)}
    layers = sorted({homes[n] for n in homes if n.startswith("past_key_values.")})
    assert layers == [0, 1]  # each device holds its layers' KV buffers
    kv = [c for s in decode.dsp.transfers() for c in s.copies if c.reason is Reason.KV_CACHE]
    assert {c.name for c in kv} == {"kv_position"}  # the 8-byte write position; never a KV buffer
    assert all(c.nbytes == 8 for c in kv)
    steady = decode.dsp.transfers()[-1]
    assert steady.by_reason().get("ACTIVATION", 0) > 0
    check_analytics(decode)


def test_memory_fit_generation_with_a_spill_cap(monkeypatch: Any) -> None:
    path = str(FIXTURES / "llama_eager.onnx")
    prompt = np.array([[5, 6, 7]], np.int64)
    want = GenerationPipeline(path, max_length=16).generate(prompt, max_new_tokens=6)
    cap = int(resident_bytes(path) * 0.77)  # the tied LM head's 512 kB alone goes to device 1
    monkeypatch.setenv("DSP_MAX_DEVICE_MEMORY", str(cap))
    with stub_topology(topology(2, 2**30, False)):
        pipe = GenerationPipeline(path, max_length=16, placement="memory_fit")
        got = pipe.generate(prompt, max_new_tokens=6)
    assert got.token_list() == want.token_list()
    placement = pipe.decoder(1).model.dsp.placement
    assert placement.devices_used == (0, 1) and max(placement.weights) <= cap


def test_diagnostics_count_every_copy_and_switch() -> None:
    graph = mlp(MLP_WIDTHS)
    x = np.ones((2, MLP_WIDTHS[0]), np.float32)
    diag.enable("TRANSFER,MULTI_DEVICE", "summary")
    try:
        with stub_topology(topology(4, 64 * MiB, False)):
            model = dsp.compile(graph, placement="pipeline_parallel")
            run_steps(model, {"x": x}, 4)
        report = diag.report()
    finally:
        diag.disable()
    summary = model.dsp.transfer_summary()
    t = report["transfers"]
    assert {k: v["copies"] for k, v in t["by_reason"].items()} == summary["copies"]
    assert {k: v["bytes_kept"] for k, v in t["by_reason"].items()} == summary["bytes"]
    assert t["device_switches"] == summary["switches"] == 3 * 4
    assert report["categories"]["TRANSFER"]["sum"] == summary["total_bytes"]
    assert model.dsp.json_report()["devices"]["transfers"]["total_bytes"] == summary["total_bytes"]


def test_cli_explain_devices_and_dot_show_placement_cuts_and_bytes(tmp_path: Any) -> None:
    path = str(FIXTURES / "cnn.onnx")
    done = run_cli(
        "plan", "explain", path, "--devices", "--placement", "pipeline_parallel", "--stub-devices", "2x1G", "--json"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["devices"]
    assert report["strategy"] == "pipeline_parallel" and len(report["cuts"]) == 1
    assert report["cuts"][0]["bytes"] > 0 and report["devices"][1]["n_slots"] > 0
    text = run_cli(
        "plan",
        "explain",
        path,
        "--devices",
        "--placement",
        "memory_fit",
        "--stub-devices",
        "3x1G:nopeer",
        "--runs",
        "3",
        env={"DSP_MAX_DEVICE_MEMORY": "24K"},
    )
    assert text.returncode == 0, text.stderr
    assert "placement memory_fit on 3 stub device(s)" in text.stdout and "cut after slot" in text.stdout
    assert "transfers over" in text.stdout
    dot = run_cli(
        "plan",
        "dot",
        path,
        "--placement",
        "pipeline_parallel",
        "--stub-devices",
        '[{"memory": 1073741824}, {"memory": 1073741824}]',
    )
    assert dot.returncode == 0, dot.stderr
    assert "device 1" in dot.stdout and re.search(r'label="0->1 \d+ B"', dot.stdout)
    bad = run_cli("plan", "explain", path, "--stub-devices", "2y1G")
    assert bad.returncode != 0 and "NxSIZE" in bad.stderr


def test_dsp_placement_environment_and_one_device_default(monkeypatch: Any) -> None:
    graph = mlp([16, 16, 16])
    x = np.ones((1, 16), np.float32)
    plain = dsp.compile(graph)
    plain.run({"x": x})
    assert plain.plan().placement is None and plain.placement_request is None
    assert plain.dsp.placement.strategy is Strategy.SINGLE_DEVICE and plain.dsp.transfers() == []
    monkeypatch.setenv("DSP_PLACEMENT", "pipeline_parallel")
    with stub_topology(topology(2, 64 * MiB, True)):
        model = dsp.compile(graph)
        model.run({"x": x})
    assert model.dsp.placement.devices_used == (0, 1)
    assert place(model.plan(), "single_device", model.topology).devices_used == (0,)


@pytest.mark.parametrize("n", [2, 8])
def test_a_1gb_mlp_over_stub_devices(n: int) -> None:
    """16 layers of 4096x4096 float32 (1 GiB of weights): pipeline stages, bit-equal to one device."""
    width, layers = 4096, 16
    g = GraphBuilder()
    h = g.placeholder("x", "float32", ["batch", width])
    for i in range(layers):
        w = np.random.default_rng(i).random((width, width), dtype=np.float32) - np.float32(0.5)
        h = g.Relu(g.MatMul(h, g.constant(w * np.float32(2 / width**0.5), name=f"w{i}")))
    g.output(h, "y")
    graph = g.build()
    x = np.random.default_rng(99).standard_normal((1, width)).astype(np.float32)
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
    with stub_topology(topology(n, 2**30, n == 2)):
        model = dsp.compile(graph, placement="pipeline_parallel")
        got = run_steps(model, {"x": x}, 3)["y"]
    assert np.array_equal(got, want)
    placement = model.dsp.placement
    assert placement.weights == tuple([layers // n * width * width * 4] * n)
    assert all(c.nbytes == width * 4 for c in placement.cuts)
    check_analytics(model)


def qkv_graph() -> Graph:
    """h = Relu(x @ w0); y = h @ wq + h @ wk + h @ wv: three sibling products of one input."""
    rng = np.random.default_rng(3)
    g = GraphBuilder()
    x = g.placeholder("x", "float32", ["batch", 32])
    h = g.Relu(g.MatMul(x, g.constant(rng.standard_normal((32, 32)).astype(np.float32), name="w0")))
    q, k, v = (g.MatMul(h, g.constant(rng.standard_normal((32, 16)).astype(np.float32), name=n)) for n in "qkv")
    g.output(q + k + v, "y")
    return g.build()


@pytest.mark.parametrize("n", [2, 3])
def test_sibling_products_spread_only_when_asked(n: int, monkeypatch: Any) -> None:
    monkeypatch.setenv("DSP_MERGE_PRODUCTS", "0")  # merged, the three would be one product (one slot)
    graph = qkv_graph()
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    want = dsp.compile(graph, mode="slot_by_slot").run({"x": x})["y"]
    with stub_topology(topology(n, 64 * MiB, True)):
        plain = dsp.compile(graph, placement="single_device")
        assert plain.dsp.placement.devices_used == (0,)
        plan = plain.plan()
        (group,) = sibling_products(plan)
        assert [plan.slots[s].op for s in group] == ["MatMul"] * 3
        monkeypatch.setenv("DSP_SPLIT_SIBLINGS", "1")
        model = dsp.compile(graph, placement="single_device")
        got = run_steps(model, {"x": x})["y"]
    assert np.array_equal(got, want)
    placement = model.dsp.placement
    assert [placement[s] for s in group] == [i % n for i in range(3)]
    assert all(placement[s] == 0 for s in range(len(placement)) if s not in group)
    last = model.dsp.transfers()[-1]
    acts = [c for c in last.copies if c.reason is Reason.ACTIVATION]
    # h goes to each other device once; each product computed elsewhere comes back
    assert sorted((c.src, c.dst) for c in acts) == sorted(
        [(0, d) for d in range(1, n)] + [(i % n, 0) for i in range(3) if i % n]
    )
    check_analytics(model)


@pytest.mark.parametrize("name", ["mlp", "gpt2_eager"])
def test_recordings_on_stub_devices_replay_without_drift(name: str) -> None:
    """EMULATED_REPLAY bakes its inputs' addresses in: copies into a recording go through kept buffers."""
    if name == "mlp":
        source: Any = mlp(MLP_WIDTHS)
        feeds = {"x": np.random.default_rng(2).standard_normal((2, MLP_WIDTHS[0])).astype(np.float32)}
    else:
        source, feeds = str(FIXTURES / f"{name}.onnx"), fixture_feeds(name)
    want = dsp.compile(source, mode="slot_by_slot").run(feeds)
    with stub_topology(topology(3, 2**30, True)):
        model = dsp.compile(source, mode="emulated_replay", placement="pipeline_parallel")
        for _ in range(8):
            got = model.run(feeds)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    counters = model.dsp.runtime.counters()
    assert model.dsp.phase.name == "REPLAYING", model.dsp.json_report()["segments"]
    assert counters["recaptures"] == 0 and counters["stale_redispatches"] == 0, counters
    assert model.dsp.placement.multi_device
    check_analytics(model)
