"""The per-step cost of crossing a Ray actor boundary (dsp_core.devices.distributed, dsp-core[ray]).

An MLP (8 layers of ``--width`` float32, ReLU) runs in one process (``dsp.compile``, frozen)
and as a RayPipeline of 1, 2 and 4 stages on a local Ray instance with CPU actors. Each row:
the median seconds per step over ``--steps`` steps (after ``--warmup``). The boundary cost is
``(t(k stages) - t(1 stage)) / (k - 1)``: what one more actor hop adds per step, the bytes
crossing each hop being the activation (batch x width x 4). The 1-stage row minus the
in-process row is the fixed cost of going through Ray at all (driver -> actor -> driver).
With ``--serve N`` (dsp-core[serve]), a RayServe deployment of N whole-model replicas is
timed too: its latency per call through the deployment handle, and its throughput with
``--serve-batch`` calls in flight at once, next to one process running them one after another.

    python benchmarks/ray_stages.py --out benchmarks/results/ray_stages.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np


def per_step(run: Any, feeds: dict[str, np.ndarray], warmup: int, steps: int) -> float:
    """Median seconds of ``run(feeds)``."""
    for _ in range(warmup):
        run(feeds)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _serve_row(graph: Any, feeds: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    """Latency per call through a RayServe handle, and throughput with many calls in flight."""
    import dsp_core as dsp
    from dsp_core.devices.distributed import RayServe

    local = dsp.compile(graph, mode="slot_by_slot")
    app = RayServe(graph, replicas=args.serve, mode="slot_by_slot")
    try:
        latency = per_step(app.run, feeds, args.warmup, args.steps)
        batch = [feeds] * args.serve_batch
        app.map(batch)  # warm every replica
        start = time.perf_counter()
        app.map(batch)
        served = args.serve_batch / (time.perf_counter() - start)
        start = time.perf_counter()
        for f in batch:
            local.run(f)
        alone = args.serve_batch / (time.perf_counter() - start)
    finally:
        app.shutdown()
    return {
        "serve_replicas": args.serve,
        "serve_s": latency,
        "serve_calls_per_s": served,
        "in_process_calls_per_s": alone,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batches", default="1,64", help="batch sizes, comma-separated")
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--serve", type=int, default=0, help="also time a RayServe deployment of this many replicas")
    p.add_argument("--serve-batch", type=int, default=32, help="calls in flight for the Serve throughput")
    p.add_argument("--out", default="benchmarks/results/ray_stages.json")
    args = p.parse_args(argv)

    import ray

    import dsp_core as dsp
    from dsp_core.devices.distributed import RayPipeline
    from dsp_core.testing.models import mlp

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    graph = mlp([args.width] * 9, bias=False)  # 8 layers
    stage_counts = [int(s) for s in args.stages.split(",")]
    rows = []
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            feeds = {"x": np.random.default_rng(1).standard_normal((batch, args.width)).astype(np.float32)}
            local = dsp.compile(graph, mode="slot_by_slot")
            row: dict[str, Any] = {"batch": batch, "activation_bytes": batch * args.width * 4}
            row["in_process_s"] = per_step(local.run, feeds, args.warmup, args.steps)
            for k in stage_counts:
                pipe = RayPipeline(graph, stages=k)
                try:
                    row[f"stages_{k}_s"] = per_step(pipe.run, feeds, args.warmup, args.steps)
                finally:
                    pipe.shutdown()
            if args.serve:
                row.update(_serve_row(graph, feeds, args))
            one = row.get("stages_1_s")
            if one is not None:
                row["ray_fixed_s"] = one - row["in_process_s"]
                row["per_boundary_s"] = {k: (row[f"stages_{k}_s"] - one) / (k - 1) for k in stage_counts if k > 1}
            rows.append(row)
    finally:
        ray.shutdown()
    print(
        f"{'batch':>5} {'bytes':>8} {'in-process':>11} "
        + " ".join(f"{f'{k} stage(s)':>11}" for k in stage_counts)
        + f" {'per boundary':>13}"
    )
    for r in rows:
        cells = " ".join(f"{r[f'stages_{k}_s'] * 1e3:>8.3f} ms" for k in stage_counts)
        hops = ", ".join(f"{v * 1e3:.3f}" for v in r.get("per_boundary_s", {}).values())
        print(f"{r['batch']:>5} {r['activation_bytes']:>8} {r['in_process_s'] * 1e3:>8.3f} ms {cells}  {hops} ms")
    for r in rows:
        if "serve_s" in r:
            print(
                f"batch {r['batch']}: Serve ({args.serve} replicas) {r['serve_s'] * 1e3:.3f} ms per call; "
                f"{r['serve_calls_per_s']:.1f} calls/s with {args.serve_batch} in flight "
                f"vs {r['in_process_calls_per_s']:.1f} calls/s in one process"
            )
    result = {
        "format": "dsp-ray-stages/1",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/ray_stages.py " + " ".join(argv or []),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "versions": {"ray": ray.__version__, "numpy": np.__version__, "dsp_core": dsp.__version__},
        "width": args.width,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
