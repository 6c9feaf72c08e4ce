"""Huge pages for a native runtime's new memory (dsp_core/runtime/hugepages.py)."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from dsp_core.runtime import hugepages
from dsp_core.runtime.hugepages import anonymous_ranges, huge_pages_for_new_memory, new_ranges

MAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1234   /usr/bin/python3.11
55d0c1e00000-55d0c2000000 rw-p 00000000 00:00 0      [heap]
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0000600000 rw-s 00000000 00:01 77     /dev/shm/x
7f0000600000-7f0000800000 r--p 00000000 00:00 0
7f0000800000-7f0000a00000 rw-p 00000000 fd:01 99     /usr/lib/libfoo.so
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
"""


def test_anonymous_ranges_are_the_writable_private_unnamed_mappings_and_the_heap():
    assert anonymous_ranges(MAPS) == [(0x55D0C1E00000, 0x55D0C2000000), (0x7F0000000000, 0x7F0000400000)]


@pytest.mark.parametrize(
    ("after", "before", "fresh"),
    [
        ([(0, 100)], [], [(0, 100)]),
        ([(0, 100)], [(0, 100)], []),
        ([(0, 100)], [(20, 30), (50, 60)], [(0, 20), (30, 50), (60, 100)]),
        ([(0, 100)], [(-10, 10), (90, 120)], [(10, 90)]),  # a grown mapping: only the growth is new
        ([(0, 10), (40, 50)], [(5, 45)], [(0, 5), (45, 50)]),
        ([(0, 10), (20, 30)], [(100, 200)], [(0, 10), (20, 30)]),
    ],
)
def test_new_ranges_are_the_parts_no_earlier_range_covers(after, before, fresh):
    assert new_ranges(after, before) == fresh


def test_off_and_small_compiles_are_left_alone(monkeypatch):
    monkeypatch.setenv("DSP_HUGE_PAGES", "0")
    with huge_pages_for_new_memory() as advice:
        pass
    assert advice.skipped.startswith("off") and advice.advised_bytes == 0
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    with huge_pages_for_new_memory(min_mib=1 << 20) as advice:  # 1 TiB: nothing allocates that
        pass
    assert "under DSP_HUGE_PAGES" in advice.skipped and advice.advised_bytes == 0


def test_without_transparent_huge_pages_nothing_is_advised(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    with huge_pages_for_new_memory(min_mib=1) as advice:
        kept = np.ones(8 << 20, np.uint8)
    assert "never" in advice.skipped and advice.advised_bytes == 0
    del kept


def _huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings inside [lo, hi) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start >= lo and end <= hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are a Linux feature")
def test_memory_allocated_inside_is_backed_by_huge_pages():
    if hugepages.thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode()} here: nothing to advise")
    size = 64 << 20
    with huge_pages_for_new_memory(min_mib=32) as advice:
        block = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )  # what a runtime's allocator does for a big buffer
        block.write(b"\x01" * size)  # touched: 4 KiB pages now
    assert advice.error == "" and not advice.skipped
    assert advice.new_bytes >= size
    assert advice.advised_bytes >= size - 2 * hugepages.huge_page_size()
    view = np.frombuffer(block, np.uint8)
    lo = view.ctypes.data
    del view  # an exported buffer would keep the mapping from closing
    if advice.collapsed_bytes:  # MADV_COLLAPSE (Linux 6.1+); before, khugepaged collapses in time
        assert _huge_kib(lo, lo + size) >= advice.collapsed_bytes >> 10
    assert block[:4] == b"\x01" * 4 and block[size - 1 : size] == b"\x01"  # the contents are kept
    block.close()


def test_zeros_are_separate_zeroed_writable_arrays_on_huge_pages(monkeypatch):
    specs = {"k": ((1, 12, 1024, 64), np.dtype(np.float32)), "v": ((1, 12, 1024, 64), np.dtype(np.float32))}
    if hugepages.thp_mode() not in ("madvise", "always"):
        assert hugepages.zeros(specs) is None
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode()} here")
    got = hugepages.zeros(specs)
    assert got is not None and list(got) == ["k", "v"]
    for name, (shape, dtype) in specs.items():
        a = got[name]
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert not a.any()
    got["k"][...] = 1.0
    assert not got["v"].any()  # no overlap
    lo = got["k"].ctypes.data
    hi = got["v"].ctypes.data + got["v"].nbytes
    assert _huge_kib(lo - hugepages.huge_page_size(), hi + hugepages.huge_page_size()) > 0
    monkeypatch.setenv("DSP_HUGE_PAGES", "0")
    assert hugepages.zeros(specs) is None
    assert hugepages.zeros({"x": ((16,), np.dtype(np.float32))}) is None  # too small to matter
