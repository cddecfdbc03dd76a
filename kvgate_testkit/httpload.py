"""httpload: the hot-path benchmarks' load generator: HTTP/1.1 keep-alive connections on a bare
asyncio protocol (uvloop when installed), so that the processes measured get as much of the
machine as possible; closed-loop clients, open-loop rates, held and timed streams, and
kvgate's in-flight gauge read over one such connection.

The fake upstream (``kvgate_testkit.upstream --fast``) writes each chunk's write instant on
the host's monotonic clock (``"t_sent":``), so a stream's per-chunk delay is exact.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvgate_testkit.procs import LOOPBACK

CHAT_PATH = "/v1/chat/completions"


def run(coro: Any) -> Any:
    """run runs ``coro`` to its end on uvloop (asyncio's own loop when uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


_T_SENT = b'"t_sent":'
_CHUNKED_END = b"0\r\n\r\n"


class HttpError(Exception):
    """HttpError is a request that did not get a 200 (or lost its connection)."""


class Conn(asyncio.Protocol):
    """Conn is one keep-alive HTTP/1.1 client connection; one request at a time.

    ``request`` sends prebuilt request bytes and returns the status once the whole response
    is read. For a streamed answer, ``on_chunk(now, t_sent)`` is called for every SSE event
    that carries the upstream's write time, as soon as the event is read.
    """

    def __init__(self) -> None:
        self.transport: Any = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done: asyncio.Future[int] | None = None
        self._buf = bytearray()
        self._status = 0
        self._length: int | None = None
        self._body_at = -1
        self._scan = 0
        self._on_chunk: Callable[[float, float], None] | None = None

    @classmethod
    async def open(cls, port: int) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, LOOPBACK, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self._done is not None and not self._done.done():
            self._done.set_exception(HttpError("connection lost"))

    def request(self, data: bytes,
                on_chunk: Callable[[float, float], None] | None = None) -> asyncio.Future[int]:
        self._done = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self._status, self._length, self._body_at, self._scan = 0, None, -1, 0
        self._on_chunk = on_chunk
        self.transport.write(data)
        return self._done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buf = self._buf
        buf += data
        if self._body_at < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            self._status = int(head[9:12])
            match = re.search(rb"\r\ncontent-length: *(\d+)", head)
            self._length = int(match.group(1)) if match else None
            self._body_at = self._scan = end + 4
        if self._on_chunk is not None:
            while True:
                i = buf.find(_T_SENT, self._scan)
                if i < 0:
                    break
                j = buf.find(b"}", i)
                if j < 0:
                    break
                self._on_chunk(now, float(buf[i + len(_T_SENT):j]))
                self._scan = j
        done = (len(buf) - self._body_at >= self._length if self._length is not None
                else buf.endswith(_CHUNKED_END))
        if done and self._done is not None and not self._done.done():
            self._done.set_result(self._status)


def http_request(body: bytes, *, extra: bytes = b"") -> bytes:
    """http_request is a POST of ``body`` to the chat endpoint, as bytes on the wire."""
    return (b"POST " + CHAT_PATH.encode() + b" HTTP/1.1\r\nhost: bench\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(body), extra, body))


# Words of ordinary English prose, so that tokenizing costs what it costs on real prompts.
_WORDS = ("the a of to and in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we can their has would when "
          "model request token cache memory budget tenant prompt answer stream server node latency "
          "throughput window context completion reserve refund admission gateway envoy processor "
          "explicit implicit beautiful ugly simple complex nested sparse readability practicality "
          "purity errors silently ambiguity temptation obvious implementation namespaces honking "
          "quickly slowly carefully yesterday tomorrow whenever because although therefore however "
          "measured predicted allocated released scheduled preempted swapped evicted admitted").split()


class ChatBodies:
    """ChatBodies makes non-streaming chat requests of about ``size`` bytes, each one unique.

    Every body starts with a fresh counter, so no cache of prompt counts can serve it:
    kvgate tokenizes every request as it would in production.
    """

    def __init__(self, size: int = 2048, variants: int = 64, seed: int = 7) -> None:
        rng = random.Random(seed)
        self._texts = []
        for _ in range(variants):
            words: list[str] = []
            length = 0  # of the words so far, a space after each
            while length < size - 180:
                words.append(rng.choice(_WORDS))
                length += len(words[-1]) + 1
            self._texts.append(" ".join(words))
        self._n = 0

    def __call__(self) -> bytes:
        self._n += 1
        text = self._texts[self._n % len(self._texts)]
        return http_request(orjson.dumps({"model": "fake", "max_tokens": 16, "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Request {self._n}. {text}"}]}))


def stream_request(chunks: int, delay_ms: float = 0, hold: bool = False) -> bytes:
    """stream_request asks the fake for a stream of ``chunks`` chunks, ``delay_ms`` apart."""
    extra = b"x-fake-delay-ms: %d\r\n" % delay_ms
    if hold:
        extra += b"x-fake-hold: 1\r\n"
    body = orjson.dumps({"model": "fake", "max_tokens": chunks, "stream": True,
                         "messages": [{"role": "user", "content": "Tell me a story."}]})
    return http_request(body, extra=extra)


async def closed_loop(port: int, bodies: ChatBodies, clients: int, total: int,
                      expect: int | None = 200) -> list[float]:
    """closed_loop sends ``total`` requests from ``clients`` keep-alive connections, each
    waiting for its answer (status ``expect``; None: any) before sending the next; returns
    latencies in seconds."""
    conns = [await Conn.open(port) for _ in range(clients)]
    latencies: list[float] = []
    remaining = total

    async def client(conn: Conn) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            data = bodies()
            t0 = time.perf_counter()
            status = await conn.request(data)
            latencies.append(time.perf_counter() - t0)
            if expect is not None and status != expect:
                raise HttpError(f"status {status}")
    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    return latencies


