"""sharing: the prompt blocks that requests running on one node share, counted once.

``Prefixes`` is a replica's own ledger of them (``node.Node.prefixes``): the prefix chains
(``extproc.prefix``) of its charges on a node, reference-counted per key.

``SharedPrefixes`` is the same count in a ledger shared by replicas (the Redis store,
``store.redis_lua``, mirrors it line for line and a differential test holds them equal):
every replica's leases on a node, so that a request admitted through any replica is
charged its prompt less what it shares with the requests running there through any
replica. It adds what one replica's ledger does not need:

- which replicas hold each key, and ``cross``: the tokens each key counts for every
  replica holding it beyond the first (sum of tokens x (replicas - 1)). Each replica
  subtracts from a node's report its own requests seen in the cache with the blocks they
  share counted once among them, and the others' published ones likewise: a prefix held
  through two replicas is subtracted twice while the node holds it once, and the foreign
  KV read would be too low by it. The blocks a set of requests shares split exactly into
  each replica's sharing among its own plus ``cross`` over the set; ``cross`` over every
  running lease (those seen in the cache are among them) can only be more, and the rule
  gives back at most what the others' subtraction took (``shared_nodes.pick_shared``):
  never more than not subtracting them at all. A replica's own ledger may count more of
  its requests' sharing than the store (a lease that took fewer keys, or was admitted
  alone): it then subtracts less, the safe side.
- bounds, because prompts are client input: a chain is at most ``MAX_LINKS`` keys
  (``extproc.prefix.MAX_KEYS``), and a node at most ``MAX_NODE_KEYS`` distinct keys: a
  lease whose new keys do not fit takes only the keys already there (its credit is the
  same; only later requests cannot share its own tail).
- the block size: each replica asks with a node's block size as it reads it; the first
  lease on an empty node sets it, and while leases hold keys there a request asked with
  another size neither gets credit nor adds keys (it is charged whole).
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.admission.types import MAX_KEYS, Chain

MAX_LINKS = MAX_KEYS
"""MAX_LINKS is the most keys of a chain the shared ledger reads (the rest is charged whole)."""
MAX_NODE_KEYS = 16_384
"""MAX_NODE_KEYS is the most distinct prefix keys the shared ledger keeps per node: 4M tokens
of distinct prompts at ~256 tokens a key, about 2 MB of Redis per node with two replicas."""


class Prefixes:
    """Prefixes counts the prefix chains (``extproc.prefix``) of a set of charges on one node,
    so that the prompt blocks they share are counted once.

    ``refs``: per key, its holders and its tokens: the whole blocks of ``block`` tokens
    between the end of the key before it and its own end (as its first holder's chain
    had them); ``dup``: the tokens of every key counted for its holders beyond the first;
    ``extra``: the holders beyond the first of the chains' first keys. ``shared`` is the
    tokens counted once thanks to sharing: ``dup`` less one block per holder that shares
    (the ends are kvgate's count, which may be off the engine's by up to a block; see
    ``extproc.prefix``). Blocks shared with requests that ended are not counted: an engine
    may have evicted them.
    """

    __slots__ = ("block", "refs", "dup", "extra")

    def __init__(self, block: int) -> None:
        self.block = block
        self.refs: dict[int, list[int]] = {}
        self.dup = 0
        self.extra = 0

    @property
    def shared(self) -> int:
        """shared is the tokens the set's charges share (counted once), see the class doc."""
        return max(0, self.dup - self.block * self.extra)

    def _blocks(self, chain: Chain) -> Iterable[tuple[int, int, int]]:
        """_blocks is each key of ``chain`` with its position and its whole blocks' tokens."""
        before = 0
        for i, (key, end) in enumerate(zip(chain.keys, chain.ends)):
            whole = end - end % self.block
            yield i, key, max(0, whole - before)
            before = max(before, whole)

    def add(self, chain: Chain) -> None:
        """add counts one more holder of ``chain``."""
        refs = self.refs
        for i, key, tokens in self._blocks(chain):
            entry = refs.get(key)
            if entry is None:
                refs[key] = [1, tokens]
                continue
            entry[0] += 1
            self.dup += entry[1]
            if i == 0:
                self.extra += 1

    def drop(self, chain: Chain) -> None:
        """drop counts one holder of ``chain`` less (one that ``add`` counted)."""
        refs = self.refs
        for i, key, _tokens in self._blocks(chain):
            entry = refs.get(key)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] <= 0:
                del refs[key]
                continue
            self.dup -= entry[1]
            if i == 0:
                self.extra -= 1

    def run(self, chain: Chain) -> int:
        """run is how many leading keys of ``chain`` the set holds (the prefix it shares)."""
        refs = self.refs
        n = 0
        for key in chain.keys:
            if key not in refs:
                break
            n += 1
        return n

    def whole_blocks(self, end: int) -> int:
        """whole_blocks is ``end`` tokens rounded down to whole blocks."""
        return end - end % self.block

    def credit(self, chain: Chain | None) -> int:
        """credit is how much ``shared`` would grow with one more holder of ``chain``: the
        tokens a request with that prompt is counted less on the node (0: none shared)."""
        if chain is None or not self.refs:
            return 0
        got = 0
        for i, key, _tokens in self._blocks(chain):
            entry = self.refs.get(key)
            if entry is None:
                if i == 0:
                    return 0
                break
            got += entry[1]
        return max(0, self.dup + got - self.block * (self.extra + 1)) - self.shared


