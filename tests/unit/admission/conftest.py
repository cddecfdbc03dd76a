"""Fixtures of the admission tests: a manual clock, configurations, and the stores to run against.

Every store-level test takes the ``store`` fixture, so a shared store (Redis) joins the
same suite by adding one parameter to ``STORES``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest

from extproc.admission import Admission
from extproc.admission.store.base import Grant, Plan, PoolUsage, Refusal, Store
from extproc.admission.store.memory import MemoryStore
from extproc.clock import ManualClock
from extproc.config import Config, parse_config

T0 = 1000.0


class YieldingStore(Store):
    """YieldingStore is the in-memory store behind an ``await`` that really suspends.

    It runs the controller's asynchronous paths (the ones a Redis store takes: no
    ``try_acquire``, drains in a task, grants that arrive after their waiter left) with the
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


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest) -> Store:
    """store is a fresh store of every kind the suite runs against."""
    return STORES[request.param]()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


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


def admission(cfg: Config, clock: ManualClock, store: Store | None = None) -> Admission:
    return Admission(cfg, clock, store)


def tenants(classes: dict[str, Any], tenants_: dict[str, Any] | None = None,
            default_class: str = "standard") -> dict[str, Any]:
    """tenants builds the ``tenants`` section."""
    return {"classes": classes, "tenants": tenants_ or {}, "default_class": default_class}
