"""redis_server: a real ``redis-server`` for tests, on a free loopback port, with no persistence.

Tests that share a budget through Redis start their own server with ``RedisServer`` and
stop it when done; ``restart`` brings it back on the same port with empty memory (what a
crashed Redis without persistence looks like to kvgate).
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from extproc.admission.store.redis import RedisStore
from extproc.clock import Clock
from extproc.config import RedisStoreConfig
from tests.support.procs import LOOPBACK, Proc, free_port, wait_until


def redis_server_binary() -> str | None:
    """redis_server_binary returns the path of ``redis-server`` on PATH, or None."""
    return shutil.which("redis-server")


def _ping(port: int) -> bool:
    """_ping sends an inline PING and tells whether the server answered +PONG.

    A raw socket rather than redis-py, so that the helper tests the server, not the client.
    """
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """RedisServer is one ``redis-server`` child process on 127.0.0.1:``port``.

    Started with ``--save "" --appendonly no``: nothing is written to disk, and a
    restart comes back empty.
    """

    def __init__(self, workdir: Path | None = None, port: int | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (.ci/run installs Debian's redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
        self.proc: Proc | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        """url is the ``redis://`` URL of database 0 on this server."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """start launches the server and waits until it answers PING; returns self."""
        if self.proc is not None and self.proc.alive():
            return self
        self._starts += 1
        argv = [self.binary, "--port", str(self.port), "--bind", LOOPBACK,
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--protected-mode", "yes", "--loglevel", "warning"]
        self.proc = Proc(argv, self.workdir / f"redis-{self._starts}.log")
        proc = self.proc

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"redis-server exited early:\n{proc.output()[-2000:]}")
            return _ping(self.port)

        wait_until(ready, timeout=timeout, what=f"redis-server on port {self.port}")
        return self

    def alive(self) -> bool:
        """alive tells whether the server process is running."""
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        """stop ends the server with SIGTERM (SIGKILL if it lingers) and waits for it."""
        if self.proc is not None:
            self.proc.signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.stop(timeout=5.0)

    def kill(self) -> None:
        """kill ends the server with SIGKILL: a crash, nothing flushed."""
        if self.proc is not None:
            self.proc.kill()

    def pause(self) -> None:
        """pause stops the server with SIGSTOP: connections stay open, nothing answers (a stall)."""
        if self.proc is not None:
            self.proc.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """resume lets a paused server run again with SIGCONT."""
        if self.proc is not None:
            self.proc.signal(signal.SIGCONT)

    def restart(self) -> None:
        """restart kills the server and starts a fresh, empty one on the same port."""
        self.kill()
        wait_until(lambda: not _ping(self.port), timeout=5.0, what="redis-server to go away")
        self.start()

    def close(self) -> None:
        """close stops the server and removes its working directory if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- pytest fixtures (imported by the conftest files that offer a Redis store) ---------

@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """redis_server is one real redis-server for the test session (skipped when not installed)."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (.ci/run installs Debian's redis-server)")
    with RedisServer() as server:
        yield server


@pytest.fixture
async def redis_store(redis_server: RedisServer, clock: Clock) -> AsyncIterator[RedisStore]:
    """redis_store is a RedisStore on the session's server, under a key prefix of its own.

    It takes its instants from the callers (``clock``, the test's manual clock), so that
    the suite's fixed-instant tests run unchanged against Redis; its timeout is 2 s, as
    the suite checks the rule, not the speed of Redis on a busy machine.
    """
    # A generous timeout: these tests check the rule, not Redis's speed on a busy machine.
    cfg = RedisStoreConfig(url=redis_server.url, key_prefix=f"t{secrets.token_hex(6)}:", timeout_s=2.0)
    store = RedisStore(cfg, clock=clock)
    yield store
    await store.close()
