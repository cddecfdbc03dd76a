"""The per-node rule and ledgers of a pool that picks nodes, at fixed instants of a manual clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.admission import Admission, Demand, Lease, Outcome, Reason, Rejection
from extproc.admission import rules, shared_nodes
from extproc.admission.node import Charge, NodeState
from extproc.admission.nodes import PoolNodes
from extproc.admission.types import NodeReport
from extproc.clock import ManualClock
from extproc.errors import ConfigError
from kvgate_testkit.admission import acquire_now
from tests.unit.admission.helpers import T0, config, no_jitter

CAP = 100_000


def nodes_pool(n: int = 3, growth: str = "worst_case", reserve: float = 0.0, **picking) -> dict:
    return {
        "max_concurrency": 1000,
        "backends": [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}",
                      "address": f"127.0.0.1:{8001 + i}", "kv_capacity_tokens": CAP}
                     for i in range(n)],
        "picking": {"growth": growth, "reserve_fraction": reserve, **picking},
    }


def report(adm: Admission, clock: ManualClock, usage: dict[str, float], mark: int | None = None,
           refused: tuple[str, ...] = (), waiting: int | None = None, running: int | None = None) -> None:
    for name, u in usage.items():
        adm.report_node("default", name, NodeReport(kv_usage=u, capacity_tokens=CAP, at=clock.now(),
                                                    refused=name in refused, mark=mark,
                                                    waiting=waiting, running=running))


def demand(prompt: int, completion: int, class_name: str = "standard") -> Demand:
    return Demand(pool="default", tenant="t", class_name=class_name, prompt_tokens=prompt,
                  reserved_completion=completion)


# --- the pure rule ------------------------------------------------------------------------

@pytest.mark.parametrize(("reserved", "generated", "lengths", "q", "want"), [
    (1000, 0, None, 0.9, 1000),                       # worst case: the whole reservation
    (1000, 400, None, 0.9, 600),
    (1000, 1000, None, 0.9, 0),
    (1000, 0, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 0.9, 90),
    (1000, 0, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 1.0, 100),
    (1000, 55, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 0.5, 25),   # above 55: 60..100, median 80
    (1000, 100, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 0.9, 900),  # longer than all: worst case
    (50, 0, [100, 200, 300], 0.9, 50),               # never above the reservation
])
def test_expected_growth(reserved, generated, lengths, q, want):
    assert rules.expected_growth(reserved, generated, lengths, q) == want


def test_pick_node_takes_the_most_room_and_says_why_others_were_passed():
    cands = [("a", CAP, 90_000, 0), ("b", CAP, 0, 50_000), ("c", CAP, 0, 10_000)]
    v = rules.pick_node(cands, 20_000, 0.0, 1.0)
    assert v.chosen == "c" and v.passed == [("a", "no_room")] and v.best_room == 90_000
    v = rules.pick_node(cands, 95_000, 0.0, 1.0)
    assert v.chosen is None and {n for n, _ in v.passed} == {"a", "b", "c"}
    # A class that may fill 50% of a node: b (50k held) is out by its watermark, c fits.
    v = rules.pick_node(cands, 30_000, 0.0, 0.5)
    assert v.chosen == "c" and ("b", "class_watermark") in v.passed


# --- counting a request once, before and after the node reports it -------------------------

def test_a_request_counts_once_before_and_after_it_is_in_the_report():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.10})                       # 10k foreign, nothing of ours
    (node,) = adm.nodes("default")
    assert node.foreign_tokens == 10_000 and node.headroom_tokens == 90_000
    lease = acquire_now(adm, demand(20_000, 10_000))
    assert isinstance(lease, Lease) and lease.node == "127.0.0.1:8001"
    assert adm.nodes("default")[0].headroom_tokens == 60_000   # counted before any report
    lease.progress(1)                                       # first token: surely in the cache now
    clock.advance(1)
    adm.mark_nodes(1)
    report(adm, clock, {"n0": 0.30 + 1e-5}, mark=1)         # the node now shows it (20k + 1)
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 10_000                    # ...and it is not counted twice
    assert node.headroom_tokens == 60_000
    # Without a mark the report subtracts nothing: the request is counted twice (safe side).
    clock.advance(1)
    report(adm, clock, {"n0": 0.30 + 1e-5})
    assert adm.nodes("default")[0].foreign_tokens == 30_001


def test_a_request_without_its_first_token_at_the_mark_is_not_subtracted():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.0})
    lease = acquire_now(adm, demand(20_000, 0))
    assert isinstance(lease, Lease)
    adm.mark_nodes(1)
    lease.progress(1)                                       # after the mark: maybe not in the report
    report(adm, clock, {"n0": 0.2}, mark=1)
    assert adm.nodes("default")[0].foreign_tokens == 20_000


def test_a_request_never_streamed_counts_once_when_settled_on_a_node_that_queues_nothing():
    """A response that is not streamed shows no token before its end: once held longer than
    recent requests typically took to their first token, on a node that queues nothing, it
    is in the cache, and is subtracted from the report like a request whose first token was
    seen."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.0}, waiting=0)
    first = acquire_now(adm, demand(20_000, 0))
    assert isinstance(first, Lease)
    clock.advance(0.5)
    adm.mark_nodes(1)                                       # no first token seen yet in the pool
    report(adm, clock, {"n0": 0.2}, mark=1, waiting=0)
    assert adm.nodes("default")[0].foreign_tokens == 20_000  # nothing says it is prefilled
    first.release(Outcome.COMPLETED, 100)
    report(adm, clock, {"n0": 0.0}, waiting=0)
    slow = acquire_now(adm, demand(1_000, 0))                # its stream lags: 2.5 s to a token
    chats = [acquire_now(adm, demand(1_000, 0)) for _ in range(2)]
    assert isinstance(slow, Lease) and all(isinstance(c, Lease) for c in chats)
    clock.advance(0.3)
    for chat in chats:
        chat.progress(1)                                    # prefilled 0.3 s after admission
        chat.release(Outcome.COMPLETED, 1)
    clock.advance(2.2)
    slow.progress(1)
    slow.release(Outcome.COMPLETED, 1)                      # the typical request took 0.3 s
    report(adm, clock, {"n0": 0.0}, waiting=0)
    document = acquire_now(adm, demand(20_000, 0))
    assert isinstance(document, Lease)
    clock.advance(1.0)                                      # older than 0.3 s, younger than 2.5 s
    late = acquire_now(adm, demand(5_000, 0))                # admitted 0.1 s before the mark
    assert isinstance(late, Lease)
    clock.advance(0.1)
    adm.mark_nodes(2)
    report(adm, clock, {"n0": 0.2}, mark=2, waiting=1)      # the node queues: maybe not in yet
    assert adm.nodes("default")[0].foreign_tokens == 20_000
    adm.mark_nodes(3)
    report(adm, clock, {"n0": 0.2}, mark=3, waiting=0)      # the document is counted once
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 0
    assert node.headroom_tokens == CAP - 20_000 - 5_000
    adm.mark_nodes(4)
    report(adm, clock, {"n0": 0.2}, mark=4)                 # queue not reported: not subtracted
    assert adm.nodes("default")[0].foreign_tokens == 20_000


