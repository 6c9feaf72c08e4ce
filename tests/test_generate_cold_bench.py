"""benchmarks/generate_cold.py on a fixture decoder: it runs, writes its JSON, and after the first call
no call of the pipeline compiles a runtime model again (the prompt plan's freeze on the third call
finds the model its eager runs compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FIXTURES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "generate_cold.py"


def test_the_benchmark_counts_each_calls_compiles_and_later_calls_compile_nothing(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    env = {**os.environ, "DSP_CACHE_DIR": str(tmp_path / "cache"), "DSP_CPU_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(FIXTURES / "gpt2_eager.onnx"), "--tokens", "4",
         "--prompt", "5", "--calls", "4", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["call"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["compiles"] >= 1, rows
    assert rows[1]["compiles"] == 0 and rows[3]["compiles"] == 0, rows
    # the third call freezes the prompt plan: at most the measured auction's candidate is compiled
    assert rows[2]["compiles"] <= 1, rows
    assert len({tuple(r["last_tokens"]) for r in rows}) == 1, rows
