"""Host time per step: legacy interpreter vs SLOT_BY_SLOT vs ONNX Runtime; DSP's own time per call.

    python benchmarks/cpu_overhead.py [--repeats 7] [--out benchmarks/results/cpu_overhead.json]
    python benchmarks/cpu_overhead.py --per-call [--out benchmarks/results/cpu_overhead_race.json]

Cases: (a) a chain of 200 small elementwise ops on a [1, 16] tensor; (b) the GPT-2
fixture's decode step (past length 7). Each figure is the median over ``--repeats`` runs
of the mean time of a batch of calls.

``--per-call``: DSP's own time per call on a frozen plan (the 3-node MLP of the CPU race,
batch 1, one thread), per CPU runtime backend: the runtime's own bound call, a full
``model.run``, and DSP's own time, measured as ``model.run`` with the runtime call
replaced by a no-op (on a shared machine, the difference of the first two carries both
timings' noise); and a plan-cache hit (acquire + release of the live plan). Each figure
is the best over rounds of the mean of a batch of calls. Then ``after_a_call``: DSP's own
time per bound step right after a real runtime call (the CNN fixture on ONNX Runtime, batch
1 and 8: the runtime's bare bound call against ``binding.run``, alternating turns, medians),
where the objects the step reads are no longer in the cache.

A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import interleaved_us, machine_meta, runtime_versions, write_results

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "tests" / "fixtures" / "gpt2_eager.onnx"
GPT2_GOLDEN = ROOT / "tests" / "fixtures" / "gpt2_eager.golden.npz"


def chain_graph(n_ops: int = 200) -> Any:
    """x[1,16] -> n_ops elementwise ops (Add, Mul, Relu, Sigmoid, Tanh, Neg, Abs, Sub) -> y."""
    import dsp_core as dsp

    g = dsp.GraphBuilder("chain200")
    x = g.placeholder("x", "float32", [1, 16])
    c = g.constant(np.full((1, 16), 0.5, np.float32), name="c")
    h = x
    unary = ["Relu", "Sigmoid", "Tanh", "Neg", "Abs"]
    binary = ["Add", "Mul", "Sub"]
    for i in range(n_ops - 1):
        h = g.op(binary[i % 3], h, c) if i % 2 == 0 else g.op(unary[(i // 2) % 5], h)
    g.output(h, "y")
    return g.build()


def time_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> tuple[float, list[float]]:
    """Median over repeats of the mean seconds per call (after one warm-up batch)."""
    for _ in range(max(1, calls // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples), samples


def ort_session(model: bytes | str, feeds: dict[str, np.ndarray]) -> tuple[Any, Any] | None:
    """An ONNX Runtime session on ``model`` (bytes or a path), one thread, and an IOBinding with ``feeds``
    and every output bound; None when ORT is missing."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    for out in sess.get_outputs():
        binding.bind_output(out.name, "cpu")
    return sess, binding


def ort_runner(model_proto: Any, feeds: dict[str, np.ndarray]) -> Callable[[], Any] | None:
    """An ONNX Runtime call through a pre-bound IOBinding, or None when ORT is missing."""
    made = ort_session(model_proto.SerializeToString(), feeds)
    if made is None:
        return None
    sess, binding = made
    return lambda: sess.run_with_iobinding(binding)


def bench_case(
    name: str, graph: Any, model_proto: Any, feeds: dict[str, np.ndarray], calls: int, repeats: int
) -> dict[str, Any]:
    """Time the three engines on one case; check they agree first."""
    import dsp_core as dsp

    model = dsp.compile(graph, mode="slot_by_slot")
    ref = model.run(feeds)
    legacy = model.run_legacy(feeds)
    for key in ref:
        np.testing.assert_allclose(ref[key], legacy[key], rtol=1e-5, atol=1e-6)
    rows: dict[str, Any] = {}
    rows["legacy"], _ = time_per_call(lambda: model.run_legacy(feeds), calls, repeats)
    rows["slot_by_slot"], _ = time_per_call(lambda: model.run(feeds), calls, repeats)
    ort_fn = ort_runner(model_proto, feeds)
    if ort_fn is not None:
        rows["onnxruntime_iobinding"], _ = time_per_call(ort_fn, calls, repeats)
    plan = model.plan()
    return {
        "case": name,
        "slots": len(plan.slots) if plan else None,
        "us_per_step": {k: round(v * 1e6, 2) for k, v in rows.items()},
        "legacy_over_slot_by_slot": round(rows["legacy"] / rows["slot_by_slot"], 2),
        "slot_by_slot_over_ort": round(rows["slot_by_slot"] / rows["onnxruntime_iobinding"], 2) if ort_fn else None,
        "calls_per_sample": calls,
        "repeats": repeats,
    }


