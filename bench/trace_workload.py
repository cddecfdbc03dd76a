"""trace_workload: bench_trace's workload: a window of Azure's 2023 conversation trace turned into
timed chat requests (online chats over several tenants, batch documents in bursts) and the
background load one node carries, as a stated scenario.

Prompts are built to the trace's exact token counts (one cl100k token per word plus the
chat template's 7 tokens); the output length is the trace's, capped by the client's
``max_tokens`` drawn from a stated mix.
"""
from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvgate_testkit.load import CHAT_OVERHEAD
from kvgate_testkit.nodes_stack import MODEL, Node
from sim.api import words

ROOT = Path(__file__).resolve().parents[1]
# The full trace lives beside a user's clone, not in it; the committed slice holds the
# default window (trace seconds 1560-1680) so tests and a fresh clone can run it.
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "azure-conv-2023.csv"
TRACE_SLICE = ROOT / "bench" / "traces" / "azure-conv-2023-slice.csv"
NODES = 3


# --- the trace --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRow:
    """TraceRow is one request of the trace: arrival (trace seconds), prompt and output tokens."""

    at: float
    prompt_tokens: int
    output_tokens: int


TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


def read_trace(path: Path, start_s: float, window_s: float) -> list[TraceRow]:
    """read_trace returns the trace's requests that arrive in [start_s, start_s + window_s) trace seconds.

    Raises ValueError naming the line of a malformed row (a missing column, a negative or
    non-numeric value, arrivals out of order).
    """
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != TRACE_COLUMNS:
            raise ValueError(f"{path}: the first line must be the columns {','.join(TRACE_COLUMNS)}")
        last = -math.inf
        for line, cells in enumerate(reader, start=2):
            if len(cells) != 3:
                raise ValueError(f"{path}:{line}: expected 3 columns, got {len(cells)}")
            try:
                at, prompt, output = float(cells[0]), int(cells[1]), int(cells[2])
            except ValueError:
                raise ValueError(f"{path}:{line}: not numbers: {','.join(cells)[:80]!r}") from None
            if not (math.isfinite(at) and at >= 0 and prompt >= 1 and output >= 1):
                raise ValueError(f"{path}:{line}: arrival must be >= 0 s and token counts >= 1")
            if at < last:
                raise ValueError(f"{path}:{line}: arrivals go backwards ({at} after {last})")
            last = at
            if at >= start_s + window_s:
                break
            if at >= start_s:
                rows.append(TraceRow(at, prompt, output))
    return rows


# --- the workload -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Burst:
    """Burst is ``count`` batch documents sent at ``at`` (simulated s): prompts and outputs in tokens."""

    at: float
    count: int
    prompt: tuple[int, int]
    output: tuple[int, int]


RAMP_STEPS = 4


