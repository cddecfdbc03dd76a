"""The Envoy files that skip request headers besides deploy/envoy.yaml (whose pass paths
tests/e2e/test_pass_paths.py covers): each sends kvgate the headers of a request that may
have no body, so such a request is decided before it can reach the upstream."""

from __future__ import annotations

import pytest

from kvgate_testkit.procs import ROOT
from kvgate_testkit.stack import Stack
from tests.e2e.test_pass_paths import CONFIG, passed, send

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("skipping_file", ["envoy-reservation.yaml", "envoy-observe.yaml",
                                        "envoy-access-log.yaml"])
def test_the_other_files_that_skip_request_headers_send_those_of_bodiless_requests(
        skipping_file: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The pair of routes that sends the headers of requests that may have no body is in
    every shipped file that skips request headers: a bodiless GET passes counted, a bodiless
    DELETE is kvgate's 405 (it reached the upstream before)."""
    own = Stack(tmp_path_factory.mktemp("skip"), CONFIG, envoy_template=ROOT / "deploy" / skipping_file).start()
    try:
        assert send(own, "GET", "/v1/models")[0] == 200
        status, headers, _ = send(own, "DELETE", "/v1/models")
        assert status == 405 and headers["x-kvgate-reason"] == "path"
        assert send(own, "GET", "/generate")[0] == 404
        assert passed(own) == 1
        assert own.inflight() == 0
    finally:
        own.stop()
