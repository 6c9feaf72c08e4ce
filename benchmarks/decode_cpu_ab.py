"""GPT-2-style greedy decode on the CPU: an ONNX Runtime loop against GenerationPipeline with the
KV stores inside the runtimes' segments (DSP_RUNTIME_KV_STORE=1), there written in place by
ONNX Runtime's replays (DSP_RUNTIME_KV_IN_PLACE=1) or as rows after each call (=0), and on the
reference (DSP_RUNTIME_KV_STORE=0).

The four run in turns (the loop in a process of its own, cpu_race.LoopWorker), ``--rounds``
times (the machine's noise is shared out between them); lateSteady tokens/s of each run,
medians and the ratios to the loop. AUTO has the native runtimes let in (this script sets
DSP_AUTO_EXCLUDE=none). Threads come from the environment, as in the CPU race:

    OMP_NUM_THREADS=1 DSP_CPU_THREADS=1 python benchmarks/decode_cpu_ab.py \\
        --model /tmp/gpt2-124m/model.onnx --threads 1 --rounds 3 --out ab_1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GPT-2 ONNX export with past inputs (make_fixtures' recipe)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    os.environ["DSP_AUTO_EXCLUDE"] = "none"
    import cpu_race

    from dsp_core.llm import GenerationPipeline

    path = Path(args.model)
    prompt = cpu_race.decode_prompt()
    variants = {  # GenerationPipeline's settings per row
        "kv_store_in_place": {"DSP_RUNTIME_KV_STORE": "1", "DSP_RUNTIME_KV_IN_PLACE": "1"},
        "kv_store_rows_after": {"DSP_RUNTIME_KV_STORE": "1", "DSP_RUNTIME_KV_IN_PLACE": "0"},
        "kv_store_on_reference": {"DSP_RUNTIME_KV_STORE": "0", "DSP_RUNTIME_KV_IN_PLACE": "1"},
    }
    runs: dict[str, list[float]] = {"ort_loop": [], **{k: [] for k in variants}}
    backends: dict[str, list[str]] = {}
    agree: list[bool] = []
    loop = cpu_race.LoopWorker(path, args.threads, args.tokens)  # its own process: see LoopWorker
    for _ in range(args.rounds):
        rate, want = loop.run()
        runs["ort_loop"].append(rate)
        for key, env in variants.items():
            os.environ.update(env)
            pipe = GenerationPipeline(path, max_length=cpu_race.DECODE_PROMPT + args.tokens + 8)
            pipe.generate(prompt, 24)  # warm-up: plans, freeze, trials
            pipe.reset_position()
            result = pipe.generate(prompt, args.tokens)
            runs[key].append(float(result.metrics.rates["lateSteady"]))
            backends[key] = pipe.decode_model.resolved_backends()
            agree.append(result.token_list()[-args.tokens :] == want)
    loop.close()
    median = {k: statistics.median(v) for k, v in runs.items()}
    record: dict[str, Any] = {
        "model": str(path),
        "threads": args.threads,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "runs_tokens_per_s": {k: [round(x, 2) for x in v] for k, v in runs.items()},
        "median_tokens_per_s": {k: round(v, 2) for k, v in median.items()},
        "ratio_to_loop": {k: round(median[k] / median["ort_loop"], 3) for k in runs if k != "ort_loop"},
        "backends": backends,
        "tokens_equal_to_the_loop": all(agree),
    }
    print("| run | lateSteady tok/s (median) | / ORT loop | runs | backends |")
    print("|---|---|---|---|---|")
    for k in runs:
        ratio = "1.0" if k == "ort_loop" else str(record["ratio_to_loop"][k])
        ran = "+".join(backends.get(k, []))
        print(f"| {k} | {median[k]:.2f} | {ratio} | {record['runs_tokens_per_s'][k]} | {ran} |")
    print(f"tokens equal to the loop's: {record['tokens_equal_to_the_loop']}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
