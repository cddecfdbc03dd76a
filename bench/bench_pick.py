"""bench_pick: what one admission to a picking pool costs, by how many requests are held.

A pool that picks nodes charges each request to a node, and a pick reads every candidate
node's expected hold. This times, in-process on the in-memory store (real monotonic
clock), one cycle of what a streamed request does to the admission core: ``acquire``
(the pick; run to its answer, which comes at once, by ``kvgate_testkit.admission.acquire_now``), a ``progress`` of one held request (what a periodic access log entry or a
streamed chunk reports), and the release of the new request with its completion count
(which teaches its class's lengths), with ``--held`` requests held on four nodes the
whole time, for each growth rule.

``--refusals`` adds what one refusal costs with ``--held`` requests in flight and the budget
full: the pool's slots (``max_concurrency``), its in-flight KV (``kv_budget_tokens``), or a
node's room in a picking pool (a prompt larger than the room, the rest of the node held by
KV kvgate did not admit). Under overload nearly every new request is refused, so a refusal
must not cost more with every request in flight (its retry hint walks them).

``--scrape-rounds`` adds what one scrape round's start costs the event loop with ``--held``
requests held, for each growth rule: ``PoolNodes.mark`` right after a completion taught a
length, so that the round also recounts every charge held (``relearn``).

``--baseline REF`` runs the same cycles with ``extproc`` as it is at git revision REF in a
second worker process, row by row in turn, and reports both beside each other: the ratio
of one held count's cost to no requests held says how a pick scales, whatever the machine
is doing.

    python bench/bench_pick.py [--held 0 500 2000] [--refusals] [--scrape-rounds] [--baseline main] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvgate_testkit import reports
from kvgate_testkit.revision import Workers, checkout

ROOT = Path(__file__).resolve().parents[1]

GROWTHS = ("worst_case", "learned", "pooled")
REFUSALS = ("slots", "kv", "node")
NODES = 4
BATCH = 50
BATCHES = 200


def _config(growth: str) -> Any:
    try:
        from extproc.configparse import parse_config
    except ImportError:  # a --baseline revision from before configparse.py
        from extproc.config import parse_config  # type: ignore[no-redef]
    backends = [{"name": f"n{i}", "metrics_url": f"http://127.0.0.1:9/{i}",
                 "address": f"127.0.0.1:{8001 + i}", "kv_capacity_tokens": 1_000_000_000}
                for i in range(NODES)]
    return parse_config({"pools": {"default": {"max_concurrency": 1_000_000, "backends": backends,
                                               "picking": {"growth": growth, "reserve_fraction": 0.1}}}})


class _HeldPool:
    """_HeldPool is a picking pool on the in-memory store (real monotonic clock) whose growth
    rule has learned 1,000 completion lengths, with ``held`` requests held on its four nodes."""

    def __init__(self, growth: str, held: int, seed: int) -> None:
        from extproc.admission import Admission, Outcome
        from extproc.clock import MonotonicClock
        self.clock = MonotonicClock()
        self.config = _config(growth)
        self.adm = Admission(self.config, self.clock)
        self.rng = random.Random(seed)
        self.report()
        for _ in range(1_000):  # the lengths the growth rules learn
            self.admit().release(Outcome.COMPLETED, self.rng.randint(10, 600))
        self.leases = []
        for i in range(held):
            if i % 100 == 0:
                self.report()  # an old tree's slow picks outlast a report's freshness
            self.leases.append(self.admit())
            self.leases[-1].progress(self.rng.randint(1, 50))

    def report(self) -> None:
        """report is the scraper's report of every node, idle."""
        from extproc.admission.types import NodeReport
        for i in range(NODES):
            self.adm.report_node("default", f"n{i}", NodeReport(kv_usage=0.0, capacity_tokens=None,
                                                                at=self.clock.now(), waiting=0, running=0))

    def admit(self) -> Any:
        """admit is a new request's lease (200 to 4,000 prompt tokens, 100 to 1,000 reserved)."""
        from extproc.admission import Lease
        from kvgate_testkit.admission import acquire_now, demand_of
        lease = acquire_now(self.adm, demand_of(self.config, "anyone", self.rng.randint(200, 4000),
                                                self.rng.randint(100, 1000)))
        if type(lease) is not Lease:
            raise RuntimeError(f"the benchmark must not be refused: {lease}")
        return lease

    def release_all(self) -> None:
        """release_all ends every request held; raises if a lease was left held."""
        from extproc.admission import Outcome
        for lease in self.leases:
            lease.release(Outcome.COMPLETED, 10)
        if self.adm.snapshot("default").inflight != 0:
            raise RuntimeError("a lease was left held")


