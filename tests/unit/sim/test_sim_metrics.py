"""Tests that the simulator's /metrics page is vLLM V1's and matches the engine's state."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sim.engine import Engine, EngineParams
from sim.metrics import make_registry, render


def samples(engine: Engine) -> dict[tuple[str, tuple], float]:
    text = render(make_registry(engine.stats, "llama", 16)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


LABELS = (("engine", "0"), ("model_name", "llama"))


def test_metrics_follow_the_engine_state():
    e = Engine(EngineParams(kv_capacity_tokens=16 * 10, prefill_tokens_per_s=1000,
                            decode_tokens_per_s=10, batch_slowdown=0))
    e.configure(0.0, background_kv_tokens=32)                  # 2 blocks
    e.add(0.0, prompt_tokens=50, target_tokens=3)              # 4 blocks
    e.add(0.0, prompt_tokens=60, target_tokens=3)              # 4 blocks, joins next step
    e.add(0.0, prompt_tokens=60, target_tokens=3)              # cannot fit: waits
    e.advance(0.05)
    m = samples(e)
    s = e.stats()
    assert (s.running, s.waiting) == (2, 1)
    assert m[("vllm:num_requests_running", LABELS)] == 2
    assert m[("vllm:num_requests_waiting", LABELS)] == 1
    assert m[("vllm:kv_cache_usage_perc", LABELS)] == (s.used_blocks + 2) / 10
    assert m[("vllm:num_preemptions_total", LABELS)] == s.preemptions
    assert m[("vllm:prompt_tokens_total", LABELS)] == 50
    assert m[("vllm:generation_tokens_total", LABELS)] == 1
    info = [k for k in m if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1 and m[info[0]] == 1.0
    labels = dict(info[0][1])
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "10"
    assert labels["kv_cache_size_tokens"] == "160" and labels["engine"] == "0"
    while (end := e.next_step_end()) is not None:
        e.advance(end)
    m = samples(e)
    assert m[("vllm:num_requests_running", LABELS)] == 0
    assert m[("vllm:kv_cache_usage_perc", LABELS)] == 0.2      # the background alone
    assert m[("vllm:request_success_total", (*LABELS[:1], ("finished_reason", "length"), LABELS[1]))] == 3
    assert m[("vllm:generation_tokens_total", LABELS)] == 9


def test_counters_expose_total_names_without_created_series():
    text = render(make_registry(Engine(EngineParams(kv_capacity_tokens=160)).stats, "m", 16)).decode()
    assert "# TYPE vllm:num_preemptions_total counter" in text
    assert "_created" not in text
