"""benchmarks/multi_gpu.py on two stub devices (the CPU reference, a committed fixture): the rows the
two-GPU run prints come out of the same code, with tokens equal to one device's and the cut's
copied bytes equal to the placement's prediction."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("multi_gpu", ROOT / "benchmarks" / "multi_gpu.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["multi_gpu"] = bench
_spec.loader.exec_module(bench)


def test_the_three_rows_on_stub_devices(tmp_path: Path, capsys: Any) -> None:
    fixture = ROOT / "tests" / "fixtures" / "gpt2_eager.onnx"
    argv = ["--onnx", str(fixture), "--stub", "2", "--mode", "slot_by_slot", "--new-tokens", "24"]
    argv += ["--repeats", "1", "--spill-fraction", "0.77", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert result["format"] == "dsp-multi-gpu/1" and result["date"] and result["versions"]["numpy"]
    (record,) = result["records"]
    rows = {r["row"]: r for r in record["rows"]}
    assert set(rows) == set(bench.ROWS) and not any("error" in r for r in rows.values())
    cap = int(record["resident_bytes"] * 0.77)
    for name in ("pipeline_parallel", "memory_fit_spill"):
        r = rows[name]
        assert r["tokens_equal_one_device"] and r["devices"] == [0, 1]
        for cut in r["cuts"]:
            assert cut["measured_bytes_per_step"] == cut["predicted_bytes_per_step"] > 0
            assert cut["modelled_s_per_step"] == pytest.approx(cut["measured_bytes_per_step"] / 300e9)
    assert (
        rows["memory_fit_spill"]["cap_bytes"] == cap and max(rows["memory_fit_spill"]["weight_bytes_per_device"]) <= cap
    )
    out = capsys.readouterr().out
    assert "pipeline_parallel" in out and "predicted" in out


def test_unknown_rows_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown row 'ring'"):
        bench.main(["--onnx", "x.onnx", "--stub", "2", "--rows", "ring", "--out", str(tmp_path)])
