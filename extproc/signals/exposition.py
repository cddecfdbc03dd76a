"""exposition: Prometheus text exposition -> the wanted samples, indexed by sample name.

Pure. Parsing is ``prometheus_client``'s own parser; this module adds the checks the
parser does not make, so that hostile bodies fail loudly instead of being half-read.
Samples are indexed by their *sample* name (``vllm:num_preemptions_total``), not by the
family name the parser derives (``vllm:num_preemptions``), because the sample name is
what engines document and what survives both exposition styles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from extproc.signals.sample import ScrapeError, ScrapeFailure


@dataclass(frozen=True, slots=True)
class Series:
    """Series is one sample line: its labels and its value."""

    labels: Mapping[str, str]
    value: float


Index = Mapping[str, list[Series]]


def parse(body: bytes, wanted: frozenset[str]) -> dict[str, list[Series]]:
    """parse reads an exposition body and keeps the samples whose name is in ``wanted``.

    Raises ``ScrapeFailure(parse)`` for text that is not UTF-8, an HTML page, a body
    cut short (the format ends every line, the last one included, with a newline: a
    body that does not was truncated, and its last value may be cut, "0.93" read as
    "0.") and anything the parser refuses. An empty body parses to an empty index
    (the extractor then reports the metrics as missing).
    """
    if not body.strip():
        return {}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeFailure(ScrapeError.PARSE, "body is not UTF-8 text") from None
    head = text.lstrip()[:64].lower()
    if head.startswith(("<", "<!doctype")):
        raise ScrapeFailure(ScrapeError.PARSE, "body is an HTML page, not Prometheus text")
    if not text.endswith("\n"):
        raise ScrapeFailure(ScrapeError.PARSE, "body does not end with a newline: truncated")
    index: dict[str, list[Series]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in wanted:
                    index.setdefault(s.name, []).append(Series(s.labels, float(s.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on hostile text
        raise ScrapeFailure(ScrapeError.PARSE, f"not Prometheus text: {str(exc)[:120]}") from None
    return index
