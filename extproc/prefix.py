"""prefix: a prompt's prefix chain, so that a node's ledger counts a prefix its requests share once.

Engines with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache) keep one
copy of the KV blocks that running requests' prompts share from their first token on: a
block is reused when it and every block before it hold the same tokens. kvgate does not see
the engine's token ids, so it cuts the prompt it counts into pieces and chains them: a
piece's key is a hash of the key before it and of the piece, so two prompts have a key in
common exactly when everything up to the end of that piece is the same. Each key comes with
its end: the prompt's tokens up to the end of its piece, in kvgate's count.

The pieces are each message's role and texts, in order, cut in pieces of about PIECE_CHARS
characters where the tokenizer's pre-split cuts (``tokens._exact_pieces``), so that the
counts of the pieces are those of the text (and, being short and repeated, are taken from
the tokenizer's cache). The ends place the chat template's tokens around each message as
the template's sizes say (``ChatTemplate``), not where the engine's template renders them:
an end can be off by a few tokens, and where kvgate's tokenizer is not the engine's, by
more. The ledger therefore credits a request that shares a chain ``k`` keys long the
tokens of whole blocks up to the ``k``-th end *less one block* (``rules.shared_tokens``),
which covers an end up to one block off. Tools are part of the chain's first key but not of
its ends (templates render them first or last; counted nowhere, they are charged in full).

A chain is at most MAX_KEYS keys: the rest of a longer prompt is charged in full.
Prompts given as token ids and batches of prompts have no chain (charged in full).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from typing import TYPE_CHECKING

from extproc.admission.types import MAX_KEYS, Chain
from extproc.openai_shapes import ChatShape, ChatTemplate, PromptShape
from extproc.tokens import Tokenizer, _exact_pieces

if TYPE_CHECKING:
    from extproc.openai_api import ParsedRequest

# Characters per piece: a piece is ~256 tokens, so a prefix shared in its middle loses at
# most that much of its credit, and a 32k-token prompt has ~128 keys.
PIECE_CHARS = 1024
# How far past PIECE_CHARS a cut is looked for; without one the rest is one piece (exact).
SCAN_CHARS = 1024


class _Builder:
    __slots__ = ("key", "end", "keys", "ends")

    def __init__(self, seed: bytes) -> None:
        self.key = _hash(0, seed)
        self.end = 0
        self.keys: list[int] = []
        self.ends: list[int] = []

    def add(self, piece: bytes, tokens: int) -> bool:
        """add chains one piece of ``tokens`` tokens; False once the chain is full."""
        if len(self.keys) >= MAX_KEYS:
            return False
        self.key = _hash(self.key, piece)
        self.end += tokens
        self.keys.append(self.key)
        self.ends.append(self.end)
        return True

    def chain(self) -> Chain | None:
        return Chain(tuple(self.keys), tuple(self.ends)) if self.keys else None


def _hash(parent: int, piece: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(piece)
    return int.from_bytes(h.digest(), "little")


def _text(b: _Builder, text: str, count: Callable[[str], int]) -> bool:
    for piece in _exact_pieces(text, PIECE_CHARS, SCAN_CHARS):
        if not b.add(b"t" + piece.encode("utf-8", "surrogatepass"), count(piece)):
            return False
    return True


def chat_chain(shape: ChatShape, tokenizer: Tokenizer, template: ChatTemplate) -> Chain | None:
    """chat_chain is the prefix chain of a validated conversation under ``template`` (None:
    nothing to chain)."""
    count = tokenizer.count
    tools = shape.texts[shape.message_ends[-1]:] if shape.message_ends else []
    b = _Builder(b"chat\x00" + template.name.encode() + b"\x00" + "\x00".join(tools).encode("utf-8", "surrogatepass"))
    if template.default_system is not None and not shape.has_system:
        if not b.add(b"s", template.per_message + count(template.default_system)):
            return b.chain()
    start = 0
    for role, stop in zip(shape.roles, shape.message_ends):
        head = template.per_message + (count(role) if template.count_role else 0)
        if not b.add(b"r" + role.encode("utf-8", "surrogatepass"), head):
            break
        if not all(_text(b, t, count) for t in shape.texts[start:stop] if t):
            break
        start = stop
    return b.chain()


def prompt_chain(shape: PromptShape, tokenizer: Tokenizer) -> Chain | None:
    """prompt_chain is the prefix chain of a completions prompt: one text only (None for
    token ids, a batch or an empty prompt)."""
    if shape.prompts != 1 or len(shape.texts) != 1 or not shape.texts[0]:
        return None
    b = _Builder(b"prompt")
    _text(b, shape.texts[0], tokenizer.count)
    return b.chain()


def prompt_ids(req: ParsedRequest, tokenizer: Tokenizer) -> list[int] | None:
    """prompt_ids is the token ids the engine caches for a request, where kvgate can know
    them: a completions request's one prompt given as token ids, or its one text prompt where
    the tokenizer gives ids (a Hugging Face tokenizer.json, exact when it is the engine's); a
    chat request's conversation rendered with the model's chat template found beside that
    tokenizer.json (``chat_template``), where it renders as the engine renders it. None
    otherwise: batches, a suffix, content parts or tool calls, tokenizers that only count."""
    if req.chat is not None:
        chat_ids = getattr(tokenizer, "chat_ids", None)
        return None if chat_ids is None else chat_ids(req.body.get("messages"))
    shape = req.prompt
    if shape is None or req.suffix or shape.prompts != 1:
        return None
    prompt = req.body.get("prompt")
    if shape.texts:
        ids = getattr(tokenizer, "ids", None)
        return ids(shape.texts[0]) if ids is not None and len(shape.texts) == 1 else None
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return prompt[0]
    return None


def prefix_of(req: ParsedRequest, tokenizer: Tokenizer, template: ChatTemplate) -> Chain | None:
    """prefix_of is a parsed request's prefix chain (None: a shape that is not chained, or a
    completions suffix, which the engine reads after each prompt)."""
    if req.chat is not None:
        return chat_chain(req.chat, tokenizer, template)
    if req.prompt is not None and not req.suffix:
        return prompt_chain(req.prompt, tokenizer)
    return None
