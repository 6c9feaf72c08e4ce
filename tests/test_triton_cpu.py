"""dsp-triton on a machine without a GPU: it installs, lists as unavailable with its reason, AUTO
falls through; its pure-Python parts (the fusion policy, the code generator, the checked kernel
cache) are right; and, where triton and torch are installed, every generated kernel of every
fixture gives the reference's outputs under Triton's CPU interpreter."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dsp_cpu_ref.plugin import SlotBySlotBackend
from dsp_cuda_graphs import attention
from dsp_triton import codegen
from dsp_triton.cache import TuneCache, read_checked, source_key, write_checked
from dsp_triton.plugin import TritonPolicy

import dsp_core as dsp
from dsp_core.backends.base import Registry
from dsp_core.backends.discovery import discover
from dsp_core.plan.fusion import propose_groups
from dsp_core.runtime.model import CompiledModel
from dsp_core.testing.models import fixed_kv_step

FIXTURES = Path(__file__).parent / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]


@pytest.fixture(autouse=True)
def _decode_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode fusions (DSP_TRITON_DECODE_FUSION, on by default) stay on for these tests even where
    the environment turns them off; test_the_decode_fusions_are_on_by_default checks the default."""
    monkeypatch.setenv("DSP_TRITON_DECODE_FUSION", "1")


def _gpu_missing() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() < 1
    except Exception:  # noqa: BLE001
        return True


# -- discovery ---------------------------------------------------------------------------
def test_registered_through_its_entry_point() -> None:
    backend = next(b for b in discover().backends if b.name == "triton")
    assert backend.distribution == "dsp-triton"
    assert backend.mode is dsp.GraphExecutionMode.TRITON
    assert backend.platform == "cuda" and backend.captures
    assert backend.contract.needs_stable_addresses and backend.contract.deterministic
    assert isinstance(backend.fusion_policy(), TritonPolicy)


@pytest.mark.skipif(not _gpu_missing(), reason="checks the CPU-only behaviour")
def test_unavailable_with_a_reason_and_auto_falls_through() -> None:
    backend = next(b for b in discover().backends if b.name == "triton")
    avail = backend.availability()
    assert not avail.ok and avail.reason
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx")
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    model.run({n: golden[f"step0.{n}"] for n in model.input_names})
    assert "triton" not in model.resolved_backends()


def test_backends_list_shows_it_with_its_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", "backends", "list"], capture_output=True, text=True, check=True
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("triton "))
    assert "TRITON" in line and "dsp-triton" in line
    if _gpu_missing():
        assert " no: " in line


# -- the policy ---------------------------------------------------------------------------
class TritonGroupedSlotBySlot(SlotBySlotBackend):
    """The reference backend grouping with dsp-triton's policy: runs each group node by node."""

    def fusion_policy(self) -> TritonPolicy:
        return TritonPolicy()


@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_policy_fuses_the_fixtures_and_the_grouped_reference_is_bit_equal(name: str) -> None:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    plain = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    grouped = CompiledModel(
        plain.graph, dsp.GraphExecutionMode.SLOT_BY_SLOT, registry=Registry(backends=[TritonGroupedSlotBySlot()])
    )
    prefix = "" if name == "cnn" else "step1."
    feeds = {n: golden[prefix + n] for n in plain.input_names}
    for _ in range(3):
        want, got = plain.run(feeds), grouped.run(feeds)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    plan, part = plain.plan(), plain.partition()
    assert plan is not None and part is not None
    slots = [s for seg in part.segments for s in seg.slots]
    triton = propose_groups(plan, slots, TritonPolicy())
    if name != "cnn":
        assert triton.kernels < len(slots) * 0.6, (triton.kernels, len(slots))
        # a norm or softmax with its prologue, or (GPT-2: the scale and mask) a product's epilogue
        assert any(g.template in ("row_reduction", "product") and len(g.slots) > 1 for g in triton.groups)


