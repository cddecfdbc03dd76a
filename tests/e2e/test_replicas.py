"""End to end: two kvgate replicas share one budget through a real redis-server.

Two stacks (fake upstream, ``kvgate serve``, the real Envoy), one per replica, both
configured with ``store.redis`` on one redis-server this module starts on a free loopback
port. The pool has N = 4 slots in all:

- N + k held streams spread over both Envoys: exactly N are admitted;
- a replica killed with SIGKILL while it holds every slot: the other admits again within
  ``lease_ttl_s``;
- Redis killed mid-traffic: both replicas say so (``kvgate_store_mode``, the error
  counter, a log line) and admit with their local share (N / 2 each), come back to shared
  mode when Redis returns, and once every stream has ended nothing is left counted: Redis
  holds 0 slots and 0 KV tokens, and N + k streams again get exactly N slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import redis as redis_sync
from openai import OpenAI

from kvgate_testkit.stack import Stack
from kvgate_testkit.procs import Proc, wait_until
from kvgate_testkit.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

N = 4
K = 3
LEASE_TTL_S = 12.0
# A heartbeat lives three refreshes (every second) plus timeout_s (2 s): a replica that stops
# beating is absent that soon, far before its leases expire.
PRESENCE_S = 5.0
PREFIX = "e2e:"
MESSAGES = [{"role": "user", "content": "Say hello"}]


def kvgate_config(url: str) -> dict[str, Any]:
    return {
        "pools": {"default": {"max_concurrency": N, "context_window": 4096, "default_max_tokens": 64,
                              "tokenizer": "cl100k_base"}},
        # timeout_s is generous: this test is about sharing, not about how fast a busy
        # 2-core machine answers; a stopped Redis is refused at once anyway.
        "store": {"redis": {"url": url, "key_prefix": PREFIX, "lease_ttl_s": LEASE_TTL_S,
                            "timeout_s": 2.0, "on_unavailable": "local_share"}},
        "server": {"drain_s": 0, "grace_s": 1},
    }


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(start_stack: Callable[..., Stack], redis_srv: RedisServer) -> tuple[Stack, Stack]:
    a = start_stack(kvgate_config(redis_srv.url))
    b = start_stack(kvgate_config(redis_srv.url))
    return a, b


def held_in_redis(server: RedisServer) -> tuple[int, int]:
    """held_in_redis is (slots, KV tokens) the shared pool holds in Redis."""
    st = redis_sync.Redis.from_url(server.url).hgetall(f"{PREFIX}{{default}}:st")
    return int(st.get(b"n", 0)), int(st.get(b"kv", 0))


def wait_replicas_see_each_other(server: RedisServer, n: int = 2) -> None:
    """wait_replicas_see_each_other waits until each of the ``n`` live replicas has sent a
    heartbeat that counted all ``n`` (their local share is 1/n from then on).

    A heartbeat's entry is its expiry (Redis time + PRESENCE_S): once exactly ``n``
    replicas are live at instant T, an entry above T + PRESENCE_S was written after T.
    """
    r = redis_sync.Redis.from_url(server.url)

    def live() -> tuple[float, list[float]]:
        secs, micros = r.time()
        now = secs + micros / 1e6
        return now, [s for _, s in r.zrange(f"{PREFIX}replicas", 0, -1, withscores=True) if s > now]

    seen_at: list[float] = []

    def all_live() -> bool:
        now, expiries = live()
        if len(expiries) == n:
            seen_at.append(now)
            return True
        return False

    wait_until(all_live, timeout=15, what=f"{n} live replicas")
    wait_until(lambda: all(e > seen_at[0] + PRESENCE_S for e in live()[1]) and len(live()[1]) == n,
               timeout=15, what="a heartbeat of every replica counting all of them")


def mode(stack: Stack) -> str | None:
    """mode is the store mode kvgate reports as current (kvgate_store_mode == 1)."""
    for (name, labels), value in stack.metrics().items():
        if name == "kvgate_store_mode" and value == 1.0:
            return dict(labels)["mode"]
    return None


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=20)


class Held:
    """Held is one streamed request the upstream holds open after its first chunk."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.stack = stack
        self.key = key
        self.stream: Any = None
        self.error: Exception | None = None

    def open(self) -> Held:
        try:
            stream = client(self.stack).chat.completions.create(
                model="fake", messages=MESSAGES, stream=True, max_tokens=3,
                extra_headers={"x-fake-hold": self.key})
            first = next(iter(stream))
            assert first.choices[0].delta.content == "tok0 "
            self.stream = stream
        except Exception as exc:  # a refusal, or a broken stream: the test looks at it
            self.error = exc
        return self

    @property
    def admitted(self) -> bool:
        return self.stream is not None

    def finish(self) -> None:
        """finish lets the upstream complete the stream and reads it to its end."""
        if self.stream is None:
            return
        try:
            self.stack.upstream_post(f"/_fake/release/{self.key}")
            for _ in self.stream:
                pass
        except Exception:
            pass  # its replica may be dead: the stream ends either way
        finally:
            self.stream.close()


