"""The on-disk plan cache: content-addressed entries, validated on every read, quarantined when bad.

Layout under the cache directory (docs/cache.md has the whole story)::

    objects/<fnv1a64 of payload, 16 hex>.dsp1   DSPC header + payload (a serialized DSP1 plan)
    refs/<key>                                  JSON: which object the key names, and its checksum
    quarantine/<dir>-<name>.<stamp>             a bad entry moved aside, with <...>.reason beside it

Payloads are opaque bytes here; the plan serializer owns their format.

Several processes may share one directory without a lock, because every change is a
single atomic rename of a complete file:

* an object's name is the hash of its payload, so two writers of one entry write the
  same bytes to the same name, and whichever ``os.replace`` lands last leaves an
  identical, whole file;
* the object is written before the ref that names it, so a ref appears only after its
  object does; refs are replaced atomically, so a reader sees an old or a new ref, whole;
* a reader holds an open file descriptor, so an object evicted or replaced under it
  still reads completely; an object gone before it is opened is a miss, never an error;
* a reader quarantines only the very inode it judged bad (it re-checks the inode just
  before moving it), so a good file that a concurrent writer renamed into place is
  left alone. The window between that check and the rename can, at worst, move aside a
  good file: the next lookup misses and recompiles; wrong data is never returned.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib
import importlib.metadata
import io
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsp_core import config
from dsp_core.counters import Counters
from dsp_core.errors import ConfigError
from dsp_core.plan.plan import constant_digest

log = logging.getLogger("dsp.cache")

MAGIC = b"DSPC"
FORMAT_VERSION = 1
# magic, format version, flags (must be 0), fingerprint length, payload length, blake2b-16 of payload
_HEADER = struct.Struct("<4sHHIQ16s")
OBJECT_SUFFIX = ".dsp1"
WEIGHT_MAGIC = b"DSPW"
WEIGHT_SUFFIX = ".dspw"
# magic, format version, flags (must be 0), byte length, digest of the bytes (plan.constant_digest)
_WEIGHT_HEADER = struct.Struct("<4sHHQ16s")
REF_FORMAT = "dsp-cache-ref/1"
DEFAULT_MAX_BYTES = 4 << 30  # holds the plans and weights of a few 1B-parameter fp16 models
QUARANTINE_KEEP = 64  # newest quarantined entries kept; older ones are pruned so quarantine cannot fill a disk
STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a crashed writer
_MAX_FINGERPRINT_BYTES = 1 << 16
_MAX_REF_BYTES = _MAX_FINGERPRINT_BYTES + 4096  # a ref is one line of JSON around a fingerprint
_TEMP_PREFIX = ".tmp-"
_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_OBJECT_RE = re.compile(r"[0-9a-f]{16}\.dsp1")
_WEIGHT_RE = re.compile(r"[0-9a-f]{32}\.dspw")
_TAG_RE = re.compile(r"[0-9a-f]{16}")  # a build's directory under refs/ (build_tag)
_MEMO_RE = re.compile(r"[0-9a-f]{32}\.memo")
MEMO_FORMAT = "dsp-digest-memo/1"
MEMO_KEEP = 1024  # digest memos kept (one per model or external-data file path); the oldest go first
_MAX_MEMO_BYTES = 8192
STAMP_SUFFIX = ".stamp"
_STAMP_RE = re.compile(r"[0-9a-f]{32}\.stamp")
# A file changed less than this long ago may change again within the same timestamp tick (file
# times are coarse, and a clock can lag): a digest memo or a hashing reader's stamp waits this long.
RACY_NS = 2_000_000_000
WEIGHT_TOUCH_SECONDS = 3600  # a weight file's mtime (its LRU clock) is moved at most this often: see _read_weight
_HUGE_BUFFER = 4 << 20  # weights at least this big are read into memory advised to use huge pages
_PARALLEL_READ = 32 << 20  # a read is split among threads in parts of at least this many bytes ...
_READ_THREADS = 4  # ... and at most this many threads
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_FLAG_VALUES = "1/0, true/false, yes/no, on/off"

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1
_WARNED_UNWRITABLE: set[str] = set()  # cache directories this process has warned cannot be written


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64-bit hash of ``data`` (offset basis 0xcbf29ce484222325, prime 0x100000001b3)."""
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


def object_name(payload: bytes, build_fingerprint: str) -> str:
    """File name of the object holding ``payload`` for a build: FNV-1a 64 of the object's bytes + ``.dsp1``.

    The object's bytes are its header, the build's fingerprint and the payload, so two
    builds whose plans happen to be identical still write two objects and never stamp
    each other's fingerprint on a shared one.
    """
    return _blob_name(encode_entry(payload, build_fingerprint))


def _blob_name(blob: bytes) -> str:
    return f"{fnv1a64(blob):016x}{OBJECT_SUFFIX}"


# -- build fingerprint ------------------------------------------------------------------
# What can change a stored plan: the importer (dsp_core/ir), the op table with its shape and
# dtype rules (dsp_core/ops), the plan compiler and the DSP1 serializer (dsp_core/plan), and
# the libraries they compute with (onnx's shape inference, numpy's dtype rules). Not the
# installed backends: the payload is the plan alone, and the auction cuts it into segments
# and picks their backends after it is loaded, in every process. Not the device either: no
# part of a plan depends on it (DSP1 is little-endian on every machine).
_PLAN_CODE = ("ir", "ops", "plan")  # subpackages of dsp_core whose source decides the plan


def fingerprint() -> str:
    """This build's fingerprint: what can change a plan (dsp-core, its plan-making code, DSP1, onnx, numpy)."""
    parts = [f"dsp-core={_core_version()}", f"dsp1={_dsp1_version()}", f"plan-code={plan_code_digest()}"]
    parts += [f"{lib}={_library_version(lib)}" for lib in ("onnx", "numpy")]
    return ";".join(parts)


def build_tag(build_fingerprint: str) -> str:
    """The 16 hex digits that name a build's directory of refs (blake2b of its fingerprint)."""
    return hashlib.blake2b(build_fingerprint.encode(), digest_size=8, person=b"dsp-cache-build").hexdigest()


def _core_version() -> str:
    try:
        from dsp_core import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001  (a fingerprint never fails; an unknown part just mismatches)
        return "unknown"


def _dsp1_version() -> str:
    try:
        from dsp_core.plan.serialize import VERSION

        return str(VERSION)
    except Exception:  # noqa: BLE001
        return "unknown"


