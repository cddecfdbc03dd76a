"""bench_cpu: kvgate's processor CPU per admitted request against a bare processor's, one lever at a time.

A smaller, steadier cut of ``bench_overhead``'s latency scenario for weighing CPU levers:
for each Envoy file of ``--variants`` one stack with the bare processor (answers CONTINUE,
parses nothing) and one with kvgate, each an Envoy (one worker thread) in front of its own
fast fake upstream; ~2 KB non-streaming chats, every body different (each one tokenized), at
``--clients`` concurrent keep-alive clients. The setups are measured in shuffled rounds
within one run, and the processor's CPU (user + system, from /proc) is summed per setup:
the figure is CPU per request and its ratio to the bare processor's in the same file. A
second table splits it by the processor's threads (user and system time of each, from
/proc/PID/task): which thread the difference is spent on, grpc's poller or the event loop.

``--baseline REF`` adds a ``kvgate@REF`` stack per file: the ``extproc`` package as it is
at git revision REF (checked out into a temporary directory), so that a change is weighed
before and after in the same run, on the same loaded machine.

``--refused-under N`` weighs the cost of a refusal instead: kvgate's pool admits N requests
at once, N streams are held open through each kvgate stack (after a warm-up that teaches it
how long requests hold), and every request of the rounds is refused with a 429 (no bare
processor: it refuses nothing; the ratio is to ``kvgate@REF`` when ``--baseline`` is given).
Under overload nearly every request is refused: what each costs, with N in flight.

    python bench/bench_cpu.py [--variants recommended access-log] [--baseline main] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson

from kvgate_testkit import reports
from kvgate_testkit.bare import COMMAND as BARE
from kvgate_testkit.httpload import ChatBodies, closed_loop, hold_streams, run
from kvgate_testkit.procs import exit_on_sigterm, wait_until
from kvgate_testkit.reports import machine, pct, publish
from kvgate_testkit.revision import checkout
from kvgate_testkit.sampling import cpu_seconds
from kvgate_testkit.stack import Stack
from kvgate_testkit.variants import hot_stack, wait_picker_nodes_up

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"


def _processor_pid(stack: Stack) -> int:
    return stack.procs["kvgate" if "kvgate" in stack.procs else "processor"].pid


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """thread_cpu is the user and system CPU seconds of each thread of a process so far, by
    the thread's name (``comm``) and its rank among the threads of that name (``python#2``:
    threads started alike get names by their order, which stays put between readings)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    seen: collections.Counter[str] = collections.Counter()
    task = Path(f"/proc/{pid}/task")
    for tid in sorted(task.iterdir(), key=lambda t: int(t.name)):
        try:
            comm = (tid / "comm").read_text().strip()
            fields = (tid / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the reading
            continue
        seen[comm] += 1
        out[f"{comm}#{seen[comm]}"] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def _thread_delta(before: dict[str, tuple[float, float]],
                  after: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """_thread_delta is each thread's CPU between two ``thread_cpu`` readings (a thread
    started in between counts from zero; so does a name whose CPU went down: a thread of
    that name ended meanwhile and the ranks moved, so it is another thread)."""
    out = {}
    for name, (u, s) in after.items():
        bu, bs = before.get(name, (0.0, 0.0))
        out[name] = (u, s) if u < bu or s < bs else (u - bu, s - bs)
    return out


async def _rounds(stacks: dict[str, Stack], clients: int, requests: int, rounds: int, seed: int,
                  refused_under: int | None = None,
                  ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, int],
                             dict[str, dict[str, list[float]]]]:
    """_rounds runs ``rounds`` shuffled rounds of ``requests`` requests against every setup;
    returns each setup's processor CPU seconds, latencies (s), request count, and its CPU
    seconds by thread (user, system). With ``refused_under`` that many streams are held
    through each setup after the warm-up, and every request of the rounds is refused."""
    rng = random.Random(seed)
    bodies = ChatBodies(seed=seed)
    for stack in stacks.values():  # warm-up: connections, tokenizer, lazy paths, hold times
        # Under a small cap the log files' releases (at the log's flush) may lag the answers:
        # a warm-up request may then be refused, which teaches no hold time but does no harm.
        await closed_loop(stack.envoy_port, bodies, clients, 300, None if refused_under else 200)
    held = []
    for stack in stacks.values() if refused_under else ():
        wait_until(lambda s=stack: s.metric("kvgate_inflight_requests") == 0, timeout=20,
                   what="the warm-up's requests released")
        held += await hold_streams(stack.envoy_port, refused_under)
    expect = 429 if refused_under else 200
    try:
        return await _measured(stacks, bodies, clients, requests, rounds, rng, expect)
    finally:
        for conn in held:
            conn.close()


async def _measured(stacks: dict[str, Stack], bodies: ChatBodies, clients: int, requests: int,
                    rounds: int, rng: random.Random, expect: int,
                    ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, int],
                               dict[str, dict[str, list[float]]]]:
    cpu: dict[str, float] = collections.defaultdict(float)
    lat: dict[str, list[float]] = collections.defaultdict(list)
    count: dict[str, int] = collections.defaultdict(int)
    threads: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0.0, 0.0]))
    order = list(stacks)
    for i in range(rounds):
        rng.shuffle(order)
        for name in order:
            pid = _processor_pid(stacks[name])
            before, by_thread = cpu_seconds(pid), thread_cpu(pid)
            got = await closed_loop(stacks[name].envoy_port, bodies, clients, requests, expect)
            cpu[name] += cpu_seconds(pid) - before
            for thread, (user, system) in _thread_delta(by_thread, thread_cpu(pid)).items():
                threads[name][thread][0] += user
                threads[name][thread][1] += system
            lat[name].extend(got)
            count[name] += len(got)
        print(f"round {i + 1}/{rounds}: " + ", ".join(
            f"{n} {cpu[n] / count[n] * 1e6:.0f} us" for n in stacks), flush=True)
    return cpu, lat, count, threads