def test_rows_longer_than_the_template_group_as_rows_only_where_dsp_nvrtc_takes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A softmax over rows the row template cannot hold is an opaque slot of its own without
    dsp-nvrtc; with it available, a row-reduction group with its prologue, which the generator
    declines and dsp-nvrtc's row kernel takes (AUTO's chain per group)."""
    from dsp_triton import kernels

    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [2, codegen.MAX_ROW + 7])
    g.output(g.Softmax(x * g.constant(np.array(0.5, np.float32)), axis=-1), "p")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    model.run({"x": np.ones((2, codegen.MAX_ROW + 7), np.float32)})
    plan = model.plan()
    assert plan is not None
    softmax = next(s for s in range(len(plan.slots)) if plan.slots[s].op == "Softmax")

    def template_of_softmax() -> str:
        groups = propose_groups(plan, range(len(plan.slots)), TritonPolicy()).groups
        return next(g.template for g in groups if softmax in g.slots)

    monkeypatch.setattr(kernels, "nvrtc_backend", lambda: None)
    assert template_of_softmax() == "opaque"
    monkeypatch.setattr(kernels, "nvrtc_backend", lambda: object())
    assert template_of_softmax() == "row_reduction"


def test_policy_keeps_ops_it_cannot_generate_alone() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [4, 8])
    y = g.Relu(g.Mod(g.Exp(x), x, fmod=1))
    g.output(g.Sigmoid(y), "y")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    model.run({"x": np.ones((4, 8), np.float32)})
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    mod = next(s for s in range(len(plan.slots)) if plan.slots[s].op == "Mod")
    assert any(g.slots == (mod,) for g in result.groups)
    assert any("no Triton template" in b.reason for b in result.boundaries)


# -- the generator ------------------------------------------------------------------------
def _spec(
    template: str,
    nodes: list[codegen.NodeSpec],
    values: dict[int, tuple[tuple[int, ...], str]],
    inputs,
    outputs,
    constants=None,
):
    specs = {
        v: codegen.TensorSpec(shape, dtype, tuple(codegen.row_major(shape)) if v in inputs else None)
        for v, (shape, dtype) in values.items()
    }
    return codegen.GroupSpec(template, nodes, specs, list(inputs), list(outputs), constants or (lambda v: None))


def test_generates_the_exported_rms_norm_as_one_row_kernel() -> None:
    n = codegen.NodeSpec
    nodes = [
        n("Cast", (1,), (2,), {"to": 1}),
        n("Pow", (2, 3), (4,)),
        n("ReduceMean", (4, 5), (6,), {"keepdims": 1}),
        n("Add", (6, 7), (8,)),
        n("Sqrt", (8,), (9,)),
        n("Reciprocal", (9,), (10,)),
        n("Mul", (2, 10), (11,)),
        n("Cast", (11,), (12,), {"to": 10}),
        n("Mul", (13, 12), (14,)),
    ]
    values = {
        1: ((1, 1, 576), "float16"),
        2: ((1, 1, 576), "float32"),
        3: ((), "float32"),
        4: ((1, 1, 576), "float32"),
        5: ((1,), "int64"),
        6: ((1, 1, 1), "float32"),
        7: ((), "float32"),
        8: ((1, 1, 1), "float32"),
        9: ((1, 1, 1), "float32"),
        10: ((1, 1, 1), "float32"),
        11: ((1, 1, 576), "float32"),
        12: ((1, 1, 576), "float16"),
        13: ((576,), "float16"),
        14: ((1, 1, 576), "float16"),
    }
    consts = {3: np.array(2.0, np.float32), 5: np.array([-1]), 7: np.array(1e-5, np.float32)}
    spec = _spec("row_reduction", nodes, values, [1, 3, 7, 13], [14], consts.get)
    kernel = codegen.generate(spec)
    ast.parse(kernel.source)
    assert kernel.grid == (1, 1, 1) and kernel.block == 1024
    assert kernel.source.count("tl.sum(") == 1
    assert "libdevice.pow" not in kernel.source  # x ** 2 is a product
    # the exponent and epsilon are literals, not arguments
    assert set(kernel.args[: kernel.n_inputs]) == {1, 13} and kernel.args[kernel.n_inputs :] == (14,)


def test_generates_gather_slice_concat_as_index_arithmetic() -> None:
    n = codegen.NodeSpec
    nodes = [
        n("Gather", (1, 2), (3,), {"axis": 0}),  # [1, 5] ids into a [100, 16] table -> [1, 5, 16]
        n("Slice", (3, 4, 5, 6), (7,)),  # the last 8 of the 16
        n("Neg", (7,), (8,)),
        n("Slice", (3, 9, 4, 6), (10,)),  # the first 8
        n("Concat", (8, 10), (11,), {"axis": -1}),
    ]
    values = {
        1: ((100, 16), "float32"),
        2: ((1, 5), "int64"),
        3: ((1, 5, 16), "float32"),
        4: ((1,), "int64"),
        5: ((1,), "int64"),
        6: ((1,), "int64"),
        7: ((1, 5, 8), "float32"),
        8: ((1, 5, 8), "float32"),
        9: ((1,), "int64"),
        10: ((1, 5, 8), "float32"),
        11: ((1, 5, 16), "float32"),
    }
    consts = {4: np.array([8]), 5: np.array([16]), 6: np.array([-1]), 9: np.array([0])}
    spec = _spec("copy", nodes, values, [1, 2, 4, 5, 6, 9], [11], consts.get)
    kernel = codegen.generate(spec)
    ast.parse(kernel.source)
    assert set(kernel.args[: kernel.n_inputs]) == {2, 1}  # ids, table: the slice bounds are literals
    assert kernel.source.count("tl.load(") == 3  # the ids once, the table at two indexes


@pytest.mark.parametrize(
    ("op", "dtype", "why"),
    [("Div", "int64", "integer Div"), ("Mod", "float32", "Mod"), ("Hardmax", "float32", "no template")],
)
def test_unsupported_groups_say_why(op: str, dtype: str, why: str) -> None:
    n = codegen.NodeSpec
    spec = _spec(
        "pointwise",
        [n(op, (1, 2), (3,)), n("Neg", (3,), (4,))],
        {1: ((4,), dtype), 2: ((4,), dtype), 3: ((4,), dtype), 4: ((4,), dtype)},
        [1, 2],
        [4],
    )
    with pytest.raises(codegen.Unsupported, match=why):
        codegen.generate(spec)


def test_rows_past_the_template_limit_are_declined() -> None:
    n = codegen.NodeSpec
    big = codegen.MAX_ROW * 2
    spec = _spec(
        "row_reduction",
        [n("Softmax", (1,), (2,), {"axis": -1})],
        {1: ((1, big), "float32"), 2: ((1, big), "float32")},
        [1],
        [2],
    )
    with pytest.raises(codegen.Unsupported, match="row of"):
        codegen.generate(spec)


def test_a_slice_bound_that_changes_per_step_is_declined() -> None:
    n = codegen.NodeSpec
    nodes = [n("Slice", (1, 2, 3), (4,)), n("Neg", (4,), (5,))]
    values = {1: ((8,), "float32"), 2: ((1,), "int64"), 3: ((1,), "int64"), 4: ((4,), "float32"), 5: ((4,), "float32")}
    spec = _spec("copy", nodes, values, [1, 2, 3], [5])
    with pytest.raises(codegen.Unsupported, match="not a constant"):
        codegen.generate(spec)


def test_identical_groups_share_one_kernel_name() -> None:
    n = codegen.NodeSpec
    a = _spec(
        "pointwise",
        [n("Add", (1, 2), (3,)), n("Relu", (3,), (4,))],
        {1: ((8,), "float32"), 2: ((8,), "float32"), 3: ((8,), "float32"), 4: ((8,), "float32")},
        [1, 2],
        [4],
    )
    b = _spec(
        "pointwise",
        [n("Add", (11, 12), (13,)), n("Relu", (13,), (14,))],
        {11: ((8,), "float32"), 12: ((8,), "float32"), 13: ((8,), "float32"), 14: ((8,), "float32")},
        [11, 12],
        [14],
    )
    assert codegen.generate(a).source == codegen.generate(b).source


# -- the kernel cache ---------------------------------------------------------------------
def test_checked_files_round_trip_and_damage_is_never_read(tmp_path: Path) -> None:
    path = tmp_path / "k" / "kernel.cubin"
    write_checked(path, b"\x7fELF binary")
    assert read_checked(path) == b"\x7fELF binary"
    path.write_bytes(b"\x7fELF binar")  # truncated
    assert read_checked(path) is None
    assert not path.exists(), "a damaged entry is removed, so the next compile rewrites it"
    write_checked(path, b"x")
    (path.parent / (path.name + ".b2")).unlink()  # a writer that died before the digest
    assert read_checked(path) is None
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_tune_cache_keeps_winners_per_source_and_device(tmp_path: Path) -> None:
    tunes = TuneCache(tmp_path)
    key = source_key("def k(): pass", "H200:sm90", "3.6.0")
    assert tunes.get(key) is None
    tunes.put(key, {"block": 512})
    assert TuneCache(tmp_path).get(key) == {"block": 512}
    assert source_key("def k(): pass", "H100:sm90", "3.6.0") != key
    (tmp_path / "tune" / f"{key}.json").write_text(json.dumps({"block": 64}))  # edited behind the digest
    assert TuneCache(tmp_path).get(key) is None


# -- the generated kernels under Triton's interpreter (needs triton + a CPU torch) ---------
def _interpreter_missing() -> str | None:
    for mod in ("triton", "torch"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install triton torch: the CPU wheels suffice)"
    return None


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_every_generated_kernel_matches_the_reference_under_the_interpreter(name: str) -> None:
    script = (
        "import json, sys, numpy as np; sys.path.insert(0, sys.argv[1])\n"
        "import interpret_check as ic; import dsp_core\n"
        "name = sys.argv[2]; z = np.load(f'{sys.argv[3]}/{name}.golden.npz'); p = '' if name == 'cnn' else 'step1.'\n"
        "m = dsp_core.compile(f'{sys.argv[3]}/{name}.onnx', mode='slot_by_slot')\n"
        "feeds = {n: z[p + n] for n in m.input_names}\n"
        "print(json.dumps([r.__dict__ for r in ic.check_model(m, feeds)]))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent / "triton_interp"), name, str(FIXTURES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [r for r in results if r["status"] not in ("ok", "unsupported")]
    assert not bad, bad[:3]
    assert sum(r["status"] == "ok" for r in results) >= 1


def test_an_empty_output_is_left_to_the_reference_kernels() -> None:
    n = codegen.NodeSpec
    spec = _spec(
        "pointwise",
        [n("Neg", (1,), (2,)), n("Relu", (2,), (3,))],
        {1: ((1, 4, 0, 16), "float32"), 2: ((1, 4, 0, 16), "float32"), 3: ((1, 4, 0, 16), "float32")},
        [1],
        [3],
    )
    with pytest.raises(codegen.Unsupported, match="empty"):
        codegen.generate(spec)


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_every_product_body_and_config_matches_numpy_under_the_interpreter() -> None:
    script = Path(__file__).parent / "triton_interp" / "product_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [r for r in results if r["status"] != "ok"]
    assert not bad, bad[:3]
    assert {r["body"] for r in results} == {"nk", "kn", "dot"}


# -- the skinny-product template (T3): grouping and declines, pure Python -------------------
def _product_spec(a: tuple[int, ...], b: tuple[int, ...], dtype: str = "float16", op: str = "MatMul", **attrs):
    n = codegen.NodeSpec
    out = (*a[:-1], b[-1]) if op == "MatMul" else (a[0], b[-1])
    return _spec("product", [n(op, (1, 2), (3,), attrs)], {1: (a, dtype), 2: (b, dtype), 3: (out, dtype)}, [1, 2], [3])


def test_product_shape_picks_the_body_from_rows_and_the_weight_layout() -> None:
    assert codegen.product_shape(_product_spec((1, 1, 64), (64, 32))).body == "kn"
    spec = _product_spec((1, 1, 64), (64, 32))
    spec.values[2] = codegen.TensorSpec((64, 32), "float16", (1, 64))  # a [N, K] buffer seen as [K, N]
    assert codegen.product_shape(spec).body == "nk"
    assert codegen.product_shape(_product_spec((1, 7, 64), (64, 32))).body == "dot"
    got = codegen.product_shape(_product_spec((2, 32, 1, 64), (2, 32, 64, 300)))
    assert (got.batch, got.m, got.k, got.n) == ((2, 32), 1, 64, 300)


@pytest.mark.parametrize(
    "spec, why",
    [
        (lambda: _product_spec((1, 17, 64), (64, 32)), "17 rows"),
        (lambda: _product_spec((1, 1, 64), (64, 1)), "one column"),
        (lambda: _product_spec((1, 3, 64), (64, 8), dtype="float64"), "float64"),
        (lambda: _product_spec((3, 1, 0), (0, 8)), "empty"),
    ],
)
def test_products_the_template_does_not_take_say_why(spec, why: str) -> None:
    with pytest.raises(codegen.Unsupported, match=why):
        kernel = codegen.generate(spec())
        print(kernel.source)


def test_a_product_kernel_streams_k_in_a_loop_and_fuses_its_epilogue() -> None:
    n = codegen.NodeSpec
    spec = _spec(
        "product",
        [n("MatMul", (1, 2), (3,)), n("Add", (3, 4), (5,)), n("Relu", (5,), (6,))],
        {
            1: ((1, 1, 512), "float16"),
            2: ((512, 256), "float16"),
            3: ((1, 1, 256), "float16"),
            4: ((256,), "float16"),
            5: ((1, 1, 256), "float16"),
            6: ((1, 1, 256), "float16"),
        },
        [1, 2, 4],
        [6],
    )
    kernel = codegen.generate(spec)
    assert kernel.template == "product" and kernel.name.startswith("dsp_mm_")
    assert "for k0 in range(0, 512," in kernel.source and "tl.sum(" in kernel.source
    assert kernel.source.count("tl.store(") == 1  # the product itself is never written: only the Relu
    assert kernel.args == (1, 2, 4, 6) and kernel.grid[0] == 256 // kernel.block
    configs = codegen.product_configs(codegen.product_shape(spec))
    assert len(configs) >= 4 and all(codegen.generate(spec, config=c).source for c in configs)


@pytest.mark.parametrize("merge", ["0", "1"])
def test_the_policy_takes_decode_products_with_their_epilogues(merge: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_MERGE_PRODUCTS", merge)
    m = dsp.compile(FIXTURES / "llama_eager.onnx", mode="slot_by_slot")
    z = np.load(FIXTURES / "llama_eager.golden.npz")
    m.run({k: z["step1." + k] for k in m.input_names})
    plan, part = m.plan(), m.partition()
    groups = [g for seg in part.segments for g in propose_groups(plan, seg.slots, TritonPolicy()).groups]
    products = [g for g in groups if g.template == "product"]
    assert products and not [g for g in groups if g.template == "matmul"]
    ops = [[plan.slots[s].op for s in g.slots] for g in products]
    assert any(o[0] == "MatMul" and "Add" in o for o in ops)  # a projection + its residual
    norm = ["Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul", "Mul"]  # the exported RMSNorm: the prologue
    if merge == "0":
        assert ["MatMul", "Sigmoid", "Mul"] in ops  # gate projection + SiLU
    else:  # Q/K/V and gate/up merged (docs/merge.md): one product group each over the joined weights
        assert ops.count([*norm, "MergedMatMul"]) == 2  # Q/K/V: the norm before, no epilogue
        assert ops.count([*norm, "MergedMatMul", "Sigmoid", "Mul", "Mul"]) == 2  # gate/up with SiLU(gate) x up
        merged = [g for g in products if "MergedMatMul" in [plan.slots[s].op for s in g.slots]]
        assert [g.kernels for g in merged] == [1, 1, 1, 1]


def test_products_stay_on_cublas_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_TRITON_PRODUCTS", "0")
    m = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="slot_by_slot")
    z = np.load(FIXTURES / "gpt2_eager.golden.npz")
    m.run({k: z["step1." + k] for k in m.input_names})
    plan, part = m.plan(), m.partition()
    templates = {g.template for seg in part.segments for g in propose_groups(plan, seg.slots, TritonPolicy()).groups}
    assert "matmul" in templates and "product" not in templates


# -- decode attention (T4) ---------------------------------------------------------------------
def _decode_groups(name: str, monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[object, list]:
    m = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    z = np.load(FIXTURES / f"{name}.golden.npz")
    m.run({k: z["step1." + k] for k in m.input_names})
    plan, part = m.plan(), m.partition()
    return plan, [g for seg in part.segments for g in propose_groups(plan, seg.slots, TritonPolicy()).groups]


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_exported_attention_is_one_decode_attention_group(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_TRITON_ATTENTION", "1")
    plan, groups = _decode_groups(name)
    attention = [g for g in groups if g.template == "decode_attention"]
    assert len(attention) == 2  # one per layer of the 2-layer fixtures
    for g in attention:
        ops = [plan.slots[s].op for s in g.slots]
        assert ops.count("MatMul") == 2 and ops.count("Softmax") == 1
    assert not [g for g in groups if g.template == "row_reduction" and plan.slots[g.slots[0]].op == "Softmax"]


def test_attention_is_one_group_by_default_and_three_kernels_when_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On by default since the H200 measured it faster in decode (benchmarks/results/gpu_2026-12-02f)."""
    monkeypatch.delenv("DSP_TRITON_ATTENTION", raising=False)
    _, groups = _decode_groups("llama_eager")
    assert len([g for g in groups if g.template == "decode_attention"]) == 2
    monkeypatch.setenv("DSP_TRITON_ATTENTION", "0")
    _, groups = _decode_groups("llama_eager")
    assert not [g for g in groups if g.template == "decode_attention"]


