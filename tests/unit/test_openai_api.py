"""OpenAI request semantics: paths, parsing and validation, reservations, context, answers."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest

from extproc.admission.types import RateInfo, Reason, Rejection
from extproc.errors import RequestError
from extproc.openai_api import (
    MAX_TOKENS_LIMIT,
    Endpoint,
    ParsedRequest,
    check_context,
    count_prompt_tokens,
    endpoint_for_path,
    error_body,
    format_reset,
    parse_request,
    rate_limit_headers,
    rejection_response,
    request_error_response,
    request_reservation,
    upstream_body,
)
from extproc.openai_shapes import TEMPLATES, chat_shape, count_shape
from extproc.tokens import load_tokenizer

JSON = "application/json"
TOK = load_tokenizer("cl100k_base")
OPENAI = TEMPLATES["openai"]


def chat(**fields: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}
    body.update(fields)
    return orjson.dumps(body)


# --- paths ------------------------------------------------------------------------

@pytest.mark.parametrize("path, expected", [
    ("/v1/chat/completions", Endpoint.CHAT),
    ("/v1/chat/completions?api-version=1", Endpoint.CHAT),
    ("/v1/completions", Endpoint.COMPLETIONS),
    ("/v1/embeddings#x", Endpoint.EMBEDDINGS),
    # Spellings the server's router accepts must not slip past admission.
    ("/v1//chat/completions", Endpoint.CHAT),
    ("/v1/chat/completions/", Endpoint.CHAT),
    ("/v1/chat/%63ompletions", Endpoint.CHAT),
    ("//v1/completions//", Endpoint.COMPLETIONS),
    ("/v1/models", None),
    ("/health", None),
    ("/v1/chat/completion", None),
    ("/v1/chat/%ZZ", None),
    ("/v1/chat/%ff", None),
    ("", None),
])
def test_endpoint_for_path(path: str, expected: Endpoint | None) -> None:
    assert endpoint_for_path(path) is expected


# --- parsing ----------------------------------------------------------------------

def test_chat_request_fields() -> None:
    req = parse_request(Endpoint.CHAT, chat(max_tokens=50, n=2, stream=True), JSON)
    assert (req.endpoint, req.model, req.stream, req.client_wants_usage, req.max_tokens, req.n) == \
        (Endpoint.CHAT, "m", True, False, 50, 2)
    assert req.body["messages"][0]["content"] == "Hello there"
    asked = parse_request(Endpoint.CHAT, chat(stream=True, stream_options={"include_usage": True}), JSON)
    assert asked.client_wants_usage
    # include_usage without streaming gets nothing streamed: no stream usage wanted.
    assert not parse_request(Endpoint.CHAT, chat(stream_options={"include_usage": True}), JSON).client_wants_usage


def test_max_completion_tokens_wins_and_absence_is_none() -> None:
    assert parse_request(Endpoint.CHAT, chat(max_tokens=10, max_completion_tokens=99), JSON).max_tokens == 99
    assert parse_request(Endpoint.CHAT, chat(max_tokens=None), JSON).max_tokens is None
    assert parse_request(Endpoint.CHAT, chat(), JSON).max_tokens is None


def test_completions_and_embeddings_fields() -> None:
    req = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"prompt": ["a", "b", "c"], "max_tokens": 7,
                                                            "best_of": 3}), None)
    assert (req.prompts, req.max_tokens, req.n, req.best_of, req.sequences) == (3, 7, 1, 3, 9)
    emb = parse_request(Endpoint.EMBEDDINGS, orjson.dumps({"input": [[1, 2, 3]], "stream": True}), JSON)
    assert (emb.max_tokens, emb.stream, emb.n, emb.model) == (0, False, 1, None)


@pytest.mark.parametrize("content_type", [
    None, "", "application/json", "Application/JSON; charset=UTF-8", "application/json;charset=\"utf-8\"",
    "application/vnd.api+json",
])
def test_json_content_types_are_accepted(content_type: str | None) -> None:
    parse_request(Endpoint.CHAT, chat(), content_type)


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
])
def test_other_content_types_are_415(content_type: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(Endpoint.CHAT, chat(), content_type)
    assert exc.value.status == 415


BAD_BODIES: list[tuple[str, Endpoint, bytes, str | None]] = [
    ("empty", Endpoint.CHAT, b"", None),
    ("malformed", Endpoint.CHAT, b'{"messages": [', None),
    ("array", Endpoint.CHAT, b"[1, 2]", None),
    ("string", Endpoint.CHAT, b'"hello"', None),
    ("null", Endpoint.CHAT, b"null", None),
    ("non-utf8", Endpoint.CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("lone surrogate", Endpoint.CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
    ("bom", Endpoint.CHAT, b"\xef\xbb\xbf" + chat(), None),
    ("depth bomb", Endpoint.CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("nan", Endpoint.CHAT, chat()[:-1] + b', "temperature": NaN}', None),
    ("missing messages", Endpoint.CHAT, b'{"model": "m"}', "messages"),
    ("messages object", Endpoint.CHAT, b'{"messages": {"role": "user"}}', "messages"),
    ("empty messages", Endpoint.CHAT, b'{"messages": []}', "messages"),
    ("message string", Endpoint.CHAT, b'{"messages": ["hi"]}', "messages[0]"),
    ("unknown part", Endpoint.CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}', "messages[0].content[0].type"),
    ("model int", Endpoint.CHAT, chat(model=3), "model"),
    ("stream string", Endpoint.CHAT, chat(stream="yes"), "stream"),
    ("stream_options list", Endpoint.CHAT, chat(stream=True, stream_options=[1]), "stream_options"),
    ("include_usage string", Endpoint.CHAT, chat(stream=True, stream_options={"include_usage": "1"}),
     "stream_options.include_usage"),
    ("max_tokens negative", Endpoint.CHAT, chat(max_tokens=-1), "max_tokens"),
    ("max_tokens zero", Endpoint.CHAT, chat(max_tokens=0), "max_tokens"),
    ("max_tokens bool", Endpoint.CHAT, chat(max_tokens=True), "max_tokens"),
    ("max_tokens float", Endpoint.CHAT, chat(max_tokens=10.0), "max_tokens"),
    ("max_tokens string", Endpoint.CHAT, chat(max_tokens="10"), "max_tokens"),
    ("max_tokens absurd", Endpoint.CHAT, chat(max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    ("max_tokens huge", Endpoint.CHAT, chat()[:-1] + b', "max_tokens": 1' + b"0" * 30 + b"}", "max_tokens"),
    ("max_tokens overflow", Endpoint.CHAT, chat()[:-1] + b', "max_tokens": 1e999}', None),
    ("max_completion_tokens", Endpoint.CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    ("n zero", Endpoint.CHAT, chat(n=0), "n"),
    ("n absurd", Endpoint.CHAT, chat(n=129), "n"),
    ("best_of absurd", Endpoint.COMPLETIONS, b'{"prompt": "x", "best_of": 1000}', "best_of"),
    ("missing prompt", Endpoint.COMPLETIONS, b'{"model": "m"}', "prompt"),
    ("prompt object", Endpoint.COMPLETIONS, b'{"prompt": {"a": 1}}', "prompt"),
    ("prompt ids with bool", Endpoint.COMPLETIONS, b'{"prompt": [1, true]}', "prompt[1]"),
    ("suffix int", Endpoint.COMPLETIONS, b'{"prompt": "x", "suffix": 1}', "suffix"),
    ("missing input", Endpoint.EMBEDDINGS, b'{"model": "m"}', "input"),
    ("input empty", Endpoint.EMBEDDINGS, b'{"input": []}', "input"),
]


@pytest.mark.parametrize("name, endpoint, body, param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_are_400_with_an_openai_error(name: str, endpoint: Endpoint, body: bytes,
                                                  param: str | None) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(endpoint, body, JSON)
    err = exc.value
    assert err.status == 400
    assert err.param == param
    assert err.error_type == "invalid_request_error"
    assert err.message
    status, headers, payload = request_error_response(err)
    assert status == 400 and ("x-should-retry", "false") in headers
    assert orjson.loads(payload)["error"]["param"] == param


def test_non_utf8_and_depth_messages_say_what_is_wrong() -> None:
    with pytest.raises(RequestError, match="UTF-8"):
        parse_request(Endpoint.CHAT, b'{"a": "\xc3\x28"}', JSON)
    with pytest.raises(RequestError, match="nested too deeply"):
        parse_request(Endpoint.CHAT, b"[" * 2000, JSON)


def test_a_128k_space_prompt_is_parsed_and_counted() -> None:
    body = orjson.dumps({"messages": [{"role": "user", "content": " " * 128_000}], "max_tokens": 10})
    req = parse_request(Endpoint.CHAT, body, JSON)
    n = count_prompt_tokens(req, TOK, OPENAI)
    assert 1000 <= n <= len(body)  # never more tokens than bytes


# --- counting and reservations ----------------------------------------------------

def test_count_prompt_tokens_matches_the_chat_shape_count() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    req = parse_request(Endpoint.CHAT, orjson.dumps({"messages": messages}), JSON)
    for name, template in TEMPLATES.items():
        assert count_prompt_tokens(req, TOK, template) == count_shape(chat_shape(messages), TOK, template), name


def test_completions_batch_counts_each_prompt_with_the_suffix() -> None:
    req = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"prompt": ["one two", "three four five six"],
                                                            "suffix": " end"}), JSON)
    total = count_prompt_tokens(req, TOK, OPENAI)
    suffix = TOK.count(" end")
    assert total == TOK.count("one two") + TOK.count("three four five six") + 2 * suffix
    assert req.max_prompt_tokens == TOK.count("three four five six") + suffix


def test_token_id_prompts_count_as_given() -> None:
    req = parse_request(Endpoint.COMPLETIONS, b'{"prompt": [[1, 2, 3], [4, 5]]}', JSON)
    assert count_prompt_tokens(req, TOK, OPENAI) == 5
    assert req.max_prompt_tokens == 3


@pytest.mark.parametrize("fields, prompt, window, default, expected", [
    ({"max_tokens": 100}, 50, 4096, 1024, 100),
    ({"max_tokens": 100, "n": 3}, 50, 4096, 1024, 300),
    ({}, 50, 4096, 1024, 1024),                 # default when it fits
    ({}, 3500, 4096, 1024, 596),                # what is left of the window
    ({}, 5000, 4096, 1024, 0),                  # nothing left (the context check refuses it)
    ({"n": 2}, 3500, 4096, 1024, 2 * 596),
])
def test_request_reservation_for_chat(fields: dict, prompt: int, window: int, default: int,
                                      expected: int) -> None:
    req = parse_request(Endpoint.CHAT, chat(**fields), JSON)
    assert request_reservation(req, prompt, window, default) == expected


def test_request_reservation_for_batches_best_of_and_embeddings() -> None:
    batch = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"prompt": ["a", "b"], "max_tokens": 10,
                                                              "n": 2, "best_of": 4}), JSON)
    assert request_reservation(batch, 10, 4096, 1024) == 10 * 4 * 2
    emb = parse_request(Endpoint.EMBEDDINGS, b'{"input": "hello"}', JSON)
    assert request_reservation(emb, 5, 4096, 1024) == 0


def _ctx_error(req: ParsedRequest, prompt: int, window: int, default: int = 1024) -> RequestError | None:
    reserved = request_reservation(req, prompt, window, default)
    try:
        check_context(req, prompt, reserved, window)
    except RequestError as err:
        return err
    return None


def test_context_check_boundary_and_openai_message() -> None:
    req = parse_request(Endpoint.CHAT, chat(max_tokens=100), JSON)
    assert _ctx_error(req, 3996, 4096) is None           # exactly the window
    err = _ctx_error(req, 3997, 4096)
    assert err is not None
    assert (err.status, err.code, err.param, err.error_type) == \
        (400, "context_length_exceeded", "messages", "invalid_request_error")
    assert err.message == ("This model's maximum context length is 4096 tokens. However, you requested "
                           "4097 tokens (3997 in the messages, 100 in the completion). Please reduce the "
                           "length of the messages or completion.")


def test_context_check_without_max_tokens_needs_room_for_one_token() -> None:
    req = parse_request(Endpoint.CHAT, chat(), JSON)
    assert _ctx_error(req, 4095, 4096) is None
    err = _ctx_error(req, 4096, 4096)
    assert err is not None and "4096 in the messages, 0 in the completion" in err.message


def test_context_check_uses_the_longest_prompt_of_a_batch() -> None:
    req = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"prompt": [[1] * 3000, [2] * 3000],
                                                            "max_tokens": 1000}), JSON)
    prompt = count_prompt_tokens(req, TOK, OPENAI)
    assert prompt == 6000
    assert _ctx_error(req, prompt, 4096) is None          # each sequence: 3000 + 1000
    assert _ctx_error(req, prompt, 3999) is not None
    err = _ctx_error(req, prompt, 3999)
    assert err is not None and err.param == "prompt" and "3000 in the prompt" in err.message


def test_context_check_for_embeddings() -> None:
    req = parse_request(Endpoint.EMBEDDINGS, orjson.dumps({"input": [1] * 8192}), JSON)
    prompt = count_prompt_tokens(req, TOK, OPENAI)
    assert _ctx_error(req, prompt, 8192) is None
    err = _ctx_error(req, prompt, 8191)
    assert err is not None and err.param == "input"


# --- stream usage -----------------------------------------------------------------

def test_upstream_body_asks_for_stream_usage_and_changes_nothing_else() -> None:
    body = chat(stream=True, temperature=0.7, max_tokens=5, stream_options={"continuous_usage_stats": True})
    req = parse_request(Endpoint.CHAT, body, JSON)
    new, _ = upstream_body(req)
    assert new is not None
    got, original = orjson.loads(new), orjson.loads(body)
    assert got.pop("stream_options") == {"include_usage": True, "continuous_usage_stats": False}
    original.pop("stream_options")
    assert got == original
    assert req.body == orjson.loads(body)  # the parsed request itself is untouched


@pytest.mark.parametrize("endpoint, body", [
    (Endpoint.CHAT, chat()),
    (Endpoint.CHAT, chat(stream=False)),
    (Endpoint.CHAT, chat(stream=True, stream_options={"include_usage": True})),
    (Endpoint.EMBEDDINGS, b'{"input": "x", "stream": true}'),
])
def test_upstream_body_leaves_other_bodies_alone(endpoint: Endpoint, body: bytes) -> None:
    assert upstream_body(parse_request(endpoint, body, JSON)) == (None, False)


def test_upstream_body_asks_for_stream_usage_of_completions() -> None:
    req = parse_request(Endpoint.COMPLETIONS, b'{"prompt": "x", "stream": true}', JSON)
    new, _ = upstream_body(req)
    assert new is not None and orjson.loads(new)["stream_options"] == {"include_usage": True}


# --- answers ----------------------------------------------------------------------

def test_error_body_shape() -> None:
    assert orjson.loads(error_body("boom", error_type="invalid_request_error", code=None)) == \
        {"error": {"message": "boom", "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-1, "0s"), (float("nan"), "0s"), (float("inf"), "0s"),
    (0.0004, "1ms"), (0.012, "12ms"), (0.0121, "13ms"), (0.999, "999ms"),
    (1, "1s"), (1.5, "1.5s"), (59.25, "59.25s"), (60, "1m0s"), (360, "6m0s"), (61.5, "1m1.5s"),
    (3600, "1h0m0s"), (3723.5, "1h2m3.5s"),
])
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_rate_limit_headers() -> None:
    rate = RateInfo(limit_requests=64, remaining_requests=10, limit_tokens=100_000, remaining_tokens=-50.5,
                    reset_tokens_s=360.0, reset_requests_s=0.012)
    assert rate_limit_headers(rate) == [
        ("x-ratelimit-limit-requests", "64"),
        ("x-ratelimit-remaining-requests", "10"),
        ("x-ratelimit-reset-requests", "12ms"),
        ("x-ratelimit-limit-tokens", "100000"),
        ("x-ratelimit-remaining-tokens", "0"),   # a bucket in debt reports 0, never negative
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]
    no_bucket = rate_limit_headers(RateInfo(limit_requests=8, remaining_requests=8))
    assert [k for k, _ in no_bucket] == ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                         "x-ratelimit-reset-requests"]
    assert rate_limit_headers(None) == []


@pytest.mark.parametrize("reason, delay, retryable, retry_after, retry_ms, kind", [
    (Reason.TPM, 0.2, True, "1", "200", "tokens"),
    (Reason.CONCURRENCY, 2.5, True, "3", "2500", "requests"),
    (Reason.KV_BUDGET, 0.0, True, "1", "1", "tokens"),
    (Reason.SHED, 1.0, True, "1", "1000", "requests"),
    (Reason.TPM, float("inf"), False, "86400", "86400000", "tokens"),
])
def test_rejection_response(reason: Reason, delay: float, retryable: bool, retry_after: str,
                            retry_ms: str, kind: str) -> None:
    rate = RateInfo(limit_requests=4, remaining_requests=0, limit_tokens=1000, remaining_tokens=10)
    rej = Rejection(reason=reason, retry_after_s=delay, retryable=retryable,
                    message=f"The {reason.value} budget is full.", rate=rate)
    status, headers, body = rejection_response(rej)
    h = dict(headers)
    assert status == 429
    assert (h["retry-after"], h["retry-after-ms"], h["x-kvgate-reason"]) == (retry_after, retry_ms, reason.value)
    assert h["content-type"] == "application/json"
    assert ("x-should-retry" in h) is (not retryable)
    assert h.get("x-should-retry", "false") == "false"
    assert h["x-ratelimit-remaining-tokens"] == "10"
    assert orjson.loads(body) == {"error": {"message": f"The {reason.value} budget is full.", "type": kind,
                                            "param": None, "code": "rate_limit_exceeded"}}


# --- the real openai client reads these answers ------------------------------------

class _Answer(http.server.BaseHTTPRequestHandler):
    """_Answer replies to every POST with the server's canned (status, headers, body)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        status, headers, body = self.server.answer  # type: ignore[attr-defined]
        self.server.hits += 1  # type: ignore[attr-defined]
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def _client(server: http.server.ThreadingHTTPServer, retries: int) -> openai.OpenAI:
    host, port = server.server_address[:2]
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="test", max_retries=retries, timeout=10)


