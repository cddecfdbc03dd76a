"""End to end: two kvgate replicas, each behind its own real Envoy, pick among the
same three simulated nodes and share what each node holds through one redis-server.

- A burst of long prompts split across both replicas preempts nothing on any node (alone,
  each replica would fill every node to its room, together twice over), and at every
  settled scrape each node's KV in use is what both replicas admitted there, summed.
- Calls refused beside the other replica's requests are told when room comes back and get
  in with the openai client's default retries once the requests on the nodes end.
- A replica killed with SIGKILL mid-burst: its leases, and the node holds with them, come
  back within the lease TTL, and the other replica then admits into that room.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import redis as redis_sync

from kvgate_testkit.nodes_stack import MODEL, NodesStack
from kvgate_testkit.procs import wait_until
from kvgate_testkit.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

CAP = 40_000                 # every node's KV cache (tokens)
BLOCK = 16                   # the simulator's block size (tokens)
PROMPT = "hello" + " hello" * 5_999   # 6,000 tokens of cl100k_base, +7 of the chat template
MAX_TOKENS = 150
LEASE_TTL_S = 3.0
PREFIX = "e2e-nodes:"
# floor(40,000 x 0.98) = 39,200 of room: six requests of 6,007 + 150 tokens fit on a node, seven do not.
PER_NODE = 6


# The tenant of the retry-hint test: its class answers a refusal with a 429 at once.
CHAT_KEY = "sk-e2e-chat"


def config(url: str) -> dict[str, Any]:
    return {"store": {"redis": {"url": url, "key_prefix": PREFIX, "lease_ttl_s": LEASE_TTL_S,
                                # generous: this test is about sharing, not a busy machine's speed
                                "timeout_s": 2.0, "expected_replicas": 2}},
            "tenants": {"unauthenticated": "standard",
                        "classes": {"standard": {"max_wait_s": 30.0}, "chat": {"priority": 10}},
                        "tenants": {"chat": {"class": "chat",
                                             "api_key_sha256": hashlib.sha256(CHAT_KEY.encode()).hexdigest()}}}}


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodesStack]]:
    pool = {"picking": {"growth": "worst_case", "reserve_fraction": 0.02}}
    a = NodesStack(tmp_path_factory.mktemp("replica-a"), nodes=3, kv_capacity_tokens=CAP,
                   pool=pool, config=config(redis_srv.url), sim_args=["--speedup", "2"])
    b = NodesStack(tmp_path_factory.mktemp("replica-b"), kv_capacity_tokens=CAP, pool=pool,
                   config=config(redis_srv.url), nodes_of=a)
    stacks = [a, b]
    try:
        # Both at once: B's kvgate finds the nodes pending until A's simulators listen.
        with ThreadPoolExecutor(2) as starters:
            for started in [starters.submit(s.start) for s in stacks]:
                started.result()
        for s in stacks:
            wait_until(lambda s=s: sum(s.per_node("kvgate_backend_pickable").values()) == 3,
                       timeout=10, what="three nodes up")
        yield stacks
    finally:
        for s in reversed(stacks):
            s.stop()


def held_in_redis(server: RedisServer) -> tuple[int, dict[str, int]]:
    """held_in_redis is the slots the shared pool holds and its holds per node (tokens)."""
    r = redis_sync.Redis.from_url(server.url)
    st = r.hgetall(f"{PREFIX}{{default}}:st")
    nk = r.hgetall(f"{PREFIX}{{default}}:nk")
    return int(st.get(b"n", 0)), {k.decode(): int(v) for k, v in nk.items() if int(v)}


def chat(stack: NodesStack, max_tokens: int = MAX_TOKENS) -> int:
    c = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = c.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": PROMPT}])
    return reply.usage.completion_tokens


def preemptions(stack: NodesStack) -> list[int]:
    return [stack.node_state(i)["preemptions"] for i in range(3)]


def test_a_burst_split_across_both_replicas_preempts_nothing_and_the_nodes_hold_the_sum(
        replicas: list[NodesStack], redis_srv: RedisServer) -> None:
    a, b = replicas
    before = preemptions(a)
    settled: list[dict[str, tuple[int, float]]] = []
    done = threading.Event()

    def scrape() -> None:
        """At each settled instant (no request entering or leaving a node while kvgate's
        metrics are read), per node: (tokens in the node's KV, what both replicas hold there)."""
        while not done.is_set():
            s1 = [a.node_state(i) for i in range(3)]
            held = [s.per_node("kvgate_backend_kv_inflight_tokens") for s in (a, b)]
            slots, _ = held_in_redis(redis_srv)
            s2 = [a.node_state(i) for i in range(3)]
            # A request the node has queued but not yet scheduled holds no block there yet.
            steady = all((x["running"], x["finished"]) == (y["running"], y["finished"])
                         and x["waiting"] == y["waiting"] == 0 for x, y in zip(s1, s2))
            if steady and slots == sum(x["running"] + x["waiting"] for x in s2) and slots:
                settled.append({a.node_name(i): (s2[i]["used_blocks"] * BLOCK, held[0][a.node_name(i)]
                                                 + held[1][a.node_name(i)], s2[i]["running"])
                                for i in range(3)})
            time.sleep(0.1)  # the sampling period, not a wait for a condition

    sampler = threading.Thread(target=scrape)
    sampler.start()
    try:
        # 24 requests, half through each replica: 18 fit at once (6 per node), 6 wait.
        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(lambda i: chat((a, b)[i % 2]), range(24)))
    finally:
        done.set()
        sampler.join(30)
    assert got == [MAX_TOKENS] * 24
    assert preemptions(a) == before
    assert len(settled) >= 3, settled
    for sample in settled:
        for node, (in_kv, admitted, running) in sample.items():
            # kvgate sees the prompt at once and the tokens generated only at the end of a
            # non-streamed reply; the node rounds every request up to whole blocks. With
            # chunked prefill, the last request a step took may hold only part of its prompt
            # yet (the step's token budget is shared): at most one prompt short.
            prompt = 6_007
            assert admitted - prompt < in_kv <= admitted + running * (MAX_TOKENS + BLOCK), (node, sample)
            assert running <= PER_NODE, (node, sample)
    wait_until(lambda: held_in_redis(redis_srv) == (0, {}), timeout=LEASE_TTL_S + 5,
               what="Redis holding nothing")


