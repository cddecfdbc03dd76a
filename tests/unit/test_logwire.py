"""Unit tests of logwire, the reading of Envoy's access log batches entry by entry from their
bytes, and of the receiver that applies them: the entries found are the ones protobuf
itself parses from the same bytes (real serialized messages, then Hypothesis's mutations of
them), and a broken batch or entry is refused, counted and logged, with the stream going on
and nothing kept."""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import logwire
from extproc.request.accesslog import AccessLogReceiver
from extproc.service import ExtProcService
from tests.unit.test_access_log import entry, park
from tests.unit.test_exchange import Rig

Entry = accesslog_pb2.HTTPAccessLogEntry
Batch = als_pb2.StreamAccessLogsMessage


def batch(*entries: Entry, name: str = "kvgate") -> Batch:
    msg = Batch()
    msg.identifier.log_name = name
    msg.identifier.node.id = "envoy-0"
    msg.http_logs.log_entry.extend(entries)
    return msg


def rich(i: int) -> Entry:
    """rich is an entry with most of what Envoy writes: addresses, times, flags, metadata."""
    e = entry(f"k-{i}", 200 + i % 3, upstream_done=i % 2 == 0, upstream_remote_reset=i % 5 == 0)
    c = e.common_properties
    c.upstream_remote_address.socket_address.address = "127.0.0.1"
    c.upstream_remote_address.socket_address.port_value = 7000 + i
    c.start_time.seconds = 1_700_000_000 + i
    c.upstream_cluster = "nodes"
    c.access_log_type = accesslog_pb2.AccessLogType.DownstreamPeriodic
    c.downstream_wire_bytes_sent = 10**12 + i  # a varint of 6 bytes
    c.sample_rate = 0.5                          # a fixed 64-bit
    c.metadata.filter_metadata["kvgate.usage"].update({"events": i, "filter": 1})
    e.request.path = "/v1/chat/completions?" + "x" * (i * 37 % 400)  # sizes over 127 bytes
    e.request.request_headers["x-tenant"] = "t" * (i % 200)
    return e


def parsed(data: bytes) -> list[Entry]:
    """parsed is what the receiver parses of ``data``: each entry logwire finds, alone."""
    spans = logwire.http_entry_spans(data)
    view = memoryview(data)
    return [Entry.FromString(view[spans[i]:spans[i + 1]]) for i in range(0, len(spans), 2)]


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_field(number: int, value: bytes) -> bytes:
    return tag(number, 2) + varint(len(value)) + value


# --- the entries found are protobuf's own ------------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 2, 300])
def test_the_entries_of_a_real_batch_are_found_in_order(count: int) -> None:
    msg = batch(*(rich(i) for i in range(count)))
    data = msg.SerializeToString()
    assert parsed(data) == list(Batch.FromString(data).http_logs.log_entry)
    assert len(parsed(data)) == count


def test_an_empty_message_and_a_tcp_batch_have_no_http_entries() -> None:
    assert len(logwire.http_entry_spans(b"")) == 0
    tcp = Batch()
    tcp.tcp_logs.log_entry.add().common_properties.upstream_cluster = "c"
    assert len(logwire.http_entry_spans(tcp.SerializeToString())) == 0


def test_http_logs_fields_merge_and_a_later_tcp_logs_clears_them_as_protobuf_reads_them() -> None:
    one = batch(rich(1)).SerializeToString()
    two = batch(rich(2), rich(3)).SerializeToString()
    tcp = Batch()
    tcp.tcp_logs.log_entry.add()
    tcp_bytes = tcp.SerializeToString()
    for data in (one + two, one + tcp_bytes + two, two + tcp_bytes, tcp_bytes + one):
        assert parsed(data) == list(Batch.FromString(data).http_logs.log_entry)
    assert [e.common_properties.metadata.filter_metadata["kvgate"].fields["link"].string_value
            for e in parsed(one + tcp_bytes + two)] == ["k-2", "k-3"]
    assert parsed(two + tcp_bytes) == []


