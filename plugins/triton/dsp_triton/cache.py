"""The kernel cache: Triton's binaries and DSP's tuning choices under DSP's cache directory.

Triton keys a compiled kernel by its source, its options, the Triton version and the
device's target; DSP gives it a cache manager that stores under ``<DSP cache>/triton``
and adds one thing Triton's own lacks: every file is written with a blake2b digest beside
it and checked when it is read, so a damaged or half-written entry is recompiled, never
loaded (a truncated cubin loads as garbage, or crashes the process). Writes are atomic
(temporary file, then rename), so concurrent writers on a shared filesystem see either
the old file or the new one.

The manager is installed only around DSP's own compilations (``scoped``), so a program
that also uses Triton (torch.compile) keeps its own cache.

``TuneCache`` keeps the tuning winner of each generated kernel (its source hash and the
device) in one small JSON file per kernel, so a warm start neither compiles nor tunes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsp_core import config

DIGEST_SUFFIX = ".b2"


def cache_root() -> Path:
    """``<DSP cache directory>/triton``."""
    from dsp_core.cache.disk import default_cache_dir

    root = config.get("cache_dir")
    base = Path(root).expanduser() if root else default_cache_dir(os.environ)
    return base / "triton"


def digest(data: bytes) -> str:
    """The digest stored beside a cache file."""
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_checked(path: Path, data: bytes) -> None:
    """``data`` at ``path`` and its digest beside it (the digest last: its presence means complete)."""
    atomic_write(path, data)
    atomic_write(path.with_name(path.name + DIGEST_SUFFIX), digest(data).encode())


def read_checked(path: Path) -> bytes | None:
    """The file's bytes when its digest matches; None (and the entry removed) when damaged or absent."""
    side = path.with_name(path.name + DIGEST_SUFFIX)
    try:
        data = path.read_bytes()
        want = side.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if digest(data) != want:
        for p in (path, side):
            with contextlib.suppress(OSError):
                p.unlink()
        return None
    return data


def checked(path: Path) -> bool:
    """True when ``path`` is present and intact."""
    return read_checked(path) is not None


_MANAGER: Any = None


def manager_class() -> Any:
    """The Triton cache manager class (made on first use: this module imports without Triton)."""
    global _MANAGER
    if _MANAGER is not None:
        return _MANAGER
    from triton.runtime.cache import CacheManager

    class DSPCacheManager(CacheManager):  # type: ignore[misc]
        """Triton's cache interface over DSP's checked files."""

        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            self.key = key
            self.cache_dir = str(cache_root() / "bin" / key)
            os.makedirs(self.cache_dir, exist_ok=True)

        def _path(self, filename: str) -> Path:
            return Path(self.cache_dir) / filename

        def get_file(self, filename: str) -> str | None:
            path = self._path(filename)
            return str(path) if checked(path) else None

        def put(self, data: Any, filename: str, binary: bool = True) -> str:
            raw = data if isinstance(data, bytes) else str(data).encode()
            path = self._path(filename)
            write_checked(path, raw)
            return str(path)

        def get_group(self, filename: str) -> dict[str, str] | None:
            raw = read_checked(self._path(f"__grp__{filename}"))
            if raw is None:
                return None
            try:
                children = json.loads(raw).get("child_paths")
            except (ValueError, AttributeError):
                return None
            if not isinstance(children, dict):
                return None
            result: dict[str, str] = {}
            for name, p in children.items():
                if not checked(Path(p)):
                    return None  # one damaged child: the whole kernel is recompiled
                result[name] = p
            return result

        def put_group(self, filename: str, group: dict[str, str]) -> str:
            return self.put(json.dumps({"child_paths": group}), f"__grp__{filename}", binary=False)

    _MANAGER = DSPCacheManager
    return _MANAGER


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """DSP's cache manager for the compilations inside the block (unless the user chose one)."""
    from triton import knobs

    if os.environ.get("TRITON_CACHE_MANAGER"):
        yield
        return
    saved = knobs.cache.__dict__.get("manager_class", None)
    knobs.cache.manager_class = manager_class()
    try:
        yield
    finally:
        if saved is None:
            knobs.cache.__dict__.pop("manager_class", None)
        else:
            knobs.cache.manager_class = saved


class TuneCache:
    """Tuning winners per kernel source and device, one checked JSON file each."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or cache_root()) / "tune"

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        raw = read_checked(self._path(key))
        if raw is None:
            return None
        try:
            got = json.loads(raw)
        except ValueError:
            return None
        return got if isinstance(got, dict) else None

    def put(self, key: str, choice: dict[str, Any]) -> None:
        try:
            write_checked(self._path(key), json.dumps(choice, sort_keys=True).encode())
        except OSError:
            pass  # an unwritable cache only costs a re-tune next time


def source_key(source: str, device: str, triton_version: str) -> str:
    """The tuning key of a generated kernel on a device."""
    return hashlib.blake2b(f"{triton_version}\0{device}\0{source}".encode(), digest_size=16).hexdigest()
