"""support: a real kvgate ``Server`` on loopback and the ext_proc messages Envoy sends.

``Rig`` runs one in-process ``Server`` (grpc.aio on port 0, admin HTTP on port 0, a
``ManualClock`` so buckets never refill behind a test's back) and a gRPC client channel
to it, on an event loop the rig owns. Sync tests (Hypothesis among them) drive it with
``rig.run(coro)``. Helpers read the admission core and the metrics registry directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry

from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.metrics import Metrics
from extproc.openai_api import Endpoint, count_prompt_tokens, parse_request
from extproc.openai_shapes import TEMPLATES
from extproc.server import Server
from extproc.tokens import load_tokenizer
from kvgate_testkit.procs import LOOPBACK

T = TypeVar("T")

# Two pools (one with a KV budget and a small window), tenant buckets, and a class per
# tenant: every budget the core has is in play.
CONFIG: dict[str, Any] = {
    "pools": {
        "default": {"max_concurrency": 3, "tpm": 1_000_000_000, "context_window": 4096,
                    "default_max_tokens": 256, "kv_budget_tokens": 12_000,
                    "tokenizer": "cl100k_base"},
        "small": {"max_concurrency": 1, "context_window": 1024, "default_max_tokens": 64,
                  "tokenizer": "cl100k_base"},
    },
    "limits": {"max_body_bytes": 65536},
    "tenants": {
        "header": "x-tenant-id", "default_class": "standard",
        "classes": {"standard": {"priority": 0, "tpm": 500_000_000},
                    "gold": {"priority": 10, "guaranteed_slots": 1}},
        "tenants": {"acme": {"class": "standard"}, "gold-1": {"class": "gold"}},
    },
    "server": {"drain_s": 0.0, "grace_s": 1.0},
}


class LoopLag:
    """LoopLag measures how long kvgate held the event loop: the most CPU time the loop's
    thread spent between two wake-ups of a 5 ms ticker, past the period (seconds).

    A held loop makes every other stream wait as long. CPU time of the loop's own thread,
    not wall-clock lateness: on a shared machine the OS may leave the whole process
    unscheduled for a second, which says nothing of kvgate; work done on the loop (a parse,
    a count that was not offloaded) shows in the thread's CPU time whatever the load.
    ``worst_wall`` keeps the wall-clock lateness for reports.
    """

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.worst = 0.0
        self.worst_wall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(self.period_s)
            held = time.thread_time() - c0  # the sleep itself costs no CPU
            self.worst = max(self.worst, held)
            self.worst_wall = max(self.worst_wall, time.perf_counter() - t0 - self.period_s)

    def start(self) -> None:
        """start runs the ticker on the current loop."""
        self.worst = self.worst_wall = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> float:
        """stop ends the ticker and returns the longest the loop was held (seconds of CPU)."""
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.worst


class Rig:
    """Rig is one real kvgate Server on loopback plus a client stub, on the rig's own loop."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock(1000.0)
        self.config = parse_config(config or CONFIG)
        self.server = Server(self.config, grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                             metrics=Metrics(CollectorRegistry()), clock=self.clock, scrape=False)
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None
        self.run(self._start())

    async def _start(self) -> None:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"{LOOPBACK}:{self.server.grpc_port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """run runs ``coro`` to completion on the rig's loop."""
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        """close stops the client channel and the server, then the loop."""
        async def stop() -> None:
            if self.channel is not None:
                await self.channel.close()
            await self.server.close()
        try:
            self.run(stop())
        finally:
            self.loop.close()

    # --- looking inside ----------------------------------------------------------------

    def count(self, name: str, **labels: str) -> float:
        """count sums a metric's samples whose labels include ``labels`` (from the registry)."""
        total = 0.0
        for family in self.server.metrics.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def held(self) -> dict[str, tuple[int, int]]:
        """held is (in-flight requests, in-flight KV tokens) per pool the store knows."""
        now = self.clock.now()
        store = self.server.admission.store
        return {pool: (u.inflight, u.kv_inflight)
                for pool in ("default", "small", *self.server.admission.pools)
                for u in [store.usage(pool, now)]}

    def nothing_held(self) -> bool:
        """nothing_held tells whether no pool holds a slot or a KV token."""
        return all(v == (0, 0) for v in self.held().values())

    async def settle(self, timeout: float = 5.0) -> None:
        """settle waits (bounded) until every ext_proc stream on the server has ended."""
        await wait_for(lambda: self.count("kvgate_streams_active") == 0, timeout)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """wait_for polls a condition another task brings about (bounded), not the passing of time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.002)


# --- what Envoy sends ------------------------------------------------------------------------

def header_map(pairs: list[tuple[str, bytes]]) -> base_pb2.HeaderMap:
    """header_map is Envoy's header map, values as raw bytes (as Envoy 1.40 sends them)."""
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def request_headers(path: str = "/v1/chat/completions", *, method: str = "POST",
                    extra: list[tuple[str, str]] = (), eos: bool = False) -> pb.ProcessingRequest:
    """request_headers is a request_headers message for a JSON request (``extra`` appended)."""
    hs = [(":path", path), (":method", method), (":scheme", "http"), (":authority", "gw"),
          ("content-type", "application/json"), *extra]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=header_map([(k, v.encode("utf-8", "surrogateescape")) for k, v in hs]),
        end_of_stream=eos))


def request_body(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    """request_body is a request_body message (BUFFERED: the whole body, end of stream)."""
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def response_headers(status: int | str = 200, content_type: str = "application/json",
                     eos: bool = False) -> pb.ProcessingRequest:
    """response_headers is a response_headers message with the upstream's status."""
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map([
        (":status", str(status).encode()), ("content-type", content_type.encode())]),
        end_of_stream=eos))


def response_body(data: bytes, eos: bool = False) -> pb.ProcessingRequest:
    """response_body is one STREAMED response chunk."""
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def chat(content: str = "Hello", **fields: Any) -> bytes:
    """chat is a one-message chat completions body with ``fields`` added."""
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **fields})


def prompt_tokens(body: bytes) -> int:
    """prompt_tokens counts a chat body's prompt the way kvgate does for CONFIG's pools
    (cl100k_base, the default chat template)."""
    return count_prompt_tokens(parse_request(Endpoint.CHAT, body, "application/json"),
                               load_tokenizer("cl100k_base"), TEMPLATES["openai"])


def sse(obj: dict[str, Any]) -> bytes:
    """sse is one server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKEN = {"choices": [{"index": 0, "delta": {"content": "x"}}]}


def usage_json(completion: int, prompt: int = 5) -> bytes:
    """usage_json is a non-streamed completion reporting ``completion`` tokens."""
    return orjson.dumps({"choices": [{"index": 0, "message": {"content": "x"}}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                   "total_tokens": prompt + completion}})


def kind(resp: Any) -> str:
    """kind names an answer: the response oneof, or ``immediate:<status>``."""
    which = resp.WhichOneof("response")
    if which == "immediate_response":
        return f"immediate:{resp.immediate_response.status.code}"
    return str(which)

