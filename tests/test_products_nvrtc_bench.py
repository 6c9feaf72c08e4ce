"""benchmarks/products_nvrtc.py on a machine without a GPU: its cases are valid graphs with the
shapes the sweep times, and the script says it needs a GPU instead of failing inside a case."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import dsp_core as dsp

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("products_nvrtc", BENCH / "products_nvrtc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_case_runs_on_the_reference_with_the_shapes_it_names() -> None:
    bench = _module()
    cases = bench.cases(["gpt2-124m", "llama-1b"])
    assert len(cases) == 11
    for _model, label, build, k, plain in cases:
        out = dsp.compile(build(), mode="slot_by_slot").run({"x": np.ones((1, 1, k), np.float16)})
        shapes = [tuple(v.shape) for v in (out.values() if isinstance(out, dict) else out)]
        if plain is not None:
            assert shapes == [(1, 1, plain[1])], (label, shapes)
        elif "qkv 2048" in label:
            assert shapes == [(1, 1, 2048), (1, 1, 512), (1, 1, 512)], (label, shapes)
        elif "gate/up" in label:
            assert shapes == [(1, 1, 8192)], (label, shapes)
        else:
            assert shapes == [(1, 1, 2304)], (label, shapes)


def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _module()
    if bench._no_gpu() is None:
        pytest.skip("a CUDA device is present: the script runs")
    assert bench.main(["--out", "/nonexistent/never-written.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
