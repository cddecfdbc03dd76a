"""upstream: a small, fast fake of an OpenAI-compatible inference server (vLLM-shaped).

It answers ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` the way
vLLM does: JSON with ``usage`` when not streamed; when streamed, SSE chunks at a
configurable pace, the usage chunk (``"choices": []``) only when the request asked for
``stream_options.include_usage``, then ``data: [DONE]``.

Behaviour per request is chosen with request headers, so one process serves every test:

- ``x-fake-tokens: N``: completion tokens to generate (default: ``max_tokens`` or 8);
- ``x-fake-delay-ms: D``: pause before each streamed chunk, in milliseconds (default 0);
- ``x-fake-status: S``: answer status S (4xx/5xx) with an OpenAI-shaped error body;
- ``x-fake-hold: KEY``: send the first streamed chunk, then wait (at most 60 s) until
  ``POST /_fake/release/KEY`` (or the client goes away) before sending the rest;
- ``x-fake-die-after: N``: a streamed answer stops after N chunks with its connection
  aborted, as a server that crashes mid-generation;
- ``x-fake-usage: TEXT``: the reported ``usage.completion_tokens`` is TEXT, written into the
  JSON as it is (a hostile server's count, or one that differs from the chunks sent);
- ``x-fake-split-usage: 1``: the usage (the streamed usage chunk, or the JSON answer) is
  written in two parts, split inside ``completion_tokens``, the pace of ``x-fake-delay-ms``
  (at least 20 ms) apart, so that a proxy reads it in two chunks.

``GET /_fake/requests`` returns the last requests received (path, headers, body) so tests
can check what the gateway forwarded; ``GET /_fake/stats`` returns counters (``started``,
``finished``, ``aborted``). Run it with ``python -m kvgate_testkit.upstream --port N``.

``--fast`` serves the benchmarks instead: ``FastUpstream``, the same answers (JSON with
usage, or SSE chunks paced by ``x-fake-delay-ms``, sized by ``x-fake-tokens``; GET
``/metrics``: an idle vLLM node's few lines) from a bare
asyncio protocol at a fraction of aiohttp's CPU per request, so that on a small machine the
fake takes as little as possible from the processes measured. Every SSE chunk carries
``"t_sent"``, the ``time.monotonic()`` (CLOCK_MONOTONIC, shared by every process on the
host) at which it was written, so a client can tell each chunk's delay through the
gateway. ``x-fake-hold: 1`` sends the first chunk, then holds the stream open until the
client goes away. No control endpoints, no request log.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from typing import Any

import orjson
from aiohttp import web

DEFAULT_TOKENS = 8
MAX_HOLD_S = 60.0
RECENT = 64


class FakeUpstream:
    """FakeUpstream holds the fake's state: recent requests, held streams and counters."""

    def __init__(self) -> None:
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self.holds: dict[str, asyncio.Event] = {}
        self.stats = {"started": 0, "finished": 0, "aborted": 0}

    def app(self) -> web.Application:
        """app builds the aiohttp application that serves the fake."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/_fake/requests", self.requests)
        app.router.add_get("/_fake/stats", self.get_stats)
        app.router.add_post("/_fake/release/{key}", self.release)
        app.router.add_post("/_fake/reset", self.reset)
        return app

    # --- control ---------------------------------------------------------------

    async def requests(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(list(self.recent)), content_type="application/json")

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.stats), content_type="application/json")

    async def release(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        self.holds.setdefault(key, asyncio.Event()).set()
        return web.Response(text="released")

    async def reset(self, request: web.Request) -> web.Response:
        self.recent.clear()
        for event in self.holds.values():  # held streams finish rather than hang
            event.set()
        self.holds.clear()
        for k in self.stats:
            self.stats[k] = 0
        return web.Response(text="reset")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    # --- inference -------------------------------------------------------------

    async def _read(self, request: web.Request) -> tuple[dict[str, Any] | None, bytes]:
        raw = await request.read()
        self.recent.append({"path": request.path, "headers": {str(k): v for k, v in request.headers.items()},
                            "body": raw.decode("utf-8", "replace")})
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, raw
        return (body if isinstance(body, dict) else None), raw

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        body = {"object": "error", "message": message, "type": "BadRequestError" if status < 500
                else "InternalServerError", "param": None, "code": status}
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    async def _accepted(self, request: web.Request) -> tuple[dict[str, Any], bytes] | web.Response:
        """_accepted is the request's JSON body and raw bytes, or the error the fake answers
        instead (``x-fake-status`` >= 400, or a body that is not a JSON object)."""
        body, raw = await self._read(request)
        status = int(request.headers.get("x-fake-status", "200"))
        if status >= 400:
            return self._error(status, "fake upstream error")
        if body is None:
            return self._error(400, "body is not a JSON object")
        return body, raw

    async def embeddings(self, request: web.Request) -> web.Response:
        got = await self._accepted(request)
        if isinstance(got, web.Response):
            return got
        body, _ = got
        inputs = body.get("input")
        items = inputs if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else [inputs]
        prompt = sum(max(1, len(str(i)) // 4) for i in items)
        data = [{"object": "embedding", "index": i, "embedding": [0.0, 0.1, 0.2]} for i in range(len(items))]
        out = {"object": "list", "data": data, "model": body.get("model", "fake"),
               "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        got = await self._accepted(request)
        if isinstance(got, web.Response):
            return got
        body, raw = got
        chat = request.path.endswith("/chat/completions")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        tokens = int(request.headers.get("x-fake-tokens", max_tokens or DEFAULT_TOKENS))
        if isinstance(max_tokens, int):
            tokens = min(tokens, max_tokens)
        prompt_tokens = max(1, len(raw) // 8)
        model = body.get("model", "fake")
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                 "completion_tokens": tokens}
        created = int(time.time())
        finish = "length" if isinstance(max_tokens, int) and tokens >= max_tokens else "stop"
        if not body.get("stream"):
            text = " ".join(f"tok{i}" for i in range(tokens))
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "logprobs": None, "finish_reason": finish} if chat else
                                      {"index": 0, "text": text, "logprobs": None,
                                       "finish_reason": finish})
            out = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": model, "choices": [choice], "usage": usage}
            self.stats["started"] += 1
            self.stats["finished"] += 1
            data = _reported(orjson.dumps(out), tokens, request.headers.get("x-fake-usage"))
            if "x-fake-split-usage" not in request.headers:
                return web.Response(body=data, content_type="application/json")
            resp = web.StreamResponse(headers={"content-type": "application/json"})
            await resp.prepare(request)
            await _write_split(resp, data, _split_pause(request))
            await resp.write_eof()
            return resp
        return await self._stream(request, body, chat, tokens, usage, finish, model, created)

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool, tokens: int,
                      usage: dict[str, int], finish: str, model: str, created: int) -> web.StreamResponse:
        delay = float(request.headers.get("x-fake-delay-ms", "0")) / 1000.0
        hold = request.headers.get("x-fake-hold")
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "cache-control": "no-cache"})
        await resp.prepare(request)
        self.stats["started"] += 1
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
            c: dict[str, Any] = {"id": "chatcmpl-fake", "object": obj, "created": created,
                                 "model": model, "choices": choices}
            if extra:
                c.update(extra)
            return b"data: " + orjson.dumps(c) + b"\n\n"

        def piece(i: int, last: bool) -> dict[str, Any]:
            fin = finish if last else None
            if chat:
                delta: dict[str, Any] = {"content": f"tok{i} "}
                if i == 0:
                    delta["role"] = "assistant"
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
            return {"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": fin}

        die_after = int(request.headers.get("x-fake-die-after", "-1"))
        try:
            for i in range(tokens):
                if delay:
                    await asyncio.sleep(delay)
                if i == die_after:
                    assert request.transport is not None
                    request.transport.abort()
                    self.stats["aborted"] += 1
                    return resp
                await resp.write(chunk([piece(i, i == tokens - 1)]))
                if i == 0 and hold:
                    event = self.holds.setdefault(hold, asyncio.Event())
                    await asyncio.wait_for(event.wait(), MAX_HOLD_S)
            if include_usage:
                data = _reported(chunk([], {"usage": usage}), tokens, request.headers.get("x-fake-usage"))
                if "x-fake-split-usage" in request.headers:
                    await _write_split(resp, data, _split_pause(request))
                else:
                    await resp.write(data)
            # [DONE] and the end of the body in one write: openai-python closes on [DONE],
            # and an end of body still on its way then reads, in Envoy's access log, as a
            # stream cut short (a real server may do that; the access-log tests need it not to).
            await resp.write_eof(b"data: [DONE]\n\n")
            self.stats["finished"] += 1
        except (ConnectionResetError, asyncio.CancelledError, TimeoutError):
            self.stats["aborted"] += 1
            raise
        finally:
            if hold:
                self.holds.pop(hold, None)
        return resp


def _reported(data: bytes, tokens: int, text: str | None) -> bytes:
    """_reported is ``data`` with its usage's completion_tokens written as ``text`` (None: as is)."""
    if text is None:
        return data
    return data.replace(b'"completion_tokens":%d' % tokens, b'"completion_tokens":' + text.encode())


