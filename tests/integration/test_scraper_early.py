"""The scraper's early scrapes (``Scraper.poke``): real metrics servers over loopback, the
thread's pace driven on a manual clock with a fake wait, and once on the real thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from extproc.clock import ManualClock, MonotonicClock
from extproc.config import Config
from extproc.configparse import parse_config
from kvgate_testkit.procs import wait_until
from tests.integration.test_scraper import (Behavior, MetricsServer, NodeReports, Published, Recorder,  # noqa: F401
                                            new_scraper, serve, servers, vllm_body)


def picking(nodes: list[MetricsServer], *, poll: float = 1.0, gap: float = 0.2, timeout: float = 1.0,
            **more: Any) -> Config:
    backends = [{"name": f"n{i}", "metrics_url": s.url, "engine": "vllm", "address": f"127.0.0.1:{9000 + i}"}
                for i, s in enumerate(nodes)]
    return parse_config({"pools": {"p": {"backends": backends}},
                         "adaptive": {"poll_interval_s": poll, "scrape_timeout_s": timeout,
                                      "stale_after_s": max(3.0, poll), "early_scrape_gap_s": gap},
                         **more})


class Paced:
    """Paced is a scraper's state on a manual clock: its waits, its sink, what it published."""

    def __init__(self, new_scraper: Any, cfg: Config) -> None:
        self.clock, self.waits, self.sink, self.pub = ManualClock(100.0), [], NodeReports(), Published()
        self.scraper = new_scraper(cfg, self.pub, Recorder(), self.clock, nodes=self.sink,
                                   wait=self.waits.append)
        self.next_at = self.clock.now()

    def cycle(self, advance: float = 0.0) -> float:
        """cycle advances the clock, runs one cycle and returns how long the thread would wait."""
        self.clock.advance(advance)
        self.next_at = self.scraper.cycle(self.next_at)
        return round(self.waits[-1], 6)

    def reported(self) -> list[str]:
        return [backend for _pool, backend, _r in self.sink.reports]


def test_a_poke_scrapes_that_node_alone_once_its_gap_has_passed(new_scraper, servers):
    # times are binary fractions: the manual clock adds them up exactly
    a, b = serve(servers, Behavior(vllm_body(0.3))), serve(servers, Behavior(vllm_body(0.4)))
    run = Paced(new_scraper, picking([a, b], gap=0.25))
    assert run.cycle() == 1.0 and run.reported() == ["n0", "n1"]   # the round; the next in 1 s
    published = len(run.pub.calls)
    assert run.cycle(0.125) == 0.875 and (a.hits, b.hits) == (1, 1)  # woken for nothing: nothing done
    run.scraper.poke("p", "n0")
    run.scraper.poke("p", "n0")                                     # one early scrape stands for both
    assert run.cycle() == 0.125                                     # deferred to the gap's end
    assert (a.hits, b.hits) == (1, 1)
    assert run.cycle(0.125) == 0.75                                 # due: n0 alone, then the round
    assert (a.hits, b.hits) == (2, 1) and run.reported() == ["n0", "n1", "n0"]
    assert len(run.sink.marks) == 2 and run.sink.reports[-1][2].mark == run.sink.marks[-1]
    assert [r.early for _p, _b, r in run.sink.reports] == [False, False, True]  # reads no rise
    assert len(run.pub.calls) == published                          # the scale keeps its pace
    assert run.cycle(0.75) == 1.0 and (a.hits, b.hits) == (3, 2)    # the round comes on time


def test_a_poke_during_a_round_is_answered_by_it_and_a_gap_of_0_turns_pokes_off(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    run = Paced(new_scraper, picking([a]))
    run.scraper.poke("p", "n0")                                     # before the round reports n0
    run.scraper.poke("p", "gone")                                   # a node not configured
    assert run.cycle() == 1.0 and a.hits == 1                       # the round answered both
    assert run.cycle(0.5) == 0.5 and a.hits == 1
    off = Paced(new_scraper, picking([a], gap=0.0))
    off.cycle()
    off.scraper.poke("p", "n0")
    assert off.cycle(0.5) == 0.5 and a.hits == 2                    # only its round scrapes it


def test_a_node_whose_scrape_still_runs_is_not_scraped_early(new_scraper, servers, monkeypatch):
    """A worker stuck past its round (a reader that never returns here) keeps the node out of
    early rounds: each poke would otherwise cost a round's timeout, or spin the thread."""
    import extproc.signals.scraper as scraper_mod

    stuck = threading.Event()
    real_read = scraper_mod.read
    monkeypatch.setattr(scraper_mod, "read", lambda *a: (stuck.wait(10.0), real_read(*a))[1])
    node = serve(servers, Behavior(vllm_body(0.3)))
    run = Paced(new_scraper, picking([node]))                      # a fetch in time even when busy
    try:
        run.cycle()                                                 # overruns (1 s): its scrape still runs
        run.scraper.poke("p", "n0")
        assert run.cycle(0.5) == 0.5 and node.hits == 1             # left to its round
    finally:
        stuck.set()


def test_the_thread_wakes_early_on_a_poke(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    scraper = new_scraper(picking([a], poll=60.0, gap=0.001), Published(), Recorder(), MonotonicClock(),
                          nodes=NodeReports())
    scraper.start()
    wait_until(lambda: a.hits >= 1, timeout=10.0, what="the first round")
    scraper.poke("p", "n0")
    wait_until(lambda: a.hits >= 2, timeout=10.0, what="an early scrape, 60 s before the next round")


async def test_the_server_hands_the_admission_cores_pokes_to_its_scraper(servers):
    """The wiring: a node the admission core pokes is scraped long before its next round."""
    from prometheus_client import CollectorRegistry

    from extproc.metrics import Metrics
    from extproc.server import Server

    a = serve(servers, Behavior(vllm_body(0.3)))
    srv = Server(picking([a], poll=60.0, gap=0.001, server={"drain_s": 0.0, "grace_s": 1.0}),
                 grpc_listen="127.0.0.1:0", admin_listen="127.0.0.1:0", metrics=Metrics(CollectorRegistry()))
    await srv.start()
    try:
        await asyncio.to_thread(wait_until, lambda: a.hits >= 1, what="the first round")
        assert srv.admission.poke_node is not None
        srv.admission.poke_node("p", "n0")
        await asyncio.to_thread(wait_until, lambda: a.hits >= 2, what="an early scrape")
    finally:
        await srv.close()
    assert srv.admission.poke_node is None


def test_an_early_round_that_fails_leaves_its_pokes_to_the_rounds(new_scraper, servers, monkeypatch):
    a = serve(servers, Behavior(vllm_body(0.3)))
    run = Paced(new_scraper, picking([a], gap=0.25))
    run.cycle()
    run.scraper.poke("p", "n0")
    monkeypatch.setattr(run.scraper, "poll_once", lambda only=None: 1 / 0)   # a bug in a round
    assert run.cycle(0.5) == 0.5                                    # not at once, again and again