def measure(growth: str, held: int, seed: int = 7) -> float:
    """measure is the median ns of one cycle (pick, one progress, release) with ``held``
    requests held, over BATCHES batches of BATCH cycles."""
    from extproc.admission import Outcome
    pool = _HeldPool(growth, held, seed)
    report, admit, rng, leases = pool.report, pool.admit, pool.rng, pool.leases
    made = [0] * len(leases)
    completed = Outcome.COMPLETED

    def cycles(n: int) -> None:
        for i in range(n):
            lease = admit()
            lease.progress(5)
            if leases:
                k = i % len(leases)
                made[k] += 1
                leases[k].progress(made[k])
            lease.release(completed, rng.randint(10, 600))

    for _ in range(10):  # warm-up
        report()
        cycles(BATCH)
    gc.collect()
    per = []
    for _ in range(BATCHES):
        report()  # the scraper's once-a-second report, here once a batch to stay fresh
        t0 = time.perf_counter_ns()
        cycles(BATCH)
        per.append((time.perf_counter_ns() - t0) / BATCH)
    pool.release_all()
    return statistics.median(per)


def measure_refusal(budget: str, held: int, seed: int = 7) -> float:
    """measure_refusal is the median ns of one refused ``acquire`` with ``held`` requests
    in flight filling ``budget`` (REFUSALS), over BATCHES batches of BATCH refusals."""
    from extproc.admission import Admission, Lease, Outcome, Rejection
    from extproc.admission.types import NodeReport
    from extproc.clock import MonotonicClock
    from kvgate_testkit.admission import acquire_now, demand_of
    try:
        from extproc.configparse import parse_config
    except ImportError:  # a --baseline revision from before configparse.py
        from extproc.config import parse_config  # type: ignore[no-redef]
    held = max(1, held)
    size = 600  # prompt 400 + completion 200 tokens a request
    pool: dict[str, Any] = {"max_concurrency": held if budget == "slots" else 10**9}
    if budget == "kv":
        pool["kv_budget_tokens"] = held * size
    if budget == "node":
        pool["backends"] = [{"name": "n0", "metrics_url": "http://127.0.0.1:9/0",
                             "address": "127.0.0.1:8001", "kv_capacity_tokens": 100 * held * size}]
        pool["picking"] = {"growth": "worst_case", "reserve_fraction": 0.0}
    clock = MonotonicClock()
    cfg = parse_config({"pools": {"default": pool}})
    adm = Admission(cfg, clock)
    rng = random.Random(seed)

    def report(usage: float) -> None:
        if budget == "node":
            adm.report_node("default", "n0", NodeReport(kv_usage=usage, capacity_tokens=None,
                                                        at=clock.now(), waiting=0, running=0))

    report(0.0)
    for _ in range(200):  # hold times learned: the hint walks the requests in flight
        lease = acquire_now(adm, demand_of(cfg, "anyone", 400, 200))
        if type(lease) is not Lease:
            raise RuntimeError(f"the benchmark's warm-up must not be refused: {lease}")
        lease.release(Outcome.COMPLETED, rng.randint(10, 200))
    leases = [acquire_now(adm, demand_of(cfg, "anyone", 400, 200)) for _ in range(held)]
    if any(type(x) is not Lease for x in leases):
        raise RuntimeError("the held requests must be admitted")
    # The node: 98 % used, most of it KV kvgate did not admit; a prompt of 3 % of it is refused.
    prompt = 3 * held * size if budget == "node" else 400
    per = []
    for _ in range(BATCHES):
        report(0.98)
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            r = acquire_now(adm, demand_of(cfg, "anyone", prompt, 200))
        per.append((time.perf_counter_ns() - t0) / BATCH)
        if type(r) is not Rejection:
            raise RuntimeError(f"the benchmark's request must be refused: {r}")
    for lease in leases:
        lease.release(Outcome.COMPLETED, 10)
    if adm.snapshot("default").inflight != 0:
        raise RuntimeError("a lease was left held")
    return statistics.median(per)


def measure_round(growth: str, held: int, seed: int = 7) -> float:
    """measure_round is the median ns of one scrape round's start (``PoolNodes.mark``) with
    ``held`` requests held on the four nodes, each round after a completion that taught a
    length, over 20 rounds."""
    from extproc.admission import Outcome
    pool = _HeldPool(growth, held, seed)
    nodes = pool.adm._pools["default"].nodes
    assert nodes is not None
    per = []
    for r in range(20):
        pool.admit().release(Outcome.COMPLETED, pool.rng.randint(10, 600))  # a length learned
        t0 = time.perf_counter_ns()
        nodes.mark(1_000 + r, pool.clock.now())
        per.append(time.perf_counter_ns() - t0)
    pool.release_all()
    return statistics.median(per)


def _worker() -> None:
    """_worker measures one row per line on stdin (``growth held``, or ``refusal:BUDGET
    held``), one figure per line back."""
    for line in sys.stdin:
        kind, held = line.split()
        if kind.startswith("refusal:"):
            print(json.dumps(measure_refusal(kind.removeprefix("refusal:"), int(held))), flush=True)
        elif kind.startswith("round:"):
            print(json.dumps(measure_round(kind.removeprefix("round:"), int(held))), flush=True)
        else:
            print(json.dumps(measure(kind, int(held))), flush=True)


