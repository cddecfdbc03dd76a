"""load: timed chat requests sent through Envoy in simulated time, as openai-python clients send
them, for the benchmarks that replay a workload against simulated nodes.

A request (each benchmark's ``Req``: ``id``, ``at``, ``tenant``, ``klass``, ``body``,
``stream``) arrives at ``at`` simulated seconds, belongs to a class (``online``: a streamed
chat, retried twice; ``batch``: a document, retried until the batch deadline) and carries
its JSON body. ``Client`` sends each one ``speedup`` times faster than simulated time,
honours ``retry-after-ms``/``retry-after`` (kvgate) and ``x-ratelimit-reset`` (Envoy), and
writes how it ended into its ``Result``; ``replay`` runs them all beside side tasks
(samplers, background load) that it stops when the last request has ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

# A placer routes a request to a node with this header (Envoy matches it to one cluster per node).
NODE_HEADER = "x-bench-node"
ONLINE_RETRIES = 2  # openai-python's default
# The chat template's cost of one user message (OpenAI recipe: 3 per message, 1 for the
# role "user", 3 to prime the reply): a content of n one-token words is an n+7-token prompt.
CHAT_OVERHEAD = 7


class Placer(Protocol):
    """Placer routes requests itself (the oracles): ``acquire`` waits for a node and returns
    (node, token), ``release`` gives it back when the request ends, ``tick`` runs per sample."""

    async def acquire(self, req: Any) -> tuple[int, int]: ...

    def release(self, node: int, token: int) -> None: ...

    def tick(self) -> None: ...


def retry_delay(headers: Any, attempt: int) -> float:
    """retry_delay is the real seconds to wait before retrying, as openai-python decides it:
    ``retry-after-ms``, then ``retry-after`` (kvgate), ``x-ratelimit-reset`` (Envoy's local rate
    limit), else exponential backoff from 0.5 s to 8 s."""
    for name, unit in (("retry-after-ms", 0.001), ("retry-after", 1.0), ("x-ratelimit-reset", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                secs = float(value) * unit
            except ValueError:
                continue
            if 0 <= secs <= 60:
                return secs
    return min(8.0, 0.5 * 2 ** attempt)


@dataclass(slots=True)
class Result:
    """Result is how one request ended (``req``: the benchmark's request). Times in simulated
    seconds from the run's start."""

    req: Any
    status: str = "pending"        # ok | refused | error
    attempts: int = 0
    refusals: int = 0              # 429 answers seen, retried ones included
    last_status: int | None = None
    ttft: float | None = None      # from the first attempt to the first token
    done_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    # (status, simulated s from the attempt's start to its answer's headers) per attempt
    answers: list[tuple[int, float]] = field(default_factory=list)


class Client:
    """Client replays requests through Envoy at ``url``, in real time ``speedup`` times faster
    than simulated; ``t0`` is the real monotonic instant of simulated 0, ``batch_deadline`` the
    real instant after which a batch request is not retried. ``placer`` (optional) picks each
    request's node, sent in NODE_HEADER."""

    def __init__(self, url: str, speedup: float, t0: float, batch_deadline: float,
                 placer: Placer | None = None) -> None:
        self.url = url
        self.speedup = speedup
        self.t0 = t0
        self.batch_deadline = batch_deadline
        self.oracle = placer
        self.open = {"online": 0, "batch": 0}        # arrived and not ended (waiting, backing off or running)
        self.attempting = {"online": 0, "batch": 0}  # with a try on the wire
        self.refusals = {"online": 0, "batch": 0}    # 429 answers so far

    def sim_now(self) -> float:
        return (time.monotonic() - self.t0) * self.speedup

    def target(self, r: Result) -> str:
        """target is the URL ``r``'s next try goes to (one Envoy here)."""
        return self.url

    def headers(self, req: Any) -> dict[str, str]:
        """headers are a request's HTTP headers: its tenant in ``x-tenant-id``, as the verified
        source in front of Envoy would set it."""
        return {"content-type": "application/json", "x-tenant-id": req.tenant}

    async def send(self, session: aiohttp.ClientSession, r: Result) -> None:
        """send waits for ``r``'s arrival, then tries until it completes or may not retry."""
        req = r.req
        await asyncio.sleep(max(0.0, self.t0 + req.at / self.speedup - time.monotonic()))
        self.open[req.klass] += 1
        try:
            await self._attempts(session, r)
        finally:
            self.open[req.klass] -= 1
            if r.done_at is None:
                r.done_at = self.sim_now()

    async def _attempts(self, session: aiohttp.ClientSession, r: Result) -> None:
        req = r.req
        first = self.sim_now()
        headers = self.headers(req)
        max_retries = ONLINE_RETRIES if req.klass == "online" else 1_000_000
        placed: tuple[int, int] | None = None
        if self.oracle is not None:
            placed = await self.oracle.acquire(req)
            headers[NODE_HEADER] = str(placed[0])
        try:
            while True:
                r.attempts += 1
                self.attempting[req.klass] += 1
                try:
                    retryable, delay = await self._attempt(session, r, headers, first)
                finally:
                    self.attempting[req.klass] -= 1
                if r.status == "ok":
                    return
                out_of_time = req.klass == "batch" and time.monotonic() + delay > self.batch_deadline
                if not retryable or r.attempts > max_retries or out_of_time:
                    r.status = "refused" if r.last_status == 429 else "error"
                    return
                await asyncio.sleep(delay)
        finally:
            if placed is not None and self.oracle is not None:
                self.oracle.release(*placed)

    async def _attempt(self, session: aiohttp.ClientSession, r: Result, headers: dict[str, str],
                       first: float) -> tuple[bool, float]:
        """_attempt sends one try; returns (retryable, real seconds to wait before the next)."""
        sent = self.sim_now()
        try:
            async with session.post(self.target(r), data=r.req.body, headers=headers) as resp:
                r.last_status = resp.status
                r.answers.append((resp.status, self.sim_now() - sent))
                if resp.status == 200:
                    if r.req.stream:
                        await self._read_stream(resp, r, first)
                    else:
                        body = await resp.json(loads=orjson.loads)
                        usage = body.get("usage") or {}
                        r.prompt_tokens = usage.get("prompt_tokens", 0)
                        r.completion_tokens = usage.get("completion_tokens", 0)
                        r.finish_reason = (body.get("choices") or [{}])[0].get("finish_reason")
                    if r.completion_tokens:
                        r.status = "ok"
                        r.done_at = self.sim_now()
                        return False, 0.0
                    return True, retry_delay({}, r.attempts - 1)
                await resp.read()
                if resp.status == 429:
                    r.refusals += 1
                    self.refusals[r.req.klass] += 1
                retryable = (resp.status in (408, 409, 429) or resp.status >= 500) and \
                    resp.headers.get("x-should-retry", "true") != "false"
                return retryable, retry_delay(resp.headers, r.attempts - 1)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return True, retry_delay({}, r.attempts - 1)

    async def _read_stream(self, resp: aiohttp.ClientResponse, r: Result, first: float) -> None:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if r.ttft is None and b'"content":"' in line and b'"content":""' not in line:
                r.ttft = self.sim_now() - first
            if b'"finish_reason":"' in line:
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                r.finish_reason = choices[0].get("finish_reason") or r.finish_reason
            elif b'"usage":{' in line:
                usage = orjson.loads(line[6:]).get("usage") or {}
                r.prompt_tokens = usage.get("prompt_tokens", 0)
                r.completion_tokens = usage.get("completion_tokens", 0)


def session() -> aiohttp.ClientSession:
    """session is the load generator's HTTP session: no overall timeout, no connection limit."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                 connector=aiohttp.TCPConnector(limit=0))


async def replay(sends: Sequence[Coroutine[Any, Any, None]], limit_s: float,
                 beside: Sequence[Coroutine[Any, Any, None]] = ()) -> str | None:
    """replay runs ``sends`` (one per request) beside ``beside`` (samplers, background load) until
    every send has returned or ``limit_s`` real seconds have passed, then stops the side tasks;
    returns the run's error, or None."""
    tasks = [asyncio.create_task(c) for c in beside]
    try:
        await asyncio.wait_for(asyncio.gather(*sends), timeout=limit_s)
        return None
    except TimeoutError:
        return "the run did not end within its time limit; unfinished requests count as errors"
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass


def close_results(results: Sequence[Result], label: str) -> None:
    """close_results counts unfinished requests as errors and prints how many completed."""
    for r in results:
        if r.status == "pending":
            r.status = "error"
    done = sum(r.status == "ok" for r in results)
    print(f"  [{label}] {done}/{len(results)} completed", flush=True)


def by_class(results: Sequence[Result], classes: Sequence[str] = ("online", "batch")) -> dict[str, dict[str, int]]:
    """by_class counts per request class: requests, completed, refused, failed, 429 answers seen."""
    out: dict[str, dict[str, int]] = {}
    for klass in classes:
        rs = [r for r in results if r.req.klass == klass]
        out[klass] = {"n": len(rs), "ok": sum(r.status == "ok" for r in rs),
                      "refused": sum(r.status == "refused" for r in rs),
                      "error": sum(r.status == "error" for r in rs),
                      "429s": sum(r.refusals for r in rs)}
    return out


def goodput(results: Sequence[Result]) -> tuple[int, float]:
    """goodput is (prompt + completion tokens of completed requests, simulated seconds from the
    first arrival to the last completion)."""
    ok = [r for r in results if r.status == "ok"]
    start = min((r.req.at for r in results), default=0.0)
    end = max((r.done_at for r in ok if r.done_at is not None), default=start)
    return sum(r.prompt_tokens + r.completion_tokens for r in ok), max(1e-9, end - start)


def result_rows(results: Sequence[Result], *fields: str) -> list[dict[str, Any]]:
    """result_rows is each result as a JSON row: the request's id, arrival, tenant, class and
    ``fields`` of it, then how it ended."""
    return [{"id": r.req.id, "at": r.req.at, "tenant": r.req.tenant, "class": r.req.klass,
             **{f: getattr(r.req, f) for f in fields},
             "status": r.status, "attempts": r.attempts, "refusals": r.refusals,
             "last_status": r.last_status, "ttft": r.ttft, "done_at": r.done_at,
             "usage": [r.prompt_tokens, r.completion_tokens], "finish_reason": r.finish_reason,
             "answers": r.answers}
            for r in results]
