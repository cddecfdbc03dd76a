"""logwire: Envoy's access log batches read entry by entry from their bytes.

Envoy's gRPC access log sends ``StreamAccessLogsMessage`` batches; with the
endpoint-picker-log file's periodic entries (every stream in flight, every 0.25 s) a batch
holds hundreds of entries, up to megabytes with thousands of streams. Parsed whole, a batch becomes
one upb arena several times its size, freed only when the last entry is done with: the C
heap's high-water mark rises with every such batch and stays resident below the objects still
alive (bench/results/memory-levers.md). kvgate registers the access log method with the raw
bytes instead (``server``), finds here where each HTTP entry lies in them, and parses one
``HTTPAccessLogEntry`` at a time, each in an arena of its own that is freed before the next.

The wire format read (envoy/service/accesslog/v3/als.proto): the batch's field 1 is the
identifier, fields 2 (``http_logs``) and 3 (``tcp_logs``) are the ``log_entries`` oneof;
``http_logs`` is a message whose field 1 (``log_entry``) repeats, each an
``HTTPAccessLogEntry`` (envoy/data/accesslog/v3/accesslog.proto). As protobuf reads it: the
``http_logs`` fields of one batch merge (their entries in order), a later ``tcp_logs`` field
clears them (the last member of a oneof wins), a field of the right number but the wrong wire
type is an unknown field, and unknown fields are skipped.

The bytes come from the network: ``http_entry_spans`` checks the whole batch's framing before
it names any entry (a truncated or overlong varint or length, a group never ended, wire
types 6 and 7, field number 0 are a ``DecodeError``), so a batch is either read or refused whole; an entry
whose own bytes do not parse is refused by ``FromString`` alone, and the others stand.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from google.protobuf.message import DecodeError

# Field numbers (als.proto): StreamAccessLogsMessage.http_logs and .tcp_logs, the oneof
# log_entries; HTTPAccessLogEntries.log_entry.
HTTP_LOGS = 2
TCP_LOGS = 3
LOG_ENTRY = 1
# Wire types.
_VARINT, _I64, _LEN, _START_GROUP, _END_GROUP, _I32 = 0, 1, 2, 3, 4, 5
# How deep groups may nest inside a skipped field (upb's limit of nesting).
GROUP_DEPTH = 100
# A varint is at most 10 bytes (64 bits, 7 a byte).
_MAX_VARINT_BYTES = 10
# The tag of a log_entry: field 1, length-delimited.
_ENTRY_TAG = LOG_ENTRY << 3 | _LEN


def _varint(data: bytes, at: int, end: int) -> tuple[int, int]:
    """_varint reads one varint of ``data`` at ``at``, within ``end``: its value and where the
    next field begins."""
    value = shift = 0
    stop = min(end, at + _MAX_VARINT_BYTES)
    while at < stop:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    raise DecodeError("truncated varint" if at >= end else "varint longer than 10 bytes")


def _skip(data: bytes, at: int, end: int, tag: int, depth: int = 0) -> int:
    """_skip passes over the value of a field that is not length-delimited (``tag`` read, its
    value at ``at``): where the next field begins. A group is passed over to its end tag, at
    most GROUP_DEPTH deep (upb's own limit)."""
    number, wire = tag >> 3, tag & 7
    if wire == _VARINT:
        return _varint(data, at, end)[1]
    if wire == _I64 or wire == _I32:
        at += 8 if wire == _I64 else 4
        if at > end:
            raise DecodeError(f"field {number}: truncated fixed-width value")
        return at
    if wire == _START_GROUP:
        if depth >= GROUP_DEPTH:
            raise DecodeError(f"groups nested over {GROUP_DEPTH} deep")
        while at < end:
            inner, at = _varint(data, at, end)
            if inner >> 3 == 0:
                raise DecodeError("field number 0")
            if inner & 7 == _END_GROUP:
                if inner >> 3 != number:
                    raise DecodeError(f"group {number} ended by the end tag of {inner >> 3}")
                return at
            if inner & 7 == _LEN:
                size, at = _varint(data, at, end)
                if size > end - at:
                    raise DecodeError(f"field {inner >> 3}: length {size} past the message's end")
                at += size
            else:
                at = _skip(data, at, end, inner, depth + 1)
        raise DecodeError(f"group {number} not ended")
    raise DecodeError(f"field {number}: wire type {wire} where no field can be")


def fields(data: bytes, at: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """fields walks the fields of the message in ``data[at:end]``: for each, its number, where
    it starts (its tag), and where its value starts and ends (bytes; the value of a
    length-delimited field without its length). Raises DecodeError when the framing is
    broken."""
    while at < end:
        start = at
        tag, at = _varint(data, at, end)
        number = tag >> 3
        if number == 0:
            raise DecodeError("field number 0")
        if tag & 7 == _LEN:
            size, at = _varint(data, at, end)
            if size > end - at:
                raise DecodeError(f"field {number}: length {size} past the message's end")
            yield number, start, at, at + size
            at += size
        else:
            value, at = at, _skip(data, at, end, tag)
            yield number, start, value, at


def _len_fields(data: bytes, at: int, end: int) -> Iterator[tuple[int, int, int]]:
    """_len_fields is ``fields`` of the length-delimited fields only: number, value's start
    and end."""
    for number, start, a, b in fields(data, at, end):
        if data[start] & 7 == _LEN:
            yield number, a, b


def http_entry_spans(data: bytes) -> array[int]:
    """http_entry_spans is where each HTTP entry of a serialized ``StreamAccessLogsMessage``
    lies in ``data``: an array of offsets, the start and end of each entry in turn (bytes), in
    the order protobuf would list the entries (module doc); empty for a batch of TCP entries
    or of none. Raises DecodeError, naming no entry, when the framing of the batch or of its
    ``http_logs`` is broken."""
    groups: list[tuple[int, int]] = []
    for number, start, stop in _len_fields(data, 0, len(data)):
        if number == HTTP_LOGS:
            groups.append((start, stop))
        elif number == TCP_LOGS:
            groups.clear()  # the oneof's last member wins
    spans = array("q")
    for start, stop in groups:
        _entries(data, start, stop, spans)
    return spans


def _entries(data: bytes, at: int, end: int, spans: array[int]) -> None:
    """_entries appends to ``spans`` the start and end of each ``log_entry`` of the
    ``HTTPAccessLogEntries`` in ``data[at:end]``; ``_len_fields`` with a fast path for the
    one-byte tag and two-byte length of a usual entry (this loop runs once an entry)."""
    while at < end:
        if data[at] == _ENTRY_TAG and at + 2 < end:
            size = data[at + 1]
            if not size & 0x80:
                at += 2
            elif not data[at + 2] & 0x80:
                size = (size & 0x7F) | data[at + 2] << 7
                at += 3
            else:
                size, at = _varint(data, at + 1, end)
            if size > end - at:
                raise DecodeError(f"field {LOG_ENTRY}: length {size} past the message's end")
            spans.append(at)
            at += size
            spans.append(at)
            continue
        for number, a, b in _len_fields(data, at, end):
            if number == LOG_ENTRY:
                spans.append(a)
                spans.append(b)
            at = b
            break
        else:
            return
