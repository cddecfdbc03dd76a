"""sampling: what a benchmark reads from the processes it runs while it runs: kvgate's and the
nodes' Prometheus readings and the simulated nodes' state, and the wait for kvgate's first
fresh scrape before load starts."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families


def readings(text: str, names: Collection[str] | None = None,
             labels: Mapping[str, Sequence[str]] | None = None) -> dict[str, float]:
    """readings sums a Prometheus exposition's samples by name (those in ``names``; every name
    when None). A name in ``labels`` is kept per the values of its listed labels instead,
    under ``name/value/...`` (e.g. ``kvgate_backend_picks_total/sim-0``)."""
    labels = labels or {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            per = labels.get(s.name)
            if per is not None:
                key = "/".join([s.name, *(s.labels.get(label, "") for label in per)])
            elif names is None or s.name in names:
                key = s.name
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def fetch_readings(url: str, timeout: float = 5.0, **how: Any) -> dict[str, float]:
    """fetch_readings is ``readings`` of the exposition at ``url`` (``timeout`` in seconds)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return readings(resp.read().decode(), **how)


def wait_fresh(admin_url: str, fresh: Callable[[dict[str, float]], bool], timeout: float = 10.0) -> None:
    """wait_fresh returns once kvgate's /metrics at ``admin_url`` satisfy ``fresh`` (by default:
    it has scraped its nodes, so a run does not start while kvgate counts them as stale);
    raises TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if fresh(fetch_readings(f"{admin_url}/metrics", timeout=2)):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("kvgate did not report fresh backend signals in time")


def scraped(m: dict[str, float]) -> bool:
    """scraped says kvgate's readings ``m`` show fresh node signals: no pool alarm, full scale."""
    return m.get("kvgate_pool_alarm") == 0.0 and m.get("kvgate_admission_scale") == 1.0


async def node_state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """node_state is a simulated node's /sim/state (KV blocks, running, waiting, preemptions...)."""
    async with session.get(f"{url}/sim/state") as resp:
        state: dict[str, Any] = await resp.json(loads=orjson.loads)
        return state


async def preemptions(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[int]:
    """preemptions is each simulated node's preemption count, in the order of ``urls``."""
    return [(await node_state(session, url))["preemptions"] for url in urls]


def rss_bytes(pid: int) -> int:
    """rss_bytes is a process's resident memory (bytes, from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """cpu_seconds is the user + system CPU time a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """descendants lists the processes below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
