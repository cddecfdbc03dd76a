"""revision: kvgate's ``extproc`` as it is at another git revision, for benchmarks that run it
beside this tree's in the same run (a worker process per tree).

The other revision is written out with ``git archive`` (no worktree, nothing in git's state
changes); a worker started with ``worker_env(source)`` and ``cwd=source`` imports that copy of
``extproc`` while the benchmark's own code (``bench``, ``kvgate_testkit``) stays this tree's.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
