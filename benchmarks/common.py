"""What every CPU benchmark records beside its figures, and how it writes them."""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
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
        "cpu_model": cpu_model(),
        "cpus": __import__("os").cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "dsp_core": __version__,
    }
    meta.update(extra)
    return meta


def cpu_model() -> str:
    """The CPU's model name and vector extensions as Linux reports them ("Intel(R) Xeon(R) Processor,
    avx512f, amx"), or the platform's processor field elsewhere: the figures of a 2-core VM depend on
    which host it landed on, and ``platform.processor()`` says only "x86_64" there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return ", ".join([name or platform.machine(), *vector])


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


TURN_S = 20e-3
SETTLED_TURN_S = 100e-3  # where some contender settles: longer turns, so the sleeps cost less


def interleaved_us(
    steps: dict[str, Callable[[], Any]], runs: int, budget_s: float = 3.0, settle: dict[str, float] | None = None
) -> dict:
    """Each contender's median call, the contenders timed in alternating turns.

    A turn is about 20 ms of one contender's calls (at least two, at most 512); the first call of a turn is
    not counted where calls are short (under 5 ms): it pays for the turn before it (caches
    another model's, another runtime's thread pool still spinning at two threads). Turns go
    round the contenders (the order rotating each cycle) until each has had about ``budget_s``
    of counted calls, and at least ``runs``. So every contender is sampled across the whole
    window, in step with the others: a noisy moment of the shared machine falls on all of them
    alike, where timing each contender's calls in one block (the best of three blocks of 30, as
    this race did before) moved a ratio by several per cent. Turns of one millisecond with every
    call counted (tried first) measured the handover instead: at two threads every contender
    after a spinning ONNX Runtime pool ran 1.5-14x slower.

    Turns of 20 ms do not cover that pool either: at two threads its workers keep a core for tens
    of milliseconds after a call (OpenVINO's MiniLM-L3 call, 9.0 ms alone, took 12.7-13.8 ms in
    turns after ONNX Runtime's). ``settle``: name -> seconds to sleep after that contender's turn
    (``dsp_onnxruntime.segment.SPIN_SETTLE_S`` for a spinning session); turns are then about 100 ms
    however short the calls, and the first call of a turn of four or more is not counted either.
    Returns name -> {"us": median, "runs": calls counted, "turns": {cycle: that turn's median us}}
    (``paired``: two contenders' turns of the same cycles, side by side).
    """
    settle = {name: t for name, t in (settle or {}).items() if t > 0.0}
    turn_s = SETTLED_TURN_S if settle else TURN_S
    once: dict[str, float] = {}
    for name, step in steps.items():
        for _ in range(3):
            step()
        # The median of five calls, not one: from one call that a noisy moment slowed 5x, the 3-node
        # MLP's ONNX Runtime peer was given a fifth of the calls of DSP's bound row, which then ran
        # some 1,600 turns alone (2026-12-05 03:07), and the ratio of the two medians compared two
        # windows of the machine, 1.011x, where turn by turn DSP was 0.59x, the faster in 276 of 284.
        calls = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            calls.append(time.perf_counter() - start)
        once[name] = max(float(np.median(calls)), 1e-7)
    # At most 512 calls a turn, except where turns are settled: a turn of 512 calls of 3 us followed
    # by a 60-150 ms sleep spent 99% of the row asleep (the 3-node MLP's rows at two threads took 18
    # minutes each, most of the race's 40 at two threads).
    cap = 1 << 30 if settle else 512
    turn = {name: max(2, min(cap, int(turn_s / t))) for name, t in once.items()}
    skip = {name: 1 if t < 5e-3 or turn[name] >= 4 else 0 for name, t in once.items()}
    wanted = {name: max(runs, int(budget_s / t)) for name, t in once.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    turns: dict[str, dict[int, float]] = {name: {} for name in steps}
    names, cycle = list(steps), 0
    clock = time.perf_counter
    while any(len(times[n]) < wanted[n] for n in names):
        order = names[cycle % len(names) :] + names[: cycle % len(names)]
        cycle += 1
        for name in order:
            if len(times[name]) >= wanted[name]:
                continue
            step, got, first = steps[name], times[name], skip[name]
            before = len(got)
            for k in range(turn[name]):
                t = clock()
                step()
                if k >= first:
                    got.append(clock() - t)
            if len(got) > before:
                turns[name][cycle] = float(np.median(got[before:])) * 1e6
            if name in settle:
                time.sleep(settle[name])  # its pool threads spin down before the next turn
    return {name: {"us": float(np.median(t)) * 1e6, "runs": len(t), "turns": turns[name]} for name, t in times.items()}


def paired(mine: dict[int, float], theirs: dict[int, float]) -> dict[str, Any]:
    """Two contenders of ``interleaved_us`` turn by turn: over the cycles where both had a turn, the
    median of the ratios of their turns' medians (``mine`` over ``theirs``), in how many ``mine`` was
    the faster, and a one-sided sign test each way (the chance of as many or more such cycles between
    two equally fast contenders): a ratio over 1.0 that ``p_slower`` does not back is a tie."""
    from dsp_core.backends.auction import sign_test  # the auction's own test (common.py loads without DSP)

    cycles = sorted(set(mine) & set(theirs))
    ratios = [mine[c] / theirs[c] for c in cycles]
    faster = sum(r < 1.0 for r in ratios)
    slower = sum(r > 1.0 for r in ratios)
    return {
        "ratio": round(float(np.median(ratios)), 3) if ratios else None,
        "faster_in": faster,
        "cycles": len(ratios),
        "p_faster": round(sign_test(faster, len(ratios)), 4),
        "p_slower": round(sign_test(slower, len(ratios)), 4),
    }
