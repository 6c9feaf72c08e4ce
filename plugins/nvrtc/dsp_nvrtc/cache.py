"""Compiled kernels on disk: NVRTC_JIT's segment cache, and the PTX bundle PTX_JIT reads.

One file per kernel under ``<DSP cache directory>/nvrtc`` (``DSP_CACHE_DIR``), named by the
digest of its ``JitSegmentCacheKey``. A file is a magic line, one JSON header line (the
key, the kernel's name, the lengths and blake2b digest of what follows) and the generated
source followed by the binary (PTX or CUBIN). Every write is atomic (a temporary file in
the same folder, then a rename), so a reader sees the old entry or the whole new one. An
entry that does not parse, whose digest or key does not match, is damaged: it is removed,
said in the log, and the kernel is compiled again, never loaded. ``PtxBundle``: below.
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


def _dsp_cache_dir() -> Path:
    root = config.get("cache_dir")
    return Path(root).expanduser() if root else default_cache_dir(os.environ)


def cache_root() -> Path:
    """``<DSP cache directory>/nvrtc``."""
    return _dsp_cache_dir() / "nvrtc"


def bundle_root() -> Path:
    """The PTX bundle's folder: ``DSP_PTX_DIR``, else ``<DSP cache directory>/ptx``."""
    root = config.get("ptx_dir")
    return Path(root).expanduser() if root else _dsp_cache_dir() / "ptx"


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


PTX_MAGIC = b"DSPPTX1\n"


class PtxBundle:
    """Generated kernels as PTX, by the digest of their CUDA C and the PTX's virtual architecture.

    NVRTC_JIT writes it (``DSP_NVRTC_EXPORT_PTX=1``); PTX_JIT reads it on machines without NVRTC:
    the generator runs anywhere (pure Python), so PTX_JIT generates a group's CUDA C as NVRTC_JIT
    would, and looks for its PTX here. A file is a magic line, one JSON header line (the kernel's
    name, the architecture, the source's digest, the PTX's length and digest) and the PTX. Writes
    are atomic. A file that does not parse, or holds another kernel, is left where it is (the
    bundle is the user's: copied from another machine) and said in the log; the group then runs
    its reference kernels.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else bundle_root()
        self.hits = 0
        self.misses = 0
        self.damaged = 0

    def path(self, name: str, source: str, arch: str) -> Path:
        return self.root / f"{group_digest(name + chr(0) + source)}.{arch}.ptx"

    def put(self, name: str, source: str, arch: str, ptx: bytes) -> Path | None:
        """Store ``ptx`` (``source`` compiled for ``arch``) atomically; None when the folder cannot be written."""
        ptx = ptx.rstrip(b"\0")
        header = {
            "name": name,
            "arch": arch,
            "source": group_digest(source),
            "ptx_bytes": len(ptx),
            "blake2b": hashlib.blake2b(ptx, digest_size=20).hexdigest(),
        }
        path = self.path(name, source, arch)
        try:
            atomic_write(path, PTX_MAGIC, json.dumps(header).encode() + b"\n", ptx)
        except OSError as exc:
            log.warning("DSP NVRTC: cannot write the PTX bundle at %s (%s): PTX not exported", path, exc)
            return None
        return path

    def get(self, name: str, source: str, arch: str) -> bytes | None:
        """The PTX of ``source``'s kernel ``name`` for ``arch`` (NUL-terminated), or None (absent or damaged)."""
        path = self.path(name, source, arch)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        why = _ptx_damage(data, name, source, arch)
        if why:
            self.damaged += 1
            self.misses += 1
            log.warning("DSP PTX_JIT: bundle file %s is damaged (%s): not loaded", path, why)
            return None
        self.hits += 1
        return data[data.index(b"\n", len(PTX_MAGIC)) + 1 :] + b"\0"


def _ptx_damage(data: bytes, name: str, source: str, arch: str) -> str:
    """Why a bundle file is not ``name``'s PTX for ``arch`` ("" when it is)."""
    if not data.startswith(PTX_MAGIC):
        return "no DSPPTX1 magic"
    end = data.find(b"\n", len(PTX_MAGIC))
    if end < 0:
        return "no header"
    try:
        header = json.loads(data[len(PTX_MAGIC) : end])
        want = (str(header["name"]), str(header["arch"]), str(header["source"]), int(header["ptx_bytes"]))
        digest = str(header["blake2b"])
    except (ValueError, KeyError, TypeError):
        return "unreadable header"
    body = data[end + 1 :]
    if want != (name, arch, group_digest(source), len(body)):
        return "it holds another kernel, or is cut short"
    if hashlib.blake2b(body, digest_size=20).hexdigest() != digest:
        return "digest mismatch"
    return ""
