"""The admission core's asks for an early scrape (``PoolNodes.poke``): a node whose last report
subtracted a request released since counts it twice until its next report."""

from __future__ import annotations

from extproc.admission import Admission, Lease, Outcome
from extproc.admission.types import NodeReport
from extproc.clock import ManualClock
from kvgate_testkit.admission import acquire_now
from tests.unit.admission.helpers import T0, config
from tests.unit.admission.test_nodes import CAP, demand, nodes_pool, report


def poked_admission(n: int = 1) -> tuple[Admission, ManualClock, list[tuple[str, str]]]:
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(n)), clock)
    pokes: list[tuple[str, str]] = []
    adm.poke_node = lambda pool, node: pokes.append((pool, node))
    report(adm, clock, {f"n{i}": 0.1 for i in range(n)})
    return adm, clock, pokes


def running(adm: Admission, prompt: int = 10_000) -> Lease:
    lease = acquire_now(adm, demand(prompt, 1_000))
    assert isinstance(lease, Lease)
    lease.progress(1)
    return lease


def test_releasing_a_subtracted_request_pokes_its_node_once_per_report():
    adm, clock, pokes = poked_admission()
    a, b, c = running(adm), running(adm), running(adm)
    adm.mark_nodes(1)
    report(adm, clock, {"n0": 0.4}, mark=1)          # a, b and c subtracted
    a.release(Outcome.COMPLETED, 1)
    assert pokes == [("default", "n0")]
    assert adm.nodes("default")[0].foreign_tokens == 40_000 - 2 * 10_001  # a counted until the next report
    b.release(Outcome.COMPLETED, 1)                   # one poke stands for the next report
    assert pokes == [("default", "n0")]
    clock.advance(0.2)
    adm.mark_nodes(2)
    report(adm, clock, {"n0": 0.2}, mark=2)           # c alone subtracted; kept cleared
    assert adm.nodes("default")[0].foreign_tokens == 20_000 - 10_001
    c.release(Outcome.COMPLETED, 1)
    assert pokes == [("default", "n0")] * 2


def test_a_request_no_report_subtracted_pokes_nothing():
    adm, clock, pokes = poked_admission(2)
    lease = running(adm)                              # admitted after the last mark
    lease.release(Outcome.COMPLETED, 1)
    other = running(adm)
    adm.mark_nodes(1)
    other.release(Outcome.CLIENT_DISCONNECT)          # released before its report arrived
    report(adm, clock, {"n0": 0.2, "n1": 0.2}, mark=1)
    assert pokes == []


def test_without_a_hook_a_release_only_keeps_the_count():
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.1})
    lease = running(adm)
    adm.mark_nodes(1)
    report(adm, clock, {"n0": 0.2}, mark=1)
    lease.release(Outcome.COMPLETED, 1)
    assert adm.nodes("default")[0].foreign_tokens == 20_000


def test_an_early_report_reads_foreign_kv_but_not_a_rise():
    """A rise is read between the rounds' reports: over an early report's fraction of an
    interval, nothing between two steps of a load, it would wipe out the round's."""
    clock = ManualClock(T0)
    adm = Admission(config(pool=nodes_pool(1)), clock)
    report(adm, clock, {"n0": 0.1})
    clock.advance(1)
    report(adm, clock, {"n0": 0.3})                                   # 20k more in a round
    assert adm.nodes("default")[0].headroom_tokens == CAP - 30_000 - 20_000
    clock.advance(0.25)
    adm.report_node("default", "n0", NodeReport(kv_usage=0.3, capacity_tokens=CAP, at=clock.now(), early=True))
    node = adm.nodes("default")[0]
    assert node.foreign_tokens == 30_000 and node.headroom_tokens == CAP - 30_000 - 20_000
    clock.advance(0.75)
    report(adm, clock, {"n0": 0.3})                                   # the next round: no rise
    assert adm.nodes("default")[0].headroom_tokens == CAP - 30_000
