"""Every input `make fuzz` found (tests/fixtures/fuzz) replays to a DSPError or an agreeing run, quickly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "fixtures" / "fuzz"

# file stem -> the outcome it must replay to (the harness's "class key")
EXPECTED = {
    "avgpool_negative_dilation_read_outside": "dsp compile:GraphError",
    "einsum_float_equation_hung_inference": "dsp compile:GraphError",
    "einsum_nul_equation_hung_inference": "dsp compile:GraphError",
    "maxpool_65535_window_took_14s": "ok ran",
    "scan_returns_int64_state_for_float": "dsp compile:DTypeError",
    "scan_state_float8_vs_body_float": "dsp compile:DTypeError",
    "sub_int64_float32_typed_by_inference": "dsp compile:DTypeError",
    "unnamed_graph_input": "dsp compile:GraphError",
    "zero_trip_loop_body_declared_bool": "dsp compile:DTypeError",
    "zero_trip_loop_body_declared_shape": "dsp compile:DTypeError",
    "zero_trip_loop_output_info_two_sources": "ok ran",
    "zero_trip_loop_inference_dropped_declared_shape": "ok ran",
    "scan_num_scan_inputs_huge_memoryerror": "dsp compile:GraphError",
    "zero_trip_loop_shape_from_rules_vs_declared": "ok ran",
    "zero_trip_loop_shape_5_vs_1": "ok ran",
    "hammingwindow_scalar_gap_output_bridged_as_a_scalar": "ok ran",  # and under numpy_replay: test_numpy_replay.py
}


def test_every_fuzz_finding_replays_to_its_expected_outcome() -> None:
    files = sorted(CASES.glob("*.onnx"))
    assert {f.stem for f in files} == set(EXPECTED), "a new finding needs its expected outcome here"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--fail-on-mismatch", "--replay", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
        # a loaded machine must not change an outcome: the one that needs ONNX's inferred types
        # (sub_int64_float32_typed_by_inference) must not lose them to the sandbox's timeout
        env={**os.environ, "DSP_DISK_CACHE": "0", "DSP_SHAPE_INFERENCE_TIMEOUT": "120"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    seen = {}
    for line in proc.stdout.splitlines():
        if ".onnx: " in line:
            path, rest = line.split(": ", 1)
            cls, key = rest.split()[:2]
            seconds = float(rest.rsplit("(", 1)[1].split()[0])
            seen[Path(path).stem] = (f"{cls} {key}", seconds)
    for stem, want in EXPECTED.items():
        got, seconds = seen[stem]
        assert got == want, f"{stem}: {got}, expected {want}"
        assert seconds < 10, f"{stem} took {seconds} s"  # the MaxPool one took 14 s before its fix
