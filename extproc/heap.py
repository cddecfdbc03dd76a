"""heap: hands the free pages of the C heap back to the operating system.

kvgate's own objects are small and live in CPython's arenas, but every gRPC message passes
through the C heap: grpc's receive buffers, the serialized bytes, upb's arenas for the
parsed message. A burst of them (thousands of streams opening at once; the periodic access
log entries of every stream in flight, Envoy's batches of them a few hundred KB each) raises
the heap's high-water mark, and glibc gives back to the system only the free memory at the
top of its heap: what the burst freed below the objects still alive stays resident, counted
against every request in flight. ``malloc_trim(0)`` releases every whole free page inside the
heap as well (bench/results/memory.md has the figures).

``HeapTrimmer`` does that from a thread of its own, at most every ``every_s`` seconds and only
when the heap's free memory moved by ``TRIM_MIN_BYTES`` since its last pass (an idle process
is not walked every second). ctypes releases the GIL for the call, so the event loop runs
meanwhile. Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

log = logging.getLogger("kvgate.server")

# How often the trimmer looks at the heap (seconds).
TRIM_EVERY_S = 1.0
# The least change of the heap's free bytes since the last pass that is worth a trim (bytes).
TRIM_MIN_BYTES = 1 << 20


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33 and later), every field a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:
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
        self._info = getattr(libc, "mallinfo2", None) if libc is not None else None
        if self._trim is not None:
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int
        if self._info is not None:
            self._info.argtypes = []
            self._info.restype = _MallInfo2
        self._last_free: int | None = None
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def free_bytes(self) -> int | None:
        """free_bytes is the free memory inside the C heap's arenas (bytes; None: unknown)."""
        if self._info is None:
            return None
        return int(self._info().fordblks)

    def maybe_trim(self) -> bool:
        """maybe_trim trims the heap if its free memory moved by ``min_bytes`` since the last
        pass (always, where that is unknown); True when it trimmed."""
        if self._trim is None:
            return False
        free = self.free_bytes()
        if free is not None and self._last_free is not None and abs(free - self._last_free) < self.min_bytes:
            return False
        self._trim(0)
        self._last_free = self.free_bytes()
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
