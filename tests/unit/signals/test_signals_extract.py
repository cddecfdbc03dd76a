"""Extraction over expositions shaped like each engine's real output (kvgate_testkit/expositions/)."""

from __future__ import annotations

import math

import pytest

from extproc.signals import ENGINES, NodeSample, ScrapeError, ScrapeFailure, read
from kvgate_testkit import EXPOSITIONS

SAMPLES = EXPOSITIONS
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"


def body(name: str) -> bytes:
    return (SAMPLES / name).read_bytes()


def reasons(sample: NodeSample) -> list[ScrapeError]:
    return [p.reason for p in sample.problems]


# (file, engine, model filter, usage, waiting, running, preemptions, capacity tokens)
CASES = [
    # V1, new usage name, capacity from kv_cache_size_tokens
    ("vllm_v1.prom", "vllm", None, 0.5, 0, 7, 0, 444832),
    # V1 data parallel: usage averaged over engines, queues and capacity summed
    ("vllm_v1_dp.prom", "vllm", None, 0.6, 7, 16, 4, 2 * 444832),
    # V1 before the rename: gpu_cache_usage_perc; capacity from blocks x block_size
    ("vllm_v1_old.prom", "vllm", None, 0.25, 1, 3, 0, 20480 * 16),
    # V0: no engine label, cache_config_info without model_name
    ("vllm_v0.prom", "vllm", None, 0.4375, 3, 12, 7, 7281 * 16),
    ("vllm_v0.prom", "vllm", LLAMA, 0.4375, 3, 12, 7, 7281 * 16),
    # two models on one backend: the configured model filters
    ("vllm_v1_two_models.prom", "vllm", LLAMA, 0.3, 2, 4, 0, 444832),
    ("vllm_v1_two_models.prom", "vllm", QWEN, 0.8, 9, 11, 0, 444832),
    ("vllm_v1_two_models.prom", "vllm", None, 0.55, 11, 15, 0, 444832),
    # SGLang with rank labels; with dp_rank groups usage is averaged, queues summed
    ("sglang.prom", "sglang", None, 0.62, 4, 30, 2, 161721),
    ("sglang.prom", "sglang", LLAMA, 0.62, 4, 30, 2, 161721),
    ("sglang_dp.prom", "sglang", None, 0.70, 10, 71, 3, 2 * 161721),
    # TGI: usage = current_max_tokens / max_total_tokens
    ("tgi.prom", "tgi", None, 61440 / 163840, 3, 24, None, 163840),
    # DCGM: the fullest GPU, with both label spellings of the host
    ("dcgm_Hostname.prom", "dcgm", None, 73339 / (73339 + 8149), None, None, None, None),
    ("dcgm_hostname.prom", "dcgm", None, 69200 / (69200 + 12288), None, None, None, None),
]


@pytest.mark.parametrize("name,engine,model,usage,waiting,running,preempt,capacity", CASES)
def test_engine_samples_read_as_the_engine_reports(name, engine, model, usage, waiting, running,
                                                     preempt, capacity):
    s = read(engine, body(name), model)
    assert s.problems == ()
    assert s.kv_usage == pytest.approx(usage)
    assert (s.waiting, s.running, s.preemptions_total, s.kv_capacity_tokens) == \
        (waiting, running, preempt, capacity)


def test_vllm_prefers_the_new_usage_name_when_both_are_exported():
    text = body("vllm_v1.prom").decode() + (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        f'vllm:gpu_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.99\n')
    assert read("vllm", text.encode()).kv_usage == pytest.approx(0.5)


def test_vllm_unknown_model_is_missing_not_idle():
    s = read("vllm", body("vllm_v1.prom"), "no/such-model")
    assert s.kv_usage is None and not s.usable
    assert ScrapeError.MISSING_METRICS in reasons(s)


def test_vllm_without_any_usage_name_is_missing():
    text = "\n".join(l for l in body("vllm_v1.prom").decode().splitlines()
                     if "kv_cache_usage_perc" not in l) + "\n"
    s = read("vllm", text.encode())
    assert s.kv_usage is None
    assert reasons(s) == [ScrapeError.MISSING_METRICS]
    assert s.waiting == 0  # what was there is still read


def test_vllm_missing_queue_is_counted_but_usage_still_counts():
    text = "\n".join(l for l in body("vllm_v1.prom").decode().splitlines()
                     if "num_requests_waiting" not in l) + "\n"
    s = read("vllm", text.encode())
    assert s.usable and s.waiting is None
    assert reasons(s) == [ScrapeError.MISSING_METRICS]


def test_vllm_cache_config_before_profiling_reports_no_capacity_without_problem():
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:num_requests_running{model_name="m"} 0\n')
    s = read("vllm", text.encode())
    assert s.kv_capacity_tokens is None and s.problems == ()
    assert s.block_tokens == 16   # the block size is known before profiling


