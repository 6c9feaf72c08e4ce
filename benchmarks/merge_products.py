"""Merged sibling products on the CPU: are numpy's bits the same, what does it cost, what does the plan gain.

    python benchmarks/merge_products.py [--repeats 5] [--out benchmarks/results/merge_products.json]

(a) For each shape, one numpy product over the weights joined along N against the
separate products: how many parts differ in any bit (why the reference runs the parts
apart, docs/merge.md), and the host time of each way (median of ``--repeats`` batches).
(b) On the decoder fixtures: merges, slots and reference-policy kernels per step of the
prefill and decode plans, with DSP_MERGE_PRODUCTS on and off. A benchmark, not a test:
nothing here fails on a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import machine_meta, write_results

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
# (label, K, part widths): the fixtures' Q/K/V and gate/up, odd widths, a Llama-3.2-1B layer's
SHAPES = [
    ("fixture qkv", 64, (64, 32, 32)),
    ("fixture gate/up", 64, (128, 128)),
    ("odd widths", 63, (17, 5, 33)),
    ("llama-1b qkv", 2048, (2048, 512, 512)),
    ("llama-1b gate/up", 2048, (8192, 8192)),
]
ROWS = (1, 32)  # decode, and a 32-token prefill


def _median_us(fn: Callable[[], Any], repeats: int, calls: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def products(repeats: int) -> list[dict[str, Any]]:
    """Part (a): bit differences and host time, separate products vs one over the concatenation."""
    rng = np.random.default_rng(0)
    rows = []
    for label, k, widths in SHAPES:
        weights = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
        joined = np.concatenate(weights, axis=1)
        bounds = np.cumsum(widths)[:-1]
        calls = max(1, int(2e7 // (k * sum(widths))))
        for m in ROWS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            parts = np.split(x @ joined, bounds, axis=-1)
            differ = sum(not np.array_equal(x @ w, p) for w, p in zip(weights, parts))
            rows.append(
                {
                    "shape": label,
                    "m": m,
                    "k": k,
                    "widths": list(widths),
                    "parts_not_bit_equal": differ,
                    "separate_us": _median_us(lambda x=x, ws=weights: [x @ w for w in ws], repeats, calls),
                    "joined_us": _median_us(lambda x=x, j=joined: x @ j, repeats, calls),
                }
            )
    return rows


def plans() -> list[dict[str, Any]]:
    """Part (b): merges, slots and kernels per step of each decoder fixture, rewrite on and off."""
    from dsp_core.cli import fuse_report

    rows = []
    for name in ("gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23"):
        for decode in (False, True):
            row: dict[str, Any] = {"model": name, "plan": "decode" if decode else "prefill"}
            for flag in ("0", "1"):
                os.environ["DSP_MERGE_PRODUCTS"] = flag
                report = fuse_report(str(FIXTURES / f"{name}.onnx"), decode=decode)
                side = "on" if flag == "1" else "off"
                row[f"slots_{side}"] = report["slots"]
                row[f"kernels_{side}"] = report["kernels"]
                row[f"merges_{side}"] = len(report["merges"]["merged"])
            rows.append(row)
    os.environ.pop("DSP_MERGE_PRODUCTS", None)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "merge_products.json"))
    args = parser.parse_args()
    os.environ.setdefault("DSP_DISK_CACHE", "0")
    prod = products(args.repeats)
    print(f"{'shape':<18} {'M':>3} {'K':>5} {'widths':<18} {'parts differ':>12} {'separate us':>12} {'joined us':>10}")
    for r in prod:
        widths = "+".join(str(n) for n in r["widths"])
        print(
            f"{r['shape']:<18} {r['m']:>3} {r['k']:>5} {widths:<18} "
            f"{r['parts_not_bit_equal']:>5} of {len(r['widths']):<4} {r['separate_us']:>12.1f} {r['joined_us']:>10.1f}"
        )
    plan_rows = plans()
    print(f"\n{'model':<18} {'plan':<8} {'merges':>6} {'slots off->on':>14} {'kernels/step off->on':>21}")
    for r in plan_rows:
        print(
            f"{r['model']:<18} {r['plan']:<8} {r['merges_on']:>6} {r['slots_off']:>6} -> {r['slots_on']:<5} "
            f"{r['kernels_off']:>10} -> {r['kernels_on']}"
        )
    write_results(args.out, machine_meta(blas=_blas()), {"products": prod, "plans": plan_rows})
    return 0


def _blas() -> str:
    """numpy's BLAS, as its build config names it."""
    try:
        config = np.show_config(mode="dicts")
        blas = config["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # noqa: BLE001  (an older numpy: the figure is still worth writing)
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