def test_openai_client_retries_a_retryable_429_and_reads_it(answering_server: Any) -> None:
    rej = Rejection(reason=Reason.CONCURRENCY, retry_after_s=0.001, retryable=True,
                    message="Too many concurrent requests on pool 'default'.")
    answering_server.answer = rejection_response(rej)
    with pytest.raises(openai.RateLimitError) as exc:
        _client(answering_server, retries=2).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    assert answering_server.hits == 3  # retried, honouring retry-after-ms
    assert exc.value.code == "rate_limit_exceeded"
    assert exc.value.response.headers["x-kvgate-reason"] == "concurrency"
    assert "Too many concurrent requests" in exc.value.message


def test_openai_client_does_not_retry_a_429_that_can_never_fit(answering_server: Any) -> None:
    rej = Rejection(reason=Reason.KV_BUDGET, retry_after_s=0.001, retryable=False,
                    message="This request can never be admitted.")
    answering_server.answer = rejection_response(rej)
    with pytest.raises(openai.RateLimitError):
        _client(answering_server, retries=2).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    assert answering_server.hits == 1


def test_openai_client_reads_a_context_length_error(answering_server: Any) -> None:
    req = parse_request(Endpoint.CHAT, chat(max_tokens=100), JSON)
    err = _ctx_error(req, 5000, 4096)
    assert err is not None
    answering_server.answer = request_error_response(err)
    with pytest.raises(openai.BadRequestError) as exc:
        _client(answering_server, retries=2).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    assert answering_server.hits == 1
    assert exc.value.code == "context_length_exceeded"
    assert exc.value.param == "messages"