def test_vllm_block_size_is_read_and_a_hostile_one_is_a_bad_value():
    base = ('vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:num_requests_running{model_name="m"} 0\n')
    good = read("vllm", ('vllm:cache_config_info{block_size="32",num_gpu_blocks="1025"} 1.0\n' + base).encode())
    assert good.block_tokens == 32 and good.kv_capacity_tokens == 32 * 1025
    bad = read("vllm", ('vllm:cache_config_info{block_size="-4",num_gpu_blocks="10"} 1.0\n' + base).encode())
    assert bad.block_tokens is None and ScrapeError.BAD_VALUE in reasons(bad) and bad.usable
    none = read("vllm", base.encode())
    assert none.block_tokens is None and none.prefix_hits is None and none.prefix_queries is None


def test_vllm_prefix_cache_counters_are_summed_over_engines_and_checked():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32\n')
    s = read("vllm", text.encode())
    assert (s.prefix_hits, s.prefix_queries) == (672, 1500)
    bad = read("vllm", text.replace(" 32\n", " -3\n").encode())
    assert bad.prefix_hits is None and ScrapeError.BAD_VALUE in reasons(bad) and bad.usable


@pytest.mark.parametrize("label", ['kv_cache_size_tokens="-5"', 'kv_cache_size_tokens="1e30"',
                                   'kv_cache_size_tokens="lots"', 'kv_cache_size_tokens="12.5"'])
def test_vllm_hostile_capacity_label_is_a_bad_value(label):
    text = (f'vllm:cache_config_info{{{label}}} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:num_requests_running{model_name="m"} 0\n')
    s = read("vllm", text.encode())
    assert s.kv_capacity_tokens is None
    assert ScrapeError.BAD_VALUE in reasons(s)
    assert s.usable  # capacity is optional: usage still counts


def _vllm(usage: str, waiting: str = "0") -> bytes:
    return (f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
            f'vllm:kv_cache_usage_perc{{engine="1",model_name="m"}} 0.2\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 1\n').encode()


@pytest.mark.parametrize("value", ["NaN", "-0.3", "-Inf", "+Inf"])
def test_unreadable_usage_makes_the_sample_unusable_never_idle(value):
    s = read("vllm", _vllm(value))
    assert s.kv_usage is None and not s.usable
    assert reasons(s) == [ScrapeError.BAD_VALUE]


@pytest.mark.parametrize("value", ["1.7", "1e300"])
def test_usage_above_one_is_clamped_to_saturated(value):
    s = read("vllm", _vllm(value))
    assert s.kv_usage == pytest.approx((1.0 + 0.2) / 2)
    assert reasons(s) == [ScrapeError.BAD_VALUE]


@pytest.mark.parametrize("value", ["NaN", "-2", "+Inf"])
def test_unreadable_queue_is_unknown_not_zero(value):
    s = read("vllm", _vllm("0.4", waiting=value))
    assert s.waiting is None and s.usable
    assert reasons(s) == [ScrapeError.BAD_VALUE]


def test_vllm_dp_num_gpu_blocks_is_the_front_ends_total_not_added_again():
    # Releases without kv_cache_size_tokens: every engine's line carries the sum over the
    # engines (here 3 engines, 3 x 1000 blocks of 16 tokens).
    lines = [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} 0.1' for e in range(3)]
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{e}",model_name="m",'
              f'num_gpu_blocks="3000"}} 1.0' for e in range(3)]
    s = read("vllm", ("\n".join(lines) + "\n").encode())
    assert s.kv_capacity_tokens == 3000 * 16
    assert ScrapeError.BAD_VALUE not in reasons(s)


def test_dcgm_mig_instances_of_one_gpu_are_read_apart():
    uuid = 'UUID="GPU-6f2a1c3e-8d4b-4a17-9b0e-2c5d7e9f1a30",gpu="0"'
    lines = []
    # a full instance listed first, an idle one last: the node is as full as the fullest
    for inst, (used, free) in enumerate([(9800, 200), (100, 9900)], start=1):
        lab = f'{uuid},GPU_I_ID="{inst}",GPU_I_PROFILE="3g.40gb"'
        lines += [f"DCGM_FI_DEV_FB_USED{{{lab}}} {used}", f"DCGM_FI_DEV_FB_FREE{{{lab}}} {free}"]
    s = read("dcgm", ("\n".join(lines) + "\n").encode())
    assert s.kv_usage == pytest.approx(0.98)
    assert s.problems == ()


def test_huge_queue_is_clamped():
    s = read("vllm", _vllm("0.4", waiting="1e300"))
    assert s.waiting == 10**9
    assert reasons(s) == [ScrapeError.BAD_VALUE]


def test_sglang_tensor_parallel_ranks_are_not_summed():
    lines = []
    for tp, (usage, queue) in enumerate([(0.4, 5), (0.5, 5)]):
        lab = f'model_name="m",tp_rank="{tp}",pp_rank="0"'
        lines += [f"sglang:token_usage{{{lab}}} {usage}", f"sglang:num_queue_reqs{{{lab}}} {queue}",
                  f"sglang:num_running_reqs{{{lab}}} 3", f"sglang:max_total_num_tokens{{{lab}}} 1000"]
    s = read("sglang", ("\n".join(lines) + "\n").encode())
    assert (s.kv_usage, s.waiting, s.running, s.kv_capacity_tokens) == (0.5, 5, 3, 1000)


