"""dsp-nvrtc on a machine without a GPU: it installs, lists NVRTC_JIT and PTX_JIT as unavailable with
their reasons, AUTO falls through; its fusion policy groups the fixtures; every generated kernel of
every fixture compiles with NVRTC (the nvidia-cuda-nvrtc wheel) and, built for the host by a C++
compiler, gives the reference's outputs; the segment cache writes atomically and recompiles
damaged entries; the committed PTX is what its source compiles to."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dsp_cpu_ref.plugin import SlotBySlotBackend
from dsp_nvrtc import codegen, compiler, hostcheck, rowwise
from dsp_nvrtc.cache import Entry, JitSegmentCacheKey, SegmentCache
from dsp_nvrtc.plugin import NvrtcPolicy

import dsp_core as dsp
from dsp_core.backends.base import Registry
from dsp_core.backends.discovery import discover
from dsp_core.plan.fusion import propose_groups
from dsp_core.plan.kernelspec import ROW_VALUED_OPS
from dsp_core.runtime.model import CompiledModel

FIXTURES = Path(__file__).parent / "fixtures"
DECODERS = ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"]
NVRTC_MISSING = compiler.available()
CXX_MISSING = None if hostcheck.host_compiler() else "no C++ compiler (g++) to run kernels on the host"


def _nvdisasm() -> str | None:
    """nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel (dsp-nvrtc's ``test`` extra) or the path."""
    import shutil

    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
            if os.path.exists(os.path.join(root, sub)):
                return os.path.join(root, sub)
    return shutil.which("nvdisasm")


def _assert_preloads_before_the_wait(cubin: bytes, name: str) -> None:
    """In the kernel's SASS, the weight's 16-byte preloads are issued before ``griddepcontrol.wait``
    (ACQBULK) and no load precedes them that would keep the wait above it: ptxas places the wait
    above every non-coherent (.nc, ``LDG...CONSTANT``) load, so a preload through a const
    __restrict__ pointer would wait for the kernel before (``dsp_pre16`` is a plain load)."""
    tool = _nvdisasm()
    if tool is None:
        return  # the source-order checks above still hold; the SASS check needs the test extra
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    ops = [line.split("*/", 1)[1].strip() for line in sass.splitlines() if "/*0" in line and "*/" in line]
    ops = [op.lstrip("@!P0123456789T ").split(" ")[0] if op.startswith("@") else op.split(" ")[0] for op in ops]
    wait = ops.index("ACQBULK")
    assert any(op.startswith("LDG.E.128") for op in ops[:wait]), ("no preload before the wait", ops[: wait + 1])
    assert not any(op.startswith("LDG") and "CONSTANT" in op for op in ops[:wait]), ops[: wait + 1]


def _gpu_missing() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() < 1
    except Exception:  # noqa: BLE001
        return True


def _feeds(name: str, model: dsp.CompiledModel) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    prefix = "" if name == "cnn" else "step1."
    return {n: golden[prefix + n] for n in model.input_names}


# -- discovery ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, mode", [("nvrtc_jit", "NVRTC_JIT"), ("ptx_jit", "PTX_JIT")])
def test_registered_through_its_entry_point(name: str, mode: str) -> None:
    backend = next(b for b in discover().backends if b.name == name)
    assert backend.distribution == "dsp-nvrtc"
    assert backend.mode is dsp.GraphExecutionMode[mode]
    assert backend.platform == "cuda" and backend.captures
    assert backend.contract.needs_stable_addresses and backend.contract.deterministic
    assert isinstance(backend.fusion_policy(), NvrtcPolicy)  # PTX_JIT loads NVRTC_JIT's kernels as PTX


@pytest.mark.skipif(not _gpu_missing(), reason="checks the CPU-only behaviour")
def test_unavailable_with_a_reason_and_auto_falls_through() -> None:
    for name in ("nvrtc_jit", "ptx_jit"):
        avail = next(b for b in discover().backends if b.name == name).availability()
        assert not avail.ok and "cupy" in avail.reason
    model = dsp.compile(FIXTURES / "gpt2_eager.onnx")
    model.run(_feeds("gpt2_eager", model))
    assert not {"nvrtc_jit", "ptx_jit"} & set(model.resolved_backends())


def test_backends_list_shows_both_in_the_cuda_chain() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", "backends", "list"], capture_output=True, text=True, check=True
    ).stdout
    for name, mode in (("nvrtc_jit", "NVRTC_JIT"), ("ptx_jit", "PTX_JIT")):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name} "))
        assert mode in line and "dsp-nvrtc" in line
        if _gpu_missing():
            assert " no: " in line
    ranks = {
        ln.split()[0]: ln.split()[-1]
        for ln in out.splitlines()
        if ln.split() and ln.split()[0] in ("triton", "nvrtc_jit", "ptx_jit", "cuda_graphs")
    }
    assert [ranks[n].strip("()") for n in ("triton", "nvrtc_jit", "ptx_jit", "cuda_graphs")] == ["1", "2", "3", "4"]


def test_cuda_graphs_has_no_jit_kernels_left() -> None:
    assert importlib.util.find_spec("dsp_cuda_graphs.fused") is None
    source = (Path(__file__).parents[1] / "plugins/cuda_graphs/dsp_cuda_graphs/segment.py").read_text()
    assert "RawModule" not in source and "LayerNormalization" not in source.split("def _slot_kernel")[0]


# -- the policy ---------------------------------------------------------------------------
class NvrtcGroupedSlotBySlot(SlotBySlotBackend):
    """The reference backend grouping with dsp-nvrtc's policy: runs each group node by node."""

    def fusion_policy(self) -> NvrtcPolicy:
        return NvrtcPolicy()


@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_policy_fuses_the_fixtures_and_the_grouped_reference_is_bit_equal(name: str) -> None:
    plain = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    grouped = CompiledModel(
        plain.graph, dsp.GraphExecutionMode.SLOT_BY_SLOT, registry=Registry(backends=[NvrtcGroupedSlotBySlot()])
    )
    feeds = _feeds(name, plain)
    for _ in range(3):
        want, got = plain.run(feeds), grouped.run(feeds)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    plan, part = plain.plan(), plain.partition()
    assert plan is not None and part is not None
    slots = [s for seg in part.segments for s in seg.slots]
    result = propose_groups(plan, slots, NvrtcPolicy())
    if name != "cnn":
        assert result.kernels < len(slots) * 0.6, (result.kernels, len(slots))
        # every norm is a row kernel, or the prologue of the product that alone reads it
        reduced = {s for s in slots if plan.slots[s].op in ROW_VALUED_OPS}
        norms = [g for g in result.groups if reduced & set(g.slots)]
        assert norms and all(g.template in ("row_reduction", "product", "decode_attention") for g in norms)
        # the skinny products (T3) take their epilogue: the bias or the residual add
        assert any(g.template == "product" and len(g.slots) > 1 for g in result.groups), result.groups


@pytest.mark.parametrize("attention", ["1", "0"])
def test_plan_explain_shows_each_groups_chain_ending_at_the_winners_kernel(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_NVRTC_ATTENTION", attention)
    plain = dsp.compile(FIXTURES / "gpt2_eager.onnx", mode="slot_by_slot")
    grouped = CompiledModel(
        plain.graph, dsp.GraphExecutionMode.SLOT_BY_SLOT, registry=Registry(backends=[NvrtcGroupedSlotBySlot()])
    )
    groups = [g for seg in grouped.explain()["segments"] for g in seg["fusion"]["groups"]]
    verdicts = {g["template"]: g["chain"][-1]["verdict"] for g in groups}
    if attention == "1":  # the default: scores, softmax and weighted sum one group
        assert verdicts["decode_attention"] == "one generated kernel" and "matmul" not in verdicts
    else:  # the products on cuBLAS, the softmax a row kernel
        assert verdicts["row_reduction"] == "one generated kernel"
        assert verdicts["matmul"].startswith("its slots' own kernels (a matmul group runs alone")
    assert all(g["chain"][-1]["backend"] == "slot_by_slot" for g in groups)


def test_policy_keeps_ops_it_cannot_generate_alone() -> None:
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [4, 8])
    y = g.Relu(g.Mod(g.Exp(x), x, fmod=1))
    g.output(g.Sigmoid(y), "y")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    model.run({"x": np.ones((4, 8), np.float32)})
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    mod = next(s for s in range(len(plan.slots)) if plan.slots[s].op == "Mod")
    assert any(g.slots == (mod,) for g in result.groups)
    assert any("no CUDA C template" in b.reason for b in result.boundaries)


# -- the generator, compiled by NVRTC and run on the host -----------------------------------
@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("name", [*DECODERS, "cnn"])
def test_every_generated_kernel_compiles_and_matches_the_reference_on_the_host(name: str) -> None:
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    results = hostcheck.check_model(model, _feeds(name, model))
    bad = [r for r in results if r.status not in ("ok", "unsupported")]
    assert not bad, bad[:3]
    ok = {r.template for r in results if r.status == "ok"}
    assert "pointwise" in ok and (name == "cnn" or {"product", "copy"} <= ok), results
    if name.startswith("llama"):  # the norm before Q/K/V, and before gate/up with SiLU(gate) x up: one kernel each
        merged = [r.ops for r in results if r.status == "ok" and "MergedMatMul" in r.ops]
        assert len(merged) == 4 and all(ops[0] in ("Pow", "RMSNormalization") for ops in merged), merged
        assert sum(ops[-3:] == ["Sigmoid", "Mul", "Mul"] for ops in merged) == 2, merged


def _half_block() -> Any:
    """A gather, LayerNorm, tanh-GELU chain, the exported RMSNorm chain, masked Softmax, transposes: in fp16."""
    g = dsp.GraphBuilder("half_block")

    def half(v: float) -> Any:
        return g.constant(np.float16(v))

    rng = np.random.default_rng(3)
    x = g.placeholder("x", "float16", [2, 5, 96])
    mask = g.placeholder("mask", "float16", [2, 1, 96])
    ids = g.placeholder("ids", "int64", [2, 5])
    table = g.constant(rng.standard_normal((10, 96)).astype(np.float16))
    e = g.Gather(table, ids, axis=0) + x
    scale = g.constant((rng.random(96) + 0.5).astype(np.float16))
    bias = g.constant(rng.standard_normal(96).astype(np.float16))
    ln = g.LayerNormalization(e, scale, bias, axis=-1, epsilon=1e-5)
    t = ln * half(0.5) * (half(1.0) + g.Tanh(half(0.7978845608) * (ln + half(0.044715) * ln * ln * ln)))
    axes = g.constant(np.array([-1], np.int64))
    h = g.Cast(t, to=1)
    inv = g.Reciprocal(
        g.Sqrt(g.ReduceMean(g.Pow(h, g.constant(np.float32(2))), axes, keepdims=1) + g.constant(np.float32(1e-6)))
    )
    r = g.Cast(h * inv, to=10)
    sm = g.Softmax(r * half(0.125) + mask, axis=-1)
    y2 = g.Where(g.Less(g.Transpose(sm, perm=[0, 2, 1]), half(0.01)), half(0.0), g.Transpose(sm, perm=[0, 2, 1]))
    g.output(sm, "sm")
    g.output(y2, "y2")
    return g.build()


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
def test_half_precision_groups_match_the_reference_on_the_host() -> None:
    model = dsp.compile(_half_block(), mode="slot_by_slot")
    rng = np.random.default_rng(4)
    feeds = {
        "x": rng.standard_normal((2, 5, 96)).astype(np.float16),
        "mask": np.where(rng.random((2, 1, 96)) < 0.2, -1e4, 0).astype(np.float16),
        "ids": np.array([[0, 3, -1, 9, 2], [-10, 5, 5, 1, 0]], np.int64),  # negative indexes count from the end
    }
    results = hostcheck.check_model(model, feeds)
    assert [r.status for r in results] == ["ok"] * len(results) and len(results) >= 5, results
    assert {r.template for r in results} == {"copy", "row_reduction"}


def _spec(template, nodes, values, inputs, outputs, constants=None) -> codegen.GroupSpec:
    specs = {
        v: codegen.TensorSpec(shape, dtype, tuple(codegen.row_major(shape)) if v in inputs else None)
        for v, (shape, dtype) in values.items()
    }
    return codegen.GroupSpec(template, nodes, specs, list(inputs), list(outputs), constants or (lambda v: None))


