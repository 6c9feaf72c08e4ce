"""Decode benchmark: DSP against torch peers on GPT-2 and Llama-family models (fp16, batch 1, greedy).

Models (random weights, seed 1234, built from configs: no download):

- ``gpt2-124m``, ``gpt2-774m``: GPT-2 small and large (default init, std 0.02);
- ``llama-135m``: the SmolLM-135M shape (30 layers, hidden 576, 9 heads / 3 KV heads,
  intermediate 1536, vocab 49152, tied embeddings, rope_theta 10000);
- ``llama-1b``: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads / 8 KV heads,
  head_dim 64, intermediate 8192, vocab 128256, tied embeddings, rope_theta 500000; plain
  rotary, without the checkpoint's llama3 frequency scaling, which changes no cost);
- ``tiny``, ``llama-tiny``: 2-layer models for ``--tiny``.

The Llama models use init std 0.05 (``LLAMA_INIT``): at transformers' default 0.02 a random
deep Llama greedily repeats one token forever, which would make "tokens identical to HF"
say nothing. Every record says how many distinct tokens the reference produced.

Rows, per model, in one run:

- ``dsp_block[MODE]``: the ONNX export of the model (scripts/decoder_export.py, the recipe of
  the test fixtures) through ``dsp_core.llm.GenerationPipeline`` in execution mode MODE with
  ``block_capture=True``: K greedy decode steps as one plan, one replay per K tokens;
- ``dsp_step[MODE]``: the same with ``block_capture=False``: one replay per token, the host
  reading tokens once per block of K. One row pair per mode of ``--modes`` (e.g.
  ``auto,cuda_graphs,triton``), each recording the backends its plans resolved to. The DSP
  rows run in a worker process per mode (``--dsp-python``, so the DSP environment may differ
  from the torch one);
- ``hf_eager``: transformers ``generate`` (dynamic cache, no compile), timed per token by a
  streamer;
- ``static_cudagraph``: a ``StaticCache`` decode step captured by hand in a
  ``torch.cuda.CUDAGraph`` and replayed per token;
- ``compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")`` of the StaticCache
  step, ``torch.compiler.cudagraph_mark_step_begin()`` each step;
- ``floor``: weight bytes / measured device copy bandwidth (every token reads every weight
  once): an upper bound on tokens/s, not a run.

Reported per row (table and JSON): lateSteady tokens/s (step >= 20, the definitions of
dsp_core.llm.metrics; the median of ``--repeats`` timed runs of ``--new-tokens`` tokens, 5 runs
of 256 by default, hf_eager ``--hf-repeats`` = 1 run), ms/token, **kernels per token** and GPU
µs per token, the ratio to torch.compile reduce-overhead and to the floor, the fraction of
tokens identical to hf_eager's, and the resolved backends; the JSON's ``block_groups`` gives, for
each kernel a fusing backend generated, its group's template, ops and shape (so that a kernel name
in ``kernels.every_kernel`` reads as the group it runs). Kernels are counted by
``torch.profiler.profile(activities=[ProfilerActivity.CUDA])`` (it sees the kernels inside
replayed CUDA graphs, CuPy-captured ones included) over a steady window of
``--profile-tokens`` decode tokens (16; a whole number of blocks for the DSP rows; the window
starts after 16 tokens) in a separate run of the same code path, inside the DSP worker for the
DSP rows, divided by the tokens in the window; the JSON also lists the top kernel names by
count and by time per token. On a machine without CUDA no kernel is counted (the value is null
with the reason; the torch rows give torch's CPU ops per token instead, labelled as such).

On the GPU image (torch 2.11, transformers 5.x, dsp + the CUDA plugins installed), one model
per invocation keeps each under 9 minutes (the exports are kept in ``--onnx-dir``):

    python3 benchmarks/decode_gpu.py --models gpt2-124m --modes auto,cuda_graphs \\
        --onnx-dir /tmp/dsp_onnx --out $OUT/decode_gpu/gpt2-124m
    python3 benchmarks/decode_gpu.py --models llama-1b --modes auto,cuda_graphs \\
        --onnx-dir /tmp/dsp_onnx --out $OUT/decode_gpu/llama-1b

Estimated on an H200 (not yet measured; the JSON records ``wall_seconds`` per phase): gpt2-124m
about 3 minutes, llama-1b about 6 (ONNX export ~1-1.5 min, a DSP worker per mode 1-2 min with the
Triton compile cold, torch.compile ~0.5-1 min); both in one invocation would come close to 9
minutes, hence the split. ``--repeats 3`` trims a minute where needed. All four models:
``--models gpt2-124m,gpt2-774m,llama-135m,llama-1b`` (in one invocation only without a time limit;
split as above otherwise).

Here, without a GPU, ``--tiny`` runs every code path on the CPU with the 2-layer GPT-2 and
Llama (fp32, 8-token prompt, 24 new tokens, 2 repeats; CUDA-graph capture is replaced by eager
calls of the same step and ``torch.compile`` may fall back to its eager backend, both noted in
the JSON):

    .fixture-venv/bin/python benchmarks/decode_gpu.py --tiny --dsp-python .venv/bin/python --out /tmp/decode
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_INIT = 0.05  # init std of the Llama models (see the module doc)


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: its transformers family and config overrides."""

    family: str  # "gpt2" or "llama"
    config: dict[str, Any]
    about: str = ""

    @property
    def vocab(self) -> int:
        """Vocabulary size (GPT-2's default 50257 where not overridden)."""
        return int(self.config.get("vocab_size", 50257))


def _llama(**shape: Any) -> dict[str, Any]:
    common = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "initializer_range": LLAMA_INIT}
    return {**common, "tie_word_embeddings": True, **shape}


