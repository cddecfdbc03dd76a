"""exposition: Prometheus text exposition -> the wanted samples, indexed by sample name.

Pure. Two steps, both needed because backends are outside input and the parse is paid
every second for every backend:

1. one scan of the whole body for lines that are neither a comment, blank, nor shaped
   like a sample (``name{labels} value [timestamp]``): such a body is garbage or an
   error page, refused as ``parse``;
2. only the lines of the wanted sample names go through ``prometheus_client``'s parser,
   which checks them fully (labels, escapes, values). A vLLM exposition is ~200 lines
   of which 6 are read: this costs about a fifth of parsing everything.

Samples are indexed by their *sample* name (``vllm:num_preemptions_total``), not by the
family name the parser derives (``vllm:num_preemptions``): the sample name is what
engines document, and it does not depend on ``# TYPE`` lines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from extproc.signals.sample import ScrapeError, ScrapeFailure

_VALUE = r"[-+]?(?:[0-9.][0-9.eE+-]*|Inf|inf|NaN|nan)"
_BAD_LINE = re.compile(
    r"^[ \t]*+(?!#|$|[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^\n]*\})?[ \t]+" + _VALUE +
    r"(?:[ \t]+-?[0-9]+)?[ \t\r]*$)[^\n]*", re.M)


@dataclass(frozen=True, slots=True)
class Series:
    """Series is one sample line: its labels and its value."""

    labels: Mapping[str, str]
    value: float


Index = Mapping[str, list[Series]]


class Selector:
    """Selector picks the lines of a fixed set of sample names out of an exposition."""

    __slots__ = ("wanted", "_lines")

    def __init__(self, wanted: frozenset[str]) -> None:
        self.wanted = wanted
        names = "|".join(re.escape(n) for n in sorted(wanted, key=len, reverse=True))
        # A name must be followed by '{' or a blank, so "x" never picks "x_total".
        self._lines = re.compile(r"^[ \t]*(?:" + names + r")(?:\{[^\n]*\})?[ \t][^\n]*", re.M)

    def lines(self, text: str) -> list[str]:
        """lines returns the sample lines of the wanted names, in order."""
        return self._lines.findall(text)


def parse(body: bytes, selector: Selector) -> dict[str, list[Series]]:
    """parse reads an exposition body and keeps the samples the selector wants.

    Raises ``ScrapeFailure(parse)`` for text that is not UTF-8, an HTML page, a body
    cut short (the format ends every line, the last one included, with a newline: a
    body that does not was truncated, and its last value may be cut, "0.93" read as
    "0."), a line that is not a sample, and anything the parser refuses. An empty body
    parses to an empty index (the extractor then reports the metrics as missing).
    """
    if not body.strip():
        return {}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeFailure(ScrapeError.PARSE, "body is not UTF-8 text") from None
    if text.lstrip()[:1] == "<":
        raise ScrapeFailure(ScrapeError.PARSE, "body is an HTML page, not Prometheus text")
    if not text.endswith("\n"):
        raise ScrapeFailure(ScrapeError.PARSE, "body does not end with a newline: truncated")
    bad = _BAD_LINE.search(text)
    if bad is not None:
        raise ScrapeFailure(ScrapeError.PARSE, f"not a sample line: {bad.group(0)[:80]!r}")
    index: dict[str, list[Series]] = {}
    lines = selector.lines(text)
    if not lines:
        return index
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in family.samples:
                if s.name in selector.wanted:
                    index.setdefault(s.name, []).append(Series(s.labels, float(s.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on hostile text
        raise ScrapeFailure(ScrapeError.PARSE, f"not Prometheus text: {str(exc)[:120]}") from None
    return index
