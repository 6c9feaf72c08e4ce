"""``dsp.compile`` with the disk cache: a warm start skips import, shape inference and compiling.

The entry of a model is keyed by its content: the blake2b of its bytes and of every
external-data file it names, plus DSP's version (a file's stat is only a memo of its
digest, re-validated; see ``file_digest``). Its payload is the default-output plan in
DSP1 with large constants by reference; those constants are stored as weight files keyed
by their digest and read back into memory, verified. Any entry that fails to load is
rejected (quarantined) and the model compiled again: a cache can make DSP faster, never
wrong.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from dsp_core import diag, progress
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.cache.disk import DiskCache, Signature, settled, stat_signature
from dsp_core.cache.memory import CacheStats
from dsp_core.errors import DSPError
from dsp_core.plan import merge, serialize
from dsp_core.plan.plan import ExternalClass, Plan
from dsp_core.runtime.model import CompiledModel

log = logging.getLogger("dsp.cache")
INLINE_LIMIT = 1 << 16  # constants larger than this live in weight files


def as_source(model: Any) -> Any:
    """``model`` when ``dsp.compile`` can key and import it (a path, bytes, an onnx.ModelProto), else a DSPError."""
    if isinstance(model, (str, os.PathLike, bytes)):
        return model
    import onnx  # only for what is neither a path nor bytes: a warm start from a path imports no onnx

    if isinstance(model, onnx.ModelProto):
        return model
    raise DSPError(f"dsp.compile takes a path, bytes, an onnx.ModelProto or a dsp Graph, not {type(model).__name__}")


def import_model(source: Any, base_dir: str | os.PathLike[str] | None = None) -> Any:
    """``dsp_core.ir.onnx_import.import_model``, imported on first use: it imports onnx, which a warm start skips."""
    from dsp_core.ir import onnx_import

    return onnx_import.import_model(source, base_dir=base_dir)


def model_key(
    source: Any, version: str, base_dir: str | os.PathLike[str] | None = None, cache: DiskCache | None = None
) -> str | None:
    """The disk-cache key of a model source: its content, external data included; None if unreadable.

    A path is keyed by the blake2b of its bytes (``file_digest``), never by its name, size
    or modification time alone, and so are the files its external data names (relative
    to its directory; for bytes or a proto, relative to ``base_dir``). ``cache`` keeps the
    digests of settled files for later processes (``DiskCache.recall_digest``). The compile
    options that change a plan (``merge.plan_options``: DSP_MERGE_PRODUCTS) are part of it.
    """
    base: Path | None
    try:
        if isinstance(source, (str, os.PathLike)):
            path = Path(source).resolve()
            if not stat.S_ISREG(path.stat().st_mode):
                return None  # a directory, FIFO...: import_model says what is wrong with it
            digest, mentions = file_digest(path, cache)
            model_bytes, base = None, path.parent
        else:
            model_bytes = source if isinstance(source, bytes) else source.SerializeToString()
            digest = hashlib.blake2b(model_bytes, digest_size=_DIGEST_SIZE).hexdigest()
            mentions = _LOCATION_KEY in model_bytes
            base = Path(base_dir).resolve() if base_dir is not None else None
        parts = [digest]
        if mentions:  # only then can it have external data: parse it to know which files
            parts += _external_parts(digest, path if model_bytes is None else model_bytes, base, cache)
    except OSError as exc:
        log.info("DSP disk cache: %s cannot be keyed (%s); compiling without the cache", _describe(source), exc)
        return None
    return DiskCache.key("dsp-model/2", *parts, version, merge.plan_options())


# -- content identity ---------------------------------------------------------------------
_DIGEST_SIZE = 32
_CHUNK = 1 << 22
_LOCATION_KEY = b"location"  # the key of every external-data entry, stored verbatim in the protobuf
_MEMO_MAX = 256
# disk.stat_signature -> (blake2b hex, mentions "location")
_memo: dict[Signature, tuple[str, bool]] = {}
_locations_memo: dict[str, tuple[str, ...]] = {}  # model content digest -> its external-data locations
_memo_lock = threading.Lock()


def file_digest(path: Path, cache: DiskCache | None = None) -> tuple[str, bool]:
    """(blake2b hex of the file's bytes, whether they contain b"location"), memoized by stat.

    The memo is only a shortcut: it is keyed by everything stat says about the file,
    ctime included (cp -p, rsync -t and tar keep mtime and size, but any write or rename
    moves ctime, which no user call can set back), and a file changed within disk.RACY_NS of
    being hashed is never memoized (git's "racy" rule: it could change again within its
    timestamp tick). In-process first, then on disk in ``cache`` (which also checks the boot
    id, so neither a reboot nor a copied cache directory can make a memo stale), so a warm
    start in a new process does not read a big model at all.
    """
    st = os.stat(path)
    sig = stat_signature(path, st)
    with _memo_lock:
        hit = _memo.get(sig)
    if hit is None and cache is not None:
        hit = cache.recall_digest(sig)
        if hit is not None:
            _memoize(sig, hit)
    if hit is not None:
        return hit
    found = _hash_file(path)
    after = os.stat(path)
    if stat_signature(path, after) == sig and settled(after):
        _memoize(sig, found)
        if cache is not None:
            cache.remember_digest(sig, *found)
    return found


def _memoize(sig: Signature, found: tuple[str, bool]) -> None:
    with _memo_lock:
        if len(_memo) >= _MEMO_MAX:
            _memo.pop(next(iter(_memo)))
        _memo[sig] = found


def _hash_file(path: Path) -> tuple[str, bool]:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    mentions, tail = False, b""
    with open(path, "rb") as f, progress.step(f"hash {path.name}", os.fstat(f.fileno()).st_size, "B") as bar:
        while n := f.readinto(buf):
            bar.advance(n)
            h.update(view[:n])
            if not mentions:
                edge = len(_LOCATION_KEY) - 1
                mentions = buf.find(_LOCATION_KEY, 0, n) >= 0 or _LOCATION_KEY in tail + bytes(view[: min(n, edge)])
                tail = bytes(view[max(0, n - edge) : n])
    return h.hexdigest(), mentions


def _external_parts(digest: str, model: Path | bytes, base: Path | None, cache: DiskCache | None) -> list[str]:
    """``location=<digest of that file>`` for every external-data file the model names."""
    parts = []
    for location in _locations(digest, model, cache):
        if base is None:
            parts.append(f"{location}=no base_dir")
            continue
        target = (base / location).resolve()
        try:
            parts.append(f"{location}={file_digest(target, cache)[0] if target.is_file() else 'not a file'}")
        except OSError as exc:
            parts.append(f"{location}=unreadable: {exc.strerror}")
    return parts


def _locations(digest: str, model: Path | bytes, cache: DiskCache | None) -> tuple[str, ...]:
    """The external-data locations of the model whose content digest this is: memoized in-process and on disk."""
    with _memo_lock:
        locations = _locations_memo.get(digest)
    if locations is not None:
        return locations
    locations = cache.recall_locations(digest) if cache is not None else None
    if locations is None:  # a function of the content alone: parsed once, then read back by every start
        locations = _external_locations(model)
        if cache is not None:
            cache.remember_locations(digest, locations)
    with _memo_lock:
        if len(_locations_memo) >= _MEMO_MAX:
            _locations_memo.pop(next(iter(_locations_memo)))
        _locations_memo[digest] = locations
    return locations


def _external_locations(model: Path | bytes) -> tuple[str, ...]:
    """The sorted external-data locations a model names (none when it does not parse: import says why)."""
    proto = _structure(model)
    if proto is None:
        return ()
    found: set[str] = set()
    graphs: list[Any] = [proto.graph]
    for function in proto.functions:
        _node_tensors(function.node, found, graphs)
    while graphs:
        g = graphs.pop()
        for t in g.initializer:
            _tensor_location(t, found)
        for sparse in g.sparse_initializer:
            _tensor_location(sparse.values, found)
            _tensor_location(sparse.indices, found)
        _node_tensors(g.node, found, graphs)
    return tuple(sorted(found))


def _structure(model: Path | bytes) -> Any:
    """The model (an onnx.ModelProto) without its big initializers' bytes (never read: the scanner seeks past
    them); None if unreadable."""
    import onnx  # here, not at the top: a warm start keys a model without importing onnx

    from dsp_core.ir import onnx_scan

    try:
        if isinstance(model, Path):
            with open(model, "rb", buffering=1 << 20) as f:
                found = onnx_scan.read_model(f, os.fstat(f.fileno()).st_size, skip_weights=True)
        else:
            found = onnx_scan.read_model(io.BytesIO(model), len(model), skip_weights=True)
        if found is not None:
            return found[0]
        proto = onnx.ModelProto()
        proto.ParseFromString(model.read_bytes() if isinstance(model, Path) else model)
    except Exception:  # noqa: BLE001  (not a model: import_model raises the real ModelLoadError)
        return None
    return proto


def _node_tensors(nodes: Any, found: set[str], graphs: list[Any]) -> None:
    for node in nodes:
        for attr in node.attribute:
            for t in [attr.t, *attr.tensors]:
                _tensor_location(t, found)
            for sparse in [attr.sparse_tensor, *attr.sparse_tensors]:
                _tensor_location(sparse.values, found)
                _tensor_location(sparse.indices, found)
            graphs += [attr.g, *attr.graphs]


def _tensor_location(t: Any, found: set[str]) -> None:
    import onnx

    if t.data_location == onnx.TensorProto.EXTERNAL:
        found.update(e.value for e in t.external_data if e.key == "location")


def compile_cached(
    source: Any,
    mode: GraphExecutionMode,
    strict: bool,
    version: str,
    force_recompile: bool = False,
    base_dir: str | os.PathLike[str] | None = None,
    placement: Any = None,
) -> CompiledModel:
    """Compile ``source`` for ``mode``, through the disk cache when it is on (``placement``: dsp_core.devices)."""
    cache = DiskCache.from_config()
    diag.watch_disk_cache(cache)  # diag: quarantines, read/write errors -> CACHE events
    stats = CacheStats()
    key = model_key(source, version, base_dir, cache) if cache.enabled else None
    if key is not None and not force_recompile:
        model = _warm(cache, key, source, mode, strict, stats, base_dir, placement)
        if model is not None:
            _store_when_learned(cache, key, model, stats)
            return model
    graph = import_model(source, base_dir=base_dir)
    with progress.step("compile plan"):
        model = CompiledModel(graph, mode, strict, stats=stats, placement=placement)
    del graph
    if key is not None and _store(cache, key, model, stats):
        _store_when_learned(cache, key, model, stats)
    return model


def _store_when_learned(cache: DiskCache, key: str, model: CompiledModel, stats: CacheStats) -> None:
    """Store the plan again when its live plans learn capture gaps, so later processes start with them."""
    model.when_plan_learns(lambda plan: _write(cache, key, plan, stats))


def _warm(
    cache: DiskCache,
    key: str,
    source: Any,
    mode: GraphExecutionMode,
    strict: bool,
    stats: CacheStats,
    base_dir: str | os.PathLike[str] | None = None,
    placement: Any = None,
) -> CompiledModel | None:
    payload = cache.get(key)
    stats.quarantines = cache.stats.quarantines
    if payload is None:
        return None
    initializers = _LazyInitializers(source, base_dir)
    try:
        # Weights come from the cache's files; one evicted (or damaged) is read from the
        # model itself, checked against the same digest, rather than recompiling.
        with progress.step("read cached weights", unit="B") as bar:

            def weight(digest: str, nbytes: int) -> memoryview | None:
                data = cache.weight(digest, nbytes)
                bar.advance(nbytes)
                return None if data is None else memoryview(data)

            plan = serialize.loads(payload, by_digest=weight, resolve=initializers.get)
    except Exception as exc:  # noqa: BLE001  (whatever a cache entry does, it only costs a recompile)
        _reject(cache, key, source, stats, exc)
        return None
    try:
        with progress.step("start cached plan"):
            model = CompiledModel(
                None, mode, strict, plan=plan, load_graph=initializers.graph, stats=stats, placement=placement
            )
    except DSPError:
        # The mode, strict or the installed backends said no (a mode nobody installed, a
        # strict failure): the plan is whole and a cold compile would say the same; keep it.
        raise
    except Exception as exc:  # noqa: BLE001
        # Not DSP's kind of "no": perhaps the entry, perhaps a backend. A cold compile
        # decides; only if it succeeds where the cached plan failed is the entry rejected.
        log.warning("DSP disk cache: the cached plan of %s failed to start (%r); compiling it", _describe(source), exc)
        cold = CompiledModel(initializers.graph(), mode, strict, stats=stats, placement=placement)
        _reject(cache, key, source, stats, exc)
        _store(cache, key, cold, stats)
        return cold
    stats.disk_hits += 1
    stats.quarantines = cache.stats.quarantines  # weights found damaged while loading
    if initializers.used:  # heal: put back the weights that had to come from the model
        for owner, k in big_constants(plan):
            cache.put_weight(owner.digest_of(k).hex(), owner.constants[k])
    return model


def _reject(cache: DiskCache, key: str, source: Any, stats: CacheStats, exc: BaseException) -> None:
    """Quarantine this build's entry for ``key``: its payload decoded or loaded wrong."""
    cache.reject(key, f"{type(exc).__name__}: {exc}")
    stats.quarantines += 1
    log.warning("DSP disk cache: entry for %s rejected (%s); recompiling", _describe(source), exc)


