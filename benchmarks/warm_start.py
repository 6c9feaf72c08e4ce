"""Cold vs warm start of a GenerationPipeline: time to first token in a fresh process, cold then warm.

Each run is a new Python process building ``GenerationPipeline(model)`` and generating a
few tokens. A *cold* run starts on an empty DSP cache directory (and empty CuPy and
Triton kernel caches, kept inside it), so it imports, rewrites, compiles and stores
everything; the *warm* runs after it share that directory, so they start from whatever
DSP kept on disk. ``--runs N`` repeats the pair N times (a fresh directory each time) and
reports medians.

Per run: the time to the first token from the process's spawn, and its breakdown, which
adds up to it: interpreter start, ``import dsp_core.llm``, the pipeline's phases
(``GenerationPipeline.timings``: prefill plan, metadata, decode plan, decode warm-up,
prefill, ...; each phase's own time) and ``other`` (what no phase covers: sampling the
first token, argument checks). Also the total (spawn to the last token) and what came
from the cache (``warm_stats``).

    python benchmarks/warm_start.py --model tests/fixtures/gpt2_eager.onnx --runs 5       # CPU
    python benchmarks/warm_start.py --export gpt2-124m --dtype fp32 --runs 3              # CPU, needs torch
    python benchmarks/warm_start.py --export gpt2-124m --mode cuda_graphs --out $OUT      # GPU image

``--export`` builds the ONNX model with benchmarks/decode_gpu.py's recipe (needs torch and
transformers; on the GPU on CUDA, else on the CPU); ``--profile`` adds the last warm
run's 30 most expensive calls (cProfile, cumulative) to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPAWN_ENV = "DSP_BENCH_SPAWN_TIME"  # the parent's time.time() just before it spawned the child


def child(args: argparse.Namespace) -> int:
    """One process: build the pipeline, generate, print one JSON line of timings."""
    start = time.time()
    spawned = float(os.environ.get(SPAWN_ENV, start))
    import numpy as np

    from dsp_core.llm import GenerationPipeline

    imported = time.time()
    block = {"auto": None, "on": True, "off": False}[args.block_capture]
    pipe = GenerationPipeline(
        args.model, max_length=args.prompt_len + args.new_tokens, mode=args.mode, block_capture=block
    )
    built = time.time()
    first: list[tuple[float, dict[str, float]]] = []
    cpu: list[float] = []  # this process's CPU seconds (all threads) at the first token

    def on_tokens(tokens: Any) -> None:
        if not first:
            first.append((time.time(), dict(pipe.timings)))
            cpu.append(time.process_time())

    prompt = np.arange(1, args.prompt_len + 1, dtype=np.int64)
    result = pipe.generate(prompt, args.new_tokens, on_tokens=on_tokens)
    done = time.time()
    first_at, phases = first[0] if first else (done, dict(pipe.timings))
    breakdown = {"interpreter start": start - spawned, "import dsp_core.llm": imported - start, **phases}
    breakdown["other"] = (first_at - spawned) - sum(breakdown.values())
    record = {
        "first_token_s": first_at - spawned,
        # CPU time to the first token, from the interpreter's start: other jobs on a shared machine
        # stretch the wall time far more than this.
        "first_token_cpu_s": cpu[0] if cpu else time.process_time(),
        "total_s": done - spawned,
        "build_s": built - imported,
        "breakdown_to_first_token": breakdown,
        "phases_total": dict(pipe.timings),
        "warm_stats": pipe.warm_stats,
        "prefill_stats": pipe.prefill_model.stats.as_dict(),
        "decode_stats": pipe.decode_model.stats.as_dict(),
        "blocks": pipe.captures_blocks(),
        "backends": pipe.decode_model.resolved_backends(),
        "tokens": result.token_list(),
        "load_average": os.getloadavg()[0],  # other processes on a shared machine only add time
    }
    print(json.dumps(record))
    return 0


def run_once(args: argparse.Namespace, model: Path, cache: Path, profile: Path | None) -> dict[str, Any]:
    """One child process on the cache directory ``cache``; its JSON record."""
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    cmd += [str(Path(__file__).resolve()), "--child", "--model", str(model)]
    cmd += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    cmd += ["--block-capture", args.block_capture]
    if args.mode:
        cmd += ["--mode", args.mode]
    env = {**os.environ, "DSP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    # Python's own bytecode cache on, as a user has it (some sandboxes turn it off; then every
    # start recompiles DSP's modules, which no DSP cache can save); main() primes it first.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Kernel binaries live in the run's cache directory too (dsp-triton keeps its own under DSP_CACHE_DIR):
    # cold compiles them, warm reuses them.
    env.update(CUPY_CACHE_DIR=str(cache / "cupy"), TRITON_CACHE_DIR=str(cache / "triton-default"))
    env[SPAWN_ENV] = repr(time.time())
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if profile is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(str(profile), stream=text).sort_stats("cumulative").print_stats(30)
        record["profile_top"] = text.getvalue().splitlines()[-45:]
    return record


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time to first token (with every run's time beside it)."""
    ordered = sorted(runs, key=lambda r: r["first_token_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["first_token_s_runs"] = [r["first_token_s"] for r in runs]
    mid["first_token_s_median"] = statistics.median(r["first_token_s"] for r in runs)
    mid["first_token_cpu_s_median"] = statistics.median(r["first_token_cpu_s"] for r in runs)
    return mid


def after_imports(record: dict[str, Any]) -> float:
    """Seconds to the first token after the interpreter started and ``dsp_core.llm`` was imported."""
    parts = record["breakdown_to_first_token"]
    return float(record["first_token_s"] - parts["interpreter start"] - parts["import dsp_core.llm"])


def machine() -> dict[str, Any]:
    """Where the numbers come from: CPU, OS, Python, the libraries that matter, GPU if any."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    with_cpu = Path("/proc/cpuinfo")
    if with_cpu.exists():
        names = [ln.split(":", 1)[1].strip() for ln in with_cpu.read_text().splitlines() if ln.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("dsp-core", "numpy", "onnx", "cupy-cuda13x", "triton", "torch"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        got = subprocess.run(query, capture_output=True, text=True)
        if got.returncode == 0:
            info["gpu"] = got.stdout.strip()
    return info


def export(args: argparse.Namespace, work: Path) -> Path:
    """The ``--export`` model, built with decode_gpu.py's recipe (kept in ``--export-dir`` when given)."""
    target = Path(args.export_dir) if args.export_dir else work / "onnx"
    model = target / "model.onnx"
    if model.exists():
        return model
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode_gpu
    import torch

    dtype = {"fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decode_gpu.export_onnx(torch, decode_gpu.build(torch, args.export, dtype, device, "eager"), model, 18)
    return model


def print_table(record: dict[str, Any]) -> None:
    """Cold vs warm: time to first token, its breakdown, the ratio."""
    cold, warm = record["cold"], record["warm"]
    print(f"{record['model']}: {record['runs']} cold/warm pairs, medians")
    print(f"{'':26s}{'cold':>9s}{'warm':>9s}")
    names = list(dict.fromkeys([*warm["breakdown_to_first_token"], *cold["breakdown_to_first_token"]]))
    names.append(names.pop(names.index("other")))
    for name in names:
        c = cold["breakdown_to_first_token"].get(name, 0.0)
        w = warm["breakdown_to_first_token"].get(name, 0.0)
        print(f"  {name:24s}{c:9.3f}{w:9.3f}")
    print(f"{'first token (s)':26s}{cold['first_token_s_median']:9.3f}{warm['first_token_s_median']:9.3f}")
    print(f"{'total (s)':26s}{cold['total_s']:9.3f}{warm['total_s']:9.3f}")
    c, w = cold["first_token_cpu_s_median"], warm["first_token_cpu_s_median"]
    print(f"{'CPU to first token (s)':26s}{c:9.3f}{w:9.3f}")
    print(f"warm start: {record['speedup_first_token']:.1f}x faster to the first token (median cold / median warm)")
    print(f"            {record['speedup_first_token_after_imports']:.1f}x after the interpreter start and imports")
    print(f"            {record['speedup_first_token_best']:.1f}x best cold / best warm")
    print(f"            {record['speedup_first_token_cpu']:.1f}x in CPU time (median cold / median warm)")
    print(f"warm stats: {warm['warm_stats']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an ONNX decoder (KV naming)")
    p.add_argument("--export", help="build this model with decode_gpu.py's recipe (gpt2-124m, ...)")
    p.add_argument("--export-dir", help="keep the exported model here (reused when it exists)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    p.add_argument("--mode", help="execution mode (default: DSP_MODE, else AUTO)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-capture", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--runs", type=int, default=3, help="cold/warm pairs, each on a fresh cache (medians reported)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", help="folder for the JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="dsp-warm-start-"))
    model = export(args, work) if args.export else Path(args.model) if args.model else None
    if model is None:
        p.error("give --model or --export")
    run_once(args, model, work / "prime", None)  # writes Python's bytecode caches, untimed
    shutil.rmtree(work / "prime", ignore_errors=True)
    colds, warms = [], []
    for i in range(args.runs):
        cache = work / f"cache{i}"
        colds.append(run_once(args, model, cache, None))
        last = args.profile and i == args.runs - 1
        warms.append(run_once(args, model, cache, work / "warm.prof" if last else None))
        if warms[-1]["tokens"] != colds[-1]["tokens"]:
            raise SystemExit(f"warm tokens {warms[-1]['tokens']} differ from cold {colds[-1]['tokens']}")
        shutil.rmtree(cache, ignore_errors=True)
    if args.profile and args.out:  # the warm run's whole profile, for pstats
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "warm.prof", Path(args.out) / "warm_start_warm.prof")
    cold, warm = median_record(colds), median_record(warms)
    record = {
        "model": args.export or str(args.model),
        "dtype": args.dtype if args.export else None,
        "mode": args.mode or os.environ.get("DSP_MODE") or "AUTO",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "cold": cold,
        "warm": warm,
        "speedup_first_token": cold["first_token_s_median"] / warm["first_token_s_median"],
        # Best of the runs: on a shared machine, other processes only ever add time.
        "speedup_first_token_best": min(r["first_token_s"] for r in colds) / min(r["first_token_s"] for r in warms),
        # The same without the interpreter's start and the imports, which no cache can shorten.
        "speedup_first_token_after_imports": after_imports(cold) / after_imports(warm),
        "speedup_first_token_cpu": cold["first_token_cpu_s_median"] / warm["first_token_cpu_s_median"],
        "python_bytecode_cache": "on (one untimed priming run first)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
    }
    print_table(record)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.export or Path(args.model).stem
        suffix = f"_{args.mode.lower()}" if args.mode else ""
        (out / f"warm_start_{stem}{suffix}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
