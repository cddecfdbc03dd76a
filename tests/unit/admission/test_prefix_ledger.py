"""A prompt prefix that kvgate's requests running on one node share is counted once there:
in its sums, in the rule's room, in a report's foreign KV, and never below what an engine
with prefix caching holds for them."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, Rejection, rules
from extproc.admission.sharing import Prefixes
from extproc.admission.types import NodeReport
from extproc.admission.types import Chain
from extproc.clock import ManualClock
from kvgate_testkit.admission import acquire_now
from tests.unit.admission.helpers import T0, config
from tests.unit.admission.test_nodes import CAP, nodes_pool, report

BLOCK = 16


def chain_of(pieces: list[tuple[str, int]]) -> Chain:
    """chain_of chains named pieces of given token lengths."""
    keys, ends, end, path = [], [], 0, ""
    for name, tokens in pieces:
        path += "/" + name
        end += tokens
        keys.append(int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little"))
        ends.append(end)
    return Chain(tuple(keys), tuple(ends))


SYSTEM = [("system", 10_000)]


def ask(prompt: int, completion: int, chain: Chain | None) -> Demand:
    return Demand(pool="default", tenant="t", class_name="standard", prompt_tokens=prompt,
                  reserved_completion=completion, prefix=chain)


def one_node(shared_prefix: bool = True) -> tuple[Admission, ManualClock]:
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1, shared_prefix=shared_prefix, block_tokens=BLOCK)), clock)
    report(adm, clock, {"n0": 0.0})
    return adm, clock


def test_a_second_request_with_the_same_prefix_is_charged_it_once_less_one_block():
    adm, _clock = one_node()
    a = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qa", 200)])))
    assert isinstance(a, Lease)
    assert adm.nodes("default")[0].held_tokens == 11_000
    b = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qb", 200)])))
    assert isinstance(b, Lease)
    node = adm.nodes("default")[0]
    # 10,000 tokens shared: 625 whole blocks of 16, one block less for the ends' error.
    assert node.shared_tokens == 10_000 - BLOCK
    assert node.held_tokens == 22_000 - (10_000 - BLOCK)
    assert node.headroom_tokens == CAP - node.held_tokens


def test_off_by_default_and_off_it_charges_every_prompt_whole():
    adm, _clock = one_node(shared_prefix=False)
    for q in ("qa", "qb"):
        assert isinstance(acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, (q, 200)]))), Lease)
    node = adm.nodes("default")[0]
    assert node.shared_tokens == 0 and node.held_tokens == 22_000
    assert config(pool=nodes_pool(1)).pools["default"].picking.shared_prefix is False


def test_a_prefix_shared_only_with_a_request_that_ended_is_charged_again():
    adm, _clock = one_node()
    a = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qa", 200)])))
    b = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qb", 200)])))
    assert isinstance(a, Lease) and isinstance(b, Lease)
    a.release(Outcome.COMPLETED, 800)
    node = adm.nodes("default")[0]
    assert node.shared_tokens == 0 and node.held_tokens == 11_000   # the engine may have evicted it
    c = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qc", 200)])))
    assert isinstance(c, Lease)
    assert adm.nodes("default")[0].shared_tokens == 10_000 - BLOCK   # shared with b, running


def test_a_node_full_for_whole_prompts_takes_requests_that_share_its_prefix():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1, shared_prefix=True, block_tokens=BLOCK)), clock)
    report(adm, clock, {"n0": 0.0})
    taken = [acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, (f"q{i}", 200)]))) for i in range(12)]
    assert all(isinstance(t, Lease) for t in taken)    # 12 x 11,000 = 132k whole, ~42k once
    unique = acquire_now(adm, ask(10_200, 800, chain_of([("other", 10_000), ("q", 200)])))
    assert isinstance(unique, Lease)
    node = adm.nodes("default")[0]
    assert node.held_tokens == 13 * 11_000 - 11 * (10_000 - BLOCK)
    # Without sharing the ninth whole prompt is refused.
    adm2, _ = one_node(shared_prefix=False)
    got = [acquire_now(adm2, ask(10_200, 800, chain_of([*SYSTEM, (f"q{i}", 200)]))) for i in range(10)]
    assert [isinstance(g, Lease) for g in got].count(True) == 9


def test_a_node_that_reports_its_block_size_is_counted_in_its_blocks():
    adm, clock = one_node()
    for q in ("qa", "qb"):
        assert isinstance(acquire_now(adm, ask(10_200, 800, chain_of([("system", 10_100), (q, 100)]))), Lease)
    assert adm.nodes("default")[0].shared_tokens == 10_096 - BLOCK      # whole blocks of 16
    adm.report_node("default", "n0", NodeReport(kv_usage=0.2, capacity_tokens=CAP, at=clock.now(),
                                                 block_tokens=512))
    assert adm.nodes("default")[0].shared_tokens == 9_728 - 512          # whole blocks of 512


def test_a_report_subtracts_a_shared_prefix_once():
    adm, clock = one_node()
    leases = [acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, (f"q{i}", 200)]))) for i in range(3)]
    for lease in leases:
        assert isinstance(lease, Lease)
        lease.progress(1)
    clock.advance(1)
    adm.mark_nodes(1)
    # The engine holds the prefix once: 10,000 + 3 x (200 + 1) tokens, plus 5,000 foreign.
    used = 10_000 + 3 * 201 + 5_000
    report(adm, clock, {"n0": used / CAP}, mark=1)
    node = adm.nodes("default")[0]
    # Subtracted: the three footprints less what two of them share (one block less each).
    assert node.foreign_tokens == used - (3 * 10_201 - 2 * (10_000 - BLOCK))
    assert 5_000 - 2 * BLOCK <= node.foreign_tokens <= 5_000


def test_what_a_report_subtracted_of_a_sharing_request_that_ends_stays_counted_until_the_next():
    """The report subtracts a request sharing a prefix its prompt less the credit, a block less
    than the blocks the engine shares: foreign KV reads low by that block, which the sharing
    covers only while the request is held."""
    adm, clock = one_node()
    a, b = (acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, (q, 200)]))) for q in ("qa", "qb"))
    assert isinstance(a, Lease) and isinstance(b, Lease)
    a.progress(1)
    b.progress(1)
    adm.mark_nodes(1)
    used = 10_000 + 2 * 201 + 30_000                   # the prefix once, and 30k the node's own
    report(adm, clock, {"n0": used / CAP}, mark=1)
    assert adm.nodes("default")[0].foreign_tokens == 30_000 - BLOCK
    b.release(Outcome.COMPLETED, 1)
    node = adm.nodes("default")[0]
    # Still counted: what the report took of b (its 10,201 less its credit, 10,000 - 16).
    assert node.foreign_tokens == 30_000 - BLOCK + 10_201 - (10_000 - BLOCK)
    clock.advance(1)
    report(adm, clock, {"n0": (10_201 + 30_000) / CAP})  # the next report: a alone
    assert adm.nodes("default")[0].foreign_tokens == 40_201   # no mark: a counted twice


# --- the engine's truth, whatever the order ---------------------------------------------

# A small trie of pieces: a system prompt most requests share, two conversations below it.
TRIE = {
    "sys": (None, 3_000), "docA": ("sys", 2_000), "docB": ("sys", 1_500),
    "turnA1": ("docA", 700), "turnA2": ("turnA1", 450), "turnB1": ("docB", 333),
    "other": (None, 2_500), "otherQ": ("other", 90),
}
LEAVES = list(TRIE)


def path_to(leaf: str, trie: dict[str, tuple[str | None, int]] = TRIE) -> list[str]:
    """path_to is the pieces of the prompt that ends with piece ``leaf`` of ``trie``, first first."""
    path: list[str] = []
    at: str | None = leaf
    while at is not None:
        path.append(at)
        at = trie[at][0]
    return path[::-1]


def engine_tokens(running: list[tuple[list[str], int]], block: int) -> int:
    """engine_tokens is what an engine with prefix caching holds for ``running`` (each the
    path of pieces of its prompt, then its own tokens): one copy of every whole block whose
    tokens, and every token before them, are the same; a request's other tokens its own."""
    blocks: set[tuple[tuple[str, ...], int]] = set()
    own = 0
    for path, tail in running:
        ends, end = [], 0
        for name in path:
            end += TRIE[name][1]
            ends.append(end)
        whole = end // block    # the block holding the prompt's end and its tail is its own
        for j in range(whole):
            upto = (j + 1) * block
            # the pieces the block and every token before it come from
            names = tuple(name for name, e, s in zip(path, ends, [0, *ends]) if s < upto)
            blocks.add((names, j))
        own += end + tail - whole * block
    return len(blocks) * block + own


