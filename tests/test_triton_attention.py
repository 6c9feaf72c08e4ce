"""dsp-triton's flash attention on the CPU: an encoder's attention (scores of two activations with
more than 16 rows, scale, padding mask, softmax, weighted sum, the heads' transpose and merge) is
one group, the kernel the generator makes of it, what declines, and (under Triton's interpreter
where it is installed) every tuning config of that kernel against the reference.

The kernel's numbers on the GPU: tests/gpu/test_triton_attention_gpu.py."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from dsp_cpu_ref.slot_by_slot import plan_values
from dsp_cuda_graphs import attention
from dsp_triton import codegen
from dsp_triton.plugin import TritonPolicy, flash_declined
from dsp_triton.segment import node_specs
from test_triton_cpu import _interpreted, _interpreter_missing

import dsp_core as dsp
from dsp_core.ir.onnx_export import to_onnx
from dsp_core.plan.fusion import classify, infer_shapes, propose_groups
from dsp_core.testing.models import encoder_attention, encoder_attention_feeds

ATTENTION = ["MatMul", "Div", "Add", "Softmax", "MatMul", "Transpose", "Reshape"]


def _model(tmp_path: Path, dtype: str = "float16", **shape: int) -> dsp.CompiledModel:
    path = tmp_path / "attention.onnx"  # through ONNX: its shape inference gives every value's shape
    onnx.save(to_onnx(encoder_attention(dtype, **shape)), path)
    return dsp.compile(path, mode="slot_by_slot")


def _groups(model: dsp.CompiledModel) -> list[tuple[str, list[str]]]:
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    return [(g.template, [plan.slots[s].op for s in g.slots]) for g in result.groups]


def _attention_spec(model: dsp.CompiledModel, feeds: dict[str, np.ndarray]) -> codegen.GroupSpec:
    """The attention group's spec with the reference's values' shapes and strides (as kernels.py builds it)."""
    plan, part, values = plan_values(model, feeds)
    groups = propose_groups(plan, part.segments[0].slots, TritonPolicy()).groups
    (g,) = [g for g in groups if g.template == "decode_attention"]
    nodes = node_specs(plan, g.slots)
    made = {o for n in nodes for o in n.outputs if o is not None}
    ins = list(dict.fromkeys(i for n in nodes for i in n.inputs if i is not None and i not in made))
    specs = {}
    for flat in {*ins, *made}:
        x = np.asarray(values[flat])
        strides = tuple(s // x.itemsize for s in x.strides) if flat in ins else None
        specs[flat] = codegen.TensorSpec(tuple(x.shape), str(x.dtype), strides)
    return codegen.GroupSpec(g.template, nodes, specs, ins, [plan.flat(v) for v in g.outputs], lambda v: None)


def test_an_encoder_attention_is_one_group_with_the_heads_merge(tmp_path: Path) -> None:
    groups = _groups(_model(tmp_path, batch=2, seq=40))
    assert ("decode_attention", ATTENTION) in groups
    assert [t for t, _ in groups].count("matmul") == 2  # the QKV and output projections stay on cuBLAS
    assert not [ops for t, ops in groups if t == "copy" and ops == ["Transpose", "Reshape"]]


def test_up_to_16_rows_the_attention_also_reads_q_k_v_through_their_index_arithmetic(tmp_path: Path) -> None:
    """Skinny products (the QKV projection's own kernel, bias fused) store Q, K and V unsplit: the
    attention reads them through the reshape, transpose and split."""
    groups = _groups(_model(tmp_path, batch=2, seq=12))
    (att,) = [ops for t, ops in groups if t == "decode_attention"]
    assert att[:7] == ["Reshape", "Transpose", "Split", "Squeeze", "Squeeze", "Squeeze", "Transpose"]
    assert att[7:] == ATTENTION
    assert ("product", ["MatMul", "Add"]) in groups


def test_switched_off_no_flash_attention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path, batch=2, seq=40)
    plan = model.plan()
    assert plan is not None
    shapes = infer_shapes(plan)
    products = [s for s in range(len(plan.slots)) if plan.slots[s].op == "MatMul"]
    scores = products[1]  # after the QKV projection
    assert flash_declined(plan, scores, classify(plan, scores, shapes)) is None
    assert "constant operand" in str(flash_declined(plan, products[0], classify(plan, products[0], shapes)))
    monkeypatch.setenv("DSP_TRITON_FLASH_ATTENTION", "0")
    assert "is off" in str(flash_declined(plan, scores, classify(plan, scores, shapes)))
    groups = _groups(model)
    assert all(t != "decode_attention" for t, _ in groups)
    assert [t for t, _ in groups].count("matmul") == 4