def _store(cache: DiskCache, key: str, model: CompiledModel, stats: CacheStats) -> bool:
    """Store the model's plan; False when it is not kept on disk (declined, non-tensor inputs)."""
    plan = model.plan()
    if plan is None or any(v.kind != "tensor" for v in model.graph.inputs):
        return False  # declined graphs and sequence/optional inputs are compiled each time
    _write(cache, key, plan, stats)
    return True


def _write(cache: DiskCache, key: str, plan: Plan, stats: CacheStats) -> None:
    try:
        payload = serialize.dumps(plan, inline_limit=INLINE_LIMIT)
    except DSPError as exc:
        log.info("DSP disk cache: plan of %s not stored: %s", plan.graph_name, exc)
        return
    if put_weights(cache, plan) and cache.put(key, payload) is not None:
        stats.disk_writes += 1


def put_weights(cache: DiskCache, plan: Plan) -> bool:
    """Store every constant ``plan`` keeps by reference as a weight file (once each); False if one failed."""
    big = big_constants(plan)
    with progress.step("store weights", sum(owner.constants[k].nbytes for owner, k in big), "B") as bar:
        for owner, k in big:
            if cache.put_weight(owner.digest_of(k).hex(), owner.constants[k]) is None:
                return False
            bar.advance(owner.constants[k].nbytes)
    return True


def big_constants(plan: Plan) -> list[tuple[Plan, int]]:
    """(plan, constant index) of every constant stored by reference, sub-plans included."""
    out = [
        (plan, k)
        for k, a in plan.constants.items()
        if a.nbytes > INLINE_LIMIT and plan.externals[k].cls is ExternalClass.CONSTANT
    ]
    for region in plan.regions.values():
        for sub in region.subplans.values():
            out += big_constants(sub)
    return out


class _LazyInitializers:
    """The model's graph and initializers, imported only if a warm start needs them."""

    def __init__(self, source: Any, base_dir: str | os.PathLike[str] | None = None) -> None:
        self._source = source
        self._base_dir = base_dir
        self._graph: Any = None

    @property
    def used(self) -> bool:
        """True once the model had to be imported."""
        return self._graph is not None

    def graph(self) -> Any:
        """The imported graph (with static shape inference, as a cold compile does)."""
        if self._graph is None:
            self._graph = import_model(self._source, base_dir=self._base_dir)
        return self._graph

    def get(self, name: str) -> Any:
        """An initializer by name, or None."""
        return self.graph().initializers.get(name)


def _describe(source: Any) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
