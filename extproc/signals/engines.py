"""engines: the metric-name mapping and extractor of each supported engine.

``read(engine, body, model_name)`` is the whole pure path from a response body to a
``NodeSample``: parse only the engine's metric names, then extract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from extproc.signals import dcgm, sglang, tgi, vllm
from extproc.signals.exposition import Index, Selector, parse
from extproc.signals.sample import NodeSample


@dataclass(frozen=True, slots=True)
class Engine:
    """Engine names the sample names an engine exports and how to read them."""

    name: str
    selector: Selector
    extract: Callable[[Index, str | None], NodeSample]


ENGINES: Mapping[str, Engine] = MappingProxyType({
    "vllm": Engine("vllm", Selector(vllm.WANTED), vllm.extract),
    "sglang": Engine("sglang", Selector(sglang.WANTED), sglang.extract),
    "tgi": Engine("tgi", Selector(tgi.WANTED), tgi.extract),
    "dcgm": Engine("dcgm", Selector(dcgm.WANTED), dcgm.extract),
})


def read(engine: str, body: bytes, model_name: str | None = None) -> NodeSample:
    """read turns one metrics response body of ``engine`` into a ``NodeSample``.

    Raises ``ScrapeFailure(parse)`` when the body is not a Prometheus exposition and
    ``KeyError`` for an engine the configuration could not have accepted.
    """
    e = ENGINES[engine]
    return e.extract(parse(body, e.selector), model_name)
