"""ResponseTracker: usage from SSE streams and final JSON, the usage chunk hidden, any split."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.openai_usage import ResponseTracker

HEAD = {"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1730000000,
        "model": "meta-llama/Meta-Llama-3-8B-Instruct"}
PIECES = ["Hé", "llo", ", ", "日本", "語", " 🤖", "!", " ünï", "cödé"]
USAGE = {"prompt_tokens": 17, "total_tokens": 29, "completion_tokens": 12}


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_events() -> list[bytes]:
    """chat_events is a vLLM chat stream with include_usage, one event per list item."""
    events = [event({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})]
    for piece in PIECES:
        events.append(event({**HEAD, "choices": [{"index": 0, "delta": {"content": piece},
                                                  "logprobs": None, "finish_reason": None}]}))
    events.append(event({**HEAD, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                              "finish_reason": "stop", "stop_reason": None}]}))
    events.append(event({**HEAD, "choices": [], "usage": USAGE}))
    events.append(b"data: [DONE]\n\n")
    return events


EVENTS = chat_events()
USAGE_INDEX = len(EVENTS) - 2
CONTENT_EVENTS = len(EVENTS) - 2  # every event with choices


def with_line_ends(events: list[bytes], eol: bytes) -> list[bytes]:
    return [e.replace(b"\n", eol) for e in events]


def feed_split(tracker: ResponseTracker, stream: bytes, cuts: list[int]) -> bytes:
    """feed_split feeds ``stream`` cut at ``cuts`` plus Envoy's empty final message;
    returns what the client receives."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(stream))), len(stream)]
    received = bytearray()
    for a, b in zip(bounds, bounds[1:]):
        chunk = stream[a:b]
        out = tracker.feed(chunk, False)
        received += chunk if out is None else out
    out = tracker.feed(b"", True)
    received += b"" if out is None else out
    return bytes(received)


@settings(max_examples=400, deadline=None)
@given(cuts=st.lists(st.integers(0, 4000), max_size=40), eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
       strip=st.booleans())
def test_any_split_gives_usage_and_the_exact_client_stream(cuts: list[int], eol: bytes, strip: bool) -> None:
    events = with_line_ends(EVENTS, eol)
    stream = b"".join(events)
    cuts = [c % (len(stream) + 1) for c in cuts]
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=strip)
    received = feed_split(tracker, stream, cuts)
    if strip:
        assert received == b"".join(e for i, e in enumerate(events) if i != USAGE_INDEX)
    else:
        assert received == stream
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (17, 12)
    assert tracker.delivered_chunks == CONTENT_EVENTS
    assert tracker.done_seen


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_single_cut_position(eol: bytes) -> None:
    # Exhaustive over one cut, so the rare spots (between \r and \n of the usage event,
    # inside a UTF-8 sequence) are all hit, not left to chance.
    events = with_line_ends(EVENTS, eol)
    stream = b"".join(events)
    expected = b"".join(e for i, e in enumerate(events) if i != USAGE_INDEX)
    for cut in range(1, len(stream)):
        tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
        assert feed_split(tracker, stream, [cut]) == expected, cut
        assert tracker.completion_tokens == 12 and tracker.delivered_chunks == CONTENT_EVENTS, cut


def test_pass_through_never_rewrites_a_chunk() -> None:
    stream = b"".join(EVENTS)
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=False)
    for i in range(0, len(stream), 7):
        assert tracker.feed(stream[i:i + 7], False) is None
    assert tracker.feed(b"", True) is None
    assert tracker.completion_tokens == 12


def test_whole_events_pass_unchanged_and_only_the_usage_event_is_emptied() -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    answers = [tracker.feed(e, False) for e in EVENTS]
    assert answers[USAGE_INDEX] == b""
    assert all(a is None for i, a in enumerate(answers) if i != USAGE_INDEX)
    assert tracker.feed(b"", True) is None


def test_partial_events_are_held_back_while_stripping() -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    first = EVENTS[1]
    assert tracker.feed(first[:10], False) == b""          # not a whole event yet
    assert tracker.feed(first[10:], False) == first         # now it is
    assert tracker.feed(EVENTS[USAGE_INDEX][:-1], False) == b""
    assert tracker.feed(EVENTS[USAGE_INDEX][-1:] + EVENTS[-1], False) == EVENTS[-1]


def test_completions_stream() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    events = [event({**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]})
              for t in (" Once", " upon", " a", " time")]
    events += [event({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                        "total_tokens": 7}}), b"data: [DONE]\n\n"]
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    received = feed_split(tracker, b"".join(events), [5, 77, 150, 151])
    assert received == b"".join(events[:4] + events[5:])
    assert (tracker.completion_tokens, tracker.delivered_chunks) == (4, 4)


def test_stream_ending_without_the_final_blank_line() -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    stream = b"".join(EVENTS[:USAGE_INDEX]) + EVENTS[USAGE_INDEX].rstrip(b"\n")
    assert feed_split(tracker, stream, [50]) == b"".join(EVENTS[:USAGE_INDEX])
    assert tracker.completion_tokens == 12
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    assert feed_split(tracker, b"data: [DONE]", []) == b"data: [DONE]"
    assert tracker.done_seen


