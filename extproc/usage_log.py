"""usage_log: exact completion counts for requests released by Envoy's access log.

In deploy/envoy-access-log.yaml kvgate answers only the request body; the response never
reaches it. An Envoy Lua filter (``LUA_SOURCE``, placed by ``extproc.envoyconf``) reads the
response as it streams, without holding a chunk or asking kvgate anything, and writes what
it found into the request's dynamic metadata, namespace ``NAMESPACE``; Envoy's gRPC access
log entry carries that metadata to kvgate at the request's end, and ``from_entry`` turns it
into the count the lease is settled with.

The protocol between the two, one definition here:

- on the request, the filter writes ``FILTER_KEY`` = 1: kvgate sees it in the request body
  message's ``metadata_context`` (``announced``) and only then asks the upstream for stream
  usage the client did not ask for (``stream_options.include_usage``): without the filter
  nobody would hide that chunk from the client;
- kvgate's answer to the request body sets ``STRIP_KEY`` = true in its own namespace
  (``ask_to_strip``) when the usage chunk is its own and must be hidden;
- on the response the filter writes ``COMPLETION_KEY`` (the text of the
  ``completion_tokens``, or the Responses API's ``output_tokens``, of the last usage object
  it saw, at most ``MAX_VALUE_CHARS`` characters), ``EVENTS_KEY`` (SSE events whose own
  ``choices`` are not empty, about one token each: what a stream cut short is charged;
  written as ``EVENTS_STEP`` says) and ``DONE_KEY`` (``data: [DONE]`` passed
  to the client: the generation ended even if the client closed before the upstream did).

An SSE event may be split across chunks anywhere: the filter carries the unfinished tail
to the next chunk, and while it hides the usage chunk it holds that tail back, so that the
client only receives whole events. A line ends in CRLF, LF or CR alone (the SSE spec's
three). A body that ends without the blank line after its last event has that event read
at the end, and what was held of it passes with the last chunk. An event longer than
``MAX_EVENT_BYTES`` stops the parsing and everything passes on as it comes.

What the filter writes comes from the upstream, which may send anything: ``from_entry``
takes only a whole number in [0, 2^40), written as JSON writes it, as a count; anything else is ``invalid`` and counted
(``kvgate_logged_usage_total``), and the lease then falls back as it would without usage
(the events for a stream cut short, the reservation otherwise), never below 0 and never
above the admission core's cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from extproc import openai_usage

# Dynamic metadata namespace the Lua filter writes (never kvgate's own: a key kvgate does not
# know there is an error in a route's settings).
NAMESPACE = "kvgate.usage"
FILTER_KEY = "filter"
COMPLETION_KEY = "completion_tokens"
EVENTS_KEY = "events"
DONE_KEY = "done"
# kvgate's own namespace (gate.METADATA_NAMESPACE), where its answer to the request
# body writes the link and STRIP_KEY.
GATE_NAMESPACE = "kvgate"
STRIP_KEY = "strip_usage"
# The longest count text the filter copies (characters), how much of a JSON body's previous
# chunk it searches again with the next (bytes), what a count is: the tracker's own, read
# the same way when a JSON answer outgrows its buffer (openai_api).
MAX_VALUE_CHARS = openai_usage.COUNT_CHARS
JSON_OVERLAP_BYTES = openai_usage.JSON_OVERLAP_BYTES
_MAX_COUNT = openai_usage.MAX_COUNT
_DIGITS = openai_usage.COUNT_TEXT
# The longest SSE event the filter parses (bytes); past it the stream passes unparsed.
MAX_EVENT_BYTES = 1 << 20
# How often the filter writes its event count while a stream goes on: at every chunk until
# EVENTS_STEP events are counted, then each time the count passes a multiple of EVENTS_STEP,
# and at the end of the body. Each write is a metadata update on Envoy's worker thread
# (about as costly as reading the chunk); a stream cut short is charged the last count
# written, up to EVENTS_STEP - 1 events below what it got.
EVENTS_STEP = 8
# kvgate_logged_usage_total's result label.
RESULTS = ("reported", "invalid", "none")

LUA_SOURCE = f"""\
-- kvgate's usage filter (extproc/usage_log.py): reads the response as it streams, holds
-- nothing but an unfinished SSE event, and writes what it found into the dynamic metadata
-- that Envoy's access log brings to kvgate.
local NS = "{NAMESPACE}"
local MAX_EVENT = {MAX_EVENT_BYTES}
local STEP = {EVENTS_STEP}
local OVERLAP = {JSON_OVERLAP_BYTES}

