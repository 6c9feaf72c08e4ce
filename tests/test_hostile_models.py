"""Models a hostile user writes: each gets a clear DSPError (or runs right), never a crash, hang or wrong output.

The cases are the reliability issue's items 3, 5-9 (duplicate inputs, extra outputs,
external data, ONNX shape inference crashes/hangs/blow-ups, unbounded graph-driven work,
non-DSP exceptions). Cases that crashed the process run in a subprocess with a timeout,
so a regression fails the test instead of taking pytest down.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsp_core as dsp
from dsp_core.errors import DSPError, GraphError, KernelError, ModelLoadError
from dsp_core.ir import onnx_inference

F = TensorProto.FLOAT


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))


def _model(nodes, inputs=None, outputs=None, inits=(), opset=23, value_info=(), domain_opsets=()):
    inputs = inputs if inputs is not None else [helper.make_tensor_value_info("x", F, [2])]
    outputs = outputs if outputs is not None else [helper.make_tensor_value_info("y", F, None)]
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in domain_opsets)]
    return helper.make_model(g, opset_imports=opsets)


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def _in_subprocess(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; fail on a signal death, a non-zero exit or a timeout."""
    env = {**os.environ, "DSP_DISK_CACHE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


# -- item 3: a graph input listed twice ---------------------------------------------------
def test_duplicate_graph_input_is_a_graph_error_naming_it() -> None:
    w = numpy_helper.from_array(np.eye(2, dtype=np.float32) * 10, "W")
    x = helper.make_tensor_value_info("x", F, [2, 2])
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"])], inputs=[x, x], inits=[w])
    with pytest.raises(GraphError, match="input 'x' twice"):
        dsp.compile(_bytes(m))


def test_duplicate_initializer_output_and_node_output_are_graph_errors() -> None:
    c = numpy_helper.from_array(np.ones(2, np.float32), "c")
    with pytest.raises(GraphError, match="initializer 'c' twice"):
        dsp.compile(_bytes(_model([helper.make_node("Add", ["x", "c"], ["y"])], inits=[c, c])))
    y = helper.make_tensor_value_info("y", F, None)
    with pytest.raises(GraphError, match="output 'y' twice"):
        dsp.compile(_bytes(_model([helper.make_node("Relu", ["x"], ["y"])], outputs=[y, y])))
    with pytest.raises(GraphError, match="'a' twice"):
        dsp.compile(_bytes(_model([helper.make_node("Split", ["x"], ["a", "a"], axis=0, num_outputs=2)])))


# -- item 5: more outputs than the op makes -------------------------------------------------
def test_node_with_more_outputs_than_its_op_is_a_graph_error() -> None:
    outs = [helper.make_tensor_value_info(n, F, [3]) for n in ("y", "z")]
    m = _model([helper.make_node("Relu", ["x"], ["y", "z"])], outputs=outs)
    with pytest.raises(GraphError, match='Relu node "Relu_0" has 2 outputs; Relu has 1'):
        dsp.compile(_bytes(m))


# -- item 6: external data has a directory, never the process's current one -------------------
def _external_model(location: str, nbytes: int | None = None) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("length", str(nbytes if nbytes is not None else 8))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], inits=[w])


def test_external_data_from_bytes_needs_base_dir_and_ignores_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.full(2, 41.0, np.float32).tofile(tmp_path / "weights.bin")
    monkeypatch.chdir(tmp_path)  # the data is right here, and still not read
    data = _bytes(_external_model("weights.bin"))
    with pytest.raises(ModelLoadError, match="pass base_dir="):
        dsp.compile(data)
    other = tmp_path / "elsewhere"
    other.mkdir()
    np.full(2, 1.0, np.float32).tofile(other / "weights.bin")
    out = dsp.compile(data, base_dir=other).run({"x": np.ones(2, np.float32)})["y"]
    np.testing.assert_array_equal(out, [2.0, 2.0])
    proto = _external_model("weights.bin")
    out = dsp.compile(proto, base_dir=tmp_path).run({"x": np.ones(2, np.float32)})["y"]
    np.testing.assert_array_equal(out, [42.0, 42.0])
    assert proto.graph.initializer[0].data_location == TensorProto.EXTERNAL  # the caller's proto is untouched