@dataclass(frozen=True, slots=True)
class Background:
    """Background is load on node ``node`` that no gateway admitted: ``tokens`` KV tokens
    from ``start_s`` (reached ``ramp_s`` later) to ``end_s`` (simulated seconds)."""

    node: int
    tokens: int
    start_s: float
    end_s: float
    ramp_s: float = 0.0

    def steps(self) -> list[tuple[float, int]]:
        """steps are the (simulated s, background tokens) settings in order: the load rises in
        ``RAMP_STEPS`` equal steps over ``ramp_s`` (at once when 0) and leaves at ``end_s``."""
        n = RAMP_STEPS if self.ramp_s > 0 else 1
        rise = [(self.start_s + self.ramp_s * i / n, self.tokens * (i + 1) // n) for i in range(n)]
        return [*rise, (self.end_s, 0)]

    def arriving(self, t: float, settle_s: float = 3.0) -> bool:
        """arriving tells whether ``t`` (simulated s) falls while the load rises or ``settle_s`` after."""
        return self.start_s <= t <= self.start_s + self.ramp_s + settle_s


@dataclass(frozen=True, slots=True)
class Scenario:
    """Scenario is what is replayed and how hard; times in simulated seconds unless named trace seconds.

    The trace window [``start_s``, ``start_s + window_s``) (trace seconds) is compressed
    ``compress`` times (a trace second lasts 1/compress simulated s). ``max_tokens_mix``
    is the clients' policy: (max_tokens or None, weight). Batch documents come in
    ``bursts`` with ``batch_max_tokens``; ``drain_s`` after the last arrival, batch
    retries stop.
    """

    name: str
    start_s: float
    window_s: float
    compress: float
    online_tenants: int
    max_tokens_mix: tuple[tuple[int | None, float], ...]
    bursts: tuple[Burst, ...]
    batch_max_tokens: int
    background: Background
    drain_s: float

    @property
    def duration_s(self) -> float:
        """duration_s is the arrivals' span in simulated seconds."""
        return self.window_s / self.compress


# Clients seen in the field ask for 1,024-4,096 tokens or for nothing at all; the trace
# does not say which, so this mix is the benchmark's stated assumption.
MAX_TOKENS_MIX: tuple[tuple[int | None, float], ...] = ((1024, 0.5), (4096, 0.25), (None, 0.25))

FULL = Scenario(
    name="full", start_s=1560.0, window_s=120.0, compress=1.4, online_tenants=6,
    max_tokens_mix=MAX_TOKENS_MIX,
    bursts=(Burst(at=15.0, count=4, prompt=(8000, 12000), output=(200, 500)),
            Burst(at=50.0, count=4, prompt=(8000, 12000), output=(200, 500))),
    batch_max_tokens=512,
    # Load that no gateway admitted grows as its own requests do: over 4 s, not in one jump.
    background=Background(node=2, tokens=16_384, start_s=25.0, end_s=55.0, ramp_s=4.0),
    drain_s=40.0)

TINY = Scenario(
    name="tiny", start_s=1560.0, window_s=10.0, compress=2.5, online_tenants=2,
    max_tokens_mix=MAX_TOKENS_MIX,
    bursts=(Burst(at=1.0, count=2, prompt=(6000, 8000), output=(20, 40)),),
    batch_max_tokens=64,
    background=Background(node=2, tokens=16_384, start_s=0.5, end_s=4.0),
    drain_s=6.0)

# One node: 32k KV tokens (a small GPU's worth at this scale), a 16k context.
NODE = Node(kv_capacity_tokens=32_768, max_model_len=16_384)


@dataclass(frozen=True, slots=True)
class Req:
    """Req is one request of the replay: when (simulated s), who, its sizes (tokens) and its JSON body.

    ``output_tokens`` is what the model would generate before stopping (the trace's
    count, sent as ``x-sim-output-tokens``); ``max_tokens`` the client's cap (None: no
    cap); ``true_output`` what the node will generate: the output, capped.
    """

    id: int
    at: float
    tenant: str
    klass: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    true_output: int
    body: bytes

    @property
    def stream(self) -> bool:
        return self.klass == "online"


def _body(i: int, prompt: int, max_tokens: int | None, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL,
                            "messages": [{"role": "user", "content": words(i, 0, prompt - CHAT_OVERHEAD)}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _pick(rng: random.Random, mix: Sequence[tuple[int | None, float]]) -> int | None:
    x = rng.random() * sum(w for _, w in mix)
    for value, weight in mix:
        x -= weight
        if x < 0:
            return value
    return mix[-1][0]


def build_requests(rows: Sequence[TraceRow], sc: Scenario, seed: int, node: Node = NODE) -> list[Req]:
    """build_requests turns trace rows and the scenario into requests drawn from ``seed``: the same list every run.

    A prompt shorter than the chat template (8 tokens) is lengthened to 8; a request
    whose prompt and cap could not fit the context even with the smallest cap is left out.
    """
    rng = random.Random(seed)
    specs: list[tuple[float, str, str, int, int, int | None]] = []
    origin = rows[0].at if rows else sc.start_s
    for row in rows:
        prompt = max(CHAT_OVERHEAD + 1, row.prompt_tokens)
        tenant = f"online-{rng.randrange(sc.online_tenants) + 1}"
        max_tokens = _pick(rng, sc.max_tokens_mix)
        if max_tokens is not None and prompt + max_tokens > node.max_model_len:
            max_tokens = None  # a client that knows its context window sends no cap rather than a 400
        if prompt >= node.max_model_len:
            continue
        specs.append(((row.at - origin) / sc.compress, tenant, "online", prompt, row.output_tokens, max_tokens))
    for b in sc.bursts:
        for _ in range(b.count):
            specs.append((b.at, "batch", "batch", rng.randint(*b.prompt), rng.randint(*b.output),
                          sc.batch_max_tokens))
    specs.sort(key=lambda s: s[0])
    reqs = []
    for i, (at, tenant, klass, prompt, output, max_tokens) in enumerate(specs):
        # Without a cap the node may use the rest of the context, as vLLM does.
        cap = node.max_model_len - prompt if max_tokens is None else max_tokens
        reqs.append(Req(i, at, tenant, klass, prompt, output, max_tokens, min(output, cap),
                        _body(i, prompt, max_tokens, klass == "online")))
    return reqs
