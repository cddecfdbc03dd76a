"""revision: kvgate's ``extproc`` as it is at another git revision, for benchmarks that run it
beside this tree's in the same run (a worker process per tree).

The other revision is written out with ``git archive`` (no worktree, nothing in git's state
changes); a worker started with ``worker_env(source)`` and ``cwd=source`` imports that copy of
``extproc`` while the benchmark's own code (``bench``, ``kvgate_testkit``) stays this tree's.
``Workers`` runs one such worker per tree and asks them in turn, so that both meet the same
machine.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]


def checkout(ref: str, into: Path) -> Path:
    """checkout writes the ``extproc`` package as it is at git revision ``ref`` into ``into``
    and returns ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "extproc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


@contextmanager
def checked_out(ref: str) -> Iterator[Path]:
    """checked_out is ``checkout`` into a temporary folder, removed when the block ends."""
    with tempfile.TemporaryDirectory(prefix="kvgate-rev-") as tmp:
        yield checkout(ref, Path(tmp))


def worker_env(source: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """worker_env is the environment (``base``, by default this process's) of a worker that
    imports ``extproc`` from ``source`` first and everything else from this tree."""
    return {**(os.environ if base is None else base),
            "PYTHONPATH": os.pathsep.join([str(source), str(ROOT)])}


class Workers:
    """Workers are one worker process per tree (name -> the folder its ``extproc`` comes from),
    each running ``argv`` and answering every line it reads with one line; the workers end with
    the ``with`` block."""

    def __init__(self, argv: list[str], trees: dict[str, Path]) -> None:
        self.procs = {name: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             cwd=source, env=worker_env(source))
                      for name, source in trees.items()}
        self.asked = 0

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for proc in self.procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)

    def ask(self, line: str) -> dict[str, str]:
        """ask sends ``line`` to every worker in turn, in the other order than the time before,
        and returns each one's answer by tree name."""
        order = list(self.procs) if self.asked % 2 == 0 else list(reversed(self.procs))
        self.asked += 1
        answers = {}
        for name in order:
            proc = self.procs[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answers[name] = proc.stdout.readline()
        return answers


def describe(ref: str = "HEAD") -> str:
    """describe is ``ref``'s short commit hash; for HEAD with uncommitted changes to tracked
    files, followed by ``+changes`` (the tree measured is not that commit)."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                           check=True, capture_output=True, text=True).stdout.strip()
    if ref != "HEAD":
        return short
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             check=True, capture_output=True, text=True).stdout.strip()
    return f"{short}+changes" if changed else short