def open_stream(stack: NodesStack, max_tokens: int) -> Any:
    """open_stream starts a streamed chat of PROMPT and reads its first chunk (the replica has
    seen its first token); the request holds its node until the test closes the stream."""
    c = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    held = c.chat.completions.create(model=MODEL, max_tokens=max_tokens, stream=True,
                                     messages=[{"role": "user", "content": PROMPT}])
    next(iter(held))
    return held


def test_calls_refused_beside_the_other_replicas_requests_get_in_with_the_clients_default_retries(
        replicas: list[NodesStack], redis_srv: RedisServer) -> None:
    """B has learned that its requests hold a node about 10 s, and holds three; A holds the
    rest of every node's room. B's calls (a class without a wait, openai-python's 2 retries)
    are refused and told to come back when the requests on the nodes are expected to end,
    not at the 50 ms floor that would spend the retries at once. The requests on the nodes
    end when the test closes them, once every call has had its first refusal (not when the
    simulator has streamed them, which a loaded machine slows): every call then gets in on
    a retry, and no node preempts."""
    a, b = replicas
    before = preemptions(a)
    learnt = 1_000  # tokens: about 10 s on the simulator at --speedup 2
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda _: chat(b, learnt), range(3))) == [learnt] * 3
    # Four holders of 6,007 + 3,000 tokens fill a node's 39,200 of room past a call's 6,157;
    # the simulator would stream each for about 30 s.
    hold_tokens = 3_000
    with ThreadPoolExecutor(12) as pool:
        holders = list(pool.map(lambda i: open_stream((b, a)[i >= 3], hold_tokens), range(12)))
    hints: list[tuple[int, str | None]] = []
    results: list[object] = []
    try:
        wait_until(lambda: held_in_redis(redis_srv)[0] == 12, timeout=15, what="every node full")

        def record(response: Any) -> None:
            hints.append((response.status_code, response.headers.get("retry-after-ms")))

        def call() -> None:
            c = openai.OpenAI(base_url=f"{b.base_url}/v1", api_key=CHAT_KEY, timeout=60,
                              http_client=openai.DefaultHttpxClient(event_hooks={"response": [record]}))
            assert c.max_retries == 2  # openai-python's default
            try:
                reply = c.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS,
                                                  messages=[{"role": "user", "content": PROMPT}])
                results.append(reply.usage.completion_tokens)
            except openai.APIError as err:
                results.append(err)
        calls = [threading.Thread(target=call) for _ in range(4)]
        for t in calls:
            t.start()
        wait_until(lambda: len(hints) >= 4, timeout=15, what="every call's first answer")
    finally:
        for held in holders:
            held.close()
    for t in calls:
        t.join(60)
    assert results == [MAX_TOKENS] * 4, (results, hints)
    # The first four answers are 429s to the calls' first tries, while every node is full,
    # each told to wait for the requests there (learnt to run ~10 s), not the floor.
    told = [int(ms) for status, ms in hints if status == 429 and ms is not None]
    assert len(told) >= 4 and min(told[:4]) >= 500, hints
    assert preemptions(a) == before
    wait_until(lambda: held_in_redis(redis_srv) == (0, {}), timeout=LEASE_TTL_S + 5,
               what="Redis holding nothing")