@pytest.mark.parametrize("location", ["/etc/hostname", "../outside.bin", "sub/../../outside.bin", ""])
def test_external_data_outside_the_model_directory_is_refused(tmp_path: Path, location: str) -> None:
    (tmp_path / "outside.bin").write_bytes(b"\0" * 8)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / "m.onnx"
    path.write_bytes(_bytes(_external_model(location)))
    with pytest.raises(ModelLoadError, match="external data|location"):
        dsp.compile(path)


def test_external_data_through_a_link_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.bin").write_bytes(b"\0" * 8)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "w.bin").symlink_to(tmp_path / "secret.bin")
    (model_dir / "m.onnx").write_bytes(_bytes(_external_model("w.bin")))
    with pytest.raises(ModelLoadError, match="leads outside"):
        dsp.compile(model_dir / "m.onnx")


def test_external_data_fifo_dev_zero_and_short_files_fail_fast(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.bin")
    (tmp_path / "zero.bin").symlink_to("/dev/zero")
    (tmp_path / "short.bin").write_bytes(b"\0" * 4)
    for name, match in (
        ("fifo.bin", "not a regular file"),
        ("zero.bin", "leads outside"),
        ("short.bin", "has 4 bytes"),
    ):
        (tmp_path / "m.onnx").write_bytes(_bytes(_external_model(name)))
        started = time.monotonic()
        with pytest.raises(ModelLoadError, match=match):
            dsp.compile(tmp_path / "m.onnx")
        assert time.monotonic() - started < 10
    (tmp_path / "m.onnx").write_bytes(_bytes(_external_model("short.bin", nbytes=1 << 40)))
    with pytest.raises(ModelLoadError, match="dims and type need 8"):
        dsp.compile(tmp_path / "m.onnx")


# -- item 7: ONNX's shape inference cannot take the process down ----------------------------
def test_dangling_inputs_are_graph_errors_before_onnx_inference_runs() -> None:
    out = _in_subprocess(
        """
        from onnx import helper, TensorProto
        import dsp_core as dsp
        for op in ("RegexFullMatch", "EyeLike", "TreeEnsemble"):
            domain = "ai.onnx.ml" if op == "TreeEnsemble" else ""
            g = helper.make_graph([helper.make_node(op, ["nonexistent"], ["y"], domain=domain)], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("ai.onnx.ml", 5)])
            try:
                dsp.compile(m.SerializeToString())
            except dsp.DSPError as e:
                print(type(e).__name__, e)
        """
    )
    assert out.count("GraphError") == 3 and "nonexistent" in out


def _layernorm_axis_model(axis: int) -> onnx.ModelProto:
    node = helper.make_node("LayerNormalization", ["X", "W", "B"], ["Y", "Mean", "InvStdDev"], axis=axis)
    ins = [helper.make_tensor_value_info(n, F, s) for n, s in (("X", [2, 3, 5]), ("W", [5]), ("B", [5]))]
    outs = [helper.make_tensor_value_info(n, F, None) for n in ("Y", "Mean", "InvStdDev")]
    return _model([node], inputs=ins, outputs=outs, opset=17)


class _Segfaulting:
    """Stands in for ONNX's C++ inference in the sandbox: it dies as an out-of-range read can."""

    @staticmethod
    def infer_shapes(*args: object) -> bytes:
        os.kill(os.getpid(), signal.SIGSEGV)
        return b""


def test_an_inference_crash_stays_in_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    relu = _model([helper.make_node("Relu", ["x"], ["y"])])
    onnx_inference._drop()  # the next sandbox is forked with the crashing stand-in
    monkeypatch.setattr(onnx_inference, "_cpp_inference", _Segfaulting)
    assert onnx_inference.infer(relu, 30, 1024) is None  # the sandbox died (SIGSEGV), this process did not
    onnx_inference._drop()
    monkeypatch.undo()
    assert onnx_inference.infer(relu, 30, 1024) is not None  # a fresh sandbox answers the next model


def test_the_sandbox_holds_none_of_this_processs_descriptors() -> None:
    """A pipe of the caller's, open when the sandbox forks, ends when the caller closes it: the fork
    keeps no copy (a race's worker waited forever for the end of its stdin that the sandbox held)."""
    read_end, write_end = os.pipe()
    try:
        onnx_inference._drop()
        assert onnx_inference.infer(_model([helper.make_node("Relu", ["x"], ["y"])]), 30, 1024) is not None
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready and os.read(read_end, 1) == b"", "the pipe did not end: the sandbox holds its write end"
    finally:
        os.close(read_end)


def test_a_layernorm_axis_that_crashed_onnx_inference_gets_a_dsp_error() -> None:
    m = _layernorm_axis_model(2**63 - 1)  # ONNX's inference reads out of bounds (it may or may not fault)
    compiled = dsp.compile(_bytes(m))
    feeds = {"X": np.ones((2, 3, 5), np.float32), "W": np.ones(5, np.float32), "B": np.zeros(5, np.float32)}
    with pytest.raises(DSPError):
        compiled.run(feeds)


def test_an_inference_hang_is_cut_by_the_timeout() -> None:
    node = helper.make_node("Einsum", ["x"], ["y"], equation=b"\xff\xfe")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [])],
        [helper.make_tensor_value_info("x", 11, [])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)])
    started = time.monotonic()
    assert onnx_inference.infer(m, 2.0, 1024) is None
    assert time.monotonic() - started < 8
    with pytest.raises(GraphError, match="not UTF-8"):  # and DSP refuses the model before inference
        dsp.compile(_bytes(m))


