"""kv_events: reads the KV cache events a vLLM engine publishes, one subscriber per node.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` publishes on a
ZMQ PUB socket one message per engine step that changed its cache, of three frames: the
topic (``topic`` in the config, empty by default), the sequence number (8 bytes, big
endian: 0, 1, 2, ... from the engine's start) and the payload, a msgpack array ``[ts,
events, data_parallel_rank]`` (msgspec ``array_like``; a trailing default left out). Each
event is a tagged union: vLLM 0.32 sends a map whose ``type`` is the event's name
(``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
[...], "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null, ...}``,
``BlockRemoved`` with ``block_hashes`` and ``medium``, ``AllBlocksCleared``, fields equal to
their defaults left out); earlier releases sent an array whose first element is the name,
then the fields in order. Both are read. Block hashes are integers or bytes, depending on
the engine's hash algorithm. Fields not named in ``_FIELDS`` are ignored (newer engines add
some). The ROUTER socket at ``replay_endpoint`` answers a DEALER's ``[b"", first seq
wanted (8 bytes, big endian)]`` with each buffered message from there as ``[b"", topic,
seq, payload]`` and then ``[b"", b"", -1, b""]``.

A ``Subscriber`` thread per node keeps that node's ``EngineBlocks`` (``extproc.engine_blocks``)
up to date. Its view is:
- ``live`` while its socket is connected and every event since the engine's cache was
  empty was applied (the first message it got was sequence 0, or a replay from 0 filled in
  what came before): the index is the engine's cache, and placement ranks by it alone;
- ``partial`` while connected but some events were missed (it started while the engine
  ran, a gap that a replay could not fill, the index's bound reached): placement ranks by
  the larger of the index and kvgate's own record;
- ``down`` before its socket connects and after it disconnects: placement uses kvgate's
  record only.
A gap in the sequence numbers asks the replay socket for what is missing (when one is
configured; at most MAX_REPLAY messages, REPLAY_TIMEOUT_S); a sequence number that goes back
to 0 is an engine that restarted, with an empty cache, one that goes back elsewhere an engine
that restarted while the socket was down (the view starts again, from a replay from 0 where
the buffer has it); the same number again is dropped. An AllBlocksCleared event makes a
partial view live again. One endpoint is one engine: vLLM's data-parallel ranks publish
on consecutive ports, each to be configured as its own endpoint (``data_parallel_rank`` is
read, not used).

Nothing the socket delivers can stop the thread: a message that is not three frames, a
sequence number that is not 8 bytes, a payload that does not decode or does not have the
shape above is counted by reason (``DROP_REASONS``) and dropped; messages over
MAX_MESSAGE_BYTES are refused by ZMQ itself, which drops the connection. The index is
bounded (``EngineBlocks.max_blocks``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
import zmq

from extproc.engine_blocks import Cleared, EngineBlocks, Event, Removed, Stored

log = logging.getLogger(__name__)

# Why a message was dropped: not [topic, seq, payload]; a sequence number not of 8 bytes;
# a payload that is no msgpack; a batch or event of another shape (wrong types, bounds).
DROP_REASONS = ("frames", "sequence", "msgpack", "shape")
# One message is one engine step's events: a step storing a 32k-token prompt in blocks of
# 16 is about 2,000 hashes and 32k token ids, ~200 KB. Larger is refused by ZMQ.
MAX_MESSAGE_BYTES = 16 << 20
# Token ids are below 2**32 (as kvgate's request parsing checks them); block hashes are
# integers of at most 64 bits or digests of at most 64 bytes.
_MAX_TOKEN_ID = 1 << 32
_MAX_HASH_BYTES = 64
_HASH_INT_RANGE = (-(1 << 63), 1 << 64)
# Seconds a poll waits before the thread looks whether it should stop.
POLL_S = 0.1
# Seconds a replay may take before the gap is given up (the view turns partial), and the
# messages it may bring at most (vLLM buffers 10,000 by default).
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY = 10_000
_END_SEQ = -1


class ViewState(StrEnum):
    """ViewState is how far a node's event view can be trusted (see the module doc)."""

    LIVE = "live"
    PARTIAL = "partial"
    DOWN = "down"


