"""kvgate_requests_total and kvgate_releases_total, counted as plain ints (metrics._Tally),
read as prometheus_client's own counters would."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest

from extproc.metrics import _Tally


def _without_created_values(text: bytes) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())


def test_a_tally_is_exposed_as_the_counter_it_replaces() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("kvgate_releases_total", "Leases released.", ["pool", "cause"], registry=theirs)
    tally = _Tally("kvgate_releases", "Leases released.", ("pool", "cause"))
    ours.register(tally)
    counter.labels("a", "completed")  # listed at 0 before any count
    tally.zero(("a", "completed"))
    for key, n in ((("a", "completed"), 3), (("b", "client_cancelled"), 1)):
        for _ in range(n):
            counter.labels(*key).inc()
            tally.inc(key)
    tally.zero(("a", "completed"))  # listing it again leaves its count
    assert _without_created_values(generate_latest(ours)) == _without_created_values(generate_latest(theirs))
    assert ours.get_sample_value("kvgate_releases_total", {"pool": "a", "cause": "completed"}) == 3.0


def test_timings_are_exposed_as_the_histogram_they_replace() -> None:
    from prometheus_client import Histogram

    from extproc.metrics import DECISION_BUCKETS, _Timings

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    hist = Histogram("kvgate_decision_seconds", "Decisions.", labelnames=["pool"],
                     buckets=DECISION_BUCKETS, registry=theirs)
    timings = _Timings("kvgate_decision_seconds", "Decisions.", "pool", DECISION_BUCKETS)
    ours.register(timings)
    # On a bound (le is inclusive), between bounds, under the first, above the last.
    for pool, seconds in (("a", 0.001), ("a", 0.0013), ("a", 0.00001), ("b", 99.0), ("a", 0.001)):
        hist.labels(pool).observe(seconds)
        timings.observe(pool, seconds)
    assert _without_created_values(generate_latest(ours)) == _without_created_values(generate_latest(theirs))
