"""overhead_report: what bench_overhead measured (Results, per setup) and its report: one table a
scenario (request path, streaming, highest rate, memory, release, progress entries), issue 17's
targets against every kvgate setup, and the targets of two runs side by side.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate_testkit.httpload import StreamTimes
from kvgate_testkit.reports import machine, pct

P99_LIMIT_S = 0.020


# Targets of issue 17 on this 2-core machine: against the bare processor in the same Envoy
# file where a ratio (the floor of any Python processor moves with the machine's load),
# absolute elsewhere.
TARGETS = {
    "added_p50_16_x_bare": 1.3, "added_p50_1_ms": 1.0, "added_chunk_p50_ms": 0.15,
    "release_p99_ms": 50.0, "cpu_x_bare": 1.3, "rate_per_s": 1500.0, "bytes_per_stream": 2048.0,
}


# Files whose completion refund comes from the response stream (reported usage, or the
# chunks delivered); the others charge the completion at its reservation.
EXACT_REFUND = ("recommended", "four-message", "observe", "endpoint-picker", "access-log",
                "endpoint-picker-log", "endpoint-picker-log-100ms", "endpoint-picker-log-500ms",
                "endpoint-picker-log-60000ms")


@dataclass(frozen=True)
class Sizes:
    """Sizes are the counts of one run (a full run, or ``--quick`` for a smoke test)."""

    latency_requests: dict[int, int]
    latency_rounds: int
    streams: int
    stream_chunks: int
    stream_rounds: int
    rates: tuple[int, ...]
    rate_step_s: float
    open_streams: int
    disconnects: int
    warmup: int
    progress_streams: int
    progress_window_s: float
    progress_samples: int


@dataclass
class RateStep:
    """RateStep is one rung of the max-rate ladder."""

    rate: int
    sent: int
    p99_s: float
    errors: int
    late: bool
    cpu_s: dict[str, float]

    @property
    def ok(self) -> bool:
        return self.errors == 0 and not self.late and self.p99_s < P99_LIMIT_S


@dataclass
class ProgressCost:
    """ProgressCost is what periodic access log entries cost one kvgate setup: ``streams``
    held for ``window_s`` seconds brought ``entries`` progress entries using ``cpu_s``
    seconds of kvgate's CPU; ``late`` are the delays (s) from a client's first chunk to the
    first progress entry of its stream."""

    interval_s: float
    streams: int
    window_s: float
    entries: float
    cpu_s: float
    late: list[float] = field(default_factory=list)


@dataclass
class Results:
    """Results are everything one run measured, per setup."""

    latency: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    latency_cpu: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    streaming: dict[str, StreamTimes] = field(default_factory=dict)
    rates: dict[str, list[RateStep]] = field(default_factory=dict)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    open_streams: int = 0
    release: list[float] = field(default_factory=list)
    setups: list[str] = field(default_factory=list)
    release_by: dict[str, list[float]] = field(default_factory=dict)  # other variants' kvgate
    progress: dict[str, ProgressCost] = field(default_factory=dict)


def best_rung(steps: list[RateStep]) -> RateStep | None:
    """best_rung is the highest rung of the max-rate ladder that passed, or None."""
    passed = [s for s in steps if s.ok]
    return passed[-1] if passed else None


def _f(value: float | None, digits: int = 2) -> str:
    return "" if value is None or value != value else f"{value:.{digits}f}"


def _per_chunk(t: StreamTimes, role: str) -> str:
    """_per_chunk is a role's CPU over a setup's streamed chunks (µs), blank where unmeasured."""
    if role not in t.cpu_s or not t.chunk:
        return ""
    return f"{t.cpu_s[role] / len(t.chunk) * 1e6:.0f} us"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 and value == value else ""


def report(res: Results, *, command: str, variants: Sequence[str], sizes: Sizes, wall_s: float,
           load: tuple[float, float, float]) -> str:
    """report writes the Markdown of one run."""
    lines = [
        "# kvgate on the hot path, side by side with plain Envoy",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}; "
        f"Envoy configuration {', '.join(f'`{v}`' for v in variants)} (one worker thread; "
        "`recommended` is deploy/envoy.yaml). Envoy, kvgate, the processors, the "
        f"fake upstreams and the load generator share the cores. Load average when the run "
        f"started: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Run took {wall_s:.0f} s.",
        "",
        "Setups: `plain` Envoy without ext_proc (the physical limit); `bare` ext_proc to a "
        "Python processor that answers CONTINUE and parses nothing (the floor of any Python "
        "processor; where the file sends the access log to the processor, it takes the "
        "batches and drops them); `kvgate`. *Added* is a setup's figure minus plain Envoy's at the same "
        "percentile; *x plain* is the ratio to plain Envoy's. Times in milliseconds.",
        "",
    ]
    if res.latency:
        lines += _latency_table(res, res.setups)
    if res.streaming:
        lines += _streaming_table(res, res.setups, sizes)
    if res.rates:
        lines += _rates_table(res, res.setups, sizes)
    if res.memory:
        lines += _memory_table(res, res.setups)
    if res.release:
        lines += _release_table(res)
    if res.progress:
        lines += _progress_table(res)
    lines += _targets(res, variants)
    return "\n".join(lines)


def _latency_table(res: Results, setups: Sequence[str]) -> list[str]:
    """_latency_table is the request path table: latency and CPU per request, per client count and setup."""
    lines = ["## Request path: ~2 KB non-streaming chat, every body tokenized", "",
             "| clients | setup | requests | p50 | p99 | added p50 | added p99 | p50 x plain | "
             "processor CPU/req | Envoy CPU/req |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for clients, lat in res.latency.items():
        base50, base99 = pct(lat.get("plain", []), 0.5), pct(lat.get("plain", []), 0.99)
        for setup in setups:
            if setup not in lat:
                continue
            p50, p99 = pct(lat[setup], 0.5), pct(lat[setup], 0.99)
            added = "| | |" if setup == "plain" else f"| {_f((p50 - base50) * 1e3)} | {_f((p99 - base99) * 1e3)} |"
            cpu = res.latency_cpu[clients][setup]
            per = {r: cpu.get(r, 0.0) / len(lat[setup]) * 1e6 for r in ("processor", "envoy")}
            lines.append(f"| {clients} | {setup} | {len(lat[setup])} | {_f(p50 * 1e3)} | "
                         f"{_f(p99 * 1e3)} {added} {_ratio(p50, base50)} | "
                         f"{_f(per['processor'], 0) + ' us' if 'processor' in cpu else ''} | "
                         f"{_f(per['envoy'], 0)} us |")
    return [*lines, ""]


def _streaming_table(res: Results, setups: Sequence[str], sizes: Sizes) -> list[str]:
    """_streaming_table is the streaming table: first chunk, chunk delay and CPU per chunk."""
    st = res.streaming
    plain = st.get("plain", StreamTimes())
    lines = [f"## Streaming: {sizes.streams} concurrent streams, {sizes.stream_chunks} chunks "
             "each at 50 chunks/s", "",
             "Time to first chunk: request sent to first chunk read. Chunk delay: the "
             "upstream's write to the client's read, for every chunk. CPU per chunk: the "
             "process's user + system time over the streams' chunks (their requests' own "
             "cost included).", "",
             "| setup | chunks | first chunk p50 | p99 | added p50 | added p99 | chunk delay p50 | "
             "p99 | added p50 | added p99 | chunk p50 x plain | Envoy CPU/chunk | processor CPU/chunk |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setup in setups:
        if setup not in st:
            continue
        t = st[setup]
        f50, f99, c50, c99 = (pct(t.first, 0.5), pct(t.first, 0.99), pct(t.chunk, 0.5),
                              pct(t.chunk, 0.99))
        if setup == "plain":
            added_f = added_c = "| | |"
        else:
            added_f = f"| {_f((f50 - pct(plain.first, 0.5)) * 1e3)} | {_f((f99 - pct(plain.first, 0.99)) * 1e3)} |"
            added_c = f"| {_f((c50 - pct(plain.chunk, 0.5)) * 1e3, 3)} | {_f((c99 - pct(plain.chunk, 0.99)) * 1e3, 3)} |"
        lines.append(f"| {setup} | {len(t.chunk)} | {_f(f50 * 1e3)} | {_f(f99 * 1e3)} {added_f} "
                     f"{_f(c50 * 1e3, 3)} | {_f(c99 * 1e3, 3)} {added_c} "
                     f"{_ratio(c50, pct(plain.chunk, 0.5))} | {_per_chunk(t, 'envoy')} "
                     f"| {_per_chunk(t, 'processor')} |")
    return [*lines, ""]


def _rates_table(res: Results, setups: Sequence[str], sizes: Sizes) -> list[str]:
    """_rates_table is the max-rate table: each setup's highest rung passed and why the next failed."""
    lines = ["## Highest rate with p99 under 20 ms (open loop, one process each)", "",
             f"Rungs of {sizes.rate_step_s:g} s at {', '.join(str(r) for r in sizes.rates)} "
             "requests/s; a rung fails on p99 >= 20 ms, any error, or a generator that fell "
             "behind its schedule, twice in a row. CPU per request at the highest rung passed.", "",
             "| setup | highest rate (req/s) | x plain | p99 there | processor CPU/req | "
             "Envoy CPU/req | first failed rung |",
             "|---|---:|---:|---:|---:|---:|---|"]
    plain_best = best_rung(res.rates.get("plain", []))
    for setup in setups:
        steps = res.rates.get(setup)
        if steps is None:
            continue
        best = best_rung(steps)
        failed = next((s for s in steps if not s.ok), None)
        why = ("" if failed is None else f"{failed.rate}/s: p99 {_f(failed.p99_s * 1e3)} ms"
               + (f", {failed.errors} errors" if failed.errors else "")
               + (", generator late" if failed.late else ""))
        if best is None:
            lines.append(f"| {setup} | < {steps[0].rate} | | | | | {why} |")
            continue
        per = {r: v / best.sent * 1e6 for r, v in best.cpu_s.items()}
        ratio = _ratio(best.rate, plain_best.rate) if plain_best else ""
        lines.append(f"| {setup} | {best.rate} | {ratio} | {_f(best.p99_s * 1e3)} | "
                     f"{_f(per.get('processor'), 0) + ' us' if 'processor' in per else ''} | "
                     f"{_f(per.get('envoy'), 0)} us | {why} |")
    return [*lines, ""]


