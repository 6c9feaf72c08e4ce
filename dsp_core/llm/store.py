"""A GenerationPipeline's warm start: its prefill, decode and block plans and its metadata in the disk cache.

The pipeline's plans are plans of *rewritten* graphs: the prefill plan's LM head reads
the last position only (``last_position_logits``), the decode plan has fixed KV buffers
(``fixed_kv_buffers``), the K-step block plans unroll it (``unroll``); so ``dsp.compile``'s
entry of the model as exported cannot hold any of them. And the pipeline needs a few
facts that only the graph knows (its KV inputs, the vocabulary and position tables'
sizes). Without this module a second process would import the whole graph and rewrite
and compile it again. With it, the pipeline stores:

- ``meta``: the model's name, its ``past_key_values.*`` inputs, its table limits;
- ``prefill``: the prefill plan, and whether its logits are the last position's alone;
- ``decode``: per (batch, max_length), the decode plan and its KV layout;
- ``block``: per (batch, max_length, k, sampling), the block plan;

each in one DiskCache entry (atomic writes, checksummed, quarantined when damaged),
keyed by the model's content key (``loader.model_key``: blake2b of its bytes and its
external data, DSP's version) plus every parameter that changes the rewritten graph
and a digest of the rewriting code itself (kv.py, block.py, limits.py, lm_head.py, this
file). The DiskCache's build fingerprint covers the importer, the op table, the plan
compiler and DSP1. Mode and backends are not part of a key: a plan is mode-free, and the
auction runs on the loaded plan in every process, as for ``dsp.compile``.

An entry's payload: ``DSPL`` + u16 version + u32 JSON length + JSON + the DSP1 plan (none
for ``meta``). The JSON repeats the entry's kind and parameters; one that disagrees, does
not parse, or whose plan fails to load is rejected (quarantined) and rebuilt: a cache can
make a start faster, never wrong.

Big constants are stored by digest (the same weight files as ``dsp.compile``'s), and
every plan of one pipeline shares one in-memory copy of each: the weights are read from
disk once per process. ``fetch`` starts reading an entry's weights on background threads
(``DiskCache.prefetch``, every check of ``DiskCache.weight`` included) before its plan is
decoded, so the pipeline discovers the backends meanwhile; ``Fetched.load`` decodes the
plan, taking each weight in its own thread.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsp_core import diag
from dsp_core.cache.disk import DiskCache, WeightPrefetch, source_digest
from dsp_core.counters import Counters
from dsp_core.plan import serialize
from dsp_core.plan.plan import Plan

log = logging.getLogger("dsp.cache")

MAGIC = b"DSPL"
VERSION = 1
FORMAT = "dsp-llm-entry/1"
_HEAD = struct.Struct("<4sHI")  # magic, version, JSON length
_MAX_JSON = 1 << 24
KINDS = ("meta", "prefill", "decode", "block")
# The code that decides the rewritten graphs and the metadata (a change invalidates every entry).
REWRITE_CODE = ("kv.py", "block.py", "limits.py", "lm_head.py", "store.py")


class EntryError(ValueError):
    """A pipeline cache entry is not what its key promises (the reason says how)."""


@dataclass
class WarmStats(Counters):
    """What a pipeline's start took from the disk cache and what it had to build (this process)."""

    hits: int = 0  # entries read and used: metadata, prefill, decode and block plans
    misses: int = 0  # entries looked up and not found (or the cache is off)
    writes: int = 0  # entries stored
    rejects: int = 0  # entries found unusable: quarantined, then rebuilt
    graph_imports: int = 0  # the model's whole graph was needed (cold start, or a miss)
    rewrites: int = 0  # graph rewrites compiled: the prefill's last-position head, fixed-KV, block unrolls
    weights_shared: int = 0  # big constants a cached plan took from memory instead of reading them again


@functools.lru_cache(maxsize=1)
def rewrite_code_digest() -> str:
    """blake2b-8 of the pipeline's rewriting code (REWRITE_CODE): part of every entry's key."""
    here = Path(__file__).resolve().parent
    return source_digest([here / name for name in REWRITE_CODE], here)


def encode(info: dict[str, Any], plan: bytes = b"") -> bytes:
    """An entry's payload: header, JSON ``info``, the DSP1 plan bytes."""
    text = json.dumps(info, sort_keys=True).encode()
    return _HEAD.pack(MAGIC, VERSION, len(text)) + text + plan


