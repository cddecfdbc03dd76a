"""vllm_rows: what bench_vllm runs: the vLLM engine's flags, the burst, the rows (straight to
vLLM, or through Envoy and kvgate on one of deploy/'s files) of each scenario, and the
burst's prompts built to exact token counts with the model's own tokenizer.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvgate_testkit.vllm import MAX_WAIT_S, EngineFlags

ROOT = Path(__file__).resolve().parents[1]
POOL_ENVOY = ROOT / "deploy" / "envoy.yaml"
PICKER_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker.yaml"
# The picker file whose ext_proc stream ends with the request: progress and the release come
# from Envoy's access log (periodic entries), the usage from its Lua filter.
PICKER_LOG_ENVOY = ROOT / "deploy" / "envoy-endpoint-picker-log.yaml"
ONE_TOKEN_WORD = re.compile(r"^ [a-z]{3,}$")


@dataclass(frozen=True, slots=True)
class Burst:
    """Burst is ``requests`` concurrent completions of ``prompt_tokens`` + ``max_tokens`` tokens."""

    requests: int = 10
    prompt_tokens: int = 1000
    max_tokens: int = 1000


@dataclass(frozen=True, slots=True)
class Row:
    """Row is one way to send the burst: ``envoy`` None sends it straight to vLLM."""

    key: str
    title: str
    envoy: Path | None = None
    picking: dict[str, Any] | None = None
    kv_budget_fraction: float = 0.9
    nodes: int = 1   # vLLM processes the row sends to; the burst is ``nodes`` x the base burst
    prompts: str = "distinct"   # "distinct" (nothing shared) or "shared" (one prefix, own questions)

    @property
    def freeze_at(self) -> float:
        """freeze_at is the KV usage (ratio) at which the row's burst is frozen for the check:
        high for the direct burst (requests then wait in vLLM too), lower through kvgate,
        which keeps usage near half the cache here."""
        return 0.75 if self.envoy is None else 0.25


ROWS = (
    Row("direct", "straight to vLLM"),
    Row("kvgate", "Envoy + kvgate, pool level (deploy/envoy.yaml)", POOL_ENVOY),
    Row("kvgate-budget-1.0", "the same, KV budget = all of vLLM's reported capacity",
        POOL_ENVOY, kv_budget_fraction=1.0),
    Row("picker-learned", "Envoy + kvgate picking the node, growth learned (q 0.9)",
        PICKER_ENVOY, {"growth": "learned", "quantile": 0.9}),
    Row("picker-worst_case", "Envoy + kvgate picking the node, growth worst_case",
        PICKER_ENVOY, {"growth": "worst_case"}),
    Row("direct-2", "straight to two vLLM processes, requests alternated between them", nodes=2),
    Row("picker-learned-2", "Envoy + kvgate picking between two vLLM processes, growth learned (q 0.9)",
        PICKER_ENVOY, {"growth": "learned", "quantile": 0.9}, nodes=2),
    Row("picker-log-learned", "the same picking, behind deploy/envoy-endpoint-picker-log.yaml",
        PICKER_LOG_ENVOY, {"growth": "learned", "quantile": 0.9}),
    Row("picker-log-learned-2", "the same picking between two vLLM processes, behind "
        "deploy/envoy-endpoint-picker-log.yaml", PICKER_LOG_ENVOY, {"growth": "learned", "quantile": 0.9}, nodes=2),
)


# Issue 29's burst on the real engine: one server of 32,768 usable KV tokens (1,025 blocks of
# 32, the null block among them), 12 requests at once of 10,200 prompt tokens + 800 generated.
# 16 sequences let all 12 run at once; 2,048 batched tokens is the default scenario's
# (prefills are chunked, decodes go on beside them).
PREFIX_FLAGS = EngineFlags(blocks=1025, block_size=32, max_model_len=16384, max_num_seqs=16,
                           max_num_batched_tokens=2048)


PREFIX_BURST = Burst(requests=12, prompt_tokens=10_200, max_tokens=800)


PREFIX_TOKENS = 10_000   # of each prompt, the same in every request of a "shared" row


PREFIX_MAX_WAIT_S = 30.0  # the class wait issue 29 measured with


PREFIX_ROWS = (
    Row("direct-shared", "straight to vLLM, one 10,000-token prefix + a 200-token question each",
        prompts="shared"),
    Row("kvgate-blind-shared", "Envoy + kvgate picking (deploy/envoy-endpoint-picker.yaml, picking "
        "defaults: shared_prefix false), the same prompts", PICKER_ENVOY, {}, prompts="shared"),
    Row("kvgate-prefix-shared", "the same with picking.shared_prefix: true", PICKER_ENVOY,
        {"shared_prefix": True}, prompts="shared"),
    Row("direct-unique", "straight to vLLM, 12 prompts of 10,200 tokens sharing nothing"),
    Row("kvgate-prefix-unique", "Envoy + kvgate, picking.shared_prefix: true, prompts sharing nothing",
        PICKER_ENVOY, {"shared_prefix": True}),
)


# Issue 29's targets: at most this many times its direct row's time (same prompts, same run).
PREFIX_MAX_RATIO = {"kvgate-prefix-shared": 1.25}


@dataclass(frozen=True, slots=True)
class Scenario:
    """Scenario is one engine's flags, its burst, the rows that send it and the report they
    make; ``prefix_tokens`` is the shared prefix of the rows whose prompts are "shared"."""

    key: str
    flags: EngineFlags
    burst: Burst
    rows: tuple[Row, ...]
    report: str                # file name in --out
    max_wait_s: float          # kvgate's class wait (s)
    prefix_tokens: int = 0
    frozen_check: bool = True  # freeze the engine once per row to compare kvgate's reading


SCENARIOS = {
    "default": Scenario("default", EngineFlags(), Burst(), ROWS, "vllm.md", MAX_WAIT_S),
    # No frozen check: the burst's own figures are the result here; readings are checked by default's.
    "prefix": Scenario("prefix", PREFIX_FLAGS, PREFIX_BURST, PREFIX_ROWS, "vllm-prefix.md",
                       PREFIX_MAX_WAIT_S, PREFIX_TOKENS, frozen_check=False),
}


def baseline(row: Row, rows: Sequence[Row]) -> Row | None:
    """baseline is the direct row that sends the same kind of prompts to as many engines
    (None for a direct row or where there is none)."""
    if row.envoy is None:
        return None
    return next((r for r in rows if r.envoy is None and r.prompts == row.prompts and r.nodes == row.nodes), None)


def burst_texts(tokenizer: Tokenizer, scenario: Scenario, row: Row, burst: Burst, seed: int) -> list[str]:
    """burst_texts are the row's prompts: distinct, or one shared prefix and a question each."""
    if row.prompts == "shared":
        return shared_prefix_prompts(tokenizer, burst, scenario.prefix_tokens, seed)
    return prompts(tokenizer, burst, seed)


