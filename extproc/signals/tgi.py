"""tgi: read a Text Generation Inference router from its exposition.

Names: ``tgi_batch_current_max_tokens`` (tokens the running batch may reach),
``tgi_batch_max_total_tokens`` (the KV token budget TGI found at warm-up, tokens),
``tgi_queue_size``, ``tgi_batch_current_size``. TGI has no usage gauge: usage is taken
as current_max_tokens / max_total_tokens, TGI's own measure of how full its batch
budget is. TGI serves one model, so ``model_name`` filters nothing. It reports no
preemption counter.
"""

from __future__ import annotations

from extproc.signals.exposition import Index, Series
from extproc.signals.sample import Findings, NodeSample

CURRENT_MAX_TOKENS = "tgi_batch_current_max_tokens"
MAX_TOTAL_TOKENS = "tgi_batch_max_total_tokens"
WAITING = "tgi_queue_size"
RUNNING = "tgi_batch_current_size"

WANTED = frozenset({CURRENT_MAX_TOKENS, MAX_TOTAL_TOKENS, WAITING, RUNNING})


def _one(f: Findings, index: Index, name: str) -> Series | None:
    series = index.get(name, [])
    if not series:
        f.missing(name)
        return None
    # TGI's gauges carry no labels; several series would be an exposition we do not
    # understand, and the largest is the safe reading of a usage numerator.
    return max(series, key=lambda s: s.value)


def extract(index: Index, model_name: str | None) -> NodeSample:
    """extract reads one TGI exposition into a ``NodeSample``."""
    del model_name  # one model per TGI router
    f = Findings()
    current = _one(f, index, CURRENT_MAX_TOKENS)
    total = _one(f, index, MAX_TOTAL_TOKENS)
    capacity = f.tokens(total.value, MAX_TOTAL_TOKENS) if total is not None else None
    kv_usage: float | None = None
    if current is not None and capacity is not None:
        used = f.count(current.value, CURRENT_MAX_TOKENS)
        if used is not None:
            kv_usage = f.ratio(used / capacity, f"{CURRENT_MAX_TOKENS} / {MAX_TOTAL_TOKENS}")
    waiting = _one(f, index, WAITING)
    running = _one(f, index, RUNNING)
    return f.sample(
        kv_usage=kv_usage,
        waiting=f.count(waiting.value, WAITING) if waiting is not None else None,
        running=f.count(running.value, RUNNING) if running is not None else None,
        kv_capacity_tokens=capacity,
    )