def test_a_request_released_before_its_report_arrives_is_not_subtracted():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.1})
    lease = acquire_now(adm, demand(20_000, 0))
    lease.progress(1)
    adm.mark_nodes(1)
    lease.release(Outcome.COMPLETED, 1)                     # gone, maybe before the node rendered
    report(adm, clock, {"n0": 0.1}, mark=1)                 # it had: nothing to subtract
    assert adm.nodes("default")[0].foreign_tokens == 10_000


def test_what_a_report_subtracted_of_a_request_that_ends_stays_counted_until_the_next_report():
    """The node may have ended a request (its stop token) before it rendered its report, while
    kvgate sees its end after the report (a slow client holds the stream): the report's
    foreign KV reads low by its footprint, which its hold covers only while it is held."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.30})                       # 30k foreign
    lease = acquire_now(adm, demand(20_000, 1_000))
    assert isinstance(lease, Lease)
    lease.progress(1)
    adm.mark_nodes(1)
    report(adm, clock, {"n0": 0.30}, mark=1)               # ended: not among the node's 30k
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 30_000 - 20_001 and node.headroom_tokens == CAP - 30_000 - 999
    lease.release(Outcome.COMPLETED, 1)
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 30_000 and node.headroom_tokens == CAP - 30_000
    clock.advance(1)
    adm.mark_nodes(2)
    report(adm, clock, {"n0": 0.20}, mark=2)               # the next report alone counts
    assert adm.nodes("default")[0].foreign_tokens == 20_000


def test_a_request_that_generated_its_whole_reservation_is_not_subtracted():
    """An engine ends a request at its max_tokens and frees its blocks at once: once kvgate
    has seen that many tokens the node no longer holds it, whenever its end reaches kvgate."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.30})
    done, running = acquire_now(adm, demand(20_000, 2)), acquire_now(adm, demand(10_000, 3))
    assert isinstance(done, Lease) and isinstance(running, Lease)
    done.progress(2)
    running.progress(2)
    adm.mark_nodes(1)
    report(adm, clock, {"n0": (40_002 - 0.5) / CAP}, mark=1)  # 30k foreign and the running one
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 30_000
    assert node.headroom_tokens == CAP - 30_000 - 20_002 - 10_003


