"""kvgate_testkit: the harness the tests and the benchmarks share (not part of kvgate).

Real processes on free loopback ports, started and stopped by the caller: ``procs`` (a
process, a free port, waiting on a condition, a run's processes), ``upstream`` (a fast
OpenAI-shaped fake inference server), ``stack`` (the real Envoy with kvgate and the fake
upstream), ``nodes_stack`` (simulated nodes that kvgate picks among), ``variants`` (the
Envoy files the hot-path benchmarks compare, and a stack on each), ``bare`` (the bare
processor), ``vllm`` (the real vLLM engine), ``redis_server`` (a real Redis-protocol
server), ``kvmetrics`` (reading kvgate's /metrics) and ``promtool`` (Prometheus's rule
checker); ``stream`` (one ext_proc stream fed to kvgate's request stages in-process, the
unit tests' seam on a request). Load and what a run reads and writes: ``load`` (replayed
workloads), ``httpload`` (the hot path's load generator), ``sampling``, ``reports`` and
``revision`` (kvgate at another git revision); ``EXPOSITIONS``, engines' /metrics
samples. It lives beside ``tests/`` and ``bench/``, which both take their stacks from it;
it needs the dev extra (``make install``) and is not in the
distribution.
"""

from pathlib import Path

EXPOSITIONS = Path(__file__).resolve().parent / "expositions"
"""EXPOSITIONS holds Prometheus expositions shaped like each engine's real /metrics (vLLM V0
and V1, data-parallel, SGLang, TGI, DCGM): for the scrape parsers' tests and benchmarks."""