def decode(payload: bytes, kind: str, params: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """(JSON info, DSP1 plan bytes) of an entry; EntryError when it is not the entry ``kind``/``params`` asked for."""
    if len(payload) < _HEAD.size:
        raise EntryError(f"truncated: {len(payload)} bytes, shorter than the {_HEAD.size}-byte header")
    magic, version, n = _HEAD.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise EntryError(f"not a pipeline entry of version {VERSION} (magic {magic!r}, version {version})")
    if n > min(_MAX_JSON, len(payload) - _HEAD.size):
        raise EntryError(f"JSON length {n} runs past the {len(payload)}-byte payload")
    try:
        info = json.loads(payload[_HEAD.size : _HEAD.size + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EntryError(f"garbage JSON: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise EntryError(f"expected a JSON object of format {FORMAT!r}")
    if info.get("kind") != kind or info.get("params") != params:
        raise EntryError(f"entry of {info.get('kind')!r} {info.get('params')!r}, asked for {kind!r} {params!r}")
    return info, payload[_HEAD.size + n :]


@dataclass
class Fetched:
    """An entry read from the disk cache (``PlanStore.fetch``), its weights being read ahead until ``load``."""

    store: PlanStore
    kind: str
    params: dict[str, Any]
    info: dict[str, Any]
    blob: bytes  # the DSP1 plan (empty for ``meta``)
    prefetch: WeightPrefetch | None

    def load(self) -> tuple[dict[str, Any], Plan | None] | None:
        """(JSON info, plan), as ``PlanStore.get`` returns it: None when the plan is rejected."""
        return self.store._load(self)


class PlanStore:
    """The disk-cache entries of one pipeline's model (see the module doc); off when the model has no key."""

    def __init__(self, source: Any, base_dir: str | os.PathLike[str] | None = None) -> None:
        from dsp_core import __version__
        from dsp_core.runtime.loader import model_key

        self.stats = WarmStats()
        self.cache = DiskCache.from_config()
        diag.watch_disk_cache(self.cache)
        keyed = source is not None and self.cache.enabled
        self.model_key = model_key(source, __version__, base_dir, self.cache) if keyed else None
        self._weights: dict[str, np.ndarray] = {}  # digest hex -> a big constant already in memory
        self._digests: dict[int, tuple[np.ndarray, bytes]] = {}  # id(array) -> (array, digest): no re-hash

    @property
    def enabled(self) -> bool:
        """True when entries can be read and written (the cache is on and the model has a content key)."""
        return self.model_key is not None

    def key(self, kind: str, params: dict[str, Any]) -> str:
        """The DiskCache key of one entry."""
        assert self.model_key is not None
        spelled = json.dumps(params, sort_keys=True)
        return DiskCache.key("dsp-llm", kind, self.model_key, rewrite_code_digest(), spelled)

    # -- weights shared between the plans of one pipeline ---------------------------------
    def share(self, plan: Plan | None) -> None:
        """Offer ``plan``'s big constants to the plans loaded or stored after it (by digest, by identity)."""
        from dsp_core.runtime.loader import big_constants

        if plan is None:
            return
        for owner, k in big_constants(plan):
            array, digest = owner.constants[k], owner.constant_digests.get(k)
            if digest is not None:
                self._weights.setdefault(digest.hex(), array)
                self._digests[id(array)] = (array, digest)

    def _weight(self, digest: str, nbytes: int, prefetch: WeightPrefetch | None = None) -> Any:
        """``serialize.loads``'s by_digest: a constant already in memory, else the cache's weight file
        (read ahead by the entry's ``prefetch`` when it has one: see ``fetch``)."""
        array = self._weights.get(digest)
        if array is not None and array.nbytes == nbytes:
            self.stats.weights_shared += 1
            return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if prefetch is not None:
            taken, data = prefetch.take(digest, nbytes)
            if taken:
                return data
        return self.cache.weight(digest, nbytes)

    def _seed_digests(self, plan: Plan) -> None:
        """Give ``plan`` the digests of constants it shares with an earlier plan (hashing 100s of MB costs)."""
        from dsp_core.runtime.loader import big_constants

        for owner, k in big_constants(plan):
            known = self._digests.get(id(owner.constants[k]))
            if known is not None and known[0] is owner.constants[k]:
                owner.constant_digests.setdefault(k, known[1])

    # -- entries --------------------------------------------------------------------------
    def get(self, kind: str, params: dict[str, Any]) -> tuple[dict[str, Any], Plan | None] | None:
        """(JSON info, plan) of an entry, or None on a miss; a damaged or wrong entry is rejected and missed."""
        fetched = self.fetch(kind, params)
        return None if fetched is None else fetched.load()

    def fetch(self, kind: str, params: dict[str, Any]) -> Fetched | None:
        """An entry read from the cache, its plan not yet decoded, or None on a miss (or a rejected entry).

        The weights its plan stores by reference and that no plan in memory holds are
        being read on background threads (``DiskCache.prefetch``) until ``Fetched.load``
        decodes the plan, so the caller can do other work meanwhile (the pipeline
        discovers the backends). Each weight is checked as a read in the caller's thread
        checks it, and what its read raised is raised in the thread that loads.
        """
        if not self.enabled:
            self.stats.misses += 1
            return None
        key = self.key(kind, params)
        payload = self.cache.get(key)
        if payload is None:
            self.stats.misses += 1
            return None
        try:
            info, blob = decode(payload, kind, params)
        except Exception as exc:  # noqa: BLE001  (whatever an entry holds, it only costs a rebuild)
            self.reject(kind, params, exc)
            return None
        prefetch = None
        if blob:
            wanted = [(d, n) for d, n in serialize.referenced_weights(blob) if not self._in_memory(d, n)]
            prefetch = self.cache.prefetch(wanted)
        return Fetched(self, kind, params, info, blob, prefetch)

    def _in_memory(self, digest: str, nbytes: int) -> bool:
        array = self._weights.get(digest)
        return array is not None and array.nbytes == nbytes

    def _load(self, fetched: Fetched) -> tuple[dict[str, Any], Plan | None] | None:
        kind, params, prefetch = fetched.kind, fetched.params, fetched.prefetch

        def weight(digest: str, nbytes: int) -> Any:
            return self._weight(digest, nbytes, prefetch)

        try:
            plan = serialize.loads(fetched.blob, by_digest=weight) if fetched.blob else None
        except Exception as exc:  # noqa: BLE001  (whatever an entry holds, it only costs a rebuild)
            self.reject(kind, params, exc)
            return None
        finally:
            if prefetch is not None:
                prefetch.cancel()  # a plan that failed to decode reads no more of its weights
        if kind != "meta" and plan is None:
            self.reject(kind, params, EntryError(f"a {kind} entry without its plan"))
            return None
        self.share(plan)
        return fetched.info, plan

    def hit(self) -> None:
        """Count an entry that was used (get's caller decides: its info may still fail a check)."""
        self.stats.hits += 1

    def reject(self, kind: str, params: dict[str, Any], exc: BaseException) -> None:
        """Quarantine an entry its user found unusable; the caller rebuilds it."""
        self.stats.rejects += 1
        if self.enabled:
            self.cache.reject(self.key(kind, params), f"{type(exc).__name__}: {exc}")
        log.warning("DSP disk cache: pipeline %s entry %s rejected (%s); rebuilding it", kind, params, exc)

    def put(self, kind: str, params: dict[str, Any], info: dict[str, Any], plan: Plan | None = None) -> bool:
        """Store an entry (its plan's big constants as weight files first); False when off or not stored."""
        from dsp_core.runtime.loader import INLINE_LIMIT, put_weights

        if not self.enabled:
            return False
        blob = b""
        if plan is not None:
            self._seed_digests(plan)
            try:
                blob = serialize.dumps(plan, inline_limit=INLINE_LIMIT)
            except Exception as exc:  # noqa: BLE001  (a plan DSP1 cannot hold is built each time)
                log.info("DSP disk cache: pipeline %s plan %s not stored: %s", kind, params, exc)
                return False
            if not put_weights(self.cache, plan):
                return False
            self.share(plan)
        info = {**info, "format": FORMAT, "kind": kind, "params": params}
        if self.cache.put(self.key(kind, params), encode(info, blob)) is None:
            return False
        self.stats.writes += 1
        return True
