"""benchmarks/models_gpu.py's pure parts on the CPU: the table of a committed GPU run, the host-time measure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import models_gpu  # noqa: E402


def test_the_table_of_a_committed_run_has_every_column() -> None:
    results = json.loads((ROOT / "benchmarks/results/gpu_2026-12-03g/matrix/models_gpu.json").read_text())["results"]
    lines = models_gpu.table(results).splitlines()
    assert len(lines) == 2 + len(results)
    assert all(line.count(" | ") == 14 for line in lines)
    minilm = next(line for line in lines if line.startswith("minilm | fp16 | 1 |"))
    cells = minilm.split(" | ")
    assert cells[3] == "0.469" and cells[10] == "82 / 131" and cells[11] == "186 / 282"
    assert cells[12] == "- / -" and cells[13] == "-" and cells[14] == "-"  # that run predates these measures


def test_host_time_is_the_median_of_calls_each_from_an_idle_gpu() -> None:
    calls: list[str] = []
    us = models_gpu.host_us(lambda: calls.append("call"), 10, lambda: calls.append("sync"))
    assert calls == [*["sync", "call"] * 10, "sync"]
    assert 0 < us < 1e5


def test_fp32_math_is_set_alike_on_both_sides() -> None:
    from types import SimpleNamespace

    backends = SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=None)), cudnn=SimpleNamespace())
    environ: dict[str, str] = {"DSP_CUBLAS_TF32": "1"}
    models_gpu.set_fp32_math("exact", backends, environ)
    assert backends.cuda.matmul.allow_tf32 is False and backends.cudnn.allow_tf32 is False
    assert environ["DSP_CUBLAS_TF32"] == "0"
    models_gpu.set_fp32_math("tf32", backends, environ)
    assert backends.cuda.matmul.allow_tf32 is True and backends.cudnn.allow_tf32 is True
    assert environ["DSP_CUBLAS_TF32"] == "1"
    with pytest.raises(ValueError, match="one of exact, tf32"):
        models_gpu.set_fp32_math("bf16", backends, environ)


def test_the_host_profile_names_where_a_call_spends_its_time() -> None:
    def inner() -> int:
        return sum(range(2000))

    def call() -> int:
        return inner() + inner()

    def sync() -> None:  # waited for before each call and at the end, never inside the profile
        syncs.append(1)
        sum(range(5000))

    syncs: list[int] = []
    rows = models_gpu.host_profile(call, 50, sync)
    assert len(syncs) == 51 and 0 < len(rows) <= models_gpu.PROFILE_TOP
    assert not [r for r in rows if "sync" in r["function"]], rows
    top = {r["function"].split("(")[-1].rstrip(")"): r for r in rows}
    assert top["inner"]["calls_per_call"] == 2.0 and top["call"]["calls_per_call"] == 1.0
    assert top["call"]["cum_us_per_call"] >= top["inner"]["own_us_per_call"] > 0
    assert [r["own_us_per_call"] for r in rows] == sorted((r["own_us_per_call"] for r in rows), reverse=True)
