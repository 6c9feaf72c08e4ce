"""Non-LLM models on one GPU: DSP AUTO against torch eager, a hand-captured CUDA graph and torch.compile.

Models (random weights, built here from configs with plain torch: no downloads, no
transformers or torchvision needed):

- ``bert-128`` / ``bert-512``: a BERT-base encoder (12 layers, hidden 768, 12 heads, erf GELU),
  sequence 128 or 512, fed ``input_ids`` and ``attention_mask``;
- ``minilm``: a MiniLM-L6-size sentence encoder (6 layers, hidden 384) with mean pooling, seq 128;
- ``resnet50``: ResNet-50 (bottleneck blocks, batch norm in eval mode), 224x224;
- ``vit-s``: a small ViT (ViT-S/16: 12 layers, hidden 384, 6 heads), 224x224.

Each in fp16 and fp32, batch 1 and 8. Per configuration, the median latency over
``--steps`` calls (after warm-up, the device synchronised after each call) of:

- ``dsp``: ``dsp.compile(onnx, mode="auto", outputs_on_device=True)`` fed CuPy arrays
  (the model exported with ``torch.onnx.export``), with its plan phase and its gaps;
- ``torch_eager``; ``torch_graph``: the forward captured by hand in a ``torch.cuda.CUDAGraph``;
- ``torch_compile``: ``torch.compile(mode="reduce-overhead")`` (``--no-compile`` skips it);

and the max abs difference of DSP's output from torch eager's. For DSP and the torch graph also
the kernels a call and their busy time (torch.profiler; the copies and memsets a call apart, in
the JSON's ``other_per_call``: a graph node that is not a kernel may cost its launch more) and the
host time of one call from an idle GPU to its return (``host_us``, median): a wall time near the
host time plus the kernels' busy time means the host work and the GPU work do not overlap, and the host time is what to
cut. For DSP also the same model through an IO binding (``bound``: ``model.bind``, the feeds
written into the plan's buffers, a call with no copy in or out, as the torch graph is timed),
its captured graphs launched alone (``graphs_alone_ms``: the call less this is
what DSP adds around them) and where its host time goes (``host_profile``, cProfile's top
functions in µs a call, in the JSON: which functions, not how long; cProfile put 5-25x the
directly timed cost on C calls such as ``Graph.launch``, benchmarks/results/gpu_2026-12-03m/).
A contender that fails is recorded with its error; the others still run.

Run on the GPU machine (python 3.12, torch, cupy; no network):

    python3 benchmarks/models_gpu.py --out $OUT/models_gpu.json
    python3 benchmarks/models_gpu.py --models bert-128,resnet50 --dtypes fp16 --batches 1 --no-compile
    python3 benchmarks/models_gpu.py --models resnet50 --dtypes fp32 --fp32-math tf32

fp32 rows compare like with like: exact fp32 on both sides by default (torch's cuDNN runs TF32
unless told not to; DSP's contract is exact), or TF32 on both with ``--fp32-math tf32``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MODELS = ("bert-128", "bert-512", "minilm", "resnet50", "vit-s")


def log(msg: str) -> None:
    print(f"[models_gpu] {msg}", flush=True)


# -- the models, in plain torch -------------------------------------------------------------------
def _torch() -> Any:
    import torch

    return torch


def attention(qkv: Any, heads: int, bias: Any = None) -> Any:
    """Scaled dot-product attention from a fused [b, s, 3h] projection, written out (as exporters see it)."""
    b, s, three_h = qkv.shape
    hidden = three_h // 3
    q, k, v = qkv.view(b, s, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads)
    if bias is not None:
        scores = scores + bias
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hidden)


def make_encoder(layers: int, hidden: int, heads: int, ffn: int, vocab: int, max_len: int, pool: bool) -> Any:
    """A BERT-style encoder: embeddings, post-LN blocks with erf GELU; ``pool``: masked mean of the last states."""
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
            self.fc1 = nn.Linear(hidden, ffn)
            self.fc2 = nn.Linear(ffn, hidden)
            self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: Any, bias: Any) -> Any:
            x = self.ln1(x + self.out(attention(self.qkv(x), heads, bias)))
            h = self.fc1(x)
            h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))  # BERT's erf GELU, as exported
            return self.ln2(x + self.fc2(h))

    class Encoder(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(max_len, hidden)
            self.types = nn.Embedding(2, hidden)
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            s = input_ids.shape[1]
            pos = torch.arange(s, device=input_ids.device)
            x = self.words(input_ids) + self.positions(pos)[None] + self.types(torch.zeros_like(input_ids))
            x = self.ln(x)
            mask = attention_mask[:, None, None, :].to(x.dtype)
            bias = (1.0 - mask) * torch.finfo(x.dtype).min
            for block in self.blocks:
                x = block(x, bias)
            if not pool:
                return x
            m = attention_mask[..., None].to(x.dtype)
            return (x * m).sum(1) / m.sum(1).clamp(min=1.0)

    return Encoder()


def make_resnet50(classes: int = 1000) -> Any:
    """ResNet-50: stem, bottleneck stages (3, 4, 6, 3), global pool, classifier."""
    torch = _torch()
    nn = torch.nn

    class Bottleneck(nn.Module):  # type: ignore[misc]
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: Any) -> Any:
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[Any] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
    ]  # fmt: skip
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def make_vit(layers: int = 12, hidden: int = 384, heads: int = 6, patch: int = 16, image: int = 224) -> Any:
    """ViT-S/16: patch embedding (a strided conv), class token, pre-LN blocks (erf GELU), head."""
    torch = _torch()
    nn = torch.nn
    n_patches = (image // patch) ** 2

    class Block(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.ln2 = nn.LayerNorm(hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

        def forward(self, x: Any) -> Any:
            x = x + self.out(attention(self.qkv(self.ln1(x)), heads))
            return x + self.mlp(self.ln2(x))

    class ViT(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Conv2d(3, hidden, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, n_patches + 1, hidden) * 0.02)
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
            self.ln = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, 1000)

        def forward(self, x: Any) -> Any:
            x = self.embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.head(self.ln(self.blocks(x))[:, 0])

    return ViT()


def build(name: str) -> tuple[Any, Callable[[int, Any], dict[str, Any]]]:
    """(module, feeds(batch, device) -> name -> torch tensor) for model ``name``."""
    torch = _torch()
    torch.manual_seed(0)
    if name.startswith("bert"):
        seq = int(name.split("-")[1])
        return make_encoder(12, 768, 12, 3072, 30522, 512, pool=False), _token_feeds(seq, 30522)
    if name == "minilm":
        return make_encoder(6, 384, 12, 1536, 30522, 512, pool=True), _token_feeds(128, 30522)
    if name == "resnet50":
        return make_resnet50(), _image_feeds(224)
    if name == "vit-s":
        return make_vit(), _image_feeds(224)
    raise SystemExit(f"unknown model {name!r}; models: {', '.join(MODELS)}")


def _token_feeds(seq: int, vocab: int) -> Callable[[int, Any], dict[str, Any]]:
    def feeds(batch: int, device: Any) -> dict[str, Any]:
        torch = _torch()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[:, seq - seq // 8 :] = 0  # some padding, so the mask matters
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    return feeds


def _image_feeds(size: int) -> Callable[[int, Any], dict[str, Any]]:
    def feeds(batch: int, device: Any) -> dict[str, Any]:
        torch = _torch()
        g = torch.Generator().manual_seed(1)
        return {"pixels": torch.randn(batch, 3, size, size, generator=g).to(device)}

    return feeds


# -- contenders -------------------------------------------------------------------------------------
def median_ms(fn: Callable[[], Any], steps: int, warmup: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``fn`` (synchronised after each call), in ms."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def host_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """Host microseconds one call of ``fn`` takes from an idle GPU to its return (the GPU waited
    for before each call, not after it), the median of ``calls``: the time the caller's thread
    spends in the call, without a launch queue that fills and makes the host wait for the GPU."""
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


HOST_CALLS = 100
PROFILE_TOP = 15


def graphs_alone_ms(runtime: Any, steps: int, sync: Callable[[], None]) -> float | None:
    """Median ms of launching each island's captured graph alone, on its stream (no staging, no
    copies, no Python of DSP's): the call's time less this is what DSP adds around its graphs."""
    graphs = [
        (u.compiled._graph, u.compiled._st["stream"])
        for u in runtime.units
        if getattr(u.compiled, "_graph", None) is not None and getattr(u.compiled, "_st", None)
    ]
    if not graphs:
        return None

    def launch() -> None:
        for graph, stream in graphs:
            graph.launch(stream)

    return median_ms(launch, steps, 3, sync)


def host_profile(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> list[dict[str, Any]]:
    """The functions ``fn`` spends its host time in (cProfile over ``calls`` calls, each from an
    idle GPU, the wait outside the profile, as ``host_us`` measures): the top ``PROFILE_TOP`` by own
    time, in µs a call. Calls back to back would fill the launch queue, and the host's wait for
    it would show as the time of whichever call blocked (a graph's launch)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    for _ in range(calls):
        sync()
        profile.enable()
        fn()
        profile.disable()
    sync()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{Path(file).name}:{line}({func})",
            "calls_per_call": round(nc / calls, 2),
            "own_us_per_call": round(tt / calls * 1e6, 2),
            "cum_us_per_call": round(ct / calls * 1e6, 2),
        }
        for (file, line, func), (_, nc, tt, ct, _) in stats.items()
    ]
    rows.sort(key=lambda r: -r["own_us_per_call"])
    return rows[:PROFILE_TOP]


