"""Fallback endpoints end to end (``picking.fallbacks: 1``), through the real Envoy with the
file `kvgate envoy-filter` writes for each picker mode, two simulated nodes and kvgate.

kvgate names node A (more room) and then node B; A is killed (its port refuses connections)
after kvgate last scraped it, so kvgate still picks and charges A. Envoy's listed cluster
tries A, is refused, retries on the next entry: the request succeeds on B, and kvgate's charge
follows it there (the served endpoint at the response headers, or the access log's upstream
host in endpoint-picker-log). Nothing is held once the request ends.

kvgate scrapes once a minute here, so that nothing but the request can tell it that A died:
the test decides nothing by time, it only waits for what kvgate reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from extproc.configparse import parse_config
from extproc.envoyconf import envoy_bootstrap
from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import wait_until

pytestmark = pytest.mark.e2e

MODES = ("endpoint-picker", "inference-pool", "endpoint-picker-log")


@pytest.fixture(params=MODES)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesStack]:
    mode = request.param
    work = tmp_path_factory.mktemp(mode)
    template = work / "envoy-template.yaml"
    s = NodesStack(work, nodes=2, envoy_template=template, sim_args=["--speedup", "4"],
                   config={"adaptive": {"poll_interval_s": 60, "stale_after_s": 120, "scrape_timeout_s": 10}})
    backends = s.kvgate_config()["pools"]["default"]["backends"]
    for b, capacity in zip(backends, (100_000, 50_000)):  # A has the more room: the primary
        b["kv_capacity_tokens"] = capacity
    s.pool = {"backends": backends, "picking": {"fallbacks": 1, "growth": "worst_case"}}
    # The file kvgate writes for its own configuration; the stack points its clusters at loopback.
    template.write_text(yaml.safe_dump(envoy_bootstrap(parse_config(s.kvgate_config()), mode)))
    s.start()
    try:
        # The first round is the only one: a scrape slowed past its timeout by a loaded
        # machine would leave its node unpickable for the test, hence the long timeout.
        try:
            wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 2, timeout=20,
                       what="both nodes up")
        except TimeoutError as exc:  # what kvgate logged says which scrape failed, or why it died
            raise TimeoutError(f"{exc}; kvgate's log:\n{s.procs['kvgate'].output()[-3000:]}") from exc
        yield s
    finally:
        s.stop()


def client(stack: NodesStack) -> Any:
    from openai import OpenAI
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def test_a_request_whose_node_refuses_is_served_by_the_fallback_and_charged_there(stack: NodesStack) -> None:
    a, b = stack.node_name(0), stack.node_name(1)
    stack.procs.pop(a).stop()  # A's port now refuses; kvgate will not scrape before the request
    assert stack.per_node("kvgate_backend_pickable") == {a: 1.0, b: 1.0}
    picks0 = stack.per_node("kvgate_backend_picks_total")
    stream = client(stack).chat.completions.create(
        model=MODEL, max_tokens=300, stream=True, messages=[{"role": "user", "content": "go"}])
    chunks = iter(stream)
    next(chunks)
    # Mid-stream: kvgate picked and charged A; B served, and B's ledger holds the request.
    assert stack.per_node("kvgate_backend_picks_total") == {a: picks0[a] + 1, b: picks0[b]}
    wait_until(lambda: stack.per_node("kvgate_backend_kv_inflight_tokens")[b] > 0, timeout=5,
               what="the charge on B")
    assert stack.per_node("kvgate_backend_kv_inflight_tokens")[a] == 0
    assert stack.node_state(1)["running"] == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=10, what="nothing in flight")
    wait_until(lambda: sum(stack.per_node("kvgate_backend_kv_inflight_tokens").values()) == 0,
               timeout=5, what="no KV held on any node")
    assert stack.metric("kvgate_served_unknown_endpoint_total") == 0
    assert stack.metric("kvgate_requests_total", outcome="admitted") == 1
    assert stack.metric("kvgate_releases_total", cause="completed") == 1
