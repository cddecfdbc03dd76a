"""The KV events reader against what the real vLLM engine published (tests/fixtures, recorded by
tests/kv_capture.py): the decoder, the index of a node's cached blocks, the sequence
logic, and hostile messages, which are counted and dropped, never raised."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.engine_blocks import GRAIN, Cleared, EngineBlocks, Removed, Stored, token_keys
from extproc.signals.kv_events import (DROP_REASONS, FrameError, NodeEvents, Subscriber, ViewState,
                                       decode_batch, decode_frames)
from tests.kv_capture import load

CAPTURE = load()
END = (-1).to_bytes(8, "big", signed=True)


def replayed() -> list[tuple[int, bytes]]:
    """replayed is every message the engine buffered, (seq, payload), from 0, in order."""
    return [(int.from_bytes(f[2], "big", signed=True), f[3]) for f in CAPTURE.replay if f[2] != END]


def whole(prompt: list[int]) -> int:
    return len(prompt) - len(prompt) % CAPTURE.block_size


# --- the recording itself -----------------------------------------------------------------

def test_the_capture_is_what_the_engine_sent_for_each_request():
    msgs = replayed()
    assert [seq for seq, _ in msgs] == list(range(len(CAPTURE.requests)))
    assert CAPTURE.block_size == 32
    # The first message never reached the subscriber that was connected before it (the
    # engine's PUB socket dropped it), the replay socket had it: that is why gaps are replayed.
    assert [int.from_bytes(f[1], "big") for f in CAPTURE.pub] == [1, 2, 3, 4]
    assert all(f[0] == b"kv" for f in CAPTURE.pub)
    assert [f[2] for f in CAPTURE.pub] == [p for _, p in msgs[1:]]


def test_the_decoder_reads_vllm_0_32_maps():
    batch = decode_batch(replayed()[0][1])
    assert batch.rank == 0 and batch.ts > 1.7e9
    (stored,) = batch.events
    assert isinstance(stored, Stored)
    prompt = CAPTURE.requests[0][1]
    # 198 prompt tokens + 4 generated: the 6 whole blocks, the first with no parent.
    assert len(stored.hashes) == 6 and stored.parent is None and stored.block_size == 32
    assert stored.token_ids == tuple(prompt[:192])
    assert stored.medium == "GPU" and stored.group == 0 and stored.extra == (False,) * 6
    kinds = {type(e) for _, p in replayed() for e in decode_batch(p).events}
    assert kinds == {Stored, Removed}


def test_the_decoder_reads_the_array_encoding_of_earlier_releases():
    stored = ["BlockStored", [7, 8], None, list(range(64)), 32, None, "GPU"]
    payload = msgpack.packb([1.5, [stored, ["BlockRemoved", [7], None], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.rank is None
    assert batch.events == (Stored((7, 8), None, tuple(range(64)), 32, None, "GPU"),
                            Removed((7,), None), Cleared())


# --- the index against the engine --------------------------------------------------------

def test_the_index_says_exactly_what_the_engine_caches_of_each_prompt():
    blocks = EngineBlocks()
    for (seq, payload), (name, prompt) in zip(replayed(), CAPTURE.requests):
        for e in decode_batch(payload).events:
            blocks.apply(e)
        # After its request, the engine caches every whole block of its prompt.
        assert blocks.cached(token_keys(prompt)) == whole(prompt), name
    first, shares = CAPTURE.requests[0][1], CAPTURE.requests[1][1]
    assert blocks.cached(token_keys(first)) == 0 and blocks.cached(token_keys(shares)) == 0  # evicted
    assert blocks.orphans == 0 and blocks.skipped == 0


def test_a_prompt_that_shares_a_prefix_with_a_cached_one_matches_the_whole_blocks_shared():
    blocks = EngineBlocks()
    for e in decode_batch(replayed()[0][1]).events:
        blocks.apply(e)
    first, shares = CAPTURE.requests[0][1], CAPTURE.requests[1][1]
    common = next(i for i, (a, b) in enumerate(zip(first, shares)) if a != b)
    assert common == 128
    assert blocks.cached(token_keys(shares)) == 128
    # One token off in the first block: nothing.
    assert blocks.cached(token_keys([shares[0] + 1, *shares[1:]])) == 0
    # A partial block is never cached: 31 tokens of a 32-token block match nothing past it.
    assert blocks.cached(token_keys(first[:159])) == 128


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([16, 32, 64, 128]), st.integers(0, 40), st.integers(0, 3000), st.integers(0, 3000))
def test_the_match_is_the_whole_blocks_the_prompt_shares_with_what_is_cached(size, stored, shared, length):
    cached_ids = list(range(1, stored * size + 1))
    prompt = cached_ids[:shared] + [0] * max(0, length - shared)
    blocks = EngineBlocks()
    if stored:
        blocks.apply(Stored(tuple(range(stored)), None, tuple(cached_ids), size))
    same = next((i for i, (a, b) in enumerate(zip(prompt, cached_ids)) if a != b), min(len(prompt), len(cached_ids)))
    assert blocks.cached(token_keys(prompt)) == (same // size * size if stored else 0)


def test_blocks_the_index_cannot_key_by_tokens_are_left_out_and_counted():
    blocks = EngineBlocks()
    ids = tuple(range(64))
    blocks.apply(Stored((1, 2), None, ids, 32, lora_name="adapter"))
    blocks.apply(Stored((3, 4), None, ids, 32, extra=(False, True)))
    blocks.apply(Stored((5,), 999, ids[:32], 32))           # parent never seen
    blocks.apply(Stored((6,), None, (), 32))                  # no token ids
    blocks.apply(Stored((7,), None, ids[:32], 32, medium="CPU"))
    assert blocks.skipped == 2 + 1 + 1 and blocks.orphans == 2
    assert len(blocks) == 1   # block 3, before the one with extra keys
    assert blocks.cached(token_keys(ids)) == 32


def test_the_index_is_bounded_and_then_no_longer_complete():
    blocks = EngineBlocks(max_blocks=4)
    blocks.clear(complete=True)
    ids = tuple(range(GRAIN * 2 * 6))
    blocks.apply(Stored(tuple(range(6)), None, ids, GRAIN * 2))
    assert len(blocks) == 4 and blocks.forgotten == 2 and not blocks.complete
    assert len(blocks.keys) == 4


def test_a_block_stored_twice_counts_once_and_removal_of_an_unknown_hash_is_harmless():
    blocks = EngineBlocks()
    ids = tuple(range(32))
    blocks.apply(Stored((1,), None, ids, 32))
    blocks.apply(Stored((1,), None, ids, 32))
    blocks.apply(Removed((42,)))
    assert len(blocks) == 1 and blocks.cached(token_keys(ids)) == 32
    blocks.apply(Removed((1,)))
    assert len(blocks) == 0 and blocks.keys == {} and blocks.cached(token_keys(ids)) == 0


# --- the sequence logic (no sockets: no replay configured) --------------------------------

def subscriber() -> Subscriber:
    return Subscriber("n0", "tcp://127.0.0.1:1", None, "kv", NodeEvents(EngineBlocks()), None)  # type: ignore[arg-type]


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload]


def test_messages_from_the_engines_start_make_the_view_complete_and_a_gap_partial():
    sub = subscriber()
    sub._connected = True
    msgs = replayed()
    sub.handle(frames(*msgs[0]))
    assert sub.view.state is ViewState.LIVE and sub.view.blocks.complete
    sub.handle(frames(*msgs[0]))          # the same message again changes nothing
    assert sub.view.batches == 1 and sub.view.restarts == 0
    sub.handle(frames(*msgs[2]))          # 1 missed, and no replay socket to ask
    assert sub.view.gaps == 1 and sub.view.state is ViewState.PARTIAL
    sub.handle(frames(*msgs[3]))
    assert sub.view.state is ViewState.PARTIAL and sub.view.last_seq == 3
    sub.handle(frames(0, msgpack.packb([2.0, [["AllBlocksCleared"]], 0])))  # a restarted engine
    assert sub.view.restarts == 1 and sub.view.state is ViewState.LIVE and len(sub.view.blocks) == 0


def test_joining_a_running_engine_without_replay_is_partial_and_a_clear_makes_it_live():
    sub = subscriber()
    sub._connected = True
    msgs = replayed()
    sub.handle(frames(*msgs[1]))
    assert sub.view.state is ViewState.PARTIAL and sub.view.batches == 1
    sub.handle(frames(2, msgpack.packb([2.0, [{"type": "AllBlocksCleared"}]])))
    assert sub.view.state is ViewState.LIVE
    sub._on_monitor([(512).to_bytes(2, "little") + b"\0\0\0\0", b""])  # EVENT_DISCONNECTED
    assert sub.view.state is ViewState.DOWN and sub.view.cached((1, 2)) is None


# --- hostile messages ----------------------------------------------------------------------

GOOD = replayed()[0][1]


@pytest.mark.parametrize(("message", "reason"), [
    ([b"kv", b"\0" * 8], "frames"),
    ([b"kv", b"\0" * 8, GOOD, b"x"], "frames"),
    ([b"kv", b"\0" * 4, GOOD], "sequence"),
    ([b"kv", b"\xff" * 8, GOOD], "sequence"),
    ([b"kv", b"\0" * 8, b"\xc1"], "msgpack"),                       # never used in msgpack
    ([b"kv", b"\0" * 8, GOOD[:-3]], "msgpack"),                      # cut short
    ([b"kv", b"\0" * 8, b"\x91" * 100_000 + b"\x90"], "msgpack"),     # nested deeper than allowed
    ([b"kv", b"\0" * 8, msgpack.packb({"ts": 1})], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [["Nope"]]])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1],
                                               "block_size": 32}]])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"x" * 65],
                                               "token_ids": [], "block_size": 32}]])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
                                               "block_size": 0}]])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [], "rank"])], "shape"),
    ([b"kv", b"\0" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
                                               "block_size": 32, "extra_keys": [None, None]}]])], "shape"),
])
def test_a_hostile_message_is_counted_by_reason_and_dropped(message, reason):
    sub = subscriber()
    sub.handle(message)
    assert sub.view.dropped == {r: int(r == reason) for r in DROP_REASONS}
    assert sub.view.batches == 0 and sub.view.last_seq is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_no_payload_makes_the_decoder_raise_anything_but_a_frame_error(payload):
    try:
        decode_frames([b"", b"\0" * 8, payload])
    except FrameError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
                    | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
                    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(
                        st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "parent_block_hash",
                                         "medium", "extra_keys", "lora_id"]), kids, max_size=6),
                    max_leaves=30))
def test_no_well_formed_msgpack_of_any_shape_breaks_the_decoder_or_the_index(obj):
    try:
        payload = msgpack.packb([1.0, [obj], 0])
    except (OverflowError, ValueError):
        return
    try:
        batch = decode_batch(payload)
    except FrameError:
        return
    blocks = EngineBlocks()
    for e in batch.events:
        blocks.apply(e)
    assert len(blocks) == sum(blocks.keys.values())


# --- metrics -------------------------------------------------------------------------------

def test_each_nodes_view_and_counts_are_exported():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from extproc.metrics import Metrics

    sub = subscriber()
    sub._connected = True
    for seq, payload in replayed()[:2]:
        sub.handle(frames(seq, payload))
    sub.handle([b"kv"])

    class Source:
        def views(self):
            return [("default", "n0", sub.view)]

    metrics = Metrics(CollectorRegistry())
    metrics.attach_kv_events(Source())
    text = generate_latest(metrics.registry).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    node = (("backend", "n0"), ("pool", "default"))
    assert got[("kvgate_kv_events_view", (*node, ("state", "live")))] == 1.0
    assert got[("kvgate_kv_events_view", (*node, ("state", "down")))] == 0.0
    assert got[("kvgate_kv_events_cached_blocks", node)] == len(sub.view.blocks) == 8
    assert got[("kvgate_kv_events_batches_total", node)] == 2
    assert got[("kvgate_kv_events_dropped_total", (*node, ("reason", "frames")))] == 1
    assert got[("kvgate_kv_events_unindexed_blocks_total", (*node, ("why", "orphan")))] == 0
