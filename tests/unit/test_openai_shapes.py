"""The OpenAI request shapes counted with the real tokenizers: chat templates, content parts,
tools, prompts and the 400s for malformed fields."""

from __future__ import annotations

from typing import Any

import pytest
import tiktoken
from tokenizers import Tokenizer as HFTok

from extproc import tokens as tk
from extproc.errors import RequestError
from extproc.openai_shapes import (
    IMAGE_TOKENS_DEFAULT,
    IMAGE_TOKENS_LOW,
    TEMPLATES,
    ChatTemplate,
    chat_shape,
    count_prompt_shape,
    count_shape,
    prompt_shape,
)
from extproc.tokens import load_tokenizer
from tests.unit.real_tokenizers import LLAMA_JSON, LLAMA_MODEL, cl100k, llama_tt  # noqa: F401 (fixtures)


def count_chat(messages: list[dict[str, Any]], tokenizer: tk.Tokenizer, template: ChatTemplate,
               tools: list[Any] | None = None) -> int:
    """count_chat is the prompt tokens of a conversation under ``template``, as kvgate counts them."""
    return count_shape(chat_shape(messages, tools), tokenizer, template)


def count_prompt(prompt: Any, tokenizer: tk.Tokenizer) -> int:
    """count_prompt is the tokens of a completions prompt (or embeddings input), summed."""
    return sum(count_prompt_shape(prompt_shape(prompt), tokenizer))


# --- chat templates ---------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the KV cache?"},
    {"role": "assistant", "content": "Keys and values of past tokens, kept per layer."},
    {"role": "user", "content": "Why does it fill up?"},
]


def test_openai_recipe(cl100k: tk.Tokenizer) -> None:
    msgs = CHAT + [{"role": "user", "name": "carol", "content": "And then?"}]
    expected = 3  # reply priming
    for m in msgs:
        expected += 3 + sum(cl100k.count(v) for v in m.values())
        expected += 1 if "name" in m else 0
    assert count_chat(msgs, cl100k, TEMPLATES["openai"]) == expected


def test_llama3_overhead_matches_the_rendered_template(llama_tt: tk.Tokenizer) -> None:
    # Meta's Llama 3 Instruct format, encoded by the model's own tokenizer.json with its
    # special tokens: kvgate's arithmetic must give the same number.
    rendered = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in CHAT)
    rendered += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    hf = HFTok.from_file(str(LLAMA_JSON))
    truth = len(hf.encode(rendered, add_special_tokens=False).ids)
    assert count_chat(CHAT, llama_tt, TEMPLATES["llama3"]) == truth


def _qwen_encoding() -> tiktoken.Encoding:
    ranks = tk.read_rank_file(LLAMA_MODEL)
    return tiktoken.Encoding("qwen-shaped", pat_str=tk.SPLIT_PATTERNS["qwen2"], mergeable_ranks=ranks,
                             special_tokens={"<|im_start|>": 200_000, "<|im_end|>": 200_001})


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


def test_qwen2_overhead_matches_the_rendered_chatml() -> None:
    enc = _qwen_encoding()
    tok = tk.TiktokenTokenizer("qwen-shaped", enc)
    truth = len(enc.encode(_chatml(CHAT), allowed_special="all"))
    assert count_chat(CHAT, tok, TEMPLATES["qwen2"]) == truth
    # Without a system message the template inserts its default one.
    no_system = CHAT[1:]
    with_default = [{"role": "system", "content": TEMPLATES["qwen2"].default_system}] + no_system
    truth = len(enc.encode(_chatml(with_default), allowed_special="all"))
    assert count_chat(no_system, tok, TEMPLATES["qwen2"]) == truth


def test_none_template_counts_only_the_text(cl100k: tk.Tokenizer) -> None:
    assert count_chat(CHAT, cl100k, TEMPLATES["none"]) == sum(cl100k.count(m["content"]) for m in CHAT)


