"""kvgate picking nodes through the real Envoy (deploy/envoy-endpoint-picker.yaml): three
simulated nodes of 100,000 KV tokens each, bursts of long prompts, KV the nodes hold for
others, a node killed."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import wait_until

pytestmark = pytest.mark.e2e

PROMPT_29K = "hello" + " hello" * 28_990   # 28,991 tokens of cl100k_base, +7 of the chat template


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesStack]:
    s = NodesStack(tmp_path_factory.mktemp("picker"), nodes=3, kv_capacity_tokens=100_000,
                   sim_args=["--speedup", "20"],
                   pool={"picking": {"growth": "worst_case", "reserve_fraction": 0.02}}).start()
    wait_until(lambda: sum(s.per_node("kvgate_backend_pickable").values()) == 3, timeout=10,
               what="three nodes up")
    yield s
    s.stop()


def client(stack: NodesStack):
    from openai import OpenAI
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(stack: NodesStack, prompt: str, max_tokens: int) -> int:
    reply = client(stack).chat.completions.create(
        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}])
    return reply.usage.completion_tokens


def preemptions(stack: NodesStack) -> list[int]:
    return [stack.node_state(i)["preemptions"] for i in range(3)]


def idle(stack: NodesStack) -> None:
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=10, what="nothing in flight")
    wait_until(lambda: sum(stack.per_node("kvgate_backend_kv_inflight_tokens").values()) == 0,
               timeout=15, what="no KV held on any node")


def test_a_burst_of_long_prompts_lands_on_every_node_waits_for_room_and_preempts_nothing(stack):
    before = preemptions(stack)
    picks0 = stack.per_node("kvgate_backend_picks_total")
    # Twelve 29k + 1k requests (359k tokens) at once on 3 x 100k: nine fit, three wait.
    with ThreadPoolExecutor(12) as pool:
        done = list(pool.map(lambda _: chat(stack, PROMPT_29K, 1_000), range(12)))
    assert done == [1_000] * 12
    assert preemptions(stack) == before
    picks = stack.per_node("kvgate_backend_picks_total")
    assert all(picks[n] - picks0[n] >= 3 for n in picks), picks
    assert stack.metric("kvgate_backend_passed_over_total", reason="no_room") > 0
    idle(stack)


def test_a_node_holding_kv_for_others_gets_no_request_until_it_frees(stack):
    stack.node_config(0, {"background_kv_tokens": 90_000})
    wait_until(lambda: stack.metric("kvgate_backend_kv_foreign_tokens", backend="node-0") >= 85_000,
               timeout=15, what="node-0's foreign KV seen")
    picks0 = stack.per_node("kvgate_backend_picks_total")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: chat(stack, PROMPT_29K[:60_000], 200), range(4)))
    picks = stack.per_node("kvgate_backend_picks_total")
    assert picks["node-0"] == picks0["node-0"]
    assert picks["node-1"] + picks["node-2"] == picks0["node-1"] + picks0["node-2"] + 4
    stack.node_config(0, {"background_kv_tokens": 0})
    wait_until(lambda: stack.metric("kvgate_backend_kv_foreign_tokens", backend="node-0") < 1_000,
               timeout=15, what="node-0 free again")
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: chat(stack, PROMPT_29K[:60_000], 200), range(6)))
    assert stack.per_node("kvgate_backend_picks_total")["node-0"] > picks0["node-0"]
    idle(stack)


def test_paths_kvgate_does_not_admit_go_to_an_up_node_and_a_client_cannot_pick_one(stack):
    import urllib.request
    with urllib.request.urlopen(f"{stack.base_url}/v1/models", timeout=5) as resp:
        assert resp.status == 200 and MODEL in resp.read().decode()
    # A client naming a node (or any address) itself: Envoy strips the header before kvgate,
    # and kvgate names the node.
    before = stack.per_node("kvgate_backend_picks_total")
    reply = client(stack).with_options(default_headers={
        "x-gateway-destination-endpoint": "127.0.0.1:1"}).chat.completions.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 5
    assert sum(stack.per_node("kvgate_backend_picks_total").values()) == sum(before.values()) + 1
    idle(stack)


def test_a_refused_request_never_reaches_a_node(stack):
    import openai
    served = sum(stack.node_state(i)["finished"].get("stop", 0) + stack.node_state(i)["finished"].get(
        "length", 0) for i in range(3))
    with pytest.raises(openai.BadRequestError) as err:   # above the context window
        client(stack).chat.completions.create(model=MODEL, max_tokens=32_000, messages=[
            {"role": "user", "content": PROMPT_29K}])
    assert err.value.status_code == 400
    after = sum(stack.node_state(i)["finished"].get("stop", 0) + stack.node_state(i)["finished"].get(
        "length", 0) for i in range(3))
    assert after == served
    assert sum(stack.node_state(i)["running"] + stack.node_state(i)["waiting"] for i in range(3)) == 0


def test_a_killed_node_stops_being_picked_and_its_requests_are_released_once(stack, tmp_path: Path):
    released0 = stack.metric("kvgate_releases_total")
    picks0 = stack.per_node("kvgate_backend_picks_total")
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(chat, stack, "a long answer", 20_000)
        wait_until(lambda: stack.metric("kvgate_inflight_requests") == 1, timeout=15, what="admitted")
        picks = stack.per_node("kvgate_backend_picks_total")
        (victim,) = [n for n in picks if picks[n] > picks0[n]]
        i = int(victim.rsplit("-", 1)[1])
        stack.procs[victim].kill()
        with pytest.raises(Exception):
            fut.result(timeout=30)
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=15, what="released")
    assert stack.metric("kvgate_releases_total") == released0 + 1
    wait_until(lambda: stack.metric("kvgate_backend_pickable", backend=victim) == 0,
               timeout=15, what=f"{victim} not pickable")
    assert stack.metric("kvgate_backend_kv_inflight_tokens", backend=victim) == 0
    picks = stack.per_node("kvgate_backend_picks_total")
    for _ in range(4):
        assert chat(stack, "hi", 3) == 3
    after = stack.per_node("kvgate_backend_picks_total")
    assert after[victim] == picks[victim]
    assert i in (0, 1, 2)


def test_a_node_killed_mid_stream_is_released_at_once_as_an_upstream_error(stack):
    """With the picker file itself: the streamed answer's node dies after
    its first chunks; the lease is released when Envoy ends the stream, and counted
    upstream_error (not client_disconnect) once Envoy's access log entry tells why."""
    causes = ("upstream_error", "client_disconnect")
    before = {c: stack.metric("kvgate_releases_total", cause=c) for c in causes}
    picks0 = stack.per_node("kvgate_backend_picks_total")
    chunks = iter(client(stack).chat.completions.create(
        model=MODEL, max_tokens=20_000, stream=True, messages=[{"role": "user", "content": "hi"}]))
    next(chunks)
    picks = stack.per_node("kvgate_backend_picks_total")
    (victim,) = [n for n in picks if picks[n] > picks0[n]]
    stack.procs[victim].kill()
    with pytest.raises(Exception):
        for _ in chunks:
            pass
    # Released before the cause could fall back to its default (5 s): not by the log entry.
    wait_until(lambda: stack.metric("kvgate_inflight_requests") == 0, timeout=2.5, interval=0.002,
               what="released")
    wait_until(lambda: stack.metric("kvgate_releases_total", cause="upstream_error")
               == before["upstream_error"] + 1, timeout=15, what="an upstream_error release")
    assert stack.metric("kvgate_releases_total", cause="client_disconnect") == before["client_disconnect"]
    assert stack.metric("kvgate_backend_kv_inflight_tokens", backend=victim) == 0


def test_a_node_found_by_dns_discovery_is_picked(tmp_path_factory: pytest.TempPathFactory):
    s = NodesStack(tmp_path_factory.mktemp("discovery"), nodes=1, kv_capacity_tokens=50_000,
                   discover=True, sim_args=["--speedup", "20"]).start()
    try:
        wait_until(lambda: s.metric("kvgate_backend_pickable", backend=s.node_name(0)) == 1,
                   timeout=10, what="the discovered node up")
        assert chat(s, "hi", 4) == 4
        assert s.metric("kvgate_backend_picks_total", backend=s.node_name(0)) == 1
    finally:
        s.stop()
