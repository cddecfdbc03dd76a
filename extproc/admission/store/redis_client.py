"""redis_client: the Redis store's round trips: pipelined scripts within a timeout.

``RedisClient`` owns the connection pool of one replica and sends lists of ``EVALSHA``
commands (``redis_lua.Script.command``) in one pipeline. Every way a round trip can fail
becomes one ``RoundTripError`` with a bounded reason (``ERROR_REASONS``); what the store
does about it (``fallback``) is not decided here. Scripts that Redis lost (a restart,
``SCRIPT FLUSH``) are loaded again and the round trip is sent once more: every script of
the store is safe to repeat. Before the scripts are loaded again, the commands the store
asks for when it hears of the loss go first (``scripts_lost``): until the scripts are
back no replica can run one, so those commands land before any script on the new server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.admission.store.redis_lua import SCRIPTS
from extproc.admission.types import ERROR_CONNECTION, ERROR_INTERNAL, ERROR_RESPONSE, ERROR_TIMEOUT
from extproc.config import RedisStoreConfig

MAX_CONNECTIONS = 32
"""MAX_CONNECTIONS is the default pool size per replica: enough for concurrent admissions
without one connection per request."""


class RoundTripError(Exception):
    """RoundTripError is one failed round trip, with its ``reason`` (one of ``ERROR_REASONS``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class RedisClient:
    """RedisClient sends one replica's scripts to Redis: at most ``timeout_s`` (s) a round trip.

    ``scripts_lost`` is called when Redis answered NOSCRIPT (it restarted or was flushed),
    once per loss: not for a round trip sent before this client loaded the scripts again
    (its NOSCRIPT is that same loss); the plain commands it returns are sent before the
    scripts are loaded again. ``where`` names the server for log lines, without
    credentials.
    """

    __slots__ = ("_client", "_timeout", "_scripts_lost", "_loads", "where")

    def __init__(self, config: RedisStoreConfig, replica_id: str,
                 scripts_lost: Callable[[], Sequence[tuple[Any, ...]]],
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._timeout = config.timeout_s
        self._scripts_lost = scripts_lost
        self._loads = 0  # how many times this client loaded the scripts
        pool = aioredis.BlockingConnectionPool.from_url(
            config.url, max_connections=max_connections, timeout=config.timeout_s,
            socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
            # One immediate retry on a new connection when a pooled one turns out dead
            # (Redis restarted, an idle connection was cut): that is not an outage.
            # Every script here is safe to repeat; timeouts are not retried.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            client_name=f"kvgate-{replica_id}")
        self._client = aioredis.Redis(connection_pool=pool)
        self.where = _describe(pool)

    async def round_trip(self, cmds: Sequence[tuple[Any, ...]]) -> list[Any]:
        """round_trip sends ``cmds`` (EVALSHA) in one pipeline within timeout_s and returns
        their replies; loads the scripts and sends again once on NOSCRIPT. Raises
        ``RoundTripError``."""
        first: Sequence[tuple[Any, ...]] | None = ()
        loads = self._loads
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(self._timeout):
                    if attempt and first is not None:
                        await self._load_scripts(first)
                    results = await self._send(cmds, retry_lost=attempt == 0)
            except (TimeoutError, RedisTimeoutError) as exc:
                raise RoundTripError(ERROR_TIMEOUT, f"no answer within {self._timeout}s") from exc
            except (RedisConnectionError, OSError) as exc:
                raise RoundTripError(ERROR_CONNECTION, str(exc) or type(exc).__name__) from exc
            except RedisError as exc:
                raise RoundTripError(ERROR_RESPONSE, str(exc) or type(exc).__name__) from exc
            except (RuntimeError, EOFError, AttributeError) as exc:
                # What a client library raises on a connection that died under it: uvloop
                # answers a write to a reset transport with RuntimeError ("the handler is
                # closed"), which redis-py lets through. The connection is gone, not Redis.
                raise RoundTripError(ERROR_CONNECTION, f"{type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                raise RoundTripError(ERROR_INTERNAL, f"{type(exc).__name__}: {exc}") from exc
            if results is None:
                # Sent before another round trip met the loss and loaded the scripts: that
                # loss is handled (a fresh server's first round trips all meet NOSCRIPT), so
                # send again as is; a NOSCRIPT then is a new loss, and fails this round trip
                # rather than load the scripts past it: the next one meets it and says so.
                first = self._scripts_lost() if self._loads == loads else None
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise RoundTripError(ERROR_RESPONSE, str(r) or type(r).__name__)
            return results
        raise AssertionError("unreachable")

    async def _send(self, cmds: Sequence[tuple[Any, ...]], retry_lost: bool) -> list[Any] | None:
        """_send is one attempt: the replies, errors among them, or None when Redis lost the
        scripts and ``retry_lost`` allows another attempt."""
        if len(cmds) == 1:
            try:
                return [await self._client.execute_command(*cmds[0])]
            except NoScriptError:
                if retry_lost:
                    return None
                raise
        pipe = self._client.pipeline(transaction=False)
        for cmd in cmds:
            pipe.execute_command(*cmd)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        if retry_lost and any(isinstance(r, NoScriptError) for r in results):
            return None
        return results

    async def _load_scripts(self, first: Sequence[tuple[Any, ...]]) -> None:
        for cmd in first:
            await self._client.execute_command(*cmd)
        for script in SCRIPTS:
            await self._client.execute_command("SCRIPT", "LOAD", script.source)
        self._loads += 1

    async def forget(self, key: str, member: str) -> None:
        """forget removes ``member`` from the zset ``key`` (this replica's heartbeat), within
        timeout_s; raises whatever the client raised."""
        async with asyncio.timeout(self._timeout):
            await self._client.zrem(key, member)

    async def aclose(self) -> None:
        """aclose closes every connection."""
        await self._client.aclose()


def _describe(pool: aioredis.ConnectionPool) -> str:
    """_describe names the Redis server for log lines, without credentials."""
    kw = pool.connection_kwargs
    if "path" in kw:
        return f"unix:{kw['path']}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