def _split_pause(request: web.Request) -> float:
    return max(0.02, float(request.headers.get("x-fake-delay-ms", "0")) / 1000.0)


async def _write_split(resp: web.StreamResponse, data: bytes, pause_s: float) -> None:
    """_write_split writes ``data`` in two parts cut inside ``completion_tokens``, ``pause_s``
    seconds apart."""
    cut = data.index(b"completion_tokens") + len(b"completion")
    await resp.write(data[:cut])
    await asyncio.sleep(pause_s)
    await resp.write(data[cut:])


# --- the fast fake for benchmarks ------------------------------------------------------

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024
# What GET /metrics answers: an idle vLLM node with room for 1.6 billion KV tokens, so that
# a pool that picks its nodes (deploy/envoy-endpoint-picker.yaml) can name this one and
# never runs out of room under the benchmark's load.
_VLLM_METRICS = (b'vllm:kv_cache_usage_perc{model_name="fake"} 0.0\n'
                 b'vllm:num_requests_waiting{model_name="fake"} 0.0\n'
                 b'vllm:num_requests_running{model_name="fake"} 0.0\n'
                 b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000000"} 1.0\n')


def _dechunk(buf: bytearray, at: int) -> tuple[bytes, int] | None:
    """_dechunk reads a chunked body from ``buf[at:]``: (body, end offset), or None if incomplete."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(bytes(buf[at:eol]).split(b";")[0], 16)
        if size == 0:
            stop = buf.find(b"\r\n\r\n", eol)  # no trailers are sent here
            return (b"".join(parts), stop + 4) if stop >= 0 else None
        if len(buf) < eol + 2 + size + 2:
            return None
        parts.append(bytes(buf[eol + 2:eol + 2 + size]))
        at = eol + 2 + size + 2


class FastUpstream(asyncio.Protocol):
    """FastUpstream is one keep-alive HTTP/1.1 connection of the benchmark fake (see the module doc).

    Requests on a connection are answered in order; a body comes with a content-length or
    chunked (as Envoy forwards a body it buffered with request headers skipped).
    """

    __slots__ = ("transport", "buf", "busy", "closed")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(_HEAD_END)
        if end < 0:
            if len(self.buf) > _MAX_HEAD:
                self._fail(431)
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            # Envoy sends a body it buffered for ext_proc without its content-length.
            got = _dechunk(self.buf, end + 4)
            if got is None:
                return
            body, stop = got
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._fail(400)
                return
            if len(self.buf) < end + 4 + length:
                return
            body, stop = bytes(self.buf[end + 4:end + 4 + length]), end + 4 + length
        del self.buf[:stop]
        parts = head[0].split(" ")
        path = parts[1] if len(parts) > 1 else "/"
        self.busy = True
        asyncio.get_running_loop().create_task(self._answer(path, headers, body))

    def _fail(self, status: int) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %d Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % status)
        self.transport.close()

    def _write(self, data: bytes) -> None:
        if not self.closed:
            assert self.transport is not None
            self.transport.write(data)

    async def _answer(self, path: str, headers: dict[str, str], raw: bytes) -> None:
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        if path == "/metrics":
            self._write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(_VLLM_METRICS), _VLLM_METRICS))
        elif not isinstance(body, dict) or not path.startswith("/v1/"):
            payload = b'{"object":"error","message":"not served here","code":404}'
            self._write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        else:
            max_tokens = body.get("max_tokens")
            tokens = int(headers.get("x-fake-tokens", max_tokens or DEFAULT_TOKENS))
            usage = {"prompt_tokens": max(1, len(raw) // 8), "completion_tokens": tokens,
                     "total_tokens": max(1, len(raw) // 8) + tokens}
            if body.get("stream"):
                await self._stream(body, headers, tokens, usage)
            else:
                text = " ".join(f"tok{i}" for i in range(tokens))
                payload = orjson.dumps({
                    "id": "cmpl-fake", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "fake"), "usage": usage, "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": "length"}]})
                self._write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        self.busy = False
        if self.buf and not self.closed:
            self._next()

    async def _stream(self, body: dict[str, Any], headers: dict[str, str], tokens: int,
                      usage: dict[str, int]) -> None:
        delay = float(headers.get("x-fake-delay-ms", "0")) / 1000.0
        hold = "x-fake-hold" in headers
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self._write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n")
        created = int(time.time())

        def event(payload: dict[str, Any]) -> None:
            payload["t_sent"] = time.monotonic()
            data = b"data: " + orjson.dumps(payload) + b"\n\n"
            self._write(b"%x\r\n%s\r\n" % (len(data), data))

        for i in range(tokens):
            if self.closed:
                return
            if delay and i:
                await asyncio.sleep(delay)
            event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
                   "model": "fake", "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                                  "finish_reason": None}]})
            if hold:
                while not self.closed:  # held until the client goes away
                    await asyncio.sleep(0.5)
                return
        if include_usage:
            event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
                   "model": "fake", "choices": [], "usage": usage})
        data = b"data: [DONE]\n\n"
        self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))


async def serve_fast(host: str, port: int) -> None:
    """serve_fast runs the benchmark fake on host:port until cancelled."""
    server = await asyncio.get_running_loop().create_server(FastUpstream, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """main serves the fake on 127.0.0.1:PORT until killed."""
    ap = argparse.ArgumentParser(description="fake vLLM-shaped upstream for tests")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--fast", action="store_true", help="the lean fake for benchmarks")
    args = ap.parse_args(argv)
    if args.fast:
        try:
            import uvloop
            run: Any = uvloop.run
        except ImportError:
            run = asyncio.run
        try:
            run(serve_fast(args.host, args.port))
        except KeyboardInterrupt:
            pass
        return
    # handler_cancellation: a client that goes away cancels its handler, as vLLM aborts
    web.run_app(FakeUpstream().app(), host=args.host, port=args.port, print=None,
                access_log=None, handle_signals=True, handler_cancellation=True)


if __name__ == "__main__":
    main()
