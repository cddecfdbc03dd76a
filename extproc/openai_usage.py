"""openai_usage: the completion tokens an OpenAI response reports, read as it streams by.

``ResponseTracker`` reads usage from the final JSON or the SSE usage chunk and hides that
chunk when kvgate asked for it; the count's reading (``COUNT_TEXT``, ``COUNT_CHARS``,
``JSON_OVERLAP_BYTES``, ``MAX_COUNT``) is shared with the usage filter (``usage_log``).

Nothing here knows about gRPC or Envoy; bodies are bytes in, bytes out.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_LINE_END = re.compile(rb"\r\n|\r|\n")


_MAX_USAGE = 1 << 40


_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


# A JSON answer over the buffer is searched for its count as the usage filter does
# (extproc/usage_log.py): the first completion_tokens (else output_tokens) after the first
# "usage" key of each chunk and the tail of the one before; the last found counts.
_USAGE_KEY = re.compile(rb'"usage"\s*:')


_COMPLETION_TEXT = re.compile(rb'"completion_tokens"\s*:\s*([^,}\s]*)')


_OUTPUT_TEXT = re.compile(rb'"output_tokens"\s*:\s*([^,}\s]*)')


# The usage filter's reading, shared with it (usage_log): a count is a JSON whole number (no
# leading zero: "007" is no JSON); at most COUNT_CHARS of its text are kept (2^40 has 13
# digits); JSON_OVERLAP_BYTES of a chunk are searched again with the next, so that a usage
# object split across two chunks is found whole.
COUNT_TEXT = re.compile(r"0|[1-9][0-9]{0,12}")


COUNT_CHARS = 24


JSON_OVERLAP_BYTES = 256


MAX_COUNT = _MAX_USAGE


def _usage_int(x: Any) -> int | None:
    return x if type(x) is int and 0 <= x < _MAX_USAGE else None


class ResponseTracker:
    """ResponseTracker follows one response body: usage, delivered chunks, the usage chunk.

    Non-streamed: the body is buffered up to ``max_buffer`` bytes and usage read from the
    final JSON; over the cap (a long answer with logprobs passes 1 MiB at a few thousand
    tokens) the completion count is searched for in the chunks as they pass, as the usage
    filter of ``usage_log`` does, and the prompt count stays unknown. Streamed (SSE): events are parsed as
    they pass, partial lines kept across chunks (split anywhere: mid-line, mid-UTF-8,
    between ``\\r`` and ``\\n``); ``delivered_chunks`` counts events with choices (about
    one token each). With ``strip_usage_chunk`` the usage event (``"choices": []`` and a
    ``usage``, whatever it holds) is removed; partial events are then held back until complete so the client only gets
    whole events. Garbage never raises; an event over ``max_buffer`` stops the parsing
    and everything held passes on.

    ``completion_tokens`` / ``prompt_tokens`` are the reported usage, None until reported.
    """

    __slots__ = ("streamed", "strip_usage_chunk", "max_buffer", "completion_tokens", "prompt_tokens",
                 "delivered_chunks", "done_seen", "overflowed", "_buf", "_scan", "_line_start", "_data",
                 "_json_tail", "_json_count")

    def __init__(self, streamed: bool, strip_usage_chunk: bool, max_buffer: int = 1 << 20) -> None:
        self.streamed = streamed
        self.strip_usage_chunk = strip_usage_chunk and streamed
        self.max_buffer = max_buffer
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.delivered_chunks = 0
        self.done_seen = False
        self.overflowed = False
        self._buf = bytearray()
        self._scan = 0
        self._line_start = 0
        self._data: list[bytearray] = []  # the data lines of the event being read
        self._json_tail: bytes | None = None  # over the cap: the last bytes searched
        self._json_count: bytes | None = None  # over the cap: the last count text found

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """feed takes the next body chunk; returns its replacement, or None to pass it as is."""
        if self.overflowed:
            return None
        if not self.streamed:
            if end_of_stream and not self._buf and self._json_tail is None and len(chunk) <= self.max_buffer:
                # The whole answer in one chunk (Envoy's usual for a short answer): read as it
                # came, without copying it into the buffer first, and one call sooner.
                self._take_json(chunk)
            else:
                self._feed_json(chunk, end_of_stream)
            return None
        self._buf += chunk
        out = self._parse(end_of_stream)
        if out is None or out == chunk:
            return None
        return out

    # non-streamed

    def _feed_json(self, chunk: bytes, end_of_stream: bool) -> None:
        if self._json_tail is None and len(self._buf) + len(chunk) > self.max_buffer:
            self._json_tail = bytes(self._buf)
            self._buf = bytearray()
        if self._json_tail is not None:
            self._search_count(chunk, end_of_stream)
            return
        self._buf += chunk
        if not end_of_stream:
            return
        body, self._buf = self._buf, bytearray()
        self._take_json(body)

    def _take_json(self, body: bytes | bytearray) -> None:
        """_take_json reads the usage of a whole JSON answer (garbage: none)."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if type(obj) is dict:
            self._take_usage(obj.get("usage"))

    def _search_count(self, chunk: bytes, end_of_stream: bool) -> None:
        """_search_count follows a JSON answer over the buffer: see ``_USAGE_KEY``."""
        text = (self._json_tail or b"") + chunk
        usage = _USAGE_KEY.search(text)
        at = usage.start() if usage is not None else 0
        found = _COMPLETION_TEXT.search(text, at) or _OUTPUT_TEXT.search(text, at)
        if found is not None:
            self._json_count = found.group(1)[:COUNT_CHARS]
        self._json_tail = text[-JSON_OVERLAP_BYTES:]
        if end_of_stream:
            count = (self._json_count or b"").decode("latin-1").strip()
            if COUNT_TEXT.fullmatch(count) and int(count) < MAX_COUNT:
                self.completion_tokens = int(count)
            self._json_tail = b""

    def _take_usage(self, usage: Any) -> bool:
        if not isinstance(usage, dict):
            return False
        # _usage_int written out for the usual names: two calls less on every answer read.
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not (type(prompt) is int and 0 <= prompt < _MAX_USAGE):
            prompt = None
        if not (type(completion) is int and 0 <= completion < _MAX_USAGE):
            completion = None
        if prompt is None and completion is None:  # the Responses API's names
            prompt = _usage_int(usage.get("input_tokens"))
            completion = _usage_int(usage.get("output_tokens"))
        if completion is None and prompt is not None and not ("completion_tokens" in usage
                                                              or "output_tokens" in usage):
            # Embeddings report no completion. A completion count that is there but is not
            # a count is refused, not rebuilt from the same answer's total.
            total = _usage_int(usage.get("total_tokens"))
            if total is not None and total >= prompt:
                completion = total - prompt
        if prompt is not None:
            self.prompt_tokens = prompt
        if completion is not None:
            self.completion_tokens = completion
        return prompt is not None or completion is not None

    # streamed

    def _parse(self, end_of_stream: bool) -> bytes | None:
        """_parse consumes whole events from the buffer.

        Returns the bytes the client gets when stripping (None otherwise); an unfinished
        event stays in the buffer.
        """
        buf = self._buf
        strip = self.strip_usage_chunk
        out = bytearray() if strip else None
        scan, line_start = self._scan, self._line_start
        event_start = 0
        search = _LINE_END.search
        while True:
            m = search(buf, scan)
            if m is None:
                scan = len(buf)
                break
            start, end = m.span()
            if end == len(buf) and end - start == 1 and buf[start] == 0x0D and not end_of_stream:
                scan = start  # a lone \r at the end may be the first half of \r\n
                break
            if start > line_start:
                self._field(buf[line_start:start])
                scan = line_start = end
                continue
            # A blank line ends the event.
            if self._event_done() and out is not None:
                out += buf[event_start:end]
            event_start = scan = line_start = end
        if end_of_stream:
            if event_start < len(buf):  # the stream ended without the final blank line
                if line_start < len(buf):
                    self._field(buf[line_start:])
                if self._event_done() and out is not None:
                    out += buf[event_start:]
            buf.clear()
            self._data.clear()
            scan = line_start = 0
        else:
            if event_start:
                del buf[:event_start]
                scan -= event_start
                line_start -= event_start
            if len(buf) > self.max_buffer:  # no event is this long: stop parsing, let it all pass
                self.overflowed = True
                if out is not None:
                    out += buf
                buf.clear()
                self._data.clear()
                scan = line_start = 0
        self._scan, self._line_start = scan, line_start
        return None if out is None else bytes(out)

    def _field(self, line: bytearray) -> None:
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)

    def _event_done(self) -> bool:
        """_event_done reads the finished event's data; returns False to drop the event."""
        data = self._data
        if not data:
            return True
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        data.clear()
        if payload == b"[DONE]":
            self.done_seen = True
            return True
        if not payload.startswith(b"{"):
            return True
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            # No JSON (a count such as 007), yet the usage event asked for if it reads as one.
            return not (self.strip_usage_chunk and b'"usage"' in payload
                        and _NO_CHOICES.search(payload) is not None)
        if not isinstance(obj, dict):
            return True
        has_usage = self._take_usage(obj.get("usage"))
        response = obj.get("response")
        if not has_usage and isinstance(response, dict):  # Responses: response.completed
            self._take_usage(response.get("usage"))
        choices = obj.get("choices")
        if isinstance(choices, list):
            if choices:
                self.delivered_chunks += 1
            elif "usage" in obj and self.strip_usage_chunk:
                # The event answers kvgate's stream_options, whatever its usage holds: the
                # client did not ask for it.
                return False
        return True
