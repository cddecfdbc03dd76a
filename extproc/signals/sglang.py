"""sglang: read an SGLang node (``--enable-metrics``) from its exposition.

Names: ``sglang:token_usage`` (ratio 0..1), ``sglang:num_queue_reqs``,
``sglang:num_running_reqs``, ``sglang:max_total_num_tokens`` (KV capacity, tokens),
``sglang:num_retracted_requests_total`` (SGLang's preemptions; absent in older releases).

Series carry rank labels (``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and ``dp_rank`` with
data-parallel attention). Ranks of one data-parallel group report the same scheduler's
view, so within a group the largest value counts (not a sum, which would count the same
queue once per tensor-parallel rank); across ``dp_rank`` groups usage is averaged and
queues and capacity are summed, as for vLLM's engines.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.signals.exposition import Index, Series
from extproc.signals.sample import MAX_COUNT, MAX_TOKENS, Findings, NodeSample

TOKEN_USAGE = "sglang:token_usage"
WAITING = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
CAPACITY = "sglang:max_total_num_tokens"
PREEMPTIONS = "sglang:num_retracted_requests_total"

WANTED = frozenset({TOKEN_USAGE, WAITING, RUNNING, CAPACITY, PREEMPTIONS})


def _groups(series: list[Series], model_name: str | None) -> dict[str, list[Series]]:
    groups: dict[str, list[Series]] = {}
    for s in series:
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        groups.setdefault(s.labels.get("dp_rank", ""), []).append(s)
    return groups


def _per_group(f: Findings, groups: dict[str, list[Series]],
               check: Callable[[float, str], float | int | None], what: str) -> list[float | int] | None:
    # One value per dp group (the max over its ranks); None if any value is unreadable.
    values: list[float | int] = []
    for series in groups.values():
        checked = [check(s.value, what) for s in series]
        readable = [v for v in checked if v is not None]
        if len(readable) != len(checked):
            return None
        values.append(max(readable))
    return values


def extract(index: Index, model_name: str | None) -> NodeSample:
    """extract reads one SGLang exposition into a ``NodeSample``."""
    f = Findings()
    kv_usage: float | None = None
    usage_groups = _groups(index.get(TOKEN_USAGE, []), model_name)
    if not usage_groups:
        f.missing(TOKEN_USAGE + (f" for model {model_name!r}" if model_name and TOKEN_USAGE in index else ""))
    else:
        ratios = _per_group(f, usage_groups, f.ratio, TOKEN_USAGE)
        if ratios is not None:
            kv_usage = sum(ratios) / len(ratios)
    counts: dict[str, int | None] = {}
    for metric in (WAITING, RUNNING):
        groups = _groups(index.get(metric, []), model_name)
        if not groups:
            f.missing(metric)
            counts[metric] = None
            continue
        values = _per_group(f, groups, f.count, metric)
        counts[metric] = None if values is None else min(int(sum(values)), MAX_COUNT)
    preempt_groups = _groups(index.get(PREEMPTIONS, []), model_name)
    preempt = _per_group(f, preempt_groups, f.count, PREEMPTIONS) if preempt_groups else None
    capacity_groups = _groups(index.get(CAPACITY, []), model_name)
    capacity = _per_group(f, capacity_groups, f.tokens, CAPACITY) if capacity_groups else None
    return f.sample(
        kv_usage=kv_usage,
        waiting=counts[WAITING],
        running=counts[RUNNING],
        preemptions_total=None if preempt is None else min(int(sum(preempt)), MAX_COUNT),
        kv_capacity_tokens=None if capacity is None else min(int(sum(capacity)), MAX_TOKENS),
    )
