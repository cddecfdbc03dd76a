"""ManualClock's timers: armed for an instant, handed to their loop when the clock passes it."""

from __future__ import annotations

import asyncio

import pytest

from extproc.clock import LoopTimers, ManualClock


async def turn() -> None:
    """turn lets the loop run what was handed to it."""
    await asyncio.sleep(0)


async def test_timers_fire_when_the_clock_passes_their_instant_in_order() -> None:
    loop = asyncio.get_running_loop()
    clock = ManualClock(100.0)
    fired: list[str] = []
    clock.call_later(loop, 2.0, lambda: fired.append("b"))
    clock.call_later(loop, 1.0, lambda: fired.append("a"))
    clock.call_later(loop, 2.0, lambda: fired.append("c"))   # same instant as b: armed after it
    clock.advance(0.999)
    await turn()
    assert fired == []
    clock.advance(0.001)
    assert fired == []                 # handed to the loop, run at its next turn
    await turn()
    assert fired == ["a"]
    clock.set(105.0)
    await turn()
    assert fired == ["a", "b", "c"]


async def test_a_cancelled_timer_never_fires_even_once_handed_to_the_loop() -> None:
    loop = asyncio.get_running_loop()
    clock = ManualClock(0.0)
    fired: list[int] = []
    early = clock.call_later(loop, 1.0, lambda: fired.append(1))
    late = clock.call_later(loop, 2.0, lambda: fired.append(2))
    early.cancel()
    clock.advance(5.0)
    late.cancel()                      # due and handed over, not yet run
    await turn()
    assert fired == []


async def test_a_timer_due_now_is_handed_over_at_once() -> None:
    loop = asyncio.get_running_loop()
    clock = ManualClock(0.0)
    fired: list[int] = []
    clock.call_later(loop, 0.0, lambda: fired.append(1))
    clock.call_later(loop, -3.0, lambda: fired.append(2))   # a late wake: as good as now
    await turn()
    assert fired == [1, 2]


def test_a_timer_of_a_closed_loop_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    clock = ManualClock(0.0)
    clock.call_later(loop, 1.0, lambda: pytest.fail("ran on a closed loop"))
    loop.close()
    clock.advance(2.0)                 # would raise RuntimeError if handed to the closed loop


async def test_loop_timers_are_the_loops_own() -> None:
    loop = asyncio.get_running_loop()
    handle = LoopTimers().call_later(loop, 3600.0, lambda: None)
    assert isinstance(handle, asyncio.TimerHandle)
    handle.cancel()
