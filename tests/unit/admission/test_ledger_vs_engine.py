"""kvgate's node ledger against the simulator's engine with prefix caching: whatever the order
of admissions, first tokens and progress, ends, the engine's evictions and reports, what
kvgate charges on a node is never below what the engine holds for kvgate's requests there.

kvgate's side is its real ledger (``PoolNodes`` with ``picking.shared_prefix``), fed prefix
chains by its real chain builder; the engine is ``sim.engine.Engine`` with
``enable_prefix_caching`` (``sim.blocks.PrefixCache``: chain hashes over full blocks,
reference counts, freed blocks cached and evicted least recently used), holding the same
requests' token ids. kvgate's chain ends are off the engine's token positions by up to a
block less one token, as a tokenizer other than the engine's would place them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.admission.nodes import Charge, PoolNodes
from extproc.admission.types import NodeReport
from extproc.prefix import _Builder
from sim.engine import Engine, EngineParams, Seq, SeqStatus
from tests.unit.admission.helpers import T0, config
from tests.unit.admission.test_nodes import CAP, nodes_pool
from tests.unit.admission.test_prefix_ledger import path_to as path_in

# A small trie of prompt pieces (engine tokens each): a system prompt most requests share,
# documents and conversation turns below it, and a prompt that shares nothing with it.
TRIE = {
    "sys": (None, 1_500), "docA": ("sys", 900), "docB": ("sys", 620),
    "turnA1": ("docA", 333), "turnA2": ("turnA1", 95), "turnB1": ("docB", 161),
    "other": (None, 700), "otherQ": ("other", 90),
}
LEAVES = list(TRIE)
PIECE_IDS = {name: i for i, name in enumerate(TRIE)}


def token_ids(path: list[str], request: int, own: int) -> list[int]:
    """token_ids is the engine's prompt: each piece's own ids (equal pieces, equal ids), then
    ``own`` tokens unique to ``request``."""
    ids = [PIECE_IDS[name] * 100_000 + i for name in path for i in range(TRIE[name][1])]
    return ids + [10_000_000 + request * 10_000 + i for i in range(own)]


def kvgate_chain(path: list[str], request: int, own: int, error: dict[str, int], block: int):
    """kvgate_chain is kvgate's chain of the same prompt (its real builder), each piece's end
    placed ``error`` tokens off the engine's (at most a block less one either way)."""
    b = _Builder(b"prompt")
    true_end = kvgate_end = 0
    for name in path:
        true_end += TRIE[name][1]
        off = max(-(block - 1), min(block - 1, error.get(name, 0)))
        b.add(name.encode(), true_end + off - kvgate_end)
        kvgate_end = true_end + off
    b.add(b"own-%d" % request, true_end + own - kvgate_end)
    return b.chain()


@dataclass
class Live:
    """Live is one request kvgate admitted: its charge, its engine and its sequence there."""

    charge: Charge
    node: str
    seq: Seq


def engine_holds(engine: Engine, seqs: list[Seq]) -> int:
    """engine_holds is the KV tokens ``engine`` holds for ``seqs``: their hashed blocks, a block
    shared among them once, and the tokens of their other (partial or not yet hashed) blocks."""
    bs = engine.pool.block_size
    hashed: set[int] = set()
    own = 0
    for s in seqs:
        if s.status is not SeqStatus.RUNNING:
            continue
        hashed.update(b.id for b in s.cached)
        own += max(0, min(s.num_tokens, s.blocks * bs) - len(s.cached) * bs)
    return len(hashed) * bs + own


