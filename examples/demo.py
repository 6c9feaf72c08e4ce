"""`make demo`: a small GPT-2 decoder compiled with AUTO, a prefill and 16 decode steps.

Three ways to run the same greedy decode, all on the bundled fixture:

1. the legacy interpreter (walks the graph at every call), with a growing KV cache;
2. ``dsp.compile`` + ``model.run`` on the same growing-cache loop (a new shape each step);
3. ``GenerationPipeline``: a prefill plan and a decode plan whose KV caches are fixed
   buffers written in place, so the decode plan's shapes never change: it freezes and,
   in a capturing mode, replays.

It prints what AUTO resolved to, the plans' sizes and phases, the time per step of each,
and checks that all three produced the same tokens, as torch did when the fixture was made.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsp_core as dsp
from dsp_core.llm import GenerationPipeline

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "gpt2_eager.onnx"


def growing_cache_decode(
    run: Any, model: dsp.CompiledModel, prompt: np.ndarray, steps: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding feeding the KV cache back step by step; returns tokens and step times."""
    past_names = [n for n in model.input_names if n.startswith("past_key_values.")]
    past = {
        n: np.zeros(
            [1 if i == 0 else (0 if i == 2 else d) for i, d in enumerate(model.graph.info(n).shape)], np.float32
        )
        for n in past_names
    }
    ids, length, tokens, times = prompt, 0, [], []
    for _ in range(steps + 1):
        seq = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, length + seq), np.int64),
            "position_ids": np.arange(length, length + seq, dtype=np.int64)[None, :],
            **past,
        }
        t0 = time.perf_counter()
        outs = run(feeds)
        times.append(time.perf_counter() - t0)
        tokens.append(int(outs["logits"][0, -1].argmax()))
        past = {n: outs[n.replace("past_key_values.", "present.")] for n in past_names}
        length += seq
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens, times


def main(argv: list[str] | None = None) -> int:
    """Run the demo."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mode", default="auto", help="execution mode of the pipeline (e.g. emulated_replay)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    model = dsp.compile(args.model)  # mode AUTO
    compile_ms = (time.perf_counter() - t0) * 1e3
    plan = model.plan()
    print(
        f"DSP {dsp.__version__}: {Path(args.model).name}, compiled in {compile_ms:.0f} ms "
        f"({'warm disk cache' if model.stats.disk_hits else 'cold'})"
    )
    print(f"AUTO resolved to: {', '.join(model.resolved_backends())}")
    if plan is not None:
        s = plan.summary()
        print(
            f"plan: {s['slots']} slots, {s['values']} values, {s['externals']['placeholder']} placeholders, "
            f"{s['externals']['constant']} constants ({s['constant_bytes'] / 1e6:.2f} MB)"
        )

    prompt = np.array([[17, 402, 93, 958, 5, 311, 640]], np.int64)
    legacy_tokens, legacy_times = growing_cache_decode(model.run_legacy, model, prompt, args.steps)
    dsp_tokens, dsp_times = growing_cache_decode(model.run, model, prompt, args.steps)

    pipe = GenerationPipeline(args.model, max_length=64, mode=args.mode)
    pipe.generate(prompt, max_new_tokens=args.steps + 1)  # warm-up: both plans built and frozen
    result = pipe.generate(prompt, max_new_tokens=args.steps + 1)
    pipe_tokens = result.token_list()
    decode = pipe.decode_model
    d = decode.plan().summary()
    counters = decode.dsp.runtime.counters()

    if not dsp_tokens == legacy_tokens == pipe_tokens:
        print(f"MISMATCH: legacy {legacy_tokens}\n      dsp {dsp_tokens}\n pipeline {pipe_tokens}")
        return 1
    legacy_step = statistics.median(legacy_times[1:]) * 1e3
    dsp_step = statistics.median(dsp_times[1:]) * 1e3
    pipe_rate = result.metrics.rate(1)  # decode tokens/s (steps >= 1)
    pipe_step = 1e3 / pipe_rate if pipe_rate else float("nan")
    print(
        f"decode plan ({pipe.mode.name}): {d['slots']} slots, {len(decode.dsp.runtime.sealed)} sealed as constants, "
        f"phase {decode.dsp.phase.name}, captures {counters.get('captures', 0)}, "
        f"recaptures {counters.get('recaptures', 0)}"
    )
    print(f"prefill ({prompt.shape[1]} tokens): legacy {legacy_times[0] * 1e3:.2f} ms, DSP {dsp_times[0] * 1e3:.2f} ms")
    print(f"decode, median of {args.steps} steps:")
    print(f"  legacy interpreter, growing cache  {legacy_step:7.3f} ms/step")
    print(f"  DSP model.run, growing cache       {dsp_step:7.3f} ms/step  ({legacy_step / dsp_step:.2f}x)")
    print(f"  DSP GenerationPipeline, fixed KV   {pipe_step:7.3f} ms/step  ({legacy_step / pipe_step:.2f}x)")
    print(f"tokens (identical in all three): {pipe_tokens[1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
