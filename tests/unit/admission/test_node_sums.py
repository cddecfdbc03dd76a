"""A node's sums against a walk of its charges: what a pick reads without visiting the requests held."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission import rules
from extproc.admission.node import Charge, Node
from extproc.admission.nodes import PoolNodes
from extproc.admission.types import NodeReport
from tests.unit.admission.helpers import T0, config
from tests.unit.admission.test_nodes import CAP, nodes_pool


def walked(pool: PoolNodes, n: Node) -> int:
    """walked is what ``n``'s charges hold, each worked out anew with the lengths learned now
    (the rule itself, as the pick read it before the sums)."""
    q = pool.picking.quantile
    if pool.growth.pooled:
        moments = []
        for c in n.charges:
            known = pool.growth.lengths.get(c.class_name)
            learned = known is not None and len(known.sorted) >= pool.picking.min_samples
            lengths, prefix = known.view() if learned else (None, None)
            moments.append(rules.growth_moments(c.reserved, c.generated, lengths, prefix))
        return sum(c.footprint for c in n.charges) + rules.pooled_growth(moments, q)
    total = 0
    for c in n.charges:
        known = pool.growth.lengths.get(c.class_name)
        learned = (pool.picking.growth != "worst_case" and known is not None
                   and len(known.sorted) >= pool.picking.min_samples)
        total += rules.node_hold(c.prompt, c.reserved, c.generated, known.sorted if learned else None, q)
    return total


def counted(pool: PoolNodes, n: Node) -> int:
    """counted is what ``n``'s charges hold as each of them was last counted."""
    if pool.growth.pooled:
        return (sum(c.footprint for c in n.charges)
                + rules.pooled_growth([c.moments for c in n.charges if c.moments is not None],
                                      pool.picking.quantile))
    return sum(c.own for c in n.charges)