def test_foreign_kv_on_the_rise_keeps_its_last_rise_free_until_it_stops():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.0})
    clock.advance(1)
    report(adm, clock, {"n0": 0.10})                       # others took 10k in one interval...
    (node,) = adm.nodes("default")
    assert node.foreign_tokens == 10_000
    assert node.headroom_tokens == 80_000                  # ...and may take 10k more by the next
    assert isinstance(acquire_now(adm, demand(80_001, 0)), Rejection)
    clock.advance(1)
    report(adm, clock, {"n0": 0.10})                       # it stopped: only what they hold counts
    assert adm.nodes("default")[0].headroom_tokens == 90_000
    clock.advance(1)
    report(adm, clock, {"n0": 0.04})                       # a fall frees room at once
    assert adm.nodes("default")[0].headroom_tokens == 96_000


def one_node_held_for(clock: ManualClock, seconds: float) -> Admission:
    """one_node_held_for is a one-node pool whose requests hold the node ``seconds`` (one
    admitted and ended), the node reported empty before and after."""
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.0})
    lease = acquire_now(adm, demand(1_000, 0))
    clock.advance(seconds)
    lease.release(Outcome.COMPLETED, 0)
    report(adm, clock, {"n0": 0.0})
    return adm


def test_a_rise_is_projected_over_the_time_kvgates_requests_hold_a_node():
    clock = ManualClock(T0)
    adm = one_node_held_for(clock, 4.0)
    clock.advance(2.0)
    report(adm, clock, {"n0": 0.05})                       # others: +5k in 2 s...
    assert adm.nodes("default")[0].headroom_tokens == CAP - 5_000 - 10_000   # ...and 10k more in 4 s
    clock.advance(0.5)
    report(adm, clock, {"n0": 0.10})                       # +5k in 0.5 s: 40k more in 4 s
    assert adm.nodes("default")[0].headroom_tokens == CAP - 10_000 - 40_000
    assert isinstance(acquire_now(adm, demand(50_001, 0)), Rejection)


def test_a_rise_in_steps_stays_projected_through_a_report_between_two_steps():
    """Load that rises in steps 1 s apart, read every second: a report may fall between two
    steps and show no growth. Its rise over the last hold time still keeps the node's room
    free, until the load has held still for a whole hold time."""
    clock = ManualClock(T0)
    adm = one_node_held_for(clock, 4.0)
    clock.advance(1.0)
    report(adm, clock, {"n0": 0.10})                       # a first step: +10k in 1 s
    assert adm.nodes("default")[0].headroom_tokens == CAP - 10_000 - 40_000
    clock.advance(1.0)
    report(adm, clock, {"n0": 0.10})                       # between two steps: flat for 1 s...
    assert adm.nodes("default")[0].headroom_tokens == CAP - 10_000 - 20_000   # 10k in 2 s, 4 s on
    assert isinstance(acquire_now(adm, demand(70_001, 0)), Rejection)
    for _ in range(4):
        clock.advance(1.0)
        report(adm, clock, {"n0": 0.10})
    assert adm.nodes("default")[0].headroom_tokens == CAP - 10_000   # still for 4 s: it stopped


def test_a_rise_read_a_while_ago_is_projected_from_its_report_not_from_now():
    clock = ManualClock(T0)
    adm = one_node_held_for(clock, 4.0)
    clock.advance(2.0)
    report(adm, clock, {"n0": 0.05})                       # others: +5k in 2 s
    assert adm.nodes("default")[0].headroom_tokens == CAP - 5_000 - 10_000
    clock.advance(1.0)                                      # no report since: 1 s more to rise,
    assert adm.nodes("default")[0].headroom_tokens == CAP - 5_000 - 12_500   # 5 s ahead in all
    assert isinstance(acquire_now(adm, demand(82_501, 0)), Rejection)
    assert isinstance(acquire_now(adm, demand(82_500, 0)), Lease)


