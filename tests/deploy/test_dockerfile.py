"""Tests of the Dockerfile and .dockerignore (no image can be built here): the pins, the user,
the ports and entrypoint the manifests rely on, and that the files the build copies, and
only those, build the kvgate wheel with every module of the package."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """instructions returns the Dockerfile's (INSTRUCTION, arguments), continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copy_sources() -> list[str]:
    """copy_sources lists what the build copies from the build context."""
    sources = []
    for word, args in instructions():
        if word == "COPY" and "--from" not in args:
            sources += args.split()[:-1]
    return sources


def dockerignore_excludes(path: str) -> bool:
    """dockerignore_excludes applies .dockerignore to a context path: the last matching rule wins."""
    excluded = False
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        parts = path.split("/")
        # A rule matches the path itself or any folder above it (Docker excludes subtrees).
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_base_image_is_pinned_and_the_runtime_is_non_root() -> None:
    ins = instructions()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", args["PYTHON_IMAGE"])
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${PYTHON_IMAGE}") for f in froms), "multi-stage"
    user = [a for w, a in ins if w == "USER"]
    assert len(user) == 1 and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user[0]), "numeric, non-root"
    assert ins.index(("USER", user[0])) > max(i for i, (w, _) in enumerate(ins) if w == "RUN")
    exposed = {p for w, a in ins if w == "EXPOSE" for p in a.split()}
    assert {"50051", "9464"} <= exposed
    assert ("ENTRYPOINT", '["kvgate"]') in ins


def test_the_image_carries_oci_labels_and_a_grpc_health_check() -> None:
    ins = instructions()
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[a-z]+)="([^"]*)"',
                             " ".join(a for w, a in ins if w == "LABEL")))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert labels["org.opencontainers.image.version"] == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert {"org.opencontainers.image.title", "org.opencontainers.image.source"} <= set(labels)
    (check,) = [a for w, a in ins if w == "HEALTHCHECK"]
    assert '"kvgate", "health"' in check and "127.0.0.1:50051" in check


def test_copied_files_exist_and_are_not_ignored() -> None:
    sources = copy_sources()
    assert {"pyproject.toml", "extproc"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not dockerignore_excludes(src), f".dockerignore drops {src}, which the Dockerfile copies"
    assert dockerignore_excludes(".venv") and dockerignore_excludes(".git")
    assert dockerignore_excludes("extproc/__pycache__/config.cpython-311.pyc")
    assert dockerignore_excludes("tests/unit/test_reload.py")


def test_the_copied_files_build_a_complete_wheel(tmp_path: Path) -> None:
    """The wheel built from the build context alone holds every module of the packages."""
    context = tmp_path / "context"
    context.mkdir()
    for src in copy_sources():
        path = ROOT / src
        if path.is_dir():
            shutil.copytree(path, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, context / src)
    out = tmp_path / "wheels"
    # With build isolation, as `pip wheel` runs in the image build.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                             "--wheel-dir", str(out), str(context)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "No matching distribution" in result.stderr:
        pytest.skip("no package index reachable for the build backend")
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob("kvgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "extproc", "sim"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    modules = [m for m in tracked if m.endswith(".py")]
    assert modules and [m for m in modules if m not in names] == []
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvgate = extproc.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # setuptools >= 77 ships the license file named by `license-files` in the wheel.
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(n for n in names if "dist-info" in n)
