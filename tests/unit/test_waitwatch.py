"""A waiting request cut at Envoy's base message timeout: told apart from a client giving up,
counted, and said once (fixed instants on a manual clock)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate_testkit.stream import Stream
from extproc.waitwatch import cut_at_base_timeout
from tests.unit.test_exchange import BASE_CONFIG, Rig, admit, body_msg, chat, headers_msg


@pytest.mark.parametrize(("waited", "base", "asked", "cut"), [
    (2.0, 2.0, 11.0, True),     # cut exactly at the base timeout (Envoy's 504 otherwise)
    (1.97, 2.0, 11.0, True),    # the reset seen a little before its body's arrival time + 2 s
    (2.7, 2.0, 11.0, True),     # seen late on a busy machine
    (0.8, 2.0, 11.0, False),    # a client that gave up early
    (4.0, 2.0, 11.0, False),    # a client that gave up later
    (2.0, 2.0, 2.5, False),     # the override barely reaches past the base: cannot tell
    (0.5, 0.5, 6.0, True),
])
def test_a_cut_is_a_wait_ended_at_the_base_timeout_well_before_the_override(waited, base, asked, cut):
    assert cut_at_base_timeout(waited, base, asked) is cut


def patient_rig() -> Rig:
    """patient_rig: class ``patient`` waits up to 10 s (asks Envoy for 11 s); 2 slots; Envoy's
    base message timeout 2 s."""
    tenants = {**BASE_CONFIG["tenants"], "classes": {**BASE_CONFIG["tenants"]["classes"],
                                                     "patient": {"max_wait_s": 10.0}},
               "tenants": {"slow": {"class": "patient"}}}
    return Rig({"tenants": tenants, "server": {"envoy_message_timeout_s": 2.0}})


async def cut_after(rig: Rig, seconds: float) -> None:
    """cut_after queues a patient request behind full slots, lets ``seconds`` pass on the
    manual clock, then ends its stream (the handler task is cancelled, as on an Envoy reset)."""
    sent: list[pb.ProcessingResponse] = []

    async def send(resp: pb.ProcessingResponse) -> None:
        sent.append(resp)

    ex = Stream(rig.gate)
    ex.request_headers(headers_msg(extra=[("x-tenant-id", "slow")]))
    task = asyncio.ensure_future(ex.request_body(body_msg(chat()), send))
    for _ in range(5):  # let it reach the queue; no time passes on the manual clock
        await asyncio.sleep(0)
    assert sent and not task.done()
    rig.clock.advance(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ex.finish()


async def test_waits_cut_at_the_base_timeout_are_counted_and_said_once(caplog):
    rig = patient_rig()
    held = [(await admit(rig))[0] for _ in range(2)]
    with caplog.at_level(logging.ERROR, logger="kvgate.exchange"):
        await cut_after(rig, 2.0)
        await cut_after(rig, 2.05)
    assert rig.count("kvgate_envoy_override_ignored_total", **{"class": "patient"}) == 2
    said = [r for r in caplog.records if "ignored kvgate's message-timeout override" in r.getMessage()]
    assert len(said) == 1 and "max_message_timeout" in said[0].getMessage()
    for h in held:
        h.finish()
    assert rig.inflight() == 0  # nothing leaked by the cut waits


async def test_a_client_giving_up_while_waiting_is_not_read_as_a_cut(caplog):
    rig = patient_rig()
    held = [(await admit(rig))[0] for _ in range(2)]
    with caplog.at_level(logging.ERROR, logger="kvgate.exchange"):
        await cut_after(rig, 0.4)
        await cut_after(rig, 6.0)
    assert rig.count("kvgate_envoy_override_ignored_total") == 0
    assert not [r for r in caplog.records if "override" in r.getMessage()]
    for h in held:
        h.finish()
