"""stacks: the processes a benchmark runs on loopback ports.

- ``Node``: a simulated vLLM node (``python -m sim``) as the replay benchmarks start it, and
  ``adaptive_for``: kvgate's ``adaptive`` section for nodes run ``speedup`` times faster;
- ``Procs``: one run's processes (simulated nodes, kvgate, the real Envoy), each logging to
  its own file in the run's folder, stopped together, newest first:

      with Procs(workdir) as procs:
          node = procs.start("sim-0", argv)
          kv = procs.kvgate(config)
          envoy = procs.envoy(envoy_config(listen=port, ...), port)

- ``hot_stack``: a hot-path benchmark's stack (kvgate_testkit's ``Stack``): Envoy on one of
  ``variants``' files in front of the fast fake upstream, with kvgate (this tree's or another
  revision's), the bare processor, or nothing behind ext_proc.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import yaml

from bench.variants import PICKED, variant_file
from kvgate_testkit.nodes_stack import MODEL
from kvgate_testkit.procs import LOOPBACK, VENV_BIN, Proc, free_port, wait_until
from kvgate_testkit.stack import Stack
from sim.engine import EngineParams

# kvgate's configuration in the hot-path benchmarks: limits far above the load, so that they
# measure the path, not refusals.
BENCH_CONFIG: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 1000000, "tpm": 10**13, "context_window": 32768,
                          "default_max_tokens": 1024, "tokenizer": "cl100k_base"}},
    "limits": {"max_body_bytes": 1048576},
    "server": {"drain_s": 0, "grace_s": 1},
}


@dataclass(frozen=True, slots=True)
class Kvgate:
    """Kvgate is a started kvgate process and its loopback ports."""

    proc: Proc
    grpc_port: int
    admin_port: int

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"


@dataclass(slots=True)
class Node(EngineParams):
    """Node is the simulated vLLM node the benchmark starts: the simulator's engine settings
    (capacities in tokens, speeds in tokens/s) plus the model's context length (tokens)."""

    max_model_len: int = 32_768

    def argv(self, port: int, speedup: float, seed: int, overflow: str) -> list[str]:
        """argv is the simulator's command line for this node."""
        return [sys.executable, "-m", "sim", "--listen", f"{LOOPBACK}:{port}", "--model", MODEL,
                "--max-model-len", str(self.max_model_len),
                "--kv-capacity-tokens", str(self.kv_capacity_tokens),
                "--block-size", str(self.block_size), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--prefill-tokens-per-s", str(self.prefill_tokens_per_s),
                "--decode-tokens-per-s", str(self.decode_tokens_per_s),
                "--batch-slowdown", str(self.batch_slowdown), "--speedup", str(speedup),
                "--seed", str(seed), "--overflow", overflow,
                # Streams write every 8 tokens (the first at once): TTFT is exact and Envoy,
                # kvgate and the client see 8x fewer chunks on 2 shared cores.
                "--stream-interval", "8", "--log-level", "WARNING"]


def adaptive_for(speedup: float) -> dict[str, Any]:
    """adaptive_for is kvgate's ``adaptive`` section for simulated nodes run ``speedup`` times
    faster than real time: watermarks 0.70/0.85, each duration divided by the speedup (and the
    recovery rate multiplied by it), so that kvgate acts at the same simulated instants."""
    return {"high_watermark": 0.85, "low_watermark": 0.70, "min_scale": 0.6,
            "recovery_per_s": 0.1 * speedup,
            "poll_interval_s": max(0.01, 1.0 / speedup),
            "scrape_timeout_s": max(0.005, 0.5 / speedup),
            "stale_after_s": 3.0 / speedup, "early_scrape_gap_s": 0.2 / speedup}


