"""Run ONNX's node conformance cases through DSP and report passed / excluded / failed.

    python scripts/node_suite.py                      # every case, through dsp_core.onnx_backend
    python scripts/node_suite.py --ops Add,Sub,Relu   # only cases whose graph uses these ops
    python scripts/node_suite.py --pattern '^test_conv' --verbose
    python scripts/node_suite.py --json out.json
    python scripts/node_suite.py --mode cuda_graphs --json $OUT/node_suite_cuda.json   # on a GPU

Each case's model runs on its stored inputs; outputs are compared with the stored
outputs at the case's own tolerance (rtol, atol), as onnx's BackendTest does.

With ``--mode`` (cuda_graphs, emulated_replay, triton, ...) each case is compiled for that
mode and run ``--runs`` times (default 5: two slot-by-slot steps, the freeze and warm-up,
the capture, a replay), every run checked, and reported as one of:

- ``captured``: correct, and every live slot replays in a captured island;
- ``partly_captured``: correct, islands replay, some slots run eagerly in gaps (reasons given);
- ``eager``: correct, nothing replays (reasons: the gaps, declines, faults, or why it blocked);
- ``wrong``: an output differs from the stored one (on any run);
- ``failed``: a run raised (the error is the reason);
- ``excluded``: listed in tests/conformance/exclusions.py (with why), not run.

``correct`` counts captured + partly_captured + eager. The JSON has the counts and, per
case, the status and the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def load_cases() -> list[Any]:
    """Every node case of the installed onnx, built in memory."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(load_model_tests(kind="node"))


def op_types(model: Any) -> set[str]:
    """The op types of a model's top-level graph."""
    return {n.op_type for n in model.graph.node}


def _is_float(dtype: np.dtype[Any]) -> bool:
    """True for numpy's floats and complexes and ml_dtypes' (bfloat16, float8, float4)."""
    if dtype.kind in "fc":
        return True
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def compare(expected: np.ndarray, got: Any, rtol: float, atol: float) -> None:
    """Raise AssertionError when ``got`` differs from ``expected`` (dtype, shape, values)."""
    got = np.asarray(got)
    if expected.dtype != got.dtype:
        raise AssertionError(f"dtype {got.dtype} != expected {expected.dtype}")
    if expected.shape != got.shape:
        raise AssertionError(f"shape {got.shape} != expected {expected.shape}")
    if _is_float(expected.dtype):
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, expected)


def _arrays(values: list[Any]) -> list[Any]:
    """Stored inputs/outputs as numpy (some cases store TensorProtos, e.g. Cast's)."""
    from onnx import TensorProto, numpy_helper

    return [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in values]


class WrongOutput(AssertionError):
    """An output differs from the case's stored one."""


