"""Run ONNX's node conformance cases through DSP and report passed / excluded / failed.

    python scripts/node_suite.py                      # every case, through dsp_core.onnx_backend
    python scripts/node_suite.py --ops Add,Sub,Relu   # only cases whose graph uses these ops
    python scripts/node_suite.py --pattern '^test_conv' --verbose
    python scripts/node_suite.py --json out.json

Each case's model runs on its stored inputs; outputs are compared with the stored
outputs at the case's own tolerance (rtol, atol), as onnx's BackendTest does.
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


def run_case(case: Any) -> None:
    """Run one case through dsp_core.onnx_backend; raise on any difference."""
    from dsp_core import onnx_backend

    rep = onnx_backend.prepare(case.model)
    for inputs, outputs in case.data_sets:
        inputs, outputs = _arrays(inputs), _arrays(outputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = rep.run(inputs)
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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 1 when a non-excluded case fails."""
    from conformance.exclusions import EXCLUDED

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated op types; keep cases that use any")
    parser.add_argument("--pattern", help="regex on the case name")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each failure")
    parser.add_argument("--json", help="write the per-case results here")
    parser.add_argument("--no-exclusions", action="store_true", help="run excluded cases too")
    args = parser.parse_args(argv)

    cases = load_cases()
    total = len(cases)
    if args.ops:
        wanted = set(args.ops.split(","))
        cases = [c for c in cases if op_types(c.model) & wanted]
    if args.pattern:
        rx = re.compile(args.pattern)
        cases = [c for c in cases if rx.search(c.name)]

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


if __name__ == "__main__":
    sys.exit(main())
