"""helpers: configurations and stores shared by the admission tests (fixtures live in conftest)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from extproc.admission import Admission
from extproc.admission.store.base import Store
from extproc.admission.types import Grant, Plan, PoolUsage, Refusal
from extproc.admission.store.memory import MemoryStore
from extproc.config import ADAPTIVE_DEFAULTS, Config
from extproc.configparse import parse_config

T0 = 1000.0
# How long the signal layer lets the core use signals (aggregate: at + stale_after_s).
STALE_AFTER_S = ADAPTIVE_DEFAULTS.stale_after_s


def no_jitter() -> float:
    """no_jitter is the random draw of a test that checks a retry hint exactly: the hint is
    not spread (``retry.spread`` lengthens it by draw x JITTER)."""
    return 0.0


class Recorder:
    """Recorder is a StoreObserver that remembers what it heard."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.modes: list[str] = []
        self.nodes: dict[str, dict[str, int]] = {}

    def store_error(self, reason: str) -> None:
        self.errors.append(reason)

    def store_mode(self, mode: str) -> None:
        self.modes.append(mode)

    def store_nodes(self, pool: str, held: dict[str, int]) -> None:
        self.nodes[pool] = dict(held)


class YieldingStore(Store):
    """YieldingStore is the in-memory store behind an ``await`` that really suspends.

    It runs the controller's asynchronous paths (the ones a Redis store takes: every
    admission awaits the store, drains in a task, grants that arrive after their waiter left) with the
    real rule and real state, without a network.
    """

    shared = False

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def admit(self, plan: Plan, now: float) -> Grant | Refusal:
        await asyncio.sleep(0)
        return self.inner.admit_now(plan, now)

    def settle(self, grant: Grant, charged_tokens: int, now: float) -> None:
        self.inner.settle(grant, charged_tokens, now)

    def usage(self, pool: str, now: float) -> PoolUsage:
        return self.inner.usage(pool, now)


STORES: dict[str, Callable[[], Store]] = {
    "memory": MemoryStore,
    "yielding": YieldingStore,
}


BASE: dict[str, Any] = {
    "pools": {"default": {"max_concurrency": 4}},
}


def config(**sections: Any) -> Config:
    """config parses BASE with ``sections`` merged in (``pool=`` updates pools.default)."""
    data = copy.deepcopy(BASE)
    pool = sections.pop("pool", None)
    if pool:
        data["pools"]["default"].update(pool)
    data.update(sections)
    return parse_config(data)


def tenants(classes: dict[str, Any], tenants_: dict[str, Any] | None = None,
            default_class: str = "standard") -> dict[str, Any]:
    """tenants builds the ``tenants`` section."""
    return {"classes": classes, "tenants": tenants_ or {}, "default_class": default_class}


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """until yields to the loop until ``predicate`` holds (a store's answer, a task's end).

    This waits for an event, bounded by ``timeout`` seconds of real time, not for time to
    pass: stores that answer over a socket need a few real milliseconds.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    for _ in range(50):
        if predicate():
            return
        await asyncio.sleep(0)
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def quiet(adm: Admission) -> None:
    """quiet lets every ready task run and waits for any wait-queue walk to finish."""
    for _ in range(3):
        await until(lambda: not adm.draining)
        for _ in range(20):
            await asyncio.sleep(0)
