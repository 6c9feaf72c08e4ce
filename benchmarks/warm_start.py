"""Cold vs warm start of a GenerationPipeline: time to first token in a fresh process, twice.

Each run is a new Python process building ``GenerationPipeline(model)`` and generating a
few tokens; both share one fresh DSP cache directory, so the first is cold (nothing cached)
and the second warm (whatever DSP keeps on disk). Reported per run: import, pipeline
build, time to the first token (from process start), total, and the ratio cold / warm.

    python benchmarks/warm_start.py --model tests/fixtures/gpt2_eager.onnx          # CPU
    python benchmarks/warm_start.py --export gpt2-124m --out benchmarks/results/warm_start   # GPU image

``--export`` builds the ONNX model with benchmarks/decode_gpu.py's recipe (needs torch);
``--profile`` adds the warm run's 25 most expensive calls (cProfile, cumulative) to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> int:
    """One process: build the pipeline, generate, print one JSON line of timings."""
    start = time.perf_counter()
    import numpy as np

    from dsp_core.llm import GenerationPipeline

    imported = time.perf_counter()
    block = {"auto": None, "on": True, "off": False}[args.block_capture]
    pipe = GenerationPipeline(args.model, max_length=args.prompt_len + args.new_tokens, block_capture=block)
    built = time.perf_counter()
    first: list[float] = []

    def on_tokens(tokens: Any) -> None:
        if not first:
            first.append(time.perf_counter())

    prompt = np.arange(1, args.prompt_len + 1, dtype=np.int64)
    pipe.generate(prompt, args.new_tokens, on_tokens=on_tokens)
    done = time.perf_counter()
    print(
        json.dumps(
            {
                "import_s": imported - start,
                "build_s": built - imported,
                "first_token_s": (first[0] if first else done) - start,
                "total_s": done - start,
                "blocks": pipe.captures_blocks(),
                "backends": pipe.decode_model.resolved_backends(),
                "stats": {k: v for k, v in vars(pipe.decode_model.stats).items() if isinstance(v, int)},
            }
        )
    )
    return 0


def run_once(args: argparse.Namespace, model: Path, cache: Path, profile: bool) -> dict[str, Any]:
    cmd = [sys.executable]
    prof = cache.parent / "warm.prof"
    if profile:
        cmd += ["-m", "cProfile", "-o", str(prof)]
    cmd += [str(Path(__file__).resolve()), "--child", "--model", str(model)]
    cmd += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    cmd += ["--block-capture", args.block_capture]
    env = {**os.environ, "DSP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    wall = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - wall
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["process_wall_s"] = wall
    if profile:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(str(prof), stream=text).sort_stats("cumulative").print_stats(25)
        record["profile_top"] = text.getvalue().splitlines()[-40:]
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an ONNX decoder (KV naming)")
    p.add_argument("--export", help="build this model with decode_gpu.py's recipe (gpt2-124m, ...)")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-capture", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--runs", type=int, default=1, help="warm runs after the cold one (the median is reported)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", help="folder for the JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="dsp-warm-start-"))
    model = Path(args.model) if args.model else None
    if args.export:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import decode_gpu
        import torch

        dtype = {"fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = work / "onnx" / "model.onnx"
        decode_gpu.export_onnx(torch, decode_gpu.build(torch, args.export, dtype, device, "eager"), model, 18)
    if model is None:
        p.error("give --model or --export")
    cache = work / "cache"
    cold = run_once(args, model, cache, profile=False)
    warm = [run_once(args, model, cache, profile=args.profile and i == args.runs - 1) for i in range(args.runs)]
    warm.sort(key=lambda r: r["first_token_s"])
    mid = warm[len(warm) // 2]
    record = {
        "model": args.export or str(args.model),
        "cold": cold,
        "warm": mid,
        "warm_runs": len(warm),
        "speedup_first_token": cold["first_token_s"] / mid["first_token_s"],
        "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
    }
    print(f"{'':8s}{'import':>9s}{'build':>9s}{'1st token':>11s}{'total':>9s}")
    for name, r in (("cold", cold), ("warm", mid)):
        print(f"{name:8s}{r['import_s']:9.2f}{r['build_s']:9.2f}{r['first_token_s']:11.2f}{r['total_s']:9.2f}")
    print(f"warm start: {record['speedup_first_token']:.1f}x faster to the first token")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"warm_start_{Path(record['model']).stem}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
