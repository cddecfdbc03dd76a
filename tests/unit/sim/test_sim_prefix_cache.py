"""Tests of the simulated engine's prefix caching (vLLM V1's), over fixed simulated instants."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sim.blocks import ROOT_HASH, BlockPool, PrefixCache, hash_block
from sim.engine import Engine, EngineParams, EventKind, SeqStatus
from sim.metrics import make_registry, render

BS = 4  # tokens per block: small numbers keep the block arithmetic readable


def make(blocks: int = 100, caching: bool = True, **kw) -> Engine:
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    kw.setdefault("decode_tokens_per_s", 10.0)
    kw.setdefault("batch_slowdown", 0.0)
    return Engine(EngineParams(kv_capacity_tokens=BS * blocks, block_size=BS,
                               enable_prefix_caching=caching, **kw))


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_until_idle(engine: Engine) -> list:
    events = []
    while (end := engine.next_step_end()) is not None:
        events += engine.advance(end)
    return events


def first_token(events, seq_id: int) -> float:
    return next(e.at for e in events if e.seq_id == seq_id and e.kind is EventKind.TOKEN)


def chain(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for k in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[k * BS:(k + 1) * BS])
        hashes.append(parent)
    return hashes


def cached(engine: Engine, tokens: list[int]) -> int:
    """cached is how many leading full blocks of ``tokens`` the engine holds a hash for."""
    assert engine.prefix_cache is not None
    return len(engine.prefix_cache.longest_hit(chain(tokens)))


def test_block_hash_is_a_chain_over_parent_and_tokens():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [1, 2, 3, 5])
    # the same tokens under another parent are another block: sharing stops at the first difference
    assert hash_block(a, [9, 9, 9, 9]) != hash_block(hash_block(ROOT_HASH, [0, 2, 3, 4]), [9, 9, 9, 9])


def test_shared_blocks_are_counted_once_in_usage():
    prefix = ids(0, 16)                                        # 4 full blocks
    for caching, used in ((True, 4 + 2 + 2), (False, 6 + 6)):
        e = make(caching=caching)
        a = e.add(0.0, 22, 5, token_ids=prefix + ids(100, 6))  # 6 blocks
        e.advance(0.022)                                       # a's prefill done: its blocks are cached
        b = e.add(0.022, 22, 5, token_ids=prefix + ids(200, 6))
        e.advance(0.125)                                       # b joins a's second decode step
        assert e.seq(a).status is SeqStatus.RUNNING and e.seq(b).status is SeqStatus.RUNNING
        s = e.stats()
        assert s.used_blocks == used == e.held_blocks()
        assert s.kv_usage == pytest.approx(used / 100)
        assert (s.prefix_cache_hits, s.prefix_cache_queries) == ((16, 44) if caching else (0, 0))


def test_a_full_hit_still_computes_the_last_token_so_a_block_aligned_prompt_reuses_one_block_less():
    e = make()
    e.add(0.0, 16, 1, token_ids=ids(0, 16))
    run_until_idle(e)
    e.add(1.0, 16, 1, token_ids=ids(0, 16))        # all 4 blocks cached: reuses 3, computes 4 tokens
    assert e.stats().prefix_cache_hits == 12
    ev = run_until_idle(e)
    assert ev[0].at == pytest.approx(1.0 + 4 / 1000)
    e.add(2.0, 17, 1, token_ids=ids(0, 17))        # one token past the blocks: reuses all 4
    assert e.stats().prefix_cache_hits == 12 + 16
    assert e.stats().prefix_cache_queries == 16 + 16 + 17


def test_reused_tokens_cost_no_prefill_time():
    e = make(blocks=1000)
    shared = ids(0, 800)                           # 200 blocks
    a = e.add(0.0, 900, 2, token_ids=shared + ids(10_000, 100))
    ev = run_until_idle(e)
    assert first_token(ev, a) == pytest.approx(0.9)             # 900 tokens at 1000 tok/s
    b = e.add(10.0, 900, 2, token_ids=shared + ids(20_000, 100))
    ev = run_until_idle(e)
    assert first_token(ev, b) == pytest.approx(10.0 + 0.1)      # only its 100 own tokens
    # the same with the flag off: the whole prompt again
    off = make(blocks=1000, caching=False)
    off.add(0.0, 900, 2, token_ids=shared + ids(10_000, 100))
    run_until_idle(off)
    c = off.add(10.0, 900, 2, token_ids=shared + ids(20_000, 100))
    assert first_token(run_until_idle(off), c) == pytest.approx(10.9)


def test_freed_blocks_stay_cached_and_are_evicted_tail_first():
    e = make(blocks=10)
    x = ids(0, 17)                                 # 4 full blocks (+1 token)
    e.add(0.0, 17, 1, token_ids=x)
    run_until_idle(e)
    s = e.stats()
    assert s.used_blocks == 0 and s.kv_usage == 0.0 and s.cached_free_blocks == 4   # cached reads as free
    assert cached(e, x) == 4
    # 7 new blocks: the 6 never-hashed free blocks first, then the LRU head: x's last block
    e.add(1.0, 26, 1, token_ids=ids(500, 26))
    assert e.stats().used_blocks == 7 and cached(e, x) == 3
    run_until_idle(e)
    assert e.add(2.0, 17, 1, token_ids=x) is not None
    assert e.stats().prefix_cache_hits == 12     # its head blocks were still there


def test_least_recently_freed_request_is_evicted_first_and_hits_leave_the_free_queue():
    e = make(blocks=12)
    x, y = ids(0, 17), ids(1000, 17)
    e.add(0.0, 17, 1, token_ids=x)
    run_until_idle(e)                              # x's 4 blocks freed first
    e.add(1.0, 17, 1, token_ids=y)
    run_until_idle(e)                              # then y's 4
    assert e.stats().cached_free_blocks == 8
    # a request needing 4 fresh + 2 evictions takes x's two tail blocks, y is untouched
    e.add(2.0, 21, 3, token_ids=ids(5000, 21))     # 6 blocks
    assert (cached(e, x), cached(e, y)) == (2, 4)
    run_until_idle(e)
    # a hit takes y's blocks off the free queue: a big request can no longer evict them
    hit = e.add(3.0, 17, 20, token_ids=y)
    assert e.seq(hit).cached_tokens == 16 and e.stats().cached_free_blocks < 8
    big = e.add(3.0, 24, 1, token_ids=ids(9000, 24))  # 7 blocks: only 12 - 5 held are free
    e.advance(3.001)
    assert cached(e, y) == 4 and e.seq(big).status is SeqStatus.RUNNING
    run_until_idle(e)
    assert e.stats().used_blocks == 0


def test_cached_prefix_tells_what_a_prompt_would_hit_and_what_of_it_is_held_without_changing_anything():
    e = make(blocks=20)
    x = ids(0, 17)
    assert e.cached_prefix(x) == (0, 0)
    a = e.add(0.0, 17, 40, token_ids=x)
    e.advance(0.1)                                 # x prefilled, still generating: its blocks are held
    longer = x[:12] + ids(900, 10)                 # shares x's first 3 blocks
    assert e.cached_prefix(longer) == (12, 12)
    assert e.cached_prefix(x) == (16, 16)          # never the last token: 4 blocks, not 5
    e.abort(0.2, a)
    assert e.cached_prefix(longer) == (12, 0)      # freed, still cached
    before = e.stats()
    assert e.cached_prefix(longer) == (12, 0) and e.stats() == before
    assert make(caching=False).cached_prefix(x) == (0, 0)


def test_blocks_of_generated_tokens_are_cached_as_they_fill():
    e = make()
    a = e.add(0.0, 6, 10, token_ids=ids(0, 6))     # 16 tokens in all: 4 blocks once generated
    run_until_idle(e)
    assert e.stats().finished["length"] == 1
    # the engine hashes generated tokens with its output ids (unique to the sequence by default)
    assert e.prefix_cache is not None and e.prefix_cache.cached_blocks == 3   # 15 tokens computed: 3 full
    assert e.seq(a) is None


def test_output_blocks_hash_with_the_given_output_ids_so_a_next_turn_hits_them():
    words = [7, 8, 9]
    e = Engine(EngineParams(kv_capacity_tokens=BS * 100, block_size=BS, enable_prefix_caching=True,
                            prefill_tokens_per_s=1000.0),
               output_token=lambda seq_id, i: words[i % 3])
    e.add(0.0, 6, 10, token_ids=ids(0, 6))
    run_until_idle(e)
    turn = ids(0, 6) + [words[i % 3] for i in range(10)] + ids(50, 5)   # prompt + reply + question
    e.add(1.0, len(turn), 1, token_ids=turn)
    assert e.stats().prefix_cache_hits == 12       # the 3 blocks computed, output included


def test_preemption_frees_only_unshared_blocks_and_resume_hits_its_own_blocks():
    e = make(blocks=16, max_num_batched_tokens=64)
    prefix = ids(0, 16)                                          # 4 shared blocks
    a = e.add(0.0, 20, 40, token_ids=prefix + ids(100, 4))       # grows to 15 blocks
    e.advance(0.020)                                             # a prefilled: its blocks are cached
    b = e.add(0.020, 20, 40, token_ids=prefix + ids(200, 4))     # grows to 15 blocks, 4 of them shared
    e.advance(0.125)
    assert e.seq(b).status is SeqStatus.RUNNING and e.stats().prefix_cache_hits == 16
    shared = e.seq(a).cached[:4]
    assert e.seq(b).cached[:4] == shared and all(blk.ref == 2 for blk in shared)
    queries = e.stats().prefix_cache_queries
    while e.stats().preemptions == 0:                            # growth preempts b, the newer
        end = e.next_step_end()
        assert end is not None, "no preemption"
        e.advance(end)
    assert e.seq(b).status is SeqStatus.WAITING and e.seq(b).blocks == 0
    # b gave back what it held alone; the shared blocks stay held (by a), once
    assert all(blk.ref == 1 for blk in shared)
    assert not any(blk.id in e.prefix_cache.free_queue for blk in shared)
    assert e.stats().used_blocks == e.seq(a).blocks == e.held_blocks()
    # b's own full blocks (prompt and generated) stay cached, free, for its return
    assert e.stats().cached_free_blocks >= 1
    ev = run_until_idle(e)
    assert len([x for x in ev if x.seq_id == b and x.kind is EventKind.TOKEN]) > 0
    assert e.stats().prefix_cache_queries == queries       # a resumed request is not counted again
    assert e.stats().used_blocks == 0 and e.stats().finished["length"] == 2


def test_a_resumed_request_reuses_its_cached_prompt_and_output_blocks():
    def resume_prefill(caching: bool) -> float:
        e = make(blocks=12, caching=caching, max_num_batched_tokens=512)
        a = e.add(0.0, 20, 24, token_ids=ids(0, 20))     # 44 tokens: 11 blocks
        b = e.add(0.0, 8, 20, token_ids=ids(500, 8))     # 28 tokens: 7 blocks
        events = run_until_idle(e)
        assert e.stats().preemptions >= 1
        gaps = [t2 - t1 for t1, t2 in zip(
            [x.at for x in events if x.seq_id == b and x.kind is EventKind.TOKEN],
            [x.at for x in events if x.seq_id == b and x.kind is EventKind.TOKEN][1:])]
        assert e.stats().finished["length"] == 2 and e.seq(a) is None
        return max(gaps)
    # with caching, b's resume recomputes only what was evicted, not its whole history
    assert resume_prefill(True) < resume_prefill(False)


def test_background_load_evicts_cached_free_blocks_it_displaces():
    e = make(blocks=10)
    x = ids(0, 17)
    e.add(0.0, 17, 1, token_ids=x)
    run_until_idle(e)
    e.configure(1.0, background_kv_tokens=BS * 8)           # 2 blocks left free
    assert e.stats().cached_free_blocks == 2 and cached(e, x) == 2
    e.configure(1.0, background_kv_tokens=0)
    assert e.stats().kv_usage == 0.0


def test_flag_off_ignores_token_ids_and_exposes_zero_counters():
    script = [(0.0, 20, 5), (0.0, 20, 5), (0.01, 40, 3)]

    def events(with_ids: bool) -> list:
        e = make(blocks=12, caching=False)
        for at, p, t in script:
            e.advance(at)
            e.add(at, p, t, token_ids=ids(0, p) if with_ids else None)
        return run_until_idle(e)
    assert events(True) == events(False)
    e = make(caching=False)
    text = render(make_registry(e.stats, "m", BS)).decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 0.0' in text
    assert 'enable_prefix_caching="False"' in text


def test_metrics_name_prefix_cache_counters_as_vllm_does():
    e = make()
    e.add(0.0, 17, 1, token_ids=ids(0, 17))
    run_until_idle(e)
    e.add(1.0, 17, 1, token_ids=ids(0, 17))
    text = render(make_registry(e.stats, "m", BS)).decode()
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 34.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0' in text
    assert 'enable_prefix_caching="True"' in text


def test_prefix_cache_refuses_what_is_not_free():
    pool = BlockPool(4, BS)
    cache = PrefixCache(pool)
    assert cache.take(3) and not cache.take(2)
    blk = cache.commit(b"h")
    cache.release([blk], 2)
    assert pool.used == 0 and len(cache.free_queue) == 1
    assert cache.take(4) and cache.lookup(b"h") is None      # the 4th block evicted it
    with pytest.raises(ValueError):
        cache.release([blk], 0)


# --- accounting under any sequence of inputs ------------------------------------------

PREFIXES = [ids(0, 12), ids(0, 8) + ids(300, 4), ids(600, 12)]


def _check(e: Engine, live: list[int]) -> None:
    cache = e.prefix_cache
    assert cache is not None
    pool = e.pool
    assert 0 <= pool.used == e.held_blocks() <= pool.total
    assert len(cache.free_queue) <= pool.free
    holders: dict[int, int] = {}
    for seq in e.running():
        assert seq.blocks >= len(seq.cached) and seq.blocks * BS >= seq.num_computed
        for blk in seq.cached:
            holders[id(blk)] = holders.get(id(blk), 0) + 1
    for seq in e.running():
        for blk in seq.cached:
            assert blk.ref == holders[id(blk)]          # ref counts match the running requests
    for blk in cache.free_queue.values():
        assert blk.ref == 0 and id(blk) not in holders
    # every hashed block is held or waits in the free queue: none leaks, none is lost
    assert cache.cached_blocks == len(holders) + len(cache.free_queue)
    for sid in live:
        waiting = e.seq(sid)
        if waiting is not None and waiting.status is SeqStatus.WAITING:
            assert waiting.blocks == 0 and not waiting.cached


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "abort", "bg", "advance", "advance"]),
                         st.integers(0, 2), st.integers(1, 16), st.integers(1, 30)), max_size=50)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_block_accounting_holds_under_admissions_steps_ends_and_preemptions(script):
    e = make(blocks=16, max_num_batched_tokens=24, batch_slowdown=0.05)
    t = 0.0
    live: list[int] = []
    added = 0
    for op, which, a, b in script:
        if op == "add":
            tokens = PREFIXES[which] + ids(1000 * (added + 1), a)
            try:
                live.append(e.add(t, len(tokens), b, token_ids=tokens))
                added += 1
            except ValueError:
                pass
        elif op == "abort" and live:
            e.abort(t, live[a % len(live)])
        elif op == "bg":
            e.configure(t, background_kv_tokens=BS * (a % 8))
        else:
            t += a / 20
            e.advance(t)
        _check(e, live)
    e.configure(t, background_kv_tokens=0)
    while (end := e.next_step_end()) is not None:
        e.advance(end)
        _check(e, live)
    s = e.stats()
    event(f"preempted: {s.preemptions > 0}")
    event(f"prefix hits: {s.prefix_cache_hits > 0}")
    assert s.used_blocks == 0 and s.running == 0 and s.waiting == 0
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    assert s.finished["length"] + s.finished["abort"] == added


def test_a_crash_empties_the_cache():
    e = make(blocks=8, overflow="crash")
    prompts = [ids(100 * k, 8) for k in range(3)]          # 2 blocks each, growing to 7
    for p in prompts:
        e.add(0.0, 8, 20, token_ids=p)
    ev = run_until_idle(e)
    assert e.stats().crashes == 1 and any(x.kind is EventKind.FAILED for x in ev)
    # their full blocks were cached until the crash; the engine comes back without them
    assert [cached(e, p) for p in prompts] == [0, 0, 0]
    assert e.stats().cached_free_blocks == 0 and e.stats().used_blocks == 0
