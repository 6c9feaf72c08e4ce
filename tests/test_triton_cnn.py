"""dsp-triton's CNN kernels on the CPU: a biased Conv and the pointwise ops after it form one
group (cuDNN runs the Conv without its bias, one generated kernel adds the bias and runs the rest),
what the policy declines and why, and the kernel the generator makes of such a group; inference
BatchNormalization as a generated per-channel op (under Triton's interpreter where it is installed).

The kernel's numbers are checked on the GPU (tests/gpu/test_triton_gpu.py), where every group's
kernel is also compared with its reference steps before it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from dsp_triton import codegen
from dsp_triton.kernels import CONV_BIAS, CONV_Y, conv_epilogue
from dsp_triton.plugin import TritonPolicy, conv_declined
from test_triton_cpu import _interpreted, _interpreter_missing

import dsp_core as dsp
from dsp_core.plan.fusion import propose_groups
from dsp_core.plan.plan import Plan
from dsp_core.testing.models import residual_conv_block

FIXTURES = Path(__file__).parent / "fixtures"


def _plan(graph: dsp.Graph) -> Plan:
    plan = dsp.compile(graph, mode="slot_by_slot").plan()
    assert plan is not None
    return plan


def _groups(plan: Plan) -> list[tuple[str, list[str]]]:
    result = propose_groups(plan, range(len(plan.slots)), TritonPolicy())
    return [
        (grp.template, [plan.slots[s].op for s in grp.slots if plan.slots[s].op != "Identity"]) for grp in result.groups
    ]


def test_a_biased_conv_takes_the_pointwise_ops_after_it() -> None:
    groups = _groups(_plan(residual_conv_block()))
    assert ("conv", ["Conv", "Relu"]) in groups
    assert ("conv", ["Conv", "Add", "Relu"]) in groups
    # the third conv's output is also a graph output: it is grouped, and the group's kernel
    # declines at its first layout (the raw output must carry the bias): see kernels._conv_piece
    assert ("conv", ["Conv", "Sigmoid"]) in groups


def test_the_fixture_cnn_fuses_its_one_biased_conv() -> None:
    plan = dsp.compile(FIXTURES / "cnn.onnx", mode="slot_by_slot").plan()
    assert plan is not None
    groups = _groups(plan)
    assert groups.count(("conv", ["Conv", "Relu"])) == 1
    assert groups.count(("matmul", ["Conv"])) == 3  # no bias: batch norm follows, unfused


def test_switched_off_or_without_a_bias_a_conv_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(residual_conv_block(bias=False))
    assert all(t != "conv" for t, _ in _groups(plan))
    conv = next(s for s in range(len(plan.slots)) if plan.slots[s].op == "Conv")
    assert conv_declined(plan, conv) == "a convolution without a bias: its epilogue saves no kernel"
    biased = _plan(residual_conv_block())
    monkeypatch.setenv("DSP_TRITON_CONV_EPILOGUE", "0")
    assert all(t != "conv" for t, _ in _groups(biased))
    conv = next(s for s in range(len(biased.slots)) if biased.slots[s].op == "Conv")
    assert conv_declined(biased, conv) == "DSP_TRITON_CONV_EPILOGUE is off: cuDNN adds the bias"
    relu = next(s for s in range(len(biased.slots)) if biased.slots[s].op == "Relu")
    assert conv_declined(biased, relu) == "Relu is not a Conv"


def test_the_epilogue_kernel_adds_the_bias_before_every_read_of_the_convolution() -> None:
    n = codegen.NodeSpec
    y, r, a, out = 10, 11, 12, 13
    shape = (2, 8, 5, 5)
    strides = tuple(codegen.row_major(shape))
    values = {
        y: codegen.TensorSpec(shape, "float16", strides),
        r: codegen.TensorSpec(shape, "float16", strides),
        a: codegen.TensorSpec(shape, "float16"),
        out: codegen.TensorSpec(shape, "float16"),
    }
    epilogue = codegen.GroupSpec("pointwise", [n("Add", (y, r), (a,)), n("Relu", (a,), (out,))], values, [y, r], [out])
    fused = conv_epilogue(epilogue, y, (8, 1, 1), "float16", "conv")
    assert [node.op for node in fused.nodes] == ["Add", "Add", "Relu"]
    assert fused.nodes[0].inputs == (y, CONV_BIAS) and fused.nodes[1].inputs == (CONV_Y, r)
    assert fused.values[CONV_BIAS] == codegen.TensorSpec((8, 1, 1), "float16", (1, 1, 1))
    kernel = codegen.generate(fused)
    ast.parse(kernel.source)
    assert set(kernel.args[: kernel.n_inputs]) == {y, r, CONV_BIAS} and kernel.args[kernel.n_inputs :] == (out,)
    assert CONV_Y not in kernel.args  # computed in registers, never stored


def _bn_spec(dtype: str, attrs: dict[str, object], stats_dtype: str = "float32") -> codegen.GroupSpec:
    n = codegen.NodeSpec
    shape = (2, 3, 4, 5)
    values = {1: codegen.TensorSpec(shape, dtype, tuple(codegen.row_major(shape)))}
    for k in (2, 3, 4, 5):
        values[k] = codegen.TensorSpec((3,), stats_dtype, (1,))
    values[6] = codegen.TensorSpec(shape, dtype)
    values[7] = codegen.TensorSpec(shape, dtype)
    nodes = [n("BatchNormalization", (1, 2, 3, 4, 5), (6,), attrs, 15), n("Relu", (6,), (7,))]
    return codegen.GroupSpec("pointwise", nodes, values, [1, 2, 3, 4, 5], [7])


def test_inference_batch_norm_is_a_per_channel_op_of_the_pointwise_kernel() -> None:
    kernel = codegen.generate(_bn_spec("float16", {"epsilon": 1e-3}))
    ast.parse(kernel.source)
    assert set(kernel.args[: kernel.n_inputs]) == {1, 2, 3, 4, 5} and kernel.args[kernel.n_inputs :] == (7,)
    assert "tl.sqrt_rn(" in kernel.source and "0.001" in kernel.source
    for attrs, why in (({"training_mode": 1}, "training mode"), ({"spatial": 0}, "spatial=0")):
        with pytest.raises(codegen.Unsupported, match=why):
            codegen.generate(_bn_spec("float32", attrs))


def test_the_fixture_cnn_runs_each_batch_norm_with_its_relu() -> None:
    plan = dsp.compile(FIXTURES / "cnn.onnx", mode="slot_by_slot").plan()
    assert plan is not None
    groups = _groups(plan)
    assert groups.count(("pointwise", ["BatchNormalization", "Relu"])) == 2
    assert all("BatchNormalization" not in ops for t, ops in groups if t == "opaque")


@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_conv_groups_and_batch_norms_match_the_reference_under_the_interpreter() -> None:
    """Each conv group's kernel fed the convolution without its bias gives the reference's outputs
    (with the bias cuDNN would have added); each batch norm group's too (the fixture CNN's)."""
    results = _interpreted(
        "import numpy as np\n"
        "from dsp_core.testing.models import residual_conv_block\n"
        "out = []\n"
        "for dt in ('float32', 'float16'):\n"
        "    m = dsp_core.compile(residual_conv_block(dt, channels=8, size=7, batch=2), mode='slot_by_slot')\n"
        "    x = np.random.default_rng(0).standard_normal((2, 8, 7, 7)).astype(dt)\n"
        "    out += [dict(r.__dict__, model=dt) for r in ic.check_model(m, {'x': x})]\n"
        "z = np.load(sys.argv[3])\n"
        "m = dsp_core.compile(sys.argv[4], mode='slot_by_slot')\n"
        "out += [dict(r.__dict__, model='cnn') for r in ic.check_model(m, {n: z[n] for n in m.input_names})]\n"
        "print(json.dumps(out))\n",
        str(FIXTURES / "cnn.golden.npz"),
        str(FIXTURES / "cnn.onnx"),
    )
    for dtype in ("float32", "float16"):
        convs = [(r["ops"], r["status"]) for r in results if r["model"] == dtype and r["template"] == "conv"]
        assert convs == [
            (["Conv", "Relu"], "ok"),
            (["Conv", "Add", "Relu"], "ok"),
            (["Conv", "Sigmoid"], "unsupported"),  # its raw output is a graph output: cuDNN adds its bias
        ], convs
    cnn = [r for r in results if r["model"] == "cnn"]
    assert all(r["status"] == "ok" for r in cnn), cnn
    assert sum("BatchNormalization" in r["ops"] for r in cnn) == 3