def _softmax_spec(dtype: str) -> codegen.GroupSpec:
    """Softmax(x * scale + mask) over rows of 300: scale a literal, the mask broadcast over heads."""
    n = codegen.NodeSpec
    return _spec(
        "row_reduction",
        [n("Mul", (1, 2), (3,)), n("Add", (3, 4), (5,)), n("Softmax", (5,), (6,), {"axis": -1}, opset=13)],
        {
            1: ((2, 3, 300), dtype),
            2: ((), dtype),
            3: ((2, 3, 300), dtype),
            4: ((2, 1, 300), dtype),
            5: ((2, 3, 300), dtype),
            6: ((2, 3, 300), dtype),
        },
        [1, 2, 4],
        [6],
        lambda v: np.asarray(0.125, dtype) if v == 2 else None,
    )


def _softmax_want(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) * 0.125 + mask
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_scaled_masked_softmax_is_one_row_kernel(dtype: str) -> None:
    spec = _softmax_spec(dtype)
    kernel = codegen.generate(spec)
    assert kernel.template == "row_reduction" and kernel.grid == 6 and kernel.args == (1, 4, 6)
    assert "0.125f" in kernel.source  # the one-element constant is a literal, not an argument
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 300)).astype(dtype)
    mask = np.where(rng.random((2, 1, 300)) < 0.2, -1e4, 0.0).astype(dtype)
    got = hostcheck.run_on_host(kernel, spec, {1: x, 4: mask})[6]
    np.testing.assert_allclose(
        got.astype(np.float64), _softmax_want(x, mask), atol=2e-3 if dtype == "float16" else 1e-6
    )


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("width", [768, 2048, 2049 + codegen.ROW_CACHE_STEPS * codegen.THREADS])
def test_a_residual_norm_reads_its_row_once_into_registers(width: int) -> None:
    """RMSNorm of a residual sum as exported (Add, Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul,
    Mul by the weight), its sum also stored: a row of at most ROW_CACHE_STEPS elements a thread is
    loaded once, by the first loop (each input at the row's index into registers the later loops
    read); a longer row is looped over as before; both equal numpy's."""
    n = codegen.NodeSpec
    rows = 2
    shape = (rows, width)
    nodes = [
        n("Add", (1, 2), (3,)),
        n("Pow", (3, 10), (4,)),
        n("ReduceMean", (4,), (5,), {"axes": [-1], "keepdims": 1}),
        n("Add", (5, 11), (6,)),
        n("Sqrt", (6,), (7,)),
        n("Reciprocal", (7,), (8,)),
        n("Mul", (3, 8), (9,)),
        n("Mul", (9, 12), (13,)),
    ]
    f32 = "float32"
    values = {1: (shape, f32), 2: (shape, f32), 3: (shape, f32), 4: (shape, f32), 5: ((rows, 1), f32)}
    values |= {6: ((rows, 1), f32), 7: ((rows, 1), f32), 8: ((rows, 1), f32), 9: (shape, f32), 13: (shape, f32)}
    values |= {10: ((), f32), 11: ((), f32), 12: ((width,), f32)}
    consts = {10: np.array(2.0, np.float32), 11: np.array(1e-6, np.float32)}
    spec = _spec("row_reduction", nodes, values, [1, 2, 10, 11, 12], [3, 13], lambda v: consts.get(v))
    kernel = codegen.generate(spec)
    cached = width <= codegen.ROW_CACHE_STEPS * codegen.THREADS
    loads = [line for line in kernel.source.split("\n") if re.search(r"\bin[01]\[", line)]
    assert len(loads) == (2 if cached else 4), kernel.source  # x and the residual: once each, or per loop
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    rng = np.random.default_rng(width)
    x, res, w = (rng.standard_normal(sh).astype(np.float32) for sh in (shape, shape, (width,)))
    got = hostcheck.run_on_host(kernel, spec, {1: x, 2: res, 12: w})
    h = x.astype(np.float64) + res
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got[3], h, rtol=1e-6)
    np.testing.assert_allclose(got[13], want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_the_host_check_sees_a_wrong_kernel() -> None:
    """The check is not vacuous: a kernel that computes another thing disagrees."""
    spec = _softmax_spec("float32")
    kernel = codegen.generate(spec)
    source = kernel.source.replace("expf(", "exp2f(").replace(f" {kernel.name}(", f" {kernel.name}_w(")
    wrong = dataclasses.replace(kernel, source=source, name=kernel.name + "_w")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 300)).astype(np.float32)
    mask = np.zeros((2, 1, 300), np.float32)
    got = hostcheck.run_on_host(wrong, spec, {1: x, 4: mask})[6]
    assert not np.allclose(got, _softmax_want(x, mask), rtol=1e-2, atol=1e-6)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_pointwise_broadcast_and_copy_index_arithmetic_on_the_host() -> None:
    """Where(c, a + b[None], -a) over [3, 4, 5] with a strided (transposed) input, then a slice and a
    concat along the last axis: one copy kernel."""
    n = codegen.NodeSpec
    nodes = [
        n("Add", (1, 2), (3,)),
        n("Neg", (1,), (4,)),
        n("Where", (5, 3, 4), (6,)),
        n("Slice", (6, 10, 11, 12), (7,), opset=13),
        n("Concat", (7, 6), (8,), {"axis": -1}),
    ]
    consts = {10: np.array([1]), 11: np.array([4]), 12: np.array([2])}
    spec = _spec(
        "copy",
        nodes,
        {
            1: ((3, 4, 5), "float32"),
            2: ((4, 5), "float32"),
            3: ((3, 4, 5), "float32"),
            4: ((3, 4, 5), "float32"),
            5: ((3, 1, 5), "bool"),
            6: ((3, 4, 5), "float32"),
            7: ((3, 4, 3), "float32"),
            8: ((3, 4, 8), "float32"),
            10: ((1,), "int64"),
            11: ((1,), "int64"),
            12: ((1,), "int64"),
        },
        [1, 2, 5, 10, 11, 12],
        [8],
        lambda v: consts.get(v),
    )
    rng = np.random.default_rng(2)
    a = np.ascontiguousarray(rng.standard_normal((5, 4, 3)).astype(np.float32)).transpose(2, 1, 0)
    spec.values[1] = codegen.TensorSpec((3, 4, 5), "float32", tuple(s // 4 for s in a.strides))
    b = rng.standard_normal((4, 5)).astype(np.float32)
    c = rng.random((3, 1, 5)) < 0.5
    kernel = codegen.generate(spec)
    assert kernel.args == (5, 1, 2, 8)  # the slice bounds are literals
    got = hostcheck.run_on_host(kernel, spec, {1: a, 2: b, 5: c})[8]
    w = np.where(c, a + b, -a)
    np.testing.assert_array_equal(got, np.concatenate([w[..., 1:4], w], axis=-1))


@pytest.mark.parametrize(
    "node, dtype, why",
    [
        (codegen.NodeSpec("Div", (1, 1), (2,)), "int32", "integer Div"),
        (codegen.NodeSpec("Exp", (1,), (2,)), "int64", "Exp on int64"),
        (codegen.NodeSpec("Mod", (1, 1), (2,)), "float32", "no template for Mod"),
    ],
)
def test_unsupported_groups_say_why(node: codegen.NodeSpec, dtype: str, why: str) -> None:
    spec = _spec("pointwise", [node], {1: ((4,), dtype), 2: ((4,), dtype)}, [1], [2])
    with pytest.raises(codegen.Unsupported, match=why):
        codegen.generate(spec)


def test_identical_groups_share_one_kernel_name() -> None:
    a, b = codegen.generate(_softmax_spec("float16")), codegen.generate(_softmax_spec("float16"))
    assert a.name == b.name and a.name.startswith("dsp_row_")
    assert codegen.generate(_softmax_spec("float32")).name != a.name


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
def test_a_compile_error_quotes_the_generated_line() -> None:
    source = codegen.DEVICE_PRELUDE + 'extern "C" __global__ void broken(float* y) {\n    y[0] = undefined_name;\n}\n'
    line = source.splitlines().index("    y[0] = undefined_name;") + 1
    with pytest.raises(compiler.NvrtcError) as info:
        compiler.compile_source(source, "broken", compiler.Target("compute_75"))
    assert info.value.lines and info.value.lines[0] == line
    assert f"line {line}: y[0] = undefined_name;" in str(info.value) and "undefined_name" in info.value.log


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
def test_nvrtc_compiles_ptx_and_a_cubin_without_a_gpu() -> None:
    kernel = codegen.generate(_softmax_spec("float16"))
    ptx = compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
    assert ptx.endswith(b"\0") and f".entry {kernel.name}(".encode() in ptx
    cubin = compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
def test_the_committed_ptx_is_what_its_source_compiles_to() -> None:
    if compiler.version() != (13, 0):
        pytest.skip(f"NVRTC {compiler.version()} here; the committed PTX is built with 13.0")
    script = Path(__file__).parents[1] / "scripts" / "build_ptx.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    ptx = rowwise.PTX.read_text()
    assert ".version 9.0" in ptx and all(f".entry {name}(" in ptx for name in rowwise.NAMES)


# -- the segment cache ------------------------------------------------------------------------
def _key(**kw) -> JitSegmentCacheKey:
    fields = dict(
        group="ab" * 16,
        shapes=((2, 3),),
        dtypes=("float16",),
        capability="sm_90",
        options=("-x",),
        compiler="nvrtc 13.0",
    )
    fields.update(kw)
    return JitSegmentCacheKey(**fields)


def test_cache_round_trip_and_every_key_field_misses(tmp_path: Path) -> None:
    cache = SegmentCache(tmp_path)
    entry = Entry("dsp_row_x", "source text", b"\x7fELF binary")
    assert cache.get(_key()) is None
    path = cache.put(_key(), entry)
    assert path is not None and path.parent == tmp_path
    assert cache.get(_key()) == entry and cache.hits == 1
    for field, other in (
        ("shapes", ((2, 4),)),
        ("dtypes", ("float32",)),
        ("capability", "sm_80"),
        ("options", ()),
        ("compiler", "nvrtc 13.1"),
        ("group", "cd" * 16),
    ):
        assert cache.get(_key(**{field: other})) is None
        assert _key(**{field: other}).differs(_key()) == [field]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def _damage(path: Path, how: str, header_at: int) -> None:
    """A cache or bundle file damaged: a flipped byte, cut short, a broken header, or emptied."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-3] ^= 0x55
    elif how == "truncate":
        data = data[:-4]
    elif how == "header":
        data[header_at : header_at + 2] = b"{{"
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty"])
def test_a_damaged_entry_is_removed_and_missed(tmp_path: Path, damage: str) -> None:
    cache = SegmentCache(tmp_path)
    path = cache.put(_key(), Entry("k", "src", b"binary bytes here"))
    assert path is not None
    _damage(path, damage, header_at=12)
    assert cache.get(_key()) is None
    assert cache.damaged == 1 and not path.exists()
    cache.put(_key(), Entry("k", "src", b"binary bytes here"))  # recompiled and stored again
    assert cache.get(_key()) is not None


def test_an_entry_under_another_key_is_damaged(tmp_path: Path) -> None:
    cache = SegmentCache(tmp_path)
    path = cache.put(_key(), Entry("k", "src", b"bin"))
    assert path is not None
    os.replace(path, cache.path(_key(capability="sm_80")))  # a file renamed by hand
    assert cache.get(_key(capability="sm_80")) is None and cache.damaged == 1


# -- the PTX bundle: NVRTC_JIT's kernels as PTX, for PTX_JIT where NVRTC is not -------------------
def test_the_ptx_archs_a_device_may_load_are_newest_first_and_safe_for_dependent_launches() -> None:
    from dsp_nvrtc.kernels import ptx_archs

    assert ptx_archs(90, dependent=True) == ["compute_90"]  # PTX before 90 has no griddepcontrol.wait
    assert ptx_archs(90, dependent=False)[:3] == ["compute_90", "compute_89", "compute_87"]
    assert ptx_archs(100, dependent=True) == ["compute_100", "compute_90"]
    assert ptx_archs(86, dependent=False) == ["compute_86", "compute_80", "compute_75"]
    assert ptx_archs(70, dependent=False) == []


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
def test_nvrtc_exports_a_kernels_ptx_and_ptx_jit_finds_it_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsp_cuda_graphs.fusion import Unfusable
    from dsp_nvrtc.cache import PtxBundle
    from dsp_nvrtc.kernels import NvrtcSource, PtxSource

    kernel = codegen.generate(_softmax_spec("float16"))
    bundle = PtxBundle(tmp_path)
    with pytest.raises(Unfusable, match=r"no PTX of its kernel .* \(DSP_NVRTC_EXPORT_PTX=1"):
        PtxSource(bundle).find(kernel, 90, dependent=True)
    NvrtcSource(SegmentCache(tmp_path / "cache"), bundle).export(kernel, "compute_90")
    [path] = tmp_path.glob("*.ptx")
    assert path.name.endswith(".compute_90.ptx")

    def no_nvrtc(*_: Any) -> bytes:
        raise AssertionError("PTX_JIT compiled")

    monkeypatch.setattr(compiler, "compile_source", no_nvrtc)
    ptx, arch = PtxSource(PtxBundle(tmp_path)).find(kernel, 100, dependent=True)
    assert arch == "compute_90" and ptx.endswith(b"\0") and f".entry {kernel.name}(".encode() in ptx
    assert b".target sm_90" in ptx and b"griddepcontrol.wait" in ptx  # DSP_WAIT() compiled in
    NvrtcSource(SegmentCache(tmp_path / "cache"), bundle).export(kernel, "compute_90")  # there: not compiled again
    other = dataclasses.replace(kernel, source=kernel.source.replace("dsp_", "dsp_x_", 1))
    with pytest.raises(Unfusable):  # another source is another kernel, whatever its name
        PtxSource(PtxBundle(tmp_path)).find(other, 90, dependent=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "renamed"])
def test_a_damaged_bundle_file_is_left_in_place_and_not_loaded(tmp_path: Path, damage: str) -> None:
    from dsp_nvrtc.cache import PtxBundle

    bundle = PtxBundle(tmp_path)
    path = bundle.put("dsp_k", "source", "compute_90", b".version 9.0\n.target sm_90\n\0")
    assert path is not None and bundle.get("dsp_k", "source", "compute_90") == b".version 9.0\n.target sm_90\n\0"
    _damage(path, damage, header_at=10)
    if damage == "renamed":  # a file copied under another kernel's name
        os.replace(path, bundle.path("dsp_k", "another source", "compute_90"))
        path = bundle.path("dsp_k", "another source", "compute_90")
        assert bundle.get("dsp_k", "another source", "compute_90") is None
    else:
        assert bundle.get("dsp_k", "source", "compute_90") is None
    assert bundle.damaged == 1 and path.exists()  # the user's file: said in the log, not removed


def test_ptx_jit_holds_its_kernels_to_nvrtc_jits_tolerance() -> None:
    from dsp_nvrtc.plugin import NvrtcBackend, PtxBackend

    assert PtxBackend().contract.tolerance == NvrtcBackend().contract.tolerance  # the same kernels


def test_a_write_that_dies_leaves_the_old_entry_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = SegmentCache(tmp_path)
    cache.put(_key(), Entry("k", "old", b"old binary"))

    def dying(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", dying)
    assert cache.put(_key(), Entry("k", "new", b"new binary")) is None  # said in the log, not raised
    monkeypatch.undo()
    assert cache.get(_key()) == Entry("k", "old", b"old binary")
    assert len(list(tmp_path.iterdir())) == 1


def test_the_wheel_carries_the_ptx_and_its_source(tmp_path: Path) -> None:
    import zipfile

    plugin = Path(__file__).parents[1] / "plugins" / "nvrtc"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(plugin),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("dsp_nvrtc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"dsp_nvrtc/ptx/rowwise.ptx", "dsp_nvrtc/ptx/rowwise.cu", "dsp_nvrtc/codegen.py"} <= names


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_bfloat16_is_held_as_bits_computed_in_float_and_rounded_per_op() -> None:
    import math

    import ml_dtypes

    n, t = codegen.NodeSpec, codegen.TensorSpec
    bf = "bfloat16"
    values = {1: t((4, 33), bf, (33, 1)), 2: t((33,), bf, (1,)), 3: t((4, 33), bf), 4: t((4, 33), bf)}
    values[5] = t((4, 33), "float32")
    nodes = [n("Add", (1, 2), (3,)), n("Gelu", (3,), (4,)), n("Cast", (4,), (5,), {"to": 1})]
    spec = codegen.GroupSpec("pointwise", nodes, values, [1, 2], [4, 5])
    kernel = codegen.generate(spec)
    assert "dsp_rbf(" in kernel.source and "unsigned short" in kernel.source
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 33)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(33).astype(ml_dtypes.bfloat16)
    got = hostcheck.run_on_host(kernel, spec, {1: a, 2: b})
    s = (a.astype(np.float32) + b.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = 0.5 * s * (1 + np.vectorize(math.erf)(s / math.sqrt(2)))
    assert got[4].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got[4].astype(np.float64), want, atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(got[5], got[4].astype(np.float32))  # the cast reads the rounded value


class _Dev:
    """A stand-in device array: GroupStep keys it by layout alone, as it does a CuPy array."""

    def __init__(self, a: Any) -> None:
        self.a = np.asarray(a)
        self.shape, self.dtype, self.strides, self.size, self.data = (
            self.a.shape,
            self.a.dtype,
            self.a.strides,
            self.a.size,
            None,
        )


def _fake_cupy() -> Any:
    import contextlib
    import types

    pool = types.SimpleNamespace(malloc=None)
    cuda = types.SimpleNamespace(using_allocator=lambda _: contextlib.nullcontext())
    return types.SimpleNamespace(asnumpy=lambda x: x.a, cuda=cuda, get_default_memory_pool=lambda: pool)


def test_a_kernel_that_baked_a_device_value_is_rebuilt_when_the_value_changes() -> None:
    """A segment serves every input signature of its plan: a shape piece computed on the device keeps
    its layout, (1,), and changes its value (7 prompt tokens, then 1 decode token). The kernel that
    folded 7 into its source must not run for 1: found on the H200, where GPT-2's decode step
    reshaped its rows with the prompt's length."""
    import types

    from dsp_cuda_graphs.fusion import GroupReport, GroupStep

    class Baking(GroupStep):
        builds = 0

        def _build(self, inputs: Any, local: Any) -> Any:
            Baking.builds += 1
            value = inputs[0].a.copy()
            return types.SimpleNamespace(value=value, constants={5: (inputs[0], value)})

        def launch(self, built: Any, inputs: Any) -> Any:
            return (_Dev(built.value * 10),)

    step = Baking(
        GroupReport(0, "copy", (3,)),
        [(lambda x: _Dev(x.a * 10), (5,), 9, ())],
        (5,),
        (9,),
        _fake_cupy(),
        lambda: False,
        0.0,
    )
    seven = _Dev([7])
    assert step(seven).a.tolist() == [70] and step(seven).a.tolist() == [70] and Baking.builds == 1
    assert step(_Dev([7])).a.tolist() == [70] and Baking.builds == 1  # another array, the same value
    assert step(_Dev([1])).a.tolist() == [10] and Baking.builds == 2  # the value changed: built again
    assert step.report.status == "fused"


def test_the_nvrtc_group_records_the_inputs_its_source_depends_on() -> None:
    """Inputs the kernel does not read (their values were folded in), inputs whose contents the
    generator asked for, and, when it asked for a value computed inside the group, every small one."""
    import types

    from dsp_nvrtc.kernels import NvrtcGroup

    group = NvrtcGroup.__new__(NvrtcGroup)
    group.in_flats, group.cp = (1, 2, 3), _fake_cupy()
    kernel: Any = types.SimpleNamespace(args=(1, 2, 9), n_inputs=2)
    big, read, folded = _Dev(np.zeros(5000)), _Dev([2]), _Dev([7])
    assert set(group._baked(kernel, [big, read, folded], set())) == {3}
    assert set(group._baked(kernel, [big, read, folded], {2})) == {2, 3}
    assert set(group._baked(kernel, [big, read, folded], {8})) == {2, 3}  # 8: made inside the group
    assert group._baked(kernel, [big, read, folded], set())[3][1].tolist() == [7]


# -- the skinny product (T3): a dot product per output, its epilogue fused -------------------
@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize(
    "op, attrs, a_shape, b_shape",
    [
        ("MatMul", {}, (2, 3, 33), (33, 17)),  # batch dims of the rows, odd K and N
        ("Gemm", {"transB": 1, "alpha": 0.5, "beta": 2.0}, (5, 40), (9, 40)),  # bias C, transposed weight
        ("Gemm", {}, (1, 7), (7, 300)),  # one row, wider than a block
    ],
)
@pytest.mark.parametrize("lanes", [0, codegen.WARP, codegen.THREADS])
def test_products_with_their_epilogue_match_numpy_on_the_host(
    op: str, attrs: dict[str, Any], a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: str, lanes: int
) -> None:
    """y = Relu(product) + r: one kernel, each thread (or ``lanes`` of a warp or a block, over K,
    summed by shuffles or the block reduction; one lane an output on the host) one output's dot
    product over K (accumulated in float, or double), rounded to the dtype as the reference
    rounds the product, then its epilogue."""
    n = codegen.NodeSpec
    rng = np.random.default_rng(len(a_shape) + b_shape[0])
    a = rng.standard_normal(a_shape).astype(dtype)
    b = rng.standard_normal(b_shape).astype(dtype)
    w = b.T if attrs.get("transB") else b
    out = (*a_shape[:-1], w.shape[1])
    c = rng.standard_normal((w.shape[1],)).astype(dtype)
    r = rng.standard_normal(out).astype(dtype)
    ins = (1, 2, 3) if op == "Gemm" else (1, 2)
    nodes = [n(op, ins, (4,), attrs), n("Relu", (4,), (5,)), n("Add", (5, 6), (7,))]
    values = {1: (a_shape, dtype), 2: (b_shape, dtype), 3: (c.shape, dtype), 4: (out, dtype), 5: (out, dtype)}
    values |= {6: (out, dtype), 7: (out, dtype)}
    spec = _spec("product", nodes, values, [*ins, 6], [7])
    if lanes:
        spec = dataclasses.replace(spec, params={"lanes": lanes})
    if lanes == codegen.THREADS and dtype == "float64":
        with pytest.raises(codegen.Unsupported, match="floats only"):
            codegen.generate(spec)
        return
    kernel = codegen.generate(spec)
    assert kernel.name.startswith("dsp_mm_") and kernel.grid * kernel.threads >= int(np.prod(out)) * max(1, lanes)
    assert ("dsp_warp_sum" in kernel.source) == (lanes == codegen.WARP)
    assert ("dsp_block_reduce" in kernel.source) == (lanes == codegen.THREADS)
    if NVRTC_MISSING is None:  # the shuffles are device code: NVRTC compiles them
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
    got = hostcheck.run_on_host(kernel, spec, {1: a, 2: b, 3: c, 6: r})[7]
    f = np.float64
    prod = (a.astype(f) @ w.astype(f)).astype(dtype)
    if op == "Gemm":
        prod = (f(attrs.get("alpha", 1.0)) * prod.astype(f)).astype(dtype).astype(f) + f(attrs.get("beta", 1.0)) * c
        prod = prod.astype(dtype)
    want = (np.maximum(prod, 0) + r).astype(dtype)
    tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got.astype(f), want.astype(f), rtol=tol, atol=tol * 4)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("lanes", [codegen.WARP, codegen.THREADS])
def test_constant_weights_are_read_16_bytes_a_load_before_the_kernel_waits(
    dtype: str, trans_b: bool, lanes: int
) -> None:
    """A product by a constant weight (``fixed_b``) whose K is its unit stride: each lane's first
    16-byte loads of the weight go into registers before ``DSP_WAIT()`` (the dependent launch's
    wait), every other load and every store after it, once; the result is the product's, also
    where the preload does not cover K (the loop after it) and on the host (one lane an output)."""
    n = codegen.NodeSpec
    rng = np.random.default_rng(lanes + trans_b)
    k_len, width = 8 * codegen.PRELOAD_VECTORS * 3 + 64, 24  # longer than a warp's preload
    a = rng.standard_normal((1, 1, k_len)).astype(np.float32)
    w = rng.standard_normal((k_len, width)).astype(np.float32)
    r = rng.standard_normal((1, 1, width)).astype(np.float32)
    cast = hostcheck._np_dtype(dtype)
    a_, w_, r_ = a.astype(cast), w.astype(cast), r.astype(cast)
    nk = np.ascontiguousarray(w_.T)  # the [N, K] copy the plugin makes of a [K, N] weight
    b = nk if trans_b else nk.T
    op, attrs = ("Gemm", {"transB": 1}) if trans_b else ("MatMul", {})
    if trans_b:
        a_, r_ = a_.reshape(1, k_len), r_.reshape(1, width)
    out = (*a_.shape[:-1], width)
    nodes = [n(op, (1, 2), (3,), attrs), n("Add", (3, 4), (5,))]
    values = {1: (a_.shape, dtype), 2: (b.shape, dtype), 3: (out, dtype), 4: (out, dtype), 5: (out, dtype)}
    spec = _spec("product", nodes, values, [1, 2, 4], [5])
    specs = dict(spec.values)
    specs[2] = codegen.TensorSpec(b.shape, dtype, tuple(st // b.itemsize for st in b.strides))
    spec = dataclasses.replace(spec, values=specs, params={"lanes": lanes, "fixed_b": 1})
    kernel = codegen.generate(spec)
    assert kernel.vector_args == (2,)
    body = kernel.source.split("\n")
    weight = kernel.args.index(2)
    waits = [k for k, line in enumerate(body) if "DSP_WAIT();" in line]
    preload = next(k for k, line in enumerate(body) if f"dsp_pre16(in{weight}" in line)
    # every other load (the row of A, the residual) and the store
    touches = [k for k, line in enumerate(body) if re.search(r"\b(in[0-9]+|out[0-9]+)\[", line) and k != preload]
    assert len(waits) == 1 and preload < waits[0] < min(touches), kernel.source
    assert all(not body[k - 1].lstrip().startswith("#pragma") for k in waits), kernel.source  # pragmas precede loops
    if NVRTC_MISSING is None:  # griddepcontrol needs sm_90
        cubin = compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
        _assert_preloads_before_the_wait(cubin, kernel.name)
    got = hostcheck.run_on_host(kernel, spec, {1: a_, 2: b, 4: r_})[5]
    f = np.float64
    want = (a_.astype(f) @ w_.astype(f)).astype(cast).astype(f) + r_.astype(f)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got.astype(f), want.astype(cast).astype(f), rtol=tol, atol=tol * 8)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("offset", [0, 1])  # A's address a multiple of 16 bytes, and one half past it
def test_a_products_input_row_is_read_16_bytes_a_load_where_its_address_allows(offset: int) -> None:
    """A (an input of the weight's dtype, K its unit stride) is read 16 bytes a load beside the weight
    when its address is a multiple of 16 (checked where the kernel runs); a view one element off takes
    the element-wise path; both give the product."""
    n = codegen.NodeSpec
    rng = np.random.default_rng(offset)
    k_len, width = 256, 16
    base = rng.standard_normal(k_len + 8).astype(np.float16)
    a = base[offset : offset + k_len].reshape(1, k_len)
    nk = np.ascontiguousarray(rng.standard_normal((width, k_len)).astype(np.float16))
    nodes = [n("Gemm", (1, 2), (3,), {"transB": 1})]
    spec = _spec(
        "product",
        nodes,
        {1: ((1, k_len), "float16"), 2: (nk.shape, "float16"), 3: ((1, width), "float16")},
        [1, 2],
        [3],
    )
    spec = dataclasses.replace(spec, params={"lanes": codegen.WARP, "fixed_b": 1})
    kernel = codegen.generate(spec)
    assert "dsp_aok" in kernel.source and "dsp_v16_at" in kernel.source
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    got = hostcheck.run_on_host(kernel, spec, {1: a, 2: nk})[3]
    want = (a.astype(np.float64) @ nk.T.astype(np.float64)).astype(np.float16)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("cols", [1, 2, 4])
@pytest.mark.parametrize("lanes", [codegen.WARP, codegen.THREADS])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("k_len", [8 * codegen.PRELOAD_VECTORS * 3 + 64, 2112])
def test_several_columns_a_lane_group_give_the_product_and_its_epilogue(
    cols: int, lanes: int, norm: bool, k_len: int
) -> None:
    """DSP_NVRTC_PRODUCT_COLUMNS: a warp (or block) computes ``cols`` adjacent columns, A read once for
    all of them, then each column's epilogue (bias, residual) stored: the product's values, with and
    without a norm prologue, K longer than the preload (2,112 at a warp: nine steps a lane, more than
    the preload's window at 2 and 4 columns, so the rolling window refills, the last step partial)."""
    n = codegen.NodeSpec
    rng = np.random.default_rng(cols + lanes)
    width = 48
    x = (rng.standard_normal((1, k_len)) + 0.3).astype(np.float16)
    nk = np.ascontiguousarray((rng.standard_normal((width, k_len)) / 16).astype(np.float16))
    bias, res = (
        (rng.standard_normal(width) * 0.1).astype(np.float16),
        rng.standard_normal((1, width)).astype(np.float16),
    )
    nodes = [n("Gemm", (2, 3, 4), (5,), {"transB": 1}), n("Add", (5, 6), (7,))]
    values = {2: ((1, k_len), "float16"), 3: (nk.shape, "float16"), 4: ((width,), "float16")}
    values |= {5: ((1, width), "float16"), 6: ((1, width), "float16"), 7: ((1, width), "float16")}
    inputs = [2, 3, 4, 6]
    if norm:
        nodes = [n("RMSNormalization", (1, 8), (2,), {"axis": -1, "epsilon": 1e-6}), *nodes]
        values |= {1: ((1, k_len), "float16"), 8: ((k_len,), "float16")}
        inputs = [1, 8, 3, 4, 6]
    spec = _spec("product", nodes, values, inputs, [7])
    spec = dataclasses.replace(spec, params={"lanes": lanes, "fixed_b": 1, "cols": cols})
    kernel = codegen.generate(spec)
    assert kernel.source.count("dsp_v16 wq") == cols
    assert kernel.grid == -(-(width // cols) * lanes // codegen.THREADS)
    steps, window = -(-k_len // (lanes * 8)), min(-(-k_len // (lanes * 8)), codegen.PRELOAD_VECTORS // cols)
    assert ("const long long kn" in kernel.source) == (window < steps), kernel.source  # the rolling refill
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    gamma = (rng.random(k_len) + 0.5).astype(np.float16)
    arrays = {1: x, 8: gamma, 3: nk, 4: bias, 6: res} if norm else {2: x, 3: nk, 4: bias, 6: res}
    got = hostcheck.run_on_host(kernel, spec, arrays)[7].astype(np.float64)
    f = np.float64
    a = x.astype(f)
    if norm:
        a = (a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * gamma.astype(f)).astype(np.float16).astype(f)
    want = ((a @ nk.T.astype(f)).astype(np.float16).astype(f) + bias).astype(np.float16).astype(f) + res
    np.testing.assert_allclose(got, want.astype(np.float16).astype(f), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("cols", [2, 4])
@pytest.mark.parametrize("graph", ["gated", "qkv"])
def test_merged_products_compute_several_columns_a_lane_group_on_the_host(graph: str, cols: int) -> None:
    """The merged gate/up (paired, SiLU x up, the exported RMSNorm as prologue) and Q/K/V (three parts,
    LayerNorm prologue; columns of one group may fall in two parts) with ``cols`` columns a warp."""
    if graph == "gated":
        built, feeds = _gated_mlp(True, "float16", k=64, n=96)
    else:
        rng = np.random.default_rng(9)
        g = dsp.GraphBuilder()
        x = g.placeholder("x", "float16", [1, 1, 64])
        h = g.LayerNormalization(x, g.constant(np.ones(64, np.float16)), g.constant(np.zeros(64, np.float16)))
        for i, width in enumerate((48, 18, 18)):  # 18: a group of 4 columns straddles the parts
            g.output(h @ g.constant((rng.standard_normal((64, width)) / 8).astype(np.float16)), f"y{i}")
        built, feeds = g.build(), {"x": rng.standard_normal((1, 1, 64)).astype(np.float16)}
    model = dsp.compile(built, mode="slot_by_slot")
    model.run(feeds)
    ((_, _, spec, values),) = hostcheck.group_specs(model, feeds)
    kernel, merged, joined = hostcheck.merged_kernel(spec, lambda v: np.asarray(values[v]), cols)
    assert merged.params["cols"] == cols
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    arrays = {v: joined[v] if v in joined else np.asarray(values[v]) for v in kernel.args[: kernel.n_inputs]}
    got = hostcheck.run_on_host(kernel, merged, arrays)
    for o in merged.outputs:
        want = np.asarray(values[o]).astype(np.float64)
        np.testing.assert_allclose(got[o].astype(np.float64), want, rtol=5e-3, atol=5e-3 * max(1.0, np.abs(want).max()))


def test_the_product_template_says_why_it_declines() -> None:
    n = codegen.NodeSpec
    rows = codegen.MAX_PRODUCT_ROWS + 1
    too_many = _spec(
        "product",
        [n("MatMul", (1, 2), (3,))],
        {1: ((rows, 8), "float32"), 2: ((8, 4), "float32"), 3: ((rows, 4), "float32")},
        [1, 2],
        [3],
    )
    with pytest.raises(codegen.Unsupported, match="rows: cuBLAS"):
        codegen.generate(too_many)
    batched = _spec(
        "product",
        [n("MatMul", (1, 2), (3,))],
        {1: ((2, 3, 8), "float32"), 2: ((2, 8, 4), "float32"), 3: ((2, 3, 4), "float32")},
        [1, 2],
        [3],
    )
    with pytest.raises(codegen.Unsupported, match=r"\[K, N\]"):
        codegen.generate(batched)


def test_constant_weights_of_any_size_take_their_epilogue_and_big_computed_operands_stay_on_cublas() -> None:
    """The policy gives the template every product by a constant weight (one warp per output for
    a big one) and products by a computed operand of at most MAX_PRODUCT_WEIGHTS elements; a
    bigger computed operand runs alone on cuBLAS, its epilogue a kernel of its own."""
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [1, 4, 64])
    wide = codegen.MAX_PRODUCT_WEIGHTS // 32 + 1
    small = g.constant(rng.standard_normal((64, 32)).astype(np.float32))
    big = g.constant(rng.standard_normal((32, wide)).astype(np.float32))
    h = g.Relu(x @ small)
    y = g.Sigmoid(h @ big)
    z = g.placeholder("z", "float32", [wide, 40])
    g.output(g.Tanh(y @ g.Exp(z)), "y")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    model.run({"x": np.full((1, 4, 64), 0.01, np.float32), "z": np.zeros((wide, 40), np.float32)})
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    ops = [(g.template, [plan.slots[s].op for s in g.slots]) for g in result.groups]
    assert ("product", ["MatMul", "Relu"]) in ops and ("product", ["MatMul", "Sigmoid"]) in ops, ops
    assert ("matmul", ["MatMul"]) in ops and any(t == "pointwise" and o[0] == "Tanh" for t, o in ops), ops


def test_nvrtc_generates_no_op_that_dsp_triton_does_not() -> None:
    """Why a segment's groups are not split between Triton and NVRTC kernels (docs/nvrtc.md): every
    op NVRTC_JIT's templates generate, Triton's do too, so a group Triton declines for its op
    would be declined by NVRTC as well; NVRTC_JIT is for machines without Triton."""
    from dsp_triton import codegen as triton_codegen

    assert codegen.SUPPORTED_OPS <= triton_codegen.SUPPORTED_OPS | triton_codegen.PRODUCT_OPS


def test_reference_specs_give_inputs_their_element_strides_and_name_the_device_inputs() -> None:
    """One helper builds both generators' value specs from a reference run (dsp_core.plan.kernelspec)."""
    from dsp_core.plan.kernelspec import Unsupported, reference_specs

    class Device:  # a stand-in for a CuPy array: not a numpy array
        def __init__(self, a: np.ndarray) -> None:
            self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides

    x = np.zeros((4, 6), np.float32).T  # a transposed input: strides (1, 6) in elements
    local = {1: Device(x), 2: np.ones(3, np.int64), 3: np.zeros((6, 4), np.float16), 4: None}
    values, device = reference_specs(local, (1, 2), [local[1], local[2]])
    assert values[1] == codegen.TensorSpec((6, 4), "float32", (1, 6))
    assert values[3] == codegen.TensorSpec((6, 4), "float16", None)  # computed inside: no strides
    assert 4 not in values and device == [1]
    odd = np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), shape=(3,), strides=(6,))
    with pytest.raises(Unsupported, match="not in whole elements"):
        reference_specs({1: odd}, (1,), [odd])


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd_kernels_compile_and_match_the_reference_on_the_host(batch_dims: int) -> None:
    from test_triton_cpu import _gather_nd_feeds, _gather_nd_graph

    model = dsp.compile(_gather_nd_graph(batch_dims), mode="slot_by_slot")
    results = hostcheck.check_model(model, _gather_nd_feeds(batch_dims))
    picks = [r for r in results if "GatherND" in r.ops]
    assert len(picks) == 1 and picks[0].status == "ok", results


# -- merged sibling products (dsp::MergedMatMul) as one kernel ----------------------------------
@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("form", ["MatMul", "Gemm"])
@pytest.mark.parametrize("lead", [(1, 1), (3,)])  # a decode row; three rows
def test_merged_products_are_one_kernel_over_their_joined_weights(form: str, dtype: str, lead: tuple[int, ...]) -> None:
    """Q/K/V-like parts of widths 24, 8, 8 (Gemm: transposed weights, biases, alpha): each part's
    output equals its own product, rounded as the reference rounds (the product, then the bias)."""
    rng = np.random.default_rng(len(lead))
    k, widths = 40, (24, 8, 8)
    a = rng.standard_normal((*lead, k)).astype(dtype)
    gemm = form == "Gemm"
    ws = [rng.standard_normal((n, k) if gemm else (k, n)).astype(dtype) for n in widths]
    cs = [rng.standard_normal(n).astype(dtype) for n in widths] if gemm else []
    outs = tuple(range(20, 20 + len(widths)))
    ins = (1, *range(2, 2 + len(ws)), *range(10, 10 + len(cs)))
    attrs = {"form": form, "transB": 1, "alpha": 0.5, "beta": 1.0, "bias": 1} if gemm else {"form": form}
    node = codegen.NodeSpec("MergedMatMul", ins, outs, attrs, domain="dsp")
    joined = np.ascontiguousarray(np.concatenate([w if gemm else w.T for w in ws], axis=0))
    arrays = {1: a, codegen.MERGED_B: joined}
    if gemm:
        arrays[codegen.MERGED_C] = np.concatenate(cs)
    values = {
        v: codegen.TensorSpec(x.shape, dtype, tuple(st // x.itemsize for st in x.strides)) for v, x in arrays.items()
    }
    values |= {w: codegen.TensorSpec(x.shape, dtype, None) for w, x in zip(ins[1:], [*ws, *cs])}
    values |= {o: codegen.TensorSpec((*lead, n), dtype) for o, n in zip(outs, widths)}
    kernel = codegen.merged_product(node, values)
    assert kernel.name.startswith("dsp_mm_") and kernel.args[-len(outs) :] == outs
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
    spec = codegen.GroupSpec("product", [node], values, list(kernel.args[: kernel.n_inputs]), list(outs))
    got = hostcheck.run_on_host(kernel, spec, arrays)
    f = np.float64
    for o, w, c in zip(outs, ws, cs or [None] * len(ws)):
        prod = a.astype(f) @ (w.T if gemm else w).astype(f)
        if gemm:
            prod = (0.5 * prod).astype(dtype).astype(f) + c.astype(f)
        tol = 2e-2 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(got[o].astype(f), prod.astype(dtype).astype(f), rtol=tol, atol=tol * 4)


def test_merged_products_are_one_product_group_and_their_epilogues_run_apart() -> None:
    """Three parts (Q/K/V): each part's epilogue is a kernel of its own."""
    from dsp_nvrtc.segment import unfused_reason

    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, 64])
    for i, n in enumerate((64, 16, 16)):
        g.output(g.Relu(x @ g.constant(rng.standard_normal((64, n)).astype(np.float16))), f"y{i}")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    model.run({"x": np.ones((1, 1, 64), np.float16)})
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    merged = [gr for gr in result.groups if [plan.slots[s].op for s in gr.slots] == ["MergedMatMul"]]
    assert len(merged) == 1 and merged[0].template == "product" and unfused_reason(plan, merged[0]) is None
    assert sum("an epilogue fuses only into two merged MatMuls" in b.reason for b in result.boundaries) == 3


def _gated_mlp(rms_chain: bool, dtype: str = "float16", k: int = 64, n: int = 96) -> tuple[Any, dict[str, Any]]:
    """RMSNorm (the exported chain, or the op) -> gate and up (merged by the core) -> SiLU(gate) x up."""
    rng = np.random.default_rng(3)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", dtype, [1, 1, k])
    w = g.constant((1 + 0.1 * rng.standard_normal(k)).astype(dtype))
    if rms_chain:
        x32 = g.Cast(x, to=1)
        mean = g.ReduceMean(g.Pow(x32, g.constant(np.array(2.0, np.float32))), g.constant(np.array([-1])))
        inv = g.Reciprocal(g.Sqrt(g.Add(mean, g.constant(np.array(1e-6, np.float32)))))
        h = g.Mul(g.Cast(g.Mul(x32, inv), to=10 if dtype == "float16" else 1), w)
    else:
        h = g.RMSNormalization(x, w, axis=-1, epsilon=1e-6)
    gate = h @ g.constant((rng.standard_normal((k, n)) / 8).astype(dtype))
    up = h @ g.constant((rng.standard_normal((k, n)) / 8).astype(dtype))
    g.output(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), "y")
    feeds = {"x": rng.standard_normal((1, 1, k)).astype(dtype)}
    return g.build(), feeds


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("rms_chain, dtype", [(True, "float16"), (True, "float32"), (False, "float16")])
def test_a_norm_then_gate_and_up_then_silu_times_up_is_one_kernel_on_the_host(rms_chain: bool, dtype: str) -> None:
    """The norm (the exported chain's mean, or RMSNormalization) as the merged product's prologue, each
    warp computing column c of gate and of up, then SiLU(gate) x up on the pair: one group, one kernel,
    the reference's result."""
    graph, feeds = _gated_mlp(rms_chain, dtype)
    model = dsp.compile(graph, mode="slot_by_slot")
    model.run(feeds)
    plan = model.plan()
    assert plan is not None
    groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy()).groups
    assert len(groups) == 1 and groups[0].template == "product", [(gr.template, gr.slots) for gr in groups]
    results = hostcheck.check_model(model, feeds)
    assert [r.status for r in results] == ["ok"], results
    ops = [op for op in results[0].ops if op != "Identity"]  # the output's name
    assert ops[-4:] == ["MergedMatMul", "Sigmoid", "Mul", "Mul"], ops


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("k_len", [64, 4096])  # a warp per column; a block per column (long K, few outputs)
def test_a_norm_then_qkv_parts_of_different_widths_is_one_kernel_storing_each_part(k_len: int) -> None:
    """LayerNorm -> Q, K, V (widths 48, 16, 16) merged: the joined product's columns, each stored to its part."""
    rng = np.random.default_rng(5)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, k_len])
    h = g.LayerNormalization(
        x, g.constant(np.ones(k_len, np.float16)), g.constant(np.zeros(k_len, np.float16)), axis=-1
    )
    for i, n in enumerate((48, 16, 16)):
        g.output(h @ g.constant((rng.standard_normal((k_len, n)) / 16).astype(np.float16)), f"y{i}")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    feeds = {"x": rng.standard_normal((1, 1, k_len)).astype(np.float16)}
    model.run(feeds)
    results = hostcheck.check_model(model, feeds)
    assert [(r.status, r.ops) for r in results] == [("ok", ["LayerNormalization", "MergedMatMul"])], results
    specs = hostcheck.group_specs(model, feeds)
    kernel, spec, _ = hostcheck._kernel(specs[0][2], specs[0][3])
    assert spec.params["lanes"] == codegen.lanes_for(k_len, 80, "float16")
    assert kernel.source.count("out") >= 3 and "dsp_pro" in kernel.source


