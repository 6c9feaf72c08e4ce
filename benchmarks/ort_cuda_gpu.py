"""dsp-onnxruntime on ONNX Runtime's CUDA provider, against ONNX Runtime's own IOBinding on the GPU.

Per fixture (the CNN at batch 1 and 8, the GPT-2 and Llama fixtures' decode step), the median
call, contenders timed in alternating turns (``common.interleaved_us``):

- ``ort_iobinding``: ONNX Runtime alone, one CUDA-provider session over the whole model, inputs
  bound once as device arrays, outputs bound to host arrays (ONNX Runtime copies them back in
  the call), the same work a DSP call does; ``run_with_iobinding`` per call;
- ``dsp_onnxruntime_bound``: DSP, ``mode="onnxruntime"`` (onnxruntime-cuda), through an IO
  binding (``model.bind``): feeds staged on the device once, each call a replay, outputs
  returned on the host;
- ``dsp_auto_bound``: DSP AUTO on the same machine (its own GPU backends), the same binding.

Every DSP output is compared with the slot-by-slot reference (max abs diff). Needs
onnxruntime-gpu (``scripts/gpu_setup.sh`` notes how it travels to the GPU image).

    python3 benchmarks/ort_cuda_gpu.py --out $OUT/ort_cuda_gpu.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_us, machine_meta, write_results  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def _cases() -> list[tuple[str, Path, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    cases = []
    for batch in (1, 8):
        x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        cases.append((f"cnn b{batch}", FIXTURES / "cnn.onnx", {"input": x}))
    for name in ("gpt2_sdpa23", "llama_sdpa23"):
        golden = np.load(FIXTURES / f"{name}.golden.npz")
        inputs = _input_names(FIXTURES / f"{name}.onnx")
        feeds = {n: golden[f"step1.{n}"] for n in inputs}
        cases.append((f"{name} decode step", FIXTURES / f"{name}.onnx", feeds))
    return cases


def _input_names(path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {t.name for t in graph.initializer}
    return [i.name for i in graph.input if i.name not in constants]


def _ort_iobinding(path: Path, feeds: dict[str, np.ndarray]) -> tuple[Callable[[], Any], list[np.ndarray]]:
    import cupy as cp
    import onnxruntime as ort
    from dsp_onnxruntime.segment import cuda_providers, session_options

    sess = ort.InferenceSession(str(path), session_options(0, alone=True), providers=cuda_providers(0))
    assert sess.get_providers()[0] == "CUDAExecutionProvider", sess.get_providers()
    names = [o.name for o in sess.get_outputs()]
    first = sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})
    binding = sess.io_binding()
    keep = []
    for i in sess.get_inputs():
        d = cp.asarray(np.ascontiguousarray(feeds[i.name]))
        keep.append(d)
        binding.bind_input(i.name, "cuda", 0, d.dtype, list(d.shape), d.data.ptr)
    outs = [np.empty(a.shape, a.dtype) for a in first]
    for name, o in zip(names, outs):
        binding.bind_output(name, "cpu", 0, o.dtype, list(o.shape), o.ctypes.data)

    def step() -> None:
        sess._sess.run_with_iobinding(binding._iobinding, None)

    step._keep = (keep, outs)  # type: ignore[attr-defined]  # the bound memory lives as long as the step
    return step, first


def _dsp_bound(path: Path, feeds: dict[str, np.ndarray], mode: str) -> tuple[Callable[[], Any], dict, list[str]]:
    import dsp_core as dsp

    model = dsp.compile(path, mode=mode)
    binding = model.bind({k: v for k, v in feeds.items() if k in model.input_names})
    for _ in range(6):  # eager, freeze, capture: the binding then replays
        out = binding.run()
    return binding.run, out, model.resolved_backends()


def run(runs: int, budget_s: float) -> list[dict[str, Any]]:
    import dsp_core as dsp

    rows = []
    for title, path, feeds in _cases():
        reference = dsp.compile(path, mode="slot_by_slot").run(feeds)
        ort_step, _ = _ort_iobinding(path, feeds)
        ours, ours_out, ours_backends = _dsp_bound(path, feeds, "onnxruntime")
        auto, auto_out, auto_backends = _dsp_bound(path, feeds, "auto")

        def diff(out: dict, want: dict = reference) -> float:
            return max(float(np.max(np.abs(np.asarray(out[k], np.float64) - want[k]))) for k in want)

        timed = interleaved_us(
            {"ort_iobinding": ort_step, "dsp_onnxruntime_bound": ours, "dsp_auto_bound": auto}, runs, budget_s
        )
        row = {
            "case": title,
            **{k: v["us"] for k, v in timed.items()},
            "calls": {k: v["runs"] for k, v in timed.items()},
            "ratio_dsp_onnxruntime": round(timed["dsp_onnxruntime_bound"]["us"] / timed["ort_iobinding"]["us"], 3),
            "ratio_dsp_auto": round(timed["dsp_auto_bound"]["us"] / timed["ort_iobinding"]["us"], 3),
            "max_diff_onnxruntime": diff(ours_out),
            "max_diff_auto": diff(auto_out),
            "backends_onnxruntime": ours_backends,
            "backends_auto": auto_backends,
        }
        rows.append(row)
        print(
            f"| {title} | {row['ort_iobinding']:.1f} | {row['dsp_onnxruntime_bound']:.1f} "
            f"({row['ratio_dsp_onnxruntime']}x) | {row['dsp_auto_bound']:.1f} ({row['ratio_dsp_auto']}x) "
            f"| {row['max_diff_onnxruntime']:.2e} | {row['max_diff_auto']:.2e} |",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/ort_cuda_gpu.json")
    parser.add_argument("--runs", type=int, default=200, help="at least this many counted calls per contender")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of counted calls per contender")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    print("| case | ORT IOBinding µs | DSP onnxruntime-cuda bound µs | DSP AUTO bound µs | diff ORT | diff AUTO |")
    print("|---|---|---|---|---|---|")
    rows = run(args.runs, args.budget)
    import cupy

    meta = machine_meta(
        gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        onnxruntime=ort.__version__,
        cupy=cupy.__version__,
        method="median call, contenders in alternating ~20 ms turns (benchmarks/common.py interleaved_us)",
    )
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
