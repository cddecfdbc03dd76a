"""vllm: read a vLLM node's KV usage, queues and KV capacity from its exposition.

Names: ``vllm:kv_cache_usage_perc`` (ratio 0..1; older releases ``vllm:gpu_cache_usage_perc``,
read only when the new name is absent), ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:num_preemptions_total``, ``vllm:cache_config_info``
(labels ``kv_cache_size_tokens`` or ``num_gpu_blocks`` and ``block_size``), and the prefix
cache's counters ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
(tokens; V1).

A data-parallel node exports one series per ``engine`` label value: usage is their mean
(each engine owns an equal share of the node's KV cache), queues are summed. Capacity:
``kv_cache_size_tokens`` is per engine and summed; ``num_gpu_blocks`` (releases without
``kv_cache_size_tokens``) is already the front end's sum over the engines, printed on every
engine's line, so it is read once (the largest line), not added up again.
When ``model_name`` is configured only series of that model count; without it, every
series on the node does.
"""

from __future__ import annotations

from extproc.signals.exposition import Index, Series
from extproc.signals.sample import MAX_COUNT, MAX_TOKENS, Findings, NodeSample

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"

WANTED = frozenset({KV_USAGE, KV_USAGE_OLD, WAITING, RUNNING, PREEMPTIONS, CACHE_INFO,
                    PREFIX_HITS, PREFIX_QUERIES})


def _of_model(series: list[Series], model_name: str | None) -> list[Series]:
    # Series without a model_name label (cache_config_info in V0) describe the whole node.
    if model_name is None:
        return series
    return [s for s in series if s.labels.get("model_name", model_name) == model_name]


def _sum_counts(f: Findings, series: list[Series], what: str) -> int | None:
    total = 0
    for s in series:
        n = f.count(s.value, what)
        if n is None:
            return None  # one unreadable engine makes the node's total unknown, not smaller
        total += n
    return min(total, MAX_COUNT)


def _capacity(f: Findings, series: list[Series]) -> int | None:
    """_capacity is the node's KV capacity in tokens from its cache_config_info lines."""
    per_engine: int | None = None  # sum of kv_cache_size_tokens over the engines
    node_total: int | None = None  # num_gpu_blocks * block_size: the node's total already
    for s in series:
        tokens = f.tokens(s.labels.get("kv_cache_size_tokens"), f"{CACHE_INFO} kv_cache_size_tokens")
        if tokens is not None:
            per_engine = (per_engine or 0) + tokens
            continue
        blocks = f.tokens(s.labels.get("num_gpu_blocks"), f"{CACHE_INFO} num_gpu_blocks")
        block_size = f.tokens(s.labels.get("block_size"), f"{CACHE_INFO} block_size")
        if blocks is not None and block_size is not None:
            node_total = max(node_total or 0, blocks * block_size)
    total = per_engine if per_engine is not None else node_total
    return None if total is None else min(total, MAX_TOKENS)


def _block(f: Findings, series: list[Series]) -> int | None:
    """_block is the node's KV block size in tokens from its cache_config_info lines: the
    largest its engines report (None: none does)."""
    sizes = [f.tokens(s.labels.get("block_size"), f"{CACHE_INFO} block_size") for s in series]
    known = [b for b in sizes if b is not None]
    return max(known) if known else None


def extract(index: Index, model_name: str | None) -> NodeSample:
    """extract reads one vLLM exposition (V0 or V1 names) into a ``NodeSample``."""
    f = Findings()
    name = KV_USAGE if KV_USAGE in index else KV_USAGE_OLD
    usages = _of_model(index.get(name, []), model_name)
    kv_usage: float | None = None
    if not usages:
        which = f" for model {model_name!r}" if model_name and name in index else ""
        f.missing(f"neither {KV_USAGE} nor {KV_USAGE_OLD}{which}")
    else:
        ratios = [f.ratio(s.value, name) for s in usages]
        readable = [r for r in ratios if r is not None]
        if len(readable) == len(ratios):
            kv_usage = sum(readable) / len(readable)
    queues: dict[str, int | None] = {}
    for metric in (WAITING, RUNNING):
        series = _of_model(index.get(metric, []), model_name)
        if not series:
            f.missing(metric)
            queues[metric] = None
        else:
            queues[metric] = _sum_counts(f, series, metric)
    preempt = _of_model(index.get(PREEMPTIONS, []), model_name)
    hits = _of_model(index.get(PREFIX_HITS, []), model_name)
    queries = _of_model(index.get(PREFIX_QUERIES, []), model_name)
    return f.sample(
        kv_usage=kv_usage,
        waiting=queues[WAITING],
        running=queues[RUNNING],
        preemptions_total=_sum_counts(f, preempt, PREEMPTIONS) if preempt else None,
        kv_capacity_tokens=_capacity(f, _of_model(index.get(CACHE_INFO, []), model_name)),
        block_tokens=_block(f, _of_model(index.get(CACHE_INFO, []), model_name)),
        prefix_hits=_sum_counts(f, hits, PREFIX_HITS) if hits else None,
        prefix_queries=_sum_counts(f, queries, PREFIX_QUERIES) if queries else None,
    )
