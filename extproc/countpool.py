"""countpool: counting the uncuttable stretches of long prompts in worker processes.

bpe-openai holds the GIL for the whole of a call. kvgate cuts a long text where the
tokenizer's own pre-split cuts, so that the sum of the pieces' counts is exact, and hands
the GIL over between pieces; a stretch with no such point (one 1 MiB "word", a long run of
digits and commas) cannot be cut without changing its count, and one call on it held every
other thread, the event loop's too, for the whole call (bench/results/big-prompt.md). Where
no cut lies within a bounded search,
the rest of the text goes to a ``CountPool`` worker process that has loaded the same
tokenizer and counts it in one call: the serving process only waits on a pipe (the GIL
free), and the count is the same engine's, exact.

Every input may be hostile, so the pool is bounded: ``workers`` processes, at most
``waiting`` more counts waiting for one; a count beyond that is refused at once with
``TokenizerBusy`` (503, retryable, ``retry-after``). A count that runs past ``timeout_s``
or whose worker dies is refused with ``TokenizerFailed`` (503, not retryable: the same text
would do it again) and the worker is killed and replaced. The pool is synchronous: it is
called from the tokenizing threads, never from the event loop.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from extproc.errors import RequestError

log = logging.getLogger("kvgate.countpool")

COUNT_WORKERS = 1
"""COUNT_WORKERS is how many worker processes a server's pool starts (each holds one core
while it counts, and its own copy of the tokenizers: tens of MB)."""
COUNT_WAITING = 2
"""COUNT_WAITING is how many counts may wait for a busy worker before the next is refused."""
COUNT_TIMEOUT_S = 10.0
"""COUNT_TIMEOUT_S bounds one count in a worker (seconds); bpe-openai counts a hostile MiB
in about 0.1 s of CPU (1-2 s on this 2-core machine under a load of 20), so a count this
long means the worker is stuck."""
COUNT_WAIT_S = 1.0
"""COUNT_WAIT_S bounds the wait for a free worker (seconds): Envoy's message timeout has
usually passed by then, and the client had better retry."""
START_TIMEOUT_S = 60.0
"""START_TIMEOUT_S bounds a worker's start, its imports and tokenizer loads (seconds)."""
RETRY_AFTER_S = 1.0
"""RETRY_AFTER_S is the ``retry-after`` of a TokenizerBusy refusal (seconds): a hostile
MiB takes the worker about a tenth of that."""
# A text is sent in parts of this many characters (a part's encoding holds the GIL).
_PART_CHARS = 65536
# The folder that holds the extproc package: a worker imports it from there.
_ROOT = str(Path(__file__).resolve().parent.parent)


class TokenizerBusy(RequestError):
    """TokenizerBusy refuses a count when every worker is busy and the wait line is full
    (503, retryable after ``retry_after_s`` seconds)."""

    def __init__(self) -> None:
        super().__init__("The gateway is counting too many long prompts without word breaks "
                         "at once. Retry shortly.", status=503, code="tokenizer_busy",
                         error_type="server_error", retry_after_s=RETRY_AFTER_S)


