"""End to end, differential: the Lua usage filter in Envoy against ``ResponseTracker``.

kvgate reads a response's usage two ways: ``openai_usage.ResponseTracker`` where it sees the
chunks itself, and the Lua filter of ``extproc/usage_log.py`` where only Envoy does
(deploy/envoy-access-log.yaml), its findings brought by the access log. Both must read the
same bytes the same way. Here the real filter runs in the real Envoy, in front of the real
kvgate, over a corpus of response streams (chat and completions, usage present or not,
asked for or not, split at every kind of boundary, hostile counts, garbage, a JSON answer,
a gzip body, streams cut by the upstream), and for each request three readings must agree:

- what the access log brings kvgate (``usage_log.from_entry`` of the very entry, read by a
  tap beside kvgate's logger), and what ``ResponseTracker`` reads from the same chunks:
  the completion count, the events with choices, ``[DONE]``;
- what the client received, and what the tracker would have let through: the stream with
  the usage event kvgate asked for removed, or untouched;
- what kvgate counted (``kvgate_logged_usage_total``), and the tap's results.

The answers come from an HTTP/2 upstream of the test's own (``kvgate_testkit.h2script``),
one DATA frame per chunk: Envoy hands the filter each frame on its own, so the filter gets
the split as written however loaded the machine (over HTTP/1 a slow read merges chunks; a
filter of the test's own counts the chunks to hold the corpus to that). The splits are
seeded: a failure names its case, and the case is the same on the next run.
"""

from __future__ import annotations

import copy
import gzip
import http.client
import random
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from extproc import openai_usage
from extproc import usage_log
from kvgate_testkit.h2script import Script, ScriptServer
from kvgate_testkit.logtap import LogTap
from kvgate_testkit.procs import LOOPBACK, ROOT, wait_until
from kvgate_testkit.stack import Stack

pytestmark = pytest.mark.e2e

SEED = 17
CASE_HEADER = "x-diff-case"
SCRIPT_HEADER = "x-diff-script"
SCRIPTED_CLUSTER = "scripted"
SSE = "text/event-stream"
CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 64, "tpm": 100_000_000, "context_window": 8192,
                          "default_max_tokens": 64, "tokenizer": "cl100k_base"}},
    "server": {"drain_s": 0, "grace_s": 1},
}


@dataclass(frozen=True)
class Case:
    """Case is one scripted answer and the request that gets it.

    ``chat``: /v1/chat/completions (else /v1/completions; ``responses``: /v1/responses, the
    Responses API, whose stream always reports usage); ``stream`` and ``asked`` (for
    ``stream_options.include_usage``): what the client's request says; ``chunks``: the
    upstream's body, as written; ``cut``: the upstream aborts its connection after them.
    """

    name: str
    chunks: tuple[bytes, ...]
    chat: bool = True
    responses: bool = False
    stream: bool = True
    asked: bool = False
    content_type: str = SSE
    cut: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    response_headers: tuple[tuple[str, str], ...] = ()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


# --- the events ----------------------------------------------------------------------