def run_case(case: Any, mode: str = "auto", runs: int = 1) -> Any:
    """Run one case through dsp_core.onnx_backend ``runs`` times per data set; raise on any difference.

    Returns the compiled model (its live plan tells what was captured). A difference is a
    WrongOutput; anything else the run raised propagates as it is.
    """
    from dsp_core import onnx_backend

    rep = onnx_backend.prepare(case.model, mode=mode)
    for inputs, outputs in case.data_sets:
        inputs, outputs = _arrays(inputs), _arrays(outputs)
        for _ in range(runs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = rep.run(inputs)
            try:
                _check_outputs(case, outputs, got)
            except AssertionError as exc:
                raise WrongOutput(str(exc)) from exc
    return rep.model


def _check_outputs(case: Any, outputs: list[Any], got: Any) -> None:
    """AssertionError when ``got`` is not the case's stored ``outputs``."""
    if len(got) != len(outputs):
        raise AssertionError(f"{len(got)} outputs, expected {len(outputs)}")
    for exp, g in zip(outputs, got):
        if isinstance(exp, list):  # sequence output
            if not isinstance(g, list) or len(exp) != len(g):
                got_kind = f"sequence of {len(g)}" if isinstance(g, list) else type(g).__name__
                raise AssertionError(f"{got_kind}, expected a sequence of {len(exp)}")
            for e, x in zip(exp, g):
                compare(np.asarray(e), x, case.rtol, case.atol)
        elif exp is None or g is None:  # an empty optional on either side
            if exp is not g:
                raise AssertionError(f"{type(g).__name__}, expected {type(exp).__name__}")
        else:
            compare(np.asarray(exp), g, case.rtol, case.atol)


def capture_state(model: Any) -> tuple[str, str]:
    """(captured / partly_captured / eager, the reasons for what ran eagerly) of a model after its runs."""
    from dsp_core.runtime.lifecycle import PlanPhase, SegmentPhase
    from dsp_core.runtime.units import UnitKind

    if model.declined is not None:
        return "eager", f"plan declined: {model.declined}"
    live = model.last_live
    if live is None:
        return "eager", "no live plan"
    runtime = live.runtime
    if runtime.phase is PlanPhase.SLOT_BY_SLOT:
        return "eager", "the plan never froze"
    if not runtime.units:
        return "captured", "every slot sealed at freeze (computed once)"
    part = model.partition()
    reasons: list[str] = []
    replaying = 0
    for unit in runtime.units:
        if unit.kind is UnitKind.ISLAND and unit.phase is SegmentPhase.REPLAYING:
            replaying += 1
            continue
        for why in _unit_reasons(unit, part, runtime.plan):
            if why not in reasons:
                reasons.append(why)
    if not reasons:
        return "captured", ""
    return ("partly_captured" if replaying else "eager"), "; ".join(reasons)


def _unit_reasons(unit: Any, part: Any, plan: Any) -> list[str]:
    """Why ``unit`` ran eagerly: its backend's faults or declines when it fell to the reference, else its reason."""
    slots = set(unit.segment.slots)
    found = [f"fault: {f.backend} {f.stage}: {f.reason}" for f in part.faults if slots & set(f.slots)]
    if unit.backend is part.reference:
        for s in unit.segment.slots:
            for name, decline in part.declines.get(s, []):
                found.append(f"{plan.slots[s].op} declined by {name}: {decline}")
    return found or [unit.reason or f"{unit.kind.value} {unit.phase.name}"]


CAPTURE_STATUSES = ("captured", "partly_captured", "eager", "wrong", "failed", "excluded")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 1 when a non-excluded case fails."""
    from conformance.exclusions import EXCLUDED

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated op types; keep cases that use any")
    parser.add_argument("--pattern", help="regex on the case name")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each failure")
    parser.add_argument("--json", help="write the per-case results here")
    parser.add_argument("--no-exclusions", action="store_true", help="run excluded cases too")
    parser.add_argument("--mode", help="compile every case for this mode and report what was captured")
    parser.add_argument("--runs", type=int, default=5, help="runs per data set with --mode (default 5)")
    parser.add_argument("--shard", help="K/N: run only every N-th case, starting at the K-th (0-based)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="with --mode: split the cases over this many processes, one report"
    )
    args = parser.parse_args(argv)
    if args.mode:
        return main_mode(args)

    cases, total = select(args)
    results: dict[str, str] = {}
    failures: dict[str, str] = {}
    start = time.perf_counter()
    for case in cases:
        if case.name in EXCLUDED and not args.no_exclusions:
            results[case.name] = "excluded"
            continue
        try:
            run_case(case)
            results[case.name] = "passed"
        except Exception as exc:  # noqa: BLE001  (a report, every failure counts)
            results[case.name] = "failed"
            failures[case.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if args.verbose:
                print(f"FAIL {case.name}: {failures[case.name]}")
    elapsed = time.perf_counter() - start
    counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "excluded", "failed")}
    print(
        f"node cases: {len(cases)} selected of {total}; passed {counts['passed']}, "
        f"excluded {counts['excluded']}, failed {counts['failed']} ({elapsed:.1f} s)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"total": total, "counts": counts, "results": results, "failures": failures}, indent=1)
        )
    return 1 if counts["failed"] else 0


def select(args: argparse.Namespace) -> tuple[list[Any], int]:
    """The cases ``--ops`` and ``--pattern`` keep, and how many there are in all."""
    cases = load_cases()
    total = len(cases)
    if args.ops:
        wanted = set(args.ops.split(","))
        cases = [c for c in cases if op_types(c.model) & wanted]
    if args.pattern:
        rx = re.compile(args.pattern)
        cases = [c for c in cases if rx.search(c.name)]
    if args.shard:
        k, n = _shard(args.shard)
        cases = cases[k::n]
    return cases, total


def _shard(text: str) -> tuple[int, int]:
    """``K/N`` as (K, N), with 0 <= K < N; a clear error otherwise."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard wants K/N (two integers), got {text!r}") from None
    if not 0 <= k < n:
        raise SystemExit(f"--shard {text}: K must be in 0..N-1")
    return k, n


def _first_lines(text: str, n: int = 3) -> str:
    """The first ``n`` non-blank lines of an error (numpy's assertion messages start with a blank one)."""
    return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][:n])