def _library_version(name: str) -> str:
    """The installed distribution's version (read from its metadata: importing onnx costs a warm start ~40 ms)."""
    try:
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001
        pass
    try:
        return str(importlib.import_module(name).__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


@functools.lru_cache(maxsize=1)
def plan_code_digest(package: Path | None = None) -> str:
    """blake2b-8 of the source of dsp_core's importer, op table and plan compiler ("unknown" without it).

    The version alone is not enough: an editable install (a developer's tree) changes that
    code without changing the version. Read once per process (about 350 kB, a few ms).
    """
    root = package if package is not None else Path(__file__).resolve().parent.parent
    return source_digest([p for sub in _PLAN_CODE for p in (root / sub).glob("*.py")], root)


def source_digest(files: list[Path], root: Path) -> str:
    """blake2b-8 of source files (each one's path under ``root``, length and bytes); "unknown" if one is unreadable."""
    h = hashlib.blake2b(digest_size=8)
    try:
        for p in sorted(files):
            data = p.read_bytes()
            h.update(f"{p.relative_to(root).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    except OSError:
        return "unknown"
    return h.hexdigest() if files else "unknown"


# -- entry format -----------------------------------------------------------------------
class _Invalid(Exception):
    """An entry (object or ref) failed validation; ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class EntryHeader:
    """The header of an object file."""

    version: int
    fingerprint: str
    payload_len: int
    checksum: bytes  # blake2b, 16 bytes, of the payload
    offset: int  # where the payload begins in the file


def checksum(payload: bytes) -> bytes:
    """The payload checksum stored in headers and refs: blake2b with a 16-byte digest."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_entry(payload: bytes, build_fingerprint: str) -> bytes:
    """An object file's bytes: header, fingerprint, payload."""
    fp = build_fingerprint.encode()
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(fp), len(payload), checksum(payload))
    return head + fp + payload


def parse_header(blob: bytes) -> EntryHeader:
    """Parse the header at the start of ``blob``; raises _Invalid with the reason."""
    if len(blob) < _HEADER.size:
        raise _Invalid(f"truncated: {len(blob)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, flags, fp_len, payload_len, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise _Invalid(f"bad magic: expected {MAGIC!r}, got {magic!r}")
    if version != FORMAT_VERSION:
        raise _Invalid(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if flags:
        raise _Invalid(f"unknown header flags {flags:#06x} (expected 0)")
    if fp_len > _MAX_FINGERPRINT_BYTES:
        raise _Invalid(f"implausible fingerprint length {fp_len} (at most {_MAX_FINGERPRINT_BYTES})")
    offset = _HEADER.size + fp_len
    if len(blob) < offset:
        raise _Invalid(f"truncated: {len(blob)} bytes, the header and fingerprint need {offset}")
    try:
        fp = blob[_HEADER.size : offset].decode()
    except UnicodeDecodeError as exc:
        raise _Invalid(f"fingerprint is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return EntryHeader(version, fp, payload_len, digest, offset)


def decode_entry(blob: bytes, build_fingerprint: str | None) -> tuple[bytes, EntryHeader]:
    """(payload, header) of an object file, validated; raises _Invalid with the reason.

    ``build_fingerprint`` is the build the object must belong to (None: any build, as
    ``verify`` checks the entries of every build).
    """
    header = parse_header(blob)
    have = len(blob) - header.offset
    if have < header.payload_len:
        raise _Invalid(f"truncated: header says {header.payload_len} payload bytes, file has {have}")
    if have > header.payload_len:
        raise _Invalid(f"{have - header.payload_len} trailing bytes after the {header.payload_len}-byte payload")
    if build_fingerprint is not None and header.fingerprint != build_fingerprint:
        raise _Invalid(
            f"fingerprint mismatch: entry built by {header.fingerprint!r}, this build is {build_fingerprint!r}"
        )
    payload = blob[header.offset :]
    got = checksum(payload)
    if got != header.checksum:
        raise _Invalid(f"checksum mismatch: header says {header.checksum.hex()}, payload hashes to {got.hex()}")
    return payload, header


def encode_ref(key: str, name: str, header: EntryHeader) -> bytes:
    """A ref file's bytes: which object ``key`` names, its checksum, size and fingerprint."""
    ref = {
        "format": REF_FORMAT,
        "key": key,
        "object": name,
        "checksum": header.checksum.hex(),
        "size": header.payload_len,
        "fingerprint": header.fingerprint,
    }
    return json.dumps(ref, sort_keys=True).encode() + b"\n"


def parse_ref(raw: bytes, key: str) -> dict[str, Any]:
    """The fields of a ref file, validated against the key it was found under; raises _Invalid."""
    try:
        ref = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Invalid(f"garbage ref: not JSON ({exc})") from None
    if not isinstance(ref, dict) or ref.get("format") != REF_FORMAT:
        raise _Invalid(f"garbage ref: expected a JSON object with format {REF_FORMAT!r}")
    if ref.get("key") != key:
        raise _Invalid(f"garbage ref: found under key {key!r} but names key {ref.get('key')!r}")
    if not isinstance(ref.get("object"), str) or not _OBJECT_RE.fullmatch(ref["object"]):
        raise _Invalid(f"garbage ref: object {ref.get('object')!r} is not 16 hex digits + {OBJECT_SUFFIX}")
    if not isinstance(ref.get("checksum"), str) or not isinstance(ref.get("fingerprint"), str):
        raise _Invalid("garbage ref: checksum or fingerprint missing")
    size = ref.get("size")
    if type(size) is not int or size < 0:
        raise _Invalid(f"garbage ref: size {size!r} is not a byte count")
    return ref


def weight_header(digest: bytes, nbytes: int) -> bytes:
    """A weight file's 32-byte header (magic, version, flags, length, digest); the raw bytes follow it."""
    return _WEIGHT_HEADER.pack(WEIGHT_MAGIC, FORMAT_VERSION, 0, nbytes, digest)


def check_weight_header(head: bytes, digest: bytes, nbytes: int | None) -> int:
    """The byte length a weight file's header declares, validated; raises _Invalid with the reason."""
    if len(head) < _WEIGHT_HEADER.size:
        raise _Invalid(f"truncated: {len(head)} bytes, shorter than the {_WEIGHT_HEADER.size}-byte header")
    magic, version, flags, length, named = _WEIGHT_HEADER.unpack_from(head)
    if magic != WEIGHT_MAGIC:
        raise _Invalid(f"bad magic: expected {WEIGHT_MAGIC!r}, got {magic!r}")
    if version != FORMAT_VERSION or flags:
        raise _Invalid(f"unsupported weight format version {version}, flags {flags:#06x}")
    if named != digest:
        raise _Invalid(f"header names digest {named.hex()}, the file name says {digest.hex()}")
    if nbytes is not None and length != nbytes:
        raise _Invalid(f"header says {length} bytes, the plan expects {nbytes}")
    return int(length)


def weight_digest(data: bytes | bytearray | memoryview | mmap.mmap) -> bytes:
    """plan.constant_digest of an array whose C-order bytes are ``data``."""
    return constant_digest(np.frombuffer(data, np.uint8))


# -- stat signatures (what digest memos and weight stamps are keyed by) ------------------
Signature = tuple[str, int, int, int, int, int]


def stat_signature(path: Path | str, st: os.stat_result) -> Signature:
    """(path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): any write, truncation or rename moves one of them.

    ctime is the field no user call can set back: ``cp -p``, ``rsync -t``, ``tar x`` and
    ``touch -r`` restore mtime, but the write (or the utime call itself) moves ctime.
    """
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(st: os.stat_result) -> bool:
    """True when the file last changed more than RACY_NS ago, so a later change gets another timestamp (git's rule)."""
    return time.time_ns() - max(st.st_ctime_ns, st.st_mtime_ns) > RACY_NS


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    """True when two stats of one file have the same signature (nothing changed it in between)."""
    return stat_signature("", a) == stat_signature("", b)


def _fine_times(st: os.stat_result) -> bool:
    """True when the file system keeps sub-second times (not FAT's or an old NFS's whole seconds)."""
    return bool(st.st_mtime_ns % 1_000_000_000 or st.st_ctime_ns % 1_000_000_000)


# -- files ------------------------------------------------------------------------------
def _atomic_write(path: Path, *parts: bytes | memoryview, durable: bool = True) -> None:
    """Write ``parts`` to ``path`` so that readers see the old file or the whole new one, never a part.

    ``durable=False`` skips the fsyncs: for hints (a weight stamp) whose loss in a crash
    costs only a re-check, and whose own checksum rejects a torn copy.
    """
    tmp = path.with_name(f"{_TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")
    try:
        with open(tmp, "xb") as f:
            for data in parts:
                f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write(path: Path, *parts: bytes | memoryview) -> None:
    """``parts`` at ``path``, its folder made if missing: readers see the old file or the whole new one.

    For a plugin's own cache files (compiled kernels) under DSP's cache directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, *parts)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every platform can open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open_regular(path: Path) -> tuple[io.FileIO, os.stat_result] | None:
    """``path`` opened for reading if it is a regular file; None when absent; _BadFile otherwise.

    Links are not followed and the open does not block (a FIFO opens at once), then
    fstat decides: a symlink, FIFO, directory, socket or device is refused, never read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise
        raise _BadFile(path, f"not a regular file ({_kind(path)}): refused", _lstat_inode(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _BadFile(path, f"not a regular file ({_kind(path)}): refused", st.st_ino)
    return io.FileIO(fd, "rb", closefd=True), st


def _kind(path: Path) -> str:
    """What a non-regular directory entry is, in words (for reasons)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "gone"
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)!r}"
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"


def _lstat_inode(path: Path) -> int:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return -1


Buffer = bytearray | mmap.mmap  # bytes read into memory this process owns


def _owned_buffer(n: int) -> Buffer:
    """``n`` writable bytes of private memory: for a big one, anonymous memory advised to use huge pages.

    Reading a weight into fresh memory costs a page fault per page first touched; with
    2 MiB pages instead of 4 KiB ones that cost falls from about half of the read to
    little (a bytearray's memory gets no such advice). Never file-backed: a later change
    to the file cannot reach these bytes.
    """
    if n < _HUGE_BUFFER or not hasattr(mmap, "MADV_HUGEPAGE"):
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # only advice: a kernel without transparent huge pages says no
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _read_exactly(f: io.FileIO, n: int) -> Buffer | None:
    """The next ``n`` bytes of ``f`` into memory this process owns; None if the file ends first.

    A big read is split among a few threads (``os.preadv`` releases the GIL), so copying
    from the page cache and the page faults of the fresh memory use more than one core.
    """
    buf = _owned_buffer(n)
    view = memoryview(buf)
    start = f.tell()
    parts = min(_READ_THREADS, _cores(), max(1, n // _PARALLEL_READ))
    bounds = [n * i // parts for i in range(parts + 1)]
    outcome: list[bool | OSError] = [False] * parts  # True: read whole; False: the file ended; or the error

    def read(i: int) -> None:
        got, end = bounds[i], bounds[i + 1]
        try:
            while got < end:
                k = os.preadv(f.fileno(), [view[got:end]], start + got)
                if not k:
                    return
                got += k
        except OSError as exc:  # raised below, in the caller's thread: an I/O error is not damage
            outcome[i] = exc
            return
        outcome[i] = True

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(1, parts)]
    for t in threads:
        t.start()
    read(0)
    for t in threads:
        t.join()
    for result in outcome:
        if isinstance(result, OSError):
            raise result
    f.seek(start + n)
    return buf if all(outcome) else None


class WeightPrefetch:
    """Weight files read ahead on background threads, each exactly as ``DiskCache.weight`` reads it.

    ``DiskCache.prefetch(wanted)`` starts it: a few daemon threads take the wanted
    ``(digest, nbytes)`` in order and call ``DiskCache.weight`` on each, so a weight gets
    every check a read in the caller's thread gets (kind, size, header, the digest unless
    its stamp vouches for the bytes, quarantine of a damaged file), into memory this
    process owns. Meanwhile the caller does work that needs no weight's value (backend
    discovery, parsing the plan). ``take(digest, nbytes)`` then hands over the outcome in
    the caller's thread: the bytes, None (absent or damaged: quarantined as a read in the
    caller's thread would have), or the exception the read raised, raised again here. A
    weight no thread has started yet (or one after ``cancel``) is read by ``take`` itself.
    """

    _PENDING, _RUNNING, _DONE = 0, 1, 2

    def __init__(self, cache: DiskCache, wanted: Sequence[tuple[str, int]], threads: int) -> None:
        self._cache = cache
        self._order = list(dict.fromkeys(wanted))  # each (digest, nbytes) once, in the caller's order
        self._state = dict.fromkeys(self._order, self._PENDING)
        self._outcome: dict[tuple[str, int], tuple[Buffer | None, BaseException | None]] = {}
        self._done = threading.Condition()
        self._next = 0  # the first job a worker may still find pending
        self._workers = [
            threading.Thread(target=self._work, name=f"dsp-weight-read-{i}", daemon=True)
            for i in range(max(1, min(threads, len(self._order))))
        ]
        for worker in self._workers:
            worker.start()

    def __len__(self) -> int:
        return len(self._order)

    def _claim(self) -> tuple[str, int] | None:
        with self._done:
            while self._next < len(self._order):
                job = self._order[self._next]
                self._next += 1
                if self._state.get(job) == self._PENDING:  # not taken by the caller meanwhile
                    self._state[job] = self._RUNNING
                    return job
        return None

    def _work(self) -> None:
        while (job := self._claim()) is not None:
            self._run(job)

    def _run(self, job: tuple[str, int]) -> None:
        try:
            outcome: tuple[Buffer | None, BaseException | None] = (self._cache.weight(*job), None)
        except BaseException as exc:  # noqa: BLE001  (carried to the caller's thread by take)
            outcome = (None, exc)
        with self._done:
            self._outcome[job] = outcome
            self._state[job] = self._DONE
            self._done.notify_all()

    def take(self, digest: str, nbytes: int) -> tuple[bool, Buffer | None]:
        """(True, what ``DiskCache.weight`` returned) for a wanted weight, once; (False, None) for any other.

        Waits for a weight a thread is reading; reads one no thread has started here, in
        the caller's thread. An exception of the read is raised here, in the caller's thread.
        """
        job = (digest, nbytes)
        with self._done:
            state = self._state.get(job)
            if state is None:
                return False, None
            if state == self._PENDING:
                self._state[job] = self._RUNNING
            else:
                while self._state[job] != self._DONE:
                    self._done.wait()
        if state == self._PENDING:
            self._run(job)
        with self._done:
            del self._state[job]  # taken once: a second take of it reads the file again, as before
            data, error = self._outcome.pop(job)
        if error is not None:
            raise error
        return True, data

    def cancel(self) -> None:
        """No new reads: the threads finish the one each is in, and ``take`` reads what is left itself."""
        with self._done:
            self._next = len(self._order)


def _read_file(path: Path, limit: int) -> tuple[bytes, int] | None:
    """(contents, inode) of the regular file ``path``, at most ``limit`` bytes; None when absent.

    _BadFile when it is not a regular file or is larger than ``limit``.
    """
    opened = _open_regular(path)
    if opened is None:
        return None
    f, st = opened
    with f:
        if st.st_size > limit:
            raise _BadFile(path, f"{st.st_size} bytes, more than the {limit} such a file can hold", st.st_ino)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _BadFile(path, f"more than the {limit} bytes such a file can hold", st.st_ino)
    return data, st.st_ino


def _entries(directory: Path) -> Iterator[os.DirEntry[str]]:
    """Every entry of ``directory`` but temp files, whatever its type; nothing when it does not exist."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):  # a file in place of a directory: verify judges it
        return
    for entry in entries:
        if not entry.name.startswith(_TEMP_PREFIX):
            yield entry


def _files(directory: Path) -> Iterator[os.DirEntry[str]]:
    """Regular files in ``directory`` that are not temp files; nothing when it does not exist."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if not entry.name.startswith(_TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
            yield entry


def _stat(entry: os.DirEntry[str]) -> os.stat_result | None:
    """stat of a directory entry, or None when another process removed it meanwhile."""
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


def _unlink(path: Path | str) -> bool:
    """Remove a file; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _remove_any(path: Path) -> bool:
    """Remove a file, link, FIFO or directory tree that stands where a cache file should; False if gone."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
            return True
        return _unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("dsp cache: could not remove %s: %s", path, exc)
        return False


def _remove_stale_temps(directory: Path, now: float) -> None:
    """Remove temp files that crashed writers left behind (older than STALE_TEMP_SECONDS)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            st = _stat(entry) if entry.name.startswith(_TEMP_PREFIX) else None
            if st is not None and now - st.st_mtime > STALE_TEMP_SECONDS:
                _unlink(entry.path)


def _stamp() -> str:
    """A unique, sortable suffix for a quarantined file: UTC time, microseconds, pid, random."""
    now = time.time()
    base = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{base}.{int(now % 1 * 1e6):06d}Z-{os.getpid()}-{secrets.token_hex(2)}"


# -- configuration ----------------------------------------------------------------------
def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={env[name]!r}: expected one of {_FLAG_VALUES}")


def _env_dir(env: Mapping[str, str], name: str, must_exist: bool) -> Path | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={raw!r}: expected a directory, found a file there")
    if must_exist and not path.is_dir():
        raise ConfigError(f"{name}={raw!r}: directory does not exist (create it, or unset {name})")
    return path


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/dsp`` when XDG_CACHE_HOME is an absolute path, else ``~/.cache/dsp``."""
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "dsp"


# -- the cache --------------------------------------------------------------------------
@dataclass
class CacheStats(Counters):
    """Counters of one DiskCache object (this process only)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    quarantines: int = 0


@dataclass(frozen=True)
class _Layout:
    """Where a cache directory keeps its parts."""

    root: Path

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def refs(self) -> Path:
        return self.root / "refs"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def digests(self) -> Path:
        return self.root / "digests"

    @property
    def stamps(self) -> Path:
        return self.root / "stamps"

    def refs_of(self, tag: str) -> Path:
        """The directory of one build's refs."""
        return self.refs / tag


class _BadFile(Exception):
    """A file of the cache failed validation: which one, why, and the inode that was judged."""

    def __init__(self, path: Path, reason: str, inode: int) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.inode = path, reason, inode


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"cache key {key!r}: expected 1-128 characters of [A-Za-z0-9_.-], not starting with '.' "
            "(DiskCache.key(...) makes one)"
        )


@dataclass(eq=False)
class DiskCache:
    """An on-disk cache of opaque plan payloads, keyed by caller-computed keys (see the module doc)."""

    root: Path
    override_dir: Path | None = None
    enabled: bool = True
    max_bytes: int = DEFAULT_MAX_BYTES
    force_recompile: bool = False
    trust_stamps: bool = True  # DSP_CACHE_VERIFY_WEIGHTS=changed: an unchanged, stamped weight file is not re-hashed
    build_fingerprint: str = field(default_factory=lambda: fingerprint())
    stats: CacheStats = field(default_factory=CacheStats)
    events: list[dict[str, Any]] = field(default_factory=list)
    listeners: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.override_dir = Path(self.override_dir) if self.override_dir is not None else None

    @property
    def _layout(self) -> _Layout:
        return _Layout(self.root)

    @property
    def build(self) -> str:
        """This build's tag: the name of its directory under refs/."""
        return build_tag(self.build_fingerprint)

    def ref_path(self, key: str) -> Path:
        """Where this build keeps the ref of ``key``: ``refs/<build tag>/<key>``."""
        _check_key(key)
        return self._layout.refs_of(self.build) / key

    def object_path(self, payload: bytes) -> Path:
        """Where this build keeps the object of ``payload``."""
        return self._layout.objects / object_name(payload, self.build_fingerprint)

    @property
    def _override(self) -> _Layout | None:
        return _Layout(self.override_dir) if self.override_dir is not None else None

    @classmethod
    def from_config(cls, env: Mapping[str, str] | None = None) -> DiskCache:
        """A cache configured by the DSP_* environment variables; ConfigError on a bad value."""
        env = os.environ if env is None else env
        return cls(
            root=_env_dir(env, "DSP_CACHE_DIR", must_exist=False) or default_cache_dir(env),
            override_dir=_env_dir(env, "DSP_CACHE_OVERRIDE_DIR", must_exist=True),
            enabled=_env_flag(env, "DSP_DISK_CACHE", default=True),
            max_bytes=int(config.get("cache_max_bytes", env=env)),  # the one size parser: 4G, 512M, bytes
            force_recompile=_env_flag(env, "DSP_FORCE_RECOMPILE", default=False),
            trust_stamps=config.get("cache_verify_weights", env=env) == "changed",
        )

    @staticmethod
    def key(*parts: bytes | str) -> str:
        """A cache key (32 hex digits) from ``parts``, e.g. model bytes, output names, mode."""
        h = hashlib.blake2b(digest_size=16, person=b"dsp-cache-key")
        for part in parts:
            if isinstance(part, str):
                tag, data = b"s", part.encode()
            elif isinstance(part, bytes | bytearray | memoryview):
                tag, data = b"b", bytes(part)
            else:
                raise TypeError(f"DiskCache.key: parts must be bytes or str, got {type(part).__name__}")
            # Length-prefixed, so ("ab", "c") and ("a", "bc") give different keys.
            h.update(tag + len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    # -- lookup -------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``: override dir first, then the cache; None on a miss."""
        _check_key(key)
        if not self.enabled:
            return None
        payload = None
        if not self.force_recompile:  # forced: every lookup misses, puts still write
            payload = self._from_override(key)
            if payload is None:
                payload = self._from_cache(key)
        if payload is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return payload

    def _from_override(self, key: str) -> bytes | None:
        if self._override is None:
            return None
        try:
            found = self._load(self._override, key)
        except _BadFile as bad:  # never moved: the override dir belongs to the user
            self._emit("override_rejected", bad.path, bad.reason)
            return None
        except OSError as exc:
            self._emit("read_error", self._override.refs / key, f"{type(exc).__name__}: {exc}")
            return None
        return found[0] if found else None

    def _from_cache(self, key: str) -> bytes | None:
        try:
            found = self._load(self._layout, key)
        except _BadFile as bad:
            self._quarantine(bad)
            return None
        except OSError as exc:
            self._emit("read_error", self._layout.refs / key, f"{type(exc).__name__}: {exc}")
            return None
        if found is None:
            return None
        payload, path = found
        with contextlib.suppress(OSError):  # LRU: a hit is a use (gone meanwhile: nothing to touch)
            os.utime(path)
        return payload

    def _load(self, layout: _Layout, key: str) -> tuple[bytes, Path] | None:
        """(payload, object path) of this build's entry for ``key``; None when absent; _BadFile when invalid.

        Each build keeps its refs in its own directory (``refs/<build tag>/``), so another
        build's entry for the same key is never seen here, never overwritten, never judged.
        """
        return self._load_entry(layout, layout.refs_of(self.build) / key, key, self.build_fingerprint)

    def _load_entry(self, layout: _Layout, ref_path: Path, key: str, expected: str | None) -> tuple[bytes, Path] | None:
        """(payload, object path) of the entry ``ref_path`` names; None when absent; _BadFile when invalid.

        ``expected`` is the fingerprint the entry must carry; None (``verify`` looking at
        another build's entries) takes the ref's own, which must then be the one its
        directory is named after. Any disagreement between the ref, its directory and its
        object is damage, whichever build wrote it.
        """
        got = self._read_ref(ref_path, key)
        if got is None:
            return None
        ref, ref_inode = got
        fp = ref["fingerprint"]
        if expected is not None and fp != expected:
            raise _BadFile(ref_path, f"fingerprint mismatch: ref in this build's directory names {fp!r}", ref_inode)
        in_build_dir = ref_path.parent != layout.refs  # refs/<key> directly: the flat layout of earlier builds
        if in_build_dir and build_tag(fp) != ref_path.parent.name:
            reason = f"ref in build directory {ref_path.parent.name} names the fingerprint of build {build_tag(fp)}"
            raise _BadFile(ref_path, reason, ref_inode)
        obj_path = layout.objects / ref["object"]
        found = self._read_object(obj_path, ref["size"], fp)
        if found is None:  # evicted by another process since the ref was written: a plain miss
            return None
        payload, header = found
        if ref["checksum"] != header.checksum.hex():
            raise _BadFile(
                ref_path, f"ref names checksum {ref['checksum']}, object has {header.checksum.hex()}", ref_inode
            )
        return payload, obj_path

    def _read_ref(self, path: Path, key: str) -> tuple[dict[str, Any], int] | None:
        got = _read_file(path, _MAX_REF_BYTES)
        if got is None:
            return None
        try:
            return parse_ref(got[0], key), got[1]
        except _Invalid as bad:
            raise _BadFile(path, bad.reason, got[1]) from None

    def _read_object(
        self, path: Path, declared: int | None = None, build_fingerprint: str | None = None
    ) -> tuple[bytes, EntryHeader] | None:
        """(payload, header) of an object, validated; reads no more than its header declares.

        ``declared`` is the payload size the ref names: an object whose header says
        otherwise is not read further. ``build_fingerprint`` is the build it must belong
        to (None: any, its integrity alone is checked).
        """
        opened = _open_regular(path)
        if opened is None:
            return None
        f, st = opened
        with f:
            try:
                blob = self._read_object_bytes(f, st, declared)
                return decode_entry(blob, build_fingerprint)
            except _Invalid as bad:
                raise _BadFile(path, bad.reason, st.st_ino) from None

    def _read_object_bytes(self, f: io.FileIO, st: os.stat_result, declared: int | None) -> bytes:
        head = f.read(min(st.st_size, _HEADER.size + _MAX_FINGERPRINT_BYTES))
        header = parse_header(head)
        total = header.offset + header.payload_len
        if declared is not None and header.payload_len != declared:
            raise _Invalid(f"header says {header.payload_len} payload bytes, the ref names {declared}")
        if declared is None and header.payload_len > max(self.max_bytes, 1 << 30):
            raise _Invalid(f"implausible payload length {header.payload_len} (the cache holds {self.max_bytes})")
        if st.st_size < total:
            have = st.st_size - header.offset
            raise _Invalid(f"truncated: header says {header.payload_len} payload bytes, file has {have}")
        if st.st_size > total:
            raise _Invalid(f"{st.st_size - total} trailing bytes after the {header.payload_len}-byte payload")
        rest = _read_exactly(f, total - len(head)) if total > len(head) else bytearray()
        if rest is None:
            raise _Invalid(f"truncated while reading: header says {header.payload_len} payload bytes")
        return bytes(head[:total]) + bytes(rest)

    def reject(self, key: str, reason: str) -> bool:
        """Quarantine this build's object for ``key`` when the caller finds its payload unusable.

        For a payload that passed every check here yet fails to load (a serializer bug, say).
        In the override dir it is only reported. True when something was moved aside.
        """
        ref_path = self.ref_path(key)
        if self._override is not None and (self._override.refs_of(self.build) / key).exists():
            self._emit("override_rejected", self._override.refs_of(self.build) / key, reason)
        try:
            got = self._read_ref(ref_path, key)
        except _BadFile as bad:
            return self._quarantine(bad)
        if got is None:
            return False
        path = self._layout.objects / got[0]["object"]
        try:
            inode = os.lstat(path).st_ino
        except FileNotFoundError:
            return False
        return self._quarantine(_BadFile(path, f"rejected by the caller: {reason}", inode))

    # -- store --------------------------------------------------------------------------
    def put(self, key: str, payload: bytes) -> Path | None:
        """Store ``payload`` under ``key`` for this build atomically, then evict LRU files beyond max_bytes.

        Returns the object's path, or None when the cache is off or the write failed (an
        event says why, and the first failure of a process is a warning; a cache that
        cannot be written never fails a compile).
        """
        ref_path = self.ref_path(key)
        if not self.enabled:
            return None
        blob = encode_entry(payload, self.build_fingerprint)
        name = _blob_name(blob)
        header = parse_header(blob)
        obj_path = self._layout.objects / name
        try:
            self._layout.objects.mkdir(parents=True, exist_ok=True)
            ref_path.parent.mkdir(parents=True, exist_ok=True)
            # Rewritten even when present: same name means same bytes, and this heals a damaged copy.
            _atomic_write(obj_path, blob)
            _atomic_write(ref_path, encode_ref(key, name, header))
        except OSError as exc:
            self._write_failed(obj_path, exc)
            return None
        self.stats.writes += 1
        self._enforce_bound(keep=name)
        return obj_path

    def _write_failed(self, path: Path, exc: Exception) -> None:
        """A write_error event; the first of this process for this directory is also a warning saying what to do."""
        self._emit("write_error", path, f"{type(exc).__name__}: {exc}")
        root = str(self.root)
        if root in _WARNED_UNWRITABLE:
            return
        _WARNED_UNWRITABLE.add(root)
        message = (
            f"the disk cache {root} cannot be written ({type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}); "
            "every process compiles from scratch. Make it writable, point DSP_CACHE_DIR at a writable "
            "directory, or turn the cache off with DSP_DISK_CACHE=0"
        )
        log.warning("DSP: %s", message)
        self._emit("unwritable", self.root, message)

    # -- weights ------------------------------------------------------------------------
    def put_weight(self, digest: str, array: np.ndarray) -> Path | None:
        """Store a large constant's bytes as ``weights/<digest>.dspw``, once; None if off or failed.

        Plans keep big constants by reference (their digest) with their dtype and shape;
        the file holds a 32-byte header and the raw C-order bytes, nothing to interpret.
        The writer stamps the file it wrote (``_read_weight`` says what a stamp is for).
        """
        _check_key(digest)
        if not self.enabled:
            return None
        path = self._layout.weights / f"{digest}{WEIGHT_SUFFIX}"
        if os.path.lexists(path):
            return path  # judged when read: a bad one is quarantined there and written again
        try:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            self._layout.weights.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, weight_header(bytes.fromhex(digest), data.nbytes), data.data)
            st = os.stat(path)
        except (OSError, ValueError) as exc:
            self._write_failed(path, exc)
            return None
        if _fine_times(st):  # these are the bytes just written: no need to read them back
            self._stamp_weight(path, st)
        self._enforce_bound(keep=path.name)
        return path

    def weight(self, digest: str, nbytes: int) -> Buffer | None:
        """A stored constant's ``nbytes`` bytes, read into memory (override dir first); None if absent or bad.

        Read, not memory-mapped: a later change to the file cannot reach a live model. The
        bytes are checked against the digest here, or trusted by the file's stamp when it is
        unchanged since DSP last knew its bytes (``_read_weight``): a damaged file (or one
        that is not a regular file) is quarantined (an override one reported) and never returned.
        """
        _check_key(digest)
        if not self.enabled or self.force_recompile:
            return None
        override = self._override
        candidates = ([(override, True)] if override is not None else []) + [(self._layout, False)]
        for layout, is_override in candidates:
            path = layout.weights / f"{digest}{WEIGHT_SUFFIX}"
            try:
                data = self._read_weight(path, nbytes, start=not is_override)
            except _BadFile as bad:
                self._reject_weight(bad, is_override)
                continue
            except OSError as exc:
                self._emit("read_error", path, f"{type(exc).__name__}: {exc}")
                continue
            if data is not None:
                return data
        return None

    def prefetch(self, wanted: Sequence[tuple[str, int]]) -> WeightPrefetch | None:
        """Start reading the weights ``wanted`` ((digest, nbytes), in the order they will be asked for)
        on background threads, each as ``weight`` reads it; None when there is nothing to read.

        The caller takes each one with ``WeightPrefetch.take`` (in its own thread) and may do
        other work meanwhile: reading from the page cache into fresh memory is mostly page
        faults and copies, outside the GIL, and each weight file is checked as ``weight``
        checks it.
        """
        if not self.enabled or self.force_recompile or not wanted:
            return None
        for digest, _ in wanted:
            _check_key(digest)
        return WeightPrefetch(self, wanted, min(_READ_THREADS, _cores()))

    def _read_weight(self, path: Path, nbytes: int | None, start: bool = False) -> Buffer | None:
        """The verified bytes of a weight file; None when absent; _BadFile when damaged.

        ``nbytes`` is what the plan declares (None in verify: the header's length, bounded
        by the file's size); nothing beyond it is read. The file's kind, size and header
        are checked every time. Its bytes are hashed unless ``start`` (a model starting
        from the cache, not ``verify``) and the file's **stamp** vouches for them: the
        stat signature (inode, size, mtime, ctime) it had when DSP last knew its bytes,
        having written them, or hashed them in a file settled for RACY_NS. Any write,
        truncation or replacement moves ctime, so a changed file is hashed in full.
        ``verify`` and DSP_CACHE_VERIFY_WEIGHTS=always never trust a stamp.

        ``start`` also moves the mtime, the LRU clock, but only once every
        WEIGHT_TOUCH_SECONDS: a touch moves ctime as well and so costs the stamp, which is
        then recorded again with the signature after the touch.
        """
        try:
            digest = bytes.fromhex(path.name.removesuffix(WEIGHT_SUFFIX))
        except ValueError:
            digest = b""
        opened = _open_regular(path)
        if opened is None:
            return None
        f, st = opened
        with f:
            try:
                length = check_weight_header(f.read(_WEIGHT_HEADER.size), digest, nbytes)
                if st.st_size != _WEIGHT_HEADER.size + length:
                    raise _Invalid(f"wrong size: {st.st_size} bytes, the header says {_WEIGHT_HEADER.size + length}")
                data = _read_exactly(f, length)
                if data is None:
                    raise _Invalid("truncated while reading")
                # The signature after the read too: a write while it read moved ctime, and is hashed.
                stamped = start and self.trust_stamps and self._stamped(path, st) and _same(st, os.fstat(f.fileno()))
                if not stamped and weight_digest(data) != digest:
                    raise _Invalid("weight bytes do not match their digest")
            except _Invalid as bad:
                raise _BadFile(path, bad.reason, st.st_ino) from None
            if start and time.time() - st.st_mtime > WEIGHT_TOUCH_SECONDS:
                self._touch(path, f)  # LRU: a read is a use
            elif not stamped and settled(st):
                self._stamp_weight(path, st)  # hashed just now, and it cannot change within its tick
        return data

    def _touch(self, path: Path, f: io.FileIO) -> None:
        """Move the mtime of a weight file just read and checked (open as ``f``) to now, and stamp it anew."""
        try:
            if os.utime in os.supports_fd:
                os.utime(f.fileno())  # the very inode that was read, whatever is at ``path`` now
            else:
                os.utime(path)
            after = os.fstat(f.fileno())
        except OSError:  # a read-only cache: the file keeps its place in the LRU order
            return
        if _fine_times(after):
            self._stamp_weight(path, after)

    def _stamp_path(self, weight: Path) -> Path:
        return self._layout.stamps / f"{weight.name.removesuffix(WEIGHT_SUFFIX)}{STAMP_SUFFIX}"

    def _stamped(self, path: Path, st: os.stat_result) -> bool:
        """True when the weight file's stamp records exactly this stat signature (this boot, undamaged)."""
        found = _read_memo(self._stamp_path(path), stat_signature(path, st))
        return found is not None and found["digest"] == path.name.removesuffix(WEIGHT_SUFFIX)

    def _stamp_weight(self, path: Path, st: os.stat_result) -> None:
        """Record that the weight file with this stat signature holds the bytes its name is the digest of."""
        if path.parent != self._layout.weights:
            return  # the override dir's files are hashed on every read: it is the user's, never written
        stamp = self._stamp_path(path)
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            _write_memo(stamp, stat_signature(path, st), path.name.removesuffix(WEIGHT_SUFFIX), False, durable=False)
        except OSError as exc:
            self._write_failed(stamp, exc)

    def _reject_weight(self, bad: _BadFile, is_override: bool) -> None:
        """Quarantine a bad weight file of the cache; only report one of the override dir."""
        if is_override:
            self._emit("override_rejected", bad.path, bad.reason)
            return
        self._quarantine(bad)

    # -- digest memos (the loader's file_digest) ------------------------------------------
    def recall_digest(self, signature: Signature) -> tuple[str, bool] | None:
        """The digest memoized for a file whose stat ``signature`` this is, or None.

        ``signature`` is ``stat_signature`` of the resolved path. A memo counts only if it
        is a regular file of the right format whose signature, boot id and check all match:
        a memo of an earlier boot (inode numbers and times can repeat), a cache directory
        copied from elsewhere, or a damaged or odd file is ignored, and the file is hashed again.
        """
        if not self.enabled or self.force_recompile:
            return None
        memo = _read_memo(self._memo_path(signature[0]), signature)
        return None if memo is None else (memo["digest"], memo["mentions"])

    def remember_digest(self, signature: Signature, digest: str, mentions: bool) -> None:
        """Memoize a settled file's digest for later processes (atomically; a failure only costs a re-hash)."""
        if not self.enabled:
            return
        path = self._memo_path(signature[0])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_memo(path, signature, digest, mentions)
        except OSError as exc:
            self._write_failed(path, exc)
            return
        self._prune_memos()

    def recall_locations(self, digest: str) -> tuple[str, ...] | None:
        """The external-data locations memoized for the model whose content digest this is, or None."""
        if not self.enabled or self.force_recompile:
            return None
        memo = _read_memo(self._memo_path(f"locations:{digest}"), _locations_signature(digest))
        found = None if memo is None else memo.get("locations")
        if not isinstance(found, list) or not all(isinstance(x, str) for x in found):
            return None
        return tuple(found)

    def remember_locations(self, digest: str, locations: tuple[str, ...]) -> None:
        """Memoize the external-data locations a model's content names, so a warm start does not parse it."""
        if not self.enabled:
            return
        path = self._memo_path(f"locations:{digest}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_memo(path, _locations_signature(digest), digest, True, locations=list(locations))
        except OSError as exc:
            self._write_failed(path, exc)
            return
        self._prune_memos()

    def _prune_memos(self) -> None:
        memos = [(st.st_mtime, e.path) for e in _files(self._layout.digests) if (st := _stat(e)) is not None]
        for _, old in sorted(memos)[:-MEMO_KEEP]:
            _unlink(old)

    def _memo_path(self, path: str) -> Path:
        name = hashlib.blake2b(path.encode(), digest_size=16, person=b"dsp-digest-memo").hexdigest()
        return self._layout.digests / f"{name}.memo"

    def _enforce_bound(self, keep: str) -> None:
        """Evict least-recently-used objects (by mtime) until under max_bytes, never ``keep``."""
        now = time.time()
        _remove_stale_temps(self._layout.objects, now)
        _remove_stale_temps(self._layout.refs_of(self.build), now)
        _remove_stale_temps(self._layout.weights, now)
        _remove_stale_temps(self._layout.digests, now)
        _remove_stale_temps(self._layout.stamps, now)
        objects = self._objects()
        total = sum(size for _, size, _ in objects)
        victims = []
        for path, size, _ in sorted(objects, key=lambda o: o[2]):
            if total <= self.max_bytes:
                break
            if path.name != keep:
                victims.append(path)
                total -= size
        if victims:
            self.stats.evictions += sum(_unlink(p) for p in victims)
            for path in victims:
                if path.parent == self._layout.weights:
                    _unlink(self._stamp_path(path))
            self._drop_dangling_refs()

    def _objects(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every object and weight file in the cache."""
        out = []
        for directory in (self._layout.objects, self._layout.weights):
            for entry in _files(directory):
                st = _stat(entry)
                if st is not None:
                    out.append((Path(entry.path), st.st_size, st.st_mtime))
        return out

    def _drop_dangling_refs(self) -> int:
        """Remove refs (of every build) whose object is gone (evicted); unreadable refs are left to get/verify."""
        dropped = 0
        for path, key, _ in _ref_entries(self._layout)[0]:
            try:
                got = _read_file(path, _MAX_REF_BYTES)
                name = parse_ref(got[0], key)["object"] if got else None
            except (_Invalid, _BadFile, OSError):
                continue
            # An object is written before its ref, so a missing one was removed, not yet to come.
            if name is not None and not (self._layout.objects / name).exists():
                dropped += _unlink(path)
        return dropped

    # -- quarantine and events ----------------------------------------------------------
    def _quarantine(self, bad: _BadFile) -> bool:
        """Move a bad file to quarantine/ with a .reason file beside it; False if it was not ours to move."""
        qdir = self._layout.quarantine
        dest = qdir / f"{bad.path.parent.name}-{bad.path.name}.{_stamp()}"
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            # Only the inode that was judged: a concurrent put may have renamed a good file here since.
            if os.lstat(bad.path).st_ino != bad.inode:
                return False
            os.replace(bad.path, dest)
            dest.with_name(dest.name + ".reason").write_text(f"{bad.path}\n{bad.reason}\n")
            if bad.path.parent == self._layout.weights:
                _unlink(self._stamp_path(bad.path))  # it vouched for the file now gone
        except FileNotFoundError:  # another process quarantined or evicted it first
            return False
        except OSError as exc:
            self._emit("quarantine_failed", bad.path, f"{bad.reason}; could not move it: {exc}")
            return False
        self.stats.quarantines += 1
        log.warning("dsp cache: quarantined %s (%s); it will be recompiled", bad.path, bad.reason)
        self._emit("quarantine", bad.path, bad.reason, to=str(dest))
        self._prune_quarantine()
        return True

    def _prune_quarantine(self) -> None:
        """Keep the newest QUARANTINE_KEEP quarantined entries (with their .reason files)."""
        entries = [e for e in _files(self._layout.quarantine) if e.name.endswith(".reason")]
        dated = sorted((st.st_mtime, Path(e.path)) for e in entries if (st := _stat(e)) is not None)
        for _, reason in dated[:-QUARANTINE_KEEP]:
            _unlink(reason)
            _remove_any(reason.with_suffix(""))

    def _emit(self, kind: str, path: Path, reason: str, **extra: str) -> None:
        """Record an event and pass it to every listener (a failing listener is logged, not raised)."""
        event = {"kind": kind, "path": str(path), "reason": reason, **extra}
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001  (diagnostics must not break a compile)
                log.exception("dsp cache: event listener %r failed", listener)

    # -- management (the `dsp cache` commands) ------------------------------------------
    def ls(self) -> list[dict[str, Any]]:
        """Every entry of every build (override dir first, then the cache): key, build, object, size, status."""
        rows = []
        sources = [("override", self._override), ("cache", self._layout)]
        for source, layout in sources:
            if layout is not None:
                rows += [self._describe(layout, *ref, source) for ref in _ref_entries(layout)[0]]
        return rows

    def _describe(self, layout: _Layout, ref_path: Path, key: str, tag: str | None, source: str) -> dict[str, Any]:
        """One ls row: reads the ref and the object's header only (verify reads the payloads)."""
        mine = tag == self.build
        row: dict[str, Any] = {"key": key, "source": source, "build": tag or "earlier layout", "this_build": mine}
        row.update(object=None, size=None, mtime=None, fingerprint_ok=None, status="ok")
        try:
            got = _read_file(ref_path, _MAX_REF_BYTES)
            ref = parse_ref(got[0], key) if got else None
        except (_Invalid, _BadFile) as bad:
            return {**row, "status": bad.reason}
        except OSError as exc:
            return {**row, "status": f"unreadable: {exc}"}
        if ref is None:
            return {**row, "status": "gone"}
        row["object"] = ref["object"]
        path = layout.objects / ref["object"]
        try:
            opened = _open_regular(path)
            if opened is None:
                return {**row, "status": "dangling: object gone"}
            f, st = opened
            with f:
                header = parse_header(f.read(_HEADER.size + _MAX_FINGERPRINT_BYTES))
        except (_Invalid, _BadFile) as bad:
            return {**row, "status": bad.reason}
        except OSError as exc:
            return {**row, "status": f"unreadable: {exc}"}
        row.update(size=st.st_size, mtime=st.st_mtime, fingerprint_ok=header.fingerprint == self.build_fingerprint)
        if st.st_size != header.offset + header.payload_len:
            row["status"] = f"wrong size: {st.st_size} bytes, the header says {header.offset + header.payload_len}"
        elif header.fingerprint != ref["fingerprint"] or (tag is not None and build_tag(ref["fingerprint"]) != tag):
            row["status"] = "fingerprint mismatch"
        elif not mine:
            row["status"] = "other build"
        return row

    def info(self) -> dict[str, Any]:
        """Where the cache is, whether it is on, its size and bound, ref counts per build, quarantine, stats."""
        objects = self._objects()
        quarantined = [e for e in _files(self._layout.quarantine) if not e.name.endswith(".reason")]
        refs = _ref_entries(self._layout)[0]
        return {
            "dir": str(self.root),
            "override_dir": str(self.override_dir) if self.override_dir is not None else None,
            "enabled": self.enabled,
            "force_recompile": self.force_recompile,
            "size": sum(size for _, size, _ in objects),
            "count": len(objects),
            "refs": len(refs),
            "this_build_refs": sum(1 for _, _, tag in refs if tag == self.build),
            "builds": len({tag for _, _, tag in refs}),
            "weights": sum(1 for _ in _files(self._layout.weights)),
            "max_bytes": self.max_bytes,
            "quarantine_count": len(quarantined),
            "fingerprint": self.build_fingerprint,
            "build": self.build,
            "stats": self.stats.as_dict(),
        }

    def clear(self, include_quarantine: bool = False) -> int:
        """Remove every object, ref (of every build), weight, stamp and digest memo (and quarantine/ when asked)."""
        layout = self._layout
        dirs = [layout.objects, layout.refs, layout.weights, layout.stamps, layout.digests]
        if include_quarantine:
            dirs.append(self._layout.quarantine)
        removed = 0
        for directory in dirs:
            if _is_file_in_place_of_dir(directory):
                removed += _remove_any(directory)
                continue
            removed += sum(_remove_any(Path(e.path)) for e in _entries(directory))
        return removed

    def verify(self) -> dict[str, Any]:
        """Check every entry of every build in full; quarantine damaged ones, drop dangling refs; counts, problems.

        Entries of other builds are checked for damage as strictly as this build's (a ref
        must name its own build's directory and an object of that build, the checksum must
        match), but a different fingerprint is not damage: they are counted as
        ``other_build_refs`` and left in place for the environment that wrote them.
        """
        before = self.stats.quarantines
        report: dict[str, Any] = {"objects_ok": 0, "refs_ok": 0, "other_build_refs": 0, "weights_ok": 0}
        report.update(dangling_refs_removed=0, override_ok=0, override_bad=0, problems=[])
        for directory in (self._layout.objects, self._layout.refs, self._layout.weights, self._layout.digests):
            if _is_file_in_place_of_dir(directory):
                self._judge(functools.partial(_not_a_directory, directory), report)
        # Refs first: an object that disagrees with its ref is quarantined as that ref's damage.
        refs, strays = _ref_entries(self._layout)
        for path in strays:
            self._judge(functools.partial(_stray, path), report)
        for path, key, tag in refs:
            mine = tag == self.build
            expected = self.build_fingerprint if mine else None
            ok = self._judge(functools.partial(self._load_entry, self._layout, path, key, expected), report)
            report["refs_ok" if mine else "other_build_refs"] += ok
        for entry in sorted(_entries(self._layout.objects), key=_name):
            path = Path(entry.path)
            check = functools.partial(self._read_object, path) if _OBJECT_RE.fullmatch(entry.name) else None
            report["objects_ok"] += self._judge(check or functools.partial(_stray, path), report)
        for entry in sorted(_entries(self._layout.weights), key=_name):
            path = Path(entry.path)
            if entry.name.endswith(".npy") and entry.is_file(follow_symlinks=False):
                _unlink(path)  # the memory-mapped format of earlier builds: never read now
                continue
            judge = functools.partial(self._read_weight, path, None) if _WEIGHT_RE.fullmatch(entry.name) else None
            report["weights_ok"] += self._judge(judge or functools.partial(_stray, path), report)
        report["dangling_refs_removed"] = self._drop_dangling_refs()
        report["stale_stamps_removed"] = self._drop_stale_stamps()
        if self._override is not None:
            for path, key, tag in _ref_entries(self._override)[0]:
                expected = self.build_fingerprint if tag == self.build else None
                seeded = functools.partial(self._load_entry, self._override, path, key, expected)
                ok = self._judge(seeded, report, self._override)
                report["override_ok" if ok else "override_bad"] += 1
        report["quarantined"] = self.stats.quarantines - before
        return report

    def _drop_stale_stamps(self) -> int:
        """Remove stamps (hints, never trusted alone) whose weight file is gone, and anything odd among them."""
        dropped = 0
        if _is_file_in_place_of_dir(self._layout.stamps):
            return int(_remove_any(self._layout.stamps))
        for entry in _entries(self._layout.stamps):
            weight = self._layout.weights / f"{entry.name.removesuffix(STAMP_SUFFIX)}{WEIGHT_SUFFIX}"
            if not (_STAMP_RE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False) and weight.exists()):
                dropped += _remove_any(Path(entry.path))
        return dropped

    def _judge(self, check: Callable[[], object], report: dict[str, Any], override: _Layout | None = None) -> bool:
        """Run one check; record a bad file and quarantine it (report it only, in the override dir)."""
        try:
            found = check()
        except _BadFile as bad:
            report["problems"].append({"path": str(bad.path), "reason": bad.reason, "override": override is not None})
            if override is not None:
                self._emit("override_rejected", bad.path, bad.reason)
            else:
                self._quarantine(bad)
            return False
        except OSError as exc:  # unreadable (permissions, I/O error): reported, left in place
            report["problems"].append({"path": str(exc.filename), "reason": f"unreadable: {exc}"})
            return False
        if found is None and override is not None:  # the cache's own dangling refs are swept, not reported
            report["problems"].append({"path": str(override.root), "reason": "a ref names a missing object"})
        return found is not None


def _read_memo(path: Path, signature: Sequence[object]) -> dict[str, Any] | None:
    """The memo at ``path`` when it records exactly ``signature`` in this boot; else None.

    It must be a regular file of at most _MAX_MEMO_BYTES of JSON of MEMO_FORMAT whose
    check matches, with a digest of hex digits and a boolean ``mentions``; anything else
    (absent, damaged, odd, of another boot) is None.
    """
    try:
        got = _read_file(path, _MAX_MEMO_BYTES)
        memo = json.loads(got[0]) if got else None
    except (_BadFile, OSError, ValueError):
        return None
    if not isinstance(memo, dict) or memo.get("check") != _memo_check(memo):
        return None
    if memo.get("format") != MEMO_FORMAT or memo.get("signature") != list(signature):
        return None
    digest, mentions = memo.get("digest"), memo.get("mentions")
    if memo.get("boot_id") != boot_id() or not isinstance(digest, str) or not isinstance(mentions, bool):
        return None
    return memo if re.fullmatch(r"[0-9a-f]{16,128}", digest) else None


def _write_memo(
    path: Path, signature: Sequence[object], digest: str, mentions: bool, durable: bool = True, **extra: Any
) -> None:
    """Write a memo: this file signature (in this boot) has this digest; atomically; OSError on failure."""
    memo: dict[str, Any] = {"format": MEMO_FORMAT, "signature": list(signature), "boot_id": boot_id()}
    memo.update(digest=digest, mentions=mentions, **extra)
    memo["check"] = _memo_check(memo)
    _atomic_write(path, json.dumps(memo, sort_keys=True).encode() + b"\n", durable=durable)


def _locations_signature(digest: str) -> tuple[str, str]:
    """What a locations memo is keyed by: the model's content digest alone (its locations are a function of it)."""
    return ("external-data locations", digest)


def _memo_check(memo: dict[str, Any]) -> str:
    """blake2b-16 of a digest memo's fields but ``check`` itself: a damaged memo never passes."""
    body = json.dumps({k: v for k, v in memo.items() if k != "check"}, sort_keys=True).encode()
    return hashlib.blake2b(body, digest_size=16, person=b"dsp-memo-check").hexdigest()


@functools.lru_cache(maxsize=1)
def boot_id() -> str | None:
    """This boot's id (Linux: /proc/sys/kernel/random/boot_id), None where the system has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _ref_entries(layout: _Layout) -> tuple[list[tuple[Path, str, str | None]], list[Path]]:
    """(refs, strays) under ``layout.refs``.

    refs: (path, key, build tag) of every build's refs, sorted; the tag is None for a ref
    of the flat layout of earlier builds (``refs/<key>``). Every entry with a key's name
    counts, whatever its type, so a FIFO or link in place of a ref is judged. strays:
    entries that are neither a build's directory nor a ref.
    """
    refs: list[tuple[Path, str, str | None]] = []
    strays: list[Path] = []
    for entry in sorted(_entries(layout.refs), key=_name):
        path = Path(entry.path)
        if _TAG_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            for sub in sorted(_entries(path), key=_name):
                if _KEY_RE.fullmatch(sub.name):
                    refs.append((Path(sub.path), sub.name, entry.name))
                else:
                    strays.append(Path(sub.path))
        elif _KEY_RE.fullmatch(entry.name):
            refs.append((path, entry.name, None))
        else:
            strays.append(path)
    return refs, strays


def _is_file_in_place_of_dir(path: Path) -> bool:
    """True when something other than a directory stands where the cache keeps a directory."""
    try:
        return not stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _not_a_directory(path: Path) -> None:
    raise _BadFile(path, f"not a directory ({_kind(path)} where the cache keeps a directory)", _lstat_inode(path))


def _name(entry: os.DirEntry[str]) -> str:
    return entry.name


def _stray(path: Path) -> None:
    """A file whose name is no entry of the cache: bad, whatever it holds."""
    raise _BadFile(path, f"not a cache entry ({_kind(path)} of an unexpected name)", _lstat_inode(path))
