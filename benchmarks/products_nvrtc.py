"""dsp-nvrtc's product kernels by lanes and columns, against dsp-triton's and cuBLAS, at decode shapes.

Each case is a small model of one decode step's product (fp16, one row): a plain product by a
constant weight at each projection shape of GPT-2 124M and the Llama-3.2-1B shape, and the merged
groups with their prologues (Llama's RMSNorm -> Q/K/V, RMSNorm -> gate/up -> SiLU(gate) x up;
GPT-2's LayerNorm -> QKV with bias). Each runs replaying in NVRTC_JIT mode at every
(``DSP_NVRTC_PRODUCT_LANES``, ``DSP_NVRTC_PRODUCT_COLUMNS``) of the sweep, and in TRITON mode;
plain products also as torch's cuBLAS call. A case's time is the sum of its kernels' durations a
run (torch.profiler, CUDA activity; not CuPy's staging copies of the feed and outputs, which every
backend makes alike), median of ``--runs`` runs, each after an L2 flush (a decode
step reads every weight once), with programmatic dependent launches off in both backends so that a
kernel's duration is its own work, not its wait for the one before.

    python3 benchmarks/products_nvrtc.py --out benchmarks/results/products_nvrtc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

for _flag in ("DSP_NVRTC_PDL", "DSP_TRITON_PDL"):  # read once per process: before dsp_core is imported
    os.environ.setdefault(_flag, "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_meta, write_results  # noqa: E402

PLAIN = {
    "gpt2-124m": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
    "llama-1b": [(2048, 2048), (2048, 3072), (8192, 2048), (2048, 16384)],
}
SWEEP = [("auto", 0)] + [(lanes, cols) for lanes in ("warp", "block") for cols in (1, 2, 4)]  # auto: the rules


def plain_case(k: int, n: int) -> Any:
    import dsp_core as dsp

    rng = np.random.default_rng(0)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, k])
    g.output(x @ g.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)), "y")
    return g.build()


def llama_merged_case(which: str) -> Any:
    """The exported RMSNorm chain, then Q/K/V (2048, 512, 512) or gate/up (8192 each) with SiLU x up."""
    import dsp_core as dsp

    rng = np.random.default_rng(1)
    g = dsp.GraphBuilder()
    k = 2048
    x = g.placeholder("x", "float16", [1, 1, k])
    x32 = g.Cast(x, to=1)
    mean = g.ReduceMean(g.Pow(x32, g.constant(np.array(2.0, np.float32))), g.constant(np.array([-1])))
    inv = g.Reciprocal(g.Sqrt(g.Add(mean, g.constant(np.array(1e-6, np.float32)))))
    h = g.Mul(g.Cast(g.Mul(x32, inv), to=10), g.constant((1 + 0.1 * rng.standard_normal(k)).astype(np.float16)))

    def weight(n: int) -> Any:
        return g.constant((rng.standard_normal((k, n)) * 0.02).astype(np.float16))

    if which == "qkv":
        for i, n in enumerate((2048, 512, 512)):
            g.output(g.Identity(h @ weight(n)), f"qkv{i}")
    else:
        gate, up = h @ weight(8192), h @ weight(8192)
        g.output(g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), "mlp")
    return g.build()


def gpt2_qkv_case() -> Any:
    """LayerNormalization, then the 768 x 2304 product and its bias (GPT-2's c_attn)."""
    import dsp_core as dsp

    rng = np.random.default_rng(2)
    g = dsp.GraphBuilder()
    x = g.placeholder("x", "float16", [1, 1, 768])
    scale = g.constant((1 + 0.1 * rng.standard_normal(768)).astype(np.float16))
    shift = g.constant((0.1 * rng.standard_normal(768)).astype(np.float16))
    h = g.LayerNormalization(x, scale, shift, axis=-1, epsilon=1e-5)
    w = g.constant((rng.standard_normal((768, 2304)) * 0.02).astype(np.float16))
    g.output(g.Add(h @ w, g.constant((0.1 * rng.standard_normal(2304)).astype(np.float16))), "qkv")
    return g.build()


Case = tuple[str, str, Callable[[], Any], int, tuple[int, int] | None]


def cases(models: list[str]) -> list[Case]:
    """(model, label, graph builder, K of its one-row input, the plain product's (K, N) or None)."""
    out: list[Case] = []
    for model in models:
        for k, n in PLAIN[model]:
            out.append((model, f"{k}x{n}", lambda k=k, n=n: plain_case(k, n), k, (k, n)))
        if model == "llama-1b":
            out.append((model, "rms+qkv 2048x3072", lambda: llama_merged_case("qkv"), 2048, None))
            out.append((model, "rms+gate/up 2048x2x8192", lambda: llama_merged_case("mlp"), 2048, None))
        else:
            out.append((model, "ln+qkv 768x2304", gpt2_qkv_case, 768, None))
    return out


def _staging(name: str) -> bool:
    low = name.lower()
    return "fill" in low or "memset" in low or low.startswith("cupy_")


def _kernel_sums(run: Callable[[], None], flush: Callable[[], None], runs: int) -> tuple[float, int, list[str]]:
    """Median over ``runs`` of the summed durations (µs) of the kernels one ``run()`` launches, each
    run after ``flush()``; with the kernel count a run and the kernels' names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    marks: list[tuple[float, float]] = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            flush()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            marks.append((t0, time.perf_counter()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = sorted(
        (float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"
    )
    # not the flush, nor DSP's staging copies of the feed and outputs (CuPy's, the same in every backend)
    work = [(ts, dur, name) for ts, dur, name in kernels if not _staging(name)]
    if not work:
        raise RuntimeError("the profiler saw no kernel of the case")
    per_run = max(1, len(work) // runs)
    sums = [sum(d for _, d, _ in work[i : i + per_run]) for i in range(0, per_run * runs, per_run)]
    return statistics.median(sums), per_run, sorted({n[:40] for _, _, n in work})


def time_case(build: Callable[[], Any], k: int, mode: str, runs: int, env: dict[str, str]) -> dict[str, Any]:
    """One case compiled in ``mode`` with the options ``env``, replaying: its kernels' µs a run."""
    import cupy as cp
    import torch

    import dsp_core as dsp

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        graph = build()
        model = dsp.compile(graph, mode=mode, strict=True, outputs_on_device=True)
        feed = {"x": cp.asarray(np.random.default_rng(9).standard_normal((1, 1, k)).astype(np.float16))}
        for _ in range(12):  # freeze, capture, replay
            model.run(feed)
        if model.dsp.phase.name != "REPLAYING":
            raise RuntimeError(f"the model is {model.dsp.phase.name}, not replaying")
        junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        us, count, names = _kernel_sums(lambda: model.run(feed), junk.zero_, runs)
        return {"us": us, "kernels": count, "names": names}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cublas_us(k: int, n: int, runs: int) -> float:
    import torch

    a = torch.randn(1, k, device="cuda", dtype=torch.float16)
    w = torch.randn(k, n, device="cuda", dtype=torch.float16)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16)
    junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return _kernel_sums(lambda: torch.mm(a, w, out=out), junk.zero_, runs)[0]