def test_a_replica_killed_mid_burst_gives_its_nodes_room_back_within_the_lease_ttl(
        replicas: list[NodesStack], redis_srv: RedisServer) -> None:
    a, b = replicas
    before = preemptions(a)
    long = 12_000  # tokens: a request that would run for minutes on the simulator
    errors: list[BaseException] = []

    def hold() -> None:
        # Streamed, so that A sees each request's first token and counts it once, not also
        # as KV the node holds for others.
        c = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        try:
            for _ in c.chat.completions.create(model=MODEL, max_tokens=long, stream=True,
                                               messages=[{"role": "user", "content": PROMPT}]):
                pass
        except Exception as exc:  # its replica is killed: the request fails, as it should
            errors.append(exc)

    # A takes every node's room: two requests of 6,007 + 12,000 tokens each (a third does not fit).
    holders = [threading.Thread(target=hold) for _ in range(6)]
    for t in holders:
        t.start()
    wait_until(lambda: held_in_redis(redis_srv)[0] == 6, timeout=15, what="A holding six requests")
    assert sorted(held_in_redis(redis_srv)[1].values()) == [2 * (6_007 + long)] * 3
    # B's request (6,157 tokens) fits beside them nowhere (3,186 left on each): it waits.
    admitted: list[int] = []
    passed = b.metric("kvgate_backend_passed_over_total", reason="no_room")
    w = threading.Thread(target=lambda: admitted.append(chat(b)))
    w.start()
    try:
        wait_until(lambda: b.metric("kvgate_backend_passed_over_total", reason="no_room") >= passed + 3,
                   timeout=10, what="B's request refused room on every node (it waits)")
        victim = a.procs["kvgate"]
        victim.popen.kill()  # SIGKILL: no settle, no goodbye; only its leases' TTL is left
        victim.popen.wait(5)
        killed_at = time.monotonic()
        wait_until(lambda: not any(v >= 6_007 + long for v in held_in_redis(redis_srv)[1].values()),
                   timeout=LEASE_TTL_S + 5, interval=0.05, what="A's node holds gone from Redis")
        freed_after = time.monotonic() - killed_at
        # Leases expire lease_ttl_s after A's last refresh, which was before the kill.
        assert freed_after <= LEASE_TTL_S + 1.0, freed_after
        # ... and B's waiter is admitted into that room.
        w.join(30)
        assert admitted == [MAX_TOKENS]
    finally:
        for t in holders:
            t.join(30)
        w.join(30)
    assert len(errors) == 6  # A's requests ended with their replica
    assert preemptions(a) == before
