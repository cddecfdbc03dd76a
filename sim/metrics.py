"""metrics: the simulator's ``/metrics`` page in vLLM V1's names, labels and types.

The page is built at scrape time from an engine snapshot (a custom collector on the
simulator's own ``CollectorRegistry``), so it always matches the engine's state and no
gauge has to be kept in step by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sim.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """EngineCollector yields vLLM V1's engine metrics from ``snapshot()``.

    Labels ``model_name`` (the served model) and ``engine="0"`` (one engine per
    simulator), as vLLM labels them; ``vllm:cache_config_info`` carries the cache
    configuration as labels with value 1.
    """

    def __init__(self, snapshot: Callable[[], EngineStats], model_name: str, block_size: int) -> None:
        self._snapshot = snapshot
        self._model = model_name
        self._block_size = block_size

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        names = ["model_name", "engine"]
        values = [self._model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    s.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.generation_tokens)
        # vLLM exports both with or without prefix caching (0 without).
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], s.finished.get(reason, 0))
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching",
                                         "engine", "num_gpu_blocks", "kv_cache_size_tokens"])
        info.add_metric([str(self._block_size), "auto", str(s.prefix_caching), "0", str(s.total_blocks),
                         str(s.total_blocks * self._block_size)], 1.0)
        yield info
        yield counter("kvgate_sim_crashes", "Times the simulated engine ran out of KV blocks with "
                      "--overflow crash and failed every running request (simulator only).", s.crashes)


def make_registry(snapshot: Callable[[], EngineStats], model_name: str, block_size: int) -> CollectorRegistry:
    """make_registry returns a fresh registry holding only the simulator's engine metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(snapshot, model_name, block_size))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """render returns the registry in the Prometheus text format (what ``/metrics`` serves)."""
    return generate_latest(registry)