def up(growth: str, nodes: int = 2, **picking) -> PoolNodes:
    pool = PoolNodes(config(pool=nodes_pool(nodes, growth=growth, min_samples=3, **picking)).pools["default"], 3.0)
    for name in pool.nodes:
        pool.report(name, NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
    return pool


# One step on the pool: (what, request index, a number).
step = st.tuples(st.sampled_from(["pick", "progress", "release", "cancel", "move", "mark"]),
                 st.integers(0, 40), st.integers(0, 3_000))


@settings(max_examples=150, deadline=None)
@given(growth=st.sampled_from(["worst_case", "learned", "pooled"]), steps=st.lists(step, max_size=120))
def test_the_sums_are_the_walk_of_the_charges_whatever_comes_and_goes(growth, steps):
    pool = up(growth)
    held: list[Charge] = []
    for i, (what, k, x) in enumerate(steps):
        if what == "pick" or not held:
            c = pool.pick("standard" if x % 2 else "batch", 100 + x, 1 + x % 700, 1.0, T0 + i)
            if isinstance(c, Charge):
                held.append(c)
            continue
        c = held[k % len(held)]
        if what == "progress":
            pool.progress(c, c.generated + x % 50, T0 + i)
        elif what == "move":
            pool.move(c, f"127.0.0.1:{8001 + x % 2}")
        elif what == "mark":
            pool.mark(i, T0 + i)
        else:  # a release that teaches a length, or one cut short that teaches none
            held.remove(c)
            assert pool.release(c, x % 800, what == "release", T0 + i)
            assert not pool.release(c, x % 800, True, T0 + i)        # twice changes nothing
        for n in pool.nodes.values():
            assert n.footprints == sum(c.footprint for c in n.charges)
            assert pool.held(n) == counted(pool, n)
            if what == "mark":   # the lengths learned have reached every charge
                assert pool.held(n) == walked(pool, n)
    pool.relearn()
    for n in pool.nodes.values():
        assert pool.held(n) == walked(pool, n)
    for c in held:
        pool.release(c, None, False, T0 + len(steps))
    for n in pool.nodes.values():   # nothing left over, not even a float
        assert (n.footprints, n.owns, n.left, n.mean, n.var) == (0, 0, 0, 0.0, 0.0)


def test_a_length_learned_reaches_the_requests_held_at_the_next_mark_or_their_next_progress():
    pool = up("learned", nodes=1)           # quantile 0.9 of the lengths learned
    (n,) = pool.nodes.values()
    for _ in range(3):                      # min_samples: the class has learned 100
        c = pool.pick("standard", 10, 1_000, 1.0, T0)
        assert isinstance(c, Charge)
        pool.release(c, 100, True, T0)
    charges = [pool.pick("standard", 10, 1_000, 1.0, T0) for _ in range(10)]
    assert pool.held(n) == walked(pool, n) == 10 * (10 + 100)
    # One long request: 900 is now the 0.9 quantile. A new request is counted with it at
    # once, one that progresses from its progress, the others from the next mark.
    pool.release(charges.pop(), 900, True, T0)
    assert pool.held(n) == 9 * 110 < walked(pool, n) == 9 * 910
    pool.progress(charges[0], 1, T0)
    assert pool.held(n) == 8 * 110 + 910      # 10 + 1 generated + 899 to come
    new = pool.pick("standard", 10, 1_000, 1.0, T0)
    assert isinstance(new, Charge) and new.own == 910
    pool.mark(1, T0)
    assert pool.held(n) == walked(pool, n) == 10 * 910
    # Nothing learned since: the next mark walks nothing.
    before = [c.own for c in n.charges]
    pool.mark(2, T0)
    assert [c.own for c in n.charges] == before


@pytest.mark.parametrize("growth", ["learned", "pooled"])
def test_a_scrape_round_recounts_a_bounded_share_of_the_charges_held(growth, monkeypatch):
    """A round once recounted every charge held (81 ms with 20,000 held, on the event loop):
    now at most RECOUNT_PER_ROUND of them, the rest in the next rounds; a charge released
    meanwhile is passed over, and the sums stay those of the charges as last counted."""
    from extproc.admission import nodes as nodes_mod
    monkeypatch.setattr(nodes_mod, "RECOUNT_PER_ROUND", 4)
    pool = up(growth, nodes=2)
    for _ in range(3):                      # min_samples: the class has learned 100
        c = pool.pick("standard", 10, 1_000, 1.0, T0)
        assert isinstance(c, Charge)
        pool.release(c, 100, True, T0)
    charges = [pool.pick("standard", 10, 1_000, 1.0, T0) for _ in range(10)]
    pool.release(charges.pop(), 900, True, T0)      # a length that moves the quantile
    stale = lambda: sum(1 for c in charges if c.held and                     # noqa: E731
                        (c.own, c.moments) != pool.growth.expect(c.class_name, c.prompt, c.reserved, c.generated))
    assert stale() == 9
    pool.mark(1, T0)
    assert stale() == 5                     # four recounted
    waiting = next(c for c in charges if (c.own, c.moments) != pool.growth.expect(c.class_name, c.prompt, c.reserved, c.generated))
    pool.release(waiting, 5, False, T0)     # one still to recount goes (cut short: teaches nothing)
    pool.mark(2, T0)
    assert stale() <= 1                     # four more read (the released one passed over)
    pool.mark(3, T0)
    assert stale() == 0
    for n in pool.nodes.values():
        assert pool.held(n) == counted(pool, n) == walked(pool, n)
    assert not pool._recount and not pool.growth.taught


def test_with_worst_case_growth_the_lengths_learned_walk_nothing():
    pool = up("worst_case", nodes=1)
    (n,) = pool.nodes.values()
    c = pool.pick("standard", 10, 1_000, 1.0, T0)
    assert isinstance(c, Charge)
    pool.release(c, 100, True, T0)
    assert not pool.growth.taught and pool.growth.lengths["standard"].sorted == [100]   # kept for a reload


def test_a_reload_that_changes_the_growth_rule_counts_every_charge_again():
    pool = up("worst_case", nodes=1)
    (n,) = pool.nodes.values()
    for _ in range(3):
        c = pool.pick("standard", 10, 1_000, 1.0, T0)
        assert isinstance(c, Charge)
        pool.release(c, 50, True, T0)
    kept = [pool.pick("standard", 10, 1_000, 1.0, T0) for _ in range(5)]
    assert pool.held(n) == 5 * 1_010
    pool.reconfigure(config(pool=nodes_pool(1, growth="pooled", min_samples=3)).pools["default"], 3.0)
    assert pool.held(n) == walked(pool, n) < 5 * 1_010
    assert all(c.held for c in kept)


def test_the_view_pooled_growth_reads_follows_the_lengths_by_a_share_of_them():
    from extproc.admission.lengths import Lengths, VIEW_SHARE
    lengths = Lengths()
    for x in range(VIEW_SHARE - 1, 0, -1):      # few kept: the view follows every length
        lengths.add(x)
        assert lengths.view()[0] == lengths.sorted
    for x in range(10 * VIEW_SHARE - lengths.sorted.__len__()):
        lengths.add(1000 + x)
    view, (sums, squares) = lengths.view()
    assert view == lengths.sorted and len(view) == 10 * VIEW_SHARE
    assert (sums[-1], squares[-1]) == (sum(view), sum(v * v for v in view))
    for i in range(1, 12):
        lengths.add(5_000 + i)
        rebuilt = lengths.view()[0] == lengths.sorted
        # Rebuilt once the lengths learned since reach 1/VIEW_SHARE of those kept.
        assert rebuilt == (i * VIEW_SHARE >= 10 * VIEW_SHARE + i), i
        if rebuilt:
            break
    assert i == 11


def test_a_charge_moved_to_a_node_keeps_its_charges_oldest_first():
    pool = up("worst_case")
    a = pool.pick("standard", 10, 100, 1.0, T0)           # first node in turn
    assert isinstance(a, Charge)
    later = [pool.pick("standard", 10, 100, 1.0, T0 + i / 10) for i in range(1, 6)]
    other = next(n for n in pool.nodes.values() if n is not a.node)
    assert pool.move(a, other.address)
    ages = [c.admitted_at for c in other.charges]
    assert a in other.charges and ages == sorted(ages) and len(ages) == 1 + sum(c.node is other for c in later)


def test_an_early_round_marks_the_nodes_it_scrapes_alone():
    """An early round (``only``) marks the nodes it scrapes and no other: a node it does not
    scrape keeps the marks of its own rounds, and the early round recounts nothing."""
    pool = up("learned", nodes=2)
    c = pool.pick("standard", 10, 1_000, 1.0, T0)
    assert isinstance(c, Charge)
    scraped = c.node
    other = next(n for n in pool.nodes.values() if n is not scraped)
    pool.mark(1, T0)
    pool.mark(2, T0, only={scraped.name})
    assert list(scraped.marks) == [1, 2]
    assert list(other.marks) == [1]
