"""engine_blocks: the KV blocks one engine caches, as its KV events tell them, keyed so that
kvgate can look a prompt up.

vLLM's KV events (``extproc.signals.kv_events``) name each block by the engine's own hash,
which covers its parent's hash, its token ids and extra keys (LoRA, multimodal inputs, cache
salt) with an algorithm of the engine's choice: kvgate cannot compute it. But a BlockStored
event also carries the blocks' token ids and their parent's hash, so the index keys each
block by a chain of kvgate's own over token ids: a key covers the key before it and the next
GRAIN token ids, and a block's key is the key at its last token. The engine's hash is kept
only to find the key again when the block is removed, and to chain the blocks stored after
it. A prompt's keys (``token_keys``, GRAIN tokens each, whatever the block size) are then
looked up at every block end: the tokens up to the last block found, with every block
before it, are cached on the node (``EngineBlocks.cached``).

Where kvgate's token ids are the engine's (a prompt given as token ids, or a text prompt
encoded with the engine's tokenizer, ``prefix.prompt_ids``) the match is exact. Where they
are not, the match is shorter or nothing, never longer than a true prefix: a placement hint
only, never a credit. What is lost: blocks stored without token ids (``token_ids`` empty)
and blocks whose parent the index no longer knows are not indexed (counted as
``orphans``); blocks of a LoRA adapter, and blocks whose hash covers extra keys (a cache
salt, multimodal input: vLLM lists them per block in ``extra_keys``) with every block after
them, are not indexed (``skipped``), since kvgate's keys cover token ids only; nor are
blocks of another medium (CPU offloading) or of another KV cache group than the first.

The index holds at most ``max_blocks`` blocks: past that the oldest stored are forgotten
(the engine evicts least recently used blocks first too), and the view is no longer
complete. All methods run on one thread (the node's subscriber); ``cached`` may be called
from another thread at any time: it only reads dictionaries, and a read racing an update
sees the view just before or just after it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Tokens per key of kvgate's chain: vLLM's block sizes are multiples of 16 (16 by default on
# GPUs, multiples of 32 on CPUs), so every block ends on a key.
GRAIN = 16
# The key before a prompt's first token.
ROOT = 0
# A node's index, in blocks (about 200 bytes each, measured; 260 with vLLM's 32-byte sha256
# hashes): 131,072 blocks of 16 are 2M tokens, more than an 8B model's cache on a 141 GB GPU.
MAX_BLOCKS = 1 << 17

EngineHash = int | bytes


def token_keys(ids: Sequence[int], parent: int = ROOT) -> tuple[int, ...]:
    """token_keys is kvgate's chain over ``ids`` after ``parent``: one key per GRAIN token ids,
    each covering every token before it (a trailing part shorter than GRAIN has none)."""
    keys = []
    key = parent
    for start in range(0, len(ids) - GRAIN + 1, GRAIN):
        # Python's hash of a tuple of ints is the same in every process and run (ints are
        # not salted): the index and the request side compute it in one process anyway.
        key = hash((key, *ids[start:start + GRAIN]))
        keys.append(key)
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class Stored:
    """Stored is a BlockStored event: ``hashes`` of the blocks stored, in order, each the
    child of the one before, the first the child of ``parent`` (None: a prompt's first);
    ``token_ids`` of all of them (``block_size`` each; empty where the engine sends none);
    ``lora_id`` / ``lora_name`` (None: the base model); ``medium`` (None or ``"GPU"``: the
    engine's device cache; another tier, e.g. ``"CPU"`` offloading, is not what a request
    reuses first); ``extra``: per block, whether its hash covers more than its tokens
    (multimodal input, cache salt, LoRA; empty: none); ``group``: the KV cache group (None
    or 0: the first, the only one of a model without sliding-window layers)."""

    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra: tuple[bool, ...] = ()
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """Removed is a BlockRemoved event: the ``hashes`` of blocks evicted from ``medium``, in
    KV cache ``group``."""

    hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """Cleared is an AllBlocksCleared event: the engine's cache is empty."""


Event = Stored | Removed | Cleared


def _device(medium: str | None, group: int | None) -> bool:
    """_device: the event is about the engine's device cache, first KV cache group."""
    return (medium is None or medium.upper() == "GPU") and not group


class EngineBlocks:
    """EngineBlocks is the index of one node's cached blocks (see the module doc).

    ``complete``: the index has seen every event since the engine's cache was empty (its
    first batch, a replay from it, or an AllBlocksCleared), and forgot nothing since; the
    subscriber clears it on a gap it cannot fill (``incomplete``). ``block_size``: the
    engine's, from its last BlockStored (tokens; None before one). Counters (events since
    start): ``orphans`` (blocks not indexed, see the module doc), ``forgotten`` (dropped
    past ``max_blocks``), ``skipped`` (LoRA or another medium).
    """

    __slots__ = ("max_blocks", "by_hash", "keys", "block_size", "complete", "orphans",
                 "forgotten", "skipped")

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.by_hash: OrderedDict[EngineHash, int] = OrderedDict()  # oldest stored first
        self.keys: dict[int, int] = {}  # kvgate's key -> engine blocks holding it
        self.block_size: int | None = None
        self.complete = False
        self.orphans = 0
        self.forgotten = 0
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.by_hash)

    def apply(self, event: Event) -> None:
        """apply updates the index with one event."""
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            if not _device(event.medium, event.group):
                self.skipped += len(event.hashes)
                return
            for h in event.hashes:
                self._drop(h)
        else:
            self.clear(complete=True)

    def clear(self, complete: bool) -> None:
        """clear forgets every block; ``complete``: the engine's cache is known to be empty."""
        self.by_hash.clear()
        self.keys.clear()
        self.complete = complete

    def incomplete(self) -> None:
        """incomplete says events were lost: what the index holds stays, but it may miss blocks
        (and hold some the engine evicted) until the engine's cache is cleared."""
        self.complete = False

    def _store(self, e: Stored) -> None:
        size = e.block_size
        if e.lora_id is not None or e.lora_name is not None or not _device(e.medium, e.group):
            self.skipped += len(e.hashes)
            return
        if e.parent is None:
            parent: int | None = ROOT
        else:
            parent = self.by_hash.get(e.parent)
        if parent is None or size % GRAIN or len(e.token_ids) != size * len(e.hashes):
            self.orphans += len(e.hashes)
            return
        self.block_size = size
        keys = token_keys(e.token_ids, parent)
        per = size // GRAIN
        for i, h in enumerate(e.hashes):
            if e.extra and e.extra[i]:  # it and its children are keyed by more than tokens
                self.skipped += len(e.hashes) - i
                break
            self._drop(h)
            key = keys[(i + 1) * per - 1]
            self.by_hash[h] = key
            self.keys[key] = self.keys.get(key, 0) + 1
        while len(self.by_hash) > self.max_blocks:
            self._unref(self.by_hash.popitem(last=False)[1])
            self.forgotten += 1
            self.complete = False

    def _drop(self, h: EngineHash) -> None:
        key = self.by_hash.pop(h, None)
        if key is not None:
            self._unref(key)

    def _unref(self, key: int) -> None:
        left = self.keys.get(key, 0) - 1
        if left > 0:
            self.keys[key] = left
        else:
            self.keys.pop(key, None)

    def cached(self, keys: Sequence[int]) -> int:
        """cached is the tokens of the longest prefix of the prompt of ``keys`` (``token_keys``)
        that the node caches in whole blocks (0: none, or no block size known yet).

        A binary search over the prompt's blocks (a pick asks every node: 11 lookups for a
        32k-token prompt rather than 2,048): it takes the cached blocks of a prompt to be a
        prefix of them, as they are in vLLM, which evicts a request's blocks tail first and
        reuses a block only after every block before it. Where a block in the middle was
        evicted alone, the answer may reach past it (a ranking a few blocks long, never a
        charge)."""
        size = self.block_size
        index = self.keys
        if not size or not index:
            return 0
        per = size // GRAIN
        lo, hi = 0, len(keys) // per   # blocks known cached, blocks that may be
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid * per - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        return lo * per * GRAIN
