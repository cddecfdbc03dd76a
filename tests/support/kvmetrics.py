"""kvmetrics: reading a running kvgate's /metrics, for the stacks of the tests and benchmarks."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

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
