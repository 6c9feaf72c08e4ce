"""Decode attention on the GPU at 128, 1,024 and 4,096 KV positions: dsp-triton against torch SDPA and the floor.

For the Llama-3.2-1B shape (32 query heads, 8 KV heads, head dim 64) and GPT-2 124M (12/12,
64), fp16, one query row, every position valid, the exported attention chain
(tests/triton_interp/attention_graphs.py: the GQA repeat, the scores product, the scale, the
additive mask, Softmax, the weighted sum) runs in TRITON mode three ways, each in a process of
its own (the switches are read once per process):

- ``fused_split``: the one-kernel template as AUTO runs it: past 256 KV positions split into
  programs of about 64 positions, then combined (DSP_TRITON_ATTENTION=1, DSP_TRITON_KV_SPLITS=0);
- ``fused_one``: the one-kernel template, one program per head (DSP_TRITON_KV_SPLITS=1);
- ``three_kernels``: the scores product, the softmax, the weighted sum (DSP_TRITON_ATTENTION=0);
- ``nvrtc_split``, ``nvrtc_one``, ``nvrtc_three``: the same in NVRTC_JIT mode (dsp-nvrtc's CUDA C
  kernels; DSP_NVRTC_ATTENTION, DSP_NVRTC_KV_SPLITS).

torch's row is ``scaled_dot_product_attention`` (``enable_gqa``, no mask: its fastest path).
Each row is the kernels of one replayed step as torch.profiler's CUDA activity sees them (per
step: kernels and the sum of their durations; median over the window's steps), with the L2
cache flushed between steps, as a decode step meets it; DSP's rows count its generated
kernels only (``dsp_*``): the copies that stage the fed q, caches and mask into the graph's
buffers are reported apart (``staging_us``), since in a decode step the caches already live
there. The floor is the K and V bytes over the copy bandwidth.

    python3 benchmarks/attention_gpu.py --out benchmarks/results/attention_gpu.json
    python3 benchmarks/attention_gpu.py --lengths 128,256,512,1024,4096 --kv-splits 16,32   # more rows
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "triton_interp"))
from common import machine_meta, write_results  # noqa: E402
from products_gpu import copy_bandwidth  # noqa: E402

SHAPES = {"llama-1b": (32, 8, 64), "gpt2-124m": (12, 12, 64)}  # heads, KV heads, head dim
LENGTHS = (128, 1024, 4096)
STEPS = 30  # profiled steps per row
MODES = {
    "fused_split": {"DSP_TRITON_ATTENTION": "1", "DSP_TRITON_KV_SPLITS": "0"},
    "fused_one": {"DSP_TRITON_ATTENTION": "1", "DSP_TRITON_KV_SPLITS": "1"},
    "three_kernels": {"DSP_TRITON_ATTENTION": "0"},
    # the same three ways in NVRTC_JIT mode (dsp-nvrtc's CUDA C kernels)
    "nvrtc_split": {"DSP_NVRTC_ATTENTION": "1", "DSP_NVRTC_KV_SPLITS": "0"},
    "nvrtc_one": {"DSP_NVRTC_ATTENTION": "1", "DSP_NVRTC_KV_SPLITS": "1"},
    "nvrtc_three": {"DSP_NVRTC_ATTENTION": "0"},
}
MARK = "ATTENTION_GPU_JSON "


def profile_steps(step: Any, steps: int = STEPS, counted: Any = lambda name: True) -> dict[str, Any]:
    """Kernels and GPU microseconds of each of ``steps`` calls of ``step`` (an L2 flush before each).

    Kernels whose name ``counted`` rejects (DSP's staging copies of the fed arrays into the
    graph's fixed buffers, which a decode step, whose caches live in those buffers, does not
    make) are reported apart as ``staging_kernels`` / ``staging_us``.
    """
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    junk = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            junk.zero_()  # a fill kernel: it marks where each step begins, and is not counted
            torch.cuda.synchronize()
            step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return step_kernels(events, counted)


def step_kernels(events: list[dict[str, Any]], counted: Any = lambda name: True) -> dict[str, Any]:
    """``profile_steps``' figures from a Chrome trace's events: steps begin at each fill kernel."""
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"),
        key=lambda e: float(e["ts"]),
    )
    per_step: list[list[dict[str, Any]]] = []
    for e in kernels:
        if "fill" in str(e.get("name", "")).lower():
            per_step.append([])
        elif per_step:
            per_step[-1].append(e)
    per_step = [s for s in per_step if s]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def part(keep: bool) -> list[list[dict[str, Any]]]:
        return [[e for e in s if bool(counted(str(e.get("name", "")))) is keep] for s in per_step]

    work, staging = part(True), part(False)
    return {
        "steps": len(per_step),
        "kernels": median([len(s) for s in work]),
        "gpu_us": median([sum(float(e.get("dur", 0.0)) for e in s) for s in work]),
        "staging_kernels": median([len(s) for s in staging]),
        "staging_us": median([sum(float(e.get("dur", 0.0)) for e in s) for s in staging]),
        "kernel_names": sorted({str(e.get("name", "?"))[:60] for s in work for e in s})[:8],
    }


def lengths() -> tuple[int, ...]:
    """The KV positions measured: --lengths (passed to the workers as ATTENTION_GPU_LENGTHS), or LENGTHS."""
    given = os.environ.get("ATTENTION_GPU_LENGTHS", "")
    return tuple(int(x) for x in given.split(",") if x.strip()) or LENGTHS


def dsp_rows(mode: str) -> list[dict[str, Any]]:
    """This process's rows: every shape and length in TRITON mode (NVRTC_JIT for the ``nvrtc_*`` modes)
    under ``mode``'s switches."""
    import attention_graphs as ag
    import cupy as cp
    import torch

    rows = []
    for model_name, (heads, kv, dim) in SHAPES.items():
        for length in lengths():
            feeds = ag.feeds(heads, kv, length, length, dim, "float16")
            dev = {k: cp.asarray(v) for k, v in feeds.items()}
            backend = "nvrtc_jit" if mode.startswith("nvrtc") else "triton"
            model = ag.model(heads, kv, length, dim, backend, "float16", strict=True, outputs_on_device=True)
            want = ag.model(heads, kv, length, dim, "slot_by_slot", "float16").run(feeds)["y"]
            for _ in range(6):  # eager (compile, tune, check), freeze, capture, replays
                got = model.run(dev)["y"]
            diff = float(np.abs(cp.asnumpy(got).astype(np.float64) - want.astype(np.float64)).max())
            torch.cuda.synchronize()
            row = {"model": model_name, "length": length, "peer": f"dsp_{mode}", "max_abs_diff": diff}
            row["phase"] = str(model.dsp.phase)
            row.update(profile_steps(functools.partial(model.run, dev), counted=lambda name: name.startswith("dsp_")))
            rows.append(row)
    return rows


