"""A warm pipeline reads its prefill plan's weights on background threads (DiskCache.prefetch).

While they are read the pipeline discovers the backends; the plan is decoded after, each
weight taken in the loading thread. Every check of a weight read in the caller's thread
still applies (kind, size, header, digest or stamp, quarantine of a damaged file), and what
a background read raises is raised in the thread that takes the weight.
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

from dsp_core.cache import disk
from dsp_core.cache.disk import DiskCache
from dsp_core.llm import GenerationPipeline
from dsp_core.plan import serialize

MODEL = FIXTURES / "gpt2_eager.onnx"
PROMPT = np.load(FIXTURES / "gpt2_eager.golden.npz")["prompt"]
GOLDEN = [int(t) for t in np.load(FIXTURES / "gpt2_eager.golden.npz")["greedy_tokens"]][:8]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DSP_CACHE_VERIFY_WEIGHTS", raising=False)
    return tmp_path / "cache"


def _pipe() -> GenerationPipeline:
    return GenerationPipeline(MODEL, max_length=40, mode="slot_by_slot")


def _tokens(pipe: GenerationPipeline) -> list[int]:
    return pipe.generate(PROMPT, 8).token_list()


@pytest.fixture
def cold(cache_dir: Path) -> GenerationPipeline:
    """The pipeline built once: its plans and weight files (stamped by the writer) in the cache."""
    pipe = _pipe()
    assert _tokens(pipe) == GOLDEN and pipe.warm_stats["writes"] >= 3
    return pipe


def _prefill_blob(pipe: GenerationPipeline) -> bytes:
    payload = pipe.store.cache.get(pipe.store.key("prefill", {"logits": "last"}))
    assert payload is not None
    from dsp_core.llm.store import decode

    return decode(payload, "prefill", {"logits": "last"})[1]


def _weights(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "weights").glob("*.dspw"), key=lambda p: p.stat().st_size)


def _flip_data_byte(path: Path) -> None:
    time.sleep(0.02)  # past the file system's timestamp tick: the write moves ctime, the stamp no longer holds
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 1)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0x01]))


def test_the_hint_lists_what_loads_asks_for_in_its_order(cold: GenerationPipeline) -> None:
    blob = _prefill_blob(cold)
    asked: list[tuple[str, int]] = []
    serialize.loads(blob, by_digest=lambda d, n: asked.append((d, n)) or cold.store.cache.weight(d, n))
    assert asked and serialize.referenced_weights(blob) == asked
    assert serialize.referenced_weights(b"garbage") == []
    assert serialize.referenced_weights(blob[: len(blob) // 2]) == []  # a cut plan: no section to read


def test_a_warm_pipeline_reads_its_prefill_weights_on_background_threads(
    cold: GenerationPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers: list[str] = []
    real = DiskCache.weight

    def weight(self: DiskCache, digest: str, nbytes: int) -> disk.Buffer | None:
        readers.append(threading.current_thread().name)
        return real(self, digest, nbytes)

    monkeypatch.setattr(DiskCache, "weight", weight)
    warm = _pipe()
    assert _tokens(warm) == GOLDEN
    assert warm.warm_stats["hits"] >= 3 and warm.warm_stats["rejects"] == 0 and warm.warm_stats["graph_imports"] == 0
    assert len(readers) == len(serialize.referenced_weights(_prefill_blob(warm))) > 0
    assert all(name.startswith("dsp-weight-read-") for name in readers), readers
    # the backends were discovered while they were read, in a phase of their own
    assert "discover backends" in warm.timings


def test_a_damaged_weight_read_in_the_background_is_quarantined_and_rebuilt(
    cold: GenerationPipeline, cache_dir: Path
) -> None:
    target = _weights(cache_dir)[-1]
    _flip_data_byte(target)
    damaged = _pipe()
    assert _tokens(damaged) == GOLDEN
    # the weight file quarantined with its reason; the prefill entry rejected and rebuilt from the model
    reasons = [p.read_text() for p in (cache_dir / "quarantine").glob("*.reason")]
    assert any("do not match their digest" in r for r in reasons), reasons
    assert damaged.warm_stats["rejects"] == 1 and damaged.warm_stats["graph_imports"] == 1
    assert target.exists()  # written back by the rebuild
    healed = _pipe()
    assert _tokens(healed) == GOLDEN
    assert healed.warm_stats["rejects"] == 0 and healed.warm_stats["graph_imports"] == 0


def test_an_io_error_of_a_background_read_is_reported_not_taken_for_damage(
    cold: GenerationPipeline, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk.os, "preadv", failing)
    events: list[dict[str, str]] = []
    real_emit = DiskCache._emit
    monkeypatch.setattr(
        DiskCache,
        "_emit",
        lambda self, kind, path, reason, **x: events.append({"kind": kind}) or real_emit(self, kind, path, reason, **x),
    )
    failed = _pipe()
    assert _tokens(failed) == GOLDEN  # the plan rebuilt from the model
    assert any(e["kind"] == "read_error" for e in events)
    assert not list((cache_dir / "quarantine").glob("weights-*")), "an I/O error is not damage"
    assert all(p.exists() for p in _weights(cache_dir))


def test_what_a_background_read_raises_is_raised_in_the_taking_thread(
    cold: GenerationPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    wanted = serialize.referenced_weights(_prefill_blob(cold))
    bad = wanted[0]
    real = DiskCache.weight
    threads: list[str] = []

    def weight(self: DiskCache, digest: str, nbytes: int) -> disk.Buffer | None:
        if (digest, nbytes) == bad:
            threads.append(threading.current_thread().name)
            raise MemoryError("no room for the weight")
        return real(self, digest, nbytes)

    monkeypatch.setattr(DiskCache, "weight", weight)
    prefetch = cold.store.cache.prefetch(wanted)
    assert prefetch is not None and len(prefetch) == len(set(wanted))
    with pytest.raises(MemoryError, match="no room"):
        prefetch.take(*bad)
    assert threads and threads[0].startswith("dsp-weight-read-")
    for digest, nbytes in wanted[1:]:
        taken, data = prefetch.take(digest, nbytes)
        assert taken and data is not None and bytes(data) == bytes(real(cold.store.cache, digest, nbytes) or b"")
    assert prefetch.take(*bad) == (False, None)  # taken once: a second ask reads the file itself


def test_after_cancel_the_taking_thread_reads_what_no_thread_started(cold: GenerationPipeline) -> None:
    wanted = serialize.referenced_weights(_prefill_blob(cold))
    prefetch = cold.store.cache.prefetch(wanted)
    assert prefetch is not None
    prefetch.cancel()
    for digest, nbytes in wanted:
        taken, data = prefetch.take(digest, nbytes)
        assert taken and data is not None and memoryview(data).nbytes == nbytes


def test_no_prefetch_when_the_cache_is_off_or_forced(cold: GenerationPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = serialize.referenced_weights(_prefill_blob(cold))
    assert cold.store.cache.prefetch([]) is None
    monkeypatch.setenv("DSP_FORCE_RECOMPILE", "1")
    assert DiskCache.from_config().prefetch(wanted) is None