def test_unknown_fields_of_every_wire_type_are_passed_over_at_both_levels() -> None:
    e = rich(7).SerializeToString()
    unknown = (tag(9, 0) + varint(2**63) + tag(10, 1) + b"\x00" * 8 + tag(11, 5) + b"\x00" * 4
               + length_field(12, b"\xff\xfe") + tag(13, 3) + tag(1, 0) + b"\x01" + tag(14, 3)
               + tag(14, 4) + tag(13, 4)
               + tag(1, 0) + b"\x05")  # the right number with the wrong wire type: unknown
    inner = unknown + length_field(1, e) + unknown + length_field(1, e)
    data = unknown + tag(2, 0) + b"\x07" + length_field(2, inner) + unknown
    assert parsed(data) == list(Batch.FromString(data).http_logs.log_entry)
    assert len(parsed(data)) == 2


@pytest.mark.parametrize(("data", "why"), [
    (b"\x12\x05\x0a\x03", "past the message's end"),          # http_logs longer than the batch
    (b"\x12\x02\x0a\x05", "past the message's end"),          # an entry longer than http_logs
    # The same, with the batch's bytes after it: one-, two- and three-byte entry lengths.
    (length_field(2, b"\x0a\x05\x00\x00") + length_field(15, b"x" * 8), "past the message's end"),
    (length_field(2, b"\x0a\x80\x01\x00") + length_field(15, b"x" * 200), "past the message's end"),
    (length_field(2, b"\x0a\x80\x80\x01") + length_field(15, b"x" * 20000), "past the message's end"),
    (b"\x12\x01\x0a", "truncated varint"),                     # an entry's length cut off
    (b"\x12\x82", "truncated varint"),                         # a length cut off
    (b"\x12" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    (b"\x08", "truncated varint"),                             # a varint field's value cut off
    (b"\x09\x00\x00", "truncated fixed-width"),
    (b"\x0d\x00", "truncated fixed-width"),
    (b"\x1b\x08\x01", "not ended"),                            # a group never ended
    (b"\x1b\x24", "ended by the end tag of 4"),
    (b"\x1c", "wire type 4"),                                  # an end tag with no group
    (b"\x0e", "wire type 6"),
    (b"\x0f", "wire type 7"),
    (b"\x02\x00", "field number 0"),
    (b"\x12\x02\x00\x00", "field number 0"),
    (b"\x1b" * 101 + b"\x1c" * 101, "nested over 100"),
])
def test_broken_framing_is_a_decode_error_naming_what_is_wrong(data: bytes, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        logwire.http_entry_spans(data)
    with pytest.raises(DecodeError):  # protobuf refuses it too
        Batch.FromString(data)


def mutations() -> st.SearchStrategy[bytes]:
    """mutations are real batches cut, with bytes changed, inserted or removed anywhere."""
    @st.composite
    def mutated(draw: Any) -> bytes:
        entries = [rich(i) for i in draw(st.lists(st.integers(0, 400), max_size=4))]
        data = bytearray(batch(*entries).SerializeToString())
        for _ in range(draw(st.integers(0, 4))):
            at = draw(st.integers(0, len(data)))
            op = draw(st.sampled_from(["set", "insert", "delete", "cut"]))
            if op == "set" and at < len(data):
                data[at] = draw(st.integers(0, 255))
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=4))
            elif op == "delete":
                del data[at:at + draw(st.integers(1, 4))]
            elif op == "cut":
                del data[at:]
        return bytes(data)
    return mutated()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_whatever_protobuf_parses_logwire_finds_alike_and_it_refuses_only_with_decode_error(data: bytes) -> None:
    try:
        spans = logwire.http_entry_spans(data)
    except DecodeError:
        spans = None
    else:
        assert all(0 <= spans[i] <= spans[i + 1] <= len(data) for i in range(0, len(spans), 2))
        assert list(spans) == sorted(spans)
    try:
        whole = list(Batch.FromString(data).http_logs.log_entry)
    except DecodeError:
        return
    assert spans is not None, "protobuf parses a batch that logwire refuses"
    assert parsed(data) == whole


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_decode_error(data: bytes) -> None:
    try:
        parsed(data)
    except DecodeError:
        pass


# --- the receiver ------------------------------------------------------------------------

def roomy() -> Rig:
    """roomy is a rig whose default pool holds ten requests."""
    return Rig({"pools": {"default": {"max_concurrency": 10, "tpm": 1_000_000, "context_window": 4096,
                                      "default_max_tokens": 256, "tokenizer": "cl100k_base"}}})


