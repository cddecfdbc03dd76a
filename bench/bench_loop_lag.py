"""bench_loop_lag: how long the event loop waits while the scraper reads backends, under CPU contention.

kvgate's gRPC event loop shares the GIL with the scraper's worker threads. This measures
the loop's lag (how late a 10 ms ``asyncio.sleep`` wakes up, sampled continuously) in one
process that runs the real ``Scraper`` polling 16 real HTTP backends (a child process)
serving a 54 KB vLLM exposition every ``--poll`` seconds, while ``--burners`` busy
processes compete for the cores. Three setups, interleaved over ``--repeats`` runs so that
the machine's background load falls on all of them alike:

- ``no scraping``: the loop alone (the floor on this machine under this contention);
- ``reads concurrent``: every worker parses as soon as its body arrives (kvgate before);
- ``reads serialized``: one body parsed at a time (``scraper._READ_LOCK``, kvgate now).

    python bench/bench_loop_lag.py [--burners 4] [--seconds 10] [--repeats 3]

Writes bench/results/loop-lag.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from bench.bench_scrape import LOOPBACK, _serve  # noqa: E402
from bench.reports import machine, pct  # noqa: E402
from extproc.clock import MonotonicClock  # noqa: E402
from extproc.configparse import parse_config  # noqa: E402
from extproc.signals import scraper as scraper_mod  # noqa: E402
from extproc.signals.observer import UnobservedScrape  # noqa: E402
from kvgate_testkit import EXPOSITIONS  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE = EXPOSITIONS / "vllm_v1.prom"
TICK_S = 0.01
SETUPS = ("no scraping", "reads concurrent", "reads serialized")


def exposition(size: int) -> bytes:
    """exposition is the vLLM sample grown to ``size`` bytes with more histogram series
    (a busy node with several models and LoRA adapters exports such bodies)."""
    text = SAMPLE.read_text()
    i = 0
    while len(text) < size:
        text += (f'vllm:request_prefill_time_seconds_bucket{{engine="{i % 4}",le="{i}.0",'
                 f'model_name="meta-llama/Llama-3.1-8B-Instruct"}} {i * 3}\n')
        i += 1
    return text.encode()


def burn() -> None:
    """burn keeps one core busy until killed: the CPU contention."""
    while True:
        pass


async def lag(seconds: float) -> list[float]:
    """lag samples how late (seconds) a TICK_S sleep wakes, for ``seconds``."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        await asyncio.sleep(TICK_S)
        out.append(time.monotonic() - t0 - TICK_S)
    return out


def run(setup: str, cfg, seconds: float) -> list[float]:
    """run measures the loop's lag with the scraper polling as ``setup`` says."""
    lock = scraper_mod._READ_LOCK
    if setup == "reads concurrent":
        scraper_mod._READ_LOCK = contextlib.nullcontext()  # type: ignore[assignment]
    scraper = scraper_mod.Scraper(cfg, lambda pool, s: None, UnobservedScrape(), MonotonicClock())
    try:
        if setup != "no scraping":
            scraper.start()
        return asyncio.run(lag(seconds))
    finally:
        scraper.stop()
        scraper_mod._READ_LOCK = lock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=16)
    ap.add_argument("--bytes", type=int, default=54 * 1024)
    ap.add_argument("--burners", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "loop-lag.md", help="the report's path")
    args = ap.parse_args()

    body = exposition(args.bytes)
    ctx = mp.get_context("spawn")
    ports_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(body, args.backends, ports_q, stop), daemon=True)
    child.start()
    burners = [ctx.Process(target=burn, daemon=True) for _ in range(args.burners)]
    started = time.monotonic()
    load = os.getloadavg()
    try:
        ports = [ports_q.get(timeout=30) for _ in range(args.backends)]
        cfg = parse_config({
            "pools": {"default": {"backends": [
                {"name": f"vllm-{i}", "metrics_url": f"http://{LOOPBACK}:{p}/metrics", "engine": "vllm"}
                for i, p in enumerate(ports)]}},
            "adaptive": {"poll_interval_s": args.poll, "scrape_timeout_s": min(0.5, args.poll),
                         "stale_after_s": 3.0},
        })
        for b in burners:
            b.start()
        lags: dict[str, list[float]] = {s: [] for s in SETUPS}
        for _ in range(args.repeats):
            for setup in SETUPS:
                lags[setup] += run(setup, cfg, args.seconds)
    finally:
        for b in burners:
            b.terminate()
        stop.set()
        child.join(10)

    floor = pct(lags["no scraping"], 0.99)
    rows = []
    for setup in SETUPS:
        v = lags[setup]
        p99 = pct(v, 0.99)
        rows.append(f"| {setup} | {len(v)} | {pct(v, 0.5) * 1000:.2f} | {p99 * 1000:.1f} | "
                    f"{pct(v, 0.999) * 1000:.1f} | {max(v) * 1000:.1f} | {p99 / floor:.2f}x |")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"""# Event-loop lag while the scraper reads, under CPU contention

Command: `make bench-loop-lag` (`python bench/bench_loop_lag.py --burners {args.burners} --seconds {args.seconds:g} --repeats {args.repeats}`)

One process: an asyncio loop sampling how late a {TICK_S * 1000:.0f} ms sleep wakes, and the real `Scraper`
polling {args.backends} HTTP backends (a child process) every {args.poll:g} s, each serving a
{len(body)} byte vLLM exposition. {args.burners} busy processes compete for the cores. The setups
run interleaved, {args.repeats} x {args.seconds:g} s each. Lag in milliseconds; *x floor* is a
setup's p99 over the loop's p99 without scraping.

| setup | samples | p50 | p99 | p99.9 | max | p99 x floor |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

Machine: {machine()}, shared
with other work (load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}). Run took
{time.monotonic() - started:.0f} s.
""")
    print(out.read_text())


if __name__ == "__main__":
    main()
