"""signals: backend feedback for the adaptive limits.

Polls each configured backend's Prometheus endpoint (vLLM, SGLang, TGI, DCGM), reads
KV-cache usage, queues and KV capacity, and hands each pool's ``PoolSignals`` to the
admission core. Split as *poll* (``poll.fetch``: bounded HTTP GET), *extract* (pure:
``engines.read`` -> ``NodeSample``, one module per engine with its metric names) and
*aggregate* (pure: node samples and ages -> ``PoolSignals``), driven by ``Scraper``.
"""

from extproc.signals.aggregate import NodeReading, aggregate
from extproc.signals.engines import ENGINES, read
from extproc.signals.observer import UnobservedScrape, ScrapeObserver
from extproc.signals.poll import fetch
from extproc.signals.sample import NodeSample, Problem, ScrapeError, ScrapeFailure
from extproc.signals.scraper import Scraper

__all__ = [
    "ENGINES", "NodeReading", "NodeSample", "UnobservedScrape", "Problem", "ScrapeError",
    "ScrapeFailure", "ScrapeObserver", "Scraper", "aggregate", "fetch", "read",
]