def test_a_rise_of_kvgates_own_requests_in_the_report_is_no_foreign_rise():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.0})
    lease = acquire_now(adm, demand(20_000, 2))  # one token of two: still running at the mark
    assert isinstance(lease, Lease)
    clock.advance(1)
    report(adm, clock, {"n0": 0.20})         # no mark: the node shows it, kvgate cannot subtract it
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 20_000     # counted twice until the next mark (safe side)...
    assert node.headroom_tokens == 59_998    # ...but not projected on top as a rise of others
    lease.progress(1)
    adm.mark_nodes(1)
    clock.advance(1)
    report(adm, clock, {"n0": 0.20}, mark=1)  # subtracted now: the floor drop is no rise either
    assert adm.nodes("default")[0].headroom_tokens == CAP - 20_002
    lease.release(Outcome.COMPLETED, 0)
    clock.advance(1)
    report(adm, clock, {"n0": 0.0}, mark=None)
    assert adm.nodes("default")[0].headroom_tokens == 100_000


@pytest.mark.parametrize("running", [1, 2])
def test_the_nodes_running_count_tells_a_foreign_step_from_a_request_entering_the_cache(running):
    """The same report either way: usage 50k with 25k subtracted. Either the request kvgate
    admitted just before the report (25k, not yet subtracted) is in the cache, or it is not
    and others took 25k. Only the node's running count tells which."""
    clock = ManualClock(T0)
    adm = one_node_held_for(clock, 4.0)                    # requests hold the node 4 s
    a = acquire_now(adm, demand(24_999, 100))
    assert isinstance(a, Lease)
    clock.advance(1.0)
    a.progress(1)                                          # in the cache: 25k
    adm.mark_nodes(1)
    report(adm, clock, {"n0": 0.25}, mark=1, waiting=0, running=1)
    x = acquire_now(adm, demand(25_000, 0))                 # admitted just before the next report
    assert isinstance(x, Lease)
    adm.mark_nodes(2)
    clock.advance(1.0)
    report(adm, clock, {"n0": 0.50}, mark=2, waiting=0, running=running)
    (node,) = adm.nodes("default")
    assert node.foreign_tokens == 25_000
    held = (25_000 + 99) + 25_000                          # both requests, growth to come included
    if running == 2:   # the request is in the cache: kvgate's own, no rise
        assert node.headroom_tokens == CAP - 25_000 - held
    else:              # it is not: others took 25k in 1 s, and may take 25k a second for 4 s more
        assert node.headroom_tokens == CAP - (25_000 + 100_000) - held
        assert isinstance(acquire_now(adm, demand(1_000, 0)), Rejection)


@settings(max_examples=150, deadline=None)
@example(foreign=10_000, ops=[("admit", 20_000, 0), ("first", 0, 0), ("mark", 0, 0), ("end", 0, 0),
                              ("render", 0, 0), ("apply", 0, 0)])
@example(foreign=10_000, ops=[("admit", 20_000, 0), ("mark", 0, 0), ("first", 0, 0),
                              ("render", 0, 0), ("apply", 0, 0)])
@given(foreign=st.integers(0, 60_000),
       ops=st.lists(st.tuples(st.sampled_from(["admit", "first", "gen", "end", "mark", "render",
                                               "apply"]),
                              st.integers(1, 40_000), st.integers(0, 30_000)), max_size=60))