def _range_model(dim: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["arange"]),
        helper.make_node("Unsqueeze", ["arange", "zero1"], ["y"]),
    ]
    inits = [
        helper.make_tensor("one", TensorProto.INT64, [], [1]),
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("zero1", TensorProto.INT64, [1], [0]),
    ]
    return _model(
        nodes,
        inputs=[helper.make_tensor_value_info("x", F, ["batch", "seq"])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        inits=inits,
        opset=18,
        value_info=[helper.make_tensor_value_info("arange", TensorProto.INT64, [dim])],
    )


def test_a_huge_declared_dim_is_refused_before_inference_and_inference_is_capped() -> None:
    started = time.monotonic()
    with pytest.raises(GraphError, match="'arange' is declared with shape"):
        dsp.compile(_bytes(_range_model(2**63 - 1)))
    assert onnx_inference.infer(_range_model(2**40), 30, 256) is None  # ONNX would materialise 2**40 ints
    assert time.monotonic() - started < 20
    out = dsp.compile(_bytes(_range_model(3))).run({"x": np.zeros((2, 3), np.float32)})["y"]
    np.testing.assert_array_equal(out, [[0, 1, 2]])


def test_inference_still_fills_value_info() -> None:
    graph = dsp.ir.import_model(
        _bytes(_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]))
    )
    assert graph.value_info["r"].dtype == "float32" and graph.value_info["r"].shape == (2,)


# -- item 8: bounded graph-driven work -------------------------------------------------------
def test_split_num_outputs_beyond_the_node_outputs_fails_fast() -> None:
    node = helper.make_node("Split", ["x"], ["a", "b", "c"], num_outputs=2**40)
    outs = [helper.make_tensor_value_info(n, F, None) for n in "abc"]
    m = _model([node], inputs=[helper.make_tensor_value_info("x", F, [6])], outputs=outs, opset=18)
    started = time.monotonic()
    with pytest.raises(DSPError, match="num_outputs=1099511627776"):
        dsp.compile(_bytes(m)).run({"x": np.arange(6, dtype=np.float32)})
    assert time.monotonic() - started < 10


def test_split_sizes_must_cover_the_axis() -> None:
    sizes = helper.make_tensor("sizes", TensorProto.INT64, [2], [1, 1])
    node = helper.make_node("Split", ["x", "sizes"], ["a", "b"])
    outs = [helper.make_tensor_value_info(n, F, None) for n in "ab"]
    m = _model([node], inputs=[helper.make_tensor_value_info("x", F, [6])], outputs=outs, inits=[sizes], opset=18)
    with pytest.raises(KernelError, match="summing to the axis length 6"):
        dsp.compile(_bytes(m)).run({"x": np.arange(6, dtype=np.float32)})


def test_too_many_node_outputs_is_a_graph_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_MAX_NODE_OUTPUTS", "4")
    names = [f"o{i}" for i in range(5)]
    node = helper.make_node("Split", ["x"], names, axis=0, num_outputs=5)
    m = _model(
        [node],
        inputs=[helper.make_tensor_value_info("x", F, [5])],
        outputs=[helper.make_tensor_value_info("o0", F, None)],
    )
    with pytest.raises(GraphError, match="names 5 outputs, more than 4"):
        dsp.compile(_bytes(m))


