"""Transparent huge pages for the memory a native runtime allocates when it compiles a segment.

A decode step of a large model streams every weight once per token: GPT-2 124M reads about
500 MB each step. With 4 KiB pages that is ~120,000 TLB misses a token; with 2 MiB pages,
a few hundred. Measured here (ONNX Runtime, GPT-2 124M decode step, 1 thread, AMD EPYC,
THP in ``madvise`` mode): 25.5 ms with the session's memory on 4 KiB pages, 22.4 ms on huge
pages (12% less).

Linux gives a process huge pages only where it asks (``madvise`` mode, the common default),
and ONNX Runtime and OpenVINO do not ask. Their weights live in memory DSP does not own, so
DSP finds it: the private anonymous mappings of the process are listed before and after
the runtime compiles (``/proc/self/maps``), and the address ranges that appeared in between
(the runtime's copies of the weights, its packed weights) are advised ``MADV_HUGEPAGE`` and
collapsed into huge pages at once (``MADV_COLLAPSE``, Linux 6.1+; on older kernels the hint
alone lets khugepaged collapse them over time). Ranges that existed before are not touched,
so another library's memory in the same process keeps its pages.

Collapsing copies the memory (about 2 ms per MiB here), so only a compile that allocated at
least ``DSP_HUGE_PAGES`` MiB is advised (default 32; 0 turns it off). Any failure leaves the
pages as they were: the advice is a hint, never an error.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from dsp_core import config

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP = "/sys/kernel/mm/transparent_hugepage"


@dataclass
class HugePageAdvice:
    """What one compile's new memory got: sizes in bytes; ``skipped`` says why nothing was done."""

    new_bytes: int = 0
    advised_bytes: int = 0
    collapsed_bytes: int = 0  # of advised_bytes, those collapsed at once (MADV_COLLAPSE)
    seconds: float = 0.0
    skipped: str = ""
    error: str = ""


def thp_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise``, ``never``), or None where there is no THP."""
    try:
        with open(f"{THP}/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_page_size() -> int:
    """The PMD huge page size in bytes (2 MiB on x86-64)."""
    try:
        with open(f"{THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def anonymous_ranges(maps: str | None = None) -> list[tuple[int, int]]:
    """The writable private anonymous mappings of this process (``/proc/self/maps``), sorted."""
    if maps is None:
        with open("/proc/self/maps") as f:
            maps = f.read()
    ranges = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        path = parts[5].strip() if len(parts) == 6 else ""
        if path not in ("", "[heap]") or not parts[1].startswith("rw") or parts[1][3] != "p":
            continue
        start, _, end = parts[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)


def new_ranges(after: list[tuple[int, int]], before: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``after``'s ranges that no range of ``before`` covers (both sorted, disjoint)."""
    out: list[tuple[int, int]] = []
    i = 0
    for start, end in after:
        while i < len(before) and before[i][1] <= start:
            i += 1
        cursor, j = start, i
        while j < len(before) and before[j][0] < end:
            if before[j][0] > cursor:
                out.append((cursor, before[j][0]))
            cursor = max(cursor, before[j][1])
            j += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(ranges: list[tuple[int, int]], advice: HugePageAdvice) -> None:
    """Advise ``ranges`` (each trimmed inward to whole huge pages) MADV_HUGEPAGE, then collapse them."""
    madvise = _madvise()
    if madvise is None:
        advice.skipped = "no madvise in this C library"
        return
    size = huge_page_size()
    errors: set[str] = set()
    for start, end in ranges:
        lo, hi = -(-start // size) * size, end // size * size
        if hi - lo < size:
            continue
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            if ctypes.get_errno() != errno.ENOMEM:  # ENOMEM: unmapped since (the runtime's threads freed it)
                errors.add(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
            continue
        advice.advised_bytes += hi - lo
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            advice.collapsed_bytes += hi - lo
        elif ctypes.get_errno() not in (errno.EINVAL, errno.EAGAIN, errno.ENOMEM):
            # EINVAL: a kernel before 6.1, or a range it will not collapse now; EAGAIN, ENOMEM: some
            # pages stay small. The advised ranges are collapsed by khugepaged in time.
            errors.add(f"MADV_COLLAPSE: {os.strerror(ctypes.get_errno())}")
    advice.error = "; ".join(sorted(errors))


def _unavailable(least: int) -> str:
    """Why no memory gets huge pages here (``least``: DSP_HUGE_PAGES), or "" when it can."""
    if least <= 0:
        return "off (DSP_HUGE_PAGES=0)"
    mode = thp_mode() if sys.platform.startswith("linux") else None
    if mode not in ("madvise", "always"):
        return f"transparent huge pages are {mode or 'not available'} on this system"
    return ""


@contextmanager
def huge_pages_for_new_memory(min_mib: int | None = None) -> Iterator[HugePageAdvice]:
    """Within the block, a runtime compiles; after it, its new memory gets huge pages (see the module doc)."""
    advice = HugePageAdvice()
    least = int(config.get("huge_pages")) if min_mib is None else min_mib
    advice.skipped = _unavailable(least)
    if advice.skipped:
        yield advice
        return
    try:
        before = anonymous_ranges()
    except OSError as exc:
        advice.skipped = f"cannot read /proc/self/maps: {exc}"
        yield advice
        return
    yield advice
    start = time.perf_counter()
    try:
        fresh = new_ranges(anonymous_ranges(), before)
    except OSError as exc:
        advice.skipped = f"cannot read /proc/self/maps: {exc}"
        return
    advice.new_bytes = sum(end - begin for begin, end in fresh)
    if advice.new_bytes < least << 20:
        advice.skipped = f"{advice.new_bytes >> 20} MiB allocated, under DSP_HUGE_PAGES={least} MiB"
        return
    advise(fresh, advice)
    advice.seconds = time.perf_counter() - start


def process_huge_bytes() -> int:
    """Bytes of this process's anonymous memory on huge pages now (AnonHugePages), 0 where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def zeros(specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray] | None:
    """Zeroed host arrays of ``specs`` (name -> shape, dtype) in one anonymous mapping advised
    MADV_HUGEPAGE before it is touched, so its pages are huge from the first write (no collapse).

    For buffers DSP itself streams every step (the decode plan's KV buffers). None (the caller
    allocates as usual) where DSP_HUGE_PAGES is 0, THP is off, or the arrays fill less than
    two huge pages.
    """
    size = huge_page_size()
    layout: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes), each offset 64-byte aligned
    total = 0
    for name, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        layout[name] = (total, nbytes)
        total += -(-nbytes // 64) * 64
    madvise = _madvise()
    if _unavailable(int(config.get("huge_pages"))) or total < 2 * size or madvise is None:
        return None
    block = mmap.mmap(-1, total + size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(block, np.uint8)  # keeps the mapping alive while any array lives
    skip = -raw.ctypes.data % size
    madvise(raw.ctypes.data + skip, (len(raw) - skip) // size * size, MADV_HUGEPAGE)  # a hint: its result aside
    return {
        name: raw[skip + at : skip + at + nbytes].view(dtype).reshape(shape)
        for (name, (shape, dtype)), (at, nbytes) in zip(specs.items(), layout.values())
    }