def test_worst_case_growth_never_admits_past_capacity(foreign, ops):
    """With the node's own KV constant, what it holds plus every admitted request's worst
    case stays within its capacity, whatever the order of admissions, first tokens, ends,
    marks, renderings of its metrics and their arrival."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    leases: list[Lease] = []
    in_engine: set[int] = set()          # requests whose KV the engine holds
    generated: dict[int, int] = {}

    def engine_usage() -> float:
        used = foreign + sum(leases[i].demand.prompt_tokens + generated[i] for i in in_engine)
        return min(1.0, used / CAP)

    report(adm, clock, {"n0": engine_usage()})
    mark = 0
    rendered: tuple[float, int] | None = None
    for op, a, b in ops:
        clock.advance(0.01)
        live = [i for i, x in enumerate(leases) if not x.released]
        if op == "admit":
            got = acquire_now(adm, demand(a, b))
            if isinstance(got, Lease):
                leases.append(got)
                generated[len(leases) - 1] = 0
                held = foreign + sum(x.demand.prompt_tokens + x.demand.reserved_completion
                                     for x in leases if not x.released)
                assert held <= CAP
        elif op == "first" and live:
            i = live[a % len(live)]
            in_engine.add(i)
            generated[i] = max(generated[i], 1)
            leases[i].progress(generated[i])
        elif op == "gen" and live:
            i = live[a % len(live)]
            if i in in_engine:
                generated[i] = min(leases[i].demand.reserved_completion, generated[i] + b)
                leases[i].progress(generated[i])
        elif op == "end" and live:
            i = live[a % len(live)]
            in_engine.discard(i)
            leases[i].release(Outcome.COMPLETED, generated[i])
        elif op == "mark":
            mark += 1
            adm.mark_nodes(mark)
            rendered = None
        elif op == "render" and mark:
            rendered = (engine_usage(), mark)
        elif op == "apply" and rendered is not None:
            report(adm, clock, {"n0": rendered[0]}, mark=rendered[1])
            rendered = None
        assert adm.nodes("default")[0].foreign_tokens >= foreign or mark == 0 or math.isclose(
            adm.nodes("default")[0].foreign_tokens, foreign, abs_tol=1)


# --- picking through the controller -----------------------------------------------------------

def test_requests_spread_over_the_nodes_with_room_and_wait_for_one_when_none_has():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(3)), clock)
    report(adm, clock, {"n0": 0.0, "n1": 0.0, "n2": 0.0})
    got = [acquire_now(adm, demand(29_000, 1_000)) for _ in range(9)]
    assert all(isinstance(x, Lease) for x in got)
    assert sorted(x.node for x in got) == ["127.0.0.1:8001"] * 3 + ["127.0.0.1:8002"] * 3 + \
        ["127.0.0.1:8003"] * 3
    r = acquire_now(adm, demand(29_000, 1_000))
    assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET and r.retryable
    assert "No node of pool 'default' has room" in r.message
    got[4].release(Outcome.COMPLETED, 1_000)
    again = acquire_now(adm, demand(29_000, 1_000))
    assert isinstance(again, Lease) and again.node == got[4].node


def test_kv_the_node_holds_for_others_keeps_requests_away_from_it():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(3)), clock)
    report(adm, clock, {"n0": 0.92, "n1": 0.0, "n2": 0.0})
    got = [acquire_now(adm, demand(20_000, 1_000)) for _ in range(8)]
    assert all(isinstance(x, Lease) for x in got)
    assert "127.0.0.1:8001" not in {x.node for x in got}
    snaps = {n.name: n for n in adm.nodes("default")}
    assert snaps["n0"].passed_over["no_room"] == 8 and snaps["n0"].picks == 0


def test_a_stale_pending_or_refused_node_is_not_picked():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(3)), clock)
    report(adm, clock, {"n0": 0.0, "n1": 0.0})                 # n2 never reported: pending
    clock.advance(2.0)
    report(adm, clock, {"n1": 0.0}, refused=("n1",))          # n1 refuses connections: down
    states = {n.name: n.state for n in adm.nodes("default")}
    assert states == {"n0": NodeState.UP, "n1": NodeState.DOWN, "n2": NodeState.PENDING}
    assert acquire_now(adm, demand(1_000, 100)).node == "127.0.0.1:8001"
    clock.advance(1.5)                                         # n0's report is 3.5 s old: stale
    r = acquire_now(adm, demand(1_000, 100))
    assert isinstance(r, Rejection) and r.retryable


def test_a_request_larger_than_every_node_never_fits():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(2, reserve=0.1)), clock)
    report(adm, clock, {"n0": 0.0, "n1": 0.0})
    r = acquire_now(adm, demand(85_000, 6_000))
    assert isinstance(r, Rejection) and not r.retryable and "largest node" in r.message


def test_release_frees_the_node_once_and_learned_growth_admits_more_than_the_worst_case():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1, growth="learned", min_samples=5, quantile=0.9)), clock)
    report(adm, clock, {"n0": 0.0})
    for _ in range(5):  # five chats that stopped at 100 tokens of their 4,000
        lease = acquire_now(adm, demand(1_000, 4_000))
        assert isinstance(lease, Lease)
        assert lease.release(Outcome.COMPLETED, 100) and not lease.release(Outcome.COMPLETED, 100)
    assert adm.nodes("default")[0].requests == 0
    got = [acquire_now(adm, demand(1_000, 4_000)) for _ in range(60)]
    admitted = sum(isinstance(x, Lease) for x in got)
    assert admitted == 60                                   # 60 x 1,100 fits; 60 x 5,000 would not
    worst = Admission(config(pool=nodes_pool(1)), clock)
    report(worst, clock, {"n0": 0.0})
    assert sum(isinstance(acquire_now(worst, demand(1_000, 4_000)), Lease) for _ in range(60)) == 20


async def test_a_waiter_gets_the_node_that_frees_first():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1), tenants={
        "classes": {"standard": {"max_wait_s": 5.0}}}), clock)
    report(adm, clock, {"n0": 0.0})
    first = acquire_now(adm, demand(60_000, 10_000))
    assert isinstance(first, Lease)
    import asyncio
    task = asyncio.ensure_future(adm.acquire(demand(50_000, 10_000)))
    await asyncio.sleep(0)
    assert not task.done()
    first.release(Outcome.COMPLETED, 10)
    got = await task
    assert isinstance(got, Lease) and got.node == "127.0.0.1:8001"


def test_retry_after_comes_from_when_room_is_expected_back():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock, rand=no_jitter)
    report(adm, clock, {"n0": 0.0})
    for _ in range(4):                      # requests that each held their node for 8 s
        x = acquire_now(adm, demand(10_000, 1_000))
        clock.advance(8.0)
        report(adm, clock, {"n0": 0.0})
        x.release(Outcome.COMPLETED, 10)
    held = [acquire_now(adm, demand(40_000, 5_000)) for _ in range(2)]
    assert all(isinstance(x, Lease) for x in held)
    clock.advance(3.0)
    report(adm, clock, {"n0": 0.0})
    r = acquire_now(adm, demand(40_000, 5_000))
    assert isinstance(r, Rejection)
    assert 4.0 <= r.retry_after_s <= 6.0    # the two are 3 s into a typical 8 s


def test_in_mixed_traffic_a_nodes_room_is_expected_back_when_the_generations_needed_end():
    """Issue 30 on a node: after 18 chats of 50 ms and 2 generations of 2 s (median 50 ms),
    two generations 0.3 s in fill the node; one of them must end for a third to fit,
    expected in 1.7 s (the median said 50 ms)."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock, rand=no_jitter)
    report(adm, clock, {"n0": 0.0})
    for _ in range(18):
        x = acquire_now(adm, demand(10_000, 1_000))
        clock.advance(0.05)
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    longs = [acquire_now(adm, demand(10_000, 1_000)) for _ in range(2)]
    clock.advance(2.0)
    for x in longs:
        assert isinstance(x, Lease) and x.release(Outcome.COMPLETED, 10)
    report(adm, clock, {"n0": 0.0})
    held = [acquire_now(adm, demand(40_000, 5_000)) for _ in range(2)]
    assert all(isinstance(x, Lease) for x in held)
    clock.advance(0.3)
    report(adm, clock, {"n0": 0.0})
    r = acquire_now(adm, demand(40_000, 5_000))
    assert isinstance(r, Rejection) and r.reason is Reason.KV_BUDGET
    assert r.retry_after_s == pytest.approx(1.7)


