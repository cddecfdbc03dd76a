"""Unit tests of the heap trimmer (extproc/heap.py): the free pages a burst leaves inside the
C heap go back to the system, and a process whose resident memory did not rise is not
trimmed again."""

from __future__ import annotations

import pytest

from extproc.heap import HeapTrimmer, resident_bytes

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
