"""procs: start and stop the real processes tests and benchmarks need, on free loopback ports."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"


def exit_on_sigterm() -> None:
    """exit_on_sigterm makes SIGTERM end this process as Ctrl-C does, by an exception, so that
    the ``finally`` blocks that stop the processes it started still run: each runs in a
    session of its own (``Proc``), and nothing else would stop them."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)


def _ephemeral_floor() -> int:
    """_ephemeral_floor is the lowest port the kernel hands to outgoing connections here."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PICKER = random.Random(os.getpid() ^ time.monotonic_ns())
_HANDED: set[int] = set()


def free_port() -> int:
    """free_port returns a TCP port on 127.0.0.1 that was free a moment ago.

    It is drawn at random below the kernel's ephemeral range, not from it: a port the kernel
    picked for ``bind(0)`` is also the kind it picks for the source port of any outgoing
    connection, so between this call and the server's bind another test process's client
    could take it (seen as grpc's "Failed to bind" when suites ran side by side). A port
    already handed out by this process is not handed out again.
    """
    high = min(_ephemeral_floor(), 65536)
    low = max(1024, high - 20000)
    for _ in range(200):
        port = _PICKER.randrange(low, high)
        if port in _HANDED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02,
               what: str = "condition") -> None:
    """wait_until polls ``predicate`` until it is true, failing after ``timeout`` seconds.

    This waits for an event in another process (a port opening, a metric changing), not
    for time to pass: the predicate is what the test depends on.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
            last_exc = None  # the error named is the last answer's, not an early one's
        except Exception as exc:  # the other process may not be up yet
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" +
                       (f" (last error: {last_exc!r})" if last_exc else ""))


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """port_open tells whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class Proc:
    """Proc is a child process whose output goes to a log file, stopped on exit."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=full_env, cwd=str(cwd or ROOT), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """stop sends SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=5)

    def wait_port(self, port: int, timeout: float = 20.0) -> None:
        """wait_port waits until the process listens on ``port``; fails early if it died."""
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.argv[0]} exited early:\n{self.output()[-3000:]}")
            return port_open(port)
        try:
            wait_until(ready, timeout=timeout, what=f"{self.argv[0]} on port {port}")
        except TimeoutError:
            raise TimeoutError(f"{self.argv[0]} not listening on {port}:\n{self.output()[-3000:]}")


@dataclass(frozen=True, slots=True)
class Kvgate:
    """Kvgate is a started kvgate process and its loopback ports."""

    proc: Proc
    grpc_port: int
    admin_port: int

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"


class Procs:
    """Procs is the processes one run started in ``workdir``, stopped newest first on ``stop``
    or when its ``with`` block ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """start runs ``argv``, its output in ``name``.log."""
        proc = Proc(argv, self.workdir / f"{name}.log", env=env)
        self.procs.append(proc)
        return proc

    def write(self, name: str, config: dict[str, Any]) -> Path:
        """write puts ``config`` in ``name``.yaml and returns its path."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def kvgate(self, config: dict[str, Any], name: str = "kvgate") -> Kvgate:
        """kvgate serves ``config`` on two free ports and returns once both answer."""
        grpc_port, admin_port = free_port(), free_port()
        proc = self.start(name, [sys.executable, "-m", "extproc", "serve", "--config", str(self.write(name, config)),
                                 "--grpc-listen", f"{LOOPBACK}:{grpc_port}",
                                 "--admin-listen", f"{LOOPBACK}:{admin_port}", "--log-level", "warning"])
        proc.wait_port(admin_port)
        proc.wait_port(grpc_port)
        return Kvgate(proc, grpc_port, admin_port)

    def envoy(self, config: dict[str, Any], port: int, name: str = "envoy") -> Proc:
        """envoy runs the real Envoy on ``config`` (one worker thread) and returns once ``port`` answers."""
        proc = self.start(name, [str(VENV_BIN / "envoy"), "-c", str(self.write(name, config)), "--log-level", "error",
                                 "--disable-hot-restart", "--concurrency", "1"])
        proc.wait_port(port)
        return proc

    def died(self) -> str:
        """died names the processes that have exited, as a sentence per process ('' when none)."""
        return "".join(f" {Path(p.argv[0]).name} exited during the run" for p in self.procs if not p.alive())

    def tails(self, chars: int = 1500) -> str:
        """tails is the last ``chars`` characters of each process's output."""
        return "\n".join(f"--- {Path(p.argv[0]).name} (tail) ---\n{p.output()[-chars:]}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def print_tails(workdir: Path, chars: int = 1500) -> None:
    """print_tails prints the last ``chars`` characters of each process log in ``workdir`` to
    stderr: what a failed run's processes said last."""
    for log in sorted(workdir.glob("*.log")):
        print(f"  --- {log.name} (tail) ---\n{log.read_text(errors='replace')[-chars:]}", file=sys.stderr)


def failure(exc: BaseException) -> str:
    """failure is how a run that raised is reported: the error's type and message, at most 2,000
    characters (one run failing must not lose the others' results)."""
    return f"{type(exc).__name__}: {exc}"[:2000]
