"""What diagnostics cost per step: off vs compiled out (and, for scale, on).

    python benchmarks/diag_overhead.py [--rounds 61] [--calls 50] [--out benchmarks/results/diag_overhead.json]

The case is the GPT-2 fixture's decode step (tests/fixtures/gpt2_eager.onnx, feeds
``step1.<input>`` of its golden file) in SLOT_BY_SLOT and EMULATED_REPLAY, after the plan
froze. Variants:

- ``compiled_out``: every emission point removed. The modules that hold them are
  re-compiled from their source with the ``if diag.ON:`` / ``if diag.TIMED:`` blocks
  replaced by their else branch and every ``diag.*(...)`` / ``self._diag*(...)``
  statement dropped; the new code objects are swapped into the live functions, so the
  same compiled model runs hook-free code. This is the build without diagnostics.
- ``off``: the shipped code with diagnostics off (the default).
- ``on_summary`` / ``on_detailed``: every category at that level (for scale).

Rounds interleave the variants; each sample is the mean time of ``--calls`` steps and
the figure is the median over rounds. A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import numpy as np
from common import machine_meta, write_results

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "tests" / "fixtures" / "gpt2_eager.onnx"
GPT2_GOLDEN = ROOT / "tests" / "fixtures" / "gpt2_eager.golden.npz"

# Every module with an emission point (the hooks the diagnostics added to the core).
HOOKED_MODULES = (
    "dsp_core.runtime.lifecycle",
    "dsp_core.runtime.plan_runtime",
    "dsp_core.runtime.model",
    "dsp_core.runtime.loader",
    "dsp_core.cache.memory",
    "dsp_core.backends.auction",
    "dsp_cpu_ref.slot_by_slot",
)
FLAGS = {"ON", "TIMED"}
WARMUP_CALLS = 5  # per variant and round, untimed: the interpreter re-specialises swapped code


# -- compiled out ---------------------------------------------------------------------------
def _is_diag(node: ast.AST) -> bool:
    """``diag.<anything>``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "diag"


class StripDiag(ast.NodeTransformer):
    """Remove emission points: flag tests keep their else branch, emission statements go."""

    def visit_If(self, node: ast.If) -> Any:
        """``if diag.ON: A else: B`` -> ``B``."""
        self.generic_visit(node)
        if _is_diag(node.test) and node.test.attr in FLAGS:  # type: ignore[attr-defined]
            return node.orelse or None
        return node

    def visit_Expr(self, node: ast.Expr) -> Any:
        """``diag.transition(...)`` or ``self._diag(...)`` as a statement -> nothing."""
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            if _is_diag(call.func) or call.func.attr.startswith("_diag"):
                return None
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        """Keep every emptied body valid with a ``pass``."""
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if name == "body" and isinstance(block, list) and not block:
                block.append(ast.Pass())
        return node


def stripped_module(module: ModuleType) -> ModuleType:
    """The module's source without emission points, executed as a separate module."""
    tree = ast.fix_missing_locations(StripDiag().visit(ast.parse(inspect.getsource(module))))
    clean = ModuleType(module.__name__ + "__compiled_out")
    clean.__file__ = module.__file__
    sys.modules[clean.__name__] = clean  # dataclasses look their module up there
    exec(compile(tree, module.__file__ or module.__name__, "exec"), clean.__dict__)  # noqa: S102
    return clean


def _functions(owner: Any, prefix: str = "") -> Iterator[tuple[str, FunctionType]]:
    """(qualified name, function) of every function of a module or class, methods and properties included."""
    for name, value in vars(owner).items():
        if isinstance(value, property):
            for part, fn in (("fget", value.fget), ("fset", value.fset)):
                if isinstance(fn, FunctionType):
                    yield f"{prefix}{name}.{part}", fn
        elif isinstance(value, (staticmethod, classmethod)):
            if isinstance(value.__func__, FunctionType):
                yield prefix + name, value.__func__
        elif isinstance(value, FunctionType):
            yield prefix + name, value
        elif isinstance(value, type) and value.__module__ == getattr(owner, "__name__", value.__module__):
            yield from _functions(value, f"{prefix}{name}.")


def swaps(module: ModuleType) -> list[tuple[FunctionType, Any, Any]]:
    """(function, shipped code, hook-free code) for each function of ``module`` defined in its file."""
    clean = dict(_functions(stripped_module(module)))
    out = []
    for qualname, fn in _functions(module):
        new = clean.get(qualname)
        code = fn.__code__
        if new is None or code.co_filename != module.__file__ or new.__code__.co_freevars != code.co_freevars:
            continue
        out.append((fn, code, new.__code__))
    return out


