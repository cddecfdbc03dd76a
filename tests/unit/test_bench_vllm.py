"""The parts of bench/bench_vllm.py that need no vLLM: exact prompts, kvgate's config for the
engine (pool level and the per-node contract), Envoy's files pointed at loopback (and
accepted by the real Envoy), vLLM's metrics parsed, the engine's processes found."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.bench_vllm import skipped_rows
from bench.vllm_report import KvCheck, Outcome, preemption_cell, prefix_report, prefix_target, report, spread
from bench.vllm_rows import (PICKER_ENVOY, PICKER_LOG_ENVOY, POOL_ENVOY, PREFIX_ROWS, ROWS, SCENARIOS, Burst,
                             baseline, burst_texts, prompts, shared_prefix_prompts)
from extproc.localstack import render_envoy
from kvgate_testkit.procs import ROOT, wait_until
from kvgate_testkit.sampling import descendants
from kvgate_testkit.vllm import EngineFlags, kvgate_config, parse_metrics
from tests.deploy.support import envoy_validate

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """tokenizer is a byte-level BPE trained on kvgate's own sources, as the bench trains one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sources = sorted((ROOT / "extproc").rglob("*.py"))[:15]
    tok.train_from_iterator([p.read_text() for p in sources], trainer=trainer)
    return tok


def test_prompts_have_the_exact_count_and_share_no_kv_block(tokenizer: Tokenizer) -> None:
    burst = Burst(requests=6, prompt_tokens=300)
    texts = prompts(tokenizer, burst, seed=3)
    ids = [tokenizer.encode(t).ids for t in texts]
    assert [len(i) for i in ids] == [300] * 6
    first_blocks = {tuple(i[:32]) for i in ids}   # vLLM's prefix cache shares whole blocks
    assert len(first_blocks) == 6
    assert prompts(tokenizer, burst, seed=3) == texts
    assert prompts(tokenizer, burst, seed=4) != texts


def test_pool_config_parses_and_points_at_the_engine(tmp_path: Path) -> None:
    flags = EngineFlags()
    cfg = kvgate_config([41000], flags, tmp_path / "tokenizer.json", None)
    pool = cfg["pools"]["default"]
    assert pool["backends"] == [{"name": "vllm-0", "metrics_url": "http://127.0.0.1:41000/metrics",
                                 "engine": "vllm"}]
    assert pool["context_window"] == flags.max_model_len
    assert pool["tokenizer"] == f"hf:{tmp_path / 'tokenizer.json'}"
    assert "kv_budget_tokens" not in pool   # derived from what vLLM reports
    assert pool["signals"]["kv_budget_fraction"] == 0.9
    full = kvgate_config([41000], flags, tmp_path / "tokenizer.json", None, kv_budget_fraction=1.0)
    assert full["pools"]["default"]["signals"]["kv_budget_fraction"] == 1.0
    # kvgate's class wait must stay below Envoy's max_message_timeout (else every wait is a 504)
    envoy = yaml.safe_load(POOL_ENVOY.read_text())
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert cfg["tenants"]["classes"]["standard"]["max_wait_s"] < float(
        ext_proc["typed_config"]["max_message_timeout"].rstrip("s"))


def test_picker_rows_follow_the_per_node_contract(tmp_path: Path) -> None:
    rows = {r.key: r for r in ROWS}
    for key, growth in (("picker-learned", "learned"), ("picker-worst_case", "worst_case"),
                        ("picker-learned-2", "learned")):
        row = rows[key]
        assert row.envoy == PICKER_ENVOY
        assert row.picking is not None and row.picking["growth"] == growth
    assert rows["picker-learned"].picking == {"growth": "learned", "quantile": 0.9}
    assert rows["picker-learned-2"].picking == rows["picker-learned"].picking
    skipped = skipped_rows(list(ROWS))
    if PICKER_ENVOY.exists():
        assert skipped == {}
        cfg = kvgate_config([41000], EngineFlags(), tmp_path / "tokenizer.json", rows["picker-learned"].picking)
        assert cfg["pools"]["default"]["backends"][0]["address"] == "127.0.0.1:41000"
    else:
        assert set(skipped) == {"picker-learned", "picker-worst_case", "picker-learned-2"}
        assert all("deploy/envoy-endpoint-picker.yaml is not in the repository" in why
                   for why in skipped.values())