def _on_device(mode: str) -> bool:
    """True when ``mode``'s first backend here runs on a device (not on the CPU)."""
    from dsp_core.backends.auction import candidates
    from dsp_core.backends.discovery import discover
    from dsp_core.backends.modes import GraphExecutionMode

    with warnings.catch_warnings():  # a mode remapped here says so when its cases run
        warnings.simplefilter("ignore")
        chain, _ = candidates(discover(), GraphExecutionMode.parse(mode))
    return bool(chain) and chain[0].platform != "cpu"


def run_mode(cases: list[Any], mode: str, runs: int, exclusions: bool = True, verbose: bool = False) -> dict[str, Any]:
    """Run ``cases`` in ``mode``; the report: counts per status and, per case, status and reason."""
    from conformance.exclusions import DEVICE_EXCLUDED, EXCLUDED

    from dsp_core import progress

    excluded = {**EXCLUDED, **(DEVICE_EXCLUDED if _on_device(mode) else {})}
    report: dict[str, dict[str, str]] = {}
    with progress.step(f"node cases ({mode})", len(cases)) as bar:
        for case in cases:
            bar.advance(1)
            if case.name in excluded and exclusions:
                report[case.name] = {"status": "excluded", "reason": excluded[case.name]}
                continue
            try:
                model = run_case(case, mode, runs)
                status, reason = capture_state(model)
            except WrongOutput as exc:
                status, reason = "wrong", _first_lines(str(exc))
            except Exception as exc:  # noqa: BLE001  (a report: every failure counts)
                status, reason = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            report[case.name] = {"status": status, "reason": reason}
            if verbose and status in ("wrong", "failed"):
                print(f"{status.upper()} {case.name}: {reason}")
    counts = {k: sum(1 for r in report.values() if r["status"] == k) for k in CAPTURE_STATUSES}
    counts["correct"] = counts["captured"] + counts["partly_captured"] + counts["eager"]
    return {"mode": mode, "runs": runs, "selected": len(cases), "counts": counts, "cases": report}


def _run_jobs(args: argparse.Namespace, selected: int) -> dict[str, Any]:
    """``--jobs N``: N processes, each a ``--shard k/N`` of the selection; their reports as one."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k in range(args.jobs):
            cmd = [sys.executable, __file__, "--mode", args.mode, "--runs", str(args.runs)]
            cmd += ["--shard", f"{k}/{args.jobs}", "--json", f"{tmp}/{k}.json"]
            for flag in ("ops", "pattern"):
                if getattr(args, flag):
                    cmd += [f"--{flag}", getattr(args, flag)]
            cmd += ["--no-exclusions"] * args.no_exclusions + ["--verbose"] * args.verbose
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL if not args.verbose else None))
        codes = [p.wait() for p in procs]
        parts = []
        for k, code in enumerate(codes):
            path = Path(f"{tmp}/{k}.json")
            if not path.exists():
                raise SystemExit(f"node_suite: shard {k}/{args.jobs} wrote no report (exit status {code})")
            parts.append(json.loads(path.read_text()))
    cases: dict[str, dict[str, str]] = {}
    for part in parts:
        cases.update(part["cases"])
    counts = {k: sum(1 for r in cases.values() if r["status"] == k) for k in CAPTURE_STATUSES}
    counts["correct"] = counts["captured"] + counts["partly_captured"] + counts["eager"]
    assert len(cases) == selected, (len(cases), selected)
    return {"mode": args.mode, "runs": args.runs, "selected": selected, "counts": counts, "cases": cases}


def main_mode(args: argparse.Namespace) -> int:
    """``--mode``: per case captured / partly captured / eager (with reasons) / wrong / failed."""
    cases, total = select(args)
    start = time.perf_counter()
    if args.jobs > 1:
        report = _run_jobs(args, len(cases))
    else:
        report = run_mode(cases, args.mode, args.runs, not args.no_exclusions, args.verbose)
    report["total"] = total
    report["seconds"] = round(time.perf_counter() - start, 1)
    c = report["counts"]
    print(
        f"node cases ({args.mode}, {args.runs} runs each): {len(cases)} selected of {total}; correct {c['correct']} "
        f"(captured {c['captured']}, partly captured {c['partly_captured']}, eager {c['eager']}), "
        f"wrong {c['wrong']}, failed {c['failed']}, excluded {c['excluded']} ({report['seconds']} s)"
    )
    reasons: dict[str, int] = {}
    for r in report["cases"].values():
        if r["status"] in ("eager", "partly_captured"):
            for why in r["reason"].split("; "):
                reasons[why[:100]] = reasons.get(why[:100], 0) + 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {n:5d}  {why}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if c["wrong"] or c["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
