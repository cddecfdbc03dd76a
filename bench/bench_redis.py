"""bench_redis: admissions per second per replica through the shared Redis store, and what
Redis adds to one admission.

Everything runs against a real ``redis-server`` started here on 127.0.0.1 (a free port, no
persistence). One pool has all three budgets (slots with a guaranteed class, the pool's
TPM bucket, the in-flight KV budget) and four tenants with their own buckets, all large
enough that nothing is refused: refusals are not what is timed. Admissions go through
``Admission.acquire`` and ``Lease.release`` with the store built the way ``kvgate serve``
builds it (Redis ``TIME``, lease TTL 30 s, timeout 50 ms); a release is queued and goes to
Redis with the replica's next round trip.

Three measures, in one run:

1. latency: one coroutine, acquire + release pairs one after the other, on the memory
   store and on Redis: median and p99 of a pair, and the difference (what Redis adds);
2. throughput of one replica: ``--concurrency`` coroutines doing pairs for ``--seconds``;
3. ``--replicas`` replica processes at once on the same Redis, each as in 2: admissions
   per second per replica. After each run Redis must hold no slot and no KV token.

Target: >= 1,000 admissions/s per replica. Writes ``bench/results/redis.md``.

Run: ``python bench/bench_redis.py`` (about 30 s; ``--quick`` for a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis as redis_sync  # noqa: E402

from bench.httpload import run  # noqa: E402
from bench.reports import machine  # noqa: E402
from extproc.admission import Admission, Demand, Lease, Outcome  # noqa: E402
from extproc.admission.store.redis import LOCAL_PREFIX, RedisStore  # noqa: E402
from extproc.clock import MonotonicClock  # noqa: E402
from extproc.config import Config  # noqa: E402
from extproc.configparse import parse_config
from kvgate_testkit.admission import demand_of  # noqa: E402
from kvgate_testkit.redis_server import RedisServer, server_version  # noqa: E402

TARGET_PER_S = 1000
RESULTS = ROOT / "bench" / "results" / "redis.md"
BIG = 10_000_000_000
PREFIX = "bench:"


def config(url: str | None, replicas: int = 1) -> Config:
    """config is one pool with every budget, four tenants, and the Redis store when ``url`` is set."""
    data: dict[str, Any] = {
        "pools": {"default": {"max_concurrency": 100_000, "tpm": BIG, "kv_budget_tokens": BIG}},
        "tenants": {
            "classes": {"gold": {"priority": 10, "guaranteed_slots": 16},
                        "standard": {"tpm": BIG}, "batch": {"priority": -1, "tpm": BIG}},
            "tenants": {"acme": {"class": "gold", "tpm": BIG}, "globex": {"class": "standard"},
                        "initech": {"class": "standard"}, "umbrella": {"class": "batch"}},
            "default_class": "standard",
        },
    }
    if url is not None:
        data["store"] = {"redis": {"url": url, "key_prefix": PREFIX, "lease_ttl_s": 30,
                                   "timeout_s": 0.05, "on_unavailable": "local_share",
                                   # A replica whose first round trip is slow must know its share.
                                   "expected_replicas": replicas}}
    return parse_config(data)


def demands() -> list[Demand]:
    """demands is one request per tenant: 200 prompt tokens reserving 100 completion tokens."""
    cfg = config(None)  # the tenants' classes, whatever the store
    return [demand_of(cfg, t, 200, 100) for t in ("acme", "globex", "initech", "umbrella")]


class Errors:
    """Errors is the store's observer here: it counts failed round trips by reason."""

    def __init__(self) -> None:
        self.by_reason: dict[str, int] = {}

    def store_error(self, reason: str) -> None:
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def store_mode(self, mode: str) -> None:
        pass

    def store_nodes(self, pool: str, held: dict[str, int]) -> None:
        pass


def make(url: str | None, errors: Errors | None = None,
         replicas: int = 1) -> tuple[Admission, RedisStore | None]:
    cfg = config(url, replicas)
    store = None
    if url is not None:
        assert cfg.store.redis is not None
        store = RedisStore(cfg.store.redis, observer=errors)  # Redis TIME, as in production
    return Admission(cfg, MonotonicClock(), store), store