def _memory_table(res: Results, setups: Sequence[str]) -> list[str]:
    """_memory_table is the memory table: resident growth per open stream."""
    n = res.open_streams
    lines = [f"## Memory with {n} streams open at once", "",
             "Growth of resident memory from idle (after warm-up) to every stream open and "
             "past its first chunk, divided by the streams.", "",
             "| setup | processor RSS growth | processor bytes/stream | Envoy RSS growth | "
             "Envoy bytes/stream |", "|---|---:|---:|---:|---:|"]
    for setup in setups:
        m = res.memory.get(setup)
        if m is None:
            continue
        proc = m.get("processor")
        lines.append(f"| {setup} | {'' if proc is None else f'{proc / 2**20:.1f} MiB'} | "
                     f"{'' if proc is None else f'{proc / n:.0f}'} | {m['envoy'] / 2**20:.1f} MiB | "
                     f"{m['envoy'] / n:.0f} |")
    return [*lines, ""]


def _release_table(res: Results) -> list[str]:
    """_release_table is the release table: from a client's disconnect to kvgate holding nothing."""
    lines = [f"## Release after a client disconnect ({len(res.release)} disconnects)", "",
             "From the client closing its connection mid-stream to kvgate's "
             "`kvgate_inflight_requests` back at 0 (read every millisecond from `/metrics`, "
             "whose own reading takes about a millisecond).", "",
             "| setup | p50 | p99 | max |", "|---|---:|---:|---:|"]
    for name, r in (("kvgate", res.release), *res.release_by.items()):
        lines.append(f"| {name} | {_f(pct(r, 0.5) * 1e3)} | {_f(pct(r, 0.99) * 1e3)} | "
                     f"{_f(max(r) * 1e3)} |")
    return [*lines, ""]


