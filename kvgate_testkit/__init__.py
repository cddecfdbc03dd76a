"""kvgate_testkit: the harness the tests and the benchmarks share (not part of kvgate).

Real processes on free loopback ports, started and stopped by the caller: ``procs`` (a
process, a free port, waiting on a condition), ``upstream`` (a fast OpenAI-shaped fake
inference server), ``stack`` (the real Envoy with kvgate and the fake upstream),
``nodes_stack`` (simulated nodes that kvgate picks among), ``redis_server`` (a real
Redis-protocol server), ``kvmetrics`` (reading kvgate's /metrics) and ``promtool``
(Prometheus's rule checker); ``stream`` (one ext_proc stream fed to kvgate's request
stages in-process, the unit tests' seam on a request); ``EXPOSITIONS``, engines' /metrics
samples. It lives beside ``tests/`` and ``bench/`` so that neither
imports the other; it needs the dev extra (``make install``) and is not in the
distribution.
"""

from pathlib import Path

EXPOSITIONS = Path(__file__).resolve().parent / "expositions"
"""EXPOSITIONS holds Prometheus expositions shaped like each engine's real /metrics (vLLM V0
and V1, data-parallel, SGLang, TGI, DCGM): for the scrape parsers' tests and benchmarks."""