def test_config_needs_an_address_on_every_backend_or_none():
    pool = nodes_pool(2)
    del pool["backends"][1]["address"]
    with pytest.raises(ConfigError, match=r"backends\[1\]\.address"):
        config(pool=pool)
    pool = nodes_pool(1)
    pool["backends"][0]["address"] = "not an address"
    with pytest.raises(ConfigError, match="HOST:PORT"):
        config(pool=pool)


def test_pooled_growth_is_taken_with_the_redis_store():
    """The shared ledger keeps the moments' sums per node, so pooled growth is shared too."""
    pool = nodes_pool(1) | {"picking": {"growth": "pooled"}}
    assert config(pool=pool).pools["default"].picking.growth == "pooled"
    shared = config(pool=pool, store={"redis": {"url": "redis://127.0.0.1:6379/0"}})
    assert shared.pools["default"].picking.growth == "pooled" and shared.store.kind == "redis"


def test_a_charge_is_the_request_on_its_node():
    pool = PoolNodes(config(pool=nodes_pool(1)).pools["default"], 3.0)
    pool.report("n0", NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=T0))
    c = pool.pick("standard", 100, 50, 1.0, T0)
    assert isinstance(c, Charge) and c.address == "127.0.0.1:8001" and c.footprint == 100
    pool.progress(c, 7, T0 + 1)
    assert c.footprint == 107 and c.first_at == T0 + 1
    assert pool.release(c, 7, True, T0 + 2) and not pool.release(c, 7, True, T0 + 3)


