"""`make demo`: compile a small GPT-2 decoder with AUTO, prefill, then 16 greedy decode steps.

Prints what AUTO resolved to, the plan's size, and the time per step against the
legacy interpreter (which walks the graph at every call), and checks both produced
the same tokens.
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "gpt2_eager.onnx"


def decode(run: Any, model: dsp.CompiledModel, prompt: np.ndarray, steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with a KV cache fed back step by step; returns tokens and step times."""
    past_names = [n for n in model.input_names if n.startswith("past_key_values.")]
    past_shape = {n: model.graph.info(n).shape for n in past_names}
    batch = prompt.shape[0]
    past = {
        n: np.zeros([batch if i == 0 else (0 if i == 2 else d) for i, d in enumerate(past_shape[n])], np.float32)
        for n in past_names
    }
    ids = prompt
    length = 0
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(steps + 1):
        seq = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((batch, length + seq), np.int64),
            "position_ids": np.arange(length, length + seq, dtype=np.int64)[None, :].repeat(batch, 0),
            **past,
        }
        t0 = time.perf_counter()
        outs = run(feeds)
        times.append(time.perf_counter() - t0)
        nxt = int(outs["logits"][0, -1].argmax())
        tokens.append(nxt)
        past = {n: outs[n.replace("past_key_values.", "present.")] for n in past_names}
        length += seq
        ids = np.array([[nxt]], np.int64)
    return tokens, times


def main(argv: list[str] | None = None) -> int:
    """Run the demo."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    model = dsp.compile(args.model)  # mode AUTO
    compile_ms = (time.perf_counter() - t0) * 1e3
    plan = model.plan()
    part = model.partition()
    print(f"DSP {dsp.__version__}: {Path(args.model).name}, compiled in {compile_ms:.0f} ms")
    print(
        f"AUTO resolved to: {', '.join(model.resolved_backends())}"
        f"{' (segments: ' + str(len(part.segments)) + ')' if part else ''}"
    )
    if plan is not None:
        s = plan.summary()
        print(
            f"plan: {s['slots']} slots, {s['values']} values, {s['externals']['placeholder']} placeholders, "
            f"{s['externals']['constant']} constants ({s['constant_bytes'] / 1e6:.2f} MB)"
        )
    else:
        print(f"plan declined: {model.declined} -> legacy interpreter")

    prompt = np.array([[464, 2068, 7586, 21831, 18045, 625, 262]], np.int64) % 1000
    dsp_tokens, dsp_times = decode(model.run, model, prompt, args.steps)
    legacy_tokens, legacy_times = decode(model.run_legacy, model, prompt, args.steps)
    if dsp_tokens != legacy_tokens:
        print(f"MISMATCH: DSP {dsp_tokens} vs legacy {legacy_tokens}")
        return 1
    dsp_step = statistics.median(dsp_times[1:]) * 1e3
    legacy_step = statistics.median(legacy_times[1:]) * 1e3
    print(f"prefill ({prompt.shape[1]} tokens): DSP {dsp_times[0] * 1e3:.2f} ms, legacy {legacy_times[0] * 1e3:.2f} ms")
    print(
        f"decode, median of {args.steps} steps: DSP {dsp_step:.3f} ms/step, legacy {legacy_step:.3f} ms/step "
        f"({legacy_step / dsp_step:.2f}x)"
    )
    print(f"tokens (identical in both): {dsp_tokens[1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
