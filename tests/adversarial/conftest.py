"""Fixtures shared by the adversarial tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.adversarial.support import Rig


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    """rig is one in-process kvgate (real gRPC server on loopback, manual clock) per module."""
    r = Rig()
    try:
        yield r
    finally:
        r.close()
