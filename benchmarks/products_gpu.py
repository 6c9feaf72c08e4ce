"""Skinny products on the GPU: dsp-triton's T3 kernel against cuBLAS, and both against the copy bandwidth.

For each decode projection shape (GPT-2 124M and the Llama-3.2-1B shape, fp16, one row),
a one-MatMul model runs in TRITON mode; the product's kernel time is the tuned config's
time per launch in a replayed graph, each launch after a write that flushes the L2 cache
(as in a decode step, where every weight is read once), read from the fusion report. cuBLAS
(torch.mm) is timed the same way. Achieved bandwidth is weight bytes / time; the floor is a
device-to-device copy of 1 GiB.

    python3 benchmarks/products_gpu.py --out benchmarks/results/products_gpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_meta, torch_flushed_us, write_results  # noqa: E402

SHAPES = {
    "gpt2-124m": [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)],
    "llama-1b": [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (2048, 128256)],
}
LAUNCHES = 20


def copy_bandwidth() -> float:
    """Read + write bytes per second of a 1 GiB device-to-device copy (as decode_gpu.py's floor)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    begin.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * reps / (begin.elapsed_time(end) * 1e-3)


def triton_time(k: int, n: int) -> dict[str, Any]:
    import cupy as cp

    import dsp_core as dsp

    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, k])
    w = g.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16), name="w")
    g.output(x @ w, "y")
    model = dsp.compile(g.build(), mode="triton", strict=True, outputs_on_device=True)
    feed = {"x": cp.asarray(rng.standard_normal((1, 1, k)).astype(np.float16))}
    for _ in range(4):
        model.run(feed)
    runtime = model.last_live.runtime
    reports = [r for u in runtime.units if hasattr(u.compiled, "fusion_report") for r in u.compiled.fusion_report()]
    prod = next(r for r in reports if r["template"] == "product")
    return {"us": prod["kernel_us"], "config": prod["config"], "status": prod["status"], "reason": prod["reason"]}


def cublas_time(k: int, n: int) -> float:
    """torch's cuBLAS product of the same shape, timed as dsp-triton tunes: each launch after an L2 flush."""
    import torch

    a = torch.randn(1, k, device="cuda", dtype=torch.float16)
    w = torch.randn(k, n, device="cuda", dtype=torch.float16)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16)
    return torch_flushed_us(lambda: torch.mm(a, w, out=out), LAUNCHES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-124m,llama-1b")
    p.add_argument("--out", default="benchmarks/results/products_gpu.json")
    args = p.parse_args(argv)
    import cupy as cp

    floor = copy_bandwidth()
    rows = []
    print(f"copy bandwidth {floor / 1e9:.0f} GB/s")
    head = f"{'model':<10} {'K x N':>14} {'triton us':>10} {'GB/s':>7} {'cuBLAS us':>10} {'GB/s':>7}"
    print(f"{head} {'x cuBLAS':>9} config")
    for model in args.models.split(","):
        for k, n in SHAPES[model]:
            try:
                t = triton_time(k, n)
            except Exception as exc:  # noqa: BLE001  (say which shape failed, go on with the others)
                print(f"{model} {k} x {n}: TRITON failed: {type(exc).__name__}: {exc}")
                t = {"us": None, "config": {}, "status": "error", "reason": str(exc)[:300]}
            c = cublas_time(k, n)
            nbytes = 2 * k * n
            tri = t["us"]
            row = {
                "model": model,
                "k": k,
                "n": n,
                "weight_bytes": nbytes,
                "triton_us": tri,
                "triton_gbs": None if not tri else nbytes / (tri * 1e-6) / 1e9,
                "cublas_us": c,
                "cublas_gbs": nbytes / (c * 1e-6) / 1e9,
                "triton_config": t["config"],
                "triton_status": t["status"],
                "vs_copy_triton": None if not tri else nbytes / (tri * 1e-6) / floor,
                "vs_copy_cublas": nbytes / (c * 1e-6) / floor,
            }
            rows.append(row)
            speed = f"{c / tri:.2f}x" if tri else "-"
            print(
                f"{model:<10} {f'{k} x {n}':>14} {tri or float('nan'):>10.2f} {row['triton_gbs'] or 0:>7.0f} "
                f"{c:>10.2f} {row['cublas_gbs']:>7.0f} {speed:>9} {t['config']}"
            )
    meta = machine_meta(
        gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        cupy=cp.__version__,
        copy_bandwidth_bytes_per_s=floor,
        timing=f"tuned config per launch in a replayed graph of {LAUNCHES} launches; cuBLAS the same",
    )
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