def one_token_words(tokenizer: Tokenizer) -> list[str]:
    """one_token_words are the tokenizer's words (a space and 3+ letters) that are one token
    each, sorted; a run of them is as many tokens as words (the pre-split cuts before each space)."""
    decoded = (tokenizer.decode([i]) for i in tokenizer.get_vocab().values())
    words = sorted(w for w in decoded if ONE_TOKEN_WORD.match(w) and len(tokenizer.encode(w).ids) == 1)
    if len(words) < 100:
        raise RuntimeError(f"the tokenizer has only {len(words)} one-token words")
    return words


def _exact(tokenizer: Tokenizer, text: str, tokens: int) -> str:
    n = len(tokenizer.encode(text).ids)
    if n != tokens:
        raise RuntimeError(f"a prompt built of {tokens} one-token words is {n} tokens")
    return text


def prompts(tokenizer: Tokenizer, burst: Burst, seed: int) -> list[str]:
    """prompts builds one distinct prompt of exactly ``burst.prompt_tokens`` tokens per request.

    Each is a random sequence of words that are one token each, so that no two prompts
    share a KV block through vLLM's prefix cache. Exactness is checked with the tokenizer
    vLLM and kvgate both load.
    """
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    return [_exact(tokenizer, "".join(rng.choice(words) for _ in range(burst.prompt_tokens)), burst.prompt_tokens)
            for _ in range(burst.requests)]


def shared_prefix_prompts(tokenizer: Tokenizer, burst: Burst, prefix_tokens: int, seed: int) -> list[str]:
    """shared_prefix_prompts builds ``burst.requests`` prompts of exactly ``burst.prompt_tokens``
    tokens that all begin with the same ``prefix_tokens`` tokens (one random run of one-token
    words) and each end with a question of its own (the rest, its own random words).

    Completions prompts get no template and this tokenizer adds no special token, so the
    prefix is the first ``prefix_tokens`` of every request's token ids, for vLLM and kvgate
    alike: vLLM shares its whole blocks (``prefix_tokens // block`` of them). Exactness is
    checked with the tokenizer, for the prefix alone and for every prompt.
    """
    question_tokens = burst.prompt_tokens - prefix_tokens
    if prefix_tokens < 1 or question_tokens < 1:
        raise ValueError(f"a prefix of {prefix_tokens} tokens leaves no question in {burst.prompt_tokens}")
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    prefix = _exact(tokenizer, "".join(rng.choice(words) for _ in range(prefix_tokens)), prefix_tokens)
    return [_exact(tokenizer, prefix + "".join(rng.choice(words) for _ in range(question_tokens)),
                   burst.prompt_tokens)
            for _ in range(burst.requests)]


