"""A GenerationPipeline's warm start (dsp_core/llm/store.py): a second process reuses every plan.

The cold and warm runs are separate Python processes sharing one cache directory, as two
users' runs would be. What ran is counted, not timed: the child wraps the importer, the
plan compiler and the three graph rewrites with counters (the real functions still run)
and reports them with the pipeline's ``warm_stats``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES

from dsp_core.cache.disk import DiskCache
from dsp_core.llm import GenerationPipeline, Sampling
from dsp_core.llm.store import PlanStore, encode

CHILD = r"""
import json, sys
from collections import Counter
import numpy as np
import dsp_core.llm.pipeline as pipeline
import dsp_core.runtime.loader as loader
import dsp_core.runtime.model as model
from dsp_core.llm import GenerationPipeline, Sampling

calls = Counter()

def counted(module, name):
    real = getattr(module, name)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)
    setattr(module, name, wrapper)

counted(loader, "import_model")
counted(model, "compile_plan")
counted(pipeline, "fixed_kv_buffers")
counted(pipeline, "unroll")
counted(pipeline, "last_position_logits")
path, max_length, block, batch, sample, mode = sys.argv[1:7]
max_length, block, batch = int(max_length), int(block), int(batch)
pipe = GenerationPipeline(path, max_length=max_length, mode=mode, block_size=block, block_capture=True)
prompt = np.load(path.replace(".onnx", ".golden.npz"))["prompt"]
prompt = np.repeat(prompt, batch, axis=0)
greedy = pipe.generate(prompt, 32)
out = {"greedy": greedy.tokens.tolist()}
positions = np.repeat(np.arange(prompt.shape[1])[None], batch, axis=0)
feeds = {"input_ids": prompt, "attention_mask": np.ones_like(prompt), "position_ids": positions}
feeds = {k: v for k, v in feeds.items() if k in pipe.prefill_model.input_names}
layout = pipe.decoder(batch).layout
for name in pipe.past_names:
    shape = list(layout.buffer_shapes[name])
    shape[2] = 0  # an empty past: the prompt alone
    feeds[name] = np.zeros(shape, layout.buffer_dtypes[name])
if sample == "1":
    sampled = pipe.generate(prompt, 16, sampling=Sampling(temperature=0.8, top_p=0.9, seed=3))
    out["sampled"] = sampled.tokens.tolist()
