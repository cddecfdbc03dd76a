"""kvgate picking nodes through the real Envoy without a round trip per streamed chunk
(deploy/envoy-endpoint-picker-log.yaml): two simulated nodes. kvgate names the node on the
request and its ext_proc stream ends there; Envoy's periodic access log entries of each
stream in flight bring the tokens generated so far (the Lua usage filter's event count) and
the node that serves, and the final entry releases with the exact usage.

What a request was charged is read from the pool's TPM bucket (``kvgate_tpm_available_tokens``),
as in test_access_log_usage.py: two requests that differ only in the tokens the node generates
must differ by that much, within what the bucket refilled meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from extproc import picker_protocol as epp
from kvgate_testkit.nodes_stack import MODEL, NodesStack, header_set, mutation_filters
from kvgate_testkit.procs import ROOT, wait_until

pytestmark = pytest.mark.e2e

PICKER_LOG_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker-log.yaml"
TPM = 12_000  # 200 tokens a second refilled: small beside the differences measured
ROUTE_HEADER = "x-test-route"
OVERRIDE_FILTER = "test.fallback"
OUTPUT_HEADER = "x-sim-output-tokens"


class PickerLogStack(NodesStack):
    """PickerLogStack is the nodes stack under deploy/envoy-endpoint-picker-log.yaml, with one
    test route, ``fallback``, on which a filter after kvgate sends the request to node 0
    whatever kvgate named (as a gateway's fallback to another endpoint would)."""

    def envoy_config(self) -> dict[str, Any]:
        cfg = super().envoy_config()
        hcm = mutation_filters(cfg, after=[OVERRIDE_FILTER])
        vhost = hcm["route_config"]["virtual_hosts"][0]
        default = vhost["routes"][-1]
        per = {**default["typed_per_filter_config"],
               OVERRIDE_FILTER: header_set(epp.DESTINATION_KEY, self.address(0))}
        vhost["routes"].insert(len(vhost["routes"]) - 1, {
            **default, "name": "fallback", "typed_per_filter_config": per,
            "match": {"prefix": "/", "headers": [{"name": ROUTE_HEADER,
                                                  "string_match": {"exact": "fallback"}}]}})
        return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerLogStack]:
    s = PickerLogStack(tmp_path_factory.mktemp("picker-log"), nodes=2, kv_capacity_tokens=100_000,
                       envoy_template=PICKER_LOG_ENVOY, sim_args=["--decode-tokens-per-s", "500"],
                       pool={"max_concurrency": 2, "tpm": TPM, "tokenizer": "cl100k_base",
                             "picking": {"growth": "worst_case", "reserve_fraction": 0.02}},
                       config={"tenants": {"classes": {"standard": {"max_wait_s": 0.0}}}}).start()
    wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 2, timeout=15,
               what="two nodes up")
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def no_leak(stack: PickerLogStack) -> Iterator[None]:
    """no_leak checks after each test that kvgate holds nothing, on no node."""
    yield
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=15, what="nothing in flight")
    wait_until(lambda: sum(stack.per_node("kvgate_backend_kv_inflight_tokens").values()) == 0,
               timeout=5, what="no KV held on any node")


def client(stack: NodesStack, route: str | None = None) -> Any:
    from openai import OpenAI
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60,
                  default_headers={ROUTE_HEADER: route} if route else None)


def stream(stack: NodesStack, max_tokens: int, output: int | None = None, route: str | None = None) -> Any:
    """stream opens a streamed chat (``output`` tokens generated, all of ``max_tokens`` when None)."""
    headers = {OUTPUT_HEADER: str(output)} if output is not None else None
    return client(stack, route).chat.completions.create(
        model=MODEL, max_tokens=max_tokens, stream=True, extra_headers=headers,
        messages=[{"role": "user", "content": "tell me"}])


def held(stack: NodesStack) -> dict[str, float]:
    return stack.per_node("kvgate_backend_kv_inflight_tokens")


def progress_entries(stack: NodesStack) -> float:
    return stack.metric("kvgate_access_log_entries_total", result="progress")


def read_in_background(pool: ThreadPoolExecutor, chunks: Any) -> Future[int]:
    """read_in_background reads a stream to its end in ``pool`` (as a client would, at its own
    pace); the future is the number of chunks read."""
    return pool.submit(lambda: sum(1 for _ in chunks))


def test_a_streams_progress_reaches_its_nodes_ledger_while_it_streams(stack):
    entries0 = progress_entries(stack)
    with ThreadPoolExecutor(1) as pool:
        done = read_in_background(pool, stream(stack, 1_200))
        wait_until(lambda: sum(held(stack).values()) > 0, timeout=15, what="admitted")
        (node,) = [n for n, v in held(stack).items() if v > 0]
        start = held(stack)[node]
        # The ledger grows by the tokens the usage filter counted, told by periodic entries
        # (the ext_proc stream ended with the request), while the request is in flight.
        wait_until(lambda: held(stack)[node] >= start + 50, timeout=15, what="the ledger grown")
        assert stack.metric("kvgate_inflight_requests") == 1 and not done.done()
        assert stack.metric("kvgate_streams_active") == 0  # its ext_proc stream ended with the request
        assert progress_entries(stack) > entries0
        assert held(stack)[node] <= start + 1_200
        assert done.result(timeout=30) > 1_200


