"""Decode benchmark: DSP AUTO against torch peers on GPT-2 124M / 774M (fp16, batch 1, greedy).

Per model (random weights, fixed seed), in one run:

- ``dsp_block``: the ONNX export of the model (recipe of scripts/make_fixtures.py) through
  ``dsp_core.llm.GenerationPipeline`` in AUTO mode with ``block_capture=True``: K greedy
  decode steps as one plan, one replay (one graph launch on the GPU) per K tokens (run in
  a worker process, so the DSP environment may differ from the torch one: ``--dsp-python``);
- ``dsp_step``: the same pipeline with ``block_capture=False``: one replay per token, the
  host reading tokens once per block of K;
- ``hf_eager``: transformers ``generate`` (dynamic cache, no compile), timed per token by a
  streamer;
- ``static_cudagraph``: the same model with a ``StaticCache``, one decode step captured by
  hand in a ``torch.cuda.CUDAGraph`` and replayed per token;
- ``compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")`` of a hand-written
  StaticCache decode step, ``torch.compiler.cudagraph_mark_step_begin()`` each step;
- ``floor``: weight bytes / measured device copy bandwidth (every token reads every weight
  once): an upper bound on tokens/s, not a run.

Each peer reports overall / decode (step >= 1) / steady (step >= 3) / lateSteady
(step >= 20) tokens/s (dsp_core.llm.metrics' definitions); JSON goes under ``--out``, and a
table with DSP's ratio to each peer is printed.

On the GPU image (torch 2.11, transformers 5.x, dsp + the CUDA plugin installed):

    python benchmarks/decode_gpu.py --out benchmarks/results/decode_gpu

Here, without a GPU, ``--tiny`` runs every code path on the CPU with a 2-layer GPT-2
(fp32, short prompt; CUDA-graph capture is replaced by eager calls of the same step and
``torch.compile`` may fall back to its eager backend, both noted in the JSON):

    .fixture-venv/bin/python benchmarks/decode_gpu.py --tiny --dsp-python .venv/bin/python --out /tmp/decode
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name -> GPT2Config overrides
    "gpt2-124m": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-774m": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_inner": 128},
}
THRESHOLDS = {"overall": 0, "decode": 1, "steady": 3, "lateSteady": 20}
DSP_PEERS = {"dsp_block": True, "dsp_step": False}  # peer -> GenerationPipeline(block_capture=...)


# -- metrics (the same definitions as dsp_core.llm.metrics, without importing dsp) ---------
def rates(step_seconds: list[float]) -> dict[str, Any]:
    """The four tokens/s metrics and the effective one from per-step seconds."""
    out: dict[str, Any] = {}
    for name, first in THRESHOLDS.items():
        times = step_seconds[first:]
        out[name] = len(times) / sum(times) if times and sum(times) > 0 else None
    best = next((n for n in ("lateSteady", "steady", "decode", "overall") if out[n] is not None), "overall")
    out["effective"] = out[best]
    out["effective_metric"] = best
    return out


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
    """A randomly initialised GPT2LMHeadModel (seed 1234) with no EOS (runs the full length)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(**MODELS[name], n_positions=1024, bos_token_id=None, eos_token_id=None, attn_implementation=attn)
    return GPT2LMHeadModel(cfg).eval().to(device=device, dtype=dtype)


