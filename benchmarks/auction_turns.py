"""How the measured auction's turns judge two CPU runtimes: run by run, or in bursts.

The auction times the backends that take a segment in turns, so a shared machine's passing load
falls on all of them. This benchmark runs MiniLM-L3 (fp32, seq 128, batch 1) compiled by DSP on
OpenVINO and on ONNX Runtime, and times both three ways: alternating run by run (the auction's
turns until 2026-12-03), in bursts of 10 runs taken in turns, and in bursts with each burst's
first run dropped (the auction's turns since). Medians of 30 runs each, at 1 and 2 threads, each
thread count in its own process (the runtimes read their thread settings once).

    python benchmarks/auction_turns.py --out benchmarks/results/auction_bursts_2026-12-03.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_meta, runtime_versions, write_results  # noqa: E402

BACKENDS = ("openvino", "onnxruntime")
MARK = "AUCTION_TURNS="


def child(runs: int) -> dict[str, Any]:
    """In this process (threads already set): the three ways of taking turns, medians in ms."""
    from cpu_race import _minilm

    import dsp_core as dsp

    path, feeds = _minilm(1)
    models = {b: dsp.compile(path, mode=b) for b in BACKENDS}
    for m in models.values():
        for _ in range(4):
            m.run(feeds)

    def once(name: str) -> float:
        start = time.perf_counter()
        models[name].run(feeds)
        return time.perf_counter() - start

    out: dict[str, dict[str, float]] = {}
    got: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(runs):
        for b in BACKENDS:
            got[b].append(once(b))
    out["run_by_run"] = {b: 1e3 * statistics.median(v) for b, v in got.items()}
    for label, drop in (("bursts", 0), ("bursts_first_dropped", 1)):
        got = {b: [] for b in BACKENDS}
        for r in range(3):
            for b in BACKENDS[r % 2 :] + BACKENDS[: r % 2]:
                burst = [once(b) for _ in range(runs // 3 + drop)]
                got[b] += burst[drop:]
        out[label] = {b: 1e3 * statistics.median(v) for b, v in got.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/auction_bursts.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(child(args.runs)), flush=True)
        return 0
    rows = []
    for threads in args.threads:
        with tempfile.TemporaryDirectory(prefix="auction-turns-") as cache:
            env = {**os.environ, "DSP_CPU_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
            env.update(DSP_CACHE_DIR=cache, DSP_AUTO_EXCLUDE="none")
            cmd = [sys.executable, __file__, "--child", "--runs", str(args.runs)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith(MARK)), None)
        if line is None:
            print(f"{threads} thread(s): the child printed no result\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append({"threads": threads, "ms": json.loads(line[len(MARK) :])})
    print(f"{'threads':>7} {'turns':<22} {'OpenVINO ms':>12} {'ONNX Runtime ms':>16}")
    for row in rows:
        for label, ms in row["ms"].items():
            print(f"{row['threads']:>7} {label:<22} {ms['openvino']:>12.2f} {ms['onnxruntime']:>16.2f}")
    meta = machine_meta(model="MiniLM-L3 fp32, seq 128, batch 1", runs=args.runs, **runtime_versions())
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
