"""A fresh GenerationPipeline's consecutive generate() calls on the CPU: what compiling costs a user.

Each call of a new pipeline may compile: the first builds the prompt and decode plans (and the
native runtimes' models for them), a plan freezes on its third execution (the prompt plan on the
third call), and a runtime's model of a big segment takes seconds to compile. This times each
call whole (wall seconds, prompt and tokens included) and counts the runtimes' model compiles
in it, for AUTO with ONNX Runtime and OpenVINO let in (this script sets DSP_AUTO_EXCLUDE=none):

    DSP_CPU_THREADS=2 python benchmarks/generate_cold.py --model /tmp/gpt2_124m.onnx --out cold.json

(``.fixture-venv/bin/python benchmarks/export_gpt2_124m.py --out /tmp/gpt2_124m.onnx`` makes the model.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a decoder ONNX export with past inputs")
    parser.add_argument("--calls", type=int, default=4, help="generate() calls of one pipeline")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a call")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    os.environ["DSP_AUTO_EXCLUDE"] = "none"
    from common import machine_meta, runtime_versions, write_results
    from dsp_onnxruntime.segment import OnnxRuntimeSegment
    from dsp_openvino.segment import OpenVinoSegment

    from dsp_core.llm import GenerationPipeline

    builds: list[tuple[str, float]] = []
    for cls in (OnnxRuntimeSegment, OpenVinoSegment):  # count the real compiles, each still made
        real = cls._build

        def counted(self: Any, model: bytes, key: Any, real: Any = real, name: str = cls.__name__) -> Any:
            start = time.perf_counter()
            got = real(self, model, key)
            builds.append((name, time.perf_counter() - start))
            return got

        cls._build = counted  # type: ignore[method-assign]
    pipe = GenerationPipeline(args.model, max_length=args.prompt + args.tokens + 8, mode="auto")
    prompt = np.arange(args.prompt, dtype=np.int64)[None] % 1000
    rows: list[dict[str, Any]] = []
    for call in range(1, args.calls + 1):
        before = len(builds)
        start = time.perf_counter()
        result = pipe.generate(prompt, args.tokens)
        seconds = time.perf_counter() - start
        made = builds[before:]
        rows.append(
            {
                "call": call,
                "seconds": round(seconds, 3),
                "compiles": len(made),
                "compile_seconds": round(sum(s for _, s in made), 3),
                "compiled": [name for name, _ in made],
                "last_tokens": [int(t) for t in result.tokens[0][-4:]],
            }
        )
    print("| call | wall s | runtime compiles | compile s |")
    print("|---|---|---|---|")
    for r in rows:
        what = f"{r['compiles']} ({', '.join(r['compiled']) or '-'})"
        print(f"| {r['call']} | {r['seconds']:.2f} | {what} | {r['compile_seconds']:.2f} |")
    if args.out:
        meta = machine_meta(threads=os.environ.get("DSP_CPU_THREADS"), model=args.model, **runtime_versions())
        write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
