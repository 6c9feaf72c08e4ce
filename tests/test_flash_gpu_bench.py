"""benchmarks/flash_gpu.py on a machine without a GPU: its shapes parse (and bad ones say why), the
group it times is the flash template's at every config, and the script says it needs a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("flash_gpu")


def test_shapes_parse_and_bad_ones_say_why() -> None:
    bench = _module()
    assert bench.parse_shapes("1x512, 8X128") == [(1, 512), (8, 128)]
    with pytest.raises(SystemExit, match="not BATCHxSEQ"):
        bench.parse_shapes("512")
    with pytest.raises(SystemExit, match="more than 16 rows"):
        bench.parse_shapes("1x16")


def test_every_config_it_times_is_the_flash_kernel_of_the_fixture() -> None:
    pytest.importorskip("dsp_triton")
    from dsp_triton import codegen

    bench = _module()
    spec = bench.attention_spec(2, 40)
    configs = codegen.attention_configs(spec)
    assert len(configs) > 1
    for config in configs:
        kernel = codegen.generate(spec, config=config)
        assert kernel.name.startswith("dsp_attn_") and kernel.source.count("tl.dot(") == 2
        assert not kernel.dependent
    # the inputs it makes follow the group's layout: Q, K, V, the scale and the mask, then one output
    kernel = codegen.generate(spec)
    assert kernel.n_inputs == 5 and len(kernel.args) == 6


def test_without_a_gpu_it_says_so() -> None:
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the benchmark would run")
    with pytest.raises(SystemExit, match="needs (torch and )?a CUDA GPU"):
        _module().main(["--shapes", "1x64", "--out", "/dev/null"])