class SharedPrefixes:
    """SharedPrefixes is the shared ledger's count of the prefixes of every replica's leases on
    one node (see the module doc): a ``Prefixes`` at the block size of the node's first
    holder, which replicas hold each key (``owners``: key -> replica -> holders) and
    ``cross`` (tokens)."""

    __slots__ = ("prefixes", "owners", "cross")

    def __init__(self) -> None:
        self.prefixes = Prefixes(0)
        self.owners: dict[int, dict[str, int]] = {}
        self.cross = 0

    @property
    def shared(self) -> int:
        """shared is the tokens the node's leases share, counted once (``Prefixes.shared``)."""
        return self.prefixes.shared if self.prefixes.refs else 0

    def _fits(self, block: int) -> bool:
        """_fits tells whether a request asked at ``block`` tokens a block shares here."""
        return block > 0 and (not self.prefixes.refs or self.prefixes.block == block)

    def credit(self, chain: Chain | None, block: int) -> int:
        """credit is what a request with ``chain``, asked at ``block``, is charged less here (tokens)."""
        if chain is None or not self._fits(block):
            return 0
        return self.prefixes.credit(bounded(chain))

    def taken(self, chain: Chain | None, block: int) -> int:
        """taken is how many leading keys of ``chain`` a lease admitted here adds (see the module doc)."""
        if chain is None or not self._fits(block):
            return 0
        chain = bounded(chain)
        run = self.prefixes.run(chain)
        if len(self.prefixes.refs) + len(chain.keys) - run <= MAX_NODE_KEYS:
            return len(chain.keys)
        return run

    def add(self, chain: Chain, block: int, owner: str) -> int:
        """add counts a lease of replica ``owner`` with ``chain`` (asked at ``block``); the keys it took."""
        k = self.taken(chain, block)
        if k == 0:
            return 0
        if not self.prefixes.refs:
            self.prefixes = Prefixes(block)
        kept = Chain(chain.keys[:k], chain.ends[:k])
        self.prefixes.add(kept)
        for key in kept.keys:
            holders = self.owners.setdefault(key, {})
            if owner not in holders and holders:
                self.cross += self.prefixes.refs[key][1]
            holders[owner] = holders.get(owner, 0) + 1
        return k

    def drop(self, keys: Iterable[int], owner: str) -> None:
        """drop stops counting a lease of ``owner`` whose taken keys were ``keys`` (in order)."""
        keys = tuple(keys)
        if not keys or not self.prefixes.refs:
            return
        refs = self.prefixes.refs
        for key in keys:
            holders = self.owners.get(key)
            if holders is None or owner not in holders:
                continue
            holders[owner] -= 1
            if holders[owner] <= 0:
                del holders[owner]
                if holders:
                    self.cross -= refs[key][1]
            if not holders:
                del self.owners[key]
        self.prefixes.drop(Chain(keys, (0,) * len(keys)))


def bounded(chain: Chain) -> Chain:
    """bounded is ``chain``'s first MAX_LINKS keys (what the shared ledger reads of it)."""
    if len(chain.keys) <= MAX_LINKS:
        return chain
    return Chain(chain.keys[:MAX_LINKS], chain.ends[:MAX_LINKS])