def export(module: Any, feeds: dict[str, Any], path: Path) -> str:
    """torch.onnx.export with the TorchScript exporter (as most deployed models were made), else dynamo."""
    torch = _torch()
    args = tuple(feeds.values())
    with torch.no_grad():
        try:
            torch.onnx.export(
                module, args, str(path), input_names=list(feeds), output_names=["out"], opset_version=17, dynamo=False
            )
            return "torchscript"
        except Exception as exc:  # noqa: BLE001  (the newer exporter is the fallback)
            log(f"TorchScript export failed ({type(exc).__name__}: {exc}); trying dynamo=True")
            torch.onnx.export(
                module, args, str(path), input_names=list(feeds), output_names=["out"], opset_version=18, dynamo=True
            )
            return "dynamo"


def run_dsp(path: Path, feeds: dict[str, Any], steps: int, want: np.ndarray) -> dict[str, Any]:
    import cupy as cp

    import dsp_core as dsp

    t0 = time.perf_counter()
    model = dsp.compile(str(path), mode="auto", outputs_on_device=True)
    result: dict[str, Any] = {"compile_s": round(time.perf_counter() - t0, 2), "backends": model.resolved_backends()}
    dev = {k: cp.asarray(v.detach().cpu().numpy()) for k, v in feeds.items()}
    sync = cp.cuda.Device().synchronize
    t0 = time.perf_counter()
    for _ in range(8):  # freeze, warm up, capture, settle
        out = model.run(dev)
    sync()
    result["settle_s"] = round(time.perf_counter() - t0, 2)
    got = cp.asnumpy(out["out"]).astype(np.float32)
    result["max_abs_diff_vs_torch"] = float(np.abs(got - want).max())
    result["ms"] = median_ms(lambda: model.run(dev), steps, 3, sync)
    result["host_us"] = round(host_us(lambda: model.run(dev), HOST_CALLS, sync), 1)
    result["kernels"] = _guard(lambda: kernels_of(lambda: model.run(dev)))
    runtime = model.dsp.runtime
    result["graphs_alone_ms"] = _guard(lambda: graphs_alone_ms(runtime, steps, sync))
    result["host_profile"] = _guard(lambda: host_profile(lambda: model.run(dev), HOST_CALLS, sync))
    result["bound"] = _guard(lambda: run_bound(model, dev, steps, sync, want))
    plan = runtime.plan
    result["phase"] = model.dsp.phase.name
    result["units"] = {k: sum(u.kind.value == k for u in runtime.units) for k in ("island", "gap", "eager")}
    result["gaps"] = [
        {"ops": [plan.slots[s].op for s in u.segment.slots], "reason": u.reason}
        for u in runtime.units
        if u.kind.value != "island" or u.phase.name != "REPLAYING"
    ][:20]
    result["counters"] = runtime.counters()
    return result