def _endless_loop() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", F, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", F, [1]),
        ],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    inits = [
        helper.make_tensor("trips", TensorProto.INT64, [], [2**62]),
        helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
    ]
    node = helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)
    return _model([node], inputs=[helper.make_tensor_value_info("x", F, [1])], inits=inits)


def test_a_loop_of_2_to_the_62_trips_stops_at_the_iteration_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_MAX_LOOP_ITERATIONS", "1000")
    started = time.monotonic()
    model = dsp.compile(_bytes(_endless_loop()))
    for run in (model.run, model.run_legacy):
        with pytest.raises(KernelError, match="more than 1,000 iterations"):
            run({"x": np.zeros(1, np.float32)})
    assert time.monotonic() - started < 30
    monkeypatch.setenv("DSP_MAX_LOOP_ITERATIONS", "10000000")


# -- item 9: malformed nodes are DSPErrors, not TypeError/ValueError --------------------------
@pytest.mark.parametrize(
    ("node", "match"),
    [
        (helper.make_node("Constant", [], ["y"], value_float=1.0, axis=0), "axis that Constant does not define"),
        (helper.make_node("Constant", [], ["y"]), "Constant node"),
    ],
)
def test_malformed_constant_nodes_are_graph_errors(node: onnx.NodeProto, match: str) -> None:
    with pytest.raises(GraphError, match=match):
        dsp.compile(_bytes(_model([node])))


def test_names_that_are_not_utf8_are_graph_errors() -> None:
    data = _bytes(_model([helper.make_node("Relu", ["x"], ["y"], zzzz=1)]))
    with pytest.raises(GraphError, match="attribute name of Relu node"):
        dsp.compile(data.replace(b"zzzz", b"\xff\xfezz"))
    data = _bytes(_model([helper.make_node("Relu", ["x"], ["y"], name="nnnn")]))
    with pytest.raises(GraphError, match="not UTF-8"):
        dsp.compile(data.replace(b"nnnn", b"\xff\xfenn"))


def test_the_cli_prints_one_line_for_a_hostile_model(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_bytes(_external_model("../outside.bin")))
    proc = subprocess.run(
        [sys.executable, "-m", "dsp_core.cli", "run", str(path), "--random-inputs"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DSP_DISK_CACHE": "0"},
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# -- found by make fuzz -----------------------------------------------------------------------
@pytest.mark.parametrize("equation", ["\x00", "ij->ji->i", "i$j"])
def test_an_einsum_equation_that_is_not_one_is_refused_before_inference(equation: str) -> None:
    node = helper.make_node("Einsum", ["x"], ["y"], equation=equation)
    m = _model([node], inputs=[helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 2])], opset=12)
    with pytest.raises(GraphError, match="is not an Einstein summation"):
        dsp.compile(_bytes(m))


def test_an_attribute_of_the_wrong_type_is_a_graph_error() -> None:
    node = helper.make_node("Einsum", ["x"], ["y"])
    node.attribute.append(helper.make_attribute("equation", 0.0))  # a float where the schema says string
    m = _model([node], inputs=[helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 2])], opset=12)
    with pytest.raises(
        GraphError, match="attribute 'equation' of Einsum node .* is of type FLOAT; Einsum takes STRING"
    ):
        dsp.compile(_bytes(m))


def test_pool_windows_outside_the_input_are_refused_not_read() -> None:
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], dilations=[-2, 2])
    x = helper.make_tensor_value_info("x", F, [1, 1, 8, 8])
    model = dsp.compile(_bytes(_model([node], inputs=[x])))
    for run in (model.run, model.run_legacy):
        with pytest.raises(KernelError, match="dilations"):
            run({"x": np.ones((1, 1, 8, 8), np.float32)})


def test_a_graph_input_without_a_name_is_a_graph_error() -> None:
    w = numpy_helper.from_array(np.eye(2, dtype=np.float32), "W")
    ins = [helper.make_tensor_value_info("x", F, [2, 2]), helper.make_tensor_value_info("", F, [2, 2])]
    with pytest.raises(GraphError, match="empty name"):
        dsp.compile(_bytes(_model([helper.make_node("MatMul", ["x", "W"], ["y"])], inputs=ins, inits=[w])))