def kvgate_chain(path: list[str], error: dict[str, int], block: int) -> Chain:
    """kvgate_chain is kvgate's chain of a prompt whose ends its count places up to a block off
    (the same text, the same error)."""
    keys, ends, end, at = [], [], 0, ""
    for name in path:
        at += "/" + name
        end += TRIE[name][1]
        keys.append(int.from_bytes(hashlib.blake2b(at.encode(), digest_size=8).digest(), "little"))
        ends.append(max(0, end + max(-(block - 1), min(block - 1, error.get(name, 0)))))
    return Chain(tuple(keys), tuple(ends))


op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(LEAVES), st.integers(1, 500)),
    st.tuples(st.just("end"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=60), block=st.sampled_from([16, 32, 256]),
       error=st.dictionaries(st.sampled_from(LEAVES), st.integers(-255, 255)))
def test_charged_kv_is_never_below_what_the_engine_holds_for_kvgate(ops, block, error):
    ledger = Prefixes(block)
    running: list[tuple[list[str], int, Chain]] = []
    footprints = 0
    for kind, a, b in ops:
        if kind == "admit":
            path = path_to(a)
            chain = kvgate_chain(path, error, block)
            credit = ledger.credit(chain)
            before = ledger.shared
            ledger.add(chain)
            assert ledger.shared - before == credit     # what a pick was told is what is counted
            running.append((path, b, chain))
            footprints += sum(TRIE[n][1] for n in path) + b
        elif running:
            path, tail, chain = running.pop(a % len(running))
            ledger.drop(chain)
            footprints -= sum(TRIE[n][1] for n in path) + tail
        truth = engine_tokens([(p, t) for p, t, _ in running], block)
        assert footprints - ledger.shared >= truth
        if not running:
            assert ledger.refs == {} and ledger.shared == 0