def _progress_table(res: Results) -> list[str]:
    """_progress_table is the progress table: what periodic access log entries cost kvgate."""
    lines = ["## Progress by periodic access log entries", "",
             "Files whose connection manager writes a periodic entry of every stream in flight "
             "(`access_log_flush_interval`): the streams held open (each after its first chunk), "
             "the progress entries kvgate applied a second against the expected streams / "
             "interval, kvgate's CPU per entry and in all (share of one core), and how late its "
             "node ledger hears of a stream's first token: from the client's read of the first "
             "chunk to the first progress entry counted (read from `/metrics` every millisecond; "
             "blank for an interval longer than the window).",
             "", "| setup | interval (s) | streams | entries/s | expected/s | CPU per entry (us) "
             "| kvgate CPU (% of a core) | first token late p50 (ms) | p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in res.progress.items():
        per_s = c.entries / c.window_s if c.window_s else float("nan")
        lines.append(f"| {name} | {c.interval_s:g} | {c.streams} | {per_s:.0f} | "
                     f"{c.streams / c.interval_s:.0f} | "
                     f"{_f(c.cpu_s / c.entries * 1e6 if c.entries else None, 1)} | "
                     f"{_f(c.cpu_s / c.window_s * 100 if c.window_s else None, 1)} | "
                     f"{_f(pct(c.late, 0.5) * 1e3, 1)} | {_f(pct(c.late, 0.99) * 1e3, 1)} |")
    return [*lines, ""]


def _bare_of(name: str) -> str:
    """_bare_of is the bare setup in the same Envoy file as the kvgate setup ``name``."""
    return "bare" + name.removeprefix("kvgate")


def _added(samples: dict[str, Any], name: str, q: float, attr: str | None = None) -> float | None:
    """_added is setup ``name``'s quantile ``q`` minus plain Envoy's (ms; of ``attr`` of the samples when given)."""
    if name not in samples or "plain" not in samples:
        return None
    mine, plain = samples[name], samples["plain"]
    if attr:
        mine, plain = getattr(mine, attr), getattr(plain, attr)
    return (pct(mine, q) - pct(plain, q)) * 1e3


def _cpu_over_bare(res: Results, name: str) -> float | None:
    """_cpu_over_bare is setup ``name``'s processor CPU per request at 16 clients over its bare processor's."""
    cpu, lat16 = res.latency_cpu.get(16, {}), res.latency.get(16, {})
    if name not in cpu or _bare_of(name) not in cpu or "processor" not in cpu[_bare_of(name)]:
        return None
    mine = cpu[name]["processor"] / len(lat16[name])
    bare = cpu[_bare_of(name)]["processor"] / len(lat16[_bare_of(name)])
    return mine / bare if bare else None


def _targets(res: Results, variants: Sequence[str]) -> list[str]:
    """_targets is issue 17's table: each target against every kvgate setup measured, the
    ratios against the bare processor in the same Envoy file."""
    setups = sorted({n for n in (*res.latency.get(16, {}), *res.streaming, *res.rates, *res.memory)
                     if n.startswith("kvgate")}, key=lambda n: (n != "kvgate", n))
    releases = {"kvgate": res.release, **res.release_by}
    lat1, lat16, st = res.latency.get(1, {}), res.latency.get(16, {}), res.streaming

    def file_of(name: str) -> str:
        return name.partition(" ")[2] or variants[0]

    def cells(measure: Callable[[str], float | None], goal: float, fmt: str, higher: bool = False,
              refund: bool = False) -> list[str]:
        out = []
        for name in setups:
            got = measure(name)
            exact = not refund or file_of(name) in EXACT_REFUND
            ok = got is not None and exact and (got >= goal if higher else got <= goal)
            out.append("" if got is None else
                       f"{got:{fmt}} ({_verdict(ok)}{'' if exact else ', no refund'})")
        return out

    def over_bare(name: str) -> float | None:
        mine, bare = _added(lat16, name, 0.5), _added(lat16, _bare_of(name), 0.5)
        return None if mine is None or not bare else mine / bare

    def rate(name: str) -> float | None:
        best = best_rung(res.rates.get(name, []))
        return None if name not in res.rates else float(best.rate if best else 0)

    def memory(name: str) -> float | None:
        if name not in res.memory or not res.open_streams:
            return None
        return res.memory[name]["processor"] / res.open_streams

    def release(name: str) -> float | None:
        got = releases.get(name)
        return pct(got, 0.99) * 1e3 if got else None

    t = TARGETS
    rows = [
        ("added p50 at 16 clients, x the bare processor's in the same file",
         f"<= {t['added_p50_16_x_bare']}x", cells(over_bare, t["added_p50_16_x_bare"], ".2f")),
        ("added p50 at 1 client (ms)", f"<= {t['added_p50_1_ms']}",
         cells(lambda n: _added(lat1, n, 0.5), t["added_p50_1_ms"], ".2f")),
        ("added p50 per streamed chunk (ms), exact refund", f"<= {t['added_chunk_p50_ms']}",
         cells(lambda n: _added(st, n, 0.5, "chunk"), t["added_chunk_p50_ms"], ".3f", refund=True)),
        ("release after a disconnect, p99 (ms)", f"<= {t['release_p99_ms']:.0f}",
         cells(release, t["release_p99_ms"], ".2f")),
        ("processor CPU per request at 16 clients, x the bare processor's",
         f"<= {t['cpu_x_bare']}x", cells(lambda n: _cpu_over_bare(res, n), t["cpu_x_bare"], ".2f")),
        ("admitted requests/s, one process, p99 < 20 ms", f">= {t['rate_per_s']:.0f}",
         cells(rate, t["rate_per_s"], ".0f", higher=True)),
        ("kvgate memory per in-flight request (B)", f"<= {t['bytes_per_stream']:.0f}",
         cells(memory, t["bytes_per_stream"], ".0f")),
    ]
    rows = [r for r in rows if any(r[2])]
    if not rows:
        return []
    return ["## Targets (issue 17)", "",
            "Ratios are over the bare processor in the same Envoy file and run (`kvgate X` "
            "against `bare X`). The tokenizer target (a 1 MiB prompt never delays another "
            "decision by more than 5 ms) is `make bench-big-prompt`'s (bench/results/big-prompt.md).",
            "", "| target | goal | " + " | ".join(setups) + " |",
            "|---|---|" + "---|" * len(setups),
            *(f"| {name} | {goal} | " + " | ".join(got) + " |" for name, goal, got in rows), ""]


def spread(text: str, previous: str) -> list[str]:
    """spread is the targets table of two runs side by side: each cell of this run's table
    (``text``) followed by the same cell of an earlier report (``previous``), so that the
    spread between runs on the shared machine shows next to each figure."""
    def table(doc: str) -> tuple[list[str], dict[str, list[str]]]:
        part = doc.split("## Targets (issue 17)", 1)
        if len(part) < 2:
            return [], {}
        rows = [line for line in part[1].splitlines() if line.startswith("| ")]
        if not rows:
            return [], {}
        head = [c.strip() for c in rows[0].strip("|").split("|")]
        return head, {cells[0]: cells for cells in
                      ([c.strip() for c in r.strip("|").split("|")] for r in rows[1:])}

    head, now = table(text)
    old_head, before = table(previous)
    if not now or not before:
        return []
    lines = ["## Targets over two runs", "",
             "Each cell: this run, then (in brackets) the run of `--previous`, same command.", "",
             "| " + " | ".join(head) + " |", "|---|---|" + "---|" * (len(head) - 2)]
    for name, cells in now.items():
        old = dict(zip(old_head, before.get(name, [])))
        lines.append("| " + " | ".join(
            c if i < 2 else f"{c} [{old.get(head[i], '') or 'not measured'}]"
            for i, c in enumerate(cells)) + " |")
    return [*lines, ""]


def _verdict(ok: bool) -> str:
    return "meets" if ok else "misses"
