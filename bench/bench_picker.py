"""bench_picker: a burst of long prompts on three simulated nodes, kvgate at the pool level
(Envoy's load balancer picks the node) against kvgate picking the node, side by side.

Every row runs the same burst (``--requests`` chat requests of ``--prompt-tokens`` +
``--max-tokens`` at once, the openai client with its default retries) against three
``kvgate sim`` nodes of ``--kv-tokens`` each, once per value of ``--background``: KV
tokens that kvgate did not admit on node-0 (another gateway's traffic, a batch job). Reported per row:
preemptions per node, requests completed, refusals the client saw, and the burst's time.

    make bench-picker                  # writes bench/results/picker.md
    python bench/bench_picker.py --runs 1 --out -   # print only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvgate_testkit.nodes_stack import MODEL, NodesStack  # noqa: E402
from kvgate_testkit.procs import exit_on_sigterm, wait_until  # noqa: E402

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("pool level, Envoy round robin (deploy/envoy.yaml)", {"picking": False}),
    ("pool level, Envoy least request (deploy/envoy.yaml)", {"picking": False,
                                                            "lb_policy": "LEAST_REQUEST"}),
    ("kvgate picks the node, worst-case growth (deploy/envoy-endpoint-picker.yaml)",
     {"picking": True, "pool": {"picking": {"growth": "worst_case"}}}),
    ("kvgate picks the node, learned growth (deploy/envoy-endpoint-picker.yaml)",
     {"picking": True, "pool": {"picking": {"growth": "learned"}}}),
]


def burst(stack: NodesStack, n: int, prompt: str, max_tokens: int) -> tuple[int, int, float]:
    """burst sends ``n`` requests at once; returns (completed, failed, seconds)."""
    import openai

    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", timeout=300)

    def one(_: int) -> bool:
        try:
            client.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                           messages=[{"role": "user", "content": prompt}])
            return True
        except openai.APIError:
            return False

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        ok = list(pool.map(one, range(n)))
    return sum(ok), n - sum(ok), time.monotonic() - t0


def run_row(name: str, opts: dict[str, Any], args: argparse.Namespace, prompt: str,
            background: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        stack = NodesStack(Path(tmp), nodes=3, kv_capacity_tokens=args.kv_tokens,
                           sim_args=["--speedup", str(args.speedup)], **opts).start()
        try:
            wait_until(lambda: stack.metric("kvgate_backend_up") == 3, timeout=10, what="nodes up")
            if background:
                stack.node_config(0, {"background_kv_tokens": background})
                wait_until(lambda: stack.node_state(0)["background_blocks"] > 0, timeout=5,
                           what="background load on node-0")
                time.sleep(1.0)  # two scrape rounds: kvgate has read the loaded node
            before = [stack.node_state(i)["preemptions"] for i in range(3)]
            done, failed, seconds = burst(stack, args.requests, prompt, args.max_tokens)
            after = [stack.node_state(i)["preemptions"] for i in range(3)]
            return {"row": name, "background": background,
                    "preemptions": [a - b for a, b in zip(after, before)],
                    "completed": done, "failed": failed, "seconds": seconds}
        finally:
            stack.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=29_000)
    ap.add_argument("--max-tokens", type=int, default=1_000)
    ap.add_argument("--kv-tokens", type=int, default=100_000)
    ap.add_argument("--background", default="0,60000",
                    help="KV tokens on node-0 that kvgate did not admit, one scenario per "
                         "comma-separated value (default 0,60000)")
    ap.add_argument("--speedup", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "picker.md"),
                    help="results file ('-': print only)")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a killed run still stops what it started
    prompt = "hello" + " hello" * (args.prompt_tokens - 10)
    backgrounds = [int(b) for b in args.background.split(",") if b.strip()]
    results: list[list[dict[str, Any]]] = []
    for run in range(args.runs):
        results.append([run_row(name, opts, args, prompt, bg) for bg in backgrounds
                        for name, opts in ROWS])
        for r in results[-1]:
            print(f"run {run + 1}, background {r['background']}: {r['row']}: preemptions "
                  f"{r['preemptions']}, completed {r['completed']}/{args.requests}, "
                  f"{r['seconds']:.1f}s", flush=True)
    lines = [
        "# Per-node picking against pool-level admission (bench/bench_picker.py)", "",
        f"Command: `python bench/bench_picker.py --runs {args.runs}` (`make bench-picker`). "
        f"{args.requests} chat requests of {args.prompt_tokens} prompt + {args.max_tokens} "
        f"completion tokens at once on three simulated nodes of {args.kv_tokens} KV tokens "
        f"(`kvgate sim`, speedup {args.speedup:g}); in the second scenario node-0 holds KV "
        "tokens that kvgate did not admit. The openai client with its default retries; each "
        "row starts fresh nodes, kvgate and Envoy.", "",
        "| KV on node-0 not admitted by kvgate | setup | run | preemptions (node-0, node-1, node-2) "
        "| completed | failed | burst time (s) |",
        "|---|---|---|---|---|---|---|"]
    for bg in backgrounds:
        for name, _ in ROWS:
            for run, rows in enumerate(results):
                r = next(x for x in rows if x["row"] == name and x["background"] == bg)
                lines.append(f"| {bg} | {name} | {run + 1} | {', '.join(map(str, r['preemptions']))} | "
                             f"{r['completed']} | {r['failed']} | {r['seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
