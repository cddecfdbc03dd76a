"""blocks: the simulated GPU's KV-cache block pool, counted in blocks of ``block_size`` tokens.

Without prefix caching only counts matter to the scheduler (which block holds which token
does not), so the pool is three integers: blocks held by sequences, blocks held by phantom
background load, and the total. The invariant ``used + background <= total`` holds whenever
the pool hands out blocks; raising the background may break it for a while (usage then
reads 1.0 and the next allocations fail until sequences give blocks back).

With prefix caching (``PrefixCache``), full blocks also carry a hash, as in vLLM V1
(facts from vllm/v1/core/block_pool.py, kv_cache_utils.py, single_type_kv_cache_manager.py):
- a block's hash covers its parent block's hash and its own token ids (a chain), so two
  sequences share blocks exactly up to their first differing block;
- a hashed block is shared by reference count; at 0 it stays cached, *free* (it counts as
  free in the usage) in a queue ordered least recently used first; a request frees its
  blocks in reverse order, so its tail blocks are evicted before its head blocks;
- an allocation takes never-hashed free blocks first, then evicts cached free blocks from
  the head of that queue (dropping their hashes); a cache hit on a free block takes it out
  of the queue;
- identical blocks are not deduplicated: two requests that computed the same block at
  once each keep their own copy, and a lookup returns the first cached.
Un-hashed blocks need no identity, so they stay counts in ``BlockPool``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# The parent "hash" of a chain's first block (vLLM seeds it from random bytes per process,
# or from PYTHONHASHSEED; a constant keeps the simulator reproducible).
ROOT_HASH = b"kvgate-sim"


def blocks_for(tokens: int, block_size: int) -> int:
    """blocks_for returns how many blocks of ``block_size`` tokens hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class BlockPool:
    """BlockPool counts the KV-cache blocks of one engine.

    ``total``: blocks the GPU holds (``kv_capacity_tokens // block_size``); ``used``:
    blocks held by sequences; ``background``: blocks held by phantom load (set at run
    time to drive the node into pressure).
    """

    __slots__ = ("block_size", "total", "used", "background")

    def __init__(self, total_blocks: int, block_size: int) -> None:
        if total_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size = block_size
        self.total = total_blocks
        self.used = 0
        self.background = 0

    @property
    def free(self) -> int:
        """free is the number of blocks a sequence may take now (never negative)."""
        return max(0, self.total - self.used - self.background)

    @property
    def usage(self) -> float:
        """usage is the ratio of blocks in use (sequences + background) to the total, in [0, 1]."""
        return min(1.0, (self.used + self.background) / self.total)

    def set_background_tokens(self, tokens: int) -> None:
        """set_background_tokens makes phantom load hold ``tokens`` KV tokens (capped at the pool)."""
        if tokens < 0:
            raise ValueError("background tokens must be >= 0")
        self.background = min(self.total, blocks_for(tokens, self.block_size))

    def take(self, n: int) -> bool:
        """take hands out ``n`` blocks if that many are free; returns whether it did."""
        if n <= 0:
            return True
        if n > self.free:
            return False
        self.used += n
        return True

    def give_back(self, n: int) -> None:
        """give_back returns ``n`` blocks a sequence held."""
        if n < 0 or n > self.used:
            raise ValueError(f"cannot give back {n} blocks: {self.used} in use")
        self.used -= n


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """hash_block returns the chain hash of one full block: SHA-256 of its parent's hash and its token ids.

    ``parent`` is the previous block's hash (``ROOT_HASH`` for a sequence's first block);
    token ids are signed 64-bit integers.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class CachedBlock:
    """CachedBlock is one full, hashed block: ``ref`` sequences hold it (0: cached but free)."""

    __slots__ = ("id", "hash", "ref")

    def __init__(self, block_id: int, block_hash: bytes) -> None:
        self.id = block_id
        self.hash = block_hash
        self.ref = 1


class PrefixCache:
    """PrefixCache keeps the hashed blocks of a ``BlockPool`` (vLLM V1's prefix caching).

    Held blocks count in ``pool.used``; cached free blocks are part of ``pool.free`` and
    wait in ``free_queue`` (least recently used first) until an allocation evicts them.
    Invariant: ``len(free_queue) <= pool.free``.
    """

    __slots__ = ("pool", "_by_hash", "free_queue", "_next_id", "evictions")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._by_hash: dict[bytes, dict[int, CachedBlock]] = {}
        self.free_queue: OrderedDict[int, CachedBlock] = OrderedDict()
        self._next_id = 0
        self.evictions = 0

    @property
    def cached_blocks(self) -> int:
        """cached_blocks is how many blocks carry a hash (held or free)."""
        return sum(len(blocks) for blocks in self._by_hash.values())

    def lookup(self, block_hash: bytes) -> CachedBlock | None:
        """lookup returns a cached block with ``block_hash`` (the first cached), or None."""
        blocks = self._by_hash.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def longest_hit(self, hashes: Iterable[bytes]) -> list[CachedBlock]:
        """longest_hit returns the cached blocks of the longest prefix of ``hashes`` (a chain, in order)."""
        hit = []
        for h in hashes:
            block = self.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def touch(self, blocks: Iterable[CachedBlock]) -> None:
        """touch takes a reference on each block; a free one leaves the free queue (no longer evictable)."""
        for block in blocks:
            if block.ref == 0:
                del self.free_queue[block.id]
                if not self.pool.take(1):
                    raise AssertionError("a cached free block must count as free")
            block.ref += 1

    def take(self, n: int) -> bool:
        """take hands out ``n`` un-hashed blocks, evicting cached free blocks when no other is free.

        Returns False (and changes nothing) when fewer than ``n`` blocks are free.
        """
        if n <= 0:
            return True
        if n > self.pool.free:
            return False
        self._evict(n - (self.pool.free - len(self.free_queue)))
        return self.pool.take(n)

    def commit(self, block_hash: bytes) -> CachedBlock:
        """commit gives a held block that just became full its hash; returns the cached block (ref 1)."""
        block = CachedBlock(self._next_id, block_hash)
        self._next_id += 1
        self._by_hash.setdefault(block_hash, {})[block.id] = block
        return block

    def release(self, blocks: Sequence[CachedBlock], unhashed: int) -> None:
        """release drops a sequence's references: ``blocks`` in its order, and ``unhashed`` other blocks.

        Blocks whose count reaches 0 join the free queue's tail in reverse order (the
        sequence's tail blocks are evicted first); un-hashed blocks simply become free.
        While background load overfills the pool, the room it takes evicts them again.
        """
        for block in reversed(blocks):
            if block.ref <= 0:
                raise ValueError("released a block nobody holds")
            block.ref -= 1
            if block.ref == 0:
                self.free_queue[block.id] = block
                self.pool.give_back(1)
        self.pool.give_back(unhashed)
        self.trim()

    def trim(self) -> None:
        """trim evicts cached free blocks that no longer fit in the free room (background load grew)."""
        self._evict(len(self.free_queue) - self.pool.free)

    def clear(self) -> None:
        """clear evicts every cached free block (held blocks keep their hash)."""
        self._evict(len(self.free_queue))

    def _evict(self, n: int) -> None:
        for _ in range(max(0, n)):
            _, block = self.free_queue.popitem(last=False)
            same = self._by_hash[block.hash]
            del same[block.id]
            if not same:
                del self._by_hash[block.hash]
            self.evictions += 1