def run_bound(
    model: Any, dev: dict[str, Any], steps: int, sync: Callable[[], None], want: np.ndarray
) -> dict[str, Any]:
    """DSP through an IO binding (``model.bind``: the feeds written into the plan's device buffers,
    each call a replay with no copy in or out), as a torch CUDA graph is replayed by hand."""
    import cupy as cp

    binding = model.bind(dev, settle=2)
    got = cp.asnumpy(binding.run()["out"]).astype(np.float32)
    return {
        "bound": binding.bound,
        "max_abs_diff_vs_torch": float(np.abs(got - want).max()),
        "ms": median_ms(binding.run, steps, 3, sync),
        "host_us": round(host_us(binding.run, HOST_CALLS, sync), 1),
    }


def run_torch(module: Any, feeds: dict[str, Any], steps: int, no_compile: bool) -> tuple[dict[str, Any], np.ndarray]:
    torch = _torch()
    sync = torch.cuda.synchronize
    result: dict[str, Any] = {}
    args = tuple(feeds.values())
    with torch.no_grad():
        want = module(*args).float().cpu().numpy()
        result["torch_eager_ms"] = median_ms(lambda: module(*args), steps, 5, sync)
        result["torch_graph_ms"] = _guard(lambda: _torch_graph(module, args, steps))
        if not no_compile:
            result["torch_compile_ms"] = _guard(lambda: _torch_compile(module, args, steps))
    return result, want