def test_a_local_share_without_a_replica_count_is_said_loudly():
    """Picking with the Redis store shares the nodes now: only an unknown share is warned of."""
    from extproc.configparse import warnings
    cfg = config(pool=nodes_pool(1), store={"redis": {"url": "redis://127.0.0.1:1/0"}})
    (line,) = warnings(cfg)
    assert line.startswith("store.redis: on_unavailable is local_share but expected_replicas is not set")
    assert warnings(config(pool=nodes_pool(1), store={"redis": {"url": "redis://127.0.0.1:1/0",
                                                                 "expected_replicas": 2}})) == []
    assert warnings(config(pool=nodes_pool(1))) == []


def test_equal_idle_nodes_share_light_traffic():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(3)), clock)
    report(adm, clock, {"n0": 0.0, "n1": 0.0, "n2": 0.0})
    seen = []
    for _ in range(6):  # one request at a time, each done before the next
        lease = acquire_now(adm, demand(100, 10))
        seen.append(lease.node)
        lease.release(Outcome.COMPLETED, 10)
    assert sorted(seen) == sorted(["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"] * 2)


# --- pooled growth: the quantile of a node's summed growth ----------------------------------

def _prefix(lengths: list[int]) -> tuple[list[float], list[float]]:
    s1, s2 = [0.0], [0.0]
    for x in lengths:
        s1.append(s1[-1] + x)
        s2.append(s2[-1] + x * x)
    return s1, s2


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 5_000), min_size=1, max_size=40).map(sorted),
       reserved=st.integers(0, 6_000), generated=st.integers(0, 6_000))
def test_growth_moments_are_the_mean_and_variance_of_the_ways_the_request_may_end(
        lengths, reserved, generated):
    left, mean, var = rules.growth_moments(reserved, generated, lengths, _prefix(lengths))
    ends = [min(x, reserved) - generated for x in lengths if x > generated]
    if reserved <= generated:
        assert (left, mean, var) == (0, 0.0, 0.0)
    elif not ends:                                       # longer than every length: worst case
        assert (left, mean, var) == (reserved - generated, reserved - generated, 0.0)
    else:
        m = sum(ends) / len(ends)
        assert left == reserved - generated
        assert mean == pytest.approx(m, abs=1e-6)
        assert var == pytest.approx(sum((e - m) ** 2 for e in ends) / len(ends), rel=1e-6, abs=1e-3)
        assert 0 <= mean <= left


def test_growth_moments_without_lengths_are_the_worst_case():
    assert rules.growth_moments(1_000, 300, None, None) == (700, 700.0, 0.0)


def test_pooled_growth_is_far_below_the_sum_of_each_requests_quantile():
    lengths = list(range(10, 1_010, 10))                  # 100 lengths, 10..1,000
    one = rules.growth_moments(4_000, 0, lengths, _prefix(lengths))
    per_request = rules.expected_growth(4_000, 0, lengths, 0.9)
    pooled = rules.pooled_growth([one] * 40, 0.9)
    assert per_request * 40 == 36_000
    # 40 x mean 505 + 1.28 x sqrt(40) x 289: the quantile of the sum, not the sum of quantiles
    assert pooled == math.ceil(40 * 505 + 1.2815515655446004 * math.sqrt(40 * one[2]))
    assert 20_200 < pooled < 23_000
    assert rules.pooled_growth([one], 0.9) <= 4_000
    assert rules.pooled_growth([one] * 40, 1.0) == 40 * 4_000     # quantile 1: every reservation
    assert rules.pooled_growth([(50, 50.0, 0.0), (0, 0.0, 0.0)], 0.99) == 50   # never above what is left
    assert rules.pooled_growth([], 0.9) == 0