def cache_kw(model: Any) -> str:
    """The forward's cache keyword (transformers renamed past_key_values -> cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def export_onnx(torch: Any, model: Any, path: Path, opset: int) -> Path:
    """Export with the fixtures' recipe: flat KV inputs/outputs, every dim dynamic, dynamo."""
    from transformers import DynamicCache

    cfg = model.config
    layers, heads, dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
    kw = cache_kw(model)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, past: list[Any]) -> Any:
            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(layers)], config=cfg)
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{kw: cache},
            )
            kv = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
            return (out.logits, *[t for layer in kv.layers for t in (layer.keys, layer.values)])

    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    batch, seq, past_len = 2, 3, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64, device=dev)
    pos = torch.arange(past_len, past_len + seq, device=dev).unsqueeze(0).repeat(batch, 1)
    past = [torch.randn(batch, heads, past_len, dim, generator=g).to(dev, dt) for _ in range(2 * layers)]
    names_in = ["input_ids", "attention_mask", "position_ids"]
    names_out = ["logits"]
    for i in range(layers):
        names_in += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        names_out += [f"present.{i}.key", f"present.{i}.value"]
    dyn = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "past": [{0: "batch", 2: "past"} for _ in range(2 * layers)],
    }
    with torch.no_grad():
        prog = torch.onnx.export(
            Wrapper(),
            (ids, mask, pos, past),
            None,
            input_names=names_in,
            output_names=names_out,
            dynamic_shapes=dyn,
            opset_version=opset,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    prog.save(str(path), external_data=True)  # 774M in fp16 is near protobuf's 2 GB limit
    return path


# -- peers -----------------------------------------------------------------------------------
def peer_hf_eager(torch: Any, model: Any, prompt: Any, n: int) -> dict[str, Any]:
    """transformers generate, timed per token by a streamer (each put() follows a host copy)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run() -> tuple[list[float], list[int]]:
        clock = Clock()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
        stamps = [start] + clock.times[1:]  # the first put() is the prompt
        return [b - a for a, b in zip(stamps, stamps[1:])], out[0, prompt.shape[1] :].tolist()

    run()  # warm-up
    seconds, tokens = run()
    return {"step_seconds": seconds, "tokens": tokens}


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
    torch: Any, dec: StaticDecoder, prompt: Any, n: int, device: str, step_fn: Any, mark_step: bool
) -> dict[str, Any]:
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
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            nxt = step_fn(token, position)
            token.copy_(nxt)
            tokens[i] = token[0, 0]
            position += 1
            clock.mark()
    return {"step_seconds": clock.seconds(), "tokens": tokens.tolist()}


def peer_static_cudagraph(torch: Any, model: Any, prompt: Any, n: int, device: str) -> dict[str, Any]:
    """One decode step captured in a torch.cuda.CUDAGraph, replayed per token (eager on a CPU)."""
    dec = StaticDecoder(torch, model, prompt.shape[1] + n + 1)
    if not device.startswith("cuda"):
        result = _static_run(torch, dec, prompt, n, device, dec.step, mark_step=False)
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

    return _static_run(torch, dec, prompt, n, device, replay, mark_step=False)


def peer_compile(torch: Any, model: Any, prompt: Any, n: int, device: str, backend: str) -> dict[str, Any]:
    """torch.compile(mode="reduce-overhead") of the StaticCache step; cudagraph_mark_step_begin each step."""
    dec = StaticDecoder(torch, model, prompt.shape[1] + n + 1)
    note = ""
    try:
        step = torch.compile(dec.step, mode="reduce-overhead", backend=backend)
        _static_run(torch, dec, prompt, min(n, 4), device, step, mark_step=True)  # compiles
    except Exception as exc:  # noqa: BLE001  (no C++ toolchain on a CPU box: exercise the path eagerly)
        if device.startswith("cuda"):
            raise
        note = f"backend {backend!r} failed on the CPU ({type(exc).__name__}); used backend 'eager'"
        torch._dynamo.reset()
        step = torch.compile(dec.step, backend="eager")
    _static_run(torch, dec, prompt, n, device, step, mark_step=True)  # warm
    result = _static_run(torch, dec, prompt, n, device, step, mark_step=True)
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
def run_dsp(args: argparse.Namespace, onnx_path: Path, prompt: list[int], block_capture: bool) -> dict[str, Any]:
    """Run the DSP pipeline in ``--dsp-python`` (a worker invocation of this script)."""
    cmd = [
        args.dsp_python,
        str(Path(__file__).resolve()),
        "--dsp-worker",
        str(onnx_path),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--new-tokens",
        str(args.new_tokens),
        "--mode",
        args.mode,
        "--block-size",
        str(args.block_size),
        "--block-capture",
        "on" if block_capture else "off",
        "--sampling",
        args.sampling,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"DSP worker failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def dsp_worker(args: argparse.Namespace) -> int:
    """Inside the DSP environment: warm run, timed run, one JSON line on stdout."""
    import numpy as np

    from dsp_core.llm import GenerationPipeline

    prompt = np.asarray([int(t) for t in args.prompt_ids.split(",")], dtype=np.int64)
    start = time.perf_counter()
    block_capture = args.block_capture == "on"
    pipe = GenerationPipeline(
        args.dsp_worker,
        max_length=prompt.size + args.new_tokens,
        mode=args.mode,
        block_size=args.block_size,
        block_capture=block_capture,
    )
    pipe.generate(prompt, args.new_tokens, sampling=_sampling(args.sampling))  # warm-up: compile, freeze, capture
    setup = time.perf_counter() - start
    launch = _time_host_launches()
    sampling = _sampling(args.sampling)
    result = pipe.generate(prompt, args.new_tokens, sampling=sampling)
    print(
        json.dumps(
            {
                "step_seconds": list(result.metrics.step_seconds),
                "tokens": result.token_list(),
                "setup_seconds": setup,
                "resolved_backends": pipe.decode_model.resolved_backends(),
                "decode_phase": pipe.decode_model.dsp.phase.name,
                "decode_state": pipe.decoder(1).xp.__name__,  # cupy: KV buffers and state on the device
                "decode_loop": (
                    f"one replay of a {args.block_size}-step plan per {args.block_size} tokens"
                    if block_capture
                    else f"one graph replay per token, tokens read once per block of {args.block_size}"
                ),
                "counters": pipe.decode_model.dsp.runtime.counters(),
                # host time spent issuing the decode steps (before the once-per-block read)
                "host_launch_us_per_token": 1e6 * sum(launch) / max(args.new_tokens - 1, 1),
                "block_counters": {
                    "x".join(map(str, key)): m.dsp.runtime.counters() for key, m in pipe._blocks.items()
                },
                "block_backends": {"x".join(map(str, key)): m.resolved_backends() for key, m in pipe._blocks.items()},
            }
        )
    )
    return 0


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
    for module in ("torch", "transformers", "cupy", "numpy", "onnx"):
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


def bench_model(args: argparse.Namespace, name: str, out_dir: Path) -> dict[str, Any]:
    """Every peer on one model; returns the JSON record."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    record: dict[str, Any] = {
        "model": name,
        "device": device,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "peers": {},
    }
    g = torch.Generator().manual_seed(0)
    vocab = MODELS[name].get("vocab_size", 50257)
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=g)
    peers = [p for p in args.peers.split(",") if p]
    if args.sampling:  # the torch peers here decode greedily: compare DSP with itself
        peers = [p for p in peers if p in DSP_PEERS]
    onnx_path = Path(args.onnx_dir or out_dir / "onnx") / f"{name}-{args.dtype}" / "model.onnx"
    for peer, block_capture in DSP_PEERS.items():
        if peer not in peers:
            continue
        try:
            if not onnx_path.exists():
                export_model = build(torch, name, dtype, device, args.export_attn)
                export_onnx(torch, export_model, onnx_path, args.opset)
                del export_model
            record["peers"][peer] = run_dsp(args, onnx_path, prompt[0].tolist(), block_capture)
        except Exception as exc:  # noqa: BLE001  (one failing peer must not hide the others)
            record["peers"][peer] = {"error": f"{type(exc).__name__}: {exc}"}
    model = build(torch, name, dtype, device, args.torch_attn)
    prompt = prompt.to(device)
    runs = {
        "hf_eager": lambda: peer_hf_eager(torch, model, prompt, args.new_tokens),
        "static_cudagraph": lambda: peer_static_cudagraph(torch, model, prompt, args.new_tokens, device),
        "compile_reduce_overhead": lambda: peer_compile(
            torch, model, prompt, args.new_tokens, device, args.compile_backend
        ),
    }
    for peer, fn in runs.items():
        if peer not in peers:
            continue
        try:
            record["peers"][peer] = fn()
        except Exception as exc:  # noqa: BLE001
            record["peers"][peer] = {"error": f"{type(exc).__name__}: {exc}"}
    for entry in record["peers"].values():
        if "step_seconds" in entry:
            entry["metrics"] = rates(entry["step_seconds"])
    record["floor"] = floor(torch, model, device)
    ref = record["peers"].get("hf_eager", {}).get("tokens")
    for entry in record["peers"].values():
        if ref and "tokens" in entry:
            entry["token_match_vs_hf"] = sum(a == b for a, b in zip(entry["tokens"], ref)) / max(len(ref), 1)
    return record


