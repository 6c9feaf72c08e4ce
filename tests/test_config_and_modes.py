"""Settings that take effect, modes that do what they say, reports that name what ran (issue 17 items 3, 5, 6)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, run_cli, write_tiny_mlp
from onnx import TensorProto, helper

import dsp_core as dsp
from dsp_core import config
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.cache.disk import DiskCache
from dsp_core.cli import random_feeds
from dsp_core.errors import BackendUnavailableError, ConfigError, InputError, ModelLoadError

GPT2 = str(FIXTURES / "gpt2_eager.onnx")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MLP (conftest.write_tiny_mlp), written once for this module."""
    return write_tiny_mlp(tmp_path_factory.mktemp("tiny") / "tiny.onnx")


# -- item 3: SHAPE_INFERENCE_ONLY computes no values -------------------------------------------
def test_shape_inference_only_returns_read_only_stand_ins_not_values() -> None:
    golden = np.load(FIXTURES / "cnn.golden.npz")
    model = dsp.compile(str(FIXTURES / "cnn.onnx"), mode="shape_inference_only")
    assert model.resolved_backends() == ["shape_inference_only"]
    out = model.run({"input": golden["input"]})["logits"]
    assert out.shape == golden["logits"].shape and out.dtype == golden["logits"].dtype
    assert not out.flags.writeable, "a stand-in must be read-only"
    assert all(s == 0 for s in out.strides), "a stand-in holds no data (zero strides): nothing was computed"
    assert not np.allclose(out, golden["logits"]), "SHAPE_INFERENCE_ONLY computed the real values"


def test_shape_inference_only_never_reads_float_feeds() -> None:
    g = dsp.GraphBuilder("big")
    x = g.placeholder("x", "float32", ["n", 512])
    w = g.constant(np.ones((512, 512), np.float32), name="w")
    g.output(g.Relu(g.MatMul(x, w)), "y")
    graph = g.build()
    model = dsp.compile(graph, mode="shape_inference_only")
    x_in = np.full((256, 512), np.nan, np.float32)  # a real run would give NaN everywhere
    y = model.run({"x": x_in})["y"]
    assert y.shape == (256, 512) and y.dtype == np.float32 and not y.flags.writeable
    assert not np.isnan(y).any()


def test_shape_inference_only_keeps_shape_feeds_concrete() -> None:
    """A small integer feed may be a shape: Reshape must get its true target."""
    g = dsp.GraphBuilder("reshape")
    x = g.placeholder("x", "float32", [4, 6])
    shape = g.placeholder("shape", "int64", [2])
    g.output(g.Reshape(x, shape), "y")
    model = dsp.compile(g.build(), mode="shape_inference_only")
    y = model.run({"x": np.ones((4, 6), np.float32), "shape": np.array([3, 8], np.int64)})["y"]
    assert y.shape == (3, 8) and not y.flags.writeable


def test_shape_inference_only_gives_every_fixture_the_reference_shapes() -> None:
    golden = np.load(FIXTURES / "gpt2_eager.golden.npz")
    ref = dsp.compile(GPT2, mode="slot_by_slot")
    feeds = {v.name: golden[f"step1.{v.name}"] for v in ref.graph.inputs if v.name not in ref.graph.initializers}
    want = ref.run(feeds)
    got = dsp.compile(GPT2, mode="shape_inference_only").run(feeds)
    for name, array in want.items():
        assert (got[name].shape, got[name].dtype) == (array.shape, array.dtype), name
    assert not np.allclose(got["logits"], want["logits"])


# -- item 3: dsp validate names what ran --------------------------------------------------------
def test_validate_does_not_credit_a_gpu_mode_that_was_remapped() -> None:
    if _gpu_here():
        pytest.skip("CUDA_GRAPHS can run on this machine: nothing is remapped")
    out = run_cli("validate", GPT2, "--modes", "cuda_graphs", "--max-new-tokens", "3", "--json")
    report = json.loads(out.stdout)
    entry = report["modes"]["CUDA_GRAPHS"]
    assert entry["remapped"] is True
    assert "cuda_graphs" not in entry["ran_on"] and entry["ran_on"] == ["emulated_replay"]
    assert any("remapped to EMULATED_REPLAY" in n for n in entry["notes"])
    assert report["modes"]["SLOT_BY_SLOT"]["ran_on"] == ["slot_by_slot"]
    assert report["modes"]["SLOT_BY_SLOT"]["remapped"] is False
    text = run_cli("validate", GPT2, "--modes", "cuda_graphs,emulated_replay", "--max-new-tokens", "3").stdout
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("CUDA_GRAPHS"))
    assert "REMAPPED" in line and " ok " not in line and "ran on emulated_replay" in line
    assert "CUDA_GRAPHS not validated" in text.splitlines()[-1]
    ok = next(ln for ln in text.splitlines() if ln.strip().startswith("EMULATED_REPLAY"))
    assert " ok " in ok and "ran on emulated_replay" in ok


