"""One decode step of GPT-2 (random weights, fp16, batch 1, past length 128) on one GPU.

Per model, the median time per step over ``--steps`` steps of:
- DSP CUDA_GRAPHS (islands captured, one graph launch each);
- DSP on the same plan without capture (DSP_NO_FREEZE=1: every op launched eagerly);
- torch eager (transformers) running the same step;
- the floor: weight bytes / measured device copy bandwidth;
and the host time of a replayed step (model.run, and the replay calls alone).

Run on the GPU machine: ``python3 benchmarks/step_gpu.py --out $OUT/step_gpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PAST = 128
SIZES = {"gpt2-124M": dict(n_layer=12, n_embd=768, n_head=12), "gpt2-774M": dict(n_layer=36, n_embd=1280, n_head=20)}


def log(msg: str) -> None:
    print(f"[step_gpu] {msg}", flush=True)


def build(size: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**SIZES[size], vocab_size=50257, n_positions=1024, attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval().half().cuda()


class Step(__import__("torch").nn.Module):  # type: ignore[misc]
    """Flat interface: (ids, mask, pos, k0, v0, ...) -> (logits, present k0, v0, ...)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> Any:
        from transformers import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        cache = DynamicCache(pairs, config=self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache
        )
        flat = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def feeds_for(model: Any) -> dict[str, Any]:
    import torch

    cfg = model.config
    g = torch.Generator(device="cuda").manual_seed(1)
    head = cfg.n_embd // cfg.n_head
    feeds: dict[str, Any] = {
        "input_ids": torch.tensor([[42]], device="cuda"),
        "attention_mask": torch.ones(1, PAST + 1, dtype=torch.int64, device="cuda"),
        "position_ids": torch.tensor([[PAST]], device="cuda"),
    }
    for i in range(cfg.n_layer):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = torch.randn(
                1, cfg.n_head, PAST, head, generator=g, device="cuda", dtype=torch.float16
            )
    return feeds


def export(model: Any, feeds: dict[str, Any], path: Path) -> None:
    import torch

    names = list(feeds)
    outs = ["logits"] + [f"present.{i}.{kv}" for i in range(model.config.n_layer) for kv in ("key", "value")]
    with torch.no_grad():
        torch.onnx.export(
            Step(model),
            tuple(feeds.values()),
            str(path),
            input_names=names,
            output_names=outs,
            opset_version=18,
            dynamo=True,
            external_data=True,
            optimize=True,
            verbose=False,
        )


def timed(fn: Any, steps: int, sync: Any) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth() -> float:
    import cupy as cp

    n = 1 << 30
    a = cp.ones(n, dtype=cp.uint8)
    b = cp.empty_like(a)
    for _ in range(3):
        b[...] = a
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    end.record()
    end.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, end) / 1e3 / 10
    return 2 * n / seconds  # bytes read + written per second