class TokenizerFailed(RequestError):
    """TokenizerFailed refuses a count whose worker ran past the timeout or died (503, not
    retryable: the same prompt would do it again)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"The gateway could not count this prompt's tokens: {why}.",
                         status=503, code="tokenizer_failed", error_type="server_error")


def _serve(read_fd: int, write_fd: int, specs: list[str]) -> int:
    """_serve is a worker's main: it loads ``specs``, says it is ready, then answers each
    request (the spec, the text's parts in UTF-8, an empty message) with ``ok N`` or
    ``error WHY`` until its pipe closes."""
    from extproc.tokens import load_tokenizer  # the worker's own copy

    requests = Connection(read_fd, writable=False)
    answers = Connection(write_fd, readable=False)
    try:
        for spec in specs:
            load_tokenizer(spec)
    except Exception as exc:
        answers.send_bytes(f"error cannot load a tokenizer: {exc}".encode())
        return 1
    answers.send_bytes(b"ready")
    while True:
        try:
            request = requests.recv_bytes()
        except (EOFError, OSError):
            return 0
        parts = []
        while part := requests.recv_bytes():  # the text's parts, then an empty message
            parts.append(part.decode("utf-8", "surrogatepass"))
        try:
            tok = load_tokenizer(request.decode())
            count = getattr(tok, "count_whole", tok.count)  # uncached: this text is counted once
            tokens = count("".join(parts))
            answer = f"ok {tokens}"
        except Exception as exc:
            answer = f"error {type(exc).__name__}: {exc}"
        answers.send_bytes(answer.encode("utf-8", "replace"))


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    requests: Connection
    answers: Connection

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()


class CountPool:
    """CountPool counts texts in ``workers`` worker processes (tokens, exact).

    ``specs`` are the tokenizer specs each worker loads at start (others load on their
    first count). ``count`` blocks its thread, never the GIL: ``wait_s`` seconds at most
    for a free worker, then ``timeout_s`` at most for the count. ``start=False`` starts the
    workers at the first count instead; until one is up, ``count`` answers None.
    """

    def __init__(self, specs: tuple[str, ...] = (), *, workers: int = COUNT_WORKERS,
                 waiting: int = COUNT_WAITING, timeout_s: float = COUNT_TIMEOUT_S,
                 wait_s: float = COUNT_WAIT_S, start_timeout_s: float = START_TIMEOUT_S,
                 start: bool = True) -> None:
        if workers < 1 or waiting < 0 or timeout_s <= 0 or wait_s <= 0:
            raise ValueError("CountPool needs workers >= 1, waiting >= 0, timeout_s > 0 and wait_s > 0")
        self.specs = tuple(specs)
        self.workers = workers
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.start_timeout_s = start_timeout_s
        self.capacity = workers + waiting
        """capacity is how many counts the pool takes at once (counting or waiting): the
        threads that call ``count`` may all be blocked in it."""
        self._admit = threading.BoundedSemaphore(self.capacity)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._closed = False
        self.replaced = 0
        """replaced counts the workers killed (timeout) or found dead and started anew."""
        self._started = False
        self._in_pool = 0
        self._up = 0  # workers started and not dropped since
        if start:
            self.start()

    def start(self) -> None:
        """start starts the workers (once; ``count`` calls it when the pool was made with
        ``start=False``, so a process that never meets such a text never starts one)."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        for _ in range(self.workers):
            self._start_worker()

    def _start_worker(self) -> None:
        # A fresh interpreter (no fork: grpc's threads run in this process), started as a
        # module so that nothing of this process's __main__ runs again; requests and answers
        # on two pipes of their own, framed by multiprocessing's Connection (no pickle).
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "extproc.countpool", str(from_parent), str(to_parent),
                 *self.specs], pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL,
                env=env)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        worker = _Worker(process, Connection(to_child, readable=False),
                         Connection(from_child, writable=False))
        with self._lock:
            if self._closed:
                self._stop(worker)
                return
            self._live.add(worker)
        threading.Thread(target=self._await_ready, args=(worker,), daemon=True,
                         name="kvgate-count-start").start()

    def _await_ready(self, worker: _Worker) -> None:
        """_await_ready puts a started worker in the idle queue once it said it is ready."""
        try:
            if worker.answers.poll(self.start_timeout_s):
                said = worker.answers.recv_bytes()
                if said == b"ready":
                    with self._lock:
                        self._up += 1
                    self._idle.put(worker)
                    return
                log.error("a count worker did not start: %s", said.decode("utf-8", "replace"))
            else:
                log.error("a count worker did not start within %.0f s", self.start_timeout_s)
        except (EOFError, OSError):
            log.error("a count worker died while starting (exit code %s)", worker.exitcode)
        # Not replaced: a worker that cannot start would fail again, in a loop. Counts are
        # made by their callers while no worker is up.
        self._drop(worker, was_up=False)

    def wait_ready(self, timeout_s: float) -> bool:
        """wait_ready waits up to ``timeout_s`` seconds until every worker has started;
        returns whether they all did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle.qsize() >= self.workers:
                return True
            time.sleep(0.01)  # at start only (tests, boot): a short poll of the queue's size
        return self._idle.qsize() >= self.workers

    def pids(self) -> list[int]:
        """pids are the process ids of the live workers."""
        with self._lock:
            return [w.process.pid for w in self._live]

    def count(self, spec: str, text: str) -> int | None:
        """count returns the tokens of ``text`` under ``spec``, counted in a worker, or None
        while no worker is up (before the first has started, or while the only one is
        replaced): the caller counts it itself then, as it would without a pool.

        Raises TokenizerBusy when ``capacity`` counts are already in the pool or no worker
        came free within ``wait_s``; TokenizerFailed when the count ran past
        ``timeout_s`` or its worker died or answered with an error.
        """
        if self._closed:
            raise TokenizerBusy()
        if not self._started:
            self.start()
        if self._up == 0:
            return None
        if not self._admit.acquire(blocking=False):
            raise TokenizerBusy()
        with self._lock:
            self._in_pool += 1
        try:
            try:
                worker = self._idle.get(timeout=self.wait_s)
            except queue.Empty:
                raise TokenizerBusy() from None
            return self._ask(worker, spec, text)
        finally:
            with self._lock:
                self._in_pool -= 1
            self._admit.release()

    @property
    def in_pool(self) -> int:
        """in_pool is how many counts are in the pool now, counting or waiting for a worker."""
        return self._in_pool

    def _ask(self, worker: _Worker, spec: str, text: str) -> int:
        kept = False
        try:
            try:
                self._send(worker.requests, spec, text)
                if not worker.answers.poll(self.timeout_s):
                    log.warning("a count ran past %.1f s: its worker is killed and replaced",
                                self.timeout_s)
                    raise TokenizerFailed(f"counting took longer than {self.timeout_s:g} s")
                answer = worker.answers.recv_bytes().decode("utf-8", "replace")
            except (EOFError, OSError):
                log.warning("a count worker died (exit code %s): replaced", worker.exitcode)
                raise TokenizerFailed("the counting process died") from None
            kept = True
        finally:
            if kept:
                self._idle.put(worker)
            else:
                self._replace(worker)
        kind, _, value = answer.partition(" ")
        if kind != "ok":
            raise TokenizerFailed(value)
        return int(value)

    @staticmethod
    def _send(requests: Connection, spec: str, text: str) -> None:
        # In parts: encoding a whole 4 MiB text at once would hold the GIL for milliseconds;
        # each write of a part hands it over. A str slice never splits a character.
        requests.send_bytes(spec.encode())
        for i in range(0, len(text), _PART_CHARS):
            requests.send_bytes(text[i:i + _PART_CHARS].encode("utf-8", "surrogatepass"))
        requests.send_bytes(b"")

    def _replace(self, worker: _Worker) -> None:
        self._drop(worker, was_up=True)
        with self._lock:
            if self._closed:
                return
            self.replaced += 1
        self._start_worker()

    def _drop(self, worker: _Worker, *, was_up: bool) -> None:
        with self._lock:
            if worker in self._live:
                self._live.discard(worker)
                self._up -= was_up
        self._stop(worker)

    @staticmethod
    def _stop(worker: _Worker) -> None:
        worker.requests.close()
        worker.answers.close()
        if worker.process.poll() is None:
            worker.process.kill()
        try:
            worker.process.wait(1.0)
        except subprocess.TimeoutExpired:  # unkillable for now: the OS reaps it later
            log.warning("a count worker (pid %d) did not exit when killed", worker.process.pid)

    def close(self) -> None:
        """close stops every worker; later counts are refused with TokenizerBusy."""
        with self._lock:
            self._closed = True
            self._up = 0
            live, self._live = self._live, set()
        for worker in live:
            self._stop(worker)


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