MODELS = {
    "gpt2-124m": ModelSpec("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}, "GPT-2 small"),
    "gpt2-774m": ModelSpec("gpt2", {"n_layer": 36, "n_embd": 1280, "n_head": 20}, "GPT-2 large"),
    "llama-135m": ModelSpec(
        "llama",
        _llama(
            num_hidden_layers=30,
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            rope_theta=10000.0,
        ),
        "the SmolLM-135M shape",
    ),
    "llama-1b": ModelSpec(
        "llama",
        _llama(
            num_hidden_layers=16,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
        "the Llama-3.2-1B shape",
    ),
    "tiny": ModelSpec("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_inner": 128}),
    "llama-tiny": ModelSpec(
        "llama",
        _llama(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=1000,
        ),
    ),
}
TINY_MODELS = "tiny,llama-tiny"
THRESHOLDS = {"overall": 0, "decode": 1, "steady": 3, "lateSteady": 20}
DSP_PEERS = {"dsp_block": True, "dsp_step": False}  # peer -> GenerationPipeline(block_capture=...)
TORCH_PEERS = ("hf_eager", "static_cudagraph", "compile_reduce_overhead")
REFERENCE, BASELINE = "hf_eager", "compile_reduce_overhead"  # tokens compared with; speed ratio to
WORKER_MARK = "decode_gpu worker result: "
PROFILE_START = 16  # kernel windows start after this many tokens (and after two DSP blocks)
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr with the seconds since start (the table goes to stdout)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def row_name(peer: str, mode: str) -> str:
    """``dsp_block[triton]``: a DSP peer under one execution mode."""
    return f"{peer}[{mode}]"


# -- metrics (the same definitions as dsp_core.llm.metrics, without importing dsp) ---------
def rates(step_seconds: Sequence[float]) -> dict[str, Any]:
    """The four tokens/s metrics and the effective one from per-step seconds."""
    out: dict[str, Any] = {}
    for name, first in THRESHOLDS.items():
        times = step_seconds[first:]
        out[name] = len(times) / sum(times) if times and sum(times) > 0 else None
    best = next((n for n in ("lateSteady", "steady", "decode", "overall") if out[n] is not None), "overall")
    out["effective"] = out[best]
    out["effective_metric"] = best
    return out


def median_run(runs: Sequence[Sequence[float]]) -> tuple[dict[str, Any], int]:
    """Median of each metric over timed runs (per-step seconds each), and the run nearest the median.

    The chosen run's index is the one whose effective rate is the median's (the lower middle
    for an even count), so its per-step seconds and tokens stand for the row.
    """
    if not runs:
        raise ValueError("no timed runs")
    each = [rates(r) for r in runs]
    out: dict[str, Any] = {}
    for name in (*THRESHOLDS, "effective"):
        values = [m[name] for m in each if m[name] is not None]
        out[name] = statistics.median(values) if values else None
    out["effective_metric"] = each[0]["effective_metric"]
    order = sorted(range(len(each)), key=lambda i: each[i]["effective"] or 0.0)
    chosen = order[(len(order) - 1) // 2]
    out["repeats"] = len(runs)
    out["effective_min"] = each[order[0]]["effective"]
    out["effective_max"] = each[order[-1]]["effective"]
    return out, chosen


# -- kernel counting ---------------------------------------------------------------------------
def profile_window(block: int, tokens: int) -> tuple[int, int, int]:
    """(start, window, run length) in tokens of a kernel-count run with ``block`` tokens per host call.

    The window opens once ``start`` tokens exist (the first token, then two whole blocks, and
    at least PROFILE_START), spans a whole number of blocks covering ``tokens``, and the run
    generates ``start + window`` tokens.
    """
    if block < 1 or tokens < 1:
        raise ValueError(f"block ({block}) and tokens ({tokens}) must be >= 1")
    start = 1 + max(2, math.ceil((PROFILE_START - 1) / block)) * block
    window = math.ceil(tokens / block) * block
    return start, window, start + window


def short_kernel_name(name: str, limit: int = 72) -> str:
    """A kernel's name without its parameter list and template arguments, at most ``limit`` chars."""
    cut = len(name)
    for mark in ("(", "<"):
        at = name.find(mark)
        if at > 0:
            cut = min(cut, at)
    base = name[:cut].strip()
    base = base.removeprefix("void ").strip() or name
    return base if len(base) <= limit else base[: limit - 3] + "..."


def summarize_trace(events: Sequence[dict[str, Any]], tokens: int, category: str, top: int = 10) -> dict[str, Any]:
    """Counts per token of the complete (``ph: X``) events of ``category`` in a Chrome trace.

    ``category`` is ``kernel`` for CUDA kernels (``gpu_memcpy``/``gpu_memset`` are not kernels
    and are counted apart), ``cpu_op`` for torch's CPU ops. Returns per-token count and µs,
    the top names by count and by time, and the window's token count.
    """
    if tokens < 1:
        raise ValueError(f"a window of {tokens} tokens")
    counts: dict[str, int] = {}
    micros: dict[str, float] = {}
    other: dict[str, int] = {}
    spans: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        if cat != category:
            if cat.startswith("gpu_") or "graph" in cat:
                other[cat] = other.get(cat, 0) + 1
            continue
        name = short_kernel_name(str(e.get("name", "?")))
        counts[name] = counts.get(name, 0) + 1
        micros[name] = micros.get(name, 0.0) + float(e.get("dur", 0.0))
        start = float(e.get("ts", 0.0))
        spans.append((start, start + float(e.get("dur", 0.0))))

    def item(name: str) -> dict[str, Any]:
        return {"name": name, "per_token": counts[name] / tokens, "us_per_token": micros[name] / tokens}

    return {
        "category": category,
        "window_tokens": tokens,
        "per_token": sum(counts.values()) / tokens,
        "us_per_token": sum(micros.values()) / tokens,
        # the time some kernel ran (overlapping kernels, as dependent launches make, counted once)
        "busy_us_per_token": busy_time(spans) / tokens,
        "distinct_names": len(counts),
        "top_by_count": [item(n) for n in sorted(counts, key=lambda n: (-counts[n], n))[:top]],
        "top_by_time": [item(n) for n in sorted(micros, key=lambda n: (-micros[n], n))[: max(top // 2, 1)]],
        "every_kernel": [item(n) for n in sorted(micros, key=lambda n: (-micros[n], n))],  # by time
        "other_events": other,
    }


def busy_time(spans: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The row's ``kernels_per_token`` / ``gpu_us_per_token`` (null with a reason unless CUDA kernels were seen)."""
    if "error" in summary:
        return {"kernels_per_token": None, "gpu_us_per_token": None, "kernels_reason": summary["error"]}
    if summary.get("category") != "kernel":
        reason = summary.get("reason") or "no CUDA device: kernels are counted from torch.profiler's CUDA activity"
        return {"kernels_per_token": None, "gpu_us_per_token": None, "kernels_reason": reason}
    if not summary["per_token"]:
        return {
            "kernels_per_token": None,
            "gpu_us_per_token": None,
            "kernels_reason": "torch.profiler recorded no CUDA kernel in the window",
        }
    return {
        "kernels_per_token": summary["per_token"],
        "gpu_us_per_token": summary["us_per_token"],
        "gpu_busy_us_per_token": summary.get("busy_us_per_token"),
    }


def torch_profiler(cuda: bool) -> Any:
    """``torch.profiler.profile`` of CUDA activity (kernels, copies, runtime calls), or of CPU ops without CUDA."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])


class KernelWindow:
    """torch.profiler over the decode tokens between two counts of one run (CUDA activity; CPU ops without CUDA).

    The code under test calls ``tokens_done(n)`` whenever its first ``n`` tokens exist; the
    profiler starts at the first call with ``n >= start`` and stops at the first with
    ``n - n_start >= window``, the device synchronised at both ends, so the window holds
    exactly the kernels of those tokens.
    """

    def __init__(
        self,
        torch: Any,
        cuda: bool,
        start: int,
        window: int,
        trace_to: Path | None = None,
        profiler: Callable[[bool], Any] | None = None,
    ) -> None:
        self.torch, self.cuda = torch, cuda
        self.start, self.window = start, window
        self.trace_to = trace_to
        self.profiler = profiler or torch_profiler  # (cuda) -> an object with start/stop/export_chrome_trace
        self.prof: Any = None
        self.begin: int | None = None
        self.end: int | None = None

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def tokens_done(self, n: int) -> None:
        """Open or close the window as the run reaches ``n`` tokens."""
        if self.begin is None and n >= self.start:
            self._sync()
            self.prof = self.profiler(self.cuda)
            self.prof.start()
            self.begin = n
        elif self.begin is not None and self.end is None and n - self.begin >= self.window:
            self._sync()
            self.prof.stop()
            self.end = n

    def result(self, cpu_reason: str = "") -> dict[str, Any]:
        """The window's summary (summarize_trace), or ``{"error": ...}`` when it never closed."""
        if self.begin is None or self.end is None:
            if self.prof is not None and self.end is None:
                with contextlib.suppress(Exception):
                    self.prof.stop()
            return {"error": f"the profiled run never completed the window ({self.begin=}, {self.end=})"}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self.prof.export_chrome_trace(str(path))
            text = path.read_text()
        if self.trace_to is not None:
            self.trace_to.parent.mkdir(parents=True, exist_ok=True)
            self.trace_to.write_bytes(gzip.compress(text.encode()))
        events = json.loads(text).get("traceEvents", [])
        summary = summarize_trace(events, self.end - self.begin, "kernel" if self.cuda else "cpu_op")
        summary["counted"] = (
            "CUDA kernels (torch.profiler, CUDA activity)"
            if self.cuda
            else "torch CPU ops, nested ones included (no CUDA device: no kernels)"
        )
        if not self.cuda:
            summary["reason"] = cpu_reason or "no CUDA device: kernels are counted from torch.profiler's CUDA activity"
        if self.trace_to is not None:
            summary["trace"] = str(self.trace_to)
        return summary


def count_kernels(
    run: Callable[[KernelWindow], Any], make_window: Callable[[], KernelWindow], **kw: Any
) -> dict[str, Any]:
    """Run ``run(window)`` once and summarise its window; a failure becomes ``{"error": ...}``."""
    window = make_window()
    try:
        run(window)
        return window.result(**kw)
    except Exception as exc:  # noqa: BLE001  (the count is a column, not the run)
        return {"error": f"{type(exc).__name__}: {exc}"}


class StepClock:
    """Per-step timestamps: CUDA events on a GPU (no sync per step), perf_counter on the CPU."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch, self.cuda = torch, device.startswith("cuda")
        self.marks: list[Any] = []

    def mark(self) -> None:
        """Timestamp now (in stream order on a GPU)."""
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks."""
        if self.cuda:
            self.torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


# -- model, export -------------------------------------------------------------------------
def build(torch: Any, name: str, dtype: Any, device: str, attn: str) -> Any:
    """A randomly initialised causal LM (seed 1234, initialised on ``device``) with no EOS (runs the full length)."""
    spec = MODELS[name]
    torch.manual_seed(1234)
    if spec.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg: Any = GPT2Config(
            **spec.config, n_positions=1024, bos_token_id=None, eos_token_id=None, attn_implementation=attn
        )
        cls: Any = GPT2LMHeadModel
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            **spec.config, bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation=attn
        )
        cls = LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg)
    return model.eval().to(dtype=dtype)


def describe(model: Any) -> dict[str, Any]:
    """Parameters, layers, heads and rope theta as the built model has them (for the JSON)."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "vocab": cfg.vocab_size,
        "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else getattr(cfg, "rope_theta", None),
        "init_std": cfg.initializer_range,
    }


def cache_kw(model: Any) -> str:
    """The forward's cache keyword (transformers renamed past_key_values -> cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def export_onnx(torch: Any, model: Any, path: Path, opset: int) -> Path:
    """Export with the fixtures' recipe (scripts/decoder_export.py), weights as external data.

    Written into a sibling folder and renamed, so an interrupted export never leaves a
    ``model.onnx`` a later run would take.
    """
    sys.path.insert(0, str(ROOT / "scripts"))
    from decoder_export import DecoderWrapper, export_decoder_program

    p = next(model.parameters())
    prog = export_decoder_program(DecoderWrapper(model).eval(), opset, device=p.device, dtype=p.dtype)
    tmp = path.parent.with_name(path.parent.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prog.save(str(tmp / path.name), external_data=True)  # 774M in fp16 is near protobuf's 2 GB limit
    shutil.rmtree(path.parent, ignore_errors=True)
    tmp.rename(path.parent)
    return path


# -- torch peers -----------------------------------------------------------------------------
def timed_runs(run: Callable[[], tuple[list[float], list[int]]], repeats: int) -> dict[str, Any]:
    """``repeats`` timed runs: per-run step seconds, the median run's tokens, whether tokens agreed."""
    seconds, tokens = [], []
    for _ in range(max(repeats, 1)):
        s, t = run()
        seconds.append(s)
        tokens.append(t)
    _, chosen = median_run(seconds)
    return {
        "runs_step_seconds": seconds,
        "tokens": tokens[chosen],
        "tokens_stable_across_repeats": all(t == tokens[0] for t in tokens),
    }


def peer_hf_eager(torch: Any, model: Any, prompt: Any, n: int, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """transformers generate, timed per token by a streamer (each put() follows a host copy)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self, window: KernelWindow | None) -> None:
            self.times: list[float] = []
            self.window = window

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())
            if self.window is not None:  # the first put() is the prompt
                self.window.tokens_done(len(self.times) - 1)

        def end(self) -> None:
            pass

    def run(length: int, window: KernelWindow | None = None) -> tuple[list[float], list[int]]:
        clock = Clock(window)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=length,
                min_new_tokens=length,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
        stamps = [start] + clock.times[1:]
        return [b - a for a, b in zip(stamps, stamps[1:])], out[0, prompt.shape[1] :].tolist()

    run(min(n, 16))  # warm-up
    result = timed_runs(lambda: run(n), args.hf_repeats)
    if args.profile_tokens:
        start, window, length = profile_window(1, args.profile_tokens)
        result["kernels"] = count_kernels(
            lambda w: run(length, w), lambda: KernelWindow(torch, cuda, start, window, args.trace_path(REFERENCE))
        )
    return result


def _static_cache(model: Any, length: int) -> Any:
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    p = next(model.parameters())
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    for key, val in (("max_batch_size", 1), ("batch_size", 1), ("device", p.device), ("dtype", p.dtype)):
        if key in params:
            kwargs[key] = val
    return StaticCache(**kwargs)


class StaticDecoder:
    """A hand-written StaticCache decode: prefill, then a fixed-shape step(token, position)."""

    def __init__(self, torch: Any, model: Any, length: int) -> None:
        self.torch, self.model = torch, model
        self.cache = _static_cache(model, length)
        self.kw = cache_kw(model)
        self.has_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def _call(self, ids: Any, positions: Any) -> Any:
        extra = {"cache_position": positions} if self.has_cache_position else {}
        out = self.model(input_ids=ids, position_ids=positions[None], use_cache=True, **{self.kw: self.cache}, **extra)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def set_position(self, p: int) -> None:
        """Rewind the cache's own device-side write position (newer StaticCache keeps one)."""
        for layer in getattr(self.cache, "layers", []):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, self.torch.Tensor):
                length.fill_(p)

    def reset(self) -> None:
        """Empty cache (same buffers)."""
        self.cache.reset()
        self.set_position(0)

    def prefill(self, prompt: Any) -> Any:
        """The prompt through the model; returns the first token [1, 1]."""
        positions = self.torch.arange(prompt.shape[1], device=prompt.device)
        return self._call(prompt, positions)

    def step(self, token: Any, position: Any) -> Any:
        """One token at ``position`` ([1] int64 tensor); returns the next token [1, 1]."""
        return self._call(token, position)


def _static_run(
    torch: Any,
    dec: StaticDecoder,
    prompt: Any,
    n: int,
    device: str,
    step_fn: Any,
    mark_step: bool,
    window: KernelWindow | None = None,
) -> tuple[list[float], list[int]]:
    clock = StepClock(torch, device)
    dec.reset()
    clock.mark()
    with torch.no_grad():
        token = dec.prefill(prompt).clone()
        position = torch.tensor([prompt.shape[1]], device=prompt.device)
        tokens = torch.empty(n, dtype=torch.long, device=prompt.device)
        tokens[0] = token[0, 0]
        clock.mark()
        for i in range(1, n):
            if window is not None:
                window.tokens_done(i)
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            nxt = step_fn(token, position)
            token.copy_(nxt)
            tokens[i] = token[0, 0]
            position += 1
            clock.mark()
        if window is not None:
            window.tokens_done(n)
    return clock.seconds(), tokens.tolist()


def _static_rows(
    torch: Any, dec: StaticDecoder, prompt: Any, args: argparse.Namespace, device: str, step: Any, peer: str
) -> dict[str, Any]:
    """Timed runs and the kernel window of a StaticCache step function (hand-captured or compiled)."""
    mark = peer == BASELINE
    result = timed_runs(lambda: _static_run(torch, dec, prompt, args.new_tokens, device, step, mark), args.repeats)
    if args.profile_tokens:
        start, window, length = profile_window(1, args.profile_tokens)
        result["kernels"] = count_kernels(
            lambda w: _static_run(torch, dec, prompt, length, device, step, mark, w),
            lambda: KernelWindow(torch, device.startswith("cuda"), start, window, args.trace_path(peer)),
        )
    return result


def peer_static_cudagraph(torch: Any, model: Any, prompt: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """One decode step captured in a torch.cuda.CUDAGraph, replayed per token (eager on a CPU)."""
    dec = StaticDecoder(torch, model, prompt.shape[1] + args.length + 1)
    if not device.startswith("cuda"):
        result = _static_rows(torch, dec, prompt, args, device, dec.step, "static_cudagraph")
        result["note"] = "no CUDA: the StaticCache step ran eagerly (capture skipped)"
        return result
    p = prompt.shape[1]
    static_token = torch.zeros(1, 1, dtype=torch.long, device=device)
    static_pos = torch.tensor([p], device=device)
    with torch.no_grad():
        dec.reset()
        dec.prefill(prompt)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                dec.set_position(p)
                dec.step(static_token, static_pos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        dec.set_position(p)
        with torch.cuda.graph(graph):
            static_next = dec.step(static_token, static_pos)

    def replay(token: Any, position: Any) -> Any:
        static_token.copy_(token)
        static_pos.copy_(position)
        graph.replay()
        return static_next

    _static_run(torch, dec, prompt, args.new_tokens, device, replay, mark_step=False)  # warm
    return _static_rows(torch, dec, prompt, args, device, replay, "static_cudagraph")


def peer_compile(torch: Any, model: Any, prompt: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """torch.compile(mode="reduce-overhead") of the StaticCache step; cudagraph_mark_step_begin each step."""
    dec = StaticDecoder(torch, model, prompt.shape[1] + args.length + 1)
    note = ""
    t0 = time.perf_counter()
    try:
        step = torch.compile(dec.step, mode="reduce-overhead", backend=args.compile_backend)
        _static_run(torch, dec, prompt, min(args.new_tokens, 4), device, step, mark_step=True)  # compiles
    except Exception as exc:  # noqa: BLE001  (no C++ toolchain on a CPU box: exercise the path eagerly)
        if device.startswith("cuda"):
            raise
        note = f"backend {args.compile_backend!r} failed on the CPU ({type(exc).__name__}); used backend 'eager'"
        torch._dynamo.reset()
        step = torch.compile(dec.step, backend="eager")
    _static_run(torch, dec, prompt, args.new_tokens, device, step, mark_step=True)  # warm
    result = _static_rows(torch, dec, prompt, args, device, step, BASELINE)
    result["setup_seconds"] = time.perf_counter() - t0
    if note:
        result["note"] = note
    return result


def floor(torch: Any, model: Any, device: str) -> dict[str, Any]:
    """Weight bytes / device copy bandwidth (read + write bytes of a large copy)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    clock = StepClock(torch, device)
    reps = 10
    clock.mark()
    for _ in range(reps):
        dst.copy_(src)
    clock.mark()
    seconds = sum(clock.seconds())
    bandwidth = 2 * nbytes * reps / seconds
    return {
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "tokens_per_s": bandwidth / weight_bytes,
    }


# -- DSP (worker process) --------------------------------------------------------------------
def run_dsp(
    args: argparse.Namespace, onnx_path: Path, prompt: list[int], mode: str, peers: list[str], log_path: Path
) -> dict[str, Any]:
    """The DSP rows of one execution mode, in ``--dsp-python`` (a worker invocation of this script)."""
    cmd = [
        args.dsp_python,
        str(Path(__file__).resolve()),
        "--dsp-worker",
        str(onnx_path),
        "--dsp-peers",
        ",".join(peers),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--new-tokens",
        str(args.new_tokens),
        "--length",
        str(args.length),
        "--modes",
        mode,
        "--block-size",
        str(args.block_size),
        "--sampling",
        args.sampling,
        "--repeats",
        str(args.repeats),
        "--profile-tokens",
        str(args.profile_tokens),
    ]
    if args.trace_dir:
        cmd += ["--trace-dir", args.trace_dir, "--model-name", args.trace_path.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"DSP worker ({mode}) ran past --timeout {args.timeout} s") from exc
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"DSP worker failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    lines = [x for x in done.stdout.splitlines() if x.startswith(WORKER_MARK)]
    if not lines:
        raise RuntimeError(f"DSP worker ({mode}) printed no result: {done.stdout.strip()[-500:]}")
    return json.loads(lines[-1][len(WORKER_MARK) :])


def dsp_worker(args: argparse.Namespace) -> int:
    """Inside the DSP environment: for each DSP peer, warm run, timed runs, a kernel window; one JSON line."""
    import numpy as np

    import dsp_core
    from dsp_core.llm import GenerationPipeline

    prompt = np.asarray([int(t) for t in args.prompt_ids.split(",")], dtype=np.int64)
    mode = args.modes
    launch = _time_host_launches()
    versions = {"dsp_core": dsp_core.__version__}
    for module in ("cupy", "triton", "numpy"):
        with contextlib.suppress(Exception):
            versions[module] = __import__(module).__version__
    out: dict[str, Any] = {"versions": versions, "rows": {}}
    source: Any = args.dsp_worker  # the first pipeline compiles the ONNX file; the others share its prefill plan
    for peer in [p for p in args.dsp_peers.split(",") if p]:
        row = row_name(peer, mode)
        try:
            start = time.perf_counter()
            pipe = GenerationPipeline(
                source,
                max_length=prompt.size + max(args.length, args.new_tokens),
                mode=mode if isinstance(source, str) else None,
                block_size=args.block_size,
                block_capture=DSP_PEERS[peer],
            )
            source = pipe.prefill_model
            sampling = _sampling(args.sampling)
            pipe.generate(prompt, args.new_tokens, sampling=sampling)  # warm-up: compile, freeze, capture
            setup = time.perf_counter() - start
            seconds, tokens, host = [], [], []
            for _ in range(max(args.repeats, 1)):
                launch.clear()
                result = pipe.generate(prompt, args.new_tokens, sampling=sampling)
                seconds.append(list(result.metrics.step_seconds))
                tokens.append(result.token_list())
                # host time spent issuing the decode steps (before the once-per-block read)
                host.append(1e6 * sum(launch) / max(args.new_tokens - 1, 1))
            _, chosen = median_run(seconds)
            entry: dict[str, Any] = {
                "mode": mode,
                "peer": peer,
                "runs_step_seconds": seconds,
                "tokens": tokens[chosen],
                "tokens_stable_across_repeats": all(t == tokens[0] for t in tokens),
                "setup_seconds": setup,
                "resolved_backends": pipe.decode_model.resolved_backends(),
                "decode_phase": pipe.decode_model.dsp.phase.name,
                "decode_state": pipe.decoder(1).xp.__name__,  # cupy: KV buffers and state on the device
                "decode_loop": (
                    f"one replay of a {args.block_size}-step plan per {args.block_size} tokens"
                    if DSP_PEERS[peer]
                    else f"one graph replay per token, tokens read once per block of {args.block_size}"
                ),
                "counters": pipe.decode_model.dsp.runtime.counters(),
                "host_launch_us_per_token": statistics.median(host),
                "block_counters": {
                    "x".join(map(str, key)): m.dsp.runtime.counters() for key, m in pipe._blocks.items()
                },
                "block_backends": {"x".join(map(str, key)): m.resolved_backends() for key, m in pipe._blocks.items()},
                "block_groups": {"x".join(map(str, key)): _fused_groups(m) for key, m in pipe._blocks.items()},
            }
            if args.profile_tokens:
                entry["kernels"] = _dsp_kernels(args, pipe, prompt, sampling, row)
            out["rows"][row] = entry
        except Exception as exc:  # noqa: BLE001  (one failing row must not hide the other)
            out["rows"][row] = {"mode": mode, "peer": peer, "error": f"{type(exc).__name__}: {exc}"}
    print(WORKER_MARK + json.dumps(out))  # a marked line: other output of the libraries cannot be taken for it
    return 0


def _fused_groups(model: Any) -> dict[str, Any]:
    """The fusion report of a model's kernel-generating segments, by kernel name: the group's
    template, ops and first output's shape, and how many groups of the plan run it (so that a
    kernel name in the profile reads as the group it runs); groups without a kernel, counted by
    status and reason."""
    kernels: dict[str, dict[str, Any]] = {}
    others: dict[str, int] = {}
    try:
        runtime = model.dsp.runtime
        plan = runtime.plan
        for unit in runtime.units:
            report = getattr(getattr(unit, "compiled", None), "fusion_report", None)
            if report is None:
                continue
            for r in report():
                if not r.get("kernel"):
                    why = f"{r.get('status')}: {str(r.get('reason', ''))[:160]}"
                    others[why] = others.get(why, 0) + 1
                    continue
                entry = kernels.get(r["kernel"])
                if entry is None:
                    slots = [plan.slots[i] for i in r["slots"]]
                    out = next((v for s in slots for v in s.outputs if v is not None), None)
                    shape = plan.values[out].shape if out is not None and out < len(plan.values) else None
                    ops = "+".join(s.op for s in slots)
                    entry = kernels[r["kernel"]] = {
                        "template": r["template"],
                        "ops": ops if len(ops) <= 240 else ops[:237] + "...",
                        "shape": [str(d) for d in shape or []],
                        "groups": 0,
                    }
                entry["groups"] += 1
    except Exception as exc:  # noqa: BLE001  (a report the runtime does not have costs the row nothing)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"kernels": kernels, "without_kernel": others}


def _dsp_kernels(args: argparse.Namespace, pipe: Any, prompt: Any, sampling: Any, row: str) -> dict[str, Any]:
    """The kernel window of a DSP row: a generate whose blocks open and close the profiler (this process)."""
    try:
        import torch
    except ImportError as exc:
        return {"error": f"torch is not importable in --dsp-python ({exc}): no profiler to count kernels with"}
    on_device = pipe.decoder(1).xp.__name__ != "numpy"
    cuda = on_device and torch.cuda.is_available()
    start, window, length = profile_window(args.block_size, args.profile_tokens)
    trace = Path(args.trace_dir) / f"{args.model_name}.{row}.json.gz" if args.trace_dir else None
    reason = "" if on_device else "DSP's decode ran on the CPU (numpy), which torch.profiler does not see"

    def run(w: KernelWindow) -> None:
        delivered = [0]

        def on_tokens(chunk: Any) -> None:  # after the host has read the block (the device is done with it)
            delivered[0] += chunk.shape[1]
            w.tokens_done(delivered[0])

        pipe.generate(prompt, length, sampling=sampling, on_tokens=on_tokens)

    return count_kernels(run, lambda: KernelWindow(torch, cuda, start, window, trace), cpu_reason=reason)


def _sampling(text: str) -> Any:
    """``temperature=0.8,top_k=50,top_p=0.9`` -> Sampling (seed 0); empty: greedy."""
    from dsp_core.llm import Sampling

    if not text:
        return None
    values = dict(item.split("=", 1) for item in text.split(","))
    return Sampling(
        temperature=float(values.get("temperature", 1.0)),
        top_k=int(values.get("top_k", 0)),
        top_p=float(values.get("top_p", 1.0)),
        seed=0,
    )


def _time_host_launches() -> list[float]:
    """Time every ``DecodeLoop.run_block`` call (the host's side of a block: it returns
    before the device finishes; the block's tokens are read after it). Returns the list
    the seconds are appended to."""
    from dsp_core.llm import pipeline

    spent: list[float] = []
    run_block = pipeline.DecodeLoop.run_block

    def timed(self: Any, *a: Any) -> None:
        t0 = time.perf_counter()
        run_block(self, *a)
        spent.append(time.perf_counter() - t0)

    pipeline.DecodeLoop.run_block = timed  # type: ignore[method-assign]
    return spent


# -- driver ----------------------------------------------------------------------------------
def meta(argv: list[str] | None) -> dict[str, Any]:
    """Machine, versions, date and the command line of this run."""
    import datetime
    import platform

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "benchmarks/decode_gpu.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "versions": {},
    }
    for module in ("torch", "transformers", "triton", "cupy", "numpy", "onnx", "onnxscript"):
        try:
            info["versions"][module] = __import__(module).__version__
        except Exception:  # noqa: BLE001, S112  (absent here)
            continue
    try:
        import torch

        if torch.cuda.is_available():
            info["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001, S110
        pass
    return info


def finish_row(entry: dict[str, Any]) -> None:
    """Median metrics, the median run's step seconds and the kernel columns of a finished row (in place)."""
    runs = entry.pop("runs_step_seconds", None)
    if runs:
        metrics, chosen = median_run(runs)
        entry["metrics"] = metrics
        entry["runs"] = [rates(r) for r in runs]
        entry["step_seconds"] = runs[chosen]
    if "kernels" in entry:
        entry.update(kernel_fields(entry["kernels"]))


def compare_rows(record: dict[str, Any]) -> None:
    """Each row's ratio to torch.compile reduce-overhead and to the floor, and its token match with hf_eager."""
    rows = record["peers"]
    base = rows.get(BASELINE, {}).get("metrics", {}).get("effective")
    fl = record.get("floor", {}).get("tokens_per_s")
    ref = rows.get(REFERENCE, {}).get("tokens")
    if ref:
        record["reference_distinct_tokens"] = len(set(ref))
    for entry in rows.values():
        rate = entry.get("metrics", {}).get("effective")
        entry["vs_compile"] = rate / base if rate and base else None
        entry["vs_floor"] = rate / fl if rate and fl else None
        if ref and "tokens" in entry:
            same = [a == b for a, b in zip(entry["tokens"], ref)]
            entry["token_match_vs_hf"] = sum(same) / max(len(ref), 1)
            # greedy decoding diverges for good after one different token: where it first did
            entry["first_mismatch_vs_hf"] = next((i for i, ok in enumerate(same) if not ok), None)


def explain_mismatches(torch: Any, model: Any, prompt: Any, record: dict[str, Any]) -> None:
    """Where a row's greedy tokens first leave HF's, what the same weights in fp32 prefer there.

    One teacher-forced fp32 forward over the prompt and HF's tokens (the rows agree with HF
    up to their first mismatch, so this is each row's context there): the top two fp32
    logits' gap, and whether fp32's choice is the row's token or HF's. A gap far below the
    fp16 noise says the two tokens are a tie that either computation may break. Runs last:
    it turns the model to fp32.
    """
    rows = record["peers"]
    ref = rows.get(REFERENCE, {}).get("tokens")
    pending = {p: e for p, e in rows.items() if e.get("first_mismatch_vs_hf") is not None and "tokens" in e}
    if not ref or not pending:
        return
    model = model.to(dtype=torch.float32)

    def teacher_forced(tokens: list[int]) -> Any:
        ids = torch.cat([prompt, torch.tensor([tokens], device=prompt.device, dtype=prompt.dtype)], dim=1)
        with torch.no_grad():
            return model(ids).logits[0].float()

    logits = teacher_forced(ref)
    start = prompt.shape[1] - 1  # logits[start + s] choose token s
    hf = fp32_agreement(logits, start, ref)
    check: dict[str, Any] = {
        "hf_tokens_equal_fp32_choice": hf["share"],
        "hf_mean_fp32_regret": hf["mean_regret"],
        "rows": {},
    }
    for peer, entry in pending.items():
        step = entry["first_mismatch_vs_hf"]
        row = logits[start + step]
        top = torch.topk(row, 2)
        mine, theirs = entry["tokens"][step], ref[step]
        choice = int(top.indices[0])
        check["rows"][peer] = {
            "step": step,
            "fp32_top2_gap": float(top.values[0] - top.values[1]),
            "fp32_logit_row_token_minus_hf_token": float(row[mine] - row[theirs]),
            "fp32_choice": "row" if choice == mine else "hf" if choice == theirs else "neither",
        }
        # Along the row's own tokens: how often fp32 would have chosen as it did, and what its
        # choices cost in fp32 logits. As often as HF's, and as cheap: the row breaks ties
        # differently, it is not less accurate.
        own = fp32_agreement(teacher_forced(list(entry["tokens"])), start, list(entry["tokens"]))
        check["rows"][peer]["tokens_equal_fp32_choice"] = own["share"]
        check["rows"][peer]["mean_fp32_regret"] = own["mean_regret"]
    record["mismatch_check"] = check


def fp32_agreement(logits: Any, start: int, tokens: list[int]) -> dict[str, float]:
    """How greedy ``tokens`` compare with the fp32 model's choices, teacher-forced on them.

    ``logits[start + s]`` are the fp32 logits that choose token ``s`` (a torch tensor or a
    numpy array). ``share``: the fraction of steps whose token is fp32's argmax;
    ``mean_regret``: the mean, over steps, of fp32's best logit minus the chosen token's (0 for
    fp32's own choices; a tie broken the other way costs its tiny gap).
    """
    rows = list(range(start, start + len(tokens)))
    picks = [int(p) for p in logits[rows].argmax(-1).tolist()]
    regret = logits[rows, picks] - logits[rows, list(tokens)]
    return {
        "share": sum(a == b for a, b in zip(picks, tokens)) / max(1, len(tokens)),
        "mean_regret": float(regret.mean()) if tokens else 0.0,
    }


def bench_model(
    args: argparse.Namespace, name: str, out_dir: Path, saved: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Every row on one model; returns the JSON record (``saved(record)`` after each row)."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t_model = time.perf_counter()
    record: dict[str, Any] = {
        "model": name,
        "about": MODELS[name].about,
        "family": MODELS[name].family,
        "device": device,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "hf_repeats": args.hf_repeats,
        "profile_tokens": args.profile_tokens,
        "torch": torch.__version__,
        "peers": {},
        "wall_seconds": {},
    }
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MODELS[name].vocab, (1, args.prompt_len), generator=g)
    peers = [p for p in args.peers.split(",") if p]
    if args.sampling:  # the torch peers here decode greedily: compare DSP with itself
        peers = [p for p in peers if p in DSP_PEERS]
    onnx_path = Path(args.onnx_dir or out_dir / "onnx") / f"{name}-{args.dtype}" / "model.onnx"
    dsp_peers = [p for p in DSP_PEERS if p in peers]
    export_error = None
    if dsp_peers and not onnx_path.exists():
        t0 = time.perf_counter()
        log(f"{name}: exporting ONNX -> {onnx_path}")
        try:
            export_model = build(torch, name, dtype, device, args.export_attn)
            export_onnx(torch, export_model, onnx_path, args.opset)
            del export_model
            if cuda:
                torch.cuda.empty_cache()  # the workers need the memory, not this process's cache
        except Exception as exc:  # noqa: BLE001  (the torch rows still run)
            export_error = f"ONNX export failed: {type(exc).__name__}: {exc}"
        record["wall_seconds"]["export"] = time.perf_counter() - t0
    for mode in args.mode_list if dsp_peers else []:
        t0 = time.perf_counter()
        try:
            if export_error:
                raise RuntimeError(export_error)
            log(f"{name}: DSP worker, mode {mode}: {', '.join(dsp_peers)}")
            logs = out_dir / "logs" / f"{name}.{mode}.stderr.txt"
            worker = run_dsp(args, onnx_path, prompt[0].tolist(), mode, dsp_peers, logs)
            record["dsp_versions"] = worker["versions"]
            record["peers"].update(worker["rows"])
        except Exception as exc:  # noqa: BLE001  (one failing mode must not hide the others)
            for peer in dsp_peers:
                record["peers"][row_name(peer, mode)] = {
                    "mode": mode,
                    "peer": peer,
                    "error": f"{type(exc).__name__}: {exc}",
                }
        for peer in dsp_peers:
            finish_row(record["peers"][row_name(peer, mode)])
        record["wall_seconds"][f"dsp[{mode}]"] = time.perf_counter() - t0
        saved(record)
    t0 = time.perf_counter()
    model = build(torch, name, dtype, device, args.torch_attn)
    record["config"] = describe(model)
    prompt = prompt.to(device)
    runs = {
        "hf_eager": lambda: peer_hf_eager(torch, model, prompt, args.new_tokens, args, cuda),
        "static_cudagraph": lambda: peer_static_cudagraph(torch, model, prompt, args, device),
        "compile_reduce_overhead": lambda: peer_compile(torch, model, prompt, args, device),
    }
    record["wall_seconds"]["build"] = time.perf_counter() - t0
    for peer, fn in runs.items():
        if peer not in peers:
            continue
        log(f"{name}: {peer}")
        t0 = time.perf_counter()
        try:
            record["peers"][peer] = fn()
        except Exception as exc:  # noqa: BLE001
            record["peers"][peer] = {"error": f"{type(exc).__name__}: {exc}"}
        finish_row(record["peers"][peer])
        record["wall_seconds"][peer] = time.perf_counter() - t0
        saved(record)
    record["floor"] = floor(torch, model, device)
    compare_rows(record)
    try:
        explain_mismatches(torch, model, prompt, record)
    except Exception as exc:  # noqa: BLE001  (a diagnostic: it never costs the rows)
        record["mismatch_check"] = {"error": f"{type(exc).__name__}: {exc}"}
    record["wall_seconds"]["model"] = time.perf_counter() - t_model
    return record  # the models go with this frame (the next model has the GPU's memory)


def _cell(value: Any, fmt: str, width: int) -> str:
    return f"{value:>{width}{fmt}}" if isinstance(value, int | float) else f"{'-':>{width}}"


def print_table(record: dict[str, Any]) -> None:
    """One row per peer: lateSteady (median), ms/token, kernels and GPU µs per token, ratios, token match."""
    rep = f"median of {record['repeats']} runs, {REFERENCE} {record['hf_repeats']}"
    print(
        f"\n{record['model']} ({record['dtype']}, {record['device']}, {record['prompt_tokens']}-token prompt, "
        f"{record['new_tokens']} new tokens, {rep})"
    )
    if record["new_tokens"] < 256:
        print(f"  note: runs of {record['new_tokens']} tokens; lateSteady wants runs of >= 256")
    head = f"{'row':<26}{'lateSteady':>11}{'ms/tok':>8}{'kern/tok':>10}{'GPU us/tok':>11}"
    print(head + f"{'x compile':>10}{'x floor':>9}{'=HF':>6}  backends")
    for peer, entry in record["peers"].items():
        if "error" in entry:
            print(f"{peer:<26}  error: {entry['error'][:100]}")
            continue
        rate = entry.get("metrics", {}).get("effective")
        backends = ",".join(entry.get("resolved_backends", [])) or ""
        print(
            f"{peer:<26}"
            + _cell(rate, ".1f", 11)
            + _cell(1e3 / rate if rate else None, ".3f", 8)
            + _cell(entry.get("kernels_per_token"), ".1f", 10)
            + _cell(entry.get("gpu_us_per_token"), ".1f", 11)
            + _cell(entry.get("vs_compile"), ".2f", 9)
            + ("x" if entry.get("vs_compile") else " ")
            + _cell(entry.get("vs_floor"), ".3f", 8)
            + ("x" if entry.get("vs_floor") else " ")
            + _cell(entry.get("token_match_vs_hf"), ".2f", 6)
            + f"  {backends}"
        )
    fl = record.get("floor", {}).get("tokens_per_s")
    print(f"{'floor (weights/bandwidth)':<26}" + _cell(fl, ".1f", 11))
    check = record.get("mismatch_check", {})
    for peer, m in check.get("rows", {}).items():
        print(
            f"{peer}: first token unlike HF's at step {m['step']}; the fp32 model's top-2 gap there is "
            f"{m['fp32_top2_gap']:.4f}, its choice: {m['fp32_choice']} (row - HF logit "
            f"{m['fp32_logit_row_token_minus_hf_token']:+.4f})"
        )
        if "tokens_equal_fp32_choice" in m:
            print(
                f"{peer}: its own tokens equal the fp32 model's teacher-forced choice at "
                f"{m['tokens_equal_fp32_choice']:.2%} of steps (mean fp32 logit regret {m['mean_fp32_regret']:.4f})"
            )
    if "hf_tokens_equal_fp32_choice" in check:
        share = check["hf_tokens_equal_fp32_choice"]
        regret = check.get("hf_mean_fp32_regret")
        tail = f" (mean fp32 logit regret {regret:.4f})" if regret is not None else ""
        print(f"HF's tokens equal the fp32 model's teacher-forced choice at {share:.2%} of steps{tail}")
    if "reference_distinct_tokens" in record:
        print(f"{REFERENCE} produced {record['reference_distinct_tokens']} distinct tokens")
    reasons = {e.get("kernels_reason") for e in record["peers"].values() if e.get("kernels_reason")}
    for reason in sorted(r for r in reasons if r):
        print(f"kernels/token not counted: {reason[:160]}")
    for peer, entry in record["peers"].items():
        summary = entry.get("kernels", {})
        if summary.get("top_by_count"):
            top = ", ".join(f"{t['name'][:40]} {t['per_token']:.0f}" for t in summary["top_by_count"][:5])
            hot = ", ".join(f"{t['name'][:40]} {t['us_per_token']:.0f}us" for t in summary["top_by_time"][:3])
            print(f"  {peer}: per token, most launched: {top}; most time: {hot}")
        host = entry.get("host_launch_us_per_token")
        if host is not None:
            print(f"  {peer}: host time issuing decode steps {host:.1f} us/token")


def summary_of(record: dict[str, Any]) -> dict[str, Any]:
    """The compact per-row figures of one model (summary.json)."""
    keys = (
        "kernels_per_token",
        "gpu_us_per_token",
        "gpu_busy_us_per_token",
        "vs_compile",
        "vs_floor",
        "token_match_vs_hf",
        "first_mismatch_vs_hf",
    )
    rows: dict[str, Any] = {}
    for peer, e in record["peers"].items():
        if "error" in e:
            rows[peer] = {"error": e["error"]}
            continue
        rows[peer] = {**e.get("metrics", {}), **{k: e.get(k) for k in keys}}
        if "resolved_backends" in e:
            rows[peer]["resolved_backends"] = e["resolved_backends"]
        if "kernels_reason" in e:
            rows[peer]["kernels_reason"] = e["kernels_reason"]
    return rows | {"floor_tokens_per_s": record.get("floor", {}).get("tokens_per_s")}


def write_results(args: argparse.Namespace, argv: list[str] | None, out_dir: Path, records: list[Any]) -> None:
    """summary.json (figures only) and decode_gpu.json (meta, summary, records without per-step data)."""
    summary = {r["model"]: summary_of(r) for r in records}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    light = ("step_seconds", "tokens")  # the per-model files keep them
    results = {
        **meta(argv),
        "setup": f"batch 1, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
        f"{'sampled (' + args.sampling + ', seed 0)' if args.sampling else 'greedy'}, {args.dtype}, "
        f"random weights (seed 1234; Llama init std {LLAMA_INIT}); figures: median of {args.repeats} timed runs "
        f"({REFERENCE}: {args.hf_repeats}); kernels over a {args.profile_tokens}-token steady window "
        "(torch.profiler CUDA activity)",
        "summary": summary,
        "records": [
            {**r, "peers": {p: {k: v for k, v in e.items() if k not in light} for p, e in r["peers"].items()}}
            for r in records
        ],
    }
    (out_dir / "decode_gpu.json").write_text(json.dumps(results, indent=2) + "\n")


@dataclass
class _Paths:
    """Where ``--trace-dir`` puts each torch row's gzipped Chrome trace (None: not kept)."""

    trace_dir: str | None
    model: str = ""

    def __call__(self, row: str) -> Path | None:
        return Path(self.trace_dir) / f"{self.model}.{row}.json.gz" if self.trace_dir else None


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line (also the DSP worker's)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-124m,llama-1b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "fp32", "bf16"])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--peers", default="dsp_block,dsp_step,hf_eager,static_cudagraph,compile_reduce_overhead")
    p.add_argument(
        "--modes",
        "--mode",
        dest="modes",
        default="auto",
        help="DSP execution modes, comma-separated (e.g. auto,cuda_graphs,triton): a dsp_block/dsp_step row pair each",
    )
    p.add_argument("--block-size", type=int, default=8, help="DSP decode steps per host call")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row (median); hf_eager: --hf-repeats")
    p.add_argument("--hf-repeats", type=int, default=1, help="timed runs of hf_eager (slow: one by default)")
    p.add_argument(
        "--profile-tokens", type=int, default=16, help="decode tokens in each row's kernel-count window (0: none)"
    )
    p.add_argument("--trace-dir", default=None, help="keep each row's profiler trace (gzipped Chrome JSON) here")
    p.add_argument(
        "--sampling",
        default="",
        help="DSP rows only: sample with e.g. temperature=0.8,top_k=50,top_p=0.9 (seed 0) instead of greedy",
    )
    p.add_argument("--export-attn", default="eager", help="attention of the ONNX export (eager: opset-18 ops)")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--torch-attn", default="sdpa", help="attention of the torch peers")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--dsp-python", default=sys.executable, help="python of the environment with dsp installed")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for each DSP worker (one per mode)")
    p.add_argument("--onnx-dir", default=None, help="where the exports go and are reused from (default: OUT/onnx)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_gpu"))
    p.add_argument(
        "--tiny",
        action="store_true",
        help=f"CPU smoke run: {TINY_MODELS}, fp32, 8-token prompt, 24 tokens, 2 repeats, 8-token kernel window",
    )
    p.add_argument("--dry-run", action="store_true", help="parse arguments, print the plan, run nothing")
    p.add_argument("--dsp-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dsp-peers", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-name", default="model", help=argparse.SUPPRESS)  # the worker's trace file names
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)  # KV room: max(new tokens, kernel run)
    return p, p.parse_args(argv)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Validate the driver's arguments (clear errors), fill the derived ones; returns the models."""
    if args.tiny:
        args.models, args.dtype, args.prompt_len, args.new_tokens = TINY_MODELS, "fp32", 8, 24
        args.repeats, args.profile_tokens = min(args.repeats, 2), min(args.profile_tokens, 8)
        args.device = args.device or "cpu"
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    args.mode_list = [m.strip().lower() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list:
        p.error("--modes is empty: give at least one DSP execution mode, e.g. auto")
    with contextlib.suppress(ImportError):  # validated where dsp is importable; else the worker says
        from dsp_core.backends.modes import GraphExecutionMode

        for mode in args.mode_list:
            try:
                GraphExecutionMode.parse(mode)
            except Exception as exc:  # noqa: BLE001
                p.error(f"--modes: {exc}")
    known = {*DSP_PEERS, *TORCH_PEERS}
    bad = [x for x in args.peers.split(",") if x and x not in known]
    if bad:
        p.error(f"unknown peer {bad[0]!r}; known: {', '.join(sorted(known))}")
    for name in ("repeats", "hf_repeats", "new_tokens", "prompt_len", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile_tokens < 0:
        p.error(f"--profile-tokens must be >= 0, got {args.profile_tokens}")
    runs = [profile_window(k, args.profile_tokens)[2] for k in (1, args.block_size)] if args.profile_tokens else []
    args.length = max([args.new_tokens, *runs])
    return models


def main(argv: list[str] | None = None) -> int:
    """Parse, run every model, write JSON, print tables."""
    p, args = parse(argv)
    if args.dsp_worker:
        return dsp_worker(args)
    models = check_args(p, args)
    if args.dry_run:
        hidden = ("dsp_worker", "prompt_ids", "dsp_peers", "model_name")
        print(json.dumps({k: v for k, v in vars(args).items() if k not in hidden}, indent=2))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    paths = _Paths(args.trace_dir)
    args.trace_path = paths

    def saved(record: dict[str, Any]) -> None:  # after each row: a cut-off run keeps what it has
        partial = json.loads(json.dumps(record))
        for entry in partial["peers"].values():
            entry.pop("runs_step_seconds", None)
        partial.setdefault("floor", {})
        write_results(args, argv, out_dir, [*records, partial])

    for name in models:
        paths.model = name
        log(f"{name}: start")
        record = bench_model(args, name, out_dir, saved)
        records.append(record)
        print_table(record)
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        write_results(args, argv, out_dir, records)
        log(f"{name}: done in {record['wall_seconds']['model']:.0f} s")
    print(f"\nJSON written under {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