def thread_table(threads: dict[str, dict[str, list[float]]], count: dict[str, int],
                 floor_us: float = 5.0) -> list[str]:
    """thread_table is the markdown table of each setup's CPU per request by thread (user /
    system), busiest first; threads under ``floor_us`` a request are summed as one row."""
    lines = ["| setup | thread | user / req | system / req | total / req |",
             "|---|---|---:|---:|---:|"]
    for name, by_thread in threads.items():
        rest = [0.0, 0.0]
        for thread, (user, system) in sorted(by_thread.items(), key=lambda kv: -sum(kv[1])):
            u, s = user / count[name] * 1e6, system / count[name] * 1e6
            if u + s < floor_us:
                rest[0] += u
                rest[1] += s
                continue
            lines.append(f"| {name} | {thread} | {u:.0f} us | {s:.0f} us | {u + s:.0f} us |")
        if sum(rest):
            lines.append(f"| {name} | (the others) | {rest[0]:.0f} us | {rest[1]:.0f} us | "
                         f"{sum(rest):.0f} us |")
    return lines


def _stacks(args: argparse.Namespace, work: Path) -> dict[str, Stack]:
    """_stacks are the run's setups, by name, for each Envoy file of ``--variants``: the bare
    processor (and its ``--bare-levers``), kvgate, and kvgate at ``--baseline``; with
    ``--refused-under`` kvgate's pool admits that many at once and no bare setup runs."""
    base = checkout(args.baseline, work / "baseline") if args.baseline else None
    stacks: dict[str, Stack] = {}
    for variant in args.variants:
        if not args.refused_under:
            stacks[f"bare {variant}"] = hot_stack(work / f"bare-{variant}", variant, work, BARE)
        for lever in args.bare_levers if not args.refused_under else ():
            stacks[f"bare {lever} {variant}"] = hot_stack(work / f"bare-{lever}-{variant}", variant, work,
                                                          [*BARE, f"--{lever}"])
        stacks[f"kvgate {variant}"] = hot_stack(work / f"kvgate-{variant}", variant, work)
        if base is not None:
            stacks[f"kvgate@{args.baseline} {variant}"] = hot_stack(work / f"kvgate-base-{variant}", variant,
                                                                    work, source=base)
    if args.refused_under:
        for stack in stacks.values():
            cfg = orjson.loads(orjson.dumps(stack.kvgate_config))
            cfg["pools"]["default"]["max_concurrency"] = args.refused_under
            stack.kvgate_config = cfg
    return stacks