def token_event(i: int, chat: bool = True, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = ({"index": index, "delta": {"content": f"tok{i} "}, "logprobs": None,
                               "finish_reason": None} if chat else
                              {"index": index, "text": f"tok{i} ", "logprobs": None, "finish_reason": None})
    return {"id": "chatcmpl-d" if chat else "cmpl-d",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1, "model": "fake", "choices": [choice]}


def data(obj: Any, end: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + end


def usage_event(count: str, chat: bool = True, end: bytes = b"\n\n") -> bytes:
    """usage_event is vLLM's last event with usage (``"choices": []``), its
    completion_tokens written as ``count``."""
    head = (b'{"id":"chatcmpl-d","object":"chat.completion.chunk"' if chat else
            b'{"id":"cmpl-d","object":"text_completion"')
    return (b"data: " + head + b',"created":1,"model":"fake","choices":[],'
            b'"usage":{"prompt_tokens":9,"total_tokens":21,"completion_tokens":'
            + count.encode() + b"}}" + end)


DONE = b"data: [DONE]\n\n"


def stream_body(tokens: int, count: str | None, *, chat: bool = True, crlf: bool = False,
                done: bool = True) -> bytes:
    """stream_body is a vLLM-shaped stream of ``tokens`` events, its usage event reporting
    ``count`` (None: none), then ``[DONE]``; ``crlf``: every line ends in CRLF."""
    end = b"\r\n\r\n" if crlf else b"\n\n"
    out = b"".join(data(token_event(i, chat), end) for i in range(tokens))
    if count is not None:
        out += usage_event(count, chat, end)
    if done:
        out += b"data: [DONE]" + end
    return out


# --- the splits ----------------------------------------------------------------------

def split_at(body: bytes, cuts: list[int]) -> tuple[bytes, ...]:
    points = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
    return tuple(body[a:b] for a, b in zip(points, points[1:]))


def cuts_inside(body: bytes, needle: bytes, offset: int) -> list[int]:
    """cuts_inside: a cut ``offset`` bytes into every occurrence of ``needle``."""
    out, at = [], body.find(needle)
    while at >= 0:
        out.append(at + offset)
        at = body.find(needle, at + 1)
    return out


def splits(name: str, body: bytes, rng: random.Random) -> Iterator[tuple[str, tuple[bytes, ...]]]:
    """splits yields ``body`` cut in the ways a proxy may read it: whole, inside every
    ``data:``, inside the JSON (in ``completion_tokens``), inside every blank line (between
    its ``\\r`` and ``\\n``, between its two line ends), and at seeded random places."""
    yield f"{name}/whole", (body,)
    yield f"{name}/in-data", split_at(body, cuts_inside(body, b"data:", 2))
    yield f"{name}/in-json", split_at(body, cuts_inside(body, b"completion_tokens", 10)
                                      + cuts_inside(body, b'"choices"', 4))
    blank = b"\r\n\r\n" if b"\r\n\r\n" in body else b"\n\n"
    for offset in range(1, len(blank)):
        yield f"{name}/in-blank-line-{offset}", split_at(body, cuts_inside(body, blank, offset))
    for i in range(2):
        yield f"{name}/random-{i}", split_at(body, rng.sample(range(1, len(body)), min(6, len(body) - 1)))


def corpus() -> list[Case]:
    """corpus is every case of this module, the same on every run (seeded)."""
    rng = random.Random(SEED)
    cases: list[Case] = []

    def add(name: str, body: bytes, **kw: Any) -> None:
        for split_name, chunks in splits(name, body, rng):
            cases.append(Case(split_name, chunks, **kw))

    for chat in (True, False):
        kind = "chat" if chat else "completions"
        for asked in (False, True):
            who = "asked" if asked else "not-asked"
            add(f"{kind}/{who}/usage", stream_body(3, "3", chat=chat), chat=chat, asked=asked)
            add(f"{kind}/{who}/crlf", stream_body(3, "3", chat=chat, crlf=True), chat=chat, asked=asked)
        # An upstream that ignores stream_options: no usage event at all.
        add(f"{kind}/no-usage", stream_body(3, None, chat=chat), chat=chat)
    # Lines ended by CR alone (the SSE spec allows it; no server seen sends it).
    add("cr-only", stream_body(2, "2").replace(b"\n", b"\r"))
    # One byte per chunk.
    short = stream_body(1, "1")
    cases.append(Case("bytes/not-asked", split_at(short, list(range(1, len(short))))))
    cases.append(Case("bytes/asked", split_at(short, list(range(1, len(short)))), asked=True))
    crlf = stream_body(1, "1", crlf=True)
    cases.append(Case("bytes/crlf", split_at(crlf, list(range(1, len(crlf))))))

    # A stream that ends (no cut) without the blank line after its last event.
    add("no-final-blank-line", stream_body(2, "2").removesuffix(b"\n\n"))
    add("no-final-blank-line/usage-last", stream_body(2, "2", done=False).removesuffix(b"\n\n"))

    # Several choices (n=2): an event per choice, and one event with both.
    two = (data(token_event(0, index=0)) + data(token_event(0, index=1))
           + data({**token_event(1), "choices": [token_event(1)["choices"][0],
                                                 token_event(1, index=1)["choices"][0]]})
           + usage_event("4") + DONE)
    add("multi-choice", two)
    # Events with no choices that are no usage event (a content filter's first event), and
    # an event with choices and usage both (continuous usage stats).
    add("empty-choices", data({"id": "x", "choices": [], "prompt_filter_results": []})
        + data(token_event(0)) + data({**token_event(1), "usage": {"prompt_tokens": 9,
                                                                    "completion_tokens": 2,
                                                                    "total_tokens": 11}})
        + usage_event("2") + DONE)
    add("empty-choices/asked", data({"id": "x", "choices": []}) + data(token_event(0))
        + usage_event("1") + DONE, asked=True)
    # Token events whose choices are not written as vLLM writes them: spaced out, the key
    # first met where it is not the event's list, an event whose last key is "choices", and
    # "choices" only in the next event (each read as an event on its own).
    spaced = (b'data: {"id":"d","choices" :\t[ {"index":0,"delta":{"content":"a"}}]}\n\n'
              b'data: {"id":"d","x":{"choices":7},"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
              b'data: {"id":"d","x":"\\"choices\\"","choices":[]}\n\n'
              b'data: {"id":"d","n":1,"choices"}\n\n'
              b'data: {"id":"d"}\n\ndata: {"id":"d","choices":[{"index":0,"delta":{}}]}\n\n')
    add("choices-spelled-otherwise", spaced + usage_event("3") + DONE)

    # Hostile counts.
    for count in ("-5", "7.5", "1e30", "99999999999999999999", '"7"', '{"n":5}', "[5]", "true",
                  "null", "7.0", "0", "1099511627776", "1099511627775", "007", "1e2"):
        label = count.replace('"', "q").replace("{", "o").replace("}", "c").replace(":", "")
        for asked in (False, True):
            body = stream_body(2, count)
            cases.append(Case(f"hostile/{label}/{'asked' if asked else 'not-asked'}",
                              split_at(body, cuts_inside(body, b"completion_tokens", 10)), asked=asked))
        cases.append(Case(f"hostile-json/{label}", (json_answer(count),), stream=False,
                          content_type="application/json"))

    # A usage event whose usage holds no count at all, for a client that did not ask.
    for label, usage in (("null", b"null"), ("no-prompt", b'{"completion_tokens":-5}'), ("empty", b"{}")):
        body = (data(token_event(0)) + b'data: {"id":"chatcmpl-d","choices":[],"usage":' + usage
                + b"}\n\n" + DONE)
        cases.append(Case(f"usage-without-count/{label}", (body,)))

    # Counts and choices elsewhere than where the API puts them: only the usage object's
    # count and the event's own choices are read.
    head = b'data: {"id":"chatcmpl-d","object":"chat.completion.chunk","created":1,"model":"fake",'
    count3 = b'"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}'
    for label, event in (
            ("count-after-usage", head + b'"choices":[],' + count3 + b',"x":{"completion_tokens":99}}'),
            ("count-before-usage", head + b'"x":{"completion_tokens":99},"choices":[],' + count3 + b"}"),
            ("choices-nested", head + b'"choices":[],' + count3 + b',"x":{"choices":[{"a":1}]}}'),
            ("choices-not-objects", head + b'"choices":[1,2]}'),
            # OpenAI's usage, its details included.
            ("openai-details", head + b'"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,'
             b'"total_tokens":12,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":'
             b'{"reasoning_tokens":2,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}')):
        for asked in (False, True):
            body = data(token_event(0)) + event + b"\n\n" + DONE
            cases.append(Case(f"{label}/{'asked' if asked else 'not-asked'}", (body,), asked=asked))

    # The Responses API: usage in response.completed's response, as input/output_tokens.
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_d","usage":null}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"tok0 "}\n\n'
    for count in ("3", "-1"):
        completed = (b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_d",'
                     b'"status":"completed","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},'
                     b'"output_tokens":' + count.encode() + b',"output_tokens_details":{"reasoning_tokens":0},'
                     b'"total_tokens":12}}}\n\n')
        add(f"responses/{count}", created + delta * 2 + completed, responses=True)

    # Garbage: comments, fields other than data, data that is no JSON, no object, bad UTF-8.
    garbage = (b": keep-alive\n\n" + b"event: message\nid: 1\nretry: 5\n" + data(token_event(0))
               + b"data: not json\n\n" + b"data: [1, 2]\n\n" + b"data: \xff\xfe{\n\n"
               + b"\n\n\n" + b"data:" + orjson.dumps(token_event(1)) + b"\n\n"
               + usage_event("2") + DONE)
    add("garbage", garbage)
    add("garbage/asked", garbage, asked=True)

    # A JSON answer (no stream), whole and split inside its usage.
    for count in ("3", "2100"):
        body = json_answer(count)
        add(f"json/{count}", body, stream=False, content_type="application/json")

    # A usage event in two data lines (the SSE spec joins them with a line feed: still JSON).
    add("usage-in-two-data-lines", data(token_event(0)) + b'data: {"id":"chatcmpl-d","choices":[],\n'
        b'data: "usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}\n\n' + DONE)
    # A JSON answer above 1 MiB (a long completion, not streamed), its usage at the end.
    big = json_answer("5").replace(b"tok0 tok1", b"tok " * 300_000)
    cases.append(Case("json/above-1-mib", split_at(big, list(range(16_000, len(big), 16_000))),  # a DATA frame is at most 16 KiB
                      stream=False, content_type="application/json"))

    # gzip: the body reaches both parsers compressed; nothing can be read from it.
    packed = gzip.compress(stream_body(3, "3"), mtime=0)
    cases.append(Case("gzip", split_at(packed, [len(packed) // 2]),
                      headers=(("accept-encoding", "gzip"),), response_headers=(("content-encoding", "gzip"),)))

    # Cut by the upstream: after whole events, and inside the usage event.
    cut_body = stream_body(3, None, done=False)
    cases.append(Case("cut/after-events", split_at(cut_body, cuts_inside(cut_body, b"data:", 0)), cut=True))
    partial = stream_body(3, "3", done=False)
    cases.append(Case("cut/in-usage", (partial[:-30],), cut=True))
    cases.append(Case("cut/in-usage/asked", (partial[:-30],), cut=True, asked=True))
    # Longer than the filter's events step: a cut stream is charged the last count written
    # (one event a chunk, two a chunk: the step passed inside a chunk); a whole one, all.
    long_cut = stream_body(2 * usage_log.EVENTS_STEP + 4, None, done=False)
    per_event = cuts_inside(long_cut, b"data:", 0)
    cases.append(Case("cut/past-the-step", split_at(long_cut, per_event), cut=True))
    cases.append(Case("cut/past-the-step/two-a-chunk", split_at(long_cut, per_event[::2]), cut=True))
    whole = stream_body(2 * usage_log.EVENTS_STEP + 4, None)
    cases.append(Case("past-the-step", split_at(whole, cuts_inside(whole, b"data:", 0))))
    return cases


def json_answer(count: str) -> bytes:
    """json_answer is a chat completion (no stream) whose usage reports ``count``."""
    return (b'{"id":"chatcmpl-d","object":"chat.completion","created":1,"model":"fake",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"tok0 tok1"},'
            b'"logprobs":null,"finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":' + count.encode() + b"}}")


CORPUS = corpus()
assert len({c.name for c in CORPUS}) == len(CORPUS), "case names must be unique"


# --- running the corpus --------------------------------------------------------------

@dataclass
class Run:
    """Run is what one case's request gave: the client's bytes and the access log entry."""

    received: bytes
    entry: Any


def request_body(case: Case) -> bytes:
    body: dict[str, Any] = {"model": "fake", "max_tokens": 16, "stream": case.stream}
    if case.responses:
        return orjson.dumps({"model": "fake", "input": "Say hello", "stream": case.stream})
    if case.chat:
        body["messages"] = [{"role": "user", "content": "Say hello"}]
    else:
        body["prompt"] = "Say hello"
    if case.asked:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def send(stack: Stack, tap: LogTap, index: int) -> Run:
    """send asks for the answer scripted for ``CORPUS[index]`` through Envoy and returns
    what the client read (all of it, or what came before the upstream's cut) and the
    request's access log entry."""
    case = CORPUS[index]
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy_port, timeout=30)
    try:
        path = ("/v1/responses" if case.responses else
                "/v1/chat/completions" if case.chat else "/v1/completions")
        headers = {"content-type": "application/json", SCRIPT_HEADER: str(index),
                   CASE_HEADER: case.name, **dict(case.headers)}
        conn.request("POST", path, body=request_body(case), headers=headers)
        resp = conn.getresponse()
        try:
            received = resp.read()
        except http.client.IncompleteRead as exc:
            received = exc.partial
        assert resp.status == 200, (case.name, resp.status, received)
    finally:
        conn.close()
    return Run(received, tap.wait(case.name))


def script(case: Case) -> Script:
    return Script(case.chunks, (("content-type", case.content_type), *case.response_headers), cut=case.cut)


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptServer]:
    server = ScriptServer({str(i): script(case) for i, case in enumerate(CORPUS)}, SCRIPT_HEADER).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tap() -> Iterator[LogTap]:
    t = LogTap(CASE_HEADER).start()
    yield t
    t.stop()


# A filter of the test's own, next to the usage filter on the response's path (just after it
# in the list: a response meets it first), that counts the chunks with bytes the usage
# filter is handed; it reads, and changes nothing.
CHUNKS_NAMESPACE = "kvgate.test"
COUNT_CHUNKS = f"""
function envoy_on_response(h)
  local n = 0
  for chunk in h:bodyChunks() do
    if chunk:length() > 0 then
      n = n + 1
      h:streamInfo():dynamicMetadata():set("{CHUNKS_NAMESPACE}", "chunks", n)
    end
  end
end
"""


def scripted(tap: LogTap, upstream: ScriptServer) -> Callable[[dict[str, Any]], None]:
    """scripted is the stack's Envoy edit: the scripted requests routed to ``upstream``
    (the file's own route, on another cluster), the tap, and the chunk counter."""

    def edit(cfg: dict[str, Any]) -> None:
        tap.add_to(cfg)
        cfg["static_resources"]["clusters"].append(upstream.cluster(SCRIPTED_CLUSTER))
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        route = copy.deepcopy(routes[-1])  # the file's route to the inference servers
        route["match"] = {"prefix": "/", "headers": [{"name": SCRIPT_HEADER, "present_match": True}]}
        route["route"]["cluster"] = SCRIPTED_CLUSTER
        routes.insert(len(routes) - 1, route)
        filters = hcm["http_filters"]
        at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.lua")
        filters.insert(at + 1, {"name": "count_chunks", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": COUNT_CHUNKS}}})

    return edit


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tap: LogTap, upstream: ScriptServer) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("usage-diff"), CONFIG,
              envoy_template=ROOT / "deploy" / "envoy-access-log.yaml", envoy_edit=scripted(tap, upstream))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def logged_before(stack: Stack) -> dict[str, float]:
    return {r: stack.metric("kvgate_logged_usage_total", result=r) for r in usage_log.RESULTS}


@pytest.fixture(scope="module")
def runs(stack: Stack, tap: LogTap, logged_before: dict[str, float]) -> dict[str, Run]:
    """runs sends the whole corpus, eight requests at a time, once for the module."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda i: send(stack, tap, i), range(len(CORPUS))))
    return {case.name: run for case, run in zip(CORPUS, got)}


# --- the readings --------------------------------------------------------------------

@dataclass(frozen=True)
class Reading:
    """Reading is one parser's view of a response, in the terms kvgate settles with."""

    completion_tokens: int | None
    events: int
    done: bool


def strip_asked(entry: Any) -> bool:
    """strip_asked: kvgate's answer told the filter to hide the usage event."""
    space = entry.common_properties.metadata.filter_metadata.get(usage_log.GATE_NAMESPACE)
    return space is not None and space.fields.get(usage_log.STRIP_KEY) is not None and \
        space.fields[usage_log.STRIP_KEY].bool_value


def tracked(case: Case, strip: bool) -> tuple[Reading, bytes]:
    """tracked is what ResponseTracker reads from the case's chunks, fed as kvgate is fed
    them (an empty last message with the end of stream, none when the upstream cut the
    stream), and the bytes it lets through; the events as the filter writes them down."""
    tracker = openai_usage.ResponseTracker(streamed=case.content_type.startswith(SSE), strip_usage_chunk=strip)
    out = []
    written = 0
    for chunk in case.chunks:
        before = tracker.delivered_chunks
        replaced = tracker.feed(chunk, False)
        out.append(chunk if replaced is None else replaced)
        written = events_written(written, before, tracker.delivered_chunks)
    if not case.cut:
        replaced = tracker.feed(b"", True)
        out.append(b"" if replaced is None else replaced)
        written = tracker.delivered_chunks
    return Reading(tracker.completion_tokens, written, tracker.done_seen), b"".join(out)


def events_written(written: int, before: int, now: int) -> int:
    """events_written is the event count in the filter's metadata after a chunk took the count
    from ``before`` to ``now`` (usage_log.EVENTS_STEP): every chunk's below the step, then the
    first past each multiple of it; the body's end writes the count whole."""
    step = usage_log.EVENTS_STEP
    if now != before and (now < step or now // step != written // step):
        return now
    return written


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_the_filter_and_the_tracker_read_the_same(case: Case, runs: dict[str, Run]) -> None:
    run = runs[case.name]
    logged = usage_log.from_entry(run.entry)
    assert logged is not None, "the usage filter did not run"
    strip = strip_asked(run.entry)
    assert strip is (case.stream and not case.asked and not case.responses)
    expected, passed = tracked(case, strip)
    filtered = Reading(logged.completion_tokens, logged.events or 0, logged.done)
    assert filtered == expected
    assert run.received == passed


def test_kvgate_counted_what_the_access_log_brought(stack: Stack, runs: dict[str, Run],
                                                    logged_before: dict[str, float]) -> None:
    results = Counter(usage_log.from_entry(run.entry).result for run in runs.values())  # type: ignore[union-attr]

    def counted() -> dict[str, float]:
        return {r: stack.metric("kvgate_logged_usage_total", result=r) - logged_before[r]
                for r in usage_log.RESULTS}

    # kvgate's entries come on their own stream, at about the tap's time.
    wait_until(lambda: counted() == {r: results[r] for r in usage_log.RESULTS}, timeout=15,
               what=f"kvgate's logged usage counts {dict(results)}")
    stack.wait_inflight(0, timeout=15)


def chunks_seen(entry: Any) -> int:
    """chunks_seen is how many chunks with bytes the usage filter was handed."""
    space = entry.common_properties.metadata.filter_metadata.get(CHUNKS_NAMESPACE)
    return int(space.fields["chunks"].number_value) if space is not None and "chunks" in space.fields else 0


def test_every_split_reaches_the_filter_as_written(runs: dict[str, Run]) -> None:
    """The corpus tests the splits it means to: the filter was handed each case's chunks as
    they were written (HTTP/2 frames), none merged by a slow read."""
    seen = {c.name: (chunks_seen(runs[c.name].entry), len([x for x in c.chunks if x])) for c in CORPUS}
    assert {name: got for name, got in seen.items() if got[0] != got[1]} == {}