def _gpu_here() -> bool:
    from dsp_core.backends.auction import gpu_present
    from dsp_core.backends.discovery import discover

    return gpu_present(discover())


# -- item 5: DSP_MODE and DSP_STRICT are read, once, by one parser ------------------------------
def test_dsp_mode_is_the_default_mode(monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    monkeypatch.setenv("DSP_MODE", "Emulated_Replay")
    assert dsp.compile(mlp_graph).mode is GraphExecutionMode.EMULATED_REPLAY
    assert dsp.compile(mlp_graph, mode="slot_by_slot").mode is GraphExecutionMode.SLOT_BY_SLOT  # argument wins
    assert config.source("mode") == "environment"


def test_dsp_mode_reaches_the_cli(tiny_path: Path) -> None:
    out = run_cli("run", str(tiny_path), "--random-inputs", "--json", env={"DSP_MODE": "emulated_replay"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["backends"] == ["emulated_replay"]


def test_unknown_dsp_mode_is_a_config_error_at_first_use(
    monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph, tiny_path: Path
) -> None:
    monkeypatch.setenv("DSP_MODE", "bogus")
    with pytest.raises(ConfigError, match=r"DSP_MODE = 'bogus'.*unknown execution mode.*slot_by_slot"):
        dsp.compile(mlp_graph)
    out = run_cli("run", str(tiny_path), "--random-inputs", env={"DSP_MODE": "bogus"})
    assert out.returncode == 2 and "DSP_MODE" in out.stderr and "Traceback" not in out.stderr


def test_dsp_strict_is_read(monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    monkeypatch.setenv("DSP_STRICT", "1")
    assert dsp.compile(mlp_graph).strict is True
    assert dsp.compile(mlp_graph, strict=False).strict is False  # argument wins
    monkeypatch.setenv("DSP_STRICT", "sometimes")
    with pytest.raises(ConfigError, match="DSP_STRICT"):
        dsp.compile(mlp_graph)


def test_strict_refuses_the_gpu_to_cpu_remap(monkeypatch: pytest.MonkeyPatch, mlp_graph: dsp.Graph) -> None:
    if _gpu_here():
        pytest.skip("this machine has a GPU: nothing to remap")
    with pytest.raises(BackendUnavailableError, match="CUDA_GRAPHS.*strict.*remap"):
        dsp.compile(mlp_graph, mode="cuda_graphs", strict=True)
    monkeypatch.setenv("DSP_STRICT", "yes")
    with pytest.raises(BackendUnavailableError, match="TRITON.*strict"):
        dsp.compile(mlp_graph, mode="triton")
    monkeypatch.delenv("DSP_STRICT")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = dsp.compile(mlp_graph, mode="cuda_graphs")  # not strict: remapped, loudly
    assert model.resolved_backends() == ["emulated_replay"]
    assert any("remapped to EMULATED_REPLAY" in str(w.message) for w in caught)


# -- item 5: sizes: one parser for the cache and for `dsp config` --------------------------------
@pytest.mark.parametrize(
    "raw, n", [("4G", 4 << 30), ("512M", 512 << 20), ("2GiB", 2 << 30), ("4096", 4096), ("1.5K", 1536)]
)
def test_cache_max_bytes_sizes(monkeypatch: pytest.MonkeyPatch, raw: str, n: int) -> None:
    monkeypatch.setenv("DSP_CACHE_MAX_BYTES", raw)
    assert config.get("cache_max_bytes") == n
    assert DiskCache.from_config().max_bytes == n


@pytest.mark.parametrize("raw", ["lots", "0", "-5", "4Q"])
def test_bad_cache_max_bytes_fails_alike_in_both(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DSP_CACHE_MAX_BYTES", raw)
    with pytest.raises(ConfigError, match="DSP_CACHE_MAX_BYTES"):
        config.get("cache_max_bytes")
    with pytest.raises(ConfigError, match="DSP_CACHE_MAX_BYTES"):
        DiskCache.from_config()


def test_dsp_config_shows_a_size_and_marks_a_bad_value() -> None:
    out = run_cli("config", "--json", env={"DSP_CACHE_MAX_BYTES": "4G"})
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["cache_max_bytes"]["value"] == "4G" and rows["cache_max_bytes"]["source"] == "environment"
    assert rows["mode"]["value"] == "auto" and rows["mode"]["error"] is None
    bad = run_cli("config", env={"DSP_MODE": "bogus", "DSP_CACHE_MAX_BYTES": "4G"})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "INVALID 'bogus'" in bad.stdout and "cache_max_bytes" in bad.stdout  # the whole table, then the error
    assert "DSP_MODE = 'bogus'" in bad.stderr


def test_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_FLIGHT_EVENTS", "")
    monkeypatch.setenv("DSP_DISK_CACHE", "")
    assert config.get("flight_events") == 2000 and config.source("flight_events") == "default"
    assert config.get("disk_cache") is True and DiskCache.from_config().enabled is True


# -- item 6: one clear line instead of a traceback or silence -----------------------------------
CNN = str(FIXTURES / "cnn.onnx")  # input [N, 3, 32, 32] float32


def test_missing_external_data_file_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "mlp.onnx"
    model.write_bytes((FIXTURES / "external_data" / "mlp.onnx").read_bytes())  # without mlp.onnx.data
    with pytest.raises(ModelLoadError, match=r"mlp\.onnx.*tensor '.*'.*external data 'mlp\.onnx\.data'"):
        dsp.compile(str(model))
    out = run_cli("run", str(model), "--random-inputs")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "mlp.onnx.data" in out.stderr and "No such file" in out.stderr


def test_huge_dim_fails_before_allocating_and_names_dim_and_bytes() -> None:
    model = dsp.compile(CNN)
    with pytest.raises(InputError, match=r"--dim N=200000000: the random inputs need 2\.24 TiB.*'input'"):
        random_feeds(model, {"N": 200_000_000}, set())
    with pytest.raises(InputError, match=r"--dim N=100000000000.*DSP_MAX_TENSOR_ELEMENTS"):
        random_feeds(model, {"N": 100_000_000_000}, set())
    out = run_cli("run", CNN, "--random-inputs", "--dim", "N=200000000")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "MemoryError" not in out.stderr
    assert "N=200000000" in out.stderr and "2.24 TiB" in out.stderr


def test_dim_for_a_symbol_the_model_lacks_is_an_error(tmp_path: Path) -> None:
    model = dsp.compile(CNN)
    with pytest.raises(InputError, match=r"--dim foo=3: the model has no symbolic dim 'foo'; its symbolic dims are N"):
        random_feeds(model, {"foo": 3}, set())
    assert random_feeds(model, {"N": 3}, set())["input"].shape == (3, 3, 32, 32)
    out = run_cli("run", CNN, "--random-inputs", "--dim", "foo=3")
    assert out.returncode == 2 and "'foo'" in out.stderr and "Traceback" not in out.stderr
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 32, 32), np.float32))
    unused = run_cli("run", CNN, "--dim", "N=3", "--input", f"input={tmp_path / 'x.npy'}")  # --dim would do nothing
    assert unused.returncode == 2 and "--dim" in unused.stderr and "--random-inputs" in unused.stderr


def _relu_model(opset: int) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def test_opset_newer_than_known_is_refused_naming_what_is_supported(tmp_path: Path) -> None:
    newest = onnx.defs.onnx_opset_version()
    x = np.array([-1.0, 2.0], np.float32)
    assert dsp.compile(_relu_model(newest)).run({"x": x})["y"].tolist() == [0.0, 2.0]
    with pytest.raises(ModelLoadError, match=rf"opset 30 of domain 'ai.onnx'.*opsets up to {newest}"):
        dsp.compile(_relu_model(30))
    path = tmp_path / "opset30.onnx"
    path.write_bytes(_relu_model(30))
    out = run_cli("run", str(path), "--random-inputs")
    assert out.returncode == 2 and "opset 30" in out.stderr and "Traceback" not in out.stderr