async def pair(adm: Admission, d: Demand) -> bool:
    """pair admits and releases one request; True when Redis admitted it (not the local share)."""
    lease = await adm.acquire(d)
    if not isinstance(lease, Lease):
        raise RuntimeError(f"refused: {lease.message}")
    lease.release(Outcome.COMPLETED, 50)
    return not lease.id.startswith(LOCAL_PREFIX)


async def latency(url: str | None, n: int) -> tuple[list[float], int]:
    """latency times ``n`` acquire + release pairs one after the other.

    Returns the microseconds of the pairs the store decided (Redis, or memory), and how
    many were decided locally instead (a round trip had exceeded timeout_s).
    """
    adm, store = make(url)
    if store is not None:
        await store.start()
    ds = demands()
    for i in range(200):  # warm: connections, scripts, caches
        await pair(adm, ds[i % 4])
    out = []
    local = 0
    perf = time.perf_counter_ns
    for i in range(n):
        t0 = perf()
        shared = await pair(adm, ds[i % 4])
        t1 = perf()
        if shared:
            out.append((t1 - t0) / 1000)
        else:
            local += 1
    await adm.close()
    return out, local


async def throughput(url: str | None, concurrency: int, seconds: float,
                     replicas: int = 1) -> dict[str, Any]:
    """throughput runs ``concurrency`` coroutines of pairs for ``seconds``.

    Returns admissions per second decided by Redis (``per_s``; with the memory store, all
    of them), those decided locally while a round trip had exceeded timeout_s
    (``local``), and the failed round trips by reason.
    """
    errors = Errors()
    adm, store = make(url, errors, replicas)
    if store is not None:
        await store.start()
    ds = demands()
    shared = local = 0
    stop_at = 0.0

    async def worker(k: int) -> None:
        nonlocal shared, local
        i = k
        while time.perf_counter() < stop_at:
            if await pair(adm, ds[i % 4]):
                shared += 1
            else:
                local += 1
            i += 1

    stop_at = time.perf_counter() + 0.5
    await asyncio.gather(*(worker(k) for k in range(concurrency)))  # warm
    shared = local = 0
    errors.by_reason.clear()
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if store is not None:
        await store.flush()
    await adm.close()
    return {"shared": shared, "local": local, "seconds": elapsed, "per_s": shared / elapsed,
            "errors": dict(errors.by_reason)}


def held(url: str) -> tuple[int, int]:
    """held is (slots, KV tokens) Redis holds for the pool: both 0 once every lease is settled."""
    st = redis_sync.Redis.from_url(url).hgetall(f"{PREFIX}{{default}}:st")
    return int(st.get(b"n", 0)), int(st.get(b"kv", 0))


def child(args: argparse.Namespace) -> int:
    """child is one replica process of measure 3: prints its result as JSON."""
    print(json.dumps(run(throughput(args.url, args.concurrency, args.seconds, args.replicas))),
          flush=True)
    return 0


