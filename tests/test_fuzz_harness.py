"""The fuzz harness (scripts/fuzz.py) itself: it must see every failure class and keep its input.

A planted target decides by the input's CRC what to do (abort, SIGSEGV, spin, allocate a
terabyte, raise ValueError, raise an expected error, return), so the test knows exactly
how many of each the run must count, from the harness's own case generator.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "scripts" / "fuzz.py"

PLANTED = """
import os, signal, zlib

class Expected(Exception):
    pass

EXPECTED = (Expected,)

def action(data):
    h = zlib.crc32(data)
    if h % 97 == 0:
        return "hang"
    return ["abort", "segv", "blowup", "nondsp", "expected", "expected", "ok", "ok"][h % 8] if h % 5 == 0 else "ok"

def planted(data):
    what = action(data)
    if what == "abort":
        os.abort()
    if what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "hang":
        while True:
            pass
    if what == "blowup":
        bytearray(1 << 40)
    if what == "nondsp":
        raise ValueError("planted")
    if what == "expected":
        raise Expected("fine")
    return "ok"

def clean(data):
    if zlib.crc32(data) % 3 == 0:
        raise Expected("fine")

def soft(data):
    if zlib.crc32(data) % 7 == 0:
        raise ValueError("planted")
"""

CLASS_OF = {"abort": "crash", "segv": "crash", "hang": "hang", "blowup": "blowup", "nondsp": "nondsp"}
CLASS_OF.update({"expected": "dsp", "ok": "ok"})


def load_fuzz():
    if "fuzz_harness" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fuzz_harness", FUZZ)
        module = importlib.util.module_from_spec(spec)
        sys.modules["fuzz_harness"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["fuzz_harness"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    seeds = base / "seeds"
    seeds.mkdir()
    f = TensorProto.FLOAT
    relu = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", f, ["n", 3])],
        [helper.make_tensor_value_info("y", f, ["n", 3])],
    )
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    mm = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Softmax", ["y"], ["z"], axis=-1)],
        "g",
        [helper.make_tensor_value_info("x", f, [2, 3])],
        [helper.make_tensor_value_info("z", f, [2, 2])],
        [w],
    )
    for name, graph in (("relu", relu), ("mm", mm)):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        (seeds / f"{name}.onnx").write_bytes(model.SerializeToString())
    target = base / "planted.py"
    target.write_text(PLANTED)
    return base, seeds, target


def run_fuzz(args, timeout=240):
    cmd = [sys.executable, str(FUZZ), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def expected_counts(seeds: Path, target: Path, cases: int, seed: int) -> Counter:
    """What the planted target does on each case the harness will generate."""
    fuzz = load_fuzz()
    corpus = fuzz.Corpus(fuzz.dir_seeds(seeds))
    spec = importlib.util.spec_from_file_location("planted", target)
    planted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planted)
    return Counter(CLASS_OF[planted.action(corpus.case(seed, i)[0])] for i in range(cases))


@pytest.fixture(scope="module")
def planted_run(setup):
    base, seeds, target = setup
    out = base / "out"
    cases, seed = 400, 7
    args = ["--cases", str(cases), "--time", "0", "--jobs", "2", "--timeout", "1", "--mem-mb", "512"]
    args += ["--seed", str(seed), "--no-default-seeds", "--seed-dir", str(seeds), "--out", str(out)]
    args += ["--target", f"{target}:planted", "--progress", "1"]
    proc = run_fuzz(args)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, out, expected_counts(seeds, target, cases, seed)


def test_counts_every_outcome_exactly(planted_run):
    proc, summary, _, expected = planted_run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert summary["inputs"] == 400
    for cls in ("crash", "hang", "blowup", "nondsp"):
        assert expected[cls] >= 1, f"the planted run has no {cls}: pick another seed"
    got = {cls: n for cls, n in summary["classes"].items() if n}
    assert got == dict(expected), proc.stdout
    assert summary["outcomes"]["nondsp run:ValueError"] == expected["nondsp"]
    assert summary["outcomes"]["dsp run:Expected"] == expected["dsp"]
    assert summary["outcomes"]["hang timeout"] == expected["hang"]
    assert summary["outcomes"]["blowup run:MemoryError"] == expected["blowup"]
    crashes = summary["outcomes"].get("crash signal:SIGABRT", 0) + summary["outcomes"].get("crash signal:SIGSEGV", 0)
    assert crashes == expected["crash"]
    assert "failures: nondsp" in proc.stdout and "inputs" in proc.stdout


def test_saves_a_reproducer_for_each_failure_class(planted_run):
    _, summary, out, _ = planted_run
    fuzz = load_fuzz()
    for folder in ("crashes", "hangs", "blowups", "nondsp"):
        files = sorted((out / folder).glob("*.onnx"))
        assert files, f"no reproducer in {folder}"
        assert files[0].with_suffix(".txt").exists()
    for key, entry in summary["signatures"].items():
        for path in entry["reproducers"]:
            assert Path(path).exists(), key
    # a reproducer is the exact input: --regen of its case id gives the same bytes
    repro = sorted((out / "crashes").glob("*.onnx"))[0]
    case_id = int(repro.stem.rsplit("-", 1)[1])
    corpus = fuzz.Corpus(fuzz.dir_seeds(out.parent / "seeds"))
    assert corpus.case(7, case_id)[0] == repro.read_bytes()


def test_replay_reproduces_the_outcome(planted_run, setup):
    _, _, out, _ = planted_run
    _, _, target = setup
    nondsp = sorted((out / "nondsp").glob("*.onnx"))[0]
    proc = run_fuzz(["--replay", str(nondsp), "--target", f"{target}:planted"], timeout=60)
    assert proc.returncode == 1
    assert "nondsp run:ValueError" in proc.stdout
    crash = [p for p in sorted((out / "crashes").glob("*.onnx")) if "SIGSEGV" in p.name]
    if crash:
        proc = run_fuzz(["--replay", str(crash[0]), "--target", f"{target}:planted"], timeout=60)
        assert proc.returncode == -signal.SIGSEGV


def test_a_clean_target_passes(setup):
    base, seeds, target = setup
    out = base / "clean"
    args = ["--cases", "300", "--time", "0", "--jobs", "2", "--no-default-seeds", "--seed-dir", str(seeds)]
    args += ["--out", str(out), "--target", f"{target}:clean"]
    proc = run_fuzz(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["inputs"] == 300 and summary["restarts"] == 0
    assert summary["classes"]["ok"] + summary["classes"]["dsp"] == 300
    fuzz = load_fuzz()
    corpus = fuzz.Corpus(fuzz.dir_seeds(seeds))
    assert summary["classes"]["dsp"] == sum(zlib.crc32(corpus.case(0, i)[0]) % 3 == 0 for i in range(300))


def test_the_coverage_guided_engine_counts_and_keeps_what_it_finds(setup):
    pytest.importorskip("atheris", reason="atheris (the coverage-guided engine, in the test extra) is not installed")
    base, seeds, target = setup
    out = base / "atheris"
    args = ["--engine", "atheris", "--cases", "300", "--time", "0", "--jobs", "2", "--no-default-seeds"]
    args += ["--seed-dir", str(seeds), "--out", str(out), "--target", f"{target}:soft"]
    proc = run_fuzz(args)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the planted ValueErrors are failures
    summary = json.loads((out / "summary.json").read_text())
    assert summary["inputs"] == 300 and summary["restarts"] == 0
    assert summary["classes"]["nondsp"] >= 1 and summary["classes"]["ok"] >= 1
    assert summary["classes"]["ok"] + summary["classes"]["nondsp"] == 300
    repro = sorted((out / "nondsp").glob("*.onnx"))[0]
    assert zlib.crc32(repro.read_bytes()) % 7 == 0  # the reproducer is the very input that failed
    replay = run_fuzz(["--replay", str(repro), "--target", f"{target}:soft"], timeout=60)
    assert replay.returncode == 1 and "nondsp run:ValueError" in replay.stdout
