"""bench_redis_prefix: what counting shared prompt prefixes once costs the Redis store's admit
script, side by side in one run.

A real Redis-protocol server started here on 127.0.0.1 (``kvgate_testkit/redis_server.py``);
one ``RedisStore`` (caller instants, so that only the script and the round trip are timed)
admitting to a picking pool of three nodes and settling at once, one admission at a time.
Rows, each with 72 leases with chains (40 and 256 keys) running on the nodes beforehand:

- ``no chain``: ``shared_prefix`` off, every prompt whole (the baseline);
- ``40 keys, shared``: a 10,000-token prompt chained in 40 keys (``extproc.prefix``'s pieces
  of ~256 tokens), sharing all but the last with the leases running on every node;
- ``40 keys, unique``: the same length, sharing nothing (every key new);
- ``256 keys, shared``: the longest chain the ledger reads (``sharing.MAX_LINKS``).

Reported: median and p99 of one admit + settle pair, and its ratio to the baseline's.
Run: ``python bench/bench_redis_prefix.py`` (``make bench-redis-prefix``; about 20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis as redis_sync  # noqa: E402

from bench.reports import machine, publish  # noqa: E402
from extproc.admission.shared_nodes import Candidate, NodeAsk  # noqa: E402
from extproc.admission.sharing import MAX_LINKS  # noqa: E402
from extproc.admission.store.redis import RedisStore  # noqa: E402
from extproc.admission.types import Chain, Grant, Plan, PoolLimits  # noqa: E402
from extproc.clock import ManualClock  # noqa: E402
from extproc.config import RedisStoreConfig  # noqa: E402
from kvgate_testkit.redis_server import RedisServer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "redis-prefix.md"
NODES = ("n0", "n1", "n2")
BLOCK = 16
RUNNING = 12
LIMITS = PoolLimits(pool="p", scale=1.0, limit=10_000, base_limit=10_000, retry_estimate_s=1.0)


def chain(keys: int, shared: int, tag: int) -> Chain:
    """chain is ``keys`` keys of 256 tokens, the first ``shared`` common to every ``tag``."""
    return Chain(tuple(i if i < shared else (tag << 20) + i for i in range(keys)),
                 tuple(256 * (i + 1) for i in range(keys)))


def ask(c: Chain | None) -> NodeAsk:
    prompt = c.ends[-1] if c is not None else 10_000
    return NodeAsk(tuple(Candidate(n, 10**9, 0, 0, 0, None, False, BLOCK if c else 0, 0) for n in NODES),
                   prompt + 500, 0.0, 1.0, None, c, prompt, 1.0)


async def row(store: RedisStore, make: object, pairs: int) -> list[float]:
    """row times ``pairs`` admit + settle pairs of the asks ``make(i)`` returns (µs each)."""
    out = []
    for i in range(pairs):
        a = make(i)  # type: ignore[operator]
        t = time.perf_counter()
        g = await store.admit(Plan(LIMITS, "t", "standard", 1, None, a), 0.0)
        assert isinstance(g, Grant), g
        store.settle(g, 1, 0.0)
        await store.flush()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def script_us(r: redis_sync.Redis) -> float:
    """script_us is the mean time (µs) Redis spent in one EVALSHA since the last reset."""
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec_per_call", 0.0))


async def run(pairs: int) -> list[tuple[str, list[float], float]]:
    server = RedisServer().start()
    store = RedisStore(RedisStoreConfig(url=server.url, key_prefix="bench:", timeout_s=1.0,
                                        expected_replicas=1), clock=ManualClock(0.0))
    store._closed = True  # no refresher: only admissions are timed
    rows: list[tuple[str, object]] = [
        ("no chain", lambda i: ask(None)),
        ("40 keys, shared", lambda i: ask(chain(40, 39, i + 1))),
        ("40 keys, unique", lambda i: ask(chain(40, 0, i + 1))),
        (f"{MAX_LINKS} keys, shared", lambda i: ask(chain(MAX_LINKS, MAX_LINKS - 1, i + 1))),
    ]
    try:
        for n in range(RUNNING * len(NODES)):  # the running leases every row finds
            for c in (chain(40, 39, 10_000 + n), chain(MAX_LINKS, MAX_LINKS - 1, 10_000 + n)):
                g = await store.admit(Plan(LIMITS, "t", "standard", 1, None, ask(c)), 0.0)
                assert isinstance(g, Grant)
        r = redis_sync.Redis.from_url(server.url)
        out = []
        for name, make in rows:
            await row(store, make, 100)  # warm-up
            r.config_resetstat()
            lat = await row(store, make, pairs)
            out.append((name, lat, script_us(r)))
    finally:
        await store._client.aclose()
        server.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = asyncio.run(run(args.pairs))
    base = statistics.median(results[0][1])
    base_script = results[0][2]
    load = os.getloadavg()
    lines = [
        "# Redis store: what counting shared prefixes once costs an admission",
        "",
        f"Command: `python bench/bench_redis_prefix.py --pairs {args.pairs}` (also `make bench-redis-prefix`). "
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. Machine: {machine()}, shared with "
        f"redis-server and everything else running. Load average at the end: {load[0]:.2f} (1 min).",
        "",
        f"One admit + settle pair at a time (two round trips) on a pool of {len(NODES)} nodes with "
        f"{2 * RUNNING * len(NODES)} leases with chains running there (see the module doc); {args.pairs} "
        "pairs a row after 100 warm-up pairs. On a loaded machine every figure is inflated alike: "
        "read the ratios.",
        "",
        "Script: the mean time Redis spent in one script call of the row (admit or settle; "
        "`INFO commandstats`, reset before the row), which blocks every replica's calls; pair: "
        "what the caller waited for both round trips.",
        "",
        "| row | script (mean) | script / no chain | pair median | pair p99 | pair median / no chain |",
        "|---|---|---|---|---|---|",
    ]
    for name, lat, script in results:
        med = statistics.median(lat)
        p99 = sorted(lat)[int(0.99 * (len(lat) - 1))]
        lines.append(f"| {name} | {script:.0f} µs | {script / base_script:.2f} | {med:.0f} µs | {p99:.0f} µs "
                     f"| {med / base:.2f} |")
    return publish(args.out, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