def print_table(record: dict[str, Any]) -> None:
    """One row per peer: the four metrics, effective, the best DSP row's ratio to it."""
    dsp = max((record["peers"].get(p, {}).get("metrics", {}).get("effective") or 0.0 for p in DSP_PEERS), default=0.0)
    print(
        f"\n{record['model']} ({record['dtype']}, {record['device']}, {record['prompt_tokens']}-token prompt, "
        f"{record['new_tokens']} new tokens), tokens/s"
    )
    cols = ["overall", "decode", "steady", "lateSteady", "effective"]
    print(f"{'peer':<26}" + "".join(f"{c:>12}" for c in cols) + f"{'DSP/peer':>10}")
    for peer, entry in record["peers"].items():
        if "error" in entry:
            print(f"{peer:<26}  error: {entry['error'][:90]}")
            continue
        m = entry["metrics"]
        ratio = f"{dsp / m['effective']:.2f}x" if dsp and m["effective"] else "-"
        print(f"{peer:<26}" + "".join(f"{m[c]:>12.1f}" if m[c] else f"{'-':>12}" for c in cols) + f"{ratio:>10}")
    fl = record["floor"]["tokens_per_s"]
    print(f"{'floor (weights/bandwidth)':<26}" + f"{'':>48}{fl:>12.1f}" + (f"{dsp / fl:>10.2f}x" if dsp else ""))
    for peer in DSP_PEERS:
        host = record["peers"].get(peer, {}).get("host_launch_us_per_token")
        if host is not None:
            print(f"{peer}: host time issuing decode steps {host:.1f} us/token")


