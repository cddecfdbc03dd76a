"""heap: hands the free pages of the C heap back to the operating system.

kvgate's own objects are small and live in CPython's arenas, but every gRPC message passes
through the C heap: grpc's receive buffers, the serialized bytes, upb's arenas for the
parsed message. A burst of them (thousands of streams opening at once; the periodic access
log entries of every stream in flight, Envoy's batches of them a few hundred KB each) raises
the heap's high-water mark, and glibc gives back to the system only the free memory at the
top of its heap: what the burst freed below the objects still alive stays resident, counted
against every request in flight. ``malloc_trim(0)`` releases every whole free page inside the
heap as well (bench/results/memory-levers.md has the figures).

``HeapTrimmer`` does that from a thread of its own, at most every ``every_s`` seconds and only
when the process's resident memory rose by ``TRIM_MIN_BYTES`` since the lowest it was after
its last trim (an idle process is not walked every second; the heap's own count of free
bytes is no guide: pages given back stay counted free, and reusing them makes them resident
again without moving it). ctypes releases the GIL for the call, so the event loop runs
meanwhile. Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing.

``pin_mmap_threshold`` keeps the largest blocks out of the heap in the first place. glibc
serves a block of ``MMAP_THRESHOLD_BYTES`` or more with a mapping of its own, given back
whole when it is freed, but it raises that threshold to the size of every such block freed
(up to 32 MiB): after the first large access log batch, every later batch's bytes (several
a second in the picker-log file, each as large) come from the heap and leave holes there
that a trim gives back only in whole free pages. Pinning the threshold (``mallopt``, which
also stops its moving) sends them to mappings again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger("kvgate.server")

# How often the trimmer looks at the heap (seconds).
TRIM_EVERY_S = 1.0
# The least rise of resident memory since the last trim that is worth a trim (bytes).
TRIM_MIN_BYTES = 1 << 20
# The size from which a block gets a mapping of its own (bytes): glibc's initial value.
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def pin_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """pin_mmap_threshold makes every block of ``size`` bytes or more a mapping of its own,
    from now on, however large the blocks freed before (module doc); False where the C
    library has no ``mallopt`` or refused."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, size))


def resident_bytes() -> int | None:
    """resident_bytes is this process's resident memory (bytes; None where /proc has no statm)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """HeapTrimmer returns the C heap's free pages to the system now and then (module doc).

    ``available``: the C library has ``malloc_trim``; ``trims`` counts the passes that trimmed.
    """

    def __init__(self, every_s: float = TRIM_EVERY_S, min_bytes: int = TRIM_MIN_BYTES) -> None:
        self.every_s = every_s
        self.min_bytes = min_bytes
        libc = _libc()
        self._trim = getattr(libc, "malloc_trim", None) if libc is not None else None
        if self._trim is not None:
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int
        # The lowest resident memory seen since the last trim (bytes; None: no trim yet).
        self._low: int | None = None
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """maybe_trim trims the heap if resident memory rose by ``min_bytes`` since the lowest
        it was after the last trim (always, where it cannot be read); True when it trimmed."""
        if self._trim is None:
            return False
        rss = resident_bytes()
        if rss is not None and self._low is not None:
            if rss - self._low < self.min_bytes:
                self._low = min(self._low, rss)
                return False
        self._trim(0)
        self._low = resident_bytes()
        self.trims += 1
        return True

    def start(self) -> None:
        """start runs ``maybe_trim`` every ``every_s`` seconds in a daemon thread."""
        if self._trim is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-heap-trim", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """stop ends the thread (waits for a pass in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.maybe_trim()
            except Exception:  # never worth ending the process for
                log.exception("heap trim failed; no more trims")
                return