def torch_rows() -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    rows = []
    for model_name, (heads, kv, dim) in SHAPES.items():
        for length in lengths():
            q = torch.randn(1, heads, 1, dim, device="cuda", dtype=torch.float16)
            k = torch.randn(1, kv, length, dim, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=kv != heads)

            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                sdpa()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                sdpa()
            row = {"model": model_name, "length": length, "peer": "torch_sdpa_graph"}
            row.update(profile_steps(graph.replay))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "results" / "attention_gpu.json"))
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument(
        "--kv-splits",
        default="",
        help="comma list of split counts N: adds a row fused_splitN per count (DSP_TRITON_KV_SPLITS=N)",
    )
    p.add_argument("--lengths", default="", help=f"comma list of KV positions (default {LENGTHS})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lengths:
        os.environ["ATTENTION_GPU_LENGTHS"] = args.lengths
    for n in (int(x) for x in args.kv_splits.split(",") if x.strip()):
        MODES[f"fused_split{n}"] = {"DSP_TRITON_ATTENTION": "1", "DSP_TRITON_KV_SPLITS": str(n)}
        args.modes += f",fused_split{n}"
    if args.worker:
        print(MARK + json.dumps(dsp_rows(args.worker)))
        return 0
    import torch

    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        env = {**os.environ, **MODES[mode]}
        done = subprocess.run(
            [sys.executable, __file__, "--worker", mode], env=env, capture_output=True, text=True, timeout=900
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
        if done.returncode != 0 or not lines:
            print(f"dsp_{mode}: failed (rc {done.returncode}): {done.stderr[-1500:]}")
            continue
        rows += json.loads(lines[-1][len(MARK) :])
    rows += torch_rows()
    bandwidth = copy_bandwidth()
    for row in rows:
        heads, kv, dim = SHAPES[row["model"]]
        kv_bytes = 2 * kv * row["length"] * dim * 2
        row["kv_bytes"] = kv_bytes
        row["floor_us"] = kv_bytes / bandwidth * 1e6
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; per replayed step, median of {STEPS} (L2 flushed before each)")
    print(
        f"{'model':<10} {'positions':>9} {'peer':<20} {'kernels':>7} {'GPU us':>8} {'floor us':>8} "
        f"{'x floor':>7} {'x torch':>7}"
    )
    for row in rows:
        torch_row = next(
            (
                r
                for r in rows
                if r["peer"] == "torch_sdpa_graph" and (r["model"], r["length"]) == (row["model"], row["length"])
            ),
            None,
        )
        us, ref = row.get("gpu_us"), (torch_row or {}).get("gpu_us")
        row["vs_torch"] = None if not us or not ref else ref / us
        row["vs_floor"] = None if not us else row["floor_us"] / us
        vs_torch = f"{row['vs_torch']:.2f}x" if row["vs_torch"] else "-"
        print(
            f"{row['model']:<10} {row['length']:>9} {row['peer']:<20} {row.get('kernels') or 0:>7} "
            f"{us or float('nan'):>8.2f} {row['floor_us']:>8.2f} {row['vs_floor'] or 0:>6.2f}x {vs_torch:>7}"
        )
    meta = machine_meta(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bandwidth_bytes_per_s=bandwidth,
        timing=f"kernels of one replayed step (torch.profiler CUDA activity), median of {STEPS}, L2 flushed first",
    )
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