class FrameError(ValueError):
    """FrameError is a message that cannot be read; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Batch:
    """Batch is one published message: ``ts`` (the engine's wall clock, seconds), its
    ``events`` in order, and the data-parallel rank that sent it (None: not given)."""

    ts: float
    events: tuple[Event, ...]
    rank: int | None = None


def _hash(x: Any) -> int | bytes:
    if type(x) is int and _HASH_INT_RANGE[0] <= x < _HASH_INT_RANGE[1]:
        return x
    if type(x) is bytes and 0 < len(x) <= _MAX_HASH_BYTES:
        return x
    raise FrameError("shape", f"a block hash must be an integer or bytes, got {type(x).__name__}")


def _hashes(x: Any) -> tuple[int | bytes, ...]:
    if type(x) is not list:
        raise FrameError("shape", "block_hashes must be an array")
    return tuple(_hash(h) for h in x)


def _optional_int(x: Any, name: str) -> int | None:
    if x is None or type(x) is int:
        return x
    raise FrameError("shape", f"{name} must be an integer or nil")


def _medium(x: Any) -> str | None:
    if x is None or (type(x) is str and len(x) <= 64):
        return x
    raise FrameError("shape", "medium must be a short string or nil")


# Each event's fields in the order an array-encoded event lists them after its type's name
# (vLLM encoded events as arrays until its events grew optional fields; 0.32 sends maps).
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _fields(x: Any) -> tuple[str, dict[str, Any]]:
    """_fields is an event's type name and fields, from either encoding (see the module doc)."""
    if type(x) is list and x and type(x[0]) is str and x[0] in _FIELDS:
        return x[0], dict(zip(_FIELDS[x[0]], x[1:]))
    if type(x) is dict and type(x.get("type")) is str and x["type"] in _FIELDS:
        return x["type"], x
    raise FrameError("shape", "an event must be a BlockStored, BlockRemoved or AllBlocksCleared")


def _extra(x: Any, blocks: int) -> tuple[bool, ...]:
    if x is None:
        return ()
    if type(x) is not list or len(x) != blocks:
        raise FrameError("shape", "extra_keys must hold one entry per block")
    return tuple(e is not None and e != [] for e in x)


def _event(x: Any) -> Event:
    tag, f = _fields(x)
    if tag == "AllBlocksCleared":
        return Cleared()
    if "block_hashes" not in f:
        raise FrameError("shape", f"{tag} without block_hashes")
    hashes = _hashes(f["block_hashes"])
    medium = _medium(f.get("medium"))
    group = _optional_int(f.get("group_idx"), "group_idx")
    if tag == "BlockRemoved":
        return Removed(hashes, medium, group)
    ids = f.get("token_ids")
    if type(ids) is not list or not all(type(t) is int and 0 <= t < _MAX_TOKEN_ID for t in ids):
        raise FrameError("shape", "token_ids must be an array of token ids")
    size = f.get("block_size")
    if type(size) is not int or not 0 < size <= 1 << 16:
        raise FrameError("shape", "block_size must be a positive integer")
    parent = f.get("parent_block_hash")
    lora_name = f.get("lora_name")
    if lora_name is not None and type(lora_name) is not str:
        raise FrameError("shape", "lora_name must be a string or nil")
    return Stored(hashes, None if parent is None else _hash(parent), tuple(ids), size,
                  _optional_int(f.get("lora_id"), "lora_id"), medium,
                  lora_name, _extra(f.get("extra_keys"), len(hashes)), group)


def decode_batch(payload: bytes) -> Batch:
    """decode_batch reads one message's payload; raises FrameError (msgpack, shape)."""
    try:
        top = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several types (ValueError, StackError, ...)
        raise FrameError("msgpack", type(err).__name__) from None
    if type(top) is not list or len(top) < 2:
        raise FrameError("shape", "a batch must be an array [ts, events, ...]")
    ts, events = top[0], top[1]
    if type(ts) not in (int, float) or type(events) is not list:
        raise FrameError("shape", "a batch must be [ts, events, ...]")
    rank = _optional_int(top[2] if len(top) > 2 else None, "data_parallel_rank")
    return Batch(float(ts), tuple(_event(e) for e in events), rank)


def decode_frames(frames: list[bytes]) -> tuple[int, Batch]:
    """decode_frames reads one PUB message ``[topic, seq, payload]``: its sequence number
    and batch; raises FrameError."""
    if len(frames) != 3:
        raise FrameError("frames", f"{len(frames)} frames, expected 3")
    seq = frames[1]
    if len(seq) != 8 or seq[0] & 0x80:
        raise FrameError("sequence", f"a sequence number of {len(seq)} bytes, or negative")
    return int.from_bytes(seq, "big"), decode_batch(frames[2])


@dataclass
class NodeEvents:
    """NodeEvents is one node's view and what its subscriber counted (since start).

    ``batches``: messages applied; ``events``: events applied; ``dropped``: messages dropped
    by reason; ``gaps``: gaps in the sequence numbers; ``replayed``: messages a replay
    filled in; ``restarts``: engine restarts seen (a sequence back to 0).
    """

    blocks: EngineBlocks
    state: ViewState = ViewState.DOWN
    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    gaps: int = 0
    replayed: int = 0
    restarts: int = 0

    def cached(self, keys: tuple[int, ...]) -> tuple[int, bool] | None:
        """cached is the tokens of the prompt of ``keys`` (``engine_blocks.token_keys``) that
        the node caches, and whether that is exact (the view is live); None while down."""
        state = self.state
        if state is ViewState.DOWN:
            return None
        return self.blocks.cached(keys), state is ViewState.LIVE


class Subscriber:
    """Subscriber is one node's reader thread: it connects a SUB socket to ``endpoint``
    (ZMQ reconnects by itself), applies each message to ``view`` in sequence order, asks
    ``replay`` (None: none) to fill gaps, and tracks the connection (see the module doc).
    ``stop`` ends it within POLL_S."""

    def __init__(self, name: str, endpoint: str, replay: str | None, topic: str,
                 view: NodeEvents, context: zmq.Context[Any]) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay = replay
        self.topic = topic
        self.view = view
        self._context = context
        self._stop = threading.Event()
        self._connected = False
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"kvgate-kv-events-{name}", daemon=True)

    def start(self) -> None:
        """start runs the thread."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        """alive: the thread runs."""
        return self._thread.is_alive()

    def stop(self, wait: bool = True) -> None:
        """stop ends the thread, which closes its sockets within POLL_S (REPLAY_TIMEOUT_S in a
        replay); ``wait``: until it did."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5 * POLL_S + REPLAY_TIMEOUT_S)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug must not end the view silently: it turns down, loudly
            log.exception("kv events of node %s: the subscriber stopped", self.name)
            self.view.state = ViewState.DOWN

    def _loop(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(POLL_S * 1000)))
                if monitor in ready:
                    self._on_monitor(monitor.recv_multipart())
                if sub in ready:
                    for _ in range(1000):  # then look at the monitor and the stop flag again
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self.view.state = ViewState.DOWN

    def _on_monitor(self, frames: list[bytes]) -> None:
        if not frames or len(frames[0]) < 2:
            return
        event = int.from_bytes(frames[0][:2], "little")
        if event == zmq.EVENT_CONNECTED:
            self._connected = True
            log.info("kv events of node %s: connected to %s", self.name, self.endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            self._connected = False
            log.warning("kv events of node %s: disconnected from %s", self.name, self.endpoint)
        self._update_state()

    def _update_state(self) -> None:
        v = self.view
        if not self._connected:
            v.state = ViewState.DOWN
        else:
            v.state = ViewState.LIVE if v.blocks.complete else ViewState.PARTIAL

    def handle(self, frames: list[bytes]) -> None:
        """handle reads and applies one message (drops and counts one it cannot read)."""
        try:
            seq, batch = decode_frames(frames)
        except FrameError as err:
            self._drop(err)
            return
        self._accept(seq, batch)
        self._update_state()

    def _drop(self, err: FrameError) -> None:
        self.view.dropped[err.reason] += 1
        if err.reason not in self._logged:  # once per reason: a hostile peer must not flood the log
            self._logged.add(err.reason)
            log.warning("kv events of node %s: message dropped (%s); further drops of this kind "
                        "are only counted", self.name, err)

    def _accept(self, seq: int, batch: Batch) -> None:
        v = self.view
        last = v.last_seq
        if seq == last:
            return  # the same message again: nothing new
        if seq == 0:
            if last is not None:
                v.restarts += 1  # a new engine: its cache starts empty
            v.blocks.clear(complete=True)
        elif last is None or seq < last:
            # Started while the engine ran, or an engine restarted while disconnected: what
            # came before is unknown unless a replay from its start fills it in.
            if last is not None:
                v.restarts += 1
            v.blocks.clear(complete=False)
            if not self._catch_up(0, seq):
                v.blocks.incomplete()
        elif seq > last + 1:
            v.gaps += 1
            if not self._catch_up(last + 1, seq):
                v.blocks.incomplete()
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: Batch) -> None:
        v = self.view
        for e in batch.events:
            v.blocks.apply(e)
        v.events += len(batch.events)
        v.batches += 1
        v.last_seq = seq

    def _catch_up(self, start: int, until: int) -> bool:
        """_catch_up applies the messages ``start`` .. ``until - 1`` from the replay socket;
        True when all of them came, in order (the index then is as if none was missed; a
        replay from 0 makes it complete)."""
        if self.replay is None or self._stop.is_set():
            return False
        got = self._replayed(start, until)
        if not got or got[0][0] != start:
            for seq, batch in got:  # what is there is still true of the cache
                self._apply(seq, batch)
            return False
        expected = start
        for seq, batch in got:
            if seq != expected:
                return False
            self._apply(seq, batch)
            self.view.replayed += 1
            expected += 1
        if start == 0 and expected == until:
            self.view.blocks.complete = True
        return expected == until

    def _replayed(self, start: int, until: int) -> list[tuple[int, Batch]]:
        """_replayed asks the replay socket for the messages from ``start`` and keeps those
        before ``until`` (at most ``until - start``; REPLAY_TIMEOUT_S in all)."""
        assert self.replay is not None
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, Batch]] = []
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            deadline = REPLAY_TIMEOUT_S
            while deadline > 0 and len(got) < min(until - start, MAX_REPLAY):
                if not sock.poll(int(min(deadline, POLL_S) * 1000)):
                    deadline -= POLL_S
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                    self._drop(FrameError("frames", "a replayed message is not [b'', topic, seq, payload]"))
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                try:
                    batch = decode_batch(frames[3])
                except FrameError as err:
                    self._drop(err)
                    break
                if start <= seq < until:
                    got.append((seq, batch))
        finally:
            sock.close(linger=0)
        return got