def _no_gpu() -> str | None:
    """None where CuPy and torch both see a CUDA device, else why not."""
    try:
        import cupy as cp
        import torch
    except ImportError as exc:
        return f"{exc.name} is not installed"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  (no driver raises anything)
        return f"CuPy sees no CUDA device ({type(exc).__name__})"
    if count < 1 or not torch.cuda.is_available():
        return "no CUDA device for CuPy and torch"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-124m,llama-1b")
    p.add_argument("--runs", type=int, default=20, help="profiled runs a case and configuration (median)")
    p.add_argument("--sweep", default=",".join(f"{lanes}:{cols}" for lanes, cols in SWEEP))
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--out", default="benchmarks/results/products_nvrtc.json")
    args = p.parse_args(argv)
    missing = _no_gpu()
    if missing:
        print(f"products_nvrtc.py needs a CUDA GPU: {missing}", file=sys.stderr)
        return 2
    sweep = [(item.split(":")[0], int(item.split(":")[1])) for item in args.sweep.split(",") if item]
    rows: list[dict[str, Any]] = []
    print(
        f"{'model':<10} {'case':<24} "
        + " ".join(f"{f'{lanes}:{cols}':>9}" for lanes, cols in sweep)
        + "    triton    cuBLAS"
    )
    for model, label, build, k, plain in cases(args.models.split(",")):
        row: dict[str, Any] = {"model": model, "case": label, "nvrtc": {}}
        for lanes, cols in sweep:
            env = {"DSP_NVRTC_PRODUCT_LANES": lanes, "DSP_NVRTC_PRODUCT_COLUMNS": str(cols)}
            try:
                row["nvrtc"][f"{lanes}:{cols}"] = time_case(build, k, "nvrtc_jit", args.runs, env)
            except Exception as exc:  # noqa: BLE001  (one configuration failing must not hide the others)
                row["nvrtc"][f"{lanes}:{cols}"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        if not args.no_triton:
            try:
                row["triton"] = time_case(build, k, "triton", args.runs, {})
            except Exception as exc:  # noqa: BLE001
                row["triton"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        if plain is not None:
            row["cublas_us"] = cublas_us(*plain, args.runs)
        rows.append(row)

        def cell(r: dict[str, Any] | None) -> str:
            return f"{r['us']:9.2f}" if r and "us" in r else f"{'err' if r else '-':>9}"

        line = " ".join(cell(row["nvrtc"][f"{lanes}:{cols}"]) for lanes, cols in sweep)
        print(f"{model:<10} {label:<24} {line} {cell(row.get('triton'))} {row.get('cublas_us', float('nan')):9.2f}")
    meta = machine_meta(
        what="summed kernel µs a run, median of --runs, L2 flushed before each run, PDL off",
        runs=args.runs,
    )
    write_results(args.out, meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
