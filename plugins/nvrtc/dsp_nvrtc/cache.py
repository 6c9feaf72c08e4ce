"""The segment cache of NVRTC_JIT (and what PTX_JIT reads): compiled kernels on disk.

One file per kernel under ``<DSP cache directory>/nvrtc`` (``DSP_CACHE_DIR``), named by the
digest of its ``JitSegmentCacheKey``. A file is a magic line, one JSON header line (the
key, the kernel's name, the lengths and blake2b digest of what follows) and the generated
source followed by the binary (PTX or CUBIN). Every write is atomic (a temporary file in
the same folder, then a rename), so a reader sees the old entry or the whole new one. An
entry that does not parse, whose digest or key does not match, is damaged: it is removed,
said in the log, and the kernel is compiled again, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dsp_core import config
from dsp_core.cache.disk import atomic_write, default_cache_dir

log = logging.getLogger("dsp.nvrtc")
MAGIC = b"DSPNVRTC1\n"


@dataclass(frozen=True)
class JitSegmentCacheKey:
    """What decides a compiled kernel: each field a reason for a miss."""

    group: str  # digest of the group's generated source: its nodes, wiring and baked constants
    shapes: tuple[tuple[int, ...], ...]  # the kernel's arguments, in parameter order
    dtypes: tuple[str, ...]
    capability: str  # the target: "sm_90" (a CUBIN for that GPU) or "compute_75" (PTX)
    options: tuple[str, ...]  # NVRTC options
    compiler: str  # "nvrtc 13.0"

    def digest(self) -> str:
        """The entry's file name stem."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def differs(self, other: JitSegmentCacheKey) -> list[str]:
        """The fields that differ from ``other`` (why one is not the other's entry)."""
        mine, theirs = asdict(self), asdict(other)
        return [k for k in mine if mine[k] != theirs[k]]


def group_digest(source: str) -> str:
    """The ``group`` field of a key: the generated source's digest."""
    return hashlib.blake2b(source.encode(), digest_size=16).hexdigest()


def cache_root() -> Path:
    """``<DSP cache directory>/nvrtc``."""
    root = config.get("cache_dir")
    base = Path(root).expanduser() if root else default_cache_dir(os.environ)
    return base / "nvrtc"


@dataclass(frozen=True)
class Entry:
    """A compiled kernel as stored."""

    name: str
    source: str
    binary: bytes


class SegmentCache:
    """Compiled kernels by key, on disk (atomic writes; a damaged entry is removed and recompiled)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_root()
        self.hits = 0
        self.misses = 0
        self.damaged = 0

    def path(self, key: JitSegmentCacheKey) -> Path:
        return self.root / f"{key.digest()}.kernel"

    def get(self, key: JitSegmentCacheKey) -> Entry | None:
        """The entry for ``key``, or None (absent, or damaged: then removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        entry, why = _parse(data, key)
        if entry is None:
            self.damaged += 1
            self.misses += 1
            log.warning("DSP NVRTC: cache entry %s is damaged (%s): removed, the kernel is compiled again", path, why)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.hits += 1
        return entry

    def put(self, key: JitSegmentCacheKey, entry: Entry) -> Path | None:
        """Store ``entry`` atomically; None when the cache directory cannot be written (said in the log)."""
        source = entry.source.encode()
        digest = hashlib.blake2b(source + entry.binary, digest_size=20).hexdigest()
        header = {
            "key": asdict(key),
            "name": entry.name,
            "source_bytes": len(source),
            "binary_bytes": len(entry.binary),
            "blake2b": digest,
        }
        path = self.path(key)
        try:
            atomic_write(path, MAGIC, json.dumps(header).encode() + b"\n", source, entry.binary)
        except OSError as exc:
            log.warning("DSP NVRTC: cannot write the kernel cache at %s (%s): compiled kernels are not kept", path, exc)
            return None
        return path


def _parse(data: bytes, key: JitSegmentCacheKey) -> tuple[Entry | None, str]:
    if not data.startswith(MAGIC):
        return None, "no DSPNVRTC1 magic"
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        return None, "no header"
    try:
        header = json.loads(data[len(MAGIC) : end])
        n_src, n_bin = int(header["source_bytes"]), int(header["binary_bytes"])
        stored = header["key"]
        name = str(header["name"])
        want = str(header["blake2b"])
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable header ({type(exc).__name__})"
    body = data[end + 1 :]
    if len(body) != n_src + n_bin:
        return None, f"{len(body)} bytes where the header says {n_src + n_bin}"
    if hashlib.blake2b(body, digest_size=20).hexdigest() != want:
        return None, "digest mismatch"
    if stored != json.loads(json.dumps(asdict(key))):
        return None, "it holds another key"
    try:
        source = body[:n_src].decode()
    except UnicodeDecodeError:
        return None, "source not UTF-8"
    return Entry(name, source, body[n_src:]), ""
