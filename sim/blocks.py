"""blocks: the simulated GPU's KV-cache block pool, counted in blocks of ``block_size`` tokens.

Only counts matter to the scheduler (which block holds which token does not), so the
pool is three integers: blocks held by sequences, blocks held by phantom background load,
and the total. The invariant ``used + background <= total`` holds whenever the pool hands
out blocks; raising the background may break it for a while (usage then reads 1.0 and the
next allocations fail until sequences give blocks back).
"""

from __future__ import annotations


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