_Spec = tuple[str, str | None, str, int]  # endpoint, replay endpoint, topic, max blocks


class KvEvents:
    """KvEvents runs one ``Subscriber`` per node of the picking pools that read KV events
    (``picking.kv_events``) and answers what each node caches (``view``).

    ``reconfigure`` follows the configuration (a reload, discovered nodes): a node whose
    endpoints changed gets a new subscriber and an empty view; the others keep theirs.
    """

    def __init__(self) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._subs: dict[tuple[str, str], tuple[_Spec, Subscriber]] = {}
        self._stopping: list[Subscriber] = []  # stopped by a reconfigure, joined by stop

    def reconfigure(self, config: Any) -> None:
        """reconfigure starts and stops subscribers to match ``config`` (an ``extproc.config.Config``)."""
        wanted: dict[tuple[str, str], _Spec] = {}
        for pool, pc in config.pools.items():
            events = pc.picking.kv_events if pc.picks or pc.discovery is not None else None
            if events is None:
                continue
            for b in pc.backends:
                ends = events.endpoint_of(b.name, b.address)
                if ends is not None:
                    wanted[(pool, b.name)] = (ends[0], ends[1], events.topic, events.max_blocks)
        self._stopping = [s for s in self._stopping if s.alive]
        for key, (spec, sub) in list(self._subs.items()):
            if wanted.get(key) != spec:
                sub.stop(wait=False)  # on the event loop: the thread closes its sockets itself
                del self._subs[key]
                self._stopping.append(sub)
        for key, spec in wanted.items():
            if key in self._subs:
                continue
            endpoint, replay, topic, max_blocks = spec
            sub = Subscriber(key[1], endpoint, replay, topic, NodeEvents(EngineBlocks(max_blocks)),
                             self._context)
            self._subs[key] = (spec, sub)
            sub.start()

    def view(self, pool: str, node: str) -> NodeEvents | None:
        """view is node ``node`` of ``pool``'s events view (None: the node publishes none)."""
        got = self._subs.get((pool, node))
        return None if got is None else got[1].view

    def views(self) -> list[tuple[str, str, NodeEvents]]:
        """views is every (pool, node, view), for the metrics."""
        return [(pool, node, sub.view) for (pool, node), (_spec, sub) in self._subs.items()]

    def stop(self) -> None:
        """stop ends every subscriber and the ZMQ context."""
        subs = [sub for _spec, sub in self._subs.values()] + self._stopping
        for sub in subs:
            sub.stop(wait=False)
        for sub in subs:
            sub.stop()
        self._subs.clear()
        self._stopping.clear()
        stuck = [sub.name for sub in subs if sub.alive]
        if stuck:  # term() would wait for their sockets forever: leave them to the process's end
            log.warning("kv events: subscribers of %s did not stop in time", ", ".join(stuck))
            return
        self._context.term()
