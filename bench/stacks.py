"""stacks: one benchmark run's processes (simulated nodes, kvgate, the real Envoy) on loopback
ports, each logging to its own file in the run's folder, stopped together, newest first.

    with Procs(workdir) as procs:
        node = procs.start("sim-0", argv)
        kv = procs.kvgate(config)
        envoy = procs.envoy(envoy_config(listen=port, ...), port)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvgate_testkit.procs import LOOPBACK, VENV_BIN, Proc, free_port


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


def failure(exc: BaseException) -> str:
    """failure is how a run that raised is reported: the error's type and message, at most 2,000
    characters (one run failing must not lose the others' results)."""
    return f"{type(exc).__name__}: {exc}"[:2000]