def _rows(got: dict[tuple[str, str, int], float], names: list[str], kind: str, label: str,
          helds: list[int], unit: float, fmt: str, *, ratio: bool, at_least: int = 0) -> list[str]:
    """_rows is one table row per held count of ``kind`` (ns figures shown in ``unit``s),
    each tree's figure and, with ``ratio``, its ratio to the first held count's."""
    out = []
    for held in helds:
        cells = []
        for n in names:
            v = got[(n, kind, held)]
            cells.append(f"{v / unit:{fmt}}" + (f" | {v / got[(n, kind, helds[0])]:.2f}" if ratio else ""))
        out.append(f"| {label} | {max(at_least, held):,} | {' | '.join(cells)} |")
    return out


def _measure(trees: dict[str, Path], kinds: list[str], helds: list[int]) -> dict[tuple[str, str, int], float]:
    """_measure runs a worker process per tree (name -> source folder) and asks each, in turn
    and in alternating order, for every kind at every count of requests held; returns their
    answers by (tree, kind, held)."""
    got: dict[tuple[str, str, int], float] = {}
    with Workers([sys.executable, str(Path(__file__).resolve()), "--worker"], trees) as workers:
        for growth in kinds:
            for held in helds:
                for name, answer in workers.ask(f"{growth} {held}").items():
                    got[(name, growth, held)] = json.loads(answer)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held", type=int, nargs="+", default=[0, 500, 2000])
    ap.add_argument("--growth", nargs="+", default=list(GROWTHS), choices=GROWTHS)
    ap.add_argument("--refusals", action="store_true",
                    help="also time one refusal with the held requests filling each budget")
    ap.add_argument("--scrape-rounds", action="store_true",
                    help="also time a scrape round's start (its recount of the charges held)")
    ap.add_argument("--baseline", metavar="REF", help="also run extproc as it is at this git revision")
    ap.add_argument("--out", type=Path, help="write the report here too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kinds = (list(args.growth) + ([f"refusal:{b}" for b in REFUSALS] if args.refusals else [])
             + ([f"round:{g}" for g in args.growth] if args.scrape_rounds else []))
    if args.worker:
        _worker()
        return 0
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvgate-pick-") as tmp:
        trees = {"this tree": ROOT}
        if args.baseline:
            trees[args.baseline] = checkout(args.baseline, Path(tmp))
        got = _measure(trees, kinds, args.held)
    command = reports.command("bench/bench_pick.py", ap, args)
    names = list(trees)
    head = " | ".join(f"{n}: us per cycle | x no one held" for n in names)
    lines = ["# A pick's cost by the requests held (bench/bench_pick.py)", "",
             f"Command: `{command}`", "",
             f"Python {platform.python_version()}; load average at the start {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f}. In-process, in-memory store, {NODES} nodes, reserve 0.1. One cycle: "
             "acquire (the pick, answered at once) + one held request's progress + the new request's release with "
             f"its completion count; median of {BATCHES} batches of {BATCH} cycles. Each worker a "
             "process of its own, rows in turn.", "",
             f"| growth | held | {head} |", "|---|---:|" + "---:|---:|" * len(names)]
    for growth in args.growth:
        lines += _rows(got, names, growth, growth, args.held, 1e3, ".1f", ratio=True)
    if args.refusals:
        head = " | ".join(f"{n}: us per refusal | x the fewest held" for n in names)
        lines += ["", "## A refusal's cost by the requests in flight", "",
                  "One refused `acquire` (its retry hint included) with the held requests "
                  "filling the budget: `slots` the pool's max_concurrency, `kv` its "
                  "kv_budget_tokens, `node` a picking pool's one node, 98 % used (mostly KV "
                  "kvgate did not admit), asked for a prompt three times what kvgate holds "
                  f"there. Median of {BATCHES} batches of {BATCH} refusals (0 held is run as 1).",
                  "", f"| budget | held | {head} |", "|---|---:|" + "---:|---:|" * len(names)]
        for budget in REFUSALS:
            lines += _rows(got, names, f"refusal:{budget}", budget, args.held, 1e3, ".1f",
                           ratio=True, at_least=1)
    if args.scrape_rounds:
        head = " | ".join(f"{n}: ms per round" for n in names)
        lines += ["", "## A scrape round's start by the requests held", "",
                  "`PoolNodes.mark` (on the event loop, once a second), each time right after a "
                  "completion taught a length, so that it recounts the charges held (every one "
                  "before bbf434f, at most `nodes.RECOUNT_PER_ROUND` since); median of 20 rounds.",
                  "", f"| growth | held | {head} |", "|---|---:|" + "---:|" * len(names)]
        for growth in args.growth:
            lines += _rows(got, names, f"round:{growth}", growth, args.held, 1e6, ".2f", ratio=False)
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        return reports.publish(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