def test_multi_line_data_comments_and_other_fields() -> None:
    usage_event = (b'event: message\nid: 9\ndata: {"choices": [],\ndata: "usage": {"prompt_tokens": 5, '
                   b'"completion_tokens": 6, "total_tokens": 11}}\n\n')
    stream = b": keep-alive\n\n" + EVENTS[1] + b"retry: 100\n\n" + usage_event + b"data:[DONE]\n\n"
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    assert feed_split(tracker, stream, [3, 40]) == stream.replace(usage_event, b"")
    assert (tracker.prompt_tokens, tracker.completion_tokens, tracker.done_seen) == (5, 6, True)


def test_continuous_usage_keeps_the_last_report_and_strips_nothing_else() -> None:
    events = [event({**HEAD, "choices": [{"index": 0, "delta": {"content": "x"}}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": k, "total_tokens": 4 + k}})
              for k in range(1, 6)]
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    assert feed_split(tracker, b"".join(events), [100]) == b"".join(events)
    assert tracker.completion_tokens == 5


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -1, "completion_tokens": True},
    {"prompt_tokens": "5", "completion_tokens": 1.5},
    {"completion_tokens": 1 << 50},
    "lots",
    None,
    [],
])
def test_hostile_usage_values_are_ignored_and_their_event_hidden(usage: object) -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    stream = event({**HEAD, "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
    received = feed_split(tracker, stream, [20])
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (None, None)
    # The answer to kvgate's stream_options all the same (as the Lua usage filter reads
    # it): a client that did not ask for it would index its empty choices.
    assert received == b"data: [DONE]\n\n"


def test_a_usage_event_that_is_no_json_is_hidden_all_the_same() -> None:
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 007}}\n\n'
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    assert feed_split(tracker, EVENTS[1] + usage + b"data: [DONE]\n\n", [30]) == EVENTS[1] + b"data: [DONE]\n\n"
    assert tracker.completion_tokens is None


def test_a_completion_count_that_is_no_count_is_not_rebuilt_from_the_total() -> None:
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=False)
    feed_split(tracker, orjson.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": -5,
                                                 "total_tokens": 21}}), [])
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (9, None)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=10), strip=st.booleans())
def test_garbage_never_raises_and_passes_through(data: bytes, cuts: list[int], strip: bool) -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=strip, max_buffer=256)
    assert feed_split(tracker, data, cuts) == data


def test_an_endless_line_stops_parsing_and_releases_what_was_held() -> None:
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True, max_buffer=64)
    assert tracker.feed(b"data: " + b"x" * 40, False) == b""
    out = tracker.feed(b"y" * 40, False)
    assert out == b"data: " + b"x" * 40 + b"y" * 40
    assert tracker.overflowed
    # From here on everything passes as it is; usage is unknown rather than wrong.
    assert tracker.feed(EVENTS[USAGE_INDEX], False) is None
    assert tracker.feed(b"", True) is None
    assert tracker.completion_tokens is None


def test_error_json_on_a_stream_request_passes_whole() -> None:
    body = b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
    tracker = ResponseTracker(streamed=True, strip_usage_chunk=True)
    assert feed_split(tracker, body, [10, 30]) == body
    assert tracker.delivered_chunks == 0 and tracker.completion_tokens is None


# --- non-streamed -----------------------------------------------------------------

CHAT_JSON = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Bonjour, ça va? 日本"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30}})


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(CHAT_JSON)), max_size=12))
def test_json_usage_with_any_split(cuts: list[int]) -> None:
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=True)  # nothing to strip in JSON
    assert feed_split(tracker, CHAT_JSON, cuts) == CHAT_JSON
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (21, 9)
    assert tracker.delivered_chunks == 0


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(CHAT_JSON)), max_size=12))
def test_json_over_the_buffer_cap_has_its_count_searched_for_as_the_usage_filter_does(cuts: list[int]) -> None:
    # Over the cap no JSON is parsed: the completion count is found in the chunks (the
    # usage filter's reading, which the access log brings in the other files); a count
    # split across two chunks is found in the overlap. The prompt count stays unknown.
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=False, max_buffer=50)
    assert feed_split(tracker, CHAT_JSON, cuts) == CHAT_JSON
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (None, 9)


@pytest.mark.parametrize("count,expected", [(b"7", 7), (b"007", None), (b"-5", None), (b'"7"', None),
                                            (b"7.5", None), (b"1099511627776", None), (b"1099511627775", 2**40 - 1)])
def test_json_over_the_buffer_cap_takes_only_a_whole_number_as_its_count(count: bytes, expected: int | None) -> None:
    body = (b'{"choices":[{"text":"' + b"x" * 200 + b'","completion_tokens":99}],'
            b'"usage":{"prompt_tokens":3,"completion_tokens":' + count + b',"total_tokens":1}}')
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=False, max_buffer=50)
    feed_split(tracker, body, [60, 120])
    assert tracker.completion_tokens == expected   # never the 99 before "usage"


def test_embeddings_usage_means_zero_completion() -> None:
    body = orjson.dumps({"object": "list", "data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}})
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=False)
    feed_split(tracker, body, [])
    assert (tracker.prompt_tokens, tracker.completion_tokens) == (8, 0)


@pytest.mark.parametrize("body", [b"", b"not json", b"[1,2]", b'{"usage": null}', b'{"usage": {"x": 1}}'])
def test_json_without_usage_leaves_it_unknown(body: bytes) -> None:
    tracker = ResponseTracker(streamed=False, strip_usage_chunk=False)
    feed_split(tracker, body, [3])
    assert tracker.completion_tokens is None and tracker.prompt_tokens is None
