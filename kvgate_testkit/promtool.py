"""promtool: Prometheus's rule checker for tests, from PATH or from Debian's ``prometheus`` package.

``promtool`` is no Python package. It is taken from PATH when there is one, else from a copy
unpacked earlier under the venv, else fetched once with ``apt-get download prometheus`` (a
package registry, no root needed) and unpacked there with ``dpkg-deb``. When none of these
works the caller is told why, to skip with that reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Under the venv (ignored by git, removed by `make clean`), so a checkout stays clean.
CACHE = Path(sys.prefix) / "kvgate-tools" / "prometheus"


class Unavailable(Exception):
    """Unavailable says why promtool cannot be had here."""


def promtool_binary() -> str:
    """promtool_binary is the path of a working ``promtool``; raises Unavailable saying why not."""
    found = shutil.which("promtool")
    if found:
        return found
    cached = CACHE / "usr" / "bin" / "promtool"
    if cached.is_file():
        return str(cached)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise Unavailable(f"promtool is not on PATH and {tool} is missing to fetch Debian's prometheus package")
    with tempfile.TemporaryDirectory(prefix="kvgate-promtool-") as tmp:
        got = subprocess.run(["apt-get", "download", "-qq", "prometheus"], cwd=tmp, capture_output=True,
                             text=True, timeout=180, check=False)
        debs = sorted(Path(tmp).glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            why = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no package file"]
            raise Unavailable(f"promtool is not on PATH and `apt-get download prometheus` failed: {why[0]}")
        staging = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(staging)], check=True, timeout=180)
        unpacked = staging / "usr" / "bin" / "promtool"
        if not unpacked.is_file():
            raise Unavailable("Debian's prometheus package held no usr/bin/promtool")
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(unpacked), str(cached))  # only promtool: the server is not needed
    return str(cached)