def test_the_ledger_credits_nearly_all_the_engine_shares():
    """Not only safe: with exact ends a prefix shared by n requests is counted once, less a
    block for each of the n - 1."""
    ledger = Prefixes(16)
    for _ in range(5):
        ledger.add(kvgate_chain(path_to("turnA2"), {}, 16))
    shared_tokens = sum(TRIE[n][1] for n in path_to("turnA2"))
    assert ledger.shared == 4 * (shared_tokens - shared_tokens % 16 - 16)


def two_nodes(**picking) -> Admission:
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(2, shared_prefix=True, block_tokens=BLOCK, **picking)), clock)
    report(adm, clock, {"n0": 0.0, "n1": 0.0})
    return adm


def test_a_request_goes_where_its_prefix_runs_unless_affinity_is_off():
    adm = two_nodes()
    a = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qa", 200)])))
    b = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("qb", 200)])))
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert b.node == a.node      # the idle node has more room: the prefix won
    by_node = {n.address: n for n in adm.nodes("default")}
    assert by_node[a.node].affinity_picks == 1 and by_node[a.node].shared_tokens == 10_000 - BLOCK
    off = two_nodes(prefix_affinity=0.0)
    a = acquire_now(off, ask(10_200, 800, chain_of([*SYSTEM, ("qa", 200)])))
    b = acquire_now(off, ask(10_200, 800, chain_of([*SYSTEM, ("qb", 200)])))
    assert isinstance(a, Lease) and isinstance(b, Lease) and b.node != a.node


def test_a_hot_prefix_does_not_pile_onto_one_node():
    adm = two_nodes()
    leases = [acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, (f"q{i}", 200)]))) for i in range(24)]
    assert all(isinstance(x, Lease) for x in leases)
    counts = {n.name: n.requests for n in adm.nodes("default")}
    # Each node holds the prefix once and takes its share: neither takes them all.
    assert min(counts.values()) >= 8, counts
    assert all(n.shared_tokens > 0 for n in adm.nodes("default"))


def test_affinity_never_fits_a_request_where_it_does_not_fit():
    adm = two_nodes()
    big = acquire_now(adm, ask(80_000, 9_000, chain_of([("big", 80_000)])))
    assert isinstance(big, Lease)
    # Shares 80k with the request on that node, but fits there only by its credit: it does,
    # once; a request sharing nothing of it goes to the other node.
    same = acquire_now(adm, ask(80_000, 9_000, chain_of([("big", 80_000)])))
    assert isinstance(same, Lease) and same.node == big.node
    other = acquire_now(adm, ask(80_000, 9_000, chain_of([("else", 80_000)])))
    assert isinstance(other, Lease) and other.node != big.node
    assert isinstance(acquire_now(adm, ask(80_000, 9_000, chain_of([("third", 80_000)]))), Rejection)