def _softmax_graph(weight_constant: bool, axis: int = -1, scores_out: bool = False):
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [1, 4, 1, 16])
    w = g.constant(rng.standard_normal((16, 32)).astype(np.float32)) if weight_constant else None
    k = g.placeholder("k", "float32", [1, 4, 16, 32])
    scores = g.MatMul(x, w if weight_constant else k)
    probs = g.Softmax(scores, axis=axis)
    v = g.placeholder("v", "float32", [1, 4, 32, 8])
    g.output(g.MatMul(probs, v), "y")
    if scores_out:
        g.output(scores, "scores")
    return g.build()


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"weight_constant": True}, "a classifier head (constant weights) is not attention"),
        ({"weight_constant": False, "axis": 1}, "a softmax over another axis"),
        ({"weight_constant": False, "scores_out": True}, "scores read outside"),
    ],
)
def test_what_is_not_decode_attention(kw, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnx

    monkeypatch.setenv("DSP_TRITON_ATTENTION", "1")

    from dsp_core.ir.onnx_export import to_onnx

    path = tmp_path / "m.onnx"
    onnx.save(to_onnx(_softmax_graph(**kw)), str(path))
    m = dsp.compile(path, mode="slot_by_slot")
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((1, 4, 1, 16)).astype(np.float32),
        "k": rng.standard_normal((1, 4, 16, 32)).astype(np.float32),
        "v": rng.standard_normal((1, 4, 32, 8)).astype(np.float32),
    }
    m.run({n: feeds[n] for n in m.input_names})
    plan, part = m.plan(), m.partition()
    groups = [g for seg in part.segments for g in propose_groups(plan, seg.slots, TritonPolicy()).groups]
    assert not [g for g in groups if g.template == "decode_attention"], why