def test_long_custom_role_is_not_free_under_fixed_templates(llama_tt: tk.Tokenizer) -> None:
    base = count_chat([{"role": "user", "content": "hi"}], llama_tt, TEMPLATES["llama3"])
    custom = count_chat([{"role": "a very long custom role name", "content": "hi"}], llama_tt,
                        TEMPLATES["llama3"])
    assert custom == base + llama_tt.count("a very long custom role name") - 1


# --- content parts, tools ---------------------------------------------------------

def test_text_parts_count_like_text_and_images_by_the_fixed_rule(cl100k: tk.Tokenizer) -> None:
    tmpl = TEMPLATES["openai"]
    plain = count_chat([{"role": "user", "content": "Describe this."}], cl100k, tmpl)
    huge_url = "data:image/png;base64," + "A" * 200_000
    parts = [{"type": "text", "text": "Describe this."},
             {"type": "image_url", "image_url": {"url": huge_url, "detail": "low"}},
             {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
             {"type": "image_url", "image_url": {"url": "https://example.invalid/b.png", "detail": "high"}}]
    counted = count_chat([{"role": "user", "content": parts}], cl100k, tmpl)
    assert counted == plain + IMAGE_TOKENS_LOW + 2 * IMAGE_TOKENS_DEFAULT
    assert (IMAGE_TOKENS_LOW, IMAGE_TOKENS_DEFAULT) == (85, 85 + 4 * 170)


def test_tool_calls_and_tool_schemas_are_counted(cl100k: tk.Tokenizer) -> None:
    tmpl = TEMPLATES["openai"]
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None}]
    base = count_chat(msgs, cl100k, tmpl)
    msgs[1] = {"role": "assistant", "content": None, "tool_calls": [call]}
    with_call = count_chat(msgs, cl100k, tmpl)
    assert with_call == base + sum(cl100k.count(s) for s in ("call_abc123", "get_weather", '{"city": "Paris"}'))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert count_chat(msgs, cl100k, tmpl, tools=tools) > with_call


@pytest.mark.parametrize("messages, param", [
    ("hello", "messages"),
    ([], "messages"),
    ([1], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": 3, "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "input_video", "url": "x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": ["text"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 1}}]}],
     "messages[0].content[0].image_url.url"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "max"}}]}],
     "messages[0].content[0].image_url.detail"),
    ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
    ([{"role": "assistant", "tool_calls": {"a": 1}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}], "messages[0].tool_calls[0].function.name"),
    ([{"role": "tool", "content": "x", "tool_call_id": 9}], "messages[0].tool_call_id"),
])
def test_malformed_conversations_are_request_errors(messages: object, param: str) -> None:
    with pytest.raises(RequestError) as exc:
        count_chat(messages, load_tokenizer("cl100k_base"), TEMPLATES["openai"])
    assert exc.value.status == 400
    assert exc.value.param == param


# --- completions prompts ----------------------------------------------------------

def test_prompt_shapes(cl100k: tk.Tokenizer) -> None:
    assert count_prompt("Hello, world!", cl100k) == cl100k.count("Hello, world!")
    assert count_prompt(["a b", "c d e"], cl100k) == cl100k.count("a b") + cl100k.count("c d e")
    assert count_prompt([5, 9, 1000, 0], cl100k) == 4
    assert count_prompt([[1, 2], [3, 4, 5]], cl100k) == 5
    assert count_prompt("", cl100k) == 0


@pytest.mark.parametrize("prompt, param", [
    (None, "prompt"),
    (3, "prompt"),
    ([], "prompt"),
    (["a", 1], "prompt[1]"),
    ([1, True], "prompt[1]"),
    ([1, -1], "prompt[1]"),
    ([1, 2.0], "prompt[1]"),
    ([1, 1 << 40], "prompt[1]"),
    ([[1], []], "prompt[1]"),
    ([[1], [2, "x"]], "prompt[1][1]"),
    ([{"a": 1}], "prompt[0]"),
])
def test_malformed_prompts_are_request_errors(prompt: object, param: str) -> None:
    with pytest.raises(RequestError) as exc:
        count_prompt(prompt, load_tokenizer("cl100k_base"))
    assert exc.value.param == param