class Procs:
    """Procs is the processes one run started in ``workdir``, stopped newest first on ``stop``
    or when its ``with`` block ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """start runs ``argv``, its output in ``name``.log."""
        proc = Proc(argv, self.workdir / f"{name}.log", env=env)
        self.procs.append(proc)
        return proc

    def write(self, name: str, config: dict[str, Any]) -> Path:
        """write puts ``config`` in ``name``.yaml and returns its path."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def kvgate(self, config: dict[str, Any], name: str = "kvgate") -> Kvgate:
        """kvgate serves ``config`` on two free ports and returns once both answer."""
        grpc_port, admin_port = free_port(), free_port()
        proc = self.start(name, [sys.executable, "-m", "extproc", "serve", "--config", str(self.write(name, config)),
                                 "--grpc-listen", f"{LOOPBACK}:{grpc_port}",
                                 "--admin-listen", f"{LOOPBACK}:{admin_port}", "--log-level", "warning"])
        proc.wait_port(admin_port)
        proc.wait_port(grpc_port)
        return Kvgate(proc, grpc_port, admin_port)

    def envoy(self, config: dict[str, Any], port: int, name: str = "envoy") -> Proc:
        """envoy runs the real Envoy on ``config`` (one worker thread) and returns once ``port`` answers."""
        proc = self.start(name, [str(VENV_BIN / "envoy"), "-c", str(self.write(name, config)), "--log-level", "error",
                                 "--disable-hot-restart", "--concurrency", "1"])
        proc.wait_port(port)
        return proc

    def died(self) -> str:
        """died names the processes that have exited, as a sentence per process ('' when none)."""
        return "".join(f" {Path(p.argv[0]).name} exited during the run" for p in self.procs if not p.alive())

    def tails(self, chars: int = 1500) -> str:
        """tails is the last ``chars`` characters of each process's output."""
        return "\n".join(f"--- {Path(p.argv[0]).name} (tail) ---\n{p.output()[-chars:]}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def print_tails(workdir: Path, chars: int = 1500) -> None:
    """print_tails prints the last ``chars`` characters of each process log in ``workdir`` to
    stderr: what a failed run's processes said last."""
    for log in sorted(workdir.glob("*.log")):
        print(f"  --- {log.name} (tail) ---\n{log.read_text(errors='replace')[-chars:]}", file=sys.stderr)


def failure(exc: BaseException) -> str:
    """failure is how a run that raised is reported: the error's type and message, at most 2,000
    characters (one run failing must not lose the others' results)."""
    return f"{type(exc).__name__}: {exc}"[:2000]


class SourceStack(Stack):
    """SourceStack is a kvgate stack whose kvgate runs from another copy of the sources
    (``source``: a directory holding an ``extproc`` package), for before/after runs."""

    def __init__(self, workdir: Path, config: dict[str, Any], source: Path, **kwargs: Any) -> None:
        super().__init__(workdir, config, **kwargs)
        self.source = source

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        if name != "kvgate":
            return super()._spawn(name, argv)
        # ``python -m`` puts the working directory first on sys.path: that picks the copy.
        proc = Proc(argv, self.workdir / f"{name}.log", cwd=self.source)
        self.procs[name] = proc
        return proc


def hot_stack(workdir: Path, variant: str, work: Path, processor: str | list[str] | None = "kvgate",
              source: Path | None = None) -> Stack:
    """hot_stack is a stack of Envoy on ``variant``'s file (written to ``work`` where derived)
    in front of the fast fake upstream, with ``processor`` behind ext_proc: ``"kvgate"`` on
    BENCH_CONFIG (run from ``source`` when given), the command of a bare processor, or None
    (plain Envoy, on the recommended file's routes: a picker file needs a processor to name
    the node). In a picker file the processor names the fake upstream as its node."""
    common: dict[str, Any] = {"envoy_template": variant_file("recommended" if processor is None else variant, work),
                              "upstream_args": ["--fast"]}
    if processor == "kvgate" and source is not None:
        stack: Stack = SourceStack(workdir, BENCH_CONFIG, source, **common)
    else:
        stack = Stack(workdir, BENCH_CONFIG if processor == "kvgate" else None, processor=processor, **common)
    if variant in PICKED:
        _picks_the_upstream(stack)
    return stack


def _picks_the_upstream(stack: Stack) -> None:
    """_picks_the_upstream makes a stack of the endpoint-picker file name its fake upstream:
    kvgate's pool gets it as its one node (address and vLLM metrics), the bare processor
    names it in a constant answer."""
    node = f"{LOOPBACK}:{stack.upstream_port}"
    if stack.processor == "kvgate":
        cfg = orjson.loads(orjson.dumps(BENCH_CONFIG))
        cfg["pools"]["default"]["backends"] = [{"name": "node-0", "engine": "vllm", "address": node,
                                                "metrics_url": f"http://{node}/metrics"}]
        stack.kvgate_config = cfg
    elif isinstance(stack.processor, list):
        stack.processor = [*stack.processor, "--destination", node]


def wait_picker_nodes_up(stacks: Iterable[Stack]) -> None:
    """wait_picker_nodes_up waits until every kvgate of ``stacks`` whose pool picks its nodes
    has scraped its node once (before that, every request is refused: no node is up)."""
    for stack in stacks:
        cfg = stack.kvgate_config
        if stack.processor == "kvgate" and cfg is not None and "backends" in cfg["pools"]["default"]:
            wait_until(partial(_picks, stack), timeout=20, what="the picker's node up")


def _picks(stack: Stack) -> bool:
    return stack.metric("kvgate_backend_pickable") == 1