def _attention_group(rows: int = 1, relu: bool = False) -> tuple[list, dict]:
    """A 4-head attention over 300 KV positions (K transposed in the group), optionally a Relu after."""
    n = codegen.NodeSpec
    nodes = [
        n("Transpose", (2,), (3,), {"perm": [0, 1, 3, 2]}),
        n("MatMul", (1, 3), (4,)),
        n("Softmax", (4,), (5,), {"axis": -1}, opset=13),
        n("MatMul", (5, 6), (7,)),
    ]
    shapes = {
        1: ((1, 4, rows, 16), "float16"),
        2: ((1, 4, 300, 16), "float16"),
        3: ((1, 4, 16, 300), "float16"),
        4: ((1, 4, rows, 300), "float16"),
        5: ((1, 4, rows, 300), "float16"),
        6: ((1, 4, 300, 16), "float16"),
        7: ((1, 4, rows, 16), "float16"),
    }
    if relu:
        nodes.append(n("Relu", (7,), (8,)))
        shapes[8] = ((1, 4, rows, 16), "float16")
    return nodes, shapes


def test_attention_generates_one_online_softmax_kernel_and_splits_for_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, shapes = _attention_group()
    spec = _spec("decode_attention", nodes, shapes, [1, 2, 6], [7])
    kernel = codegen.generate(spec)
    assert kernel.name.startswith("dsp_attn_") and kernel.grid == (4, 1, 1)
    assert "for l0 in range(0, 300," in kernel.source and "att_alpha" in kernel.source
    assert kernel.source.count("tl.store(") == 1  # scores and probabilities never leave the kernel
    spec7 = _spec("decode_attention", *_attention_group(rows=7), [1, 2, 6], [7])
    flash = codegen.generate(spec7)  # 7 query rows: the flash body, a block of rows a program
    assert flash.source.count("tl.dot(") == 2 and "att_acc / att_l[:, None]" in flash.source
    monkeypatch.setenv("DSP_TRITON_FLASH_ATTENTION", "0")
    with pytest.raises(codegen.Unsupported, match="query rows"):
        codegen.generate(spec7)
    parts = codegen.attention_parts(spec7)
    assert [p.template for p, _ in parts] == ["product", "row_reduction", "product"]
    assert [idxs for _, idxs in parts] == [[0, 1], [2], [3]]
    assert all(codegen.generate(p).source for p, _ in parts)


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
@pytest.mark.parametrize("splits", ["1", "4", "16"])
def test_decode_attention_matches_the_reference_under_the_interpreter(splits: str) -> None:
    """GQA ratios 1, 3, 4; valid lengths 1, 255, 257, L-1, L; one program per head, or KV split and combined."""
    script = Path(__file__).parent / "triton_interp" / "attention_graphs.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "DSP_TRITON_ATTENTION": "1", "DSP_TRITON_KV_SPLITS": splits}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [r for r in results if r["status"] != "ok"]
    assert sum(r["template"] == "decode_attention" for r in results) == 5


