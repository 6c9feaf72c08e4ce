"""``dsp.compile`` with the disk cache: a warm start skips import, shape inference and compiling.

The entry of a model is keyed by what identifies its bytes without reading them all (a
file's resolved path, size and modification time; the digest of given bytes or proto)
plus DSP's version. Its payload is the default-output plan in DSP1 with large constants
by reference; those constants are stored as weight files keyed by their digest and are
memory-mapped back. Any entry that fails to load is rejected (quarantined) and the model
compiled again: a cache can make DSP faster, never wrong.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from dsp_core import diag
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.cache.disk import DiskCache
from dsp_core.cache.memory import CacheStats
from dsp_core.errors import DSPError
from dsp_core.ir.onnx_import import import_model
from dsp_core.plan import serialize
from dsp_core.plan.plan import ExternalClass, Plan
from dsp_core.runtime.model import CompiledModel

log = logging.getLogger("dsp.cache")
_INLINE_LIMIT = 1 << 16  # constants larger than this live in weight files


def model_key(source: Any, version: str) -> str | None:
    """The disk-cache key of a model source, or None when it cannot be keyed cheaply."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).resolve()
        try:
            st = path.stat()
        except OSError:
            return None
        ident = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    elif isinstance(source, bytes):
        ident = hashlib.sha256(source).hexdigest()
    else:  # an onnx.ModelProto
        ident = hashlib.sha256(source.SerializeToString()).hexdigest()
    return DiskCache.key("dsp-model", ident, version)


def compile_cached(
    source: Any, mode: GraphExecutionMode, strict: bool, version: str, force_recompile: bool = False
) -> CompiledModel:
    """Compile ``source`` for ``mode``, through the disk cache when it is on."""
    cache = DiskCache.from_config()
    diag.watch_disk_cache(cache)  # diag: quarantines, read/write errors -> CACHE events
    stats = CacheStats()
    key = model_key(source, version) if cache.enabled else None
    if key is not None and not force_recompile:
        model = _warm(cache, key, source, mode, strict, stats)
        if model is not None:
            return model
    model = CompiledModel(import_model(source), mode, strict, stats=stats)
    if key is not None:
        _store(cache, key, model, stats)
    return model


def _warm(
    cache: DiskCache, key: str, source: Any, mode: GraphExecutionMode, strict: bool, stats: CacheStats
) -> CompiledModel | None:
    payload = cache.get(key)
    stats.quarantines = cache.stats.quarantines
    if payload is None:
        return None
    initializers = _LazyInitializers(source)
    try:
        # Weights come from the cache's files; one evicted (or damaged) is read from the
        # model itself, checked against the same digest, rather than recompiling.
        plan = serialize.loads(payload, by_digest=cache.weight, resolve=initializers.get)
        model = CompiledModel(None, mode, strict, plan=plan, load_graph=initializers.graph, stats=stats)
    except DSPError as exc:
        cache.reject(key, f"{type(exc).__name__}: {exc}")
        stats.quarantines += 1
        log.warning("DSP disk cache: entry for %s rejected (%s); recompiling", _describe(source), exc)
        return None
    stats.disk_hits += 1
    stats.quarantines = cache.stats.quarantines  # weights found damaged while loading
    if initializers.used:  # heal: put back the weights that had to come from the model
        for owner, k in _big_constants(plan):
            cache.put_weight(owner.digest_of(k).hex(), owner.constants[k])
    return model


def _store(cache: DiskCache, key: str, model: CompiledModel, stats: CacheStats) -> None:
    plan = model.plan()
    if plan is None or any(v.kind != "tensor" for v in model.graph.inputs):
        return  # declined graphs and sequence/optional inputs are compiled each time
    try:
        payload = serialize.dumps(plan, inline_limit=_INLINE_LIMIT)
    except DSPError as exc:
        log.info("DSP disk cache: plan of %s not stored: %s", _describe(model), exc)
        return
    for owner, k in _big_constants(plan):
        if cache.put_weight(owner.digest_of(k).hex(), owner.constants[k]) is None:
            return
    if cache.put(key, payload) is not None:
        stats.disk_writes += 1


def _big_constants(plan: Plan) -> list[tuple[Plan, int]]:
    """(plan, constant index) of every constant stored by reference, sub-plans included."""
    out = [
        (plan, k)
        for k, a in plan.constants.items()
        if a.nbytes > _INLINE_LIMIT and plan.externals[k].cls is ExternalClass.CONSTANT
    ]
    for region in plan.regions.values():
        for sub in region.subplans.values():
            out += _big_constants(sub)
    return out


class _LazyInitializers:
    """The model's graph and initializers, imported only if a warm start needs them."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._graph: Any = None

    @property
    def used(self) -> bool:
        """True once the model had to be imported."""
        return self._graph is not None

    def graph(self) -> Any:
        """The imported graph (with static shape inference, as a cold compile does)."""
        if self._graph is None:
            self._graph = import_model(self._source)
        return self._graph

    def get(self, name: str) -> Any:
        """An initializer by name, or None."""
        return self.graph().initializers.get(name)


def _describe(source: Any) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