def write_results(args: argparse.Namespace, argv: list[str] | None, out_dir: Path, records: list[Any]) -> None:
    """summary.json (metrics only) and decode_gpu.json (meta, summary, records without per-step data)."""
    summary = {
        r["model"]: {peer: e.get("metrics", {"error": e.get("error")}) for peer, e in r["peers"].items()}
        | {"floor_tokens_per_s": r["floor"]["tokens_per_s"]}
        for r in records
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    light = ("step_seconds", "tokens")  # the per-model files keep them
    results = {
        **meta(argv),
        "setup": f"batch 1, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
        f"{'sampled (' + args.sampling + ', seed 0)' if args.sampling else 'greedy'}, {args.dtype}, "
        "random weights (seed 1234)",
        "summary": summary,
        "records": [
            {**r, "peers": {p: {k: v for k, v in e.items() if k not in light} for p, e in r["peers"].items()}}
            for r in records
        ],
    }
    (out_dir / "decode_gpu.json").write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Parse, run every model, write JSON, print tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-124m,gpt2-774m", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "fp32", "bf16"])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--peers", default="dsp_block,dsp_step,hf_eager,static_cudagraph,compile_reduce_overhead")
    p.add_argument("--mode", default="auto", help="DSP execution mode")
    p.add_argument("--block-size", type=int, default=8, help="DSP decode steps per host call")
    p.add_argument("--block-capture", default="on", choices=["on", "off"], help=argparse.SUPPRESS)
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
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the DSP worker")
    p.add_argument("--onnx-dir", default=None, help="where the exports go (default: OUT/onnx)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_gpu"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny GPT-2, fp32, 8-token prompt, 24 tokens")
    p.add_argument("--dry-run", action="store_true", help="parse arguments, print the plan, run nothing")
    p.add_argument("--dsp-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dsp_worker:
        return dsp_worker(args)
    if args.tiny:
        args.models, args.dtype, args.prompt_len, args.new_tokens = "tiny", "fp32", 8, 24
        args.device = args.device or "cpu"
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    if args.dry_run:
        print(json.dumps({k: v for k, v in vars(args).items() if k not in ("dsp_worker", "prompt_ids")}, indent=2))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for name in models:
        record = bench_model(args, name, out_dir)
        records.append(record)
        with contextlib.suppress(KeyError):
            print_table(record)
        slim = json.loads(json.dumps(record))
        (out_dir / f"{name}.json").write_text(json.dumps(slim, indent=2) + "\n")
        write_results(args, argv, out_dir, records)  # after each model: a cut-off run keeps what it has
    print(f"\nJSON written under {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
