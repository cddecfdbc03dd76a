"""vllm: the real vLLM engine (its CPU build, in its own virtualenv) on a loopback port
(``Engine``, started with ``EngineFlags``), and kvgate with the real Envoy on one of deploy/'s
files in front of engines (``Gate``), with kvgate's configuration for them and the Prometheus
readings of both: for the engine's end-to-end tests and ``bench/bench_vllm.py``.
"""
from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.configparse import parse_config
from extproc.localstack import render_envoy
from kvgate_testkit.procs import LOOPBACK, Kvgate, Proc, Procs, free_port, wait_until
from kvgate_testkit.sampling import descendants

MODEL_NAME = "tiny-llama"
# Envoy's max_message_timeout in both files is 60 s: a class wait above it turns every
# waiting request into a 504 (VLLM-CPU.md), so kvgate's wait stays below it.
MAX_WAIT_S = 45.0
# kvgate's scrape period and timeout of vLLM's /metrics (s), which can take over 0.5 s to
# answer while the engine is busy on this machine's shared cores.
POLL_S = 1.0


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

    def __init__(self, name: str, envoy_file: Path, engines: Sequence[Engine], tokenizer_path: Path,
                 workdir: Path, picking: dict[str, Any] | None = None, kv_budget_fraction: float = 0.9,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.envoy_file = envoy_file
        self.engines = list(engines)
        self.procs = Procs(workdir / name)
        self.envoy_port = free_port()
        self.kvgate_config = kvgate_config([e.port for e in self.engines], self.engines[0].flags,
                                           tokenizer_path, picking, kv_budget_fraction, max_wait_s)
        self.kv: Kvgate | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        assert self.kv is not None, "the gate is not started"
        return self.kv.admin_url

    def start(self) -> Gate:
        """start launches kvgate, waits until it has read every engine's signals, then Envoy."""
        try:
            self.kv = self.procs.kvgate(self.kvgate_config)
            wait_until(lambda: self.metrics().get("kvgate_backend_up") == float(len(self.engines)),
                       timeout=30, what="kvgate's first scrape of every vLLM process")
            cfg = render_envoy(yaml.safe_load(self.envoy_file.read_text()), listen=self.envoy_port,
                               admin=free_port(), grpc=self.kv.grpc_port, upstream=self.engines[0].port)
            self.procs.envoy(cfg, self.envoy_port)
        except BaseException:
            self.stop()
            raise
        return self

    def metrics(self) -> dict[str, float]:
        """metrics reads kvgate's /metrics (see parse_metrics)."""
        return get_metrics(f"{self.admin_url}/metrics", timeout=5)

    def logs(self) -> str:
        return self.procs.tails()

    def stop(self) -> None:
        self.procs.stop()


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