def test_the_flash_kernel_reads_q_k_v_once_and_stores_only_the_merged_heads(tmp_path: Path) -> None:
    shape = {"batch": 3, "seq": 40, "heads": 2, "head_dim": 16}
    model = _model(tmp_path, **shape)
    spec = _attention_spec(model, encoder_attention_feeds("float16", **shape))
    configs = codegen.attention_configs(spec)
    assert configs[0] == {"block_m": 64, "block_l": 64, "num_warps": 4}
    assert all(set(c) == {"block_m", "block_l", "num_warps"} for c in configs)
    kernel = codegen.generate(spec)
    ast.parse(kernel.source)
    assert kernel.source.count("tl.dot(") == 2  # the scores and the weighted sum
    assert kernel.grid == (3 * 2 * 1, 1, 1)  # a program per (batch, head, 64 query rows)
    (out,) = kernel.args[kernel.n_inputs :]
    assert spec.values[out].shape == (3, 40, 32)  # the merged heads: no scores, no [b, h, s, d] copy
    assert kernel.source.count("tl.store(") == 1
    small = codegen.generate(spec, config={"block_m": 16, "block_l": 32, "num_warps": 4})
    assert small.grid == (3 * 2 * 3, 1, 1)  # 40 rows in blocks of 16


def test_the_flash_kernel_loads_the_padding_mask_as_one_row_and_launches_plainly(tmp_path: Path) -> None:
    """The additive mask ``[batch, 1, 1, L]`` varies along the KV positions only: one vector load a
    step, bounded by the positions alone, broadcast over the query rows (a load per tile element
    cost BERT-base seq 512's attention 19 -> 11.7 us on the H200). The kernel is not a programmatic
    dependent (launched early it took 27 us a layer where it takes 15.5)."""
    shape = {"batch": 3, "seq": 40, "heads": 2, "head_dim": 16}
    spec = _attention_spec(_model(tmp_path, **shape), encoder_attention_feeds("float16", **shape))
    kernel = codegen.generate(spec)
    (mask_load,) = [line for line in kernel.source.split("\n") if "tl.load(" in line and line.endswith("[None, :]")]
    assert "mask=rl < 40, other=0)[None, :]" in mask_load
    assert "rm" not in mask_load and "rl[None, :]" not in mask_load
    assert not kernel.dependent
    assert "gdc_wait" not in kernel.source


def test_several_query_rows_are_never_split_over_the_kv_positions(tmp_path: Path) -> None:
    """The KV split is for one query row's latency-bound loop; blocks of rows fill the GPU."""
    shape = {"batch": 1, "seq": 300, "heads": 2, "head_dim": 16}
    spec = _attention_spec(_model(tmp_path, **shape), encoder_attention_feeds("float16", **shape))
    assert attention.spec_splits(spec, None) == 1  # 300 positions: one query row would split in 4
    assert attention.spec_splits(spec, None, forced=4) == 1
    assert attention.kv_split_count(2, 300, None) == 4


def test_a_head_larger_than_the_flash_kernel_holds_runs_as_three_parts(tmp_path: Path) -> None:
    shape = {"batch": 1, "seq": 20, "heads": 1, "head_dim": 160}
    spec = _attention_spec(_model(tmp_path, **shape), encoder_attention_feeds("float16", **shape))
    with pytest.raises(codegen.Unsupported, match=r"flash kernel holds 128 \(parts\)"):
        codegen.generate(spec)
    assert [p.template for p, _ in codegen.attention_parts(spec)] == ["product", "row_reduction", "product"]


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_every_flash_config_matches_the_reference_under_the_interpreter() -> None:
    """The default and every config the tuner times, fp32 and fp16, rows not a multiple of the block
    (the masked rows and KV positions), against the reference; a wrong normalisation is caught."""
    results = _interpreted(
        "import onnx, tempfile\n"
        "from dsp_core.ir.onnx_export import to_onnx\n"
        "from dsp_core.testing.models import encoder_attention, encoder_attention_feeds\n"
        "from dsp_triton import codegen\n"
        "default = codegen.attention_configs\n"
        "out = []\n"
        "for dt, seq in (('float32', 40), ('float16', 40), ('float16', 12)):\n"
        "    shape = dict(batch=2, seq=seq, heads=2, head_dim=16)\n"
        "    path = tempfile.mkdtemp() + '/a.onnx'\n"
        "    onnx.save(to_onnx(encoder_attention(dt, **shape)), path)\n"
        "    m = dsp_core.compile(path, mode='slot_by_slot')\n"
        "    feeds = encoder_attention_feeds(dt, **shape)\n"
        "    configs = []\n"
        "    codegen.attention_configs = lambda spec: configs.extend(default(spec)) or default(spec)\n"
        "    out += [dict(r.__dict__, dtype=dt, config=None) for r in ic.check_model(m, feeds)]\n"
        "    for c in configs[: len(configs) // 2]:\n"
        "        codegen.attention_configs = lambda spec, c=c: [c]\n"
        "        got = ic.check_model(m, feeds, templates={'decode_attention'})\n"
        "        out += [dict(r.__dict__, dtype=dt, config=c) for r in got]\n"
        "    codegen.attention_configs = default\n"
        "print(json.dumps(out))\n"
    )
    assert all(r["status"] == "ok" for r in results), [r for r in results if r["status"] != "ok"]
    flash = [r for r in results if r["template"] == "decode_attention"]
    assert {r["dtype"] for r in flash} == {"float32", "float16"}
    assert len({str(r["config"]) for r in flash}) >= 6
    assert all(r["ops"][-7:] == ATTENTION for r in flash)


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_the_decoders_prefill_attention_runs_the_flash_body_under_the_interpreter() -> None:
    """A prefill's attention (7 query rows: GPT-2's causal mask, Llama's GQA repeat of K and V read
    through their index arithmetic) generates the flash body and matches the reference."""
    results = _interpreted(
        "import numpy as np\n"
        "from dsp_triton import codegen\n"
        "out = []\n"
        "for name in ('gpt2_eager', 'llama_eager'):\n"
        "    z = np.load(f'{sys.argv[3]}/{name}.golden.npz')\n"
        "    m = dsp_core.compile(f'{sys.argv[3]}/{name}.onnx', mode='slot_by_slot')\n"
        "    feeds = {n: z['step0.' + n] for n in m.input_names}\n"
        "    got = ic.check_model(m, feeds, templates={'decode_attention'})\n"
        "    out += [dict(r.__dict__, model=name) for r in got]\n"
        "print(json.dumps(out))\n",
        str(Path(__file__).parent / "fixtures"),
    )
    assert sorted(r["model"] for r in results) == ["gpt2_eager"] * 2 + ["llama_eager"] * 2
    assert all(r["status"] == "ok" for r in results), results
    assert all(r["ops"][-5:] == ["MatMul", "Mul", "Add", "Softmax", "MatMul"] for r in results)