def receive(rig: Rig, service: ExtProcService, *messages: bytes) -> None:
    """receive hands ``messages`` (raw batches) to kvgate's access log service on one stream."""
    async def stream() -> Any:
        for m in messages:
            yield m

    asyncio.run(AccessLogReceiver(service.endings, rig.metrics).StreamAccessLogs(stream(), None))


def test_a_batch_with_broken_framing_is_refused_whole_and_the_stream_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    first, second = park(rig, service), park(rig, service)
    good = batch(entry(first.ending.link)).SerializeToString()
    broken = batch(entry(second.ending.link)).SerializeToString()[:-3]  # cut inside the entry
    with caplog.at_level(logging.ERROR, logger="kvgate.server"):
        receive(rig, service, broken, good)
    assert rig.count("kvgate_access_log_entries_total", result="malformed") == 1
    assert rig.count("kvgate_access_log_entries_total", result="released") == 1
    # Nothing of the broken batch applied: its request stays parked for the TTL.
    assert list(service.endings.parked) == [second.ending.link] and rig.inflight() == 1
    assert any("framing is broken" in r.getMessage() for r in caplog.records)


def test_an_entry_that_does_not_parse_is_refused_alone(caplog: pytest.LogCaptureFixture) -> None:
    rig = roomy()
    service = ExtProcService(rig.gate, rig.metrics)
    a, b, c = park(rig, service), park(rig, service), park(rig, service)
    data = batch(entry(a.ending.link), entry(b.ending.link), entry(c.ending.link)).SerializeToString()
    # b's link is a string field: bytes that are not UTF-8 make its entry undecodable.
    assert b.ending.link is not None and data.count(b.ending.link.encode()) == 1
    data = data.replace(b.ending.link.encode(), b"\xff" * len(b.ending.link))
    with pytest.raises(DecodeError):
        Batch.FromString(data)  # parsed whole, the batch would be lost with every entry
    with caplog.at_level(logging.ERROR, logger="kvgate.server"):
        receive(rig, service, data)
    assert rig.count("kvgate_access_log_entries_total", result="released") == 2
    assert rig.count("kvgate_access_log_entries_total", result="malformed") == 1
    assert list(service.endings.parked) == [b.ending.link]
    assert any("1 access log entries of 3" in r.getMessage() for r in caplog.records)


def test_broken_batches_keep_nothing() -> None:
    rig = Rig()
    service = ExtProcService(rig.gate, rig.metrics)
    ex = park(rig, service)
    data = batch(*(entry(ex.ending.link) for _ in range(50))).SerializeToString()
    broken = [data[:-1], data.replace(ex.ending.link.encode(), b"\xff" * len(ex.ending.link))]
    logging.getLogger("kvgate.server").disabled = True  # the log lines are not the figure
    try:
        receive(rig, service, *broken)  # warm-up: metric children, caches
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            receive(rig, service, *(broken * 100))
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    finally:
        logging.getLogger("kvgate.server").disabled = False
    assert rig.count("kvgate_access_log_entries_total", result="malformed") == 101 * 51
    assert list(service.endings.parked) == [ex.ending.link]
    assert grown < 16 * 1024, f"{grown} B kept after 200 broken batches"


def test_fields_cut_a_message_into_its_fields_end_to_end():
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

    from extproc.service import _without_field
    req = ext_pb.ProcessingRequest()
    req.request_body.body = b"x" * 300
    req.request_body.end_of_stream = True
    req.metadata_context.filter_metadata["kvgate"].update({"pool": "default"})
    req.observability_mode = True
    data = req.SerializeToString()
    spans = list(logwire.fields(data, 0, len(data)))
    assert [start for _, start, _, _ in spans] == [0] + [stop for _, _, _, stop in spans[:-1]]
    assert spans[-1][3] == len(data)
    assert sorted(n for n, *_ in spans) == sorted(f.number for f, _ in req.ListFields())
    body_field = ext_pb.ProcessingRequest.DESCRIPTOR.fields_by_name["request_body"].number
    cut = ext_pb.ProcessingRequest.FromString(_without_field(data, body_field))
    assert not cut.HasField("request_body") and cut.observability_mode
    with pytest.raises(DecodeError):
        _without_field(data[:-1], body_field)
