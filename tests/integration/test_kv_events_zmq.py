"""The KV events subscriber over real ZMQ sockets: a publisher in the test plays back, byte for
byte, what the real vLLM engine published (tests/fixtures, tests/kv_capture.py) on a PUB
socket and answers replay requests on a ROUTER socket as vLLM does; the subscriber fills the
gap the engine left, survives hostile messages and a lost connection, and placement follows
what the events say each node caches."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from extproc.admission import Admission, Demand, Lease
from extproc.clock import ManualClock
from extproc.configparse import parse_config
from extproc.engine_blocks import EngineBlocks, token_keys
from extproc.signals.kv_events import KvEvents, NodeEvents, Subscriber, ViewState, decode_batch
from kvgate_testkit.admission import acquire_now
from kvgate_testkit.procs import wait_until
from tests.kv_capture import load
from tests.unit.admission.helpers import T0
from tests.unit.admission.test_nodes import nodes_pool, report

CAPTURE = load()
END = (-1).to_bytes(8, "big", signed=True)
LOOPBACK = "127.0.0.1"


class Publisher:
    """Publisher plays an engine's event sockets: an XPUB (a PUB that also tells when a
    subscriber subscribed) and a ROUTER answering replay requests from ``buffer`` as vLLM's
    ZmqEventPublisher does."""

    def __init__(self, ctx: zmq.Context, buffer: list[tuple[int, bytes]], topic: bytes = b"kv") -> None:
        self.topic = topic
        self.buffer = buffer
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port(f"tcp://{LOOPBACK}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port(f"tcp://{LOOPBACK}")
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://{LOOPBACK}:{self.replay_port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in self.buffer:
                if seq >= first:
                    self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", END, b""])

    def wait_subscribed(self) -> None:
        """wait_subscribed returns once a subscriber's subscription reached the socket."""
        assert self.pub.poll(10_000), "no subscriber subscribed"
        assert self.pub.recv() == b"\x01" + self.topic

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        """close stops answering and closes both sockets (again: nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def replayed() -> list[tuple[int, bytes]]:
    return [(int.from_bytes(f[2], "big"), f[3]) for f in CAPTURE.replay if f[2] != END]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


def test_the_subscriber_fills_the_message_the_engine_dropped_and_ends_exact(ctx):
    engine = Publisher(ctx, replayed())
    view = NodeEvents(EngineBlocks())
    sub = Subscriber("n0", engine.endpoint, engine.replay, "kv", view, ctx)
    sub.start()
    try:
        engine.wait_subscribed()
        wait_until(lambda: view.state is not ViewState.DOWN, what="connected")
        for frames in CAPTURE.pub:       # as the engine sent them: sequence 0 is missing
            engine.send(frames)
        wait_until(lambda: view.last_seq == 4, what="every message applied")
        assert engine.replays == 1 and view.replayed == 1 and view.gaps == 0
        assert view.state is ViewState.LIVE
        # The same index as every message applied in order.
        want = EngineBlocks()
        for _, payload in replayed():
            for e in decode_batch(payload).events:
                want.apply(e)
        assert dict(view.blocks.by_hash) == dict(want.by_hash)
        last = CAPTURE.requests[-1][1]
        assert view.cached(token_keys(last)) == (len(last) - len(last) % 32, True)

        # Hostile messages: counted and dropped; the thread goes on.
        engine.send([b"kv", b"\x00" * 8])
        engine.send([b"kv", (5).to_bytes(8, "big"), b"\xc1\xc1"])
        engine.send([b"kv", (5).to_bytes(8, "big"), msgpack.packb([9.0, [["AllBlocksCleared"]], 0])])
        wait_until(lambda: view.last_seq == 5, what="the clear applied")
        assert view.dropped["frames"] == 1 and view.dropped["msgpack"] == 1
        assert len(view.blocks) == 0 and view.state is ViewState.LIVE

        # The engine goes away: the view is down, so placement falls back to kvgate's record.
        engine.close()
        wait_until(lambda: view.state is ViewState.DOWN, what="disconnect seen")
        assert view.cached(token_keys(last)) is None
    finally:
        sub.stop()
        engine.close()


def test_a_gap_the_replay_buffer_no_longer_holds_leaves_the_view_partial(ctx):
    msgs = replayed()
    engine = Publisher(ctx, msgs[3:])     # the engine's buffer kept only the latest
    view = NodeEvents(EngineBlocks())
    sub = Subscriber("n0", engine.endpoint, engine.replay, "kv", view, ctx)
    sub.start()
    try:
        engine.wait_subscribed()
        engine.send([b"kv", (0).to_bytes(8, "big"), msgs[0][1]])
        wait_until(lambda: view.last_seq == 0)
        assert view.state is ViewState.LIVE
        engine.send([b"kv", (4).to_bytes(8, "big"), msgs[4][1]])
        wait_until(lambda: view.last_seq == 4)
        assert view.gaps == 1 and view.state is ViewState.PARTIAL
    finally:
        sub.stop()
        engine.close()


def picking_config(engines: dict[str, Publisher]) -> dict:
    # Each request holds 298 tokens and n1 caches 192 of the prompt: at affinity 10 the cached
    # tokens outweigh the room the first four requests take there.
    pool = nodes_pool(2, prefix_affinity=10.0)
    pool["picking"]["kv_events"] = {"topic": "kv", "endpoints": [
        {"backend": name, "endpoint": e.endpoint, "replay_endpoint": e.replay} for name, e in engines.items()]}
    return {"pools": {"default": pool}}


def place(adm: Admission, prompt: list[int], requests: int) -> list[str]:
    """place admits ``requests`` requests of ``prompt`` (keyed by its token ids); their nodes."""
    nodes = []
    for _ in range(requests):
        lease = acquire_now(adm, Demand(pool="default", tenant="t", class_name="standard",
                                       prompt_tokens=len(prompt), reserved_completion=100,
                                       blocks=token_keys(prompt)))
        assert isinstance(lease, Lease)
        nodes.append(lease.node)
    return nodes


def test_placement_goes_to_the_node_whose_events_say_it_caches_the_prompt(ctx):
    """Two idle nodes; only n1's engine has cached the prompt (its events say so): every
    request goes there. Without events it would alternate between them."""
    msgs = replayed()
    engines = {"n0": Publisher(ctx, []), "n1": Publisher(ctx, msgs)}
    raw = picking_config(engines)
    events = KvEvents()
    clock = ManualClock(T0)
    adm = Admission(parse_config(raw), clock)
    adm.node_events = events.view
    events.reconfigure(parse_config(raw))
    try:
        for e in engines.values():
            e.wait_subscribed()
        engines["n0"].send([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, [["AllBlocksCleared"]], 0])])
        engines["n1"].send([b"kv", (0).to_bytes(8, "big"), msgs[0][1]])
        wait_until(lambda: all(v.last_seq == 0 and v.state is ViewState.LIVE for _, _, v in events.views()))
        report(adm, clock, {"n0": 0.0, "n1": 0.0})
        prompt = CAPTURE.requests[0][1]
        assert place(adm, prompt, 4) == ["127.0.0.1:8002"] * 4
        by = {n.name: n for n in adm.nodes("default")}
        assert by["n1"].affinity_picks >= 1
        # Without the events (a node whose view is down): in turn, as before.
        adm.node_events = None
        assert "127.0.0.1:8001" in place(adm, prompt, 2)
        # A reload that drops the events stops the subscribers.
        plain = {"pools": {"default": nodes_pool(2)}}
        events.reconfigure(parse_config(plain))
        assert events.views() == []
    finally:
        events.stop()
        for e in engines.values():
            e.close()


async def test_the_server_follows_the_config_and_exports_each_nodes_view(ctx):
    """kvgate's server starts a subscriber per node of a pool that reads KV events, hands the
    views to placement and to /metrics, and a reload without them stops the subscribers."""
    import asyncio
    import urllib.request

    from prometheus_client import CollectorRegistry

    from extproc.metrics import Metrics
    from extproc.server import Server

    msgs = replayed()
    engine = Publisher(ctx, msgs)
    raw = {"pools": {"default": nodes_pool(1)}, "server": {"drain_s": 0.0, "grace_s": 1.0}}
    raw["pools"]["default"]["picking"]["kv_events"] = {
        "topic": "kv", "endpoints": [{"backend": "n0", "endpoint": engine.endpoint, "replay_endpoint": engine.replay}]}
    srv = Server(parse_config(raw), grpc_listen=f"{LOOPBACK}:0", admin_listen=f"{LOOPBACK}:0",
                 metrics=Metrics(CollectorRegistry()), scrape=True)
    await srv.start()
    try:
        await asyncio.to_thread(engine.wait_subscribed)
        engine.send(CAPTURE.pub[0])                     # sequence 1: 0 comes from the replay
        assert srv.admission.node_events is not None
        view = srv.admission.node_events("default", "n0")
        await asyncio.to_thread(wait_until, lambda: view.last_seq == 1)
        shares = CAPTURE.requests[1][1]
        assert view.cached(token_keys(shares)) == (len(shares) - len(shares) % 32, True)

        def scraped() -> str:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{srv.admin_port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        text = await asyncio.to_thread(scraped)
        assert 'kvgate_kv_events_view{backend="n0",pool="default",state="live"} 1.0' in text
        assert 'kvgate_kv_events_replayed_total{backend="n0",pool="default"} 1.0' in text
        plain = {"pools": {"default": nodes_pool(1)}, "server": {"drain_s": 0.0, "grace_s": 1.0}}
        srv._apply_nodes(parse_config(plain))
        assert srv.admission.node_events("default", "n0") is None
    finally:
        await srv.close()
        engine.close()