def test_a_split_attention_is_partials_then_one_combine() -> None:
    assert attention.kv_split_count(12, 288, 132) == 4  # GPT-2 124M at batch 1: 12 heads, about 64 positions each
    assert attention.kv_split_count(32, 1024, 132) == 16
    assert attention.kv_split_count(32, 4096, 132) == 64  # at most 64 a head
    assert attention.kv_split_count(12, 4096, 132) == 64
    assert attention.kv_split_count(256, 4096, 132) == 8  # batch 8 x 32 heads: 16 x 132 programs at most
    assert attention.kv_split_count(4096, 4096, 132) == 1  # the heads alone fill the GPU many times over
    assert attention.kv_split_count(12, 256, 132) == 1  # one program per head up to 256 positions
    assert attention.kv_split_count(12, 60, 132) == 1
    assert attention.kv_split_count(4096, 4096, None) == 64  # no device known: no cap from its SMs
    assert attention.kv_split_count(12, 4096, 132, forced=3) == 3
    assert attention.kv_split_count(12, 2, 132, forced=8) == 2
    spec = _spec("decode_attention", *_attention_group(relu=True), [1, 2, 6], [8])
    partial, combine = codegen.attention_split_specs(spec, 4)
    first, second = codegen.generate(partial), codegen.generate(combine)
    assert first.grid == (16, 1, 1) and first.name.startswith("dsp_attn_")
    assert second.grid == (4, 1, 1) and second.name.startswith("dsp_attn_combine_")
    assert "tl.maximum(" in second.source and second.source.count("tl.store(") == 1  # the Relu'd output
    assert second.args[-1] == 8


@pytest.mark.parametrize(("length", "forced", "kernels"), [(96, "0", 1), (256, "0", 1), (300, "0", 2), (300, "1", 1)])
def test_dsp_plan_fuse_counts_a_split_attention_as_two_kernels(
    length: int, forced: str, kernels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 256 KV positions decode attention is partials and their combine (DSP_TRITON_KV_SPLITS=1: one)."""
    sys.path.insert(0, str(Path(__file__).parent / "triton_interp"))
    import attention_graphs as ag

    monkeypatch.setenv("DSP_TRITON_KV_SPLITS", forced)
    model = ag.model(6, 2, length, 16, "slot_by_slot")
    model.run(ag.feeds(6, 2, length, length - 1, 16))
    plan, part = model.plan(), model.partition()
    assert plan is not None and part is not None
    groups = [g for seg in part.segments for g in propose_groups(plan, seg.slots, TritonPolicy()).groups]
    assert [g.kernels for g in groups if g.template == "decode_attention"] == [kernels]


# -- fewer kernels per decode layer: the norm as the product's prologue, the KV store as an epilogue,
# -- rotary as one kernel ----------------------------------------------------------------------
def _interpreted(body: str, *args: str) -> list[dict]:
    """Run ``body`` under Triton's interpreter in a subprocess (``ic``: interpret_check, ``t``: this module,
    ``args``: ``sys.argv[3:]``); the check results it prints as its last line, as JSON."""
    here = Path(__file__).parent
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
        "import interpret_check as ic, dsp_core, test_triton_cpu as t\n" + body
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(here / "triton_interp"), str(here), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _layer_kernels(report: dict) -> list[int]:
    """Kernels per layer of a decode plan: from a layer's first norm+product to the next layer's.

    Each layer holds two norm-prologue products (attention's Q/K/V and the MLP's first) and
    the LM head is the last one; a layer is the groups from its first to the next's first.
    """
    groups = report["groups"]
    norms = ("ReduceMean", "LayerNormalization", "RMSNormalization")
    products = ("MatMul", "Gemm", "MergedMatMul")
    starts = [
        k
        for k, g in enumerate(groups)
        if any(op in norms for op in g["ops"]) and any(op in products for op in g["ops"])
    ]
    assert len(starts) % 2 == 1, starts  # two per layer, then the LM head
    return [sum(g["kernels"] for g in groups[starts[i] : starts[i + 2]]) for i in range(0, len(starts) - 1, 2)]


@pytest.mark.parametrize(
    "name, layers, total, alone",
    [
        # totals: 2 fewer since GatherND (the exported mask's row pick) joins its neighbours' kernel;
        # 4 fewer on the eager exports since decode attention is one kernel by default (two with a
        # split: these fixtures' few KV positions take none)
        ("llama_eager", [8, 7], 21, 0),  # the first layer also computes the rotary tables (cos)
        ("llama_sdpa23", [8, 8], 21, 2),  # K's store follows the opset-23 RotaryEmbedding, which runs alone
        ("gpt2_eager", [6, 6], 16, 0),
        ("gpt2_sdpa23", [6, 6], 16, 0),  # attention is the one opset-23 Attention op
    ],
)
def test_decode_plans_take_at_most_10_kernels_per_layer(name: str, layers: list[int], total: int, alone: int) -> None:
    """`dsp plan fuse --decode --backend triton`: the kernels of each layer, counted.

    Before the norm prologue, the KV stores as epilogues and one rotary kernel per q and k:
    14 per layer on llama_eager (38 per step), 10 on gpt2_eager (29 per step).
    """
    from dsp_core.cli import fuse_report

    report = fuse_report(str(FIXTURES / f"{name}.onnx"), backend="triton", decode=True)
    assert _layer_kernels(report) == layers and layers[-1] <= 10
    assert report["kernels"] == total, report["templates"]
    ops = [g["ops"] for g in report["groups"]]
    stores = [o for o in ops if "KVScatter" in o]
    assert sum(o == ["KVScatter"] for o in stores) == alone  # else the last store of the kernel computing its row
    if name.startswith("llama"):  # V: stored by the Q/K/V product kernel, through its reshape and transpose
        qkv = [o for o in ops if "MergedMatMul" in o and "KVScatter" in o]
        assert len(qkv) == 2 and all(o[-3:] == ["Reshape", "Transpose", "KVScatter"] for o in qkv), qkv
    if name == "llama_eager":
        rotary = [o for o in ops if "Neg" in o]
        assert len(rotary) == 4 and sum("KVScatter" in o for o in rotary) == 2  # K's rotary stores K
        assert all(o.count("Mul") == 2 and o[-1] in ("Add", "KVScatter") for o in rotary[2:])  # x*cos + rot*sin
    if name.startswith("gpt2"):
        assert len(stores) == 2 and all(o.count("KVScatter") == 2 for o in stores)  # K and V: one kernel


@pytest.mark.parametrize(("name", "total"), [("llama_eager", 32), ("gpt2_eager", 24)])
def test_the_decode_fusions_are_on_by_default(name: str, total: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default (checked on the H200); DSP_TRITON_DECODE_FUSION=0 gives the grouping without them:
    norms, KV stores and rotary halves as kernels of their own."""
    from dsp_core.cli import fuse_report

    monkeypatch.setenv("DSP_TRITON_DECODE_FUSION", "0")
    report = fuse_report(str(FIXTURES / f"{name}.onnx"), backend="triton", decode=True)
    assert report["kernels"] == total, report["templates"]
    stores = [g["ops"] for g in report["groups"] if "KVScatter" in g["ops"]]
    assert stores and all(o == ["KVScatter"] for o in stores), stores
    monkeypatch.delenv("DSP_TRITON_DECODE_FUSION")
    assert fuse_report(str(FIXTURES / f"{name}.onnx"), backend="triton", decode=True)["kernels"] < total