@functools.cache
def _swap_table() -> tuple[tuple[FunctionType, Any, Any], ...]:
    """Built once, so every round runs the same (already specialised) hook-free code objects."""
    return tuple(s for name in HOOKED_MODULES for s in swaps(importlib.import_module(name)))


@contextlib.contextmanager
def compiled_out() -> Iterator[int]:
    """Run hook-free code inside the block; yields how many functions were swapped."""
    table = _swap_table()
    for fn, _, new in table:
        fn.__code__ = new
    try:
        yield len(table)
    finally:
        for fn, old, _ in table:
            fn.__code__ = old


# -- the case -----------------------------------------------------------------------------
def gpt2_feeds() -> tuple[Any, dict[str, np.ndarray]]:
    """The GPT-2 fixture's graph and its first decode step's feeds."""
    from dsp_core.ir.onnx_import import import_model

    graph = import_model(str(GPT2))
    golden = np.load(GPT2_GOLDEN)
    return graph, {name: golden["step1." + name] for name in graph.input_names}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Diagnostics set up as the variant says (and reset afterwards)."""
    from dsp_core import diag

    diag.disable()
    diag.clear()
    if name == "compiled_out":
        with compiled_out():
            yield
        return
    if name.startswith("on_"):
        diag.enable("ALL", name[3:])
    try:
        yield
    finally:
        diag.disable()
        diag.clear()


def sample(step: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call over ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t0) / calls


def bench_mode(mode: str, variants: list[str], rounds: int, calls: int) -> dict[str, Any]:
    """Interleaved rounds of every variant on one compiled model; medians in microseconds."""
    import dsp_core as dsp

    graph, feeds = gpt2_feeds()
    model = dsp.compile(graph, mode=mode)
    expected = model.run_legacy(feeds)
    for _ in range(6):  # freeze, warm, capture, replay
        model.run(feeds)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            with variant(v):
                step = lambda: model.run(feeds)  # noqa: E731
                sample(step, WARMUP_CALLS)
                samples[v].append(sample(step, calls))
    got = model.run(feeds)
    for key, want in expected.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5)
    medians = {v: statistics.median(s) * 1e6 for v, s in samples.items()}
    return {
        "mode": mode,
        "phase": model.dsp.phase.name,
        "median_us": {v: round(m, 2) for v, m in medians.items()},
        "min_us": {v: round(min(s) * 1e6, 2) for v, s in samples.items()},
        "samples_us": {v: [round(x * 1e6, 2) for x in s] for v, s in samples.items()},
        "off_over_compiled_out": round(medians["off"] / medians["compiled_out"], 4),
        "paired_off_over_compiled_out": paired(samples["off"], samples["compiled_out"]),
    }


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-round ratios a/b (same round, so drift cancels)."""
    q1, q2, q3 = statistics.quantiles([x / y for x, y in zip(a, b)], n=4)
    return {"median": round(q2, 4), "q1": round(q1, 4), "q3": round(q3, 4)}


def main(argv: list[str] | None = None) -> int:
    """Run both modes, print a table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=61)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "diag_overhead.json"))
    args = p.parse_args(argv)
    if not GPT2.exists():
        print("skipped: tests/fixtures/gpt2_eager.onnx not found")
        return 0

    with compiled_out() as swapped:
        print(f"compiled out: {swapped} functions of {len(HOOKED_MODULES)} modules re-compiled without hooks")
    variants = ["compiled_out", "off", "on_summary", "on_detailed"]
    results = [bench_mode(m, variants, args.rounds, args.calls) for m in ("slot_by_slot", "emulated_replay")]
    header = (
        f"{'mode':<16} {'phase':<15}"
        + "".join(f"{v + ' µs':>17}" for v in variants)
        + f"{'off/out':>9}  paired off/out (q1..q3)"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        cells = "".join(f"{r['median_us'][v]:>17.1f}" for v in variants)
        pr = r["paired_off_over_compiled_out"]
        spread = f"{pr['median']:.4f} ({pr['q1']:.4f}..{pr['q3']:.4f})"
        print(f"{r['mode']:<16} {r['phase']:<15}{cells}{r['off_over_compiled_out']:>9.4f}  {spread}")
    meta = machine_meta(
        case="GPT-2 fixture decode step (step1 feeds), plan frozen",
        statistic=f"median over {args.rounds} interleaved rounds of the mean of {args.calls} steps",
        functions_swapped_when_compiled_out=swapped,
    )
    write_results(args.out, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