def gpt2_case() -> tuple[Any, Any, dict[str, np.ndarray]] | None:
    """The GPT-2 fixture and the feeds of its first decode step, or None if absent."""
    if not GPT2.exists() or not GPT2_GOLDEN.exists():
        return None
    import onnx

    from dsp_core.ir.onnx_import import import_model

    golden = np.load(GPT2_GOLDEN)
    prefix = "step1."
    proto = onnx.load(str(GPT2))
    graph = import_model(proto)
    feeds = {name: golden[prefix + name] for name in graph.input_names}
    return graph, proto, feeds


def mlp3_model(batch: int = 1) -> tuple[Path, dict[str, np.ndarray]]:
    """The CPU race's 3-node MLP (x[n, 8] -> MatMul -> Relu -> MatMul -> y[n, 4]) in a file, and its feeds."""
    import tempfile

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = Path(tempfile.mkdtemp(prefix="dsp-mlp3-")) / "mlp3.onnx"
    onnx.save(model, str(path))
    return path, {"x": rng.standard_normal((batch, 8)).astype(np.float32)}


def best_per_call_us(step: Callable[[], Any], rounds: int, calls: int) -> float:
    """The best over ``rounds`` of the mean µs per call of ``calls`` calls (noise only adds time)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def per_call_overhead(rounds: int = 30, calls: int = 2000) -> dict[str, Any]:
    """Per CPU backend that replays: its own call, ``model.run``, a binding's ``run`` (IO binding,
    no copies), DSP's own time on each path (the same path with the backend's call a no-op), a
    plan cache hit."""
    import os

    import dsp_core as dsp

    os.environ.setdefault("DSP_CPU_THREADS", "1")
    path, feeds = mlp3_model()
    found: dict[str, Any] = {}
    for mode in ("onnxruntime", "openvino", "numpy_replay"):
        model = dsp.compile(path, mode=mode)
        for _ in range(8):  # freeze, capture, settle into the steady replay
            model.run(feeds)
        live = model.last_live
        assert live is not None and live.runtime._steady is not None, f"{mode}: no steady replay"
        runtime = live.runtime
        ((unit, call),) = runtime._steady.units  # the backend's own call on its bound buffers
        assert call is not None, f"{mode}: no replay call"
        own = best_per_call_us(call, rounds, calls)
        full = best_per_call_us(functools.partial(model.run, feeds), rounds, calls)
        binding = model.bind(feeds)
        bound = best_per_call_us(binding.run, rounds, calls)
        binding.close()
        # DSP's own time: the same paths with the backend's call a no-op (the steady program is
        # rebuilt around it by the next clean steps)
        unit.compiled._replay_call = lambda values: _no_op
        runtime._steady = None
        for _ in range(3):
            model.run(feeds)
        assert runtime._steady is not None and runtime._steady.units[0][1] is _no_op
        no_op = best_per_call_us(_no_op, rounds, calls)
        dsp_own = best_per_call_us(functools.partial(model.run, feeds), rounds, calls) - no_op
        binding = model.bind(feeds)
        dsp_own_bound = best_per_call_us(binding.run, rounds, calls) - no_op
        binding.close()
        cache = model.cache

        def hit_once(cache: Any = cache, signature: Any = live.signature) -> None:
            cache.release(cache.acquire(signature))

        found[mode] = {
            "backend_call_us": round(own, 2),
            "dsp_run_us": round(full, 2),
            "dsp_bound_us": round(bound, 2),
            "dsp_own_us": round(dsp_own, 2),
            "dsp_own_bound_us": round(dsp_own_bound, 2),
            "dsp_run_minus_backend_call_us": round(full - own, 2),
            "plan_cache_hit_us": round(best_per_call_us(hit_once, rounds, calls), 2),
        }
        print(json.dumps({mode: found[mode]}), flush=True)
    return found


def after_call_overhead(budget_s: float = 4.0) -> dict[str, Any]:
    """DSP's own time per step right after a real runtime call: the CNN fixture on ONNX Runtime
    (batch 1 and 8, one thread), the runtime's bare bound call against ``binding.run`` and against
    ``model.run`` (its run step: copies in and out), timed in alternating turns
    (``common.interleaved_us``); beside them ONNX Runtime's own ``run`` against its own IOBinding
    on a session of the same file and thread count, what its ``run`` costs above a bound call.

    ``per_call_overhead`` measures DSP's own time with a no-op for the runtime's call, so every
    object the step touches stays in the cache; after a real call of 45-310 µs (the CNN's
    convolutions run through the caches) each object the step reads is a miss, and that is
    what a user pays."""
    import os

    import dsp_core as dsp

    os.environ.setdefault("DSP_CPU_THREADS", "1")
    found: dict[str, Any] = {}
    for batch in (1, 8):
        x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
        model = dsp.compile(ROOT / "tests" / "fixtures" / "cnn.onnx", mode="onnxruntime")
        binding = model.bind({"input": x})
        live = model.last_live
        assert binding.bound and live is not None and live.runtime._steady is not None, "the CNN did not bind"
        ((_, call),) = live.runtime._steady.units  # ONNX Runtime's bound call on DSP's buffers
        run_model = dsp.compile(ROOT / "tests" / "fixtures" / "cnn.onnx", mode="onnxruntime")
        feeds = {"input": x.copy()}
        for _ in range(12):  # freeze, settle: later calls take the steady program's run step
            run_model.run(feeds)
        steps: dict[str, Callable[[], Any]] = {
            "backend_call": call,
            "dsp_bound": binding.run,
            "dsp_run": functools.partial(run_model.run, feeds),
        }
        peer = _ort_cnn(x)
        if peer is not None:
            steps["ort_iobinding"], steps["ort_run"] = peer
        timed = interleaved_us(steps, 30, budget_s)
        own = timed["backend_call"]["us"]
        entry = {
            "backend_call_us": round(own, 2),
            "dsp_bound_us": round(timed["dsp_bound"]["us"], 2),
            "dsp_own_after_call_us": round(timed["dsp_bound"]["us"] - own, 2),
            "dsp_run_us": round(timed["dsp_run"]["us"], 2),
            "dsp_run_above_call_us": round(timed["dsp_run"]["us"] - own, 2),
            "runs": timed["dsp_bound"]["runs"],
        }
        if peer is not None:
            entry["ort_run_above_its_iobinding_us"] = round(timed["ort_run"]["us"] - timed["ort_iobinding"]["us"], 2)
        found[f"cnn_batch{batch}"] = entry
        binding.close()
        print(json.dumps({f"cnn_batch{batch}": found[f"cnn_batch{batch}"]}), flush=True)
    return found


def _ort_cnn(x: np.ndarray) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """ONNX Runtime's own IOBinding step and ``run`` on the CNN fixture (one thread), or None without it."""
    feeds = {"input": x}
    made = ort_session(str(ROOT / "tests" / "fixtures" / "cnn.onnx"), feeds)
    if made is None:
        return None
    sess, binding = made
    return (lambda: sess.run_with_iobinding(binding)), (lambda: sess.run(None, feeds))