def test_with_the_redis_store_check_config_no_longer_warns_about_sharing():
    from extproc.configparse import parse_config, warnings
    raw = {"pools": {"default": nodes_pool(1, shared_prefix=True)},
           "store": {"redis": {"url": "redis://127.0.0.1:6379/0", "expected_replicas": 2}}}
    assert not any("shared_prefix" in w for w in warnings(parse_config(raw)))


def test_a_request_a_shared_store_admitted_keeps_its_chain_here():
    """The store counts the sharing of every replica's leases; this replica's ledger counts its
    own (its marks subtract its requests' shared blocks once), with the store's credit."""
    from extproc.admission.nodes import PoolNodes
    pool = PoolNodes(config(pool=nodes_pool(1, shared_prefix=True, block_tokens=BLOCK)).pools["default"], 3.0)
    for q in ("qa", "qb"):
        c = pool.charge("n0", "standard", 10_200, 800, T0, chain_of([*SYSTEM, (q, 200)]), 10_000 - BLOCK, True)
        assert c is not None and c.chain is not None
    (snap,) = pool.snapshot(T0)
    assert snap.shared_tokens == 10_000 - BLOCK and snap.inflight_tokens == 20_400
    assert snap.credit_tokens == 2 * (10_000 - BLOCK) and snap.affinity_picks == 2
    off = PoolNodes(config(pool=nodes_pool(1)).pools["default"], 3.0)
    c = off.charge("n0", "standard", 10_200, 800, T0, chain_of([*SYSTEM, ("qa", 200)]))
    assert c is not None and c.chain is None


def test_a_request_goes_where_its_prefix_ended_a_moment_ago_but_is_not_credited_for_it():
    adm = two_nodes()
    first = acquire_now(adm, ask(10_200, 800, chain_of([*SYSTEM, ("turn1", 200)])))
    assert isinstance(first, Lease)
    first.release(Outcome.COMPLETED, 800)
    # The next turn of that conversation: both nodes idle, the one that served turn 1 may
    # still cache its prefix (placement), but it is charged whole (it may be evicted).
    for _ in range(3):   # whatever the turn order would say
        nxt = acquire_now(adm, ask(10_500, 800, chain_of([*SYSTEM, ("turn1", 200), ("turn2", 300)])))
        assert isinstance(nxt, Lease) and nxt.node == first.node
        by_node = {n.address: n for n in adm.nodes("default")}
        assert by_node[nxt.node].shared_tokens == 0 and by_node[nxt.node].held_tokens == 11_300
        nxt.release(Outcome.COMPLETED, 800)
    off = two_nodes(prefix_affinity=0.0)
    a = acquire_now(off, ask(10_200, 800, chain_of([*SYSTEM, ("turn1", 200)])))
    assert isinstance(a, Lease)
    a.release(Outcome.COMPLETED, 800)
    b = acquire_now(off, ask(10_500, 800, chain_of([*SYSTEM, ("turn1", 200), ("turn2", 300)])))
    assert isinstance(b, Lease) and b.node != a.node      # in turn, blind to the cache


@pytest.mark.parametrize("keep", [40, 0])
def test_the_record_of_ended_prefixes_is_bounded_by_its_configured_size(keep: int) -> None:
    from extproc.admission.nodes import PoolNodes
    from extproc.admission.types import NodeReport
    pool = PoolNodes(config(pool=nodes_pool(1, shared_prefix=True, prefix_record_keys=keep)).pools["default"], 3.0)
    pool.report("n0", NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
    for i in range(30):
        c = pool.pick("standard", 300, 10, 1.0, T0, chain=chain_of([(f"u{i}", 100), ("q", 200)]))
        assert not isinstance(c, rules.NodePass)
        pool.release(c, 10, True, T0)
    (node,) = pool.nodes.values()
    assert len(node.recent) == keep                                       # two keys a request
    assert node.cached(chain_of([("u0", 100), ("q", 200)])) == 0          # the oldest went first
    assert node.cached(chain_of([("u29", 100), ("q", 200)])) == (288 if keep else 0)  # whole blocks of 16