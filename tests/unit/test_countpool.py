"""Long counts off the GIL: stretches without word breaks counted in a worker process,
HF ``tokenizers`` through its GIL-free batch call.

Real worker processes with the real bpe-openai tokenizer: the counts are the one-call
counts of the same engine, the event loop keeps running while one is counted (a loop-lag
probe, compared with the one call that holds the GIL), and every failure (a full pool, a
count past its timeout, a dead worker, a closed pool) is a clear 503 that holds nothing.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import tokens as tk
from extproc.countpool import CountPool, TokenizerBusy, TokenizerFailed
from kvgate_testkit.stream import Stream
from extproc.gate import Gate
from extproc.tokens import load_tokenizer
from tests.unit.test_exchange import Rig, body_msg, chat, headers_msg, set_headers

SPEC = "cl100k_base"
MIB = 1 << 20


@functools.lru_cache(maxsize=64)
def word(chars: int, seed: int) -> str:
    """word is one hostile 'word' of random letters: no point where the pre-split cuts."""
    return "".join(random.Random(seed).choices("abcdefghijk", k=chars))


@functools.lru_cache(maxsize=64)
def cjk_run(chars: int, seed: int) -> str:
    """cjk_run is ideographs without punctuation: one pre-token, 3 bytes a character."""
    return "".join(map(chr, random.Random(seed).choices(range(0x4E00, 0xA000), k=chars)))


class Recording:
    """Recording is the real pool, with the lengths of the texts it was asked to count."""

    def __init__(self, pool: CountPool) -> None:
        self.pool = pool
        self.asked: list[int] = []

    def count(self, spec: str, text: str) -> int:
        self.asked.append(len(text))
        return self.pool.count(spec, text)


@pytest.fixture(scope="module")
def pool() -> Iterator[CountPool]:
    """pool is one worker with the tokenizer loaded, no wait line; generous bounds (a loaded
    machine is slow, and these tests are about counts, not time)."""
    p = CountPool((SPEC,), workers=1, waiting=0, timeout_s=60.0, wait_s=60.0)
    assert p.wait_ready(120.0), "the count worker did not start"
    yield p
    p.close()


@pytest.fixture
def bare() -> Iterator[CountPool]:
    """bare is a pool whose worker loads no tokenizer: it starts in a fraction of the time,
    for the tests of its failures."""
    p = CountPool((), workers=1, waiting=0, timeout_s=60.0, wait_s=60.0)
    assert p.wait_ready(120.0), "the count worker did not start"
    yield p
    p.close()


@pytest.fixture
def far(pool: CountPool) -> Iterator[Recording]:
    rec = Recording(pool)
    tk.use_count_pool(rec)
    yield rec
    tk.use_count_pool(None)


def one_call(text: str) -> int:
    return load_tokenizer(SPEC).count_whole(text)


def fresh() -> tk.Tokenizer:
    """fresh is the spec's engine behind an empty count cache (no second load of its ranks)."""
    engine = load_tokenizer(SPEC)
    assert isinstance(engine, tk.BpeOpenAITokenizer)
    return tk.BpeOpenAITokenizer(SPEC, engine._engine)


# --- exact counts ------------------------------------------------------------------

def test_a_hostile_megabyte_word_is_counted_in_the_worker_exactly(far: Recording) -> None:
    text = word(MIB, 1)
    assert fresh().count(text) == one_call(text)
    assert far.asked == [MIB]


@pytest.mark.parametrize("make", [
    lambda: "Some prose, then a run: " + word(40_000, 2) + " and prose after it. " * 500,
    lambda: ("数据，" * 3000) + cjk_run(30_000, 3) + "。完",
    lambda: "🤖🚀" * 20_000,
    lambda: ("<|endoftext|> <|fim_prefix|>" + word(20_000, 4)) * 3,
    lambda: "\n".join(["The quick brown fox jumps over the lazy dog's back."] * 4000),
], ids=["prose around a word", "CJK", "emoji", "special tokens text", "natural text"])
def test_long_texts_of_every_kind_count_what_one_call_counts(far: Recording, make) -> None:
    text = make()
    assert fresh().count(text) == one_call(text)
    # Only stretches without a cut point went to the worker; natural text is cut here.
    assert all(n > tk._FAR_PIECE_CHARS for n in far.asked)


def test_natural_text_never_goes_to_the_worker(far: Recording) -> None:
    text = "It's a plain sentence, with words; and more words. " * 20_000
    assert fresh().count(text) == one_call(text)
    assert far.asked == []


class InProcess:
    """InProcess counts a far piece here, in one call: what the worker runs, without the
    process, so that many examples of the splitting stay fast."""

    def __init__(self) -> None:
        self.asked = 0

    def count(self, spec: str, text: str) -> int:
        self.asked += 1
        return load_tokenizer(spec).count_whole(text)


_PARTS = st.one_of(
    st.text(max_size=200),
    st.builds(word, st.integers(tk._FAR_PIECE_CHARS - 10, tk._FAR_PIECE_CHARS + 3000), st.integers(0, 99)),
    st.builds(cjk_run, st.integers(100, 7000), st.integers(0, 99)),
    st.sampled_from(["hello world. ", "数据，", "🤖", " ", "\n\n", "<|endoftext|>", "12345", "é-à"]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PARTS, min_size=1, max_size=12), st.integers(1, 40))
def test_pieces_and_far_pieces_sum_to_the_one_call_count(parts: list[str], repeat: int) -> None:
    text = "".join(parts) * (1 if len(parts) > 3 else repeat)
    here = InProcess()
    tk.use_count_pool(here)
    try:
        assert fresh().count(text) == one_call(text)
    finally:
        tk.use_count_pool(None)


# --- the event loop keeps running -----------------------------------------------------

async def test_a_count_on_the_event_loop_never_waits_on_the_pool(far: Recording) -> None:
    """A wait for a worker on the loop's thread would hold every stream: a text counted
    there (a small body) is counted in one call, as without a pool."""
    text = word(30_000, 14)
    assert fresh().count(text) == one_call(text)
    assert far.asked == []
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, fresh().count, text) == one_call(text)
    assert far.asked == [30_000]


async def _longest_stall(count: object, text: str) -> tuple[float, float]:
    """_longest_stall counts ``text`` in a thread (``count(text)``) while a probe task on
    the loop wakes every millisecond; returns (the count's seconds, the probe's longest
    gap between two wake-ups in seconds)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    gaps: list[float] = []

    async def probe() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(probe())
    await asyncio.sleep(0)  # the probe runs before the count starts
    with ThreadPoolExecutor(1) as executor:
        t0 = time.perf_counter()
        await loop.run_in_executor(executor, count, text)
        took = time.perf_counter() - t0
    done.set()
    await task
    return took, max(gaps)


async def test_a_megabyte_word_in_the_worker_leaves_the_loop_running(far: Recording) -> None:
    """The bound is relative, on the loop's own probe: counted here in one call, the loop
    cannot run at all while the count lasts; counted in the worker, its longest stall is a
    small part of the count."""
    took, stall = await _longest_stall(fresh().count, word(MIB, 7))
    assert far.asked == [MIB]
    assert stall < took / 3, (took, stall)
    tk.use_count_pool(None)
    took_here, stall_here = await _longest_stall(fresh().count, word(MIB, 8))
    assert stall_here > took_here / 2, (took_here, stall_here)


async def test_hf_counts_a_long_text_as_encode_does_with_the_gil_handed_over() -> None:
    """HF ``tokenizers`` holds the GIL in ``encode``: a long text goes through
    ``encode_batch`` (the same tokens), which hands it over while it runs."""
    from tests.unit.real_tokenizers import LLAMA_JSON

    loaded = load_tokenizer(f"hf:{LLAMA_JSON}")
    assert isinstance(loaded, tk.HFTokenizer)
    hf = tk.HFTokenizer(loaded.name, loaded._tok)  # an empty count cache
    text = ("Prose with words, numbers 12345 and 数据，" + word(3000, 13) + " 🤖\n") * 30
    assert len(text) > tk._HF_BATCH_CHARS
    assert hf.count(text) == len(hf._tok.encode(text, add_special_tokens=False))
    took, stall = await _longest_stall(hf.count, text + "!")
    assert stall < took / 3, (took, stall)
    encode = hf._tok.encode  # the one call that holds the GIL, for the contrast
    took_one, stall_one = await _longest_stall(lambda t: encode(t, add_special_tokens=False), text + "?")
    assert stall_one > took_one / 2, (took_one, stall_one)


# --- failures: clear errors, workers replaced ---------------------------------------

def test_a_count_past_its_timeout_is_refused_and_its_worker_replaced(bare: CountPool) -> None:
    before = bare.pids()
    bare.timeout_s = 1e-6  # no count answers that fast: the count "runs past" its bound
    with pytest.raises(TokenizerFailed, match="longer than") as err:
        bare.count(SPEC, "hello world")
    assert err.value.status == 503 and err.value.retry_after_s is None
    assert bare.replaced == 1
    assert bare.wait_ready(120.0) and bare.pids() != before


def test_a_dead_worker_fails_its_count_and_is_replaced(bare: CountPool) -> None:
    [pid] = bare.pids()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TokenizerFailed, match="died"):
        bare.count(SPEC, word(50_000, 10))
    assert bare.replaced == 1
    assert bare.wait_ready(120.0) and bare.pids() != [pid]
    # The new worker answers; an error inside it is a clear refusal that keeps the worker.
    with pytest.raises(TokenizerFailed, match="unknown tokenizer"):
        bare.count("no-such-tokenizer", "hello")
    assert bare.replaced == 1 and bare.in_pool == 0


def test_a_full_pool_refuses_at_once_with_a_retryable_busy(pool: CountPool) -> None:
    first: list[object] = []
    long = word(2 * MIB, 11)  # a count long enough to still run when the next one comes
    th = threading.Thread(target=lambda: first.append(pool.count(SPEC, long)))
    th.start()
    deadline = time.monotonic() + 60
    while pool.in_pool == 0 and time.monotonic() < deadline:  # wait for the first to enter
        time.sleep(0.001)
    assert pool.in_pool == 1
    with pytest.raises(TokenizerBusy) as err:
        pool.count(SPEC, "anything")
    assert err.value.status == 503 and err.value.retry_after_s == 1.0
    th.join()
    assert first == [one_call(long)]
    assert pool.in_pool == 0


def test_a_lazy_pool_starts_at_its_first_count_which_it_leaves_to_the_caller() -> None:
    p = CountPool((), workers=1, start=False, wait_s=60.0)
    try:
        assert p.pids() == []
        assert p.count(SPEC, "hello world") is None  # no worker up yet: the caller counts
        assert len(p.pids()) == 1
        assert p.wait_ready(120.0)
        with pytest.raises(TokenizerFailed, match="unknown tokenizer"):  # up: it answers
            p.count("no-such-tokenizer", "hello")
    finally:
        p.close()
    with pytest.raises(TokenizerBusy):  # closed: refused, not counted here behind its back
        p.count(SPEC, "x")
    assert p.pids() == []
    with pytest.raises(ValueError):
        CountPool(workers=0, start=False)


async def test_a_server_installs_its_pool_sizes_its_threads_and_stops_both() -> None:
    from prometheus_client import CollectorRegistry

    from extproc.configparse import parse_config
    from extproc.metrics import Metrics
    from extproc.server import TOKENIZE_THREADS, Server

    config = parse_config({"pools": {"default": {"max_concurrency": 4, "tokenizer": SPEC}}})
    server = Server(config, metrics=Metrics(CollectorRegistry()), scrape=False)
    try:
        assert tk._far is server.count_pool and server.count_pool.specs == (SPEC,)
        assert server.count_pool.pids() == []  # started at the first long uncuttable count
        assert server.executor._max_workers == TOKENIZE_THREADS + server.count_pool.capacity
    finally:
        await server.close()
    assert tk._far is None


# --- through the request path: a 503 that holds nothing -------------------------------

class Refusing:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def count(self, spec: str, text: str) -> int:
        raise self.error


@pytest.mark.parametrize("error, retry", [(TokenizerBusy(), "1"), (TokenizerFailed("it died"), None)])
async def test_a_count_the_pool_cannot_make_is_a_503_and_nothing_is_held(error: Exception,
                                                                          retry: str | None) -> None:
    rig = Rig({"limits": {"max_body_bytes": 4 * MIB}})
    rig.gate = Gate(rig.config, rig.admission, rig.metrics, rig.clock, ThreadPoolExecutor(2))
    tpm_before = rig.admission.snapshot("default").tpm_available
    tk.use_count_pool(Refusing(error))
    try:
        ex = Stream(rig.gate)
        ex.request_headers(headers_msg(), None)
        resp = await ex.request_body(body_msg(chat("Summarise: " + word(100_000, 12))))
    finally:
        tk.use_count_pool(None)
    imm = resp.immediate_response
    assert imm.status.code == 503
    hs = set_headers(imm)
    assert hs.get("retry-after") == retry
    assert (hs.get("x-should-retry") == "false") == (retry is None)
    assert hs["x-kvgate-reason"] == "tokenizer_unavailable"
    assert rig.inflight() == 0 and rig.admission.snapshot("default").kv_inflight == 0
    assert rig.admission.snapshot("default").tpm_available == tpm_before
    assert rig.count("kvgate_requests_total", outcome="rejected_tokenizer_unavailable") == 1
    ex.finish()
    assert rig.inflight() == 0


def test_the_cache_key_of_a_long_text_is_hashed_in_parts_to_the_digest_of_the_whole() -> None:
    import hashlib

    text = cjk_run(200_000, 15) + "\ud800" + word(70_000, 15)  # a lone surrogate too
    whole = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    assert tk._CountCache.key(text) == whole
