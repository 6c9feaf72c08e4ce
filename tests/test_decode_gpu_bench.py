"""benchmarks/decode_gpu.py's pure parts, on the CPU without torch: metrics and medians, the
kernel-count window and the Chrome-trace summary, the derived columns, the table, the
command line. The GPU run itself is the lead's (the module doc names the command); here the
numbers it will print are checked to come out of these functions right."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("decode_gpu", ROOT / "benchmarks" / "decode_gpu.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["decode_gpu"] = bench  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(bench)


def kernel(name: str, dur: float, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur}


# -- metrics ---------------------------------------------------------------------------------
def test_rates_use_the_metric_thresholds() -> None:
    steps = [1.0, 0.5] + [0.25] * 18 + [0.1] * 10  # 30 steps
    m = bench.rates(steps)
    assert m["overall"] == pytest.approx(30 / sum(steps))
    assert m["decode"] == pytest.approx(29 / sum(steps[1:]))
    assert m["lateSteady"] == pytest.approx(10 / 1.0)
    assert m["effective_metric"] == "lateSteady" and m["effective"] == m["lateSteady"]
    short = bench.rates([0.5] * 5)  # no step 20: the best metric there is
    assert short["lateSteady"] is None and short["effective_metric"] == "steady"


def test_median_run_takes_each_metric_median_and_the_middle_run() -> None:
    runs = [[0.1] * 30, [0.2] * 30, [0.05] * 30]  # 10, 5, 20 tokens/s
    metrics, chosen = bench.median_run(runs)
    assert metrics["lateSteady"] == pytest.approx(10.0)
    assert chosen == 0  # the run whose rate is the median
    assert metrics["repeats"] == 3
    assert (metrics["effective_min"], metrics["effective_max"]) == (pytest.approx(5.0), pytest.approx(20.0))
    metrics, chosen = bench.median_run([[0.1] * 30, [0.2] * 30])  # even: the lower middle run
    assert metrics["lateSteady"] == pytest.approx(7.5) and chosen == 1
    with pytest.raises(ValueError, match="no timed runs"):
        bench.median_run([])


def test_timed_runs_keep_every_run_and_the_median_runs_tokens() -> None:
    results = iter([([0.2] * 25, [1, 2]), ([0.1] * 25, [1, 2]), ([0.3] * 25, [1, 3])])
    out = bench.timed_runs(lambda: next(results), 3)
    assert len(out["runs_step_seconds"]) == 3
    assert out["tokens"] == [1, 2]  # run 0 has the median rate
    assert out["tokens_stable_across_repeats"] is False


# -- the kernel window -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("block", "tokens", "expected"),
    [
        (1, 16, (16, 16, 32)),
        (8, 16, (17, 16, 33)),
        (8, 10, (17, 16, 33)),
        (4, 16, (17, 16, 33)),
        (32, 16, (65, 32, 97)),
    ],
)
def test_profile_window_is_steady_and_whole_blocks(block: int, tokens: int, expected: tuple[int, int, int]) -> None:
    start, window, length = bench.profile_window(block, tokens)
    assert (start, window, length) == expected
    assert start >= bench.PROFILE_START and (start - 1) % block == 0  # after the first token, whole blocks
    assert start >= 1 + 2 * block and window % block == 0 and window >= tokens


def test_profile_window_rejects_empty_windows() -> None:
    with pytest.raises(ValueError):
        bench.profile_window(0, 16)
    with pytest.raises(ValueError):
        bench.profile_window(8, 0)


def test_short_kernel_name_drops_templates_and_parameters() -> None:
    long = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<c10::Half>>(int, float*)"
    assert bench.short_kernel_name(long) == "at::native::vectorized_elementwise_kernel"
    assert bench.short_kernel_name("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    assert bench.short_kernel_name("x" * 100).endswith("...") and len(bench.short_kernel_name("x" * 100)) == 72


def test_summarize_trace_counts_kernels_per_token_not_copies() -> None:
    events = [kernel("cupy_multiply__float16", 1.0) for _ in range(6)]
    events += [kernel("void gemv<128>(float*)", 20.0) for _ in range(4)]
    events += [kernel("Memcpy DtoH (Device -> Pinned)", 3.0, "gpu_memcpy"), kernel("Memset", 1.0, "gpu_memset")]
    events += [kernel("cudaGraphLaunch", 5.0, "cuda_runtime"), {"ph": "i", "cat": "kernel", "name": "marker"}]
    s = bench.summarize_trace(events, tokens=2, category="kernel")
    assert s["per_token"] == 5.0  # 10 kernels over 2 tokens; copies, runtime calls and instants excluded
    assert s["us_per_token"] == pytest.approx((6 * 1.0 + 4 * 20.0) / 2)
    assert [t["name"] for t in s["top_by_count"]] == ["cupy_multiply__float16", "gemv"]
    assert s["top_by_count"][0]["per_token"] == 3.0
    assert s["top_by_time"][0] == {"name": "gemv", "per_token": 2.0, "us_per_token": 40.0}
    assert s["other_events"] == {"gpu_memcpy": 1, "gpu_memset": 1}
    with pytest.raises(ValueError):
        bench.summarize_trace(events, tokens=0, category="kernel")


class TraceProfiler:
    """Stands in for torch.profiler.profile where torch is absent: writes the given Chrome trace."""

    def __init__(self, events: list[dict[str, Any]], log: list[str]) -> None:
        self.events, self.log = events, log

    def start(self) -> None:
        self.log.append("start")

    def stop(self) -> None:
        self.log.append("stop")

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"traceEvents": self.events}))


def test_kernel_window_opens_and_closes_at_token_counts(tmp_path: Path) -> None:
    log: list[str] = []
    events = [kernel("k", 2.0) for _ in range(48)]
    trace = tmp_path / "t" / "row.json.gz"
    w = bench.KernelWindow(None, False, 17, 16, trace, profiler=lambda cuda: TraceProfiler(events, log))
    for n in (1, 9):
        w.tokens_done(n)
    assert log == [] and w.begin is None
    w.tokens_done(17)
    w.tokens_done(25)
    assert log == ["start"]
    w.tokens_done(33)
    w.tokens_done(41)  # closed once
    assert log == ["start", "stop"] and (w.begin, w.end) == (17, 33)
    s = w.result()
    assert s["window_tokens"] == 16 and s["category"] == "cpu_op"  # no CUDA: CPU ops, never called kernels
    assert bench.kernel_fields(s)["kernels_per_token"] is None
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"] == events
    assert s["trace"] == str(trace)


def test_kernel_window_counts_cuda_kernels_when_on_cuda(tmp_path: Path) -> None:
    class Sync:
        calls = 0

        class cuda:  # noqa: N801  (torch.cuda's shape)
            @staticmethod
            def synchronize() -> None:
                Sync.calls += 1

    events = [kernel("k", 2.0) for _ in range(48)] + [kernel("aten::mm", 9.0, "cpu_op")]
    w = bench.KernelWindow(Sync, True, 16, 16, profiler=lambda cuda: TraceProfiler(events, []))
    for n in range(1, 40):
        w.tokens_done(n)
    s = w.result()
    assert Sync.calls == 2  # the device is synchronised at both ends of the window
    assert s["category"] == "kernel" and s["per_token"] == 3.0 and s["us_per_token"] == 6.0
    fields = bench.kernel_fields(s)
    assert (fields["kernels_per_token"], fields["gpu_us_per_token"]) == (3.0, 6.0)
    assert fields["gpu_busy_us_per_token"] == s["busy_us_per_token"]


def test_a_window_that_never_closes_is_an_error_not_a_count() -> None:
    log: list[str] = []
    w = bench.KernelWindow(None, False, 17, 16, profiler=lambda cuda: TraceProfiler([], log))
    w.tokens_done(17)
    w.tokens_done(25)
    s = w.result()
    assert "never completed" in s["error"] and log == ["start", "stop"]
    assert bench.kernel_fields(s)["kernels_per_token"] is None


def test_kernel_fields_are_null_with_a_reason_unless_cuda_kernels_were_seen() -> None:
    cpu = bench.summarize_trace([kernel("aten::mm", 3.0, "cpu_op")], 1, "cpu_op")
    cpu["reason"] = "no CUDA device"
    assert bench.kernel_fields(cpu) == {
        "kernels_per_token": None,
        "gpu_us_per_token": None,
        "kernels_reason": "no CUDA device",
    }
    empty = bench.summarize_trace([], 4, "kernel")
    assert "no CUDA kernel" in bench.kernel_fields(empty)["kernels_reason"]
    assert bench.kernel_fields({"error": "boom"})["kernels_reason"] == "boom"


# -- rows, table, command line ---------------------------------------------------------------
def record_with_rows() -> dict[str, Any]:
    rows: dict[str, Any] = {
        "dsp_block[auto]": {"runs_step_seconds": [[0.001] * 40, [0.002] * 40, [0.001] * 40], "tokens": [1, 2, 3, 4]},
        "hf_eager": {"runs_step_seconds": [[0.01] * 40], "tokens": [1, 2, 9, 9]},
        "compile_reduce_overhead": {"runs_step_seconds": [[0.002] * 40], "tokens": [1, 2, 3, 4]},
        "dsp_step[triton]": {"error": "RuntimeError: no GPU"},
    }
    rows["dsp_block[auto]"]["kernels"] = bench.summarize_trace([kernel("k", 1.0)] * 32, 16, "kernel")
    rows["dsp_block[auto]"]["resolved_backends"] = ["triton", "cuda_graphs"]
    for entry in rows.values():
        bench.finish_row(entry)
    record = {
        "model": "llama-1b",
        "dtype": "fp16",
        "device": "cuda",
        "prompt_tokens": 32,
        "new_tokens": 256,
        "repeats": 3,
        "hf_repeats": 1,
        "peers": rows,
        "floor": {"tokens_per_s": 2000.0},
    }
    bench.compare_rows(record)
    return record


def test_rows_get_ratios_to_compile_and_floor_and_the_token_match() -> None:
    record = record_with_rows()
    block = record["peers"]["dsp_block[auto]"]
    assert block["metrics"]["lateSteady"] == pytest.approx(1000.0)  # median of 1000, 500, 1000
    assert block["vs_compile"] == pytest.approx(2.0) and block["vs_floor"] == pytest.approx(0.5)
    assert block["token_match_vs_hf"] == 0.5 and block["first_mismatch_vs_hf"] == 2
    assert block["kernels_per_token"] == 2.0 and "runs_step_seconds" not in block and len(block["runs"]) == 3
    assert record["peers"]["hf_eager"]["first_mismatch_vs_hf"] is None
    assert record["reference_distinct_tokens"] == 3
    summary = bench.summary_of(record)
    assert summary["dsp_block[auto]"]["resolved_backends"] == ["triton", "cuda_graphs"]
    assert summary["dsp_step[triton]"] == {"error": "RuntimeError: no GPU"}
    assert summary["floor_tokens_per_s"] == 2000.0


def test_table_prints_every_row_with_its_columns(capsys: pytest.CaptureFixture[str]) -> None:
    bench.print_table(record_with_rows())
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("dsp_block[auto]"))
    assert line.split()[1:8] == ["1000.0", "1.000", "2.0", "2.0", "2.00x", "0.500x", "0.50"]
    assert line.rstrip().endswith("triton,cuda_graphs")
    assert "dsp_step[triton]" in out and "error: RuntimeError: no GPU" in out
    assert "hf_eager produced 3 distinct tokens" in out


def test_command_line_modes_models_and_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "gpt2-124m,gpt2-774m,llama-135m,llama-1b", "--modes", "auto,cuda_graphs,triton"]
    assert bench.main([*argv, "--new-tokens", "20", "--dry-run"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["mode_list"] == ["auto", "cuda_graphs", "triton"]
    assert shown["length"] == 33  # room for the kernel-count run, longer than 20 tokens
    p, args = bench.parse([])
    assert args.models == "gpt2-124m,llama-1b" and args.repeats == 5
    for bad, message in (
        (["--models", "llama-7b"], "unknown model 'llama-7b'"),
        (["--modes", "auto,warp"], "--modes"),
        (["--peers", "vllm"], "unknown peer 'vllm'"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            bench.main([*bad, "--dry-run"])
        assert message in capsys.readouterr().err


def test_llama_shapes_are_the_named_models() -> None:
    small, big = bench.MODELS["llama-135m"].config, bench.MODELS["llama-1b"].config
    assert (small["num_hidden_layers"], small["hidden_size"], small["num_attention_heads"]) == (30, 576, 9)
    assert (small["num_key_value_heads"], small["intermediate_size"], small["vocab_size"]) == (3, 1536, 49152)
    assert (big["num_hidden_layers"], big["hidden_size"], big["num_attention_heads"], big["head_dim"]) == (
        16,
        2048,
        32,
        64,
    )
    assert (big["num_key_value_heads"], big["intermediate_size"], big["vocab_size"]) == (8, 8192, 128256)
    assert small["tie_word_embeddings"] and big["tie_word_embeddings"]
    assert (small["rope_theta"], big["rope_theta"]) == (10000.0, 500000.0)


def test_fp32_agreement_counts_the_fp32_choices_and_what_the_others_cost() -> None:
    """Teacher-forced logits (numpy here, torch in the benchmark): a row that takes fp32's argmax
    everywhere agrees 100% at no regret; one that breaks one near tie the other way costs its gap."""
    import numpy as np

    logits = np.zeros((6, 5), np.float32)
    logits[2:6] = [[0, 3, 1, 0, 0], [2.0, 1.99, 0, 0, 0], [0, 0, 0, 4, 1], [1, 0, 0, 0, 5]]
    best = bench.fp32_agreement(logits, 2, [1, 0, 3, 4])
    assert best == {"share": 1.0, "mean_regret": 0.0}
    other = bench.fp32_agreement(logits, 2, [1, 1, 3, 4])
    assert other["share"] == 0.75 and abs(other["mean_regret"] - 0.01 / 4) < 1e-6


def test_busy_time_counts_overlapping_kernels_once() -> None:
    """Dependent launches overlap kernels: the summed durations grow, the busy time does not."""
    assert bench.busy_time([]) == 0.0
    assert bench.busy_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8), (2.5, 4.0)]) == pytest.approx(5.0)
    events = [{"ph": "X", "cat": "kernel", "name": f"k{j}", "ts": 10.0 * j, "dur": 15.0} for j in range(4)]
    s = bench.summarize_trace(events, tokens=2, category="kernel")
    assert s["us_per_token"] == pytest.approx(30.0) and s["busy_us_per_token"] == pytest.approx(22.5)
    assert bench.kernel_fields(s)["gpu_busy_us_per_token"] == pytest.approx(22.5)
