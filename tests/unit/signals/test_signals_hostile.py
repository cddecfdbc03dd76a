"""Any body a backend may send either reads into a bounded sample or fails by reason."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.signals import ENGINES, ScrapeError, ScrapeFailure, read
from kvgate_testkit import EXPOSITIONS

SAMPLES = EXPOSITIONS
REAL = [(SAMPLES / n).read_bytes() for n in ("vllm_v1_dp.prom", "sglang_dp.prom", "tgi.prom", "dcgm_hostname.prom")]


def check(engine: str, body: bytes) -> None:
    try:
        s = read(engine, body)
    except ScrapeFailure as exc:
        assert exc.reason in set(ScrapeError)
        return
    if s.kv_usage is not None:
        assert 0.0 <= s.kv_usage <= 1.0 and not math.isnan(s.kv_usage)
    for v in (s.waiting, s.running, s.preemptions_total):
        assert v is None or 0 <= v <= 10**9
    assert s.kv_capacity_tokens is None or 0 < s.kv_capacity_tokens <= 10**12


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ENGINES)), st.binary(max_size=300))
def test_random_bytes(engine, body):
    check(engine, body)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ENGINES)), st.sampled_from(REAL), st.integers(0, 20000), st.binary(max_size=8))
def test_real_exposition_cut_or_corrupted_anywhere(engine, real, cut, junk):
    check(engine, real[: cut % (len(real) + 1)])
    check(engine, real[: cut % (len(real) + 1)] + junk + real[cut % (len(real) + 1):])


number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20)).map(repr)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([
    "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running",
    "sglang:token_usage", "sglang:num_queue_reqs", "sglang:max_total_num_tokens",
    "tgi_batch_current_max_tokens", "tgi_batch_max_total_tokens", "tgi_queue_size",
    "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"]), st.sampled_from(['', '{gpu="0"}', '{engine="1"}']),
    number), max_size=12), st.sampled_from(sorted(ENGINES)))
def test_hostile_values(lines, engine):
    text = "".join(f"{name}{labels} {value.replace('inf', 'Inf').replace('nan', 'NaN')}\n"
                   for name, labels, value in lines)
    check(engine, text.encode())