def main(argv: list[str] | None = None) -> int:
    """main runs the comparison and writes the report (bench/results/cpu.md by default)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["recommended", "access-log"],
                    choices=("recommended", "four-message", "observe", "reservation", "access-log",
                             "endpoint-picker", "endpoint-picker-log"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000, help="requests per setup and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--baseline", metavar="REF", help="also run kvgate as it is at this git revision")
    ap.add_argument("--bare-levers", nargs="+", default=[], choices=("no-log-sink",),
                    help="extra bare setups per file: `no-log-sink` refuses the access log "
                         "(UNIMPLEMENTED) instead of taking it")
    ap.add_argument("--refused-under", type=int, metavar="N",
                    help="time refusals instead: the pool admits N at once, N streams are held")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu.md")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    load = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-cpu-") as tmp:
        work = Path(tmp)
        stacks = _stacks(args, work)
        try:
            for stack in stacks.values():
                stack.start()
            wait_picker_nodes_up(stacks.values())
            cpu, lat, count, threads = run(_rounds(stacks, args.clients, args.requests, args.rounds,
                                                    args.seed, args.refused_under))
        finally:
            for stack in stacks.values():
                stack.stop()
    command = reports.command("bench/bench_cpu.py", ap, args)
    # The ratio column: to the bare processor, or for refusals to the baseline (or kvgate).
    against = (f"kvgate@{args.baseline}" if args.baseline else "kvgate") if args.refused_under else "bare"
    refused = ([f"Every request of the rounds refused (429) with {args.refused_under} streams held "
                "open through each stack (the pool's max_concurrency); the ratio is to "
                f"{against}'s CPU per refusal.", ""] if args.refused_under else [])
    lines = ["# kvgate's processor CPU per request against a bare processor", "",
             f"Command: `{command}`", "",
             f"Machine: {machine()}; load average at the start {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f}; run took {time.monotonic() - started:.0f} s. ~2 KB non-streaming "
             f"chats at {args.clients} clients, {args.rounds} shuffled rounds of "
             f"{args.requests} requests per setup. CPU: user + system of the processor process "
             "(from /proc), per request.", "", *refused,
             f"| file | setup | requests | p50 (ms) | p99 (ms) | processor CPU/req | x {against} |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for variant in args.variants:
        reference = f"{against} {variant}"
        ref_cpu = cpu[reference] / count[reference]
        for name in stacks:
            if not name.endswith(" " + variant):
                continue
            per = cpu[name] / count[name]
            lines.append(f"| {variant} | {name.rsplit(' ', 1)[0]} | {count[name]} | "
                         f"{pct(lat[name], 0.5) * 1e3:.2f} | {pct(lat[name], 0.99) * 1e3:.2f} | "
                         f"{per * 1e6:.0f} us | {per / ref_cpu:.2f}x |")
    lines += ["", "## By thread", "",
              "The processor's CPU per request split by its threads (from /proc/PID/task; "
              "`comm` names them, `#n` is the order among threads of one name). Ticks are "
              f"1/{os.sysconf('SC_CLK_TCK')} s: a thread's figure may be off by up to "
              f"{1e6 / os.sysconf('SC_CLK_TCK') / args.requests:.1f} us a request (a tick "
              "a round); threads under 5 us a request are summed.", "",
              *thread_table(threads, count)]
    return publish(args.out, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
