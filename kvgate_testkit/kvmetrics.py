"""kvmetrics: what the stacks of the tests and benchmarks share: their loopback ports and
reading the running kvgate's /metrics."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvgate_testkit.procs import LOOPBACK, Proc, free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class KvgateMetrics:
    """KvgateMetrics reads the /metrics of the kvgate at ``admin_url`` (set by the stack using it)."""

    admin_url: str

    def metrics(self) -> Samples:
        """metrics reads kvgate's /metrics: {(sample name, sorted labels): value}."""
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """metric sums the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.metrics().items() if n == name and want <= set(ls))


class LoopbackStack(KvgateMetrics):
    """LoopbackStack holds the free loopback ports of kvgate (gRPC, admin) and Envoy, and the
    child processes of a stack by name."""

    def __init__(self) -> None:
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.envoy_port = free_port()
        self.procs: dict[str, Proc] = {}

    @property
    def base_url(self) -> str:
        """base_url is Envoy's listener, where requests go."""
        return f"http://{LOOPBACK}:{self.envoy_port}"

    @property
    def admin_url(self) -> str:  # type: ignore[override]
        """admin_url is kvgate's admin server (/metrics)."""
        return f"http://{LOOPBACK}:{self.admin_port}"