def charged(stack: NodesStack, send: Callable[[], None]) -> tuple[float, float]:
    """charged runs ``send`` (one request, to its end) and waits for its release; returns what
    the TPM bucket lost meanwhile and the most it can have refilled in that time."""
    before, t0 = stack.metric("kvgate_tpm_available_tokens", pool="default"), time.monotonic()
    send()
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=15, what="released")
    after = stack.metric("kvgate_tpm_available_tokens", pool="default")
    return before - after, (time.monotonic() - t0) * TPM / 60


def test_the_end_settles_the_exact_usage(stack):
    completed0 = stack.metric("kvgate_releases_total", cause="completed")
    usage_chunks: list[int] = []

    def run(output: int) -> Callable[[], None]:
        def send() -> None:
            usage_chunks.append(sum(1 for c in stream(stack, 1_000, output) if not c.choices))
        return send

    short, slack_short = charged(stack, run(10))
    long, slack_long = charged(stack, run(810))
    assert usage_chunks == [0, 0]  # the usage chunk kvgate asked for was hidden from the client
    assert 800 - slack_long <= long - short <= 800 + slack_short, (short, long, slack_short, slack_long)
    assert stack.metric("kvgate_releases_total", cause="completed") == completed0 + 2
    assert stack.metric("kvgate_logged_usage_total", result="reported") >= 2


def test_a_client_that_leaves_mid_stream_is_released(stack):
    before = stack.metric("kvgate_releases_total", cause="client_disconnect")
    s = stream(stack, 2_000)
    chunks = iter(s)
    for _ in range(5):
        next(chunks)
    s.close()
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=15, interval=0.005,
               what="released")
    assert stack.metric("kvgate_releases_total", cause="client_disconnect") == before + 1


def test_refusals_are_unchanged_and_reach_no_node(stack):
    import openai

    def on_nodes() -> int:
        return sum(stack.node_state(i)["running"] + stack.node_state(i)["waiting"] for i in range(2))

    finished = [stack.node_state(i)["finished"] for i in range(2)]
    with pytest.raises(openai.BadRequestError) as err:   # above the context window
        client(stack).chat.completions.create(model=MODEL, max_tokens=40_000,
                                              messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400
    assert [stack.node_state(i)["finished"] for i in range(2)] == finished and on_nodes() == 0
    held_open = [stream(stack, 2_000) for _ in range(2)]
    for s in held_open:
        next(iter(s))
    with pytest.raises(openai.RateLimitError) as err:   # both slots taken, no wait in this class
        client(stack).chat.completions.create(model=MODEL, max_tokens=5,
                                              messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 429
    assert err.value.response.headers["x-kvgate-reason"] == "concurrency"
    assert on_nodes() == 2
    for s in held_open:
        s.close()


def test_a_request_envoy_sent_to_another_node_is_charged_there(stack):
    # node-0 holds KV for others: kvgate names node-1, the fallback route sends it to node-0.
    stack.node_config(0, {"background_kv_tokens": 90_000})
    try:
        wait_until(lambda: stack.metric("kvgate_backend_kv_foreign_tokens", backend="node-0") >= 85_000,
                   timeout=15, what="node-0's foreign KV seen")
        picks0 = stack.per_node("kvgate_backend_picks_total")
        with ThreadPoolExecutor(1) as pool:
            done = read_in_background(pool, stream(stack, 1_200, route="fallback"))
            wait_until(lambda: sum(held(stack).values()) > 0, timeout=15, what="admitted")
            assert stack.per_node("kvgate_backend_picks_total")["node-1"] == picks0["node-1"] + 1
            wait_until(lambda: held(stack)["node-0"] > 0 and held(stack)["node-1"] == 0, timeout=15,
                       what="the charge moved to node-0")
            assert not done.done()
            done.result(timeout=30)
    finally:
        stack.node_config(0, {"background_kv_tokens": 0})


def test_a_node_killed_mid_stream_is_released_and_no_longer_picked(stack):
    """Last in this module: it kills a node. Its stream is released by Envoy's final access
    log entry, told an upstream error; the dead node is passed over and the other serves."""
    import openai
    before = stack.metric("kvgate_releases_total", cause="upstream_error")
    chunks = iter(stream(stack, 2_000))
    next(chunks)
    (victim,) = [n for n, v in held(stack).items() if v > 0]
    stack.procs[victim].kill()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=15, what="released")
    assert stack.metric("kvgate_releases_total", cause="upstream_error") == before + 1
    assert held(stack)[victim] == 0
    wait_until(lambda: stack.metric("kvgate_backend_pickable", backend=victim) == 0, timeout=15,
               what=f"{victim} not pickable")
    picks = stack.per_node("kvgate_backend_picks_total")
    for _ in range(3):
        reply = client(stack).chat.completions.create(model=MODEL, max_tokens=3,
                                                      messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 3
    after = stack.per_node("kvgate_backend_picks_total")
    assert after[victim] == picks[victim] and sum(after.values()) == sum(picks.values()) + 3