def test_a_scan_state_of_another_type_than_its_body_declares_is_a_dtype_error() -> None:
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "v"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["o"])],
        "body",
        [helper.make_tensor_value_info("s_in", F, []), helper.make_tensor_value_info("v", F, [])],
        [helper.make_tensor_value_info("s_out", F, []), helper.make_tensor_value_info("o", F, [])],
    )
    node = helper.make_node("Scan", ["init", "x"], ["y", "z"], body=body, num_scan_inputs=1)
    ins = [helper.make_tensor_value_info("init", TensorProto.FLOAT16, []), helper.make_tensor_value_info("x", F, [5])]
    outs = [helper.make_tensor_value_info(n, F, None) for n in ("y", "z")]
    with pytest.raises(
        DSPError, match='input 0 \\("init"\\) is float16, but its body declares input "s_in" as float32'
    ):
        dsp.compile(_bytes(_model([node], inputs=ins, outputs=outs, opset=11)))


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("MaxPool", {"kernel_shape": [9, 2], "auto_pad": "SAME_UPPER"}),
        ("MaxPool", {"kernel_shape": [7, 11], "auto_pad": "SAME_LOWER", "strides": [2, 1]}),
        ("AveragePool", {"kernel_shape": [9, 3], "auto_pad": "SAME_UPPER"}),
        ("AveragePool", {"kernel_shape": [9, 3], "auto_pad": "SAME_LOWER", "count_include_pad": 1}),
        ("AveragePool", {"kernel_shape": [6, 8], "pads": [2, 3, 1, 4], "strides": [1, 2]}),
        ("LpPool", {"kernel_shape": [8, 2], "auto_pad": "SAME_UPPER", "p": 2}),
    ],
)
def test_pool_kernels_larger_than_the_input_give_the_untrimmed_result(
    op: str, attrs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cutting what only ever sees padding changes nothing: same values as the full windows (and ONNX's)."""
    from onnx.reference import ReferenceEvaluator

    from dsp_core.ops import conv

    x = helper.make_tensor_value_info("x", F, [1, 2, 5, 6])
    outputs = ["y", "i"] if op == "MaxPool" else ["y"]
    m = _model(
        [helper.make_node(op, ["x"], outputs, **attrs)],
        inputs=[x],
        opset=19,
        outputs=[helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs],
    )
    feed = {"x": np.random.default_rng(0).standard_normal((1, 2, 5, 6)).astype(np.float32)}
    got = dsp.compile(_bytes(m)).run(feed)
    monkeypatch.setattr(conv, "_trim_windows", lambda in_sp, kernel, out, pb, pe, s, d: (kernel, pb, pe))
    full = dsp.compile(_bytes(m)).run(feed)
    for name in outputs:
        np.testing.assert_array_equal(got[name], full[name])
    if "strides" not in attrs:  # ONNX's reference evaluator agrees where it handles the geometry
        want = ReferenceEvaluator(m).run(None, feed)[0]
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)


def test_a_65535_row_max_pool_window_over_32_rows_costs_what_32_rows_cost() -> None:
    huge = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[65535, 2], auto_pad="SAME_LOWER")
    xs = helper.make_tensor_value_info("x", F, [1, 3, 32, 32])
    big = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    started = time.monotonic()
    y = dsp.compile(_bytes(_model([huge], inputs=[xs], opset=22))).run({"x": big})["y"]
    assert time.monotonic() - started < 5  # was 14 s: 400M window reads
    padded = np.pad(big, ((0, 0), (0, 0), (0, 0), (1, 0)), constant_values=-np.inf)  # SAME_LOWER: pad before
    want = np.maximum(padded[..., :-1], padded[..., 1:]).max(axis=2, keepdims=True).repeat(32, axis=2)
    np.testing.assert_array_equal(y, want)


def test_a_missing_external_data_file_names_the_folder_and_the_remedy(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(_bytes(_external_model("weights.bin")))
    with pytest.raises(ModelLoadError, match="cannot open external data 'weights.bin' in .*keep the data file beside"):
        dsp.compile(tmp_path / "m.onnx")
