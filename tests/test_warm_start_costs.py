"""What every start pays, cold or warm, kept to what it needs (docs/cache.md, "A GenerationPipeline's warm start")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dsp_cpu_ref.plugin import SlotBySlotBackend

import dsp_core as dsp
from dsp_core.backends import auction, discovery
from dsp_core.backends.base import Availability, Registry
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.runtime import loader

FIXTURES = Path(__file__).resolve().parent / "fixtures"


class _Probed(SlotBySlotBackend):
    """A CPU runtime's place in AUTO's chain, with its availability probe counted (a real one may import
    a whole runtime)."""

    name = "probed_cpu_runtime"
    mode = GraphExecutionMode.OPENVINO

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    def _availability_probe(self) -> Availability:
        self.probes += 1
        return Availability.yes()


@pytest.mark.parametrize("excluded", [True, False])
def test_auto_does_not_probe_a_backend_it_leaves_out(monkeypatch: pytest.MonkeyPatch, excluded: bool) -> None:
    probed = _Probed()
    registry = Registry([*discovery.discover().backends, probed])
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", f"{probed.name},openvino,onnxruntime,numpy_replay" if excluded else "none")
    chain, _ = auction.candidates(registry, GraphExecutionMode.AUTO)
    assert (probed in chain) is not excluded
    assert probed.probes == (0 if excluded else 1)


def test_importing_dsp_imports_no_onnx() -> None:
    """onnx (and protobuf) load only for what needs them: a cold compile, not a warm start's imports."""
    code = "import sys, dsp_core, dsp_core.llm; print([m for m in ('onnx', 'google.protobuf') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_greedy_generation_imports_no_numpy_random() -> None:
    """numpy.random (about 5 ms of imports) is for sampling: a greedy generation draws nothing."""
    code = (
        "import sys, numpy as np; from dsp_core.llm import GenerationPipeline; "
        f"GenerationPipeline({str(FIXTURES / 'gpt2_eager.onnx')!r}, max_length=16).generate(np.arange(1, 5), 4); "
        "print(sorted(m for m in sys.modules if m.startswith('numpy.random')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_warm_start_does_not_parse_a_model_for_its_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(FIXTURES / "external_data", tmp_path / "model")
    path = tmp_path / "model" / "mlp.onnx"
    golden = np.load(path.with_name("mlp.golden.npz"))
    _fresh_process()  # an earlier test may have keyed the same content in this process
    cold = dsp.compile(path)
    name = cold.input_names[0]
    _fresh_process()

    def no_parse(model: object) -> tuple[str, ...]:
        raise AssertionError("the model was parsed for its external-data locations on a warm start")

    monkeypatch.setattr(loader, "_external_locations", no_parse)
    warm = dsp.compile(path)
    assert warm.stats.disk_hits == 1
    out = cold.output_names[0]
    np.testing.assert_array_equal(warm.run({name: golden["x"]})[out], cold.run({name: golden["x"]})[out])


def _fresh_process() -> None:
    """What a new process starts with: no in-process memo of digests or locations."""
    with loader._memo_lock:
        loader._memo.clear()
        loader._locations_memo.clear()