def test_the_picker_log_rows_pick_as_the_picker_rows_behind_the_picker_log_file(tmp_path: Path) -> None:
    rows = {r.key: r for r in ROWS}
    for key, twin in (("picker-log-learned", "picker-learned"), ("picker-log-learned-2", "picker-learned-2")):
        assert rows[key].envoy == PICKER_LOG_ENVOY
        assert (rows[key].picking, rows[key].nodes) == (rows[twin].picking, rows[twin].nodes)
    cfg = render_envoy(yaml.safe_load(PICKER_LOG_ENVOY.read_text()), listen=18080, admin=18081, grpc=15051,
                       upstream=18000)
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster.get("type") != "ORIGINAL_DST":   # the node kvgate names; the rest on loopback
            (ep,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            assert ep["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    done = envoy_validate(cfg, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_parse_metrics_sums_vllm_series_and_keeps_the_report_labels() -> None:
    text = "\n".join([
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.7734375',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 4.0',
        "# TYPE vllm:num_preemptions counter",
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 8.0',
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="32",kv_cache_size_tokens="4128",num_gpu_blocks="129"} 1.0',
        "# TYPE kvgate_requests counter",
        'kvgate_requests_total{class="standard",outcome="admitted",pool="default"} 10.0',
        'kvgate_requests_total{class="standard",outcome="rejected_kv_budget",pool="default"} 4.0',
        ""])
    m = parse_metrics(text)
    assert m["vllm:kv_cache_usage_perc"] == 0.7734375
    assert m["vllm:num_requests_waiting"] == 7.0
    assert m["vllm:num_preemptions_total"] == 8.0
    assert m["vllm:cache_config_info{kv_cache_size_tokens=4128}"] == 1.0
    assert m["kvgate_requests_total{outcome=admitted}"] == 10.0
    assert m["kvgate_requests_total{outcome=rejected_kv_budget}"] == 4.0
    assert m["kvgate_requests_total"] == 14.0


def test_descendants_finds_children_and_grandchildren() -> None:
    # sh starts two children of its own; the engine's API server starts its engine core so.
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60; true' & sleep 60 & wait"], start_new_session=True)
    try:
        wait_until(lambda: len(descendants(proc.pid)) == 3, timeout=10, what="three descendants")
        assert proc.pid not in descendants(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def test_spread() -> None:
    assert spread([8.0, 8.0]) == "8"
    assert spread([43.71, 55.62], 1) == "43.7-55.6"
    assert spread([]) == "-"



def test_two_engine_rows_double_the_burst_and_each_engine_is_a_node(tmp_path: Path) -> None:
    rows = {r.key: r for r in ROWS}
    assert rows["direct-2"].envoy is None and rows["direct-2"].nodes == 2
    assert rows["picker-learned-2"].nodes == 2
    assert all(r.nodes == 1 for k, r in rows.items() if not k.endswith("-2"))
    flags = EngineFlags()
    cfg = kvgate_config([41000, 41002], flags, tmp_path / "tokenizer.json", rows["picker-learned-2"].picking)
    pool = cfg["pools"]["default"]
    assert [(b["name"], b["address"], b["metrics_url"]) for b in pool["backends"]] == [
        ("vllm-0", "127.0.0.1:41000", "http://127.0.0.1:41000/metrics"),
        ("vllm-1", "127.0.0.1:41002", "http://127.0.0.1:41002/metrics")]
    assert pool["max_concurrency"] == 2 * flags.max_num_seqs   # the engines' slots, not one's


def test_parse_metrics_keeps_kvgate_readings_per_backend() -> None:
    text = "\n".join([
        "# TYPE kvgate_backend_kv_cache_usage_ratio gauge",
        'kvgate_backend_kv_cache_usage_ratio{backend="vllm-0",pool="default"} 0.25',
        'kvgate_backend_kv_cache_usage_ratio{backend="vllm-1",pool="default"} 0.5',
        ""])
    m = parse_metrics(text)
    assert m["kvgate_backend_kv_cache_usage_ratio{backend=vllm-0}"] == 0.25
    assert m["kvgate_backend_kv_cache_usage_ratio{backend=vllm-1}"] == 0.5


def test_preemption_cell_shows_each_engine_and_the_total() -> None:
    one = [Outcome("direct", 1, preemptions=8.0, node_preemptions=[8.0]),
           Outcome("direct", 2, preemptions=7.0, node_preemptions=[7.0])]
    assert preemption_cell(one) == "7-8"
    two = [Outcome("direct-2", 1, preemptions=15.0, node_preemptions=[8.0, 7.0]),
           Outcome("direct-2", 2, preemptions=16.0, node_preemptions=[8.0, 8.0])]
    assert preemption_cell(two) == "8 / 7-8 = 15-16"


def test_report_judges_each_gated_row_against_the_direct_burst_on_as_many_engines(tmp_path: Path) -> None:
    def check(node: str) -> KvCheck:
        return KvCheck(node, 0.5, 0.5, 0.0, 0.0, 2.0)
    outcomes = [
        Outcome("direct", 1, preemptions=8.0, node_preemptions=[8.0], completed=10, checks=[check("vllm-0")]),
        Outcome("kvgate", 1, node_preemptions=[0.0], completed=10, kvgate_inflight_after=0.0),
        Outcome("direct-2", 1, preemptions=16.0, node_preemptions=[8.0, 8.0], completed=20,
                checks=[check("vllm-0"), check("vllm-1")]),
        Outcome("picker-learned-2", 1, preemptions=1.0, node_preemptions=[0.0, 1.0], completed=20,
                kvgate_inflight_after=0.0, series={0: [(0.0, 0.1)], 1: [(0.0, 0.2)]}),
    ]
    verdict = report(outcomes, {}, EngineFlags(), Burst(), 1, ["bench/bench_vllm.py"], {}, [40.0, 41.0],
                     100.0, tmp_path)
    assert "through kvgate 0 preemptions in those runs: NO" in verdict   # the two-engine row preempted
    assert "3/3 frozen checks" in verdict
    text = (tmp_path / "vllm.md").read_text()
    assert "| 1 | direct-2 | vllm-1 | 0.5 | 0.5 |" in text
    assert "| picker-learned-2: " in text and "| 0 / 1 = 1 | 20/20 |" in text
    assert (tmp_path / "vllm_kv.png").stat().st_size > 0
    outcomes[-1] = Outcome("picker-learned-2", 1, node_preemptions=[0.0, 0.0], completed=20,
                           kvgate_inflight_after=0.0)
    assert "0 preemptions in those runs: yes" in report(outcomes, {}, EngineFlags(), Burst(), 1, [], {},
                                                       [40.0], 100.0, tmp_path)


def test_shared_prefix_prompts_share_exactly_the_prefix_and_have_the_exact_count(tokenizer: Tokenizer) -> None:
    burst = Burst(requests=5, prompt_tokens=400, max_tokens=10)
    texts = shared_prefix_prompts(tokenizer, burst, prefix_tokens=330, seed=3)
    ids = [tokenizer.encode(t).ids for t in texts]
    assert [len(i) for i in ids] == [400] * 5
    assert len({tuple(i[:330]) for i in ids}) == 1            # one prefix, at the start of the ids
    # vLLM shares whole blocks: the 10 blocks of 32 within the prefix, not the one it ends in
    assert len({tuple(i[:320]) for i in ids}) == 1
    assert len({tuple(i[320:352]) for i in ids}) == 5
    assert len({tuple(i[330:]) for i in ids}) == 5             # a question of its own each
    assert shared_prefix_prompts(tokenizer, burst, 330, seed=3) == texts
    other = shared_prefix_prompts(tokenizer, burst, 330, seed=4)
    assert tokenizer.encode(other[0]).ids[:32] != ids[0][:32]   # another row: another prefix
    with pytest.raises(ValueError):
        shared_prefix_prompts(tokenizer, burst, prefix_tokens=400, seed=3)


def test_the_prefix_scenario_is_issue_29s_burst_and_leaves_the_default_alone(tmp_path: Path) -> None:
    default, prefix = SCENARIOS["default"], SCENARIOS["prefix"]
    assert (default.rows, default.flags, default.burst, default.report) == (ROWS, EngineFlags(), Burst(), "vllm.md")
    assert all(r.prompts == "distinct" for r in ROWS)
    f = prefix.flags
    assert (f.blocks, f.block_size, f.usable_tokens, f.max_model_len) == (1025, 32, 32_768, 16384)
    assert f.max_num_seqs >= prefix.burst.requests == 12     # all twelve may run at once
    assert (prefix.burst.prompt_tokens, prefix.burst.max_tokens, prefix.prefix_tokens) == (10_200, 800, 10_000)
    assert prefix.report == "vllm-prefix.md" and prefix.max_wait_s == 30
    rows = {r.key: r for r in PREFIX_ROWS}
    assert list(rows) == ["direct-shared", "kvgate-blind-shared", "kvgate-prefix-shared", "direct-unique",
                          "kvgate-prefix-unique"]
    assert rows["kvgate-blind-shared"].picking == {}          # the picker's defaults: prefix-blind
    assert rows["kvgate-prefix-shared"].picking == rows["kvgate-prefix-unique"].picking == {"shared_prefix": True}
    assert {r.envoy for r in PREFIX_ROWS if r.envoy is not None} == {PICKER_ENVOY}
    assert baseline(rows["kvgate-blind-shared"], PREFIX_ROWS) is rows["direct-shared"]
    assert baseline(rows["kvgate-prefix-unique"], PREFIX_ROWS) is rows["direct-unique"]
    assert baseline(rows["direct-shared"], PREFIX_ROWS) is None
    for r in PREFIX_ROWS:
        if r.picking is not None:   # parse_config accepts it (it raises otherwise)
            cfg = kvgate_config([41000], f, tmp_path / "tokenizer.json", r.picking, max_wait_s=prefix.max_wait_s)
            assert cfg["tenants"]["classes"]["standard"]["max_wait_s"] == 30


def test_burst_texts_follow_the_rows_prompts(tokenizer: Tokenizer) -> None:
    prefix = SCENARIOS["prefix"]
    small = type(prefix)("t", prefix.flags, prefix.burst, prefix.rows, "t.md", 30, prefix_tokens=200)
    burst = Burst(requests=3, prompt_tokens=260, max_tokens=1)
    rows = {r.key: r for r in PREFIX_ROWS}
    shared = [tokenizer.encode(t).ids for t in burst_texts(tokenizer, small, rows["direct-shared"], burst, 1)]
    unique = [tokenizer.encode(t).ids for t in burst_texts(tokenizer, small, rows["direct-unique"], burst, 1)]
    assert len({tuple(i[:200]) for i in shared}) == 1
    assert len({tuple(i[:32]) for i in unique}) == 3


def test_prefix_target_wants_all_completed_no_preemption_and_the_ratio() -> None:
    rows = {r.key: r for r in PREFIX_ROWS}
    ok = Outcome("kvgate-prefix-shared", 1, completed=12)
    assert prefix_target(rows["kvgate-prefix-shared"], ok, 1.2, 12) == ("12/12, 0 preemptions, <= 1.25x", True)
    assert prefix_target(rows["kvgate-prefix-shared"], ok, 1.3, 12)[1] is False
    assert prefix_target(rows["kvgate-prefix-shared"], ok, None, 12)[1] is False    # no direct row to compare
    assert prefix_target(rows["kvgate-blind-shared"], Outcome("kvgate-blind-shared", 1, completed=12), 3.5, 12) \
        == ("12/12, 0 preemptions", True)
    preempted = Outcome("kvgate-prefix-unique", 1, completed=12, preemptions=1.0)
    assert prefix_target(rows["kvgate-prefix-unique"], preempted, 1.0, 12)[1] is False
    assert prefix_target(rows["direct-unique"], Outcome("direct-unique", 1, preemptions=4.0), None, 12) == ("-", None)


def test_prefix_report_gives_each_row_its_ratio_hits_and_verdict(tmp_path: Path) -> None:
    sc = SCENARIOS["prefix"]
    outcomes = [
        Outcome("direct-shared", 1, completed=12, elapsed_s=15.0, peak_kv=0.68, prefix_hits=109_824.0),
        Outcome("kvgate-blind-shared", 1, completed=12, elapsed_s=52.8, peak_kv=0.37, refusals=3.0,
                prefix_hits=99_840.0),
        Outcome("kvgate-prefix-shared", 1, completed=12, elapsed_s=18.0, peak_kv=0.68, prefix_hits=109_824.0,
                kvgate_seen={"kvgate_backend_kv_shared_prefix_tokens": 9_600.0,
                             "kvgate_backend_prefix_credit_tokens_total": 105_600.0}),
        Outcome("direct-unique", 1, completed=12, elapsed_s=51.5, preemptions=4.0),
        Outcome("kvgate-prefix-unique", 1, completed=12, elapsed_s=80.0),
    ]
    verdict, met = prefix_report(outcomes, {}, sc, sc.burst, 1, ["bench/bench_vllm.py", "--scenario", "prefix"],
                                 {}, [25.0], 300.0, tmp_path)
    assert met and verdict == ("kvgate-blind-shared: PASS; kvgate-prefix-shared: PASS; "
                               "kvgate-prefix-unique: PASS")
    text = (tmp_path / "vllm-prefix.md").read_text()
    assert "| 12/12 | 18.0 | 1.20x | 0 | 0.680 | 109824 | 0 | 12/12, 0 preemptions, <= 1.25x | PASS |" in text
    assert "| 12/12 | 52.8 | 3.52x | 0 | 0.370 | 99840 | 3 |" in text
    assert "| 1 | kvgate-prefix-shared | 9,600 | - | - | - | 105,600 | - | 109,824 |" in text
    outcomes[2] = Outcome("kvgate-prefix-shared", 1, completed=12, elapsed_s=20.0)
    verdict, met = prefix_report(outcomes, {}, sc, sc.burst, 1, [], {}, [25.0], 300.0, tmp_path)
    assert not met and "kvgate-prefix-shared: FAIL" in verdict
