"""reports: how a benchmark writes its report: the command that reproduces it, the machine it
ran on, its percentiles and its cells, and the file it hands in."""

from __future__ import annotations

import argparse
import math
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def publish(out: Path, text: str) -> int:
    """publish writes the report ``text`` to ``out`` (making its folder) and prints it; returns
    the command's exit status, 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


def percentile(values: Sequence[float], q: float) -> float | None:
    """percentile is the nearest-rank ``q`` quantile (0..1) of ``values``: the smallest value
    with at least a share ``q`` of the values at or below it; None if there are none."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, math.ceil(q * len(ranked)) - 1))]


def pct(values: Sequence[float], q: float) -> float:
    """pct is the ``q`` quantile (0..1) of ``values`` at the rank nearest q x (n - 1) (nan when
    empty): the hot-path benchmarks' reading, kept so their figures compare across runs."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def cell(x: float | None, digits: int = 2) -> str:
    """cell is ``x`` with ``digits`` decimals, or ``n/a`` when it is unknown."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def _word(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def command(script: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
            hidden: Sequence[str] = ("out", "raw")) -> str:
    """command is the command line that reproduces ``args``: ``python script`` and each option
    whose value is not its default, in the parser's order, so that a report names exactly the
    run it holds; options in ``hidden`` (where the output goes) are left out."""
    words = [f"python {script}"]
    for action in parser._actions:  # argparse keeps its options only here
        if not action.option_strings or action.dest in ("help", *hidden):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a switch: present when its value is not the default
            words.append(flag)
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            words += [flag, *map(_word, value)]
        elif isinstance(value, list):  # action="append": the option once per value
            words += [w for v in value for w in (flag, _word(v))]
        else:
            words += [flag, _word(value)]
    return " ".join(words)


def chosen(ap: argparse.ArgumentParser, text: str, known: Mapping[str, T], what: str) -> list[T]:
    """chosen is ``known``'s entries for the comma-separated keys in ``text``, in their order; a
    key ``known`` lacks, or none at all, ends the command with a message listing the choices."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        ap.error(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return [known[k] for k in keys]


def machine() -> str:
    """machine says what a run measured on: architecture, the CPU cores this process may use,
    the Python that ran it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return (f"{platform.machine()}, {cores} CPU cores, "
            f"{platform.python_implementation()} {platform.python_version()}")
