"""dsp-triton's convolution groups on the CPU: a biased Conv and the pointwise ops after it form one
group (cuDNN runs the Conv without its bias, one generated kernel adds the bias and runs the rest),
what the policy declines and why, and the kernel the generator makes of such a group.

The kernel's numbers are checked on the GPU (tests/gpu/test_triton_gpu.py), where every group's
kernel is also compared with its reference steps before it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from dsp_triton import codegen
from dsp_triton.kernels import CONV_BIAS, CONV_Y, conv_epilogue
from dsp_triton.plugin import TritonPolicy, conv_declined

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
