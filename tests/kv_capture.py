"""kv_capture: the KV cache events the real vLLM engine published, as recorded by
``bench/record_kv_events.py`` into ``tests/fixtures/vllm_kv_events.jsonl`` (bytes as sent)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CAPTURE = Path(__file__).parent / "fixtures" / "vllm_kv_events.jsonl"


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
