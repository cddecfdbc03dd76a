"""Tests of the simulated engine's accounting and scheduling, over fixed simulated instants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.blocks import BlockPool, blocks_for
from sim.engine import Engine, EngineParams, EventKind, SeqStatus


def make(capacity: int = 16 * 1000, **kw) -> Engine:
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    kw.setdefault("decode_tokens_per_s", 10.0)
    kw.setdefault("batch_slowdown", 0.0)
    return Engine(EngineParams(kv_capacity_tokens=capacity, **kw))


def run_until_idle(engine: Engine, limit: float = 1e6) -> list:
    events = []
    while (end := engine.next_step_end()) is not None:
        assert end <= limit, "engine did not go idle"
        events += engine.advance(end)
    return events


def tokens_of(events, seq_id: int) -> list[float]:
    return [e.at for e in events if e.seq_id == seq_id and e.kind is EventKind.TOKEN]


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_pool_refuses_more_than_free_and_counts_background():
    pool = BlockPool(10, 16)
    assert pool.take(7) and pool.used == 7
    pool.set_background_tokens(40)          # 3 blocks
    assert pool.free == 0 and not pool.take(1)
    pool.set_background_tokens(10_000)      # capped at the pool
    assert pool.background == 10 and pool.usage == 1.0 and pool.free == 0
    pool.give_back(7)
    with pytest.raises(ValueError):
        pool.give_back(1)


def test_prefill_takes_time_in_proportion_to_prompt_then_decode_steps():
    e = make()
    sid = e.add(0.0, prompt_tokens=2000, target_tokens=3)
    assert e.advance(1.99) == []
    # 2000 tokens at 1000 tok/s, in chunks of 8192: one step of 2.0 s gives the first token
    ev = e.advance(2.0)
    assert [(x.kind, x.at) for x in ev] == [(EventKind.TOKEN, 2.0)]
    ev += run_until_idle(e)
    assert tokens_of(ev, sid) == pytest.approx([2.0, 2.1, 2.2])
    assert ev[-1].kind is EventKind.FINISHED and ev[-1].seq_id == sid


def test_long_prompt_is_chunked_and_gets_blocks_per_chunk():
    e = make(capacity=16 * 4000, max_num_batched_tokens=8192)
    sid = e.add(0.0, prompt_tokens=20_000, target_tokens=1)
    assert e.seq(sid).blocks == 8192 // 16       # first chunk only
    e.advance(8.192)
    assert e.seq(sid).num_computed == 8192 and e.seq(sid).blocks == 2 * 8192 // 16
    ev = run_until_idle(e)
    assert tokens_of(ev, sid) == pytest.approx([20.0])


def test_blocks_track_tokens_and_are_freed_on_completion():
    e = make()
    sid = e.add(0.0, prompt_tokens=30, target_tokens=10)
    assert e.pool.used == blocks_for(30, 16)
    e.advance(0.03)     # prefill done, first token sampled; the step in flight computes token 31
    assert e.seq(sid).num_computed == 30 and e.pool.used == 2
    e.advance(0.13)     # 31 computed; the next step computes token 32: still 2 blocks
    assert e.seq(sid).num_computed == 31 and e.pool.used == 2
    e.advance(0.23)     # 32 computed; the step computing token 33 needed a third block
    assert e.seq(sid).num_computed == 32 and e.pool.used == 3 == e.held_blocks()
    run_until_idle(e)
    assert e.pool.used == 0 and e.stats().running == 0 and e.seq(sid) is None
    assert e.stats().finished["length"] == 1


def test_abort_frees_blocks_of_running_and_waiting_requests():
    e = make(capacity=16 * 10)
    a = e.add(0.0, prompt_tokens=100, target_tokens=50)   # 7 blocks
    b = e.add(0.0, prompt_tokens=100, target_tokens=50)   # does not fit: waits
    e.advance(0.1)
    assert e.stats().running == 1 and e.stats().waiting == 1 and e.pool.used == 7
    assert e.abort(0.15, b) and e.stats().waiting == 0 and e.pool.used == 7
    assert e.abort(0.15, a) and e.pool.used == 0 and e.held_blocks() == 0
    # the step in flight (a's first decode) ends without a token for the aborted request
    assert run_until_idle(e) == []
    assert not e.abort(0.3, a)
    assert e.stats().finished["abort"] == 2


def test_request_waits_while_its_prompt_blocks_are_not_free():
    e = make(capacity=16 * 10)
    a = e.add(0.0, prompt_tokens=100, target_tokens=2)   # 7 of 10 blocks
    b = e.add(0.0, prompt_tokens=100, target_tokens=2)
    ev = e.advance(0.1)
    assert e.seq(b).status is SeqStatus.WAITING and e.stats().waiting == 1
    ev += run_until_idle(e)
    assert tokens_of(ev, b)[0] > tokens_of(ev, a)[-1]      # b ran only after a freed its blocks
    assert e.stats().waiting == 0 and e.pool.used == 0


def test_waiting_queue_is_fifo_a_large_head_blocks_small_requests():
    e = make(capacity=16 * 20)
    e.add(0.0, prompt_tokens=200, target_tokens=5)           # 13 blocks
    big = e.add(0.0, prompt_tokens=150, target_tokens=5)     # 10 blocks: waits
    small = e.add(0.0, prompt_tokens=10, target_tokens=5)    # would fit, but is behind big
    e.advance(0.2)                                           # first step over: the queue was tried
    assert e.stats().running == 1 and e.pool.used == 13
    assert e.seq(big).status is SeqStatus.WAITING and e.seq(small).status is SeqStatus.WAITING
    assert e.stats().waiting == 2


def test_growth_past_capacity_preempts_the_newest_request_which_recomputes():
    e = make(capacity=16 * 8)
    a = e.add(0.0, prompt_tokens=48, target_tokens=40)     # 3 blocks each at admission
    b = e.add(0.0, prompt_tokens=48, target_tokens=40)     # joins at the next step
    ev = e.advance(0.048)
    assert e.pool.used == 4 + 3 and e.stats().running == 2   # a decodes its 49th token
    ev += run_until_idle(e)
    s = e.stats()
    assert s.preemptions >= 1
    assert len(tokens_of(ev, a)) == 40 and len(tokens_of(ev, b)) == 40   # nothing lost
    assert tokens_of(ev, a)[-1] < tokens_of(ev, b)[-1]                   # the newer one yielded
    assert s.used_blocks == 0 and s.finished["length"] == 2
    # the recompute of b (its prompt and generated tokens) was charged as prefill time again
    assert max(b2 - b1 for b1, b2 in zip(tokens_of(ev, b), tokens_of(ev, b)[1:])) > 0.1 + 1e-9


def test_preemption_never_lets_blocks_exceed_the_pool():
    e = make(capacity=16 * 8)
    for _ in range(3):
        e.add(0.0, prompt_tokens=30, target_tokens=60)
    while (end := e.next_step_end()) is not None:
        e.advance(end)
        assert e.pool.used <= e.pool.total and e.pool.used == e.held_blocks()
    assert e.stats().preemptions >= 1 and e.pool.used == 0


def test_crash_mode_fails_every_running_request_and_empties_the_pool():
    e = make(capacity=16 * 8, overflow="crash")
    a = e.add(0.0, prompt_tokens=48, target_tokens=40)
    b = e.add(0.0, prompt_tokens=48, target_tokens=40)
    ev = run_until_idle(e)
    failed = {x.seq_id for x in ev if x.kind is EventKind.FAILED}
    assert failed == {a, b}
    failed_at = {x.at for x in ev if x.kind is EventKind.FAILED}
    assert len(failed_at) == 1                                 # one crash took both
    s = e.stats()
    assert s.crashes == 1 and s.preemptions == 0 and s.used_blocks == 0 and s.running == 0
    assert s.finished["error"] == 2


def test_decode_step_time_grows_with_batch_size():
    def interval(n: int) -> float:
        e = make(capacity=16 * 100, batch_slowdown=0.1)
        ids = [e.add(0.0, prompt_tokens=16, target_tokens=4) for _ in range(n)]
        ev = run_until_idle(e)
        t = tokens_of(ev, ids[0])
        return t[2] - t[1]
    assert interval(1) == pytest.approx(0.1)
    assert interval(4) == pytest.approx(0.1 * 1.3)


def test_background_kv_counts_in_usage_and_blocks_admission():
    e = make(capacity=16 * 10)
    e.configure(0.0, background_kv_tokens=16 * 8)
    assert e.stats().kv_usage == pytest.approx(0.8)
    sid = e.add(0.0, prompt_tokens=100, target_tokens=1)       # 7 blocks, 2 free
    assert e.seq(sid).status is SeqStatus.WAITING and e.next_step_end() is None
    e.configure(1.0, background_kv_tokens=0)                    # pressure gone: it runs
    ev = run_until_idle(e)
    assert tokens_of(ev, sid) == pytest.approx([1.1])


def test_configure_rejects_bad_values_and_changes_nothing():
    e = make()
    with pytest.raises(ValueError):
        e.configure(0.0, decode_tokens_per_s=0.0, background_kv_tokens=5)
    with pytest.raises(ValueError):
        e.configure(0.0, nonsense=1)
    assert e.params.decode_tokens_per_s == 10.0 and e.params.background_kv_tokens == 0


def test_requests_that_can_never_fit_are_refused():
    e = make(capacity=16 * 4)
    with pytest.raises(ValueError):
        e.add(0.0, prompt_tokens=60, target_tokens=5)
    with pytest.raises(ValueError):
        e.add(0.0, prompt_tokens=0, target_tokens=5)
    with pytest.raises(ValueError):
        EngineParams(kv_capacity_tokens=8, block_size=16).validate()


def test_early_stop_is_reported_as_stop():
    e = make()
    e.add(0.0, prompt_tokens=10, target_tokens=3, max_tokens=10)
    run_until_idle(e)
    assert e.stats().finished == {"length": 0, "stop": 1, "abort": 0, "error": 0}
    assert e.stats().generation_tokens == 3 and e.stats().prompt_tokens == 10


def _script(ops):
    e = make(capacity=16 * 12, max_num_batched_tokens=64, batch_slowdown=0.05)
    t = 0.0
    ids: list[int] = []
    targets: dict[int, int] = {}
    log = []
    for op, a, b in ops:
        if op == "add":
            try:
                ids.append(e.add(t, prompt_tokens=a, target_tokens=b))
                targets[ids[-1]] = b
            except ValueError:
                pass
        elif op == "abort" and ids:
            e.abort(t, ids[a % len(ids)])
        elif op == "bg":
            e.configure(t, background_kv_tokens=a)
        else:
            t += a / 10
            log += e.advance(t)
        assert e.pool.used == e.held_blocks() <= e.pool.total
    e.configure(t, background_kv_tokens=0)
    log += run_until_idle(e)
    return e, targets, log


ops = st.lists(st.tuples(st.sampled_from(["add", "abort", "bg", "advance"]),
                         st.integers(1, 150), st.integers(1, 40)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_accounting_invariants_hold_for_any_sequence_of_inputs(script):
    e, targets, log = _script(script)
    s = e.stats()
    assert s.used_blocks == 0 and s.running == 0 and s.waiting == 0
    finished = {x.seq_id for x in log if x.kind is EventKind.FINISHED}
    for sid in finished:
        # every finished request produced exactly its target tokens, preempted or not
        assert len([x for x in log if x.seq_id == sid and x.kind is EventKind.TOKEN]) == targets[sid]
    assert s.finished["length"] == len(finished)
    assert s.finished["length"] + s.finished["abort"] == len(targets)
    assert s.generation_tokens == len([x for x in log if x.kind is EventKind.TOKEN])


@settings(max_examples=20, deadline=None)
@given(ops)
def test_same_inputs_give_the_same_events(script):
    assert _script(script)[2] == _script(script)[2]