@pytest.mark.parametrize("name", DECODERS)
def test_the_grouped_reference_runs_the_decode_plan_bit_equal(name: str) -> None:
    """Stores inside groups move in the schedule: the grouped run must still write the same buffers."""
    runs = []
    for grouped in (False, True):
        graph, feeds = fixed_kv_step(FIXTURES / f"{name}.onnx")
        model = dsp.compile(graph, mode="slot_by_slot")
        if grouped:
            model = CompiledModel(
                graph,
                dsp.GraphExecutionMode.SLOT_BY_SLOT,
                registry=Registry(backends=[TritonGroupedSlotBySlot()]),
            )
        outs = model.run(feeds)
        runs.append((outs, {k: v for k, v in feeds.items() if k.startswith("past_key_values")}))
    (want, want_kv), (got, got_kv) = runs
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    for key in want_kv:
        np.testing.assert_array_equal(got_kv[key], want_kv[key], err_msg=f"{name} {key}")


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
@pytest.mark.parametrize("name", DECODERS)
def test_every_kernel_of_the_decode_plans_matches_the_reference_under_the_interpreter(name: str) -> None:
    results = _interpreted(
        "m, feeds = ic.decode_model(sys.argv[3])\nprint(json.dumps([r.__dict__ for r in ic.check_model(m, feeds)]))\n",
        str(FIXTURES / f"{name}.onnx"),
    )
    bad = [r for r in results if r["status"] not in ("ok", "unsupported")]
    assert not bad, bad[:3]
    fused = [r for r in results if r["status"] == "ok"]
    assert any("KVScatter" in r["ops"] for r in fused)  # the KV stores ran as part of a kernel
    assert any(
        r["template"] == "product" and set(r["ops"]) & {"ReduceMean", "LayerNormalization", "RMSNormalization"}
        for r in fused
    )


def _norm_graph(extra_reader: bool) -> object:
    g = dsp.GraphBuilder("norm_product")
    x = g.placeholder("x", "float32", [1, 1, 64])
    rng = np.random.default_rng(1)
    gamma = g.constant(rng.standard_normal(64).astype(np.float32))
    beta = g.constant(rng.standard_normal(64).astype(np.float32))
    w = g.constant(rng.standard_normal((64, 48)).astype(np.float32))
    normed = g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)
    g.output(g.MatMul(normed, w), "y")
    if extra_reader:
        g.output(g.Relu(normed), "r")  # something else reads the normed rows
    return g.build()


@pytest.mark.parametrize("extra_reader", [False, True])
def test_a_norm_is_the_product_prologue_only_when_the_product_alone_reads_it(extra_reader: bool) -> None:
    model = dsp.compile(_norm_graph(extra_reader), mode="slot_by_slot")
    model.run({"x": np.ones((1, 1, 64), np.float32)})
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    norm = next(s.index for s in plan.slots if s.op == "LayerNormalization")
    group = next(g for g in result.groups if norm in g.slots)
    ops = [plan.slots[s].op for s in group.slots]
    if extra_reader:  # the norm (and the Relu reading it) stays one row kernel that stores the rows
        assert group.template == "row_reduction" and "MatMul" not in ops
        assert any("read outside the norm and the product" in b.reason for b in result.boundaries)
    else:
        assert group.template == "product" and ops == ["LayerNormalization", "MatMul", "Identity"]
        assert group.kernels == 1