def open_all(specs: list[tuple[Stack, str]]) -> list[Held]:
    """open_all opens every held stream at once, from one thread each."""
    held = [Held(stack, key) for stack, key in specs]
    threads = [threading.Thread(target=h.open) for h in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return held


def finish_all(held: list[Held]) -> None:
    for h in held:
        h.finish()


def refused_for(h: Held, reason: str) -> bool:
    err = h.error
    return isinstance(err, openai.RateLimitError) and err.response.headers.get("x-kvgate-reason") == reason


@pytest.fixture(autouse=True)
def nothing_left(replicas: tuple[Stack, Stack], redis_srv: RedisServer) -> Iterator[None]:
    yield
    wait_until(lambda: held_in_redis(redis_srv) == (0, 0), timeout=LEASE_TTL_S + 5,
               what="Redis to hold no slot and no KV token")


def test_the_global_limit_holds_across_both_replicas(replicas: tuple[Stack, Stack], redis_srv: RedisServer):
    a, b = replicas
    held = open_all([((a, b)[i % 2], f"spread-{i}") for i in range(N + K)])
    try:
        admitted = [h for h in held if h.admitted]
        # A replica whose Redis round trip timed out admits from its local share: then the
        # machine was too slow for timeout_s, which the modes say, not the rule.
        assert len(admitted) == N, ([repr(h.error) for h in held], mode(a), mode(b))
        assert all(refused_for(h, "concurrency") for h in held if not h.admitted)
        assert held_in_redis(redis_srv)[0] == N
    finally:
        finish_all(held)
    # Every replica's view of the shared pool drains to 0 once the streams end.
    for s in (a, b):
        wait_until(lambda s=s: s.inflight() == 0, timeout=LEASE_TTL_S + 5, what="in-flight 0")


def test_a_replica_killed_with_sigkill_frees_its_slots_once_its_heartbeat_is_gone(
        replicas: tuple[Stack, Stack], redis_srv: RedisServer):
    a, b = replicas
    held = open_all([(a, f"kill-{i}") for i in range(N)])
    try:
        assert all(h.admitted for h in held), [repr(h.error) for h in held]
        probe = Held(b, "kill-probe").open()
        held.append(probe)
        assert refused_for(probe, "concurrency")
        victim = a.procs["kvgate"]
        victim.popen.kill()  # SIGKILL: no settle, no goodbye
        victim.popen.wait(5)
        killed_at = time.monotonic()

        def b_admits() -> bool:
            reply = client(b).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
            return reply.usage.completion_tokens == 2

        def admitted_once() -> bool:
            try:
                return b_admits()
            except openai.RateLimitError:
                return False

        wait_until(admitted_once, timeout=LEASE_TTL_S + 5, interval=0.05,
                   what="replica B to admit after A was killed")
        freed_after = time.monotonic() - killed_at
        # A's heartbeat expires PRESENCE_S after its last refresh; B's next refresh finds it
        # gone and its admin port refusing, and releases its leases, long before their
        # lease_ttl_s. The slack covers a refresh and a round trip on a busy machine.
        assert freed_after <= PRESENCE_S + 2.5 < LEASE_TTL_S, freed_after
        assert f"released its {N} leases" in b.log("kvgate")
    finally:
        finish_all(held)
        _respawn_kvgate(a)


def admits(stack: Stack) -> bool:
    """admits tells whether a short request through ``stack`` is admitted now."""
    try:
        client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
        return True
    except openai.APIStatusError:
        return False


def _respawn_kvgate(stack: Stack) -> None:
    """_respawn_kvgate starts the stack's kvgate again with the same command (a new replica)."""
    old = stack.procs["kvgate"]
    if old.alive():
        return
    new = Proc(old.argv, stack.workdir / "kvgate-respawned.log")
    stack.procs["kvgate"] = new
    new.wait_port(stack.admin_port)
    new.wait_port(stack.grpc_port)


def test_redis_restarted_mid_traffic_degrades_loudly_recovers_and_counts_nothing_twice(
        replicas: tuple[Stack, Stack], redis_srv: RedisServer):
    a, b = replicas
    wait_until(lambda: mode(a) == "shared" and mode(b) == "shared", timeout=10, what="shared mode")
    wait_replicas_see_each_other(redis_srv)  # A may have just been respawned
    errors_before = [s.metric("kvgate_store_errors_total") for s in (a, b)]
    statuses: list[int] = []
    stop = threading.Event()

    def traffic(stack: Stack) -> None:
        while not stop.is_set():
            try:
                client(stack).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=2)
                statuses.append(200)
            except openai.APIStatusError as err:
                statuses.append(err.status_code)
            except openai.APIConnectionError:
                statuses.append(0)

    workers = [threading.Thread(target=traffic, args=(s,)) for s in (a, b)]
    before = open_all([(a, "restart-shared-0"), (a, "restart-shared-1")])
    during: list[Held] = []
    try:
        assert all(h.admitted for h in before)
        for w in workers:
            w.start()
        redis_srv.kill()  # a crash, mid-traffic
        wait_until(lambda: mode(a) == "local_share" and mode(b) == "local_share", timeout=10,
                   what="both replicas in local_share mode")
        for s, base in zip((a, b), errors_before):
            assert s.metric("kvgate_store_errors_total") > base
            assert "unavailable" in s.log("kvgate")
        # Alone, a replica admits only within what its own leases hold in the ledger beyond
        # its live requests (the leases of requests that ended while their settles could
        # not be sent): both together never pass the limit, whatever each one held.
        stop.set()
        for w in workers:
            w.join(30)
        during = open_all([((a, b)[i % 2], f"restart-local-{i}") for i in range(N + K)])
        assert len(before) + sum(h.admitted for h in during) <= N, [repr(h.error) for h in during]
        assert any(refused_for(h, "concurrency") for h in during), [repr(h.error) for h in during]
        redis_srv.start()  # back, empty
        wait_until(lambda: mode(a) == "shared" and mode(b) == "shared", timeout=10,
                   what="both replicas back in shared mode")
        assert "answers again" in a.log("kvgate") and "answers again" in b.log("kvgate")
        # A's live shared streams and what both admitted alone are counted in the new Redis, once.
        live = len(before) + sum(h.admitted for h in during)
        wait_until(lambda: held_in_redis(redis_srv)[0] == live, timeout=LEASE_TTL_S + 2,
                   what="the live leases taken again")
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join(30)
        finish_all(before + during)
        if not redis_srv.alive():
            redis_srv.start()  # for the tests after this one, whatever happened here
    assert statuses and all(s in (200, 429) for s in statuses), sorted(set(statuses))
    wait_until(lambda: held_in_redis(redis_srv) == (0, 0), timeout=LEASE_TTL_S + 5,
               what="Redis to hold nothing")
    for s in (a, b):
        wait_until(lambda s=s: s.inflight() == 0, timeout=LEASE_TTL_S + 5, what="in-flight 0")
    # Once every replica had its refresh to take its leases again in the new Redis (the
    # rebuild window after a restart), admissions resume.
    for s in (a, b):
        wait_until(lambda s=s: admits(s), timeout=15, what="admissions after the rebuild window")
    # Nothing double-counted: the whole budget is there again, and not more.
    again = open_all([((a, b)[i % 2], f"after-{i}") for i in range(N + K)])
    try:
        assert sum(h.admitted for h in again) == N, [repr(h.error) for h in again]
    finally:
        finish_all(again)
