"""Smoke test of bench_request_path's in-process paths: every file's messages admit a
request, and in the log files Envoy's final entry (``held.final_message``) releases it with
the usage the filter read. The CPU figures of so short a run mean nothing."""

from __future__ import annotations

import asyncio

import pytest

from bench.bench_request_path import FILES, RequestPath

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("file", FILES)
def test_each_file_s_path_admits_and_settles_every_request(file: str) -> None:
    path = RequestPath(file, 40)
    loop = asyncio.new_event_loop()
    try:
        assert path.run(loop) > 0  # raises if a lease was left held
    finally:
        loop.close()
    admitted = path.metrics.registry.get_sample_value(
        "kvgate_requests_total", {"pool": "default", "class": "standard", "outcome": "admitted"})
    assert admitted == 40
    if file != "recommended":
        reported = path.metrics.registry.get_sample_value(
            "kvgate_logged_usage_total", {"result": "reported"})
        assert reported == 40  # every release by the entry, with the filter's count