def _interleaved_rotary_graph() -> object:
    """Rotary in the interleaved form (GPT-J's rotate_every_two), cos and sin from the position id.

    ``rot[2i] = -x[2i+1]``, ``rot[2i+1] = x[2i]``: strided slices, a Neg, a Concat of the two
    on a new last axis and a Reshape that interleaves them; ``y = x * cos + rot * sin`` with
    cos/sin repeated per pair.
    """
    g = dsp.GraphBuilder("rotary_interleaved")
    heads, dim = 4, 16
    x = g.placeholder("x", "float32", [1, heads, 1, dim])
    pos = g.placeholder("pos", "int64", [1, 1])
    inv = 1.0 / (10000 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    freqs = g.Mul(g.Unsqueeze(g.Cast(pos, to=1), g.constant(np.array([-1], np.int64))), g.constant(inv))  # [1,1,D/2]
    pair = g.constant(np.array([1, 1, 1, dim], np.int64))

    def repeated(t: object) -> object:  # [1, 1, D/2] -> [1, 1, 1, D], each value twice in a row
        t2 = g.Unsqueeze(t, g.constant(np.array([-1], np.int64)))
        return g.Reshape(g.Concat(t2, t2, axis=-1), pair)

    cos, sin = repeated(g.Cos(freqs)), repeated(g.Sin(freqs))

    def strided(start: int) -> object:
        c = g.constant
        return g.Slice(
            x,
            c(np.array([start], np.int64)),
            c(np.array([dim], np.int64)),
            c(np.array([-1], np.int64)),
            c(np.array([2], np.int64)),
        )

    axis = g.constant(np.array([-1], np.int64))
    odd, even = g.Unsqueeze(g.Neg(strided(1)), axis), g.Unsqueeze(strided(0), axis)
    rot = g.Reshape(g.Concat(odd, even, axis=-1), g.constant(np.array([1, heads, 1, dim], np.int64)))
    g.output(x * cos + rot * sin, "y")
    return g.build()


def _interleaved_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"x": rng.standard_normal((1, 4, 1, 16)).astype(np.float32), "pos": np.array([[11]], np.int64)}


def test_interleaved_rotary_is_one_kernel_and_the_grouped_reference_is_bit_equal() -> None:
    graph = _interleaved_rotary_graph()
    feeds = _interleaved_feeds()
    plain = dsp.compile(graph, mode="slot_by_slot")
    want = plain.run(feeds)["y"]
    x, p = feeds["x"].astype(np.float64), 11.0
    theta = p / (10000 ** (np.arange(0, 16, 2) / 16))
    c, s = np.repeat(np.cos(theta), 2), np.repeat(np.sin(theta), 2)
    rot = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(want, x * c + rot * s, rtol=1e-5, atol=1e-5)  # the graph is interleaved rotary
    grouped = CompiledModel(
        graph, dsp.GraphExecutionMode.SLOT_BY_SLOT, registry=Registry(backends=[TritonGroupedSlotBySlot()])
    )
    np.testing.assert_array_equal(grouped.run(feeds)["y"], want)
    plan, part = plain.plan(), plain.partition()
    assert plan is not None and part is not None
    from dsp_core.plan.fusion import segment_fusion

    result = segment_fusion(plan, [s for seg in part.segments for s in seg.slots], TritonPolicy())
    rotary = [g for g in result.groups if any(plan.slots[s].op == "Neg" for s in g.slots)]
    assert len(rotary) == 1 and rotary[0].kernels == 1
    ops = [plan.slots[s].op for s in rotary[0].slots]  # the slices, rotate, x*cos + rot*sin (and the tables)
    assert ops.count("Slice") == 2 and "Concat" in ops and "Reshape" in ops and ops[-1] == "Add"
    assert result.kernels == 1, [(g.template, [plan.slots[s].op for s in g.slots]) for g in result.groups]


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_interleaved_rotary_kernel_matches_the_reference_under_the_interpreter() -> None:
    results = _interpreted(
        "m = dsp_core.compile(t._interleaved_rotary_graph(), mode='slot_by_slot')\n"
        "print(json.dumps([r.__dict__ for r in ic.check_model(m, t._interleaved_feeds())]))\n"
    )
    rotary = [r for r in results if "Neg" in r["ops"]]
    assert len(rotary) == 1 and rotary[0]["status"] == "ok", results


def _v_store_graph(rows: int, merged: bool) -> object:
    """x -> (Q and) V projections; V reshaped to heads, transposed and stored into a KV buffer at ``pos``."""
    g = dsp.GraphBuilder("v_store")
    heads, dim, length, k = 2, 16, 12, 40
    rng = np.random.default_rng(rows)
    x = g.placeholder("x", "float32", [1, rows, k])
    buf = g.variable("buf", "float32", [1, heads, length, dim])
    pos = g.placeholder("pos", "int64", [1])
    v = x @ g.constant(rng.standard_normal((k, heads * dim)).astype(np.float32))
    if merged:
        g.output(x @ g.constant(rng.standard_normal((k, 24)).astype(np.float32)), "q")
    v_heads = g.Transpose(g.Reshape(v, g.constant(np.array([1, rows, heads, dim], np.int64))), perm=[0, 2, 1, 3])
    stored = g.op("KVScatter", buf, v_heads, pos, domain="dsp")
    g.output(g.ReduceSum(stored, g.constant(np.array([-1], np.int64)), keepdims=0), "s")  # reads the whole buffer
    return g.build()


def _v_store_feeds(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "x": rng.standard_normal((1, rows, 40)).astype(np.float32),
        "buf": rng.standard_normal((1, 2, 12, 16)).astype(np.float32),
        "pos": np.array([7], np.int64),
    }


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_kv_store_of_a_projection_is_the_product_kernels_last_store(rows: int, merged: bool) -> None:
    graph = _v_store_graph(rows, merged)
    runs = []
    for registry in (None, Registry(backends=[TritonGroupedSlotBySlot()])):
        model = (
            CompiledModel(graph, dsp.GraphExecutionMode.SLOT_BY_SLOT, registry=registry)
            if registry
            else dsp.compile(graph, mode="slot_by_slot")
        )
        feeds = _v_store_feeds(rows)
        runs.append((model.run(feeds), feeds["buf"], model))
    (want, want_buf, plain), (got, got_buf, _) = runs
    np.testing.assert_array_equal(got_buf, want_buf)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    plan = plain.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    group = next(g for g in result.groups if any(plan.slots[s].op == "KVScatter" for s in g.slots))
    ops = [plan.slots[s].op for s in group.slots]
    assert group.template == "product" and ops[-3:] == ["Reshape", "Transpose", "KVScatter"], ops
    assert ("MergedMatMul" in ops) is merged
    assert not any(plan.slots[s].op == "ReduceSum" for s in group.slots)  # the buffer's reader is another kernel


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_product_kernels_with_a_kv_store_match_the_reference_under_the_interpreter() -> None:
    results = _interpreted(
        "out = []\n"
        "for rows in (1, 3):\n"
        "    for merged in (False, True):\n"
        "        m = dsp_core.compile(t._v_store_graph(rows, merged), mode='slot_by_slot')\n"
        "        out += [r.__dict__ for r in ic.check_model(m, t._v_store_feeds(rows))]\n"
        "print(json.dumps(out))\n"
    )
    stores = [r for r in results if "KVScatter" in r["ops"]]
    assert len(stores) == 4 and all(r["status"] == "ok" and r["template"] == "product" for r in stores), stores