def test_sglang_nan_usage_on_one_rank_is_unusable():
    text = body("sglang_dp.prom").decode()
    lines = [l.rsplit(" ", 1)[0] + " NaN" if l.startswith("sglang:token_usage{") and 'dp_rank="1"' in l else l
             for l in text.splitlines()]
    s = read("sglang", ("\n".join(lines) + "\n").encode())
    assert s.kv_usage is None and reasons(s) == [ScrapeError.BAD_VALUE]


def test_tgi_without_max_total_tokens_is_missing():
    text = "\n".join(l for l in body("tgi.prom").decode().splitlines()
                     if "tgi_batch_max_total_tokens" not in l) + "\n"
    s = read("tgi", text.encode())
    assert s.kv_usage is None and s.waiting == 3
    assert reasons(s) == [ScrapeError.MISSING_METRICS]


def test_tgi_zero_max_total_tokens_is_a_bad_value():
    text = body("tgi.prom").decode().replace("tgi_batch_max_total_tokens 163840", "tgi_batch_max_total_tokens 0")
    s = read("tgi", text.encode())
    assert s.kv_usage is None and ScrapeError.BAD_VALUE in reasons(s)


def test_dcgm_gpu_with_nan_memory_makes_the_node_unusable():
    text = body("dcgm_Hostname.prom").decode()
    lines = [l.rsplit(" ", 1)[0] + " NaN" if l.startswith("DCGM_FI_DEV_FB_FREE{gpu=\"1\"") else l
             for l in text.splitlines()]
    s = read("dcgm", ("\n".join(lines) + "\n").encode())
    assert s.kv_usage is None and reasons(s) == [ScrapeError.BAD_VALUE]


def test_dcgm_without_framebuffer_metrics_is_missing():
    text = "\n".join(l for l in body("dcgm_hostname.prom").decode().splitlines() if "FB_" not in l) + "\n"
    s = read("dcgm", text.encode())
    assert s.kv_usage is None and reasons(s) == [ScrapeError.MISSING_METRICS]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_another_engines_exposition_is_missing_metrics(engine):
    other = {"vllm": "tgi.prom", "sglang": "vllm_v1.prom", "tgi": "sglang.prom", "dcgm": "vllm_v0.prom"}[engine]
    s = read(engine, body(other))
    assert not s.usable and ScrapeError.MISSING_METRICS in reasons(s)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_empty_body_is_missing_metrics(engine):
    s = read(engine, b"")
    assert not s.usable and reasons(s)[0] == ScrapeError.MISSING_METRICS


@pytest.mark.parametrize("payload", [
    b"<html><body><h1>502 Bad Gateway</h1></body></html>\n",
    b"<!DOCTYPE html>\n<html></html>\n",
    b"this is not a metrics page at all\n",
    b"\xff\xfe\x00garbage\n",
    b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.',  # truncated mid-value
    b'vllm:kv_cache_usage_perc{engine="0",mod',                 # truncated mid-labels
    b'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_waiting{engine="0"} 1\nvllm:num_req',
])
def test_non_prometheus_bodies_fail_as_parse(payload):
    with pytest.raises(ScrapeFailure) as info:
        read("vllm", payload)
    assert info.value.reason == ScrapeError.PARSE


def test_every_reading_is_within_bounds():
    for name, engine, *_ in CASES:
        s = read(engine, body(name))
        assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0 and not math.isnan(s.kv_usage)


def test_a_garbage_line_among_real_samples_fails_the_body():
    text = body("vllm_v1.prom").decode()
    cut = len(text) // 2
    cut = text.index("\n", cut) + 1
    with pytest.raises(ScrapeFailure) as info:
        read("vllm", (text[:cut] + "upstream connect error or disconnect/reset before headers\n" + text[cut:]).encode())
    assert info.value.reason == ScrapeError.PARSE


def test_names_that_extend_a_wanted_name_are_not_read_as_it():
    text = ('vllm:kv_cache_usage_perc_max{model_name="m"} 0.99\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:num_requests_waiting{model_name="m"} 1\n'
            'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 40\n'
            'vllm:num_requests_running{model_name="m"} 2\n')
    s = read("vllm", text.encode())
    assert (s.kv_usage, s.waiting, s.running) == (0.25, 1, 2)


def test_a_broken_wanted_line_fails_the_body():
    text = 'vllm:kv_cache_usage_perc{model_name="m} 0.25\nvllm:num_requests_waiting 1\n'
    with pytest.raises(ScrapeFailure) as info:
        read("vllm", text.encode())
    assert info.value.reason == ScrapeError.PARSE