@dataclass
class StreamTimes:
    """StreamTimes are the delays of streamed answers (seconds)."""

    first: list[float] = field(default_factory=list)   # request sent -> first chunk read
    chunk: list[float] = field(default_factory=list)   # upstream write -> client read, per chunk
    cpu_s: dict[str, float] = field(default_factory=dict)  # by role (processor, envoy)


async def streams(port: int, count: int, chunks: int, interval_ms: float,
                  out: StreamTimes) -> None:
    """streams runs ``count`` concurrent streams of ``chunks`` chunks ``interval_ms`` apart,
    started over one interval so that they do not tick in lockstep."""
    data = stream_request(chunks, interval_ms)

    async def one(delay: float) -> None:
        await asyncio.sleep(delay)
        conn = await Conn.open(port)
        try:
            first: list[float] = []

            def on_chunk(now: float, sent: float) -> None:
                if not first:
                    first.append(now)
                out.chunk.append(now - sent)
            t0 = time.monotonic()
            if await conn.request(data, on_chunk) != 200:
                raise HttpError("stream refused")
            if first:
                out.first.append(first[0] - t0)
        finally:
            conn.close()
    rng = random.Random(count)
    await asyncio.gather(*(one(rng.random() * interval_ms / 1000) for _ in range(count)))


async def open_loop(port: int, bodies: ChatBodies, rate: int, seconds: float) -> tuple[list[float], int, bool]:
    """open_loop sends requests at ``rate`` per second for ``seconds`` whatever the answers'
    pace (idle connections are reused, new ones opened as needed). Returns latencies,
    errors and whether the generator itself fell behind (then the rung does not count)."""
    loop = asyncio.get_running_loop()
    idle: list[Conn] = []
    everyone: list[Conn] = []
    latencies: list[float] = []
    errors = 0
    pending: set[asyncio.Task[None]] = set()

    async def one(data: bytes) -> None:
        nonlocal errors
        conn = idle.pop() if idle else None
        if conn is None:
            conn = await Conn.open(port)
            everyone.append(conn)
        t0 = time.perf_counter()
        try:
            status = await conn.request(data)
        except HttpError:
            errors += 1
            return
        latencies.append(time.perf_counter() - t0)
        if status != 200:
            errors += 1
        idle.append(conn)

    total = int(rate * seconds)
    start = loop.time()
    behind = 0
    for i in range(total):
        due = start + i / rate
        wait = due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -0.005:
            behind += 1
        task = asyncio.ensure_future(one(bodies()))
        pending.add(task)
        task.add_done_callback(pending.discard)
    # A generator more than 5 ms behind its schedule for over 2% of the sends did not
    # offer the rate (a shared core was busy elsewhere): the rung is void, not passed.
    late = behind > 0.02 * total
    if pending:
        await asyncio.wait(pending, timeout=10)
    errors += sum(1 for t in pending if not t.done())
    for conn in everyone:
        conn.close()
    return latencies, errors, late


async def hold_streams(port: int, count: int, batch: int = 256) -> list[Conn]:
    """hold_streams opens ``count`` streams the upstream holds after their first chunk and
    returns their connections once every first chunk has been read."""
    data = stream_request(2, hold=True)
    conns: list[Conn] = []

    async def one() -> None:
        conn = await Conn.open(port)
        conns.append(conn)
        got = asyncio.get_running_loop().create_future()

        def on_chunk(now: float, sent: float) -> None:
            if not got.done():
                got.set_result(None)
        done = conn.request(data, on_chunk)
        done.add_done_callback(_retrieved)  # ends with the connection, by design
        await asyncio.wait([got, done], return_when=asyncio.FIRST_COMPLETED, timeout=30)
        if not got.done():
            raise HttpError("a held stream got no first chunk")
    for start in range(0, count, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, count - start))))
    return conns


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class Inflight:
    """Inflight reads kvgate's ``kvgate_inflight_requests`` (summed) over one keep-alive
    connection, and other lines of its /metrics (``read_sum``)."""

    _LINE = re.compile(rb"^kvgate_inflight_requests\{[^}]*\} ([0-9.e+-]+)$", re.M)
    PROGRESS = re.compile(rb'^kvgate_access_log_entries_total\{result="progress"\} ([0-9.e+-]+)$', re.M)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    @classmethod
    async def open(cls, admin_port: int) -> Inflight:
        return cls(await Conn.open(admin_port))

    async def read(self) -> float:
        return await self.read_sum(self._LINE)

    async def read_sum(self, line: re.Pattern[bytes]) -> float:
        """read_sum is the sum of the values of the /metrics lines ``line`` matches."""
        await self.conn.request(b"GET /metrics HTTP/1.1\r\nhost: bench\r\n\r\n")
        return sum(float(v) for v in line.findall(bytes(self.conn._buf)))

    async def wait(self, value: float, timeout: float = 10.0, interval: float = 0.001) -> float:
        """wait polls until the value is ``value``; returns when it was first seen (monotonic)."""
        deadline = time.monotonic() + timeout
        while True:
            got = await self.read()
            now = time.monotonic()
            if got == value:
                return now
            if now > deadline:
                raise TimeoutError(f"kvgate_inflight_requests stayed {got}, not {value}")
            await asyncio.sleep(interval)

    def close(self) -> None:
        self.conn.close()
