"""dsp-openvino and dsp-onnxruntime: installed, conformant, and right on every fixture through AUTO.

The rest of the suite keeps these two out of AUTO (conftest's DSP_AUTO_EXCLUDE); here they
are let in, and every answer is compared with the slot-by-slot reference.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES, run_cli
from test_conformance_kit import _counts, _run_kit

import dsp_core as dsp
from dsp_core.backends.discovery import discover

BACKENDS = ("openvino", "onnxruntime")
DECODERS = ("gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23")


@pytest.fixture
def cpu_runtimes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AUTO with both CPU runtimes in it (numpy_replay, the third CPU bidder, left out: its own
    trials are in test_numpy_replay.py), and a disk cache of this test's own."""
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "numpy_replay")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", BACKENDS)
def test_registered_and_available(name: str) -> None:
    backend = next(b for b in discover().backends if b.name == name)
    assert backend.distribution == f"dsp-{name}" and backend.platform == "cpu"
    assert backend.availability().ok, backend.availability().reason
    assert backend.contract.tolerance <= 1e-4 and "float32" in backend.contract.dtypes


@pytest.mark.parametrize("name", BACKENDS)
def test_passes_the_conformance_kit(tmp_path: Path, name: str) -> None:
    done = _run_kit(tmp_path, "--dsp-backend", name)
    output = done.stdout + done.stderr
    counts = _counts(output.splitlines()[-1] if output.strip() else "")
    assert done.returncode == 0, output[-6000:]
    assert counts.get("passed", 0) >= 50 and not counts.get("failed") and not counts.get("error"), output[-3000:]