def _errors(m: dict[str, Any]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(m["errors"].items())) or "0"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _measure(args: argparse.Namespace, n_lat: int) -> tuple[list[float], list[float], int, dict[str, Any],
                                                          dict[str, Any], list[dict[str, Any]], str]:
    """_measure runs the three measures on a fresh Redis server: ``n_lat`` admissions one at a time
    (memory store, Redis: latencies in µs and how many Redis pairs were decided locally),
    throughput of one replica (memory, Redis) and of ``--replicas`` processes at once; checks
    after each that Redis holds nothing; returns them with the server's version."""
    with RedisServer() as server:
        url = server.url
        lat_mem, _ = run(latency(None, n_lat))
        lat_redis, lat_local = run(latency(url, n_lat))
        assert held(url) == (0, 0), f"leaked after the latency run: {held(url)}"
        one_mem = run(throughput(None, args.concurrency, args.seconds))
        one = run(throughput(url, args.concurrency, args.seconds))
        assert held(url) == (0, 0), f"leaked after one replica: {held(url)}"
        procs = [subprocess.Popen([sys.executable, __file__, "--child", "--url", url,
                                   "--seconds", str(args.seconds), "--concurrency", str(args.concurrency),
                                   "--replicas", str(args.replicas)],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for _ in range(args.replicas)]
        many = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"replica process failed ({p.returncode})")
            many.append(json.loads(out.strip().splitlines()[-1]))
        assert held(url) == (0, 0), f"leaked after {args.replicas} replicas: {held(url)}"
        # The binary's own banner: Valkey answers INFO with a Redis-compatible redis_version.
        redis_version = server_version(server.binary)
    return lat_mem, lat_redis, lat_local, one_mem, one, many, redis_version


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds instead of about 30")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    ap.add_argument("--concurrency", type=int, default=16, help="coroutines per replica")
    ap.add_argument("--replicas", type=int, default=2, help="replica processes in measure 3")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write the report")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.seconds = 1.5
    n_lat = 500 if args.quick else 3000

    lat_mem, lat_redis, lat_local, one_mem, one, many, redis_version = _measure(args, n_lat)

    load = os.getloadavg()
    med_mem, med_redis = statistics.median(lat_mem), statistics.median(lat_redis)
    p99_mem, p99_redis = pct(lat_mem, 0.99), pct(lat_redis, 0.99)
    per_replica = [m["per_s"] for m in many]
    ok = one["per_s"] >= TARGET_PER_S and min(per_replica) >= TARGET_PER_S
    cmd = "python bench/bench_redis.py" + (" --quick" if args.quick else "")
    lines = [
        "# Redis store: admissions per second per replica, and the latency Redis adds",
        "",
        f"Command: `{cmd}` (also `make bench-redis`). Date: "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.",
        f"Machine: {machine()}, shared by redis-server, the benchmark and everything else running; "
        f"{redis_version}, "
        f"redis-py without hiredis, uvloop. Load average at the end: {load[0]:.2f} (1 min), {load[1]:.2f} (5 min).",
        "",
        "An admission is `await Admission.acquire` + `Lease.release` on one pool with every budget "
        "(slots with a guaranteed class, pool TPM, KV budget, four tenants with their own buckets; "
        "nothing refused). With Redis: one EVALSHA per admission, carrying the replica's queued "
        "settles in the same pipeline; Redis TIME; lease TTL 30 s; timeout 50 ms.",
        "",
        "## Latency of one admission (acquire + release), one at a time",
        "",
        "| store | median | p99 |",
        "|---|---|---|",
        f"| memory | {med_mem:.1f} µs | {p99_mem:.1f} µs |",
        f"| Redis (127.0.0.1) | {med_redis:.1f} µs | {p99_redis:.1f} µs |",
        f"| **added by Redis** | **{med_redis - med_mem:.1f} µs** | {p99_redis - p99_mem:.1f} µs |",
        "",
        f"{n_lat} pairs each, after 200 warm-up pairs"
        + (f"; {lat_local} Redis pairs were decided locally after a timeout and are left out." if lat_local
           else "."),
        "",
        f"## Throughput, {args.concurrency} concurrent requests per replica, {args.seconds:g} s",
        "",
        "Only admissions Redis decided count; those decided locally after a round trip "
        "exceeded timeout_s (50 ms) are listed apart with the failed round trips.",
        "",
        "| run | admissions/s per replica | decided locally | failed round trips |",
        "|---|---|---|---|",
        f"| memory store, 1 replica | {one_mem['per_s']:,.0f} | | |",
        f"| Redis, 1 replica | {one['per_s']:,.0f} | {one['local']:,} | {_errors(one)} |",
    ]
    for i, m in enumerate(many):
        lines.append(f"| Redis, {args.replicas} replica processes at once: replica {i + 1} | "
                     f"{m['per_s']:,.0f} | {m['local']:,} | {_errors(m)} |")
    lines += [
        "",
        f"Together the {args.replicas} replicas admitted {sum(per_replica):,.0f}/s through one Redis. "
        f"Target >= {TARGET_PER_S:,}/s per replica: **{'met' if ok else 'NOT met'}**.",
        "After every run Redis held 0 slots and 0 KV tokens (every lease settled exactly once).",
        "",
    ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
