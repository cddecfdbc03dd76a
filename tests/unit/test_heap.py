"""Unit tests of the heap trimmer (extproc/heap.py): the free pages a burst leaves inside the
C heap go back to the system, and a process whose resident memory did not rise is not
trimmed again; with the mmap threshold pinned, a large block is a mapping of its own even
after a larger one was freed."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.heap import HeapTrimmer, resident_bytes

ROOT = Path(__file__).resolve().parents[2]

trimmer = HeapTrimmer()
pytestmark = pytest.mark.skipif(not trimmer.available, reason="the C library has no malloc_trim")

# Above CPython's small-object limit and below glibc's mmap threshold: in the C heap itself.
CHUNK = 64 * 1024
CHUNKS = 256


def burst() -> list[bytearray]:
    """burst leaves CHUNKS / 2 chunks freed between others still alive (what a burst of
    messages does between the objects of requests still in flight); returns the survivors."""
    chunks = [bytearray(CHUNK) for _ in range(CHUNKS)]
    for i in range(CHUNKS):
        chunks[i][::4096] = b"x" * len(chunks[i][::4096])  # every page resident
    return chunks[1::2]


def test_a_trim_gives_back_the_pages_a_burst_freed_below_live_objects() -> None:
    t = HeapTrimmer(min_bytes=1 << 20)
    t.maybe_trim()
    kept = burst()
    before = resident_bytes()
    assert before is not None
    assert t.maybe_trim()  # 16 MiB more resident since the last trim
    released = before - (resident_bytes() or before)
    assert released >= CHUNKS // 2 * CHUNK // 2, f"only {released} B released"
    assert len(kept) == CHUNKS // 2


def test_a_process_whose_memory_did_not_rise_is_not_trimmed_again() -> None:
    t = HeapTrimmer(min_bytes=1 << 20)
    assert t.maybe_trim()  # the first pass always trims
    assert not t.maybe_trim()
    assert t.trims == 1
    kept = burst()
    assert t.maybe_trim() and t.trims == 2
    del kept


def test_the_thread_starts_and_stops() -> None:
    t = HeapTrimmer(every_s=3600)
    t.start()
    t.stop()  # wakes the waiting thread at once
    assert t._thread is None


# A fresh interpreter: the blocks it frees move glibc's threshold, and the test's own
# process has freed large blocks already. Prints whether a 300 KiB block freed after a
# 2 MiB one was a mapping of its own (mallinfo2's count of mapped blocks rose for it).
_MAPPED_AFTER_A_LARGE_FREE = """
import ctypes, sys
from extproc.heap import pin_mmap_threshold
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold()
big = bytearray(2 << 20)
del big  # freed: glibc's own threshold rises to 2 MiB
before = libc.mallinfo2().hblks
block = bytearray(300 << 10)
print(libc.mallinfo2().hblks > before)
"""


def mapped_after_a_large_free(mode: str) -> bool:
    out = subprocess.run([sys.executable, "-c", _MAPPED_AFTER_A_LARGE_FREE, mode], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return out.strip() == "True"


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="not glibc 2.33 or later")
def test_a_pinned_threshold_keeps_large_blocks_out_of_the_heap_after_a_larger_one_is_freed() -> None:
    assert not mapped_after_a_large_free("unpinned")  # glibc's moving threshold: in the heap
    assert mapped_after_a_large_free("pinned")
