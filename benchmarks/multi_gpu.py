"""Decode over two GPUs: one device vs PIPELINE_PARALLEL vs MEMORY_FIT with a spill cap.

For each model (GPT-2 774M and the Llama-3.2-1B shape by default: the builders and the ONNX
export of benchmarks/decode_gpu.py, fp16, random weights, seed 1234), three rows, each a
``GenerationPipeline`` in ``--mode`` (cuda_graphs by default) with one graph replay per token
(``block_capture=False``: a block plan would capture across devices):

- ``one_device``: no placement (device 0);
- ``pipeline_parallel``: two stages, the cut where the fewest bytes cross among the
  weight-balanced boundaries;
- ``memory_fit_spill``: MEMORY_FIT with device 0's budget capped at ``--spill-fraction`` (0.6)
  of the model's resident bytes, so about 40% of the weights spill to device 1. The cap is
  device 0's modelled memory (``use_topology``), not DSP_MAX_DEVICE_MEMORY: that variable caps
  CuPy's pool as well, and the prefill and decode plans each hold their own device copy of
  the weights, so a cap low enough to force a spill would leave the allocator short.

Reported per row (table on stdout, JSON under ``--out``): lateSteady tokens/s (median of
``--repeats`` runs of ``--new-tokens``), ms/token and its difference to one device, whether
the tokens equal one device's, the placement (devices, weight bytes per device, the cuts with
their predicted bytes per step), and for the decode plan's last step: the bytes copied per
reason, the ACTIVATION bytes crossing the cut against the placement's prediction, the
modelled copy time (bytes / the topology's bandwidth) against a measured one (CUDA events
around ``--copy-reps`` peer copies of the cut's bytes on the same devices, or through pinned
host memory where the devices have no peer access).

On the two-GPU image (dsp installed by scripts/gpu_setup.sh; torch and transformers only to
build and export the models), one model per invocation keeps each under 10 minutes:

    python3 benchmarks/multi_gpu.py --models gpt2-774m --onnx-dir /tmp/dsp_onnx --out $OUT
    python3 benchmarks/multi_gpu.py --models llama-1b --onnx-dir /tmp/dsp_onnx --out $OUT

Without a GPU, ``--onnx tests/fixtures/gpt2_eager.onnx --stub 2 --mode slot_by_slot`` runs the
same rows on two stub devices (no torch needed): what tests/test_multi_gpu_bench.py checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("one_device", "pipeline_parallel", "memory_fit_spill")


def log(msg: str) -> None:
    """A progress line on stderr (the table goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decode_gpu() -> Any:
    """benchmarks/decode_gpu.py as a module (its model builders and ONNX export)."""
    spec = importlib.util.spec_from_file_location("decode_gpu", ROOT / "benchmarks" / "decode_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["decode_gpu"] = module
    spec.loader.exec_module(module)
    return module


def export(name: str, onnx_dir: Path, opset: int) -> Path:
    """The model's fp16 ONNX export, where decode_gpu.py keeps it too (a later invocation of either reuses it)."""
    path = onnx_dir / f"{name}-fp16" / "model.onnx"
    if path.exists():
        return path
    import torch

    bench = decode_gpu()
    log(f"{name}: building and exporting to {path}")
    model = bench.build(torch, name, torch.float16, "cuda", "eager")
    bench.export_onnx(torch, model, path, opset)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return path


def topology_scope(stub: int) -> Any:
    """The topology of the run: ``stub`` fake devices (all peers), or the CUDA devices."""
    from dsp_core.devices import cuda_topology, stub_topology, use_topology

    if stub:
        return stub_topology([{"memory": 64 << 30, "peers": [j for j in range(stub) if j != i]} for i in range(stub)])
    topo = cuda_topology()
    if topo is None or len(topo) < 2:
        raise SystemExit(
            f"needs 2 CUDA devices (found {0 if topo is None else len(topo)}); --stub N runs on stub devices"
        )
    return use_topology(topo)


def resident_bytes(path: str, mode: str) -> int:
    """What placement charges for the model's weights (and values computed from them alone)."""
    import dsp_core as dsp

    model = dsp.compile(path, mode=mode, placement="single_device")
    return sum(model.dsp.placement.weights)


def measure_copy(nbytes: int, src: int, dst: int, peer: bool, reps: int) -> float | None:
    """Seconds per copy of ``nbytes`` from ``src`` to ``dst`` (CUDA events; None without CuPy)."""
    try:
        import cupy as cp
    except ImportError:
        return None
    if nbytes <= 0:
        return 0.0
    with cp.cuda.Device(src):
        a = cp.zeros(nbytes, cp.uint8)
    with cp.cuda.Device(dst):
        b = cp.empty(nbytes, cp.uint8)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        stream = cp.cuda.Stream.null
        pinned = cp.cuda.alloc_pinned_memory(nbytes)
        for timed in (False, True):
            if timed:
                start.record(stream)
            for _ in range(reps):
                if peer:
                    cp.cuda.runtime.memcpyPeerAsync(b.data.ptr, dst, a.data.ptr, src, nbytes, stream.ptr)
                else:
                    d2h, h2d = cp.cuda.runtime.memcpyDeviceToHost, cp.cuda.runtime.memcpyHostToDevice
                    cp.cuda.runtime.memcpyAsync(pinned.ptr, a.data.ptr, nbytes, d2h, stream.ptr)
                    cp.cuda.runtime.memcpyAsync(b.data.ptr, pinned.ptr, nbytes, h2d, stream.ptr)
            if timed:
                stop.record(stream)
        stop.synchronize()
        return float(cp.cuda.get_elapsed_time(start, stop)) / 1e3 / reps


def run_row(row: str, path: str, args: argparse.Namespace, prompt: np.ndarray, cap: int) -> dict[str, Any]:
    """One row: a pipeline placed as ``row`` says, a warm-up, ``--repeats`` timed generations."""
    from dsp_core.devices import current_topology, use_topology
    from dsp_core.llm import GenerationPipeline

    placement = {"one_device": None, "pipeline_parallel": "pipeline_parallel", "memory_fit_spill": "memory_fit"}[row]
    spill = row == "memory_fit_spill"
    with use_topology(capped(current_topology(), cap)) if spill else contextlib.nullcontext():
        start = time.perf_counter()
        pipe = GenerationPipeline(
            path, max_length=prompt.shape[1] + args.new_tokens, mode=args.mode, placement=placement, block_capture=False
        )
        pipe.generate(prompt, args.new_tokens)  # compile, freeze, capture
        setup = time.perf_counter() - start
        runs, tokens = [], []
        for _ in range(max(args.repeats, 1)):
            result = pipe.generate(prompt, args.new_tokens)
            runs.append(result.metrics.rates["lateSteady"] or result.metrics.effective[1] or 0.0)
            tokens.append(result.token_list())
    decode = pipe.decoder(1).model
    rate = statistics.median(runs)
    entry: dict[str, Any] = {
        "row": row,
        "placement": placement,
        "cap_bytes": cap if spill else None,
        "setup_seconds": setup,
        "late_steady_tok_s": rate,
        "runs_tok_s": runs,
        "ms_per_token": 1e3 / rate if rate else None,
        "tokens": tokens[0],
        "tokens_stable": all(t == tokens[0] for t in tokens),
        "resolved_backends": decode.resolved_backends(),
        "decode_phase": decode.dsp.phase.name,
        "counters": decode.dsp.runtime.counters(),
    }
    if placement is not None:
        entry.update(transfer_fields(decode, args))
    del pipe
    gc.collect()
    return entry


def transfer_fields(decode: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The placement, and the last decode step's copies against the placement's prediction."""
    placed = decode.dsp.placement
    plan = decode.plan()
    last = decode.dsp.transfers()[-1]
    acts = [c for c in last.copies if c.reason.name == "ACTIVATION"]
    cuts = []
    for cut in placed.cuts:
        crossing = [c for c in acts if c.src == cut.src and c.dst == cut.dst]
        measured_bytes = sum(c.nbytes for c in crossing)
        peer = placed.topology.peer(cut.src, cut.dst)
        measured_s = measure_copy(measured_bytes, cut.src, cut.dst, peer, args.copy_reps) if not args.stub else None
        if measured_s is None:  # stub devices: the host time of the numpy copies
            times = [c.measured_s for c in crossing if c.measured_s is not None]
            measured_s = sum(times) if times else None
        cuts.append(
            {
                **cut.as_dict(plan),
                "predicted_bytes_per_step": cut.nbytes,
                "measured_bytes_per_step": measured_bytes,
                "copies_per_step": len(crossing),
                "modelled_s_per_step": sum(c.modelled_s for c in crossing),
                "measured_s_per_step": measured_s,
                "peer": peer,
            }
        )
    return {
        "devices": placed.devices_used,
        "weight_bytes_per_device": list(placed.weights),
        "budget_bytes_per_device": list(placed.budgets),
        "cuts": cuts,
        "last_step_bytes_by_reason": last.by_reason(),
        "last_step_switches": len(last.switches),
        "transfer_totals": decode.dsp.transfer_summary(),
    }


def capped(topology: Any, budget: int) -> Any:
    """``topology`` with device 0's memory cut so that its placement budget is ``budget`` bytes."""
    from dsp_core import config

    reserve = float(config.get("device_memory_reserve"))
    first = dataclasses.replace(topology[0], memory=int(budget / (1.0 - reserve)) + 1)
    return dataclasses.replace(topology, devices=(first, *topology.devices[1:]))


def bench_model(name: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """The three rows of one model, compared with the one-device row."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, size=(1, args.prompt_len), dtype=np.int64)
    with topology_scope(args.stub):
        resident = resident_bytes(path, "slot_by_slot")  # no device memory needed for the numbers
        cap = int(resident * args.spill_fraction)
        rows = []
        for row in args.rows.split(","):
            log(f"{name}: {row}")
            try:
                rows.append(run_row(row, path, args, prompt, cap))
            except Exception as exc:  # noqa: BLE001  (one failing row must not hide the others)
                rows.append({"row": row, "error": f"{type(exc).__name__}: {exc}"})
    base = next((r for r in rows if r["row"] == "one_device" and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["tokens_equal_one_device"] = r["tokens"] == base["tokens"]
            r["vs_one_device"] = (
                r["late_steady_tok_s"] / base["late_steady_tok_s"] if base["late_steady_tok_s"] else None
            )
            if r["ms_per_token"] is not None and base["ms_per_token"] is not None:
                r["extra_ms_per_token"] = r["ms_per_token"] - base["ms_per_token"]
    return {"model": name, "onnx": path, "resident_bytes": resident, "rows": rows}


def meta() -> dict[str, Any]:
    """Date, machine, versions and the command line."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "benchmarks/multi_gpu.py", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "versions": {},
    }
    for module in ("dsp_core", "cupy", "numpy", "torch", "transformers", "onnx"):
        with contextlib.suppress(Exception):
            info["versions"][module] = __import__(module).__version__
    with contextlib.suppress(Exception):
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        info["machine"]["gpus"] = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(count)]
        info["machine"]["peer_access"] = {
            f"{i}->{j}": bool(cupy.cuda.runtime.deviceCanAccessPeer(i, j))
            for i in range(count)
            for j in range(count)
            if i != j
        }
    return info


def print_table(records: list[dict[str, Any]]) -> None:
    """One line per row; the cut lines under the placed rows."""
    print(f"{'model':<12} {'row':<18} {'tok/s':>8} {'ms/tok':>7} {'vs 1':>6} {'same':>5}  devices / bytes per step")
    for rec in records:
        for r in rec["rows"]:
            if "error" in r:
                print(f"{rec['model']:<12} {r['row']:<18} error: {r['error'][:90]}")
                continue
            vs = r.get("vs_one_device")
            same = r.get("tokens_equal_one_device")
            extra = ""
            if "cuts" in r:
                extra = f"{list(r['devices'])}, weights {r['weight_bytes_per_device']}"
            print(
                f"{rec['model']:<12} {r['row']:<18} {r['late_steady_tok_s']:>8.1f} {r['ms_per_token'] or 0:>7.3f} "
                f"{vs if vs is None else f'{vs:.2f}':>6} {str(same):>5}  {extra}"
            )
            for c in r.get("cuts", []):
                measured = c["measured_s_per_step"]
                print(
                    f"{'':<32} cut {c['src']}->{c['dst']} after slot {c['after_slot']}: predicted "
                    f"{c['predicted_bytes_per_step']} B, copied {c['measured_bytes_per_step']} B/step in "
                    f"{c['copies_per_step']} copies; modelled {c['modelled_s_per_step'] * 1e6:.4f} us, measured "
                    f"{'-' if measured is None else f'{measured * 1e6:.2f} us'} ({'peer' if c['peer'] else 'via host'})"
                )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-774m,llama-1b", help="decode_gpu.py model names, comma-separated")
    p.add_argument("--onnx", default=None, help="run this ONNX decoder instead of building --models")
    p.add_argument("--onnx-dir", default="/tmp/dsp_onnx", help="where the exports are kept")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--mode", default="cuda_graphs", help="execution mode of every row")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spill-fraction", type=float, default=0.6, help="memory_fit cap, a fraction of resident bytes")
    p.add_argument("--copy-reps", type=int, default=200, help="peer copies timed per cut")
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    p.add_argument("--stub", type=int, default=0, metavar="N", help="N stub devices instead of the GPUs")
    p.add_argument("--out", required=True, help="directory for multi_gpu.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    bad = [r for r in args.rows.split(",") if r not in ROWS]
    if bad:
        raise SystemExit(f"--rows: unknown row {bad[0]!r}; rows are {', '.join(ROWS)}")
    if args.onnx:
        targets = [(Path(args.onnx).stem, args.onnx)]
    else:
        targets = [(name, str(export(name, Path(args.onnx_dir), args.opset))) for name in args.models.split(",")]
    records = [bench_model(name, path, args) for name, path in targets]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"format": "dsp-multi-gpu/1", **meta(), "records": records}
    target = out / "multi_gpu.json"
    target.write_text(json.dumps(result, indent=2, default=str))
    print_table(records)
    log(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