function envoy_on_request(h)
  h:streamInfo():dynamicMetadata():set(NS, "{FILTER_KEY}", 1)
end

-- The metadata object is valid only until the script yields (between chunks): fetched anew.
local function put(h, key, value)
  h:streamInfo():dynamicMetadata():set(NS, key, value)
end

-- The usage object's count: the first after "usage" (the same key elsewhere is not it).
local function count_in(s)
  local from = string.find(s, '"usage"%s*:') or 1
  local found = string.match(s, '"completion_tokens"%s*:%s*([^,}}%s]*)', from)
  if found == nil then found = string.match(s, '"output_tokens"%s*:%s*([^,}}%s]*)', from) end
  if found ~= nil then return string.sub(found, 1, {MAX_VALUE_CHARS}) end
  return nil
end

local function follow_json(h)
  local tail = ""
  for chunk in h:bodyChunks() do
    local s = tail .. chunk:getBytes(0, chunk:length())
    local c = count_in(s)
    if c ~= nil then put(h, "{COMPLETION_KEY}", c) end
    tail = string.sub(s, -OVERLAP)
  end
end

-- The next blank line from pos: where the line end before it starts and where it ends. A
-- line ends in \\r\\n, \\n or \\r (the SSE spec's three); a \\r last in s may be the first
-- half of \\r\\n: nil until more comes.
local function blank_line(s, pos)
  while true do
    local a = string.find(s, "[\\r\\n]", pos)
    if a == nil then return nil end
    local e = a
    if string.byte(s, a) == 13 then
      if a == #s then return nil end
      if string.byte(s, a + 1) == 10 then e = a + 1 end
    end
    local c = string.byte(s, e + 1)
    if c == nil then return nil end
    if c == 10 then return a, e + 1 end
    if c == 13 then
      if e + 1 == #s then return nil end
      if string.byte(s, e + 2) == 10 then return a, e + 2 end
      return a, e + 1
    end
    pos = e + 1
  end
end

-- The first character of the event's own choices list ("]" when it is empty), nil when it
-- has none: '"choices"%s*:%s*%[%s*(.)' as a plain search for the key, then the rest matched
-- where the key ends (a pattern tried at every position costs several times more).
local function choices_first(ev)
  local init = 1
  while true do
    local k, e = string.find(ev, '"choices"', init, true)
    if k == nil then return nil end
    local c = string.match(ev, '^%s*:%s*%[%s*(.)', e + 1)
    if c ~= nil then return c end
    init = k + 1
  end
end

-- One whole event: writes the usage and [DONE] it carries. Returns whether it is an event
-- with choices, and whether it passes (false: the usage event hidden from the client).
local function read_event(h, ev, strip)
  if string.find(ev, "[DONE]", 1, true) and string.find("\\n" .. ev .. "\\n", "[\\r\\n]data: ?%[DONE%][\\r\\n]") then
    put(h, "{DONE_KEY}", 1)
    return false, true
  end
  local first = choices_first(ev)
  local keep = true
  if string.find(ev, '"usage"', 1, true) then
    local c = count_in(ev)
    if c ~= nil then put(h, "{COMPLETION_KEY}", c) end
    if strip and first == "]" then keep = false end
  end
  return first ~= nil and first ~= "]", keep
end

-- The next blank line from pos in a text without \\r: a plain search (blank_line's answer).
local function blank_lf(s, pos)
  local a = string.find(s, "\\n\\n", pos, true)
  if a == nil then return nil end
  return a, a + 1
end

local function follow_sse(h, strip)
  local tail, events, overflow, last, written = "", 0, false, nil, 0
  for chunk in h:bodyChunks() do
    last = chunk
    local got = chunk:getBytes(0, chunk:length())
    if not overflow then
      local s, held = got, #tail > 0
      if held then s = tail .. got end
      local find = blank_line
      if not string.find(s, "\\r", 1, true) then find = blank_lf end
      -- out: what passes of s before `from`, once an event has been hidden (else all of it).
      local out, from = nil, 1
      local pos, before = 1, events
      -- Where the next '"choices"', '"usage"' and '[DONE]' of s start (false: none left),
      -- each searched for again only once passed: one scan of s per key, however many events.
      local at_choices, at_usage, at_done = 0, 0, 0
      while true do
        local a, b = find(s, pos)
        if a == nil then break end
        if at_choices and at_choices < pos then at_choices = string.find(s, '"choices"', pos, true) or false end
        if at_usage and at_usage < pos then at_usage = string.find(s, '"usage"', pos, true) or false end
        if at_done and at_done < pos then at_done = string.find(s, "[DONE]", pos, true) or false end
        local counted, keep = false, true
        if (at_usage and at_usage < a) or (at_done and at_done < a) then
          counted, keep = read_event(h, string.sub(s, pos, a - 1), strip)
        elseif at_choices and at_choices + 8 < a then
          -- A token's event: read_event's answer without copying it out, unless the list's
          -- start is not right after the key (then read_event's search, on the event alone).
          local _, e, c = string.find(s, '^%s*:%s*%[%s*(.)', at_choices + 9)
          if e ~= nil and e < a then
            counted = c ~= "]"
          else
            counted = read_event(h, string.sub(s, pos, a - 1), strip)
          end
        elseif at_choices and at_choices < a then
          counted = read_event(h, string.sub(s, pos, a - 1), strip)
        end
        if counted then events = events + 1 end
        if strip and not keep then
          out = out or {{}}
          out[#out + 1] = string.sub(s, from, pos - 1)
          from = b + 1
        end
        pos = b + 1
      end
      tail = string.sub(s, pos)
      local upto = pos - 1
      if #tail > MAX_EVENT then
        overflow = true
        tail = ""
        upto = #s
      end
      -- What passes now: s up to its unfinished event, less what was hidden. Unchanged when
      -- nothing was held from the last chunk, nothing is held now and nothing was hidden.
      if strip and (out ~= nil or held or #tail > 0) then
        if out ~= nil then
          out[#out + 1] = string.sub(s, from, upto)
          chunk:setBytes(table.concat(out))
        else
          chunk:setBytes(string.sub(s, 1, upto))
        end
      end
      if events ~= before and (events < STEP or math.floor(events / STEP) ~= math.floor(written / STEP)) then
        put(h, "{EVENTS_KEY}", events)
        written = events
      end
    end
  end
  -- The body ended (the iterator returns at once after the last chunk, whose buffer is
  -- still this filter's) without the blank line after its last event: that event is read
  -- as a whole one, and what was held of it passes with the last chunk.
  if #tail > 0 and last ~= nil then
    local counted, keep = read_event(h, tail, strip)
    if counted then events = events + 1 end
    -- A body ended by trailers has passed its last chunk already: nothing to add it to.
    if strip and keep then pcall(function() last:setBytes(last:getBytes(0, last:length()) .. tail) end) end
  end
  if events ~= written then put(h, "{EVENTS_KEY}", events) end
end

function envoy_on_response(h)
  local gate = h:streamInfo():dynamicMetadata():get("{GATE_NAMESPACE}")
  if gate == nil or gate["link"] == nil then return end
  local ctype = h:headers():get("content-type") or ""
  if string.find(ctype, "text/event-stream", 1, true) then
    follow_sse(h, gate["{STRIP_KEY}"] == true)
  else
    follow_json(h)
  end
end
"""


@dataclass(frozen=True, slots=True)
class LoggedUsage:
    """LoggedUsage is what the usage filter saw of one response, as kvgate takes it.

    ``completion_tokens``: the count the upstream reported (None: none, or ``invalid``);
    ``events``: SSE events with choices delivered (None: not a count); ``done``: the
    stream's ``[DONE]`` passed; ``result``: one of RESULTS, for the metric (``invalid`` when
    either count was not a count).
    """

    completion_tokens: int | None
    events: int | None
    done: bool
    result: str

    def tracker(self, streamed: bool) -> openai_usage.ResponseTracker | None:
        """tracker is this usage in the shape an ending settles a lease from; None when
        it holds no count at all (the reservation is charged)."""
        if self.completion_tokens is None and self.events is None:
            return None
        t = openai_usage.ResponseTracker(streamed=streamed, strip_usage_chunk=False)
        t.completion_tokens = self.completion_tokens
        t.delivered_chunks = self.events or 0
        t.done_seen = self.done
        return t


def _count(value: Any) -> int | None:
    """_count reads one count the filter wrote: a whole number in [0, 2^40), or None."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        text = value.string_value.strip()
        if _DIGITS.fullmatch(text):
            n = int(text)
            return n if n < _MAX_COUNT else None
        return None
    if kind == "number_value":
        x = value.number_value
        if math.isfinite(x) and x.is_integer() and 0 <= x < _MAX_COUNT:
            return int(x)
    return None


def from_entry(entry: Any) -> LoggedUsage | None:
    """from_entry reads the usage filter's findings from an access log entry (an
    ``HTTPAccessLogEntry``); None when no usage filter ran on the request's path."""
    space = entry.common_properties.metadata.filter_metadata.get(NAMESPACE)
    if space is None or FILTER_KEY not in space.fields:
        return None
    fields = space.fields
    completion: int | None = None
    result = "none"
    if COMPLETION_KEY in fields:
        completion = _count(fields[COMPLETION_KEY])
        result = "reported" if completion is not None else "invalid"
    # No events key: the filter saw no event with choices (or no body at all).
    events = _count(fields[EVENTS_KEY]) if EVENTS_KEY in fields else 0
    if events is None:
        result = "invalid"
    return LoggedUsage(completion, events, DONE_KEY in fields, result)


def events_so_far(entry: Any) -> int | None:
    """events_so_far is the SSE events with choices the usage filter has counted so far, as a
    periodic access log entry of a stream in flight tells them (``from_entry``'s ``events``,
    without reading the rest): 0 when no filter ran or it has seen none yet, None when the
    count is not a count."""
    space = entry.common_properties.metadata.filter_metadata.get(NAMESPACE)
    if space is None:
        return 0
    fields = space.fields
    if FILTER_KEY not in fields or EVENTS_KEY not in fields:
        return 0
    return _count(fields[EVENTS_KEY])


def announced(metadata: Any) -> bool:
    """announced: the usage filter runs on this request's path (its mark is in the
    ``metadata_context`` of the request body message)."""
    if metadata is None:
        return False
    space = metadata.filter_metadata.get(NAMESPACE)
    return space is not None and FILTER_KEY in space.fields


def ask_to_strip(resp: Any) -> None:
    """ask_to_strip marks kvgate's answer to the request body (a ``ProcessingResponse``):
    the usage chunk of this stream is kvgate's to hide from the client."""
    resp.dynamic_metadata.fields[GATE_NAMESPACE].struct_value.fields[STRIP_KEY].bool_value = True