# -- the greedy pick: dsp::Sample at temperature 0 and ArgMax over the last axis, as two kernels ----
def test_greedy_picks_are_recognised_and_nothing_else() -> None:
    from dsp_cuda_graphs.greedy import PickLayout, greedy_pick

    def slot(op: str, domain: str = "", **attrs: object) -> object:
        return type("S", (), {"op": op, "domain": domain, "attrs": attrs})()

    assert greedy_pick(slot("Sample", "dsp", temperature=0.0)) == PickLayout(sample=True)
    assert greedy_pick(slot("Sample", "dsp", temperature=0.7)) is None  # a real draw stays the reference's
    assert greedy_pick(slot("ArgMax", axis=-1, keepdims=0)) == PickLayout(sample=False, keepdims=False, axis=-1)
    assert greedy_pick(slot("ArgMax", axis=1, select_last_index=1)) is None  # the last best index: the reference
    assert greedy_pick(slot("ArgMin", axis=-1)) is None


def test_the_greedy_pick_spreads_a_row_over_chunks_and_declines_what_it_cannot_key() -> None:
    first, second = codegen.argmax_rows(codegen.TensorSpec((2, 128256), "float16", (128256, 1)))
    assert first.grid == (126, 2, 1) and second.grid == (2, 1, 1)  # 126 programs per row, then one per row
    assert "bitcast=True" in first.source and first.args == (0, 1, 2) and second.args == (1, 2, 3)
    strided, _ = codegen.argmax_rows(codegen.TensorSpec((1, 50257), "float32", (7 * 50257, 1)))
    assert f"* {7 * 50257}" in strided.source  # the row stride of a [B, S, V][:, -1] view, read in place
    for bad in (codegen.TensorSpec((2, 8), "int64", (8, 1)), codegen.TensorSpec((2, 3, 8), "float32", (24, 8, 1))):
        with pytest.raises(codegen.Unsupported):
            codegen.argmax_rows(bad)


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_the_greedy_pick_matches_numpys_argmax_under_the_interpreter() -> None:
    results = _interpreted("print(json.dumps(ic.argmax_cases()))\n")
    assert len(results) == 3 * (4 * 6 + 1)
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad[:3]


# -- GatherND in a generated kernel (GPT-2's exported attention mask picks rows with it) -----------
def _gather_nd_graph(batch_dims: int) -> object:
    g = dsp.GraphBuilder("gather_nd")
    data = g.placeholder("data", "float32", [2, 5, 6, 3])
    if batch_dims == 0:
        idx = g.placeholder("idx", "int64", [4, 2])  # rows of data[i, j]
    else:
        idx = g.placeholder("idx", "int64", [2, 4, 1])  # per batch, rows of data[b, i]
    picked = g.GatherND(g.Relu(data), idx, batch_dims=batch_dims)
    g.output(g.Add(picked, g.constant(np.float32(1.5))), "y")
    return g.build()


def _gather_nd_feeds(batch_dims: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    idx = (
        np.array([[0, 1], [1, -1], [-2, 4], [1, 0]], np.int64)  # negative indices count from the end
        if batch_dims == 0
        else np.array([[[4], [0], [-1], [2]], [[1], [1], [3], [-5]]], np.int64)
    )
    return {"data": rng.standard_normal((2, 5, 6, 3)).astype(np.float32), "idx": idx}


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd_joins_the_kernel_of_its_neighbours(batch_dims: int) -> None:
    model = dsp.compile(_gather_nd_graph(batch_dims), mode="slot_by_slot")
    feeds = _gather_nd_feeds(batch_dims)
    model.run(feeds)
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    (group,) = [g for g in result.groups if any(plan.slots[s].op == "GatherND" for s in g.slots)]
    assert [plan.slots[s].op for s in group.slots][:3] == ["Relu", "GatherND", "Add"], group


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_gather_nd_kernels_match_the_reference_under_the_interpreter() -> None:
    results = _interpreted(
        "out = []\n"
        "for b in (0, 1):\n"
        "    m = dsp_core.compile(t._gather_nd_graph(b), mode='slot_by_slot')\n"
        "    out += [r.__dict__ for r in ic.check_model(m, t._gather_nd_feeds(b))]\n"
        "print(json.dumps(out))\n"
    )
    picks = [r for r in results if "GatherND" in r["ops"]]
    assert len(picks) == 2 and all(r["status"] == "ok" for r in picks), picks


def test_a_declined_group_reports_nvrtcs_kernel_and_hands_every_call_to_it() -> None:
    """AUTO's chain per group (Triton, then NVRTC): once Triton's templates decline a group and
    dsp-nvrtc took it, the report says so and every call goes to NVRTC's step."""
    from dsp_cuda_graphs.fusion import GroupReport as NvrtcReport
    from dsp_triton.kernels import FusedGroup, GroupReport

    report = GroupReport(3, "row_reduction", (7,), status="reference", reason="a row of 20000 elements")
    assert report.as_dict()["status"] == "reference"
    nv = NvrtcReport(3, "row_reduction", (7,), status="fused", kernel="dsp_row_ab12", compile_ms=2.5)
    report.fallback = nv
    got = report.as_dict()
    assert (got["status"], got["kernel"], got["compile_ms"]) == ("nvrtc", "dsp_row_ab12", 2.5)
    assert got["reason"].startswith("Triton's templates decline it (a row of 20000 elements)")
    nv.status, nv.reason = "demoted", "its kernel disagreed"
    assert report.as_dict()["status"] == "demoted" and report.as_dict()["reason"].endswith("its kernel disagreed")

    group = FusedGroup(report, [], (1,), (2,), [], lambda f, v: None, 5e-3, None, lambda: False)
    calls: list[tuple[object, ...]] = []
    group.fallback = lambda *xs: calls.append(xs) or "nvrtc's output"
    assert group("x") == "nvrtc's output" and calls == [("x",)]


def test_without_dsp_nvrtc_available_a_declined_group_keeps_its_reference_kernels() -> None:
    from dsp_triton import kernels

    if kernels.nvrtc_backend() is not None:
        pytest.skip("dsp-nvrtc is available here (a GPU machine): the GPU test covers the fallback")
    assert kernels.nvrtc_step(object()) is None  # type: ignore[arg-type]