def _torch_graph(module: Any, args: tuple[Any, ...], steps: int) -> dict[str, Any]:
    """The forward captured by hand in a CUDA graph (static inputs), replayed: median ms and its kernels."""
    torch = _torch()
    static = tuple(a.clone() for a in args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            module(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(*static)
    ms = median_ms(graph.replay, steps, 3, torch.cuda.synchronize)
    host = round(host_us(graph.replay, HOST_CALLS, torch.cuda.synchronize), 1)
    return {"ms": ms, "host_us": host, "kernels": _guard(lambda: kernels_of(graph.replay))}


def _torch_compile(module: Any, args: tuple[Any, ...], steps: int) -> dict[str, float]:
    torch = _torch()
    compiled = torch.compile(module, mode="reduce-overhead")
    t0 = time.perf_counter()
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        compiled(*args)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        compiled(*args)

    return {"ms": median_ms(step, steps, 3, torch.cuda.synchronize), "compile_s": round(compile_s, 1)}


PROFILED_CALLS = 5


def kernels_of(fn: Callable[[], Any], calls: int = PROFILED_CALLS) -> dict[str, Any]:
    """The CUDA kernels of ``calls`` calls of ``fn`` (torch.profiler's CUDA activity, which sees the
    kernels inside replayed graphs), per call: count, summed µs, busy µs, the most expensive ones."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_gpu import summarize_trace, torch_profiler

    torch.cuda.synchronize()
    prof = torch_profiler(True)
    prof.start()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    summary = summarize_trace(events, calls, "kernel", top=12)
    return {
        "per_call": summary["per_token"],
        "us_per_call": round(summary["us_per_token"], 1),
        "busy_us_per_call": round(summary["busy_us_per_token"], 1),
        # copies and memsets a call (graph nodes that are not kernels: each costs a graph's launch more)
        "other_per_call": {k: round(v / calls, 2) for k, v in sorted(summary["other_events"].items())},
        "top_by_time": [
            {"name": k["name"][:60], "per_call": k["per_token"], "us_per_call": round(k["us_per_token"], 1)}
            for k in summary["every_kernel"][:15]
        ],
    }


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (a contender that fails is recorded; the others still run)
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def bench(name: str, dtype: str, batch: int, steps: int, workdir: Path, no_compile: bool) -> dict[str, Any]:
    torch = _torch()
    module, make_feeds = build(name)
    module = module.eval().cuda()
    if dtype == "fp16":
        module = module.half()
    feeds = make_feeds(batch, "cuda")
    if dtype == "fp16":
        feeds = {k: v.half() if v.is_floating_point() else v for k, v in feeds.items()}
    result: dict[str, Any] = {"model": name, "dtype": dtype, "batch": batch}
    torch_result, want = run_torch(module, feeds, steps, no_compile)
    result.update(torch_result)
    path = workdir / f"{name}-{dtype}-b{batch}.onnx"
    t0 = time.perf_counter()
    result["exporter"] = export(module, feeds, path)
    result["export_s"] = round(time.perf_counter() - t0, 1)
    del module
    torch.cuda.empty_cache()
    result["dsp"] = _guard(lambda: run_dsp(path, feeds, steps, want))
    path.unlink(missing_ok=True)
    return result


def _ms(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['ms']:.3f}" if "ms" in value else "error"
    return f"{value:.3f}" if isinstance(value, float) else "-"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "model | dtype | batch | DSP ms | phase | gaps | torch eager | torch graph | torch.compile | max |diff| "
        "| kernels/call DSP / torch graph | kernels' busy µs DSP / torch graph | host µs/call DSP / torch graph "
        "| DSP's graphs alone ms | DSP bound ms / host µs"
    )
    lines = [head, " | ".join("---" for _ in range(15))]
    for r in rows:
        d = r.get("dsp", {})
        gaps = str(d.get("units", {}).get("gap", "-"))
        diff = f"{d['max_abs_diff_vs_torch']:.2e}" if "max_abs_diff_vs_torch" in d else "-"
        torch_cells = [_ms(r.get(k)) for k in ("torch_eager_ms", "torch_graph_ms", "torch_compile_ms")]
        graph = r.get("torch_graph_ms")
        counts = [
            f"{k['per_call']:.0f}" if isinstance(k, dict) and "per_call" in k else "-"
            for k in (d.get("kernels"), graph.get("kernels") if isinstance(graph, dict) else None)
        ]
        cells = [r["model"], r["dtype"], str(r["batch"]), _ms(d), d.get("phase", "error"), gaps, *torch_cells, diff]
        cells.append(" / ".join(counts))
        busy = [
            f"{k['busy_us_per_call']:.0f}" if isinstance(k, dict) and "busy_us_per_call" in k else "-"
            for k in (d.get("kernels"), graph.get("kernels") if isinstance(graph, dict) else None)
        ]
        cells.append(" / ".join(busy))
        hosts = [str(x.get("host_us", "-")) if isinstance(x, dict) else "-" for x in (d, graph)]
        cells.append(" / ".join(hosts))
        alone = d.get("graphs_alone_ms")
        cells.append(f"{alone:.3f}" if isinstance(alone, float) else "-")
        bound = d.get("bound")
        cells.append(f"{bound['ms']:.3f} / {bound['host_us']}" if isinstance(bound, dict) and "ms" in bound else "-")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=100, help="timed calls per contender (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compile takes minutes)")
    parser.add_argument(
        "--fp32-math",
        choices=FP32_MATH,
        default="exact",
        help="fp32 products and convolutions of both DSP and torch: exact (the default: torch's cuDNN "
        "would otherwise run TF32 while DSP's contract is exact fp32) or tf32 (both)",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "models_gpu.json"))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("models_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    set_fp32_math(args.fp32_math, torch.backends, os.environ)  # before DSP's plugins load (they read it once)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dsp-models-") as tmp:
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    log(f"{name} {dtype} batch {batch}")
                    try:
                        row = bench(name, dtype, batch, args.steps, Path(tmp), args.no_compile)
                    except Exception as exc:  # noqa: BLE001  (one configuration's failure is a row, not the end)
                        traceback.print_exc()
                        row = {"model": name, "dtype": dtype, "batch": batch, "error": f"{type(exc).__name__}: {exc}"}
                    rows.append(row)
                    log(json.dumps({k: v for k, v in row.items() if k != "dsp"}, default=str))
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    info = {**meta(), "fp32_math": args.fp32_math}
                    Path(args.out).write_text(json.dumps({"meta": info, "results": rows}, indent=1, default=str))
    print(table(rows))
    print(f"wrote {args.out}")
    return 0


FP32_MATH = ("exact", "tf32")


def set_fp32_math(mode: str, backends: Any, environ: Any) -> None:
    """fp32 math of both sides alike: torch's TF32 switches (``torch.backends``) and DSP's
    ``DSP_CUBLAS_TF32``, both on for ``tf32``, both off for ``exact``."""
    if mode not in FP32_MATH:
        raise ValueError(f"fp32 math {mode!r}: one of {', '.join(FP32_MATH)}")
    tf32 = mode == "tf32"
    backends.cuda.matmul.allow_tf32 = tf32
    backends.cudnn.allow_tf32 = tf32
    environ["DSP_CUBLAS_TF32"] = "1" if tf32 else "0"


def meta() -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }


if __name__ == "__main__":
    sys.exit(main())