def bench(size: str, steps: int, workdir: Path, bandwidth: float) -> dict[str, Any]:
    import cupy as cp
    import torch

    import dsp_core as dsp

    sync = cp.cuda.Device().synchronize
    model = build(size)
    feeds = feeds_for(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict[str, Any] = {"weight_bytes": weight_bytes, "floor_ms": weight_bytes / bandwidth * 1e3}

    step = Step(model)
    with torch.no_grad():
        times = timed(lambda: step(*feeds.values()), 20, torch.cuda.synchronize)
        times = timed(lambda: step(*feeds.values()), steps, torch.cuda.synchronize)
    result["torch_eager_ms"] = statistics.median(times) * 1e3
    with torch.no_grad():
        want = step(*feeds.values())[0].float().cpu().numpy()
    log(f"{size}: torch eager {result['torch_eager_ms']:.3f} ms")

    path = workdir / f"{size}.onnx"
    t0 = time.perf_counter()
    export(model, feeds, path)
    result["export_s"] = time.perf_counter() - t0
    log(f"{size}: exported in {result['export_s']:.1f} s")
    host = {k: v.cpu().numpy() for k, v in feeds.items() if not k.startswith("past")}
    kv = {k: cp.asarray(v.cpu().numpy()) for k, v in feeds.items() if k.startswith("past")}
    torch.cuda.empty_cache()

    graphs = dsp.compile(path, mode="cuda_graphs", strict=True, outputs_on_device=True)
    graphs.dsp.mark_variable(list(kv))  # KV caches live on the device, read in place
    all_feeds = {**host, **kv}
    for _ in range(10):
        out = graphs.run(all_feeds)
    sync()
    got = cp.asnumpy(out["logits"]).astype(np.float32)
    result["max_abs_err_vs_torch"] = float(np.abs(got - want).max())
    runtime = graphs.last_live.runtime  # type: ignore[union-attr]
    result["phase"] = graphs.dsp.phase.name
    result["units"] = [(u.kind.value, len(u.segment.slots), u.phase.name, u.reason) for u in runtime.units]
    before = runtime.counters()
    times = timed(lambda: graphs.run(all_feeds), steps, sync)
    after = runtime.counters()
    result["cuda_graphs_ms"] = statistics.median(times) * 1e3
    result["recaptures_in_steady_state"] = after["recaptures"] - before["recaptures"]
    host_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        graphs.run(all_feeds)
        host_times.append(time.perf_counter() - t0)
        sync()
    result["host_us_per_run_call"] = statistics.median(host_times) * 1e6
    islands = [u for u in runtime.units if u.kind.value == "island"]
    compiled = islands[0].compiled if islands else None
    result["host_us_per_replay_call"] = replay_host_us(graphs, compiled, all_feeds, steps, sync)
    # The same with every feed already on the device (as the decode pipeline feeds it): the
    # replay then copies nothing from the host and is one graph launch plus bookkeeping.
    device_feeds = {k: cp.asarray(v) for k, v in all_feeds.items()}
    result["host_us_per_replay_call_device_feeds"] = replay_host_us(graphs, compiled, device_feeds, steps, sync)
    log(f"{size}: CUDA_GRAPHS {result['cuda_graphs_ms']:.3f} ms; phase {result['phase']}")

    os.environ["DSP_NO_FREEZE"] = "1"
    try:
        eager = dsp.compile(path, mode="cuda_graphs", strict=True, outputs_on_device=True)
        eager.dsp.mark_variable(list(kv))
        for _ in range(5):
            eager.run(all_feeds)
        eager_steps = max(20, steps // 4)
        times = timed(lambda: eager.run(all_feeds), eager_steps, sync)
        result["uncaptured_ms"] = statistics.median(times) * 1e3
        result["uncaptured_steps"] = eager_steps
    finally:
        del os.environ["DSP_NO_FREEZE"]
    result["speedup_vs_uncaptured"] = result["uncaptured_ms"] / result["cuda_graphs_ms"]
    log(f"{size}: uncaptured {result['uncaptured_ms']:.3f} ms; speedup {result['speedup_vs_uncaptured']:.1f}x")
    return result


def replay_host_us(graphs: Any, compiled: Any, feeds: dict[str, Any], steps: int, sync: Any) -> float | None:
    """Median host µs of the island's replay call over ``steps`` runs (after 5 untimed ones)."""
    if compiled is None:
        return None
    for _ in range(5):
        graphs.run(feeds)
    sync()
    times: list[float] = []
    orig = compiled.replay

    def timed(values: Any) -> Any:
        t0 = time.perf_counter()
        status = orig(values)
        times.append(time.perf_counter() - t0)
        return status

    compiled.replay = timed
    try:
        for _ in range(steps):
            graphs.run(feeds)
            sync()
    finally:
        compiled.replay = orig
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="step_gpu.json")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", default=",".join(SIZES))
    args = parser.parse_args()
    import cupy as cp
    import torch
    import transformers

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "cupy": cp.__version__},
        "setup": f"batch 1, one new token, past length {PAST}, fp16, random weights; median of {args.steps} steps",
        "command": "python3 benchmarks/step_gpu.py --out $OUT/step_gpu.json",
        "models": {},
    }
    bandwidth = copy_bandwidth()
    report["copy_bandwidth_GBps"] = bandwidth / 1e9
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            try:
                report["models"][size] = bench(size, args.steps, Path(tmp), bandwidth)
            except Exception as exc:  # noqa: BLE001  (report what failed, go on with the next)
                import traceback

                traceback.print_exc()
                report["models"][size] = {"error": f"{type(exc).__name__}: {exc}"}
            Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
