"""What every CPU benchmark records beside its figures, and how it writes them."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def machine_meta(**extra: Any) -> dict[str, Any]:
    """Date, machine, Python, numpy and dsp-core versions, plus ``extra``."""
    from dsp_core import __version__

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "dsp_core": __version__,
    }
    meta.update(extra)
    return meta


def write_results(out: str | Path, meta: dict[str, Any], results: Any) -> None:
    """Write ``{"meta": ..., "results": ...}`` as JSON to ``out`` and say where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")


def runtime_versions() -> dict[str, str]:
    """Versions of DSP's distributions and of the runtimes a CPU benchmark races."""
    import importlib.metadata

    found = {}
    for dist in ("dsp-core", "dsp-openvino", "dsp-onnxruntime", "onnxruntime", "openvino", "onnx"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def torch_flushed_us(body: Any, launches: int = 20, runs: int = 10) -> float:
    """Microseconds of one ``body()`` on the GPU, timed as dsp-triton tunes its kernels.

    ``launches`` (L2 flush, body) pairs captured in a torch CUDA graph and replayed ``runs``
    times, minus the same graph of flushes alone: each launch meets a cold L2, as in a decode
    step where every weight and cache row is read once.
    """
    import torch

    junk = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")

    def timed(with_body: bool) -> float:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            body()
            junk.zero_()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                junk.zero_()
                if with_body:
                    body()
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(runs):
            graph.replay()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)) * 1000 / (runs * launches)

    return max(timed(True) - timed(False), 0.0)