def _scaled_after_transpose(tmp_path: Path) -> dsp.CompiledModel:
    """Attention of three inputs whose output is transposed, then scaled, then its heads merged."""
    from dsp_core.ir.builder import GraphBuilder

    g = GraphBuilder("scaled_after_transpose")
    q = g.placeholder("q", "float32", [1, 2, 24, 16])
    kt = g.placeholder("kt", "float32", [1, 2, 16, 24])
    v = g.placeholder("v", "float32", [1, 2, 24, 16])
    ctx = g.MatMul(g.Softmax(g.MatMul(q, kt), axis=-1), v)
    scaled = g.Mul(g.Transpose(ctx, perm=[0, 2, 1, 3]), g.constant(np.array(2.0, np.float32)))
    g.output(g.Reshape(scaled, g.constant(np.array([1, 24, 32], np.int64))), "y")
    path = tmp_path / "scaled.onnx"
    onnx.save(to_onnx(g.build()), path)
    return dsp.compile(path, mode="slot_by_slot")


def test_after_the_heads_transpose_only_layout_ops_join_and_the_kernel_stores_through_it(tmp_path: Path) -> None:
    model = _scaled_after_transpose(tmp_path)
    groups = _groups(model)
    assert ("decode_attention", ["MatMul", "Softmax", "MatMul", "Transpose"]) in groups
    plan = model.plan()
    assert plan is not None
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    reasons = [b.reason for b in result.boundaries]
    assert "Mul after the attention output's layout ops (the kernel stores through them)" in reasons, reasons
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("q", (1, 2, 24, 16)), ("kt", (1, 2, 16, 24)))}
    feeds["v"] = rng.standard_normal((1, 2, 24, 16)).astype(np.float32)
    spec = _attention_spec(model, feeds)
    kernel = codegen.generate(spec)
    (out,) = kernel.args[kernel.n_inputs :]
    assert spec.values[out].shape == (1, 24, 2, 16)  # the transposed output, stored through its index


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_an_output_stored_through_the_heads_transpose_matches_the_reference_under_the_interpreter(
    tmp_path: Path,
) -> None:
    """The group's output is the transposed [1, 24, 2, 16] value (the scale after it is another
    group's): the kernel stores each lane at its transposed index; the reference agrees."""
    onnx_path = tmp_path / "scaled.onnx"
    _scaled_after_transpose(tmp_path)  # writes scaled.onnx
    results = _interpreted(
        "import numpy as np\n"
        "m = dsp_core.compile(sys.argv[3], mode='slot_by_slot')\n"
        "rng = np.random.default_rng(0)\n"
        "feeds = {n: rng.standard_normal(s).astype(np.float32)\n"
        "         for n, s in (('q', (1, 2, 24, 16)), ('kt', (1, 2, 16, 24)), ('v', (1, 2, 24, 16)))}\n"
        "print(json.dumps([r.__dict__ for r in ic.check_model(m, feeds)]))\n",
        str(onnx_path),
    )
    flash = [r for r in results if r["template"] == "decode_attention"]
    assert [r["ops"] for r in flash] == [["MatMul", "Softmax", "MatMul", "Transpose"]]
    assert all(r["status"] == "ok" for r in results), results