def _no_op() -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print a table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="JSON results (default under benchmarks/results/)")
    p.add_argument("--per-call", action="store_true", help="DSP's own time per call on the 3-node MLP, per backend")
    args = p.parse_args(argv)
    results_dir = ROOT / "benchmarks" / "results"
    if args.per_call:
        meta = machine_meta(
            threads=1, statistic="best over 30 rounds of the mean of 2000 calls", versions=runtime_versions()
        )
        results = {**per_call_overhead(), "after_a_call": after_call_overhead()}
        write_results(args.out or results_dir / "cpu_overhead_race.json", meta, results)
        return 0
    args.out = args.out or str(results_dir / "cpu_overhead.json")

    from dsp_core.ir.onnx_export import to_onnx

    results = []
    chain = chain_graph()
    print("case (a): 200-op elementwise chain ...", flush=True)
    results.append(
        bench_case("chain200", chain, to_onnx(chain), {"x": np.ones((1, 16), np.float32)}, 200, args.repeats)
    )
    case = gpt2_case()
    if case is None:
        print("case (b) skipped: tests/fixtures/gpt2_eager.onnx not found (run `make fixtures`)")
    else:
        print("case (b): GPT-2 fixture decode step ...", flush=True)
        results.append(bench_case("gpt2_decode_step", *case, 50, args.repeats))

    header = (
        f"{'case':<18} {'slots':>5} {'legacy µs':>10} {'slot_by_slot µs':>16} "
        f"{'ORT iobind µs':>14} {'legacy/sbs':>11} {'sbs/ORT':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        us = r["us_per_step"]
        print(
            f"{r['case']:<18} {r['slots']:>5} {us['legacy']:>10.1f} {us['slot_by_slot']:>16.1f} "
            f"{us.get('onnxruntime_iobinding', float('nan')):>14.1f} {r['legacy_over_slot_by_slot']:>10.2f}x "
            f"{r['slot_by_slot_over_ort'] or float('nan'):>7.2f}x"
        )
    meta = machine_meta(statistic=f"median of {args.repeats} samples, each the mean over a batch of calls")
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    write_results(args.out, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