def _admitted(growth: str, lengths: list[int], **picking) -> int:
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1, growth=growth, min_samples=len(lengths), **picking)), clock)
    report(adm, clock, {"n0": 0.0})
    for n in lengths:
        lease = acquire_now(adm, demand(100, 4_000))
        assert isinstance(lease, Lease)
        lease.release(Outcome.COMPLETED, n)
    return sum(isinstance(acquire_now(adm, demand(1_000, 4_000)), Lease) for _ in range(100))


def test_pooled_growth_admits_more_than_each_requests_quantile_and_less_than_the_mean():
    lengths = [10 * i for i in range(1, 101)]             # chats ending anywhere in 10..1,000
    worst = _admitted("worst_case", lengths)
    learned = _admitted("learned", lengths)
    pooled = _admitted("pooled", lengths)
    assert worst == 20                                    # 20 x 5,000 = 100k
    assert learned == 52                                  # 1,000 + the 0.9 quantile (900) each
    # n x 1,505 + 1.28 x sqrt(n) x 289 <= 100k: the bound of the sum admits more, not all
    assert 60 <= pooled < 100_000 // 1_505
    assert _admitted("pooled", lengths, quantile=0.99) < pooled


def test_pooled_growth_with_one_length_learned_is_that_length():
    assert _admitted("pooled", [300] * 20) == _admitted("learned", [300] * 20) == 100_000 // 1_300


def test_a_class_watermark_is_a_share_of_the_whole_node_not_of_what_the_reserve_leaves():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1, reserve=0.1), tenants={
        "classes": {"standard": {}, "batch": {"kv_watermark": 0.7}}}), clock)
    report(adm, clock, {"n0": 0.0})
    docs = [acquire_now(adm, demand(34_000, 500, "batch")) for _ in range(2)]
    assert all(isinstance(x, Lease) for x in docs)      # 69,000 <= 0.7 x 100,000 (not 0.7 x 90,000)
    over = acquire_now(adm, demand(1_500, 500, "batch"))  # 71,000: above the class's share
    assert isinstance(over, Rejection) and over.retryable
    assert adm.nodes("default")[0].passed_over == {"class_watermark": 1}
    chat = acquire_now(adm, demand(20_000, 500))          # 89,500: the reserve still bounds the rest
    assert isinstance(chat, Lease)
    assert isinstance(acquire_now(adm, demand(1_000, 100)), Rejection)


def test_a_store_sharing_the_nodes_gets_the_same_watermark_as_the_local_pick():
    clock = ManualClock(T0)
    pool = PoolNodes(config(pool=nodes_pool(1, reserve=0.1)).pools["default"], 3.0)
    pool.report("n0", NodeReport(kv_usage=0.0, capacity_tokens=CAP, at=clock.now()))
    ask = pool.ask("batch", 34_000, 500, 0.7, clock.now())
    assert shared_nodes.pick_shared(ask, {"n0": 34_500}).chosen == "n0"       # 69,000 <= 70,000
    assert shared_nodes.pick_shared(ask, {"n0": 36_000}).by_watermark        # 70,500 > 70,000
    assert pool.ask("batch", 1_000, 0, 1.0, clock.now()).watermark == 1.0


def test_a_store_sharing_the_nodes_is_asked_with_what_a_report_subtracted_of_requests_ended_since():
    clock = ManualClock(T0)
    pool = PoolNodes(config(pool=nodes_pool(1)).pools["default"], 3.0)
    pool.report("n0", NodeReport(kv_usage=0.30, capacity_tokens=CAP, at=clock.now()))
    charge = pool.pick("standard", 20_000, 1_000, 1.0, clock.now())
    assert isinstance(charge, Charge)
    pool.progress(charge, 1, clock.now())
    pool.mark(1, clock.now())
    pool.report("n0", NodeReport(kv_usage=0.30, capacity_tokens=CAP, at=clock.now(), mark=1))  # ended there
    assert pool.ask("standard", 1, 0, 1.0, clock.now()).candidates[0].foreign == 30_000 - 20_001
    pool.release(charge, 1, True, clock.now())
    assert pool.ask("standard", 1, 0, 1.0, clock.now()).candidates[0].foreign == 30_000