# An operation and its arguments; admissions, time passing and reports are drawn more often.
op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(LEAVES), st.integers(1, 300), st.sampled_from([1, 3, 8, 60])),
    st.tuples(st.just("admit"), st.sampled_from(LEAVES), st.integers(1, 300), st.sampled_from([1, 3, 8, 60])),
    st.tuples(st.just("admit"), st.sampled_from(LEAVES), st.integers(1, 300), st.sampled_from([1, 3, 8, 60])),
    st.tuples(st.just("advance"), st.sampled_from([0.005, 0.03, 0.2, 0.8]), st.just(0), st.just(0)),
    st.tuples(st.just("advance"), st.sampled_from([0.005, 0.03, 0.2, 0.8]), st.just(0), st.just(0)),
    st.tuples(st.just("progress"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("end"), st.integers(0, 30), st.booleans(), st.just(0)),
    st.tuples(st.just("evict"), st.integers(0, 1), st.sampled_from([0, 0.5, 0.9, 0.97]), st.just(0)),
    st.tuples(st.just("mark"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("report"), st.integers(0, 1), st.booleans(), st.just(0)),
    st.tuples(st.just("report"), st.integers(0, 1), st.booleans(), st.just(0)),
)


NO_ERROR = {name: 0 for name in LEAVES}
LATE_SYS = {**NO_ERROR, "sys": 15}   # kvgate places the system prompt's end 15 tokens late


# derandomize: the same 1,200 examples every run, so that a new counterexample (a finding, as the
# xfails below were) is found where it can be studied, not as a red CI run one time in ten.
@settings(max_examples=1200, deadline=None, derandomize=True)
# Two requests sharing the system prompt, near the end of their reservations: a credit of
# the shared whole blocks without the block less is one block too many.
@example(ops=[("admit", "sys", 5, 3), ("advance", 0.005, 0, 0), ("admit", "docA", 5, 3), ("advance", 0.03, 0, 0)],
         nodes=1, engine_block=16, batched=8192, error=LATE_SYS)
# The same with the engine's blocks of 32 against kvgate's configured 16: the credit must
# follow the block size the node reports.
@example(ops=[("admit", "sys", 5, 3), ("advance", 0.005, 0, 0), ("admit", "docA", 5, 3), ("advance", 0.03, 0, 0)],
         nodes=1, engine_block=32, batched=8192, error=LATE_SYS)
# Both in the engine's cache at a scrape round, beside the engine's own clients' load: the
# report's foreign KV must subtract the shared prefix once.
@example(ops=[("admit", "sys", 5, 60), ("advance", 0.005, 0, 0), ("admit", "docA", 5, 60),
              ("advance", 0.2, 0, 0), ("progress", 0, 0, 0), ("progress", 1, 0, 0),
              ("evict", 0, 0.5, 0), ("mark", 0, 0, 0), ("report", 0, True, 0)],
         nodes=1, engine_block=16, batched=8192, error=NO_ERROR)
# A request that ended beside one still running: its prefix is no credit to the next.
@example(ops=[("admit", "sys", 5, 60), ("admit", "other", 5, 60), ("end", 0, False, 0),
              ("admit", "docA", 5, 3), ("advance", 0.03, 0, 0)],
         nodes=1, engine_block=16, batched=8192, error=NO_ERROR)
# A node nearly full of its own clients' load: a request is let in by its credit, no more.
@example(ops=[("evict", 0, 0.97, 0), ("report", 0, False, 0), ("report", 0, False, 0), ("admit", "sys", 5, 60),
              ("admit", "docA", 5, 60), ("admit", "turnA1", 300, 60)],
         nodes=1, engine_block=16, batched=8192, error=NO_ERROR)
# A request that ends between a scrape round's mark and its report is gone from the report.
@example(ops=[("admit", "sys", 5, 60), ("advance", 0.2, 0, 0), ("progress", 0, 0, 0), ("evict", 0, 0.5, 0),
              ("mark", 0, 0, 0), ("end", 0, False, 0), ("report", 0, True, 0)],
         nodes=1, engine_block=16, batched=8192, error=NO_ERROR)
@given(ops=st.lists(op, max_size=50), nodes=st.integers(1, 2),
       engine_block=st.sampled_from([16, 32]), batched=st.sampled_from([512, 8192]),
       error=st.fixed_dictionaries({name: st.integers(-31, 31) for name in LEAVES}))
def test_a_nodes_charged_kv_is_never_below_what_the_engine_holds_for_kvgate(
        ops, nodes, engine_block, batched, error):
    drive(ops, nodes, engine_block, batched, error)


# Two requests sharing the system prompt, both in the cache at a scrape round, then ending: the
# report subtracted the second its prompt less the credit, up to two blocks less than the engine
# shares (``Node.kept``).
SHARING_THEN_ENDED = [("admit", "sys", 5, 60), ("advance", 0.005, 0, 0), ("admit", "docA", 5, 60),
                      ("advance", 0.2, 0, 0), ("progress", 0, 0, 0), ("progress", 1, 0, 0),
                      ("evict", 0, 0.5, 0), ("mark", 0, 0, 0), ("report", 0, True, 0),
                      ("end", 0, True, 0), ("end", 0, True, 0)]
# A request the engine finished by its stop before a scrape round, kvgate having seen its first
# token only, whose end kvgate sees after the report (a slow client holds the stream):
# subtracted from the report, gone from the engine (``Node.kept``).
STOPPED_BEFORE_THE_SCRAPE = [("admit", "sys", 5, 3), ("advance", 0.005, 0, 0), ("progress", 0, 0, 0),
                             ("advance", 0.2, 0, 0), ("evict", 0, 0.5, 0), ("mark", 0, 0, 0),
                             ("report", 0, True, 0), ("end", 0, True, 0)]
# The same, kvgate having seen every token it reserved before the scrape round: the engine has
# ended it, the mark leaves it out (``Node.mark``).
FINISHED_BEFORE_THE_SCRAPE = [("admit", "sys", 5, 3), ("advance", 0.2, 0, 0), ("progress", 0, 0, 0),
                              ("evict", 0, 0.5, 0), ("mark", 0, 0, 0), ("report", 0, True, 0),
                              ("end", 0, True, 0)]
# The engine finished a request (max_tokens 1) before a scrape round while kvgate, which saw
# its token, still holds it; a second request sharing its prompt is admitted after the report
# with credit for it (found by the property test in a full run).
FINISHED_STILL_HELD = [("admit", "sys", 1, 1), ("advance", 0.005, 0, 0), ("progress", 0, 0, 0),
                       ("evict", 0, 0.5, 0), ("mark", 0, 0, 0), ("report", 0, False, 0),
                       ("admit", "sys", 1, 1)]
# The same with a request that stopped before its reservation (its stop token) and whose last
# tokens kvgate had not seen at the mark: nothing tells kvgate that the engine ended it.
STOPPED_STILL_HELD = [("admit", "sys", 1, 3), ("advance", 0.005, 0, 0), ("progress", 0, 0, 0),
                      ("advance", 0.2, 0, 0), ("evict", 0, 0.5, 0), ("mark", 0, 0, 0),
                      ("report", 0, False, 0), ("admit", "sys", 1, 1)]


@pytest.mark.parametrize("ops", [SHARING_THEN_ENDED, STOPPED_BEFORE_THE_SCRAPE, FINISHED_BEFORE_THE_SCRAPE,
                                 FINISHED_STILL_HELD],
                         ids=["margin", "stopped", "finished", "finished-still-held"])
def test_foreign_kv_read_from_a_report_is_not_low_once_requests_it_subtracted_end(ops):
    drive(ops, 1, 16, 8192, NO_ERROR)


@pytest.mark.xfail(strict=True, reason="known gap: a request the engine ended by its stop before a scrape "
                   "while kvgate had seen fewer tokens than it reserved is subtracted from that report; a "
                   "request admitted with credit for the prefix it shares with it is short of those blocks "
                   "until kvgate sees the first one's end")
def test_a_request_stopped_before_the_scrape_and_still_held_gives_credit_counted_nowhere():
    drive(STOPPED_STILL_HELD, 1, 16, 8192, NO_ERROR)


def drive(ops: list[tuple], nodes: int, engine_block: int, batched: int, error: dict[str, int]) -> None:
    """drive runs ``ops`` against kvgate's ledger of ``nodes`` nodes and their engines, and
    ``check`` after each."""
    # The node reports its block size (vLLM's cache_config_info) from its first report on.
    pool = PoolNodes(config(pool=nodes_pool(nodes, shared_prefix=True, block_tokens=16)).pools["default"], 3.0)
    engines = {name: Engine(EngineParams(kv_capacity_tokens=CAP, block_size=engine_block,
                                         max_num_batched_tokens=batched, prefill_tokens_per_s=1e6,
                                         enable_prefix_caching=True))
               for name in pool.nodes}
    names = list(engines)
    now = T0
    mark: int | None = None
    marks = 0
    others: dict[str, int] = {}   # what each engine held for its other clients at its last report
    live: list[Live] = []

    def scrape(name: str) -> None:
        stats = engines[name].stats()
        others[name] = stats.background_blocks * engine_block
        pool.report(name, NodeReport(kv_usage=stats.kv_usage, capacity_tokens=CAP, at=now, mark=mark,
                                     waiting=stats.waiting, running=stats.running, block_tokens=engine_block))

    for name in names:
        scrape(name)
    for i, (kind, a, b, c) in enumerate(ops):
        if kind == "admit":
            path = path_in(a, TRIE)
            prompt = sum(TRIE[n][1] for n in path) + b
            got = pool.pick("standard", prompt, c, 1.0, now, chain=kvgate_chain(path, i, b, error, engine_block))
            if isinstance(got, Charge):
                engine = engines[got.node.name]
                seq_id = engine.add(now, prompt, c, token_ids=token_ids(path, i, b))
                seq = engine.seq(seq_id)
                assert seq is not None
                live.append(Live(got, got.node.name, seq))
                # the credit the pick fitted it by is what the node counts: it still fits
                room = next(x.headroom_tokens for x in pool.snapshot(now) if x.name == got.node.name)
                assert room is not None and room >= 0
        elif kind == "advance":
            now += a
            for engine in engines.values():
                engine.advance(now)
        elif kind == "progress" and live:     # the stream shows the tokens generated so far
            r = live[a % len(live)]
            pool.progress(r.charge, r.seq.output_tokens, now)
        elif kind == "end" and live:          # the stream ends, the request done or not
            r = live.pop(a % len(live))
            engines[r.node].abort(now, r.seq.id)
            pool.release(r.charge, r.seq.output_tokens, b and r.seq.status is SeqStatus.FINISHED, now)
        elif kind == "evict":                 # load the engine's own clients bring evicts its cached blocks
            name = names[a % len(names)]
            engines[name].configure(now, background_kv_tokens=int(b * CAP))
        elif kind == "mark":                  # a scrape round starts
            marks += 1
            mark = marks
            pool.mark(mark, now)
        elif kind == "report":                # one node's scrape, in the round if one started
            scrape(names[a % len(names)])
            if not b:                         # the round is over: later scrapes have no mark
                mark = None
        check(pool, engines, live, others, now)
    for r in live:
        engines[r.node].abort(now, r.seq.id)
        pool.release(r.charge, r.seq.output_tokens, False, now)
    live.clear()
    check(pool, engines, live, others, now)
    assert all(not n.prefixes.refs and not n.prefixes.dup and not n.prefixes.extra for n in pool.nodes.values())


def check(pool: PoolNodes, engines: dict[str, Engine], live: list[Live], others: dict[str, int], now: float) -> None:
    """check asserts, on every node, that what kvgate charges there (foreign KV + holds, a
    shared prefix once; what its room is taken from) covers what the engine holds for
    kvgate's requests and ``others``, what it held for its other clients at its last report;
    and that a node whose requests all ended has nothing left charged.

    Ends included: what a report subtracted of a request that ended since stays counted until
    the next report (``Node.kept``). Not found by the operations drawn, yet a gap (see
    ``test_a_request_stopped_before_the_scrape_and_still_held_gives_credit_counted_nowhere``):
    a request the engine ended by its stop before a scrape, kvgate still holding it, and a
    request sharing its prefix admitted before its end is seen."""
    for snap in pool.snapshot(now):
        truth = engine_holds(engines[snap.name], [r.seq for r in live if r.node == snap.name])
        charged = snap.foreign_tokens + snap.held_tokens
        assert charged >= truth + others[snap.name], (snap.name, charged, truth, others[snap.name])
        if snap.headroom_tokens is not None:
            assert snap.headroom_tokens <= CAP - truth - others[snap.name]
        if not any(r.node == snap.name for r in live):
            assert (snap.requests, snap.inflight_tokens, snap.held_tokens, snap.shared_tokens) == (0, 0, 0, 0)