out.update(
    calls=dict(calls),
    warm=pipe.warm_stats,
    prefill=pipe.prefill_model.stats.as_dict(),
    prefill_logits=pipe.prefill_logits,
    prefill_shape=list(pipe.prefill_model.run(feeds)["logits"].shape),
    decode=pipe.decode_model.stats.as_dict(),
    block_counters=pipe.block_model(batch, block).dsp.runtime.counters(),
    # what a warm start should never need: torch (Triton's driver imports it), Triton's compiler
    imported=sorted(m for m in ("torch", "triton.compiler.compiler") if m in sys.modules),
)
print(json.dumps(out))
"""


def run_child(
    cache: Path,
    name: str,
    max_length: int = 48,
    block: int = 4,
    batch: int = 1,
    sample: bool = True,
    mode: str = "emulated_replay",
) -> dict[str, Any]:
    """One process building the pipeline on ``cache`` and generating; what it counted."""
    env = {**os.environ, "DSP_CACHE_DIR": str(cache)}
    args = [str(FIXTURES / f"{name}.onnx"), str(max_length), str(block), str(batch), "1" if sample else "0", mode]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def golden_tokens(name: str) -> list[int]:
    return [int(t) for t in np.load(FIXTURES / f"{name}.golden.npz")["greedy_tokens"]]


@pytest.mark.parametrize("name", ["gpt2_eager", "gpt2_sdpa23", "gpt2_torchscript", "llama_eager", "llama_sdpa23"])
def test_a_second_process_reuses_the_prefill_decode_and_block_plans(tmp_path: Path, name: str) -> None:
    cold = run_child(tmp_path, name)
    warm = run_child(tmp_path, name)
    assert cold["greedy"] == warm["greedy"] == [golden_tokens(name)]
    assert cold["sampled"] == warm["sampled"]
    # cold: the graph imported once, the prefill's head cut to the last position, the decode graph
    # rewritten, two blocks unrolled, all stored
    assert cold["calls"]["import_model"] == 1 and cold["calls"]["fixed_kv_buffers"] == 1
    assert cold["calls"]["last_position_logits"] == 1
    assert cold["calls"]["unroll"] == 2 and cold["calls"]["compile_plan"] == 4
    assert cold["warm"]["writes"] == 5 and cold["warm"]["hits"] == 0
    # warm: metadata, prefill, decode plan, greedy and sampled block plans from the cache; nothing
    # imported or rewritten, and the cached prefill plan computes the last position's logits alone
    assert warm["calls"] == {}
    assert warm["warm"]["hits"] == 5 and warm["warm"]["misses"] == 0 and warm["warm"]["writes"] == 0
    assert cold["prefill_logits"] == warm["prefill_logits"] == "last position"
    assert cold["prefill_shape"] == warm["prefill_shape"] == [1, 1, 1000]
    assert warm["warm"]["graph_imports"] == 0 and warm["warm"]["rewrites"] == 0
    assert warm["prefill"]["disk_hits"] == 1 and warm["decode"]["disk_hits"] == 1
    # every big constant of the decode and block plans came from memory: each weight read once
    assert warm["warm"]["weights_shared"] > 0
    # the cached plans capture and replay as the built ones do
    assert warm["block_counters"]["captures"] == cold["block_counters"]["captures"] == 1
    assert warm["block_counters"]["recaptures"] == 0


def _decode_object(cache: Path, name: str, max_length: int = 48, batch: int = 1) -> Path:
    """The object file of the decode-plan entry the pipeline of ``name`` stores under ``cache``."""
    store = _store(cache, name)
    disk = store.cache
    ref = json.loads(disk.ref_path(store.key("decode", {"batch": batch, "max_length": max_length})).read_text())
    return cache / "objects" / ref["object"]


def _store(cache: Path, name: str) -> PlanStore:
    old = os.environ.get("DSP_CACHE_DIR")
    os.environ["DSP_CACHE_DIR"] = str(cache)
    try:
        return PlanStore(str(FIXTURES / f"{name}.onnx"))
    finally:
        if old is not None:
            os.environ["DSP_CACHE_DIR"] = old


def test_a_damaged_cached_decode_plan_is_quarantined_and_rebuilt(tmp_path: Path) -> None:
    name = "gpt2_eager"
    cold = run_child(tmp_path, name, sample=False)
    obj = _decode_object(tmp_path, name)
    blob = bytearray(obj.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte in the middle of the plan
    obj.write_bytes(bytes(blob))
    damaged = run_child(tmp_path, name, sample=False)
    assert damaged["greedy"] == cold["greedy"] == [golden_tokens(name)]
    assert damaged["calls"].get("fixed_kv_buffers") == 1  # the decode plan was rebuilt...
    assert damaged["calls"].get("unroll") is None  # ...the block plan still came from the cache
    assert damaged["warm"]["writes"] == 1 and damaged["warm"]["hits"] == 3  # metadata, prefill, block
    assert list((tmp_path / "quarantine").glob("objects-*.reason")), "the damaged object was not quarantined"
    healed = run_child(tmp_path, name, sample=False)
    assert healed["calls"] == {} and healed["warm"]["hits"] == 4 and healed["greedy"] == cold["greedy"]


def test_an_entry_that_passes_the_checksum_but_is_not_a_plan_is_rejected(tmp_path: Path) -> None:
    name = "gpt2_eager"
    cold = run_child(tmp_path, name, sample=False)
    store = _store(tmp_path, name)
    params = {"batch": 1, "max_length": 48}
    # Well-formed for the disk cache, but its JSON claims other parameters and its plan is garbage.
    store.cache.put(store.key("decode", params), encode({"format": "dsp-llm-entry/1", "kind": "decode"}, b"DSP1junk"))
    bad = run_child(tmp_path, name, sample=False)
    assert bad["greedy"] == cold["greedy"]
    assert bad["warm"]["rejects"] == 1 and bad["calls"].get("fixed_kv_buffers") == 1
    assert run_child(tmp_path, name, sample=False)["calls"] == {}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path))
    return tmp_path


def _pipe(max_length: int = 40, block: int = 4) -> GenerationPipeline:
    return GenerationPipeline(FIXTURES / "gpt2_eager.onnx", max_length=max_length, block_size=block, block_capture=True)


def test_a_different_max_length_batch_or_block_size_is_a_miss(cache_dir: Path) -> None:
    prompt = np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"]
    first = _pipe()
    expected = first.generate(prompt, 12).tokens
    assert first.warm_stats["writes"] == 4  # metadata, prefill, decode, block
    same = _pipe()
    assert (same.generate(prompt, 12).tokens == expected).all()
    assert same.warm_stats["hits"] == 4 and same.warm_stats["rewrites"] == 0

    longer = _pipe(max_length=44)  # new decode and block plans; the metadata and prefill plan are the model's
    assert (longer.generate(prompt, 12).tokens == expected).all()
    assert longer.warm_stats["hits"] == 2 and longer.warm_stats["rewrites"] == 2
    assert longer.warm_stats["writes"] == 2

    other_k = _pipe(block=2)  # the decode plan is reused, the block plan is new
    assert (other_k.generate(prompt, 12).tokens == expected).all()
    assert other_k.warm_stats["hits"] == 3 and other_k.warm_stats["writes"] == 1

    two = _pipe()  # batch 2: a decode plan of its own
    rows = two.generate(np.repeat(prompt, 2, axis=0), 12).tokens
    assert (rows == np.repeat(expected, 2, axis=0)).all()
    assert two.warm_stats["hits"] == 2 and two.warm_stats["writes"] == 2  # decode and block of batch 2

    sampled = _pipe()  # a sampling setting is part of the block key; the seed is not
    a = sampled.generate(prompt, 12, sampling=Sampling(temperature=0.7, seed=1)).tokens
    b = _pipe().generate(prompt, 12, sampling=Sampling(temperature=0.7, seed=1)).tokens
    assert (a == b).all()


def test_the_cache_off_builds_everything_and_stores_nothing(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSP_DISK_CACHE", "0")
    prompt = np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"]
    for _ in range(2):
        pipe = _pipe()
        assert pipe.generate(prompt, 8).token_list() == golden_tokens("gpt2_eager")[:8]
        assert pipe.warm_stats["hits"] == 0 and pipe.warm_stats["writes"] == 0 and pipe.warm_stats["rewrites"] == 3
    assert not list(cache_dir.rglob("*.dsp1"))


def test_a_graph_given_directly_has_no_warm_start(cache_dir: Path) -> None:
    import dsp_core as dsp

    graph = dsp.compile(FIXTURES / "gpt2_eager.onnx").graph
    pipe = GenerationPipeline(graph, max_length=40)
    prompt = np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"]
    assert pipe.generate(prompt, 8).token_list() == golden_tokens("gpt2_eager")[:8]
    assert pipe.warm_stats["writes"] == 0 and not pipe.store.enabled


def test_the_start_phases_add_up(cache_dir: Path) -> None:
    import time

    t0 = time.perf_counter()
    pipe = _pipe()
    pipe.generate(np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"], 8)
    wall = time.perf_counter() - t0
    assert {"prefill plan", "metadata", "decode plan", "decode warm-up", "prefill"} <= set(pipe.timings)
    assert all(v >= 0 for v in pipe.timings.values())
    # each phase counts only its own time: together they never exceed the wall time
    assert sum(pipe.timings.values()) <= wall


def test_an_entry_of_another_kind_is_never_taken(cache_dir: Path) -> None:
    pipe = _pipe()
    pipe.generate(np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"], 4)
    store = pipe.store
    meta = store.cache.get(store.key("meta", {}))
    assert meta is not None
    # the metadata entry copied under the decode plan's key: its JSON names another kind
    store.cache.put(store.key("decode", {"batch": 1, "max_length": 40}), meta)
    again = _pipe()
    again.decoder(1)
    assert again.warm_stats["rejects"] == 1 and again.warm_stats["rewrites"] == 1
    assert isinstance(DiskCache.from_config().info()["quarantine_count"], int)


def test_dsp_generate_reports_the_start_and_a_second_run_is_warm(tmp_path: Path) -> None:
    from conftest import run_cli

    args = ("generate", str(FIXTURES / "gpt2_eager.onnx"), "--prompt-ids", "3,14,15,92", "--max-new-tokens", "6")
    env = {"DSP_CACHE_DIR": str(tmp_path)}
    cold = run_cli(*args, "--json", env=env)
    warm = run_cli(*args, "--json", env=env)
    assert cold.returncode == warm.returncode == 0, cold.stderr + warm.stderr
    c, w = json.loads(cold.stdout), json.loads(warm.stdout)
    assert c["tokens"] == w["tokens"]
    assert c["start"]["warm"]["writes"] == 3 and c["start"]["warm"]["graph_imports"] == 1  # metadata, prefill, decode
    assert w["start"]["warm"]["hits"] == 3 and w["start"]["warm"]["graph_imports"] == 0
    assert c["start"]["prefill_logits"] == w["start"]["prefill_logits"] == "last position"
    assert {"prefill plan", "decode plan", "decode warm-up"} <= set(w["start"]["seconds"])
    text = run_cli(*args, env=env)
    assert text.returncode == 0
    assert "start " in text.stderr and "(3 cached, 0 stored)" in text.stderr
    assert "prefill logits" not in text.stderr  # said only when the head was not found
