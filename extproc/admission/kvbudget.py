"""kvbudget: the in-flight KV-token budget, and what a request reserves of it.

A request holds KV-cache memory for its prompt and every token it generates, for as long
as it runs. The sum over admitted, unfinished requests of (prompt + reserved completion)
is kept within ``kv_budget × scale``: the guard against ten 32k-token requests arriving
together, which neither slots nor a per-minute bucket stop.

Class watermarks (``kv_watermark`` w < 1, e.g. on a sheddable batch class): a request of
such a class is admitted only while the pool's in-flight KV tokens, every class counted
and the request included, stay within ``floor(w × effective KV budget)``; classes with a
higher watermark may fill the rest. Why: a long-running class that may take the whole
budget holds it for minutes, and any shrink of the adaptive scale then leaves no room
for anyone else; below the watermark it can never hold the last ``1 - w`` of it, so
short requests of other classes still fit while it drains.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from extproc.admission.slots import scaled_floor


def reserved_completion(prompt_tokens: int, max_tokens: int | None, context_window: int,
                        default_max_tokens: int) -> int:
    """reserved_completion is the completion tokens reserved for a request.

    ``max_tokens`` (or ``max_completion_tokens``) when the request gives it; otherwise
    ``min(context_window - prompt_tokens, default_max_tokens)``, never below 0. All tokens.
    """
    if max_tokens is not None:
        return max_tokens if max_tokens > 0 else 0
    room = context_window - prompt_tokens
    return max(0, min(room, default_max_tokens))


def base_kv_budget(configured: int | None, capacity_tokens: int | None, fraction: float) -> int | None:
    """base_kv_budget is the pool's KV budget at scale 1.0, in tokens (None: unbounded).

    The configured ``kv_budget_tokens`` wins; otherwise ``floor(capacity × fraction)``
    of the KV capacity the nodes report; None when neither is known.
    """
    if configured is not None:
        return configured
    if capacity_tokens is None or capacity_tokens <= 0:
        return None
    return max(1, math.floor(capacity_tokens * fraction))


def effective_kv_budget(base: int | None, scale: float) -> int | None:
    """effective_kv_budget is the KV budget at ``scale``: floor(base × scale) tokens (None stays None)."""
    if base is None:
        return None
    return scaled_floor(base, scale)


def kv_ceilings(watermarks: Mapping[str, float], kv_budget: int | None,
                base_kv_budget: int | None) -> dict[str, tuple[int, int]]:
    """kv_ceilings is, per class with a watermark below 1, how far it may fill the KV budget.

    ``watermarks`` maps class names to ratios in (0, 1]; the budgets are the effective
    and the scale-1.0 KV budgets in tokens. Each class gets ``(floor(w × kv_budget),
    floor(w × base_kv_budget))`` tokens; nobody gets one without a KV budget.
    """
    if kv_budget is None or base_kv_budget is None:
        return {}
    return {name: (scaled_floor(kv_budget, w), scaled_floor(base_kv_budget, w))
            for name, w in watermarks.items() if w < 1.0}


class KvLedger:
    """KvLedger counts the KV tokens reserved by admitted, unfinished requests of one pool."""

    __slots__ = ("inflight",)

    def __init__(self) -> None:
        self.inflight = 0

    def take(self, tokens: int) -> int:
        """take reserves ``tokens``; returns the tokens in flight."""
        self.inflight += tokens
        return self.inflight

    def give(self, tokens: int) -> int:
        """give frees ``tokens`` reserved earlier; returns the tokens in flight."""
        if tokens > self.inflight:
            raise ValueError(f"cannot free {tokens} KV tokens, only {self.inflight} are in flight")
        self.inflight -= tokens
        return self.inflight