# -- the KV store (dsp::KVScatter) as one kernel ------------------------------------------------
def _stored_on_host(buffer: np.ndarray, update: np.ndarray, position: np.ndarray, axis: int = -2) -> np.ndarray:
    """codegen.kv_store's kernel (compiled by NVRTC where it is installed) run on the host: the buffer after it."""
    node = codegen.NodeSpec("KVScatter", (0, 1, 2), (3,), {"axis": axis}, domain="dsp")
    values = {
        k: codegen.TensorSpec(x.shape, str(x.dtype), tuple(st // x.itemsize for st in x.strides))
        for k, x in enumerate((buffer, update, position))
    }
    kernel = codegen.kv_store(node, values)
    assert kernel.name.startswith("dsp_kv_") and kernel.args == (1, 2, 0) and kernel.n_inputs == 2
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
    spec = codegen.GroupSpec("store", [node], values, [1, 2], [0])
    out = buffer.copy()
    got = hostcheck.run_on_host(kernel, spec, {0: out, 1: update, 2: position})[0]
    assert got is out  # written in place
    return out


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("pos_dtype", ["int64", "int32"])
@pytest.mark.parametrize(
    "rows, start",
    [(1, 3), (3, 5), (1, 0), (2, -2)],  # one decode row; a prompt's rows; the first; from the end
)
def test_the_kv_store_kernel_writes_the_rows_the_reference_writes(
    dtype: str, pos_dtype: str, rows: int, start: int
) -> None:
    from dsp_core.ops.llm import kv_scatter

    rng = np.random.default_rng(rows * 10 + start)
    buffer = rng.standard_normal((1, 2, 8, 4)).astype(dtype)
    update = rng.standard_normal((1, 2, rows, 4)).astype(dtype)
    position = np.array([start], pos_dtype)
    want = kv_scatter(types.SimpleNamespace(xp=np), buffer.copy(), update, position)
    np.testing.assert_array_equal(_stored_on_host(buffer, update, position), want)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_the_kv_store_reads_strided_rows_and_writes_nothing_outside_the_buffer() -> None:
    rng = np.random.default_rng(1)
    buffer = np.zeros((2, 6, 3), np.float32)  # [B, L, D], axis 1
    update = np.ascontiguousarray(rng.standard_normal((2, 3, 2)).astype(np.float32)).transpose(
        0, 2, 1
    )  # [2, 2, 3] view
    got = _stored_on_host(buffer, update, np.array([1], np.int64), axis=1)
    want = buffer.copy()
    want[:, 1:3] = update
    np.testing.assert_array_equal(got, want)
    # rows past the end are not written (the reference raises there; the pipeline never asks)
    tail = _stored_on_host(buffer, update, np.array([5], np.int64), axis=1)
    want = buffer.copy()
    want[:, 5:6] = update[:, :1]
    np.testing.assert_array_equal(tail, want)


def test_the_kv_store_declines_what_it_cannot_write() -> None:
    node = codegen.NodeSpec("KVScatter", (0, 1, 2), (3,), {"axis": -2}, domain="dsp")

    def spec(b: tuple[int, ...], u: tuple[int, ...], ub: str = "float32", pos: str = "int64") -> dict[int, Any]:
        return {
            0: codegen.TensorSpec(b, "float32", tuple(codegen.row_major(b))),
            1: codegen.TensorSpec(u, ub, tuple(codegen.row_major(u))),
            2: codegen.TensorSpec((1,), pos, (1,)),
        }

    with pytest.raises(codegen.Unsupported, match="the reference casts"):
        codegen.kv_store(node, spec((1, 8, 4), (1, 1, 4), ub="float16"))
    with pytest.raises(codegen.Unsupported, match="a position of float32"):
        codegen.kv_store(node, spec((1, 8, 4), (1, 1, 4), pos="float32"))
    with pytest.raises(codegen.Unsupported, match="for a buffer of"):
        codegen.kv_store(node, spec((1, 8, 4), (1, 1, 5)))


def test_a_decode_plans_kv_stores_join_the_kernel_that_makes_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's decode plan: both stores of a layer join the copy group that splits the QKV product
    and lays out K and V (one kernel a layer where there were two store kernels); Llama's K store
    joins its rotary, its V store the merged Q/K/V product. DSP_NVRTC_KV_FUSION=0: each
    dsp::KVScatter is a store group of its own, which dsp-nvrtc generates too (NvrtcKVStore: one
    kernel where the reference launches four)."""
    from dsp_nvrtc.segment import unfused_reason

    def stores(name: str) -> tuple[Any, list[Any]]:
        plan = _decode_plan(name, "pipeline")
        assert plan is not None
        groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy()).groups
        return plan, [g for g in groups if any(plan.slots[s].op == "KVScatter" for s in g.slots)]

    plan, found = stores("gpt2_eager")
    assert len(found) == 2 and all(g.template == "copy" and g.kernels == 1 for g in found)  # 2 layers
    assert all(sum(plan.slots[s].op == "KVScatter" for s in g.slots) == 2 for g in found)
    assert all(unfused_reason(plan, g) is None for g in found)
    plan, found = stores("llama_eager")
    rotary = [g for g in found if any(plan.slots[s].op == "Neg" for s in g.slots)]
    assert len(found) == 4 and len(rotary) == 2, [[plan.slots[s].op for s in g.slots] for g in found]
    # V's store: the merged Q/K/V product's kernel writes V's row through its reshape and transpose
    products = [g for g in found if g.template == "product"]
    assert len(products) == 2 and all(any(plan.slots[s].op == "MergedMatMul" for s in g.slots) for g in products)
    monkeypatch.setenv("DSP_NVRTC_KV_FUSION", "0")
    plan, found = stores("gpt2_eager")
    assert len(found) == 4 and all(g.template == "store" and len(g.slots) == 1 for g in found)
    assert all(unfused_reason(plan, g) is None for g in found)


def _decode_step(name: str, length: int = 16) -> tuple[dsp.CompiledModel, dict[str, np.ndarray]]:
    """The fixture's decode step over fixed KV buffers of ``length`` (``fixed_kv_buffers``), on the
    reference, with the golden step 1's past in the buffers and its token at position 7."""
    from dsp_core.llm.kv import fixed_kv_buffers

    golden = np.load(FIXTURES / f"{name}.golden.npz")
    fixed = fixed_kv_buffers(dsp.compile(FIXTURES / f"{name}.onnx").graph, batch=1, max_length=length)
    decode = dsp.compile(fixed.graph, mode="slot_by_slot")
    feeds: dict[str, np.ndarray] = {}
    for n, shape in fixed.buffer_shapes.items():
        past = golden[f"step1.{n}"]
        feeds[n] = np.zeros(shape, past.dtype)
        feeds[n][:, :, : past.shape[2]] = past
    mask = np.zeros((1, length), np.int64)
    mask[:, :8] = 1
    feeds.update(
        input_ids=golden["step1.input_ids"],
        attention_mask=mask,
        position_ids=golden["step1.position_ids"],
        kv_position=np.array([7]),
    )
    return decode, {k: v for k, v in feeds.items() if k in decode.input_names}


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("name", ["gpt2_eager", "gpt2_sdpa23", "llama_eager", "llama_sdpa23"])
def test_kernels_with_kv_stores_write_the_rows_the_reference_writes_on_the_host(name: str) -> None:
    """Each generated kernel of a decode step, run on the host; a kernel with KV stores starts from the
    buffers as the reference left them with its new rows poisoned (NaN), so a row it does not write,
    or writes elsewhere, fails the comparison."""
    decode, feeds = _decode_step(name)
    results = hostcheck.check_model(decode, feeds, nvrtc=NVRTC_MISSING is None)
    assert not [r for r in results if r.status in ("mismatch", "error")], results
    with_stores = [r for r in results if "KVScatter" in r.ops and r.template != "store"]  # a store alone: kv_store
    assert len(with_stores) >= 2 and all(r.status == "ok" for r in with_stores), with_stores


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("cols", [1, 2, 4])
def test_the_merged_qkv_product_writes_vs_kv_row_through_its_layout(cols: int) -> None:
    """Llama's decode step: the norm, the merged Q/K/V product, V's reshape and transpose and V's KV
    store are one kernel (the store's index mapped forward from V's column); started from the buffer
    with the new row poisoned, it writes the reference's row, with 1, 2 or 4 columns a lane group."""
    decode, feeds = _decode_step("llama_eager")
    found = [(spec, values) for _, _, spec, values in hostcheck.group_specs(decode, feeds)]
    merged = [(spec, values) for spec, values in found if any(n.op == "KVScatter" for n in spec.nodes)]
    merged = [(spec, values) for spec, values in merged if codegen.merged_index(spec) >= 0]
    assert len(merged) == 2, [[n.op for n in spec.nodes] for spec, _ in found]  # two layers
    for spec, values in merged:
        kernel, mspec, joined = hostcheck.merged_kernel(spec, lambda v, got=values: np.asarray(got[v]), cols)
        assert kernel.kv_stores and [n.op for n in mspec.nodes][-3:] == ["Reshape", "Transpose", "KVScatter"]
        arrays = {v: joined[v] if v in joined else np.asarray(values[v]) for v in kernel.args[: kernel.n_inputs]}
        for out, _ in kernel.kv_stores:
            arrays[out] = hostcheck._poisoned_rows(mspec, out, values)
        got = hostcheck.run_on_host(kernel, mspec, arrays)
        for o in mspec.outputs:
            want = np.asarray(values[o]).astype(np.float64)
            np.testing.assert_allclose(got[o].astype(np.float64), want, rtol=1e-4, atol=1e-4, err_msg=str(o))


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_the_host_check_sees_a_kv_row_written_to_the_wrong_place(monkeypatch: pytest.MonkeyPatch) -> None:
    real = codegen._kv_store

    def one_row_off(gen: Any, k: int, node: Any, idx: Any) -> None:
        real(gen, k, node, idx)
        gen.scope.lines[-1] = gen.scope.lines[-1].replace("] = ", " + 64] = ")

    monkeypatch.setattr(codegen, "_kv_store", one_row_off)
    decode, feeds = _decode_step("gpt2_eager")
    results = hostcheck.check_model(decode, feeds, nvrtc=False)
    bad = [r for r in results if "KVScatter" in r.ops]
    assert bad and all(r.status == "mismatch" for r in bad), bad


def test_a_kv_store_kernel_writes_through_the_buffers_pointer_at_the_device_position() -> None:
    """The copy kernel of GPT-2's split: its outputs are q, then the two buffers (their pointers: the
    stores' outputs are the buffers, in place); the position is an input, read after the wait."""
    decode, feeds = _decode_step("gpt2_eager")
    groups = hostcheck.group_specs(decode, feeds)
    specs = [spec for _, _, spec, _ in groups if "KVScatter" in [n.op for n in spec.nodes]]
    assert specs
    kernel = codegen.generate(specs[0])
    stores = [n for n in specs[0].nodes if n.op == "KVScatter"]
    assert kernel.kv_stores == tuple((n.outputs[0], n.inputs[0]) for n in stores)
    outs = kernel.args[kernel.n_inputs :]
    assert [v for v, _ in kernel.kv_stores] == list(outs[-2:])
    assert all(n.inputs[0] not in kernel.args[: kernel.n_inputs] for n in stores)  # a buffer is never loaded
    assert stores[0].inputs[2] in kernel.args[: kernel.n_inputs]
    body = kernel.source
    assert body.index("DSP_WAIT();") < body.index("(long long)in")
    assert kernel.source.count(f"< {specs[0].values[stores[0].inputs[0]].shape[2]}) out") == 2


# -- the greedy pick (dsp::Sample at temperature 0, ArgMax over the last axis) ---------------
def _picked_on_host(x: np.ndarray) -> np.ndarray:
    """codegen.argmax_rows' two kernels compiled by NVRTC and run on the host over ``x`` [B, V]."""
    dtype = "bfloat16" if x.dtype.name == "bfloat16" else str(x.dtype)
    item = x.dtype.itemsize
    spec = codegen.TensorSpec(tuple(x.shape), dtype, tuple(s // item for s in x.strides))
    first, second = codegen.argmax_rows(spec)
    first_spec, second_spec = codegen.argmax_specs(spec, first)
    for kernel in (first, second):
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
    bits = x.view(np.dtype(f"int{codegen.ORDERED_KEY_BITS[dtype][0]}"))
    chunks = hostcheck.run_on_host(first, first_spec, {0: bits})
    return hostcheck.run_on_host(second, second_spec, {1: chunks[1], 2: chunks[2]})[3]


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_greedy_pick_kernels_give_numpys_argmax_on_the_host(dtype: str) -> None:
    """One and many chunks, a strided [B, S, V][:, -1] view, ties (the first index), NaN (the first
    NaN), -0 against +0, a row of -inf; the kernels compile with NVRTC and run on the host."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    for rows, vocab, view in ((1, 50257, False), (2, 3000, True), (3, 7, False), (2, 1025, True)):
        full = rng.standard_normal((rows, 3, vocab) if view else (rows, vocab)).astype(np_dtype)
        x = full[:, -1] if view else full
        x[..., -1] = x.max(axis=-1)  # ties with an earlier maximum
        x[0, vocab // 2] = np.nan
        x[-1, :] = np.where(np.arange(vocab) % 2, -np.inf, -0.0).astype(np_dtype)
        x[-1, 5] = 0.0  # +0 after -0: the first zero is the pick
        np.testing.assert_array_equal(_picked_on_host(x), np.argmax(x.astype(np.float64), axis=-1))


def test_the_greedy_pick_declines_what_it_cannot_key() -> None:
    with pytest.raises(codegen.Unsupported, match="int32"):
        codegen.argmax_rows(codegen.TensorSpec((1, 10), "int32"))
    with pytest.raises(codegen.Unsupported, match=r"\[2, 3, 4\]"):
        codegen.argmax_rows(codegen.TensorSpec((2, 3, 4), "float32"))
    first, second = codegen.argmax_rows(codegen.TensorSpec((2, 128256), "float16"))
    assert (first.grid, second.grid) == (2 * 126, 2) and first.template == second.template == "argmax"
    assert "const short* __restrict__ in0" in first.source  # fp16 logits read as their bits


def test_the_pick_layout_reduces_the_last_axis_of_device_arrays_only() -> None:
    from dsp_cuda_graphs.greedy import PickLayout

    class Device:  # what PickLayout asks of a device array
        def __init__(self, x: np.ndarray) -> None:
            self.x, self.data, self.ndim, self.shape = x, object(), x.ndim, x.shape

        def __getitem__(self, key: Any) -> Any:
            return self.x[key]

        def reshape(self, *shape: Any) -> Any:
            return self.x.reshape(*shape)

    logits = np.arange(24.0).reshape(2, 3, 4)
    sample = PickLayout(sample=True)
    assert sample.takes(Device(logits)) and not sample.takes(logits)  # a host array: the reference
    assert sample.rows(Device(logits)).shape == (2, 4) and sample.shape(logits) == (2, 1)
    argmax = PickLayout(sample=False, keepdims=False, axis=-1)
    assert argmax.takes(Device(logits)) and argmax.rows(Device(logits)).shape == (6, 4)
    assert argmax.shape(logits) == (2, 3)
    assert not PickLayout(sample=False, axis=1).takes(Device(logits))  # not the last axis


# -- decode attention (T4): one block per (batch, head) ---------------------------------------
def _attention_graphs() -> Any:
    """tests/triton_interp/attention_graphs.py: the exporters' decode-attention chain, GQA 1, 3, 4."""
    folder = str(Path(__file__).parent / "triton_interp")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import attention_graphs

    return attention_graphs


ATTENTION_CASES = _attention_graphs().CASES


def _attention_model(case: tuple[int, ...], dtype: str = "float32") -> tuple[dsp.CompiledModel, dict[str, Any]]:
    ag = _attention_graphs()
    heads, kv, length, valid, dim = case
    model = ag.model(heads, kv, length, dim, "slot_by_slot", dtype)
    feeds = ag.feeds(heads, kv, length, valid, dim, dtype)
    model.run(feeds)
    return model, feeds


def _one_attention_group_per_layer(plan: Any, groups: list[Any], layers: int) -> list[Any]:
    from dsp_nvrtc.segment import unfused_reason

    attention = [g for g in groups if g.template == "decode_attention"]
    assert len(attention) == layers, [(g.template, [plan.slots[s].op for s in g.slots]) for g in groups]
    for g in attention:
        ops = [plan.slots[s].op for s in g.slots]
        assert ops.count("MatMul") == 2 and ops.count("Softmax") == 1, ops
        assert unfused_reason(plan, g) is None
        assert len(g.outputs) == 1  # only the weighted sum leaves the kernel
    assert not [g for g in groups if g.template == "scores"]
    softmax = [g for g in groups if "Softmax" in {plan.slots[s].op for s in g.slots}]
    assert all(g.template == "decode_attention" for g in softmax)
    return attention


@pytest.mark.usefixtures("nvrtc_attention")
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_is_one_group_reading_k_and_v_through_their_index_arithmetic(case: tuple[int, ...]) -> None:
    model, _ = _attention_model(case)
    plan = model.plan()
    assert plan is not None
    groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy()).groups
    (g,) = _one_attention_group_per_layer(plan, groups, 1)
    ops = [plan.slots[s].op for s in g.slots]
    gqa = case[0] != case[1]
    assert ops.count("Expand") == (2 if gqa else 0) and ops.count("Transpose") == 1, ops  # no K/V copies
    assert ops.count("Cast") == 1


@pytest.fixture
def nvrtc_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSP_NVRTC_ATTENTION on (the default), whatever the environment says."""
    monkeypatch.setenv("DSP_NVRTC_ATTENTION", "1")


def test_decode_attention_is_on_by_default() -> None:
    from dsp_core import config

    assert config.get("nvrtc_attention", env={}) is True


def test_without_decode_attention_the_products_stay_on_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """With DSP_NVRTC_ATTENTION=0 the scores and the weighted sum are matmul groups (cuBLAS), the
    softmax a row kernel, and the boundary says why."""
    monkeypatch.setenv("DSP_NVRTC_ATTENTION", "0")
    plan = _decode_plan("gpt2_eager", "fixture")
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    templates = [g.template for g in result.groups]
    assert "decode_attention" not in templates and templates.count("matmul") == 4, templates
    assert any("DSP_NVRTC_ATTENTION is off" in b.reason for b in result.boundaries)


def _decode_plan(name: str, source: str) -> Any:
    if source == "pipeline":
        from dsp_core.llm import GenerationPipeline

        pipe = GenerationPipeline(str(FIXTURES / f"{name}.onnx"), mode="slot_by_slot")
        pipe.generate(np.array([[1, 2, 3]], np.int64), max_new_tokens=3)
        return pipe.decode_model.plan()
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    model.run(_feeds(name, model))  # the golden step 1: one new token over the past
    return model.plan()


@pytest.mark.usefixtures("nvrtc_attention")
@pytest.mark.parametrize("source", ["fixture", "pipeline"])
@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_the_decoders_attention_is_one_decode_attention_group_per_layer(name: str, source: str) -> None:
    plan = _decode_plan(name, source)
    assert plan is not None
    groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy()).groups
    _one_attention_group_per_layer(plan, groups, 2)  # the 2-layer fixtures


def _softmax_graph(weight_constant: bool = False, axis: int = -1, scores_out: bool = False, rows: int = 1) -> Any:
    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float32", [1, 4, rows, 16])
    k = g.constant(rng.standard_normal((16, 32)).astype(np.float32)) if weight_constant else None
    scores = g.MatMul(x, k if k is not None else g.placeholder("k", "float32", [1, 4, 16, 32]))
    probs = g.Softmax(scores, axis=axis)
    g.output(g.MatMul(probs, g.placeholder("v", "float32", [1, 4, 32, 8])), "y")
    if scores_out:
        g.output(scores, "scores")
    return g.build()


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"weight_constant": True}, "a product by a constant weight is a projection, not attention"),
        ({"axis": 1}, "a softmax over another axis"),
        ({"scores_out": True}, "scores read outside the group"),
        ({"rows": 5}, "five query rows: the products stay on cuBLAS"),
    ],
)
def test_what_is_not_decode_attention_groups_as_before(kw: dict[str, Any], why: str, tmp_path: Path) -> None:
    import onnx

    from dsp_core.ir.onnx_export import to_onnx

    path = tmp_path / "m.onnx"
    onnx.save(to_onnx(_softmax_graph(**kw)), str(path))
    model = dsp.compile(path, mode="slot_by_slot")
    rng = np.random.default_rng(1)
    shapes = {"x": (1, 4, kw.get("rows", 1), 16), "k": (1, 4, 16, 32), "v": (1, 4, 32, 8)}
    model.run({n: rng.standard_normal(shapes[n]).astype(np.float32) for n in model.input_names})
    plan = model.plan()
    assert plan is not None
    groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy()).groups
    assert not [g for g in groups if g.template == "decode_attention"], why
    assert not [g for g in groups if g.template == "scores"], why  # no scores group left over
    products = [g for g in groups if any(plan.slots[s].op == "MatMul" for s in g.slots)]
    assert len(products) == 2 and all(g.template in ("matmul", "product") and len(g.slots) == 1 for g in products)


@pytest.mark.usefixtures("nvrtc_attention")
@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_the_decode_attention_kernel_compiles_for_sm90_and_matches_the_reference_on_the_host(
    case: tuple[int, ...], dtype: str
) -> None:
    """GQA ratios 1, 3, 4; valid lengths 1, 255, 257, L-1 and L of the KV buffer (the rest masked)."""
    model, feeds = _attention_model(case, dtype)
    results = hostcheck.check_model(model, feeds)
    assert not [r for r in results if r.status not in ("ok", "unsupported")], results
    assert [r.status for r in results if r.template == "decode_attention"] == ["ok"], results
    specs = hostcheck.group_specs(model, feeds)
    found = [(spec, values) for _, g, spec, values in specs if g.template == "decode_attention"]
    assert len(found) == 1
    spec, values = found[0]
    kernel = codegen.generate(spec)
    heads = case[0]
    assert kernel.name.startswith("dsp_attn_") and kernel.grid == heads and kernel.threads == codegen.ATTENTION_THREADS
    assert kernel.source.count("out0[") == 1 and "Expand" not in kernel.source  # stores only the weighted sum
    assert "DSP_WAIT();" in kernel.source and "__syncthreads();" in kernel.source
    compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    got = hostcheck.run_on_host(kernel, spec, {v: np.asarray(values[v]) for v in kernel.args[: kernel.n_inputs]})
    (out,) = spec.outputs
    want = np.asarray(values[out]).astype(np.float64)
    tol = 2e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(got[out].astype(np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def _attention_spec(dtype: str, rows: int = 1, length: int = 300, heads: int = 4, dim: int = 16) -> codegen.GroupSpec:
    """Transpose(K), q.Kt, x 0.25, + mask, Softmax, Cast, @ V over [1, heads, length, dim] caches."""
    n = codegen.NodeSpec
    nodes = [
        n("Transpose", (2,), (3,), {"perm": [0, 1, 3, 2]}),
        n("MatMul", (1, 3), (4,)),
        n("Mul", (4, 10), (5,)),
        n("Add", (5, 11), (6,)),
        n("Softmax", (6,), (7,), {"axis": -1}, opset=13),
        n("Cast", (7,), (8,), {"to": 1}),
        n("MatMul", (8, 9), (12,)),
    ]
    q, kv, s = (1, heads, rows, dim), (1, heads, length, dim), (1, heads, rows, length)
    values = {1: (q, dtype), 2: (kv, dtype), 3: ((1, heads, dim, length), dtype), 4: (s, dtype), 5: (s, dtype)}
    values |= {6: (s, dtype), 7: (s, dtype), 8: (s, "float32"), 9: (kv, "float32"), 10: ((), dtype)}
    values |= {11: ((1, 1, 1, length), dtype), 12: ((1, heads, rows, dim), "float32")}
    scale = np.asarray(0.25, dtype if dtype != "bfloat16" else "float32")
    return _spec("decode_attention", nodes, values, [1, 2, 9, 10, 11], [12], lambda v: scale if v == 10 else None)


def _attention_inputs(spec: codegen.GroupSpec, valid: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {}
    for v in (1, 2, 9):
        tv = spec.values[v]
        arrays[v] = rng.standard_normal(tv.shape).astype(hostcheck._np_dtype(tv.dtype))
    mask = np.zeros(spec.values[11].shape, np.float32)
    mask[..., valid:] = -np.inf
    arrays[11] = mask.astype(hostcheck._np_dtype(spec.values[11].dtype))
    return arrays


def _attention_want(spec: codegen.GroupSpec, x: dict[int, np.ndarray]) -> np.ndarray:
    """The reference's chain in numpy, rounded to the dtype after every op as the reference rounds."""
    dt = hostcheck._np_dtype(spec.values[1].dtype)

    def r(a: np.ndarray) -> np.ndarray:
        return a.astype(dt).astype(np.float64)

    f = {k: a.astype(np.float64) for k, a in x.items()}
    s = r(r(r(f[1] @ f[2].transpose(0, 1, 3, 2)) * 0.25) + f[11])
    e = np.exp(s - s.max(-1, keepdims=True))
    p = r(e / e.sum(-1, keepdims=True)).astype(np.float32).astype(np.float64)
    return p @ f[9]


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("valid", [1, 299, 300])
def test_decode_attention_in_every_half_dtype_matches_numpy_on_the_host(dtype: str, valid: int) -> None:
    spec = _attention_spec(dtype)
    kernel = codegen.generate(spec)
    assert kernel.template == "decode_attention" and kernel.grid == 4
    assert "0.25f" in kernel.source  # the scale: a literal
    compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    x = _attention_inputs(spec, valid)
    got = hostcheck.run_on_host(kernel, spec, {v: x[v] for v in kernel.args[: kernel.n_inputs]})[12]
    want = _attention_want(spec, x)
    tol = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("length, splits, valid", [(300, 4, 300), (300, 4, 1), (300, 7, 299), (300, 5, 130), (5, 4, 5)])
def test_a_split_decode_attention_is_partials_then_one_combine_and_matches_numpy_on_the_host(
    dtype: str, length: int, splits: int, valid: int
) -> None:
    """One block per (head, range of KV positions) stores the range's max, sum and unnormalised weighted
    sum; one combine block per head rescales and merges them. Ranges of unequal lengths (7 of 300), a
    range wholly masked (valid 1), and a last range past the buffer's end (5 positions in 4 ranges of 2)."""
    spec = _attention_spec(dtype, length=length)
    partial, combine = codegen.attention_split_specs(spec, splits)
    kernel, last = codegen.generate(partial), codegen.attention_combine(combine)
    assert kernel.grid == 4 * splits and last.grid == 4 and last.template == "decode_attention_combine"
    assert kernel.args[kernel.n_inputs :] == (codegen.ATT_M, codegen.ATT_L, codegen.ATT_ACC)
    assert last.args == (codegen.ATT_M, codegen.ATT_L, codegen.ATT_ACC, 12)
    for k in (kernel, last):
        compiler.compile_source(k.device_source(), k.name, compiler.Target("sm_90"))
    x = _attention_inputs(spec, valid)
    parts = hostcheck.run_on_host(kernel, partial, {v: x[v] for v in kernel.args[: kernel.n_inputs]})
    got = hostcheck.run_on_host(last, combine, parts)[12]
    want = _attention_want(spec, x)
    tol = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def test_decode_attention_splits_by_the_shared_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """dsp plan fuse counts a decode attention past 256 KV positions as two kernels (partials, combine),
    by the rule the kernels follow; DSP_NVRTC_KV_SPLITS forces a count."""
    from dsp_cuda_graphs import attention

    monkeypatch.setenv("DSP_NVRTC_ATTENTION", "1")
    model, _ = _attention_model((4, 4, 300, 300, 16))
    plan = model.plan()
    assert plan is not None
    policy = NvrtcPolicy()
    (g,) = [g for g in propose_groups(plan, range(len(plan.slots)), policy).groups if g.template == "decode_attention"]
    assert policy.kernels(plan, g.template, g.slots) == 2  # 300 positions: 4 ranges of 75
    assert attention.kv_split_count(4, 300, None) == 4
    monkeypatch.setenv("DSP_NVRTC_KV_SPLITS", "1")
    assert policy.kernels(plan, g.template, g.slots) == 1
    small, _ = _attention_model((4, 4, 128, 128, 16))
    plan = small.plan()
    assert plan is not None
    monkeypatch.delenv("DSP_NVRTC_KV_SPLITS")
    (g,) = [g for g in propose_groups(plan, range(len(plan.slots)), policy).groups if g.template == "decode_attention"]
    assert policy.kernels(plan, g.template, g.slots) == 1  # up to 256 positions: one block a head


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_a_prompts_attention_is_cublas_products_around_one_softmax_kernel() -> None:
    """Query rows the one-block kernel declines (a prompt): the products on their reference steps,
    the scale, mask, softmax and cast between them one generated row kernel."""
    spec = _attention_spec("float16", rows=5)
    with pytest.raises(codegen.Unsupported, match="5 query rows"):
        codegen.generate(spec)
    head, part, tail = codegen.attention_parts(spec)
    assert (head, tail) == ([0, 1], [6]) and [nd.op for nd in part.nodes] == ["Mul", "Add", "Softmax", "Cast"]
    kernel = codegen.generate(part)
    assert kernel.template == "row_reduction" and kernel.args == (4, 11, 8)
    x = _attention_inputs(spec, 200)
    scores = (x[1].astype(np.float32) @ x[2].astype(np.float32).transpose(0, 1, 3, 2)).astype(np.float16)
    probs = hostcheck.run_on_host(kernel, part, {4: scores, 11: x[11]})[8]
    want = _attention_want(spec, x)
    np.testing.assert_allclose(probs.astype(np.float64) @ x[9].astype(np.float64), want, rtol=5e-3, atol=5e-3)


@pytest.mark.usefixtures("nvrtc_attention")
@pytest.mark.skipif(NVRTC_MISSING is not None or CXX_MISSING is not None, reason=str(NVRTC_MISSING or CXX_MISSING))
@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_a_prompts_attention_softmax_part_matches_the_reference_on_the_host(name: str) -> None:
    model = dsp.compile(FIXTURES / f"{name}.onnx", mode="slot_by_slot")
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    results = hostcheck.check_model(model, {n: golden["step0." + n] for n in model.input_names})
    attention = [r for r in results if r.template == "decode_attention"]
    assert len(attention) == 2 and all(r.status == "ok" and r.kernel.startswith("dsp_row_") for r in attention), results


def test_the_decode_attention_kernel_says_what_it_declines() -> None:
    with pytest.raises(codegen.Unsupported, match="KV positions"):
        codegen.generate(_attention_spec("float16", length=codegen.MAX_ATTENTION_POSITIONS + 1))
    with pytest.raises(codegen.Unsupported, match="head dims"):
        codegen.generate(_attention_spec("float16", dim=codegen.MAX_ATTENTION_DIM + 8))
    with pytest.raises(codegen.Unsupported, match="attention over float64"):
        codegen.generate(_attention_spec("float64"))
    spec = _attention_spec("float32")
    relu = codegen.NodeSpec("Relu", (7,), (13,))  # between the softmax and the weighted sum
    nodes = [*spec.nodes[:5], relu, codegen.NodeSpec("MatMul", (13, 9), (12,))]
    values = {**spec.values, 13: codegen.TensorSpec(spec.values[7].shape, "float32")}
    with pytest.raises(codegen.Unsupported, match="ops other than casts"):
        codegen.generate(dataclasses.replace(spec, nodes=nodes, values=values))


# -- a norm as the prologue of its one-row product ---------------------------------------------
def _norm_product_spec(k_len: int, width: int, dtype: str, rows: int, lanes: int) -> codegen.GroupSpec:
    """LayerNorm(x) -> Reshape to [rows, K] -> Gemm by a [K, width] weight with a bias: GPT-2's
    ln_1 and c_attn, as the NVRTC policy groups them for a decode step."""
    n = codegen.NodeSpec
    shape = (1, rows, k_len) if rows == 1 else (rows, 1, k_len)
    nodes = [
        n("LayerNormalization", (1, 2, 3), (4,), {"axis": -1, "epsilon": 1e-5}),
        n("Reshape", (4, 5), (6,)),
        n("Gemm", (6, 7, 8), (9,)),
    ]
    values = {1: (shape, dtype), 2: ((k_len,), dtype), 3: ((k_len,), dtype), 4: (shape, dtype)}
    values |= {5: ((2,), "int64"), 6: ((rows, k_len), dtype), 7: ((k_len, width), dtype), 8: ((width,), dtype)}
    values |= {9: ((rows, width), dtype)}
    target = np.array([rows, k_len], np.int64)
    spec = _spec("product", nodes, values, [1, 2, 3, 5, 7, 8], [9], lambda v: target if v == 5 else None)
    return dataclasses.replace(spec, params={"lanes": lanes} if lanes else {})


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("k_len", [96, 768, 3000])  # rows held in registers, and one longer (looped)
@pytest.mark.parametrize("lanes", [0, codegen.WARP, codegen.THREADS])
def test_a_norm_is_the_prologue_of_its_one_row_product(dtype: str, k_len: int, lanes: int) -> None:
    """One kernel: every block reduces the row, stages it normalised (rounded to the norm's dtype,
    as the reference rounds it) in shared memory and the product reads A from there; no thread
    leaves before the block's barriers (the last block's spare warps compute the last output
    again and store nothing); the result is the reference's (LayerNorm, then the product)."""
    rng = np.random.default_rng(k_len + lanes)
    width = 300
    cast = hostcheck._np_dtype(dtype)
    x = (rng.standard_normal((1, 1, k_len)) * 2 + 0.5).astype(cast)
    gamma, beta = (rng.random(k_len) + 0.5).astype(cast), rng.standard_normal(k_len).astype(cast)
    w, c = (rng.standard_normal((k_len, width)) / 8).astype(cast), rng.standard_normal(width).astype(cast)
    spec = _norm_product_spec(k_len, width, dtype, 1, lanes)
    kernel = codegen.generate(spec)
    source = kernel.source
    assert "dsp_pro[" in source and "__syncthreads();" in source and "return;" not in source, source
    assert kernel.grid * kernel.threads >= width * max(1, lanes)
    if NVRTC_MISSING is None:
        compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    got = hostcheck.run_on_host(kernel, spec, {1: x, 2: gamma, 3: beta, 7: w, 8: c})[9]
    f = np.float64
    xf = x.astype(f)
    mean = xf.mean(-1, keepdims=True)
    ln = ((xf - mean) / np.sqrt(((xf - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma + beta).astype(cast)
    want = ((ln.reshape(1, k_len).astype(f) @ w.astype(f)).astype(cast).astype(f) + c).astype(cast)
    tol = 1e-4 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got.astype(f), want.astype(f), rtol=tol, atol=tol * 8)


@pytest.mark.skipif(CXX_MISSING is not None, reason=str(CXX_MISSING))
def test_a_norm_prologue_over_several_rows_runs_as_parts() -> None:
    """A prompt's layout (3 rows): the kernel declines it, and the group splits into the norm as one
    row kernel storing the product's operand, then the product and its epilogue (reference steps)."""
    spec = _norm_product_spec(96, 40, "float32", 3, codegen.WARP)
    with pytest.raises(codegen.Unsupported, match="one row"):
        codegen.generate(spec)
    head, part, tail = codegen.prologue_parts(spec)
    assert head == [] and [n.op for n in part.nodes] == ["LayerNormalization", "Reshape"] and tail == [2]
    assert part.template == "row_reduction" and part.outputs == [6]
    kernel = codegen.generate(part)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 1, 96)).astype(np.float32)
    gamma, beta = rng.random(96).astype(np.float32) + 0.5, rng.standard_normal(96).astype(np.float32)
    got = hostcheck.run_on_host(kernel, part, {1: x, 2: gamma, 3: beta})[6]
    mean = x.mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(got, want.reshape(3, 96), rtol=1e-5, atol=1e-5)


def test_the_policy_takes_a_norm_into_its_one_row_product_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's decode plan: each ln_1 and ln_2 joins the product after it (c_attn, c_fc), so the norm
    is no group of its own; DSP_NVRTC_NORM_PROLOGUE=0 keeps them apart, with that reason."""
    plan = _decode_plan("gpt2_eager", "pipeline")
    groups = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    norms = [g for g in groups.groups if any(plan.slots[s].op == "LayerNormalization" for s in g.slots)]
    assert len(norms) == 5  # 2 layers x (ln_1, ln_2), and ln_f before the LM head (cuBLAS: no prologue)
    assert sum(g.template == "product" for g in norms) == 4, [(g.template, g.slots) for g in norms]
    monkeypatch.setenv("DSP_NVRTC_NORM_PROLOGUE", "0")
    apart = propose_groups(plan, range(len(plan.slots)), NvrtcPolicy())
    norms = [g for g in apart.groups if any(plan.slots[s].op == "LayerNormalization" for s in g.slots)]
    assert all(g.template == "row_reduction" for g in norms)
    assert any("DSP_NVRTC_NORM_PROLOGUE is off" in b.reason for b in apart.boundaries)


def test_product_lanes_follow_the_measured_rule_and_the_option() -> None:
    """A warp per output up to K 2,048 (a block's reduction costs more than it saves there on the
    H200), a block past it where the outputs are few; DSP_NVRTC_PRODUCT_LANES's choice wins; fp64
    products sum in a warp (the block reduction sums floats)."""
    assert codegen.lanes_for(2048, 3072, "float16") == codegen.WARP  # Llama's Q/K/V
    assert codegen.lanes_for(2048, 2048, "float16") == codegen.WARP  # Llama's output projection
    assert codegen.lanes_for(8192, 2048, "float16") == codegen.THREADS  # Llama's down projection
    assert codegen.lanes_for(3072, 768, "float16") == codegen.THREADS  # GPT-2's down projection
    assert codegen.lanes_for(8192, 16384, "float16") == codegen.WARP  # many outputs: warps fill the GPU
    assert codegen.lanes_for(2048, 3072, "float16", "block") == codegen.THREADS
    assert codegen.lanes_for(8192, 2048, "float16", "warp") == codegen.WARP
    assert codegen.lanes_for(8192, 2048, "float64") == codegen.WARP


def test_product_columns_auto_pays_the_norm_prologue_in_one_wave() -> None:
    """Auto columns: with a norm prologue, the fewest columns a warp that leave at most two blocks a
    multiprocessor (Llama's Q/K/V two, gate/up four on an H200's 132; more on a smaller GPU); without
    one, two where the outputs are 8,192 or more; one on a block's lanes; an explicit choice wins."""
    warp, block = codegen.WARP, codegen.THREADS
    assert codegen.columns_for(0, warp, 3072, True, 132) == 2
    assert codegen.columns_for(0, warp, 8192, True, 132) == 4
    assert codegen.columns_for(0, warp, 8192, True, None) == 4  # unknown device: the H200's count
    assert codegen.columns_for(0, warp, 3072, True, 66) == 4
    assert codegen.columns_for(0, warp, 2304, True, 132) == 2  # GPT-2's LayerNorm + QKV
    assert codegen.columns_for(0, warp, 16384, False, 132) == 2
    assert codegen.columns_for(0, warp, 3072, False, 132) == 1
    assert codegen.columns_for(0, block, 2048, True, 132) == 1
    assert codegen.columns_for(3, warp, 3072, True, 132) == 3


@pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
@pytest.mark.parametrize("cols", [0, 1, 2, 4])
def test_merged_kernels_issue_their_weight_preloads_before_the_wait(cols: int) -> None:
    """The merged gate/up kernel with its norm prologue (at 1, 2 and 4 columns a warp), and (0) two
    sibling products alone, the plain merged kernel: in the SASS for sm_90 the joined weight's
    preloads precede griddepcontrol.wait, so they overlap the kernel before."""
    if cols:
        graph, feeds = _gated_mlp(True, "float16", k=2048, n=256)
    else:
        rng = np.random.default_rng(2)
        g = dsp.GraphBuilder()
        x = g.placeholder("x", "float16", [1, 1, 2048])
        for i in range(2):
            g.output(x @ g.constant((rng.standard_normal((2048, 256)) * 0.02).astype(np.float16)), f"y{i}")
        graph, feeds = g.build(), {"x": rng.standard_normal((1, 1, 2048)).astype(np.float16)}
        cols = 1
    model = dsp.compile(graph, mode="slot_by_slot")
    model.run(feeds)
    specs = hostcheck.group_specs(model, feeds)
    merged = [s for s in specs if codegen.merged_index(s[2]) >= 0]
    assert len(merged) == 1, [s[2].template for s in specs]
    spec, values = merged[0][2], merged[0][3]
    kernel, _, _ = hostcheck.merged_kernel(spec, lambda v: np.asarray(values[v]), cols)
    cubin = compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("sm_90"))
    _assert_preloads_before_the_wait(cubin, kernel.name)