# A sitecustomize that makes one module fail to import, as on a machine without it.
_BLOCK = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == {module!r} or name.startswith({module!r} + "."):
                raise ImportError("No module named " + repr(name) + " (blocked by the test)")
    sys.meta_path.insert(0, _Block())
    """
)


@pytest.mark.parametrize("name", BACKENDS)
def test_without_its_package_it_lists_as_unavailable_with_the_reason(tmp_path: Path, name: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(_BLOCK.format(module=name))
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    table = json.loads(run_cli("backends", "list", "--json", env=env).stdout)
    row = {r["name"]: r for r in table["backends"]}[name]
    assert row["available"] is False and f"{name} is not installed" in row["reason"], row
    assert "pip install" in row["reason"]
    # its plugin still loaded (a recorded reason, not a load failure), and AUTO goes on without it
    assert not [f for f in table["failures"] if f["entry_point"] == name] and name not in table["auto"]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_named_backend_freezes_binds_and_replays(name: str, cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode=name)
    reference = dsp.compile(mlp_graph, mode="slot_by_slot")
    rng = np.random.default_rng(1)
    for _ in range(6):
        x = rng.standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime.phase.name == "REPLAYING"
    units = [u for u in runtime.units if u.backend.name == name]
    assert units and all(u.phase.name == "REPLAYING" and u.counters.captures == 1 for u in units)
    assert sum(u.counters.replays for u in units) >= 3


def test_openvino_caches_compiled_models_under_dsps_cache(cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="openvino")
    model.run({"x": np.ones((2, 8), np.float32)})
    folder = Path(os.environ["DSP_CACHE_DIR"]) / "runtimes" / "openvino"
    assert any(folder.iterdir()), "OpenVINO wrote no compiled blob under DSP's cache"


def test_openvino_keeps_f32_when_bf16_is_asked_but_the_contract_forbids_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsp_openvino.plugin import OpenVinoBackend, compile_config

    monkeypatch.setenv("DSP_CPU_PRECISION", "bf16")
    monkeypatch.setenv("DSP_CPU_THREADS", "1")
    settings = compile_config()
    assert not OpenVinoBackend.allows_bf16 and settings["INFERENCE_PRECISION_HINT"] == "f32"
    assert settings["INFERENCE_NUM_THREADS"] == 1


def test_onnxruntime_keeps_its_optimized_model_under_dsps_cache(cpu_runtimes: None, mlp_graph: dsp.Graph) -> None:
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    model.run({"x": np.ones((2, 8), np.float32)})
    folder = Path(os.environ["DSP_CACHE_DIR"]) / "runtimes" / "onnxruntime"
    files = sorted(folder.glob("*.onnx"))
    assert files, "no optimized model file"
    again = dsp.compile(mlp_graph, mode="onnxruntime")  # a new session loads the optimized file
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(again.run({"x": x})["y"], model.run({"x": x})["y"])


def _fixture_feeds(name: str, step: int) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    prefix = f"step{step}."
    feeds = {k[len(prefix) :]: golden[k] for k in golden.files if k.startswith(prefix)}
    return {k: v for k, v in feeds.items() if not k.startswith(("logits", "present"))}


def _through_auto(path: Path, feeds_per_run: list[dict[str, np.ndarray]]) -> None:
    """Runs under AUTO (trials, freeze, replay) equal the reference's within the runtimes' tolerance."""
    auto = dsp.compile(path)
    reference = dsp.compile(path, mode="slot_by_slot")
    for feeds in feeds_per_run:
        got, want = auto.run(feeds), reference.run(feeds)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=2e-4, err_msg=f"{path.name}: {key}")
    used = set(auto.resolved_backends())
    assert used & set(BACKENDS), f"{path.name}: AUTO used {used}"
    assert not auto.explain()["faults"], auto.explain()["faults"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_every_decoder_fixture_through_auto_matches_the_reference(name: str, cpu_runtimes: None) -> None:
    decode = _fixture_feeds(name, 1)  # a decode step: past of the prompt's length
    prefill = _fixture_feeds(name, 0)  # 7 tokens, an empty past (zero-sized tensors)
    _through_auto(FIXTURES / f"{name}.onnx", [prefill] * 4 + [decode] * 4)


def test_the_cnn_through_auto_matches_the_reference(cpu_runtimes: None) -> None:
    x = np.load(FIXTURES / "cnn.golden.npz")["input"]
    _through_auto(FIXTURES / "cnn.onnx", [{"input": x}] * 5)


def test_the_external_data_mlp_through_auto_matches_the_reference(cpu_runtimes: None) -> None:
    golden = np.load(FIXTURES / "external_data" / "mlp.golden.npz")
    path = FIXTURES / "external_data" / "mlp.onnx"
    name = dsp.compile(path).input_names[0]
    _through_auto(path, [{name: golden["x"]}] * 5)


def test_auto_leaves_both_out_by_default_and_lists_them_when_let_in(tmp_path: Path) -> None:
    """By default AUTO leaves the native runtimes out; DSP_AUTO_EXCLUDE=none lets them in."""
    env = {k: v for k, v in os.environ.items() if k != "DSP_AUTO_EXCLUDE"}
    cmd = [sys.executable, "-m", "dsp_core.cli", "backends", "list", "--json"]
    table = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env).stdout)
    assert not {"openvino", "onnxruntime"} & set(table["auto"]), table["auto"]
    let_in = {**env, "DSP_AUTO_EXCLUDE": "none"}
    table = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=let_in).stdout)
    assert {"openvino", "onnxruntime"} <= set(table["auto"]), table["auto"]


def _light_graph() -> dsp.Graph:
    g = dsp.GraphBuilder("light")
    x = g.placeholder("x", "float32", [2, 3])
    g.output(g.Relu(g.Neg(x)), "y")
    return g.build()


def test_openvino_declines_a_short_light_segment_under_auto_but_not_when_named(
    cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", "onnxruntime,numpy_replay")
    auto = dsp.compile(_light_graph())
    declines = [d for s in auto.explain()["segments"] for d in s["declines"] if d["backend"] == "openvino"]
    assert auto.resolved_backends() == ["slot_by_slot"]
    assert declines and all("call overhead" in d["detail"] for d in declines), declines
    named = dsp.compile(_light_graph(), mode="openvino")
    assert named.resolved_backends() == ["openvino"]
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_array_equal(named.run({"x": x})["y"], np.maximum(-x, 0))


def test_an_op_a_runtime_lacks_is_declined_with_the_reason(cpu_runtimes: None) -> None:
    g = dsp.GraphBuilder("det")
    x = g.placeholder("x", "float32", [3, 3])
    g.output(g.Det(x), "d")
    model = dsp.compile(g.build(), mode="openvino")  # the reference takes what it declines
    (decline,) = [d for s in model.explain()["segments"] for d in s["declines"] if d["op"] == "Det"]
    assert decline["reason"] == "unsupported_op" and "no conversion rule for Det" in decline["detail"]
    a = np.eye(3, dtype=np.float32) * 2
    np.testing.assert_allclose(model.run({"x": a})["d"], 8.0, rtol=1e-6)


def test_backends_list_says_what_auto_leaves_out() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DSP_AUTO_EXCLUDE"}
    out = subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", "backends", "list"], capture_output=True, text=True, env=env
    ).stdout
    assert "left out of AUTO by DSP_AUTO_EXCLUDE: numpy_replay, onnxruntime, openvino" in out


def test_onnxruntimes_kernel_table_is_kept_so_discovery_does_not_import_it(tmp_path: Path) -> None:
    """Discovery asks every backend's predicate once; for onnxruntime that meant importing it and
    walking its kernel definitions in every process. The table is kept per onnxruntime version:
    a second process discovers the backends without importing onnxruntime, with the same table;
    a damaged file is made again."""
    from dsp_onnxruntime import plugin

    env = {**os.environ, "DSP_CACHE_DIR": str(tmp_path), "DSP_DISK_CACHE": "1"}
    probe = (
        "import sys; from dsp_core.backends.discovery import discover; discover(); print('onnxruntime' in sys.modules)"
    )
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True) for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr[-2000:] for r in runs]
    (kept,) = (tmp_path / "onnxruntime").glob("kernels-*-CPUExecutionProvider.json")
    assert plugin._read_table(kept) == plugin._table_from_onnxruntime()
    # the CUDA provider's table (asked by onnxruntime-cuda's predicate) is kept too, empty in a CPU build
    (cuda,) = (tmp_path / "onnxruntime").glob("kernels-*-CUDAExecutionProvider.json")
    assert plugin._read_table(cuda) == plugin._table_from_onnxruntime(plugin.CUDA_PROVIDER)
    kept.write_bytes(kept.read_bytes()[:-40])  # cut short: damaged
    assert plugin._read_table(kept) is None
    again = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert again.stdout.strip() == "True" and plugin._read_table(kept) == plugin._table_from_onnxruntime()


@pytest.mark.parametrize(
    "dtype",
    ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"],
)
def test_segment_model_constants_read_back_as_written(dtype: str) -> None:
    """Initializers are filled straight into the model (one copy of the bytes): every plain dtype,
    0-d and n-d, reads back equal."""
    from onnx import numpy_helper

    from dsp_core.plan.subgraph import _add_initializer

    rng = np.random.default_rng(3)
    graph = __import__("onnx").GraphProto()
    arrays = {
        "a": (rng.standard_normal((3, 4, 5)) * 50).astype(dtype),
        "b": np.asarray(rng.standard_normal() * 9).astype(dtype),
    }
    for name, array in arrays.items():
        _add_initializer(graph, name, array)
    for tensor in graph.initializer:
        got = numpy_helper.to_array(tensor)
        want = arrays[tensor.name]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


# -- a decode step as one runtime call: the KV stores inside the segment ---------------------
def _decode_run(name: str, mode: str) -> tuple[list[int], Any, list[np.ndarray]]:
    """16 greedy tokens of fixture ``name`` under ``mode``: the tokens, the decode plan's partition,
    and the KV buffers as they are after the last step."""
    from dsp_core.llm import GenerationPipeline

    pipe = GenerationPipeline(str(FIXTURES / f"{name}.onnx"), mode=mode)
    tokens = pipe.generate(np.array([[5, 7, 11, 13]], np.int64), 16).token_list()
    state = pipe._resident[1]  # the batch-1 decode arrays the session wrote
    return tokens, pipe.decode_model.partition(), [np.array(b) for b in state.buffers.values()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DECODERS)
def test_a_decode_step_is_one_runtime_call_with_its_kv_stores_inside(
    name: str, backend: str, cpu_runtimes: None
) -> None:
    """Named, each runtime takes the whole decode step, its KV stores included (written as
    ScatterElements of the buffer the runtime reads; the segment writes the rows into the buffer
    after the call): one segment, the reference's tokens and the reference's KV buffers."""
    want, _, want_kv = _decode_run(name, "slot_by_slot")
    got, part, got_kv = _decode_run(name, backend)
    assert got == want
    assert [s.backend for s in part.segments] == [backend], [(s.backend, len(s.slots)) for s in part.segments]
    assert len(got_kv) == len(want_kv) > 0
    for g, w in zip(got_kv, want_kv):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_onnxruntime_replays_write_the_kv_rows_in_place(backend: str, cpu_runtimes: None) -> None:
    """ONNX Runtime's replays bind each store's updated buffer onto the buffer itself (its
    ScatterElements then writes only the new rows); OpenVINO's keep writing the rows after the
    call. Both replay most steps and end with the reference's buffers (the test above)."""
    from dsp_core.backends.whole import WholeSegment
    from dsp_core.llm import GenerationPipeline

    pipe = GenerationPipeline(str(FIXTURES / "gpt2_eager.onnx"), mode=backend)
    pipe.generate(np.array([[5, 7, 11, 13]], np.int64), 16)
    runtime = pipe.decode_model.last_live.runtime  # type: ignore[union-attr]
    (segment,) = [u.compiled for u in runtime.units if isinstance(u.compiled, WholeSegment)]
    assert len(segment.stores) == 4  # 2 layers, K and V
    if backend == "onnxruntime":
        assert sorted(segment.in_place) == sorted(out for *_, out in segment.stores)
        buffers = {id(b) for b in pipe._resident[1].buffers.values()}
        assert {id(b) for b in segment._bound_outputs} >= buffers  # bound onto the session's own buffers
    else:
        assert segment.in_place == {}
    assert runtime.counters()["replays"] >= 10, runtime.counters()


@pytest.mark.parametrize(("name", "layers"), [("gpt2_eager", 2), ("llama_eager", 2)])
@pytest.mark.parametrize("window", ["switch", "always", "off"])
def test_onnxruntime_attention_reads_only_the_positions_written_so_far(
    name: str, layers: int, window: str, cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSP_RUNTIME_KV_WINDOW (on by default): in ONNX Runtime's decode-step model each layer's K and
    V buffers are sliced to position + rows where the attention reads them (the masks with them)
    while that is under a part of the buffer (half at one thread: an If per layer, the whole buffer
    read in its other branch; ``always``: that part set to all of it, no If), and the logits of every
    step, on either side of the switch, are the reference's. Off: no slice, the whole buffer read."""
    import dsp_onnxruntime.segment as ort_segment
    from onnx import numpy_helper

    from dsp_core.llm import GenerationPipeline
    from dsp_core.plan import subgraph

    monkeypatch.setenv("DSP_RUNTIME_KV_WINDOW", "0" if window == "off" else "1")
    monkeypatch.setenv("DSP_CPU_THREADS", "1")
    if window == "always":
        monkeypatch.setattr(ort_segment, "WINDOW_BELOW_ONE_THREAD", 1.0)
    models: list[Any] = []
    made = subgraph.segment_model

    def keep(*args: Any, **kwargs: Any) -> Any:
        models.append(made(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(subgraph, "segment_model", keep)
    prompt = np.array([[5, 7, 11, 13]], np.int64)
    tokens = [int(t) for t in np.random.default_rng(7).integers(1, 50, 26)]
    logits = {}
    for mode in ("slot_by_slot", "onnxruntime"):
        session = GenerationPipeline(str(FIXTURES / f"{name}.onnx"), max_length=40, mode=mode).session()
        rows = [session.append(prompt)]
        for token in tokens:  # decode steps at positions 4..29 of 40: the switch is at 20
            rows.append(session.append(np.array([[token]], np.int64)))
        logits[mode] = np.stack(rows)
    np.testing.assert_allclose(logits["onnxruntime"], logits["slot_by_slot"], rtol=1e-4, atol=1e-4)
    (decode,) = [m for m in models if any(n.op_type == "TensorScatter" for n in m.graph.node)]
    stores = {n.output[0] for n in decode.graph.node if n.op_type == "TensorScatter"}
    switches = [n for n in decode.graph.node if n.op_type == "If"]

    def cuts(nodes: Any) -> list[Any]:
        return [n for n in nodes if n.op_type == "Slice" and "_w" in n.name]

    assert len(stores) == 2 * layers
    if window == "switch":
        assert len(switches) == layers and cuts(decode.graph.node) == []
        for node in switches:
            branches = {a.name: a.g for a in node.attribute}
            # K (before its transpose) and V (before the product), each read after the store
            assert len(cuts(branches["then_branch"].node)) >= 2 and cuts(branches["else_branch"].node) == []
        assert len({n.input[0] for n in switches}) == 1  # one condition for the step
        produced = {o: n for n in decode.graph.node for o in n.output}
        condition = produced[switches[0].input[0]]
        assert condition.op_type == "Less" and condition.input[0] == cuts(branches["then_branch"].node)[0].input[2]
        assert numpy_helper.to_array(produced[condition.input[1]].attribute[0].t).tolist() == [20]  # half of 40
    elif window == "always":
        assert switches == [] and len(cuts(decode.graph.node)) >= 2 * layers
        assert len({n.input[2] for n in cuts(decode.graph.node)}) == 1  # one end for every store of the step
    else:
        assert switches == [] and cuts(decode.graph.node) == []


def test_a_kv_buffer_is_bound_in_place_only_where_nothing_else_sees_its_old_rows() -> None:
    """``_in_place_stores`` on GPT-2's decode plan: every store's buffer is fed and read only by its
    store, so all four bind in place; a buffer that is also an output of the segment does not."""
    from dsp_core.backends.whole import _in_place_stores, kv_stores, segment_io
    from dsp_core.llm import GenerationPipeline
    from dsp_core.plan.subgraph import SubgraphIO

    pipe = GenerationPipeline(str(FIXTURES / "gpt2_eager.onnx"), mode="slot_by_slot")
    pipe.generate(np.array([[5, 7, 11]], np.int64), 2)
    plan = pipe.decode_model.plan()
    assert plan is not None
    slots = tuple(range(len(plan.slots)))
    io, _ = segment_io(plan, slots)
    stores = kv_stores(plan, slots)
    assert len(stores) == 4
    assert _in_place_stores(plan, slots, stores, io) == {out: buffer for buffer, *_, out in stores}
    first_buffer = stores[0][0]
    shown = SubgraphIO(io.inputs, (*io.outputs, first_buffer))
    assert stores[0][4] not in _in_place_stores(plan, slots, stores, shown)
    assert len(_in_place_stores(plan, slots, stores, shown)) == 3


def test_with_runtime_kv_stores_off_each_store_runs_on_the_reference(
    cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_RUNTIME_KV_STORE", "0")
    want, _, _ = _decode_run("gpt2_eager", "slot_by_slot")
    got, part, _ = _decode_run("gpt2_eager", "onnxruntime")
    assert got == want
    backends = [s.backend for s in part.segments]
    assert backends.count("onnxruntime") == 3 and "slot_by_slot" in backends, backends  # 2 layers: 2 stores each


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_products_are_written_in_the_models_opset(backend: str, cpu_runtimes: None) -> None:
    """A merged product (the core's sibling rewrite, domain dsp) inside an opset-18 segment model:
    its parts are Slices with inputs (opset 10 on). The Split written for the dsp domain's opset 1
    (a ``split`` attribute) was invalid there: ONNX Runtime refused the model and OpenVINO read
    Llama's uneven Q/K/V as three even parts. Named, each runtime now gives the reference's step."""
    from dsp_core.backends.whole import segment_io
    from dsp_core.plan.merge import is_merged
    from dsp_core.plan.subgraph import segment_model

    feeds = _fixture_feeds("llama_eager", 1)
    ref = dsp.compile(FIXTURES / "llama_eager.onnx", mode="slot_by_slot")
    want = ref.run(feeds)
    plan = ref.plan()
    assert plan is not None
    slots = tuple(s for s in range(len(plan.slots)) if is_merged(plan.slots[s]))
    assert slots
    io, embedded = segment_io(plan, slots)
    proto = segment_model(plan, slots, io, {f: ("float32", None) for f in io.inputs}, {})
    assert max(o.version for o in proto.opset_import if o.domain == "") >= 13
    ops = [n.op_type for n in proto.graph.node]
    assert "Split" not in ops and ops.count("Slice") == sum(len(plan.slots[s].outputs) for s in slots), ops
    assert all(len(n.input) == 4 for n in proto.graph.node if n.op_type == "Slice")
    got = dsp.compile(FIXTURES / "llama_eager.onnx", mode=backend).run(feeds)
    for name, w in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(w), rtol=1e-4, atol=1e-4)


def _sealed_graph() -> dsp.Graph:
    """x[2, 8] @ Transpose(w)[8, 16] -> Relu: the transpose reads a constant only (a frozen plan seals it)."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder("sealed")
    x = g.placeholder("x", "float32", [2, 8])
    w = g.constant(rng.standard_normal((16, 8)).astype(np.float32), name="w")
    g.output(g.Relu(g.MatMul(x, g.Transpose(w))), "y")
    return g.build()


def _count_builds(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Every compile of a model by ``name``'s segments, counted (the real compile still runs)."""
    from dsp_onnxruntime.segment import OnnxRuntimeSegment
    from dsp_openvino.segment import OpenVinoSegment

    cls = OpenVinoSegment if name == "openvino" else OnnxRuntimeSegment
    real, builds = cls._build, []

    def counted(self: Any, model: bytes, key: Any) -> Any:
        builds.append(len(model))
        return real(self, model, key)

    monkeypatch.setattr(cls, "_build", counted)
    return builds


@pytest.mark.parametrize("name", BACKENDS)
def test_freezing_finds_the_model_the_eager_runs_compiled(
    name: str, cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager runs compute the slots a frozen plan seals on the reference kernels and compile the
    rest, the model the frozen unit needs: one compile from the first run to the replays, where a
    big model used to be compiled again at freeze (GPT-2 124M's prompt plan: 5 s more on OpenVINO)."""
    builds = _count_builds(monkeypatch, name)
    graph = _sealed_graph()
    model, reference = dsp.compile(graph, mode=name), dsp.compile(graph, mode="slot_by_slot")
    rng = np.random.default_rng(4)
    for _ in range(6):
        x = rng.standard_normal((2, 8)).astype(np.float32)
        np.testing.assert_allclose(model.run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    runtime = model.last_live.runtime  # type: ignore[union-attr]
    assert runtime.phase.name == "REPLAYING" and runtime.sealed, runtime.sealed
    assert len(builds) == 1, builds
    # a second model of the same graph shares the compiled model (its own bindings)
    again = dsp.compile(graph, mode=name)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    for _ in range(4):
        np.testing.assert_allclose(again.run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    assert len(builds) == 1, builds


def test_a_shared_model_is_offered_only_with_equal_sealed_values_and_while_held() -> None:
    import gc

    from dsp_core.backends import whole

    class Model:  # a compiled model stands in as any object a segment holds
        pass

    key = ("test-shared-model",)
    held = Model()
    whole._keep_shared(key, {7: np.arange(4.0)}, held)
    assert whole._find_shared(key, {7: np.arange(4.0)}) is held
    assert whole._find_shared(key, {7: np.arange(4.0) + 1}) is None  # other sealed values: another model
    del held
    gc.collect()
    assert whole._find_shared(key, {7: np.arange(4.0)}) is None and key not in whole._SHARED


_WARM_LLAMA = """
import sys
import numpy as np
sys.path.insert(0, {bench!r})
import cpu_race, dsp_core as dsp
path, feeds = cpu_race.MODELS["llama_decode"][1](8)
want = dsp.compile(path, mode="slot_by_slot").run(feeds)
model = dsp.compile(path, mode={mode!r})
for _ in range(4):
    got = model.run({{k: v for k, v in feeds.items() if k in model.input_names}})
print(max(float(np.max(np.abs(got[k] - want[k]))) for k in want))
"""


@pytest.mark.parametrize("name", BACKENDS)
def test_a_warm_runtime_cache_never_serves_other_outputs_than_a_fresh_compile(name: str, tmp_path: Path) -> None:
    """OpenVINO 2026.4 imported the Llama fixture's decode-step model from its CACHE_DIR into a
    compiled model that computed other outputs (max abs diff 11.8) in every process after the
    first. Each process here is a new one over one DSP cache: the second and third must give
    the reference's outputs too (OpenVINO: the blob fails its probe, the model is compiled
    afresh; ONNX Runtime: its optimized model file, loaded with optimisations off)."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    env = {**os.environ, "DSP_CACHE_DIR": str(tmp_path / "cache"), "DSP_CPU_THREADS": "1"}
    for _ in range(3):
        cmd = [sys.executable, "-c", _WARM_LLAMA.format(bench=bench, mode=name)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert float(done.stdout.split()[-1]) < 1e-4, done.stdout + done.stderr[-2000:]


def test_a_cached_blob_that_fails_its_probe_is_compiled_afresh_and_not_cached_again(
    cpu_runtimes: None, mlp_graph: dsp.Graph, tmp_path: Path
) -> None:
    from dsp_openvino import segment

    model = dsp.compile(mlp_graph, mode="openvino")
    x = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)
    for _ in range(4):
        want = model.run({"x": x})["y"]
    probes = list((tmp_path / "cache").rglob(segment._PROBE))
    assert probes, "no probe digest kept beside the blob"
    for probe in probes:  # as if the blob computed something else than the fresh compile did
        probe.write_text("0" * 32)
    del model  # nothing holds its compiled model: the next plan compiles (from OpenVINO's cache)
    gc.collect()
    again = dsp.compile(mlp_graph, mode="openvino", force_recompile=True)
    for _ in range(4):
        got = again.run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert list((tmp_path / "cache").rglob(segment._NO_CACHE)), "the failing model is not marked"


def test_the_cuda_provider_lists_as_unavailable_here_with_the_reason(mlp_graph: dsp.Graph) -> None:
    """onnxruntime-cuda (the CUDA provider of onnxruntime-gpu) registers everywhere; on a machine
    without CuPy, a CUDA device or onnxruntime-gpu it says which is missing, and ``mode="onnxruntime"``
    runs on the CPU provider."""
    backend = next(b for b in discover().backends if b.name == "onnxruntime-cuda")
    assert backend.platform == "cuda" and backend.mode.name == "ONNXRUNTIME"
    avail = backend.availability()
    if avail.ok:
        pytest.skip("onnxruntime-cuda is available on this machine: tests/gpu/test_onnxruntime_cuda_gpu.py covers it")
    assert "pip install" in avail.reason or "CUDA device" in avail.reason, avail.reason
    model = dsp.compile(mlp_graph, mode="onnxruntime")
    assert model.resolved_backends() == ["onnxruntime"]


def test_the_cuda_backend_takes_what_either_provider_has_and_leaves_kv_stores_out() -> None:
    """A session places a node the CUDA provider lacks on its CPU provider, so the CUDA backend's
    table is both providers' kernels; a KV store (written in place after the call) it declines."""
    from dataclasses import replace

    from dsp_onnxruntime import plugin

    from dsp_core.backends.base import SlotView
    from dsp_core.ops.registry import Trait

    slot = SlotView(0, "Relu", "", Trait(0), {}, ("float32",), ("float32",), opset=17)
    assert plugin._kernel_decline(slot, 17, (plugin.CUDA_PROVIDER, plugin.PROVIDER)) is None
    missing = plugin._kernel_decline(replace(slot, op="NoSuchOp"), 17, (plugin.CUDA_PROVIDER, plugin.PROVIDER))
    assert missing is not None and "CUDA or CPU provider has no NoSuchOp" in missing.detail
    store = replace(slot, op="KVScatter", domain="dsp")
    declined = plugin.OnnxRuntimeCudaBackend()._supports(store)
    assert declined is not None and "KV store" in declined.detail


def test_a_gpu_build_lists_its_kernels_in_a_child_and_a_crash_there_leaves_the_schemas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime-gpu 1.31's get_all_opkernel_def segfaults where TensorRT is not installed (seen on
    the H200): a build with more providers than the CPU's is asked in a child process, and where
    that child dies the ops' schemas stand in (every op, no dtype declined)."""
    import onnxruntime
    from dsp_onnxruntime import plugin

    in_process = plugin._table_from_onnxruntime()
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    assert plugin._table_from_onnxruntime() == in_process  # the child's answer, the same table
    monkeypatch.setattr(plugin, "_KERNELS_AS_JSON", "import os; os.abort()")  # the crash
    table = plugin._table_from_onnxruntime()
    assert table == plugin._schema_table() and table != in_process
    assert (1, 5, frozenset()) in table[("Relu", "")] and ("Attention", "com.microsoft") in table


def test_an_opset_is_raised_only_where_every_op_keeps_its_meaning() -> None:
    """TensorScatter needs opset 24: a segment's opset is raised to it only where each of its ops'
    newer versions only add types, optional inputs or optional attributes."""
    from dsp_core.plan.subgraph import raises_cleanly

    assert raises_cleanly({"Reshape", "Transpose", "Shape", "Add", "Gemm", "Cast"}, 18, 24)
    assert not raises_cleanly({"Split"}, 11, 24)  # Split-13 made ``split`` an input: not the same op
    assert not raises_cleanly({"Reshape", "NoSuchOp"}, 18, 24)


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_onnxruntime_writes_the_kv_stores_as_tensor_scatter_in_place(
    name: str, cpu_runtimes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime's ScatterElements copies the whole buffer even with its output bound onto it;
    its TensorScatter (opset 24) writes only the rows. The decode segment's model is written with
    TensorScatter, one set of position nodes for all stores, and the tokens are the reference's."""
    import onnx
    from dsp_onnxruntime import segment as ort_segment

    built: list[bytes] = []
    real = ort_segment.cached_session

    def keep(model: bytes, alone: bool = False, device: int | None = None, threads: int | None = None) -> Any:
        built.append(model)
        return real(model, alone, device, threads)

    monkeypatch.setattr(ort_segment, "cached_session", keep)
    want, _, want_kv = _decode_run(name, "slot_by_slot")
    got, _, got_kv = _decode_run(name, "onnxruntime")
    assert got == want
    for g, w in zip(got_kv, want_kv):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    decode = [onnx.load_from_string(b) for b in built]
    decode = [m for m in decode if any(n.op_type == "TensorScatter" for n in m.graph.node)]
    assert decode, "no segment model wrote its KV stores as TensorScatter"
    model = decode[-1]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TensorScatter") == 4 and "ScatterElements" not in ops
    # the write positions: made once, for all four stores
    assert len([n for n in model.graph.node if n.op_type == "Expand" and "_kvw" in n.name]) == 1
    assert {o.domain: o.version for o in model.opset_import}[""] == 24
