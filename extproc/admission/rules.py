"""rules: THE admission rule, a pure function of a plan and a pool's state.

Every store applies ``decide`` (the in-memory store calls it; a shared store mirrors it
in one atomic script), so the rule is written once and tested alone. The order of the
checks decides which budget a refusal names:

1. never fits (not retryable): tokens above the KV budget, the class's KV ceiling or a
   bucket's capacity at scale 1.0;
2. concurrency slots (``slots.slot_refusal``);
3. in-flight KV tokens: the pool's KV budget, then the ceiling of the plan's class
   (``kv_watermark`` below 1: the class may fill the budget only up to
   ``floor(w × budget)``, every class's tokens counted; see ``kvbudget``);
4. the tenant's bucket, then the pool's bucket.

Every budget that refuses is checked, and the refusal's retry delay is the longest of
theirs: a client that waits that long is not refused again by another budget at once.

A pool that picks nodes adds a per-node rule, checked before the store's (``pick_node``):
a node fits a request when, with C its capacity and r the reserve,

    foreign + sum(hold of kvgate's requests on it) + hold(new) <= floor(C x (1 - r))

where ``foreign`` is the KV the node reported that kvgate did not admit (``nodes``), and a
request's hold is its prompt + tokens generated so far + the growth still to come
(``node_hold``). A class with a KV watermark w < 1 fits only within floor(w' x C x (1 - r)),
w' = min(1, w / (1 - r)) (``node_watermark``): the class fills at most w of the node's
whole capacity. ``pick_node``, ``choose_node``'s callers and the Redis store's script all
take w', never w.
With pooled growth the growth to come is bounded for the node's requests together
(``pooled_growth``), and a new request needs what it adds to that bound.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from extproc.admission.bucket import FIT_SLACK, wait_for
from extproc.admission.slots import slot_refusal
from extproc.admission.types import Budget, BucketSpec, Plan, Refusal


def _bucket_wait(n: int, tokens: float, spec: BucketSpec, estimate: float) -> float:
    """_bucket_wait is the wait (s) until ``n`` fits; above the scaled capacity, a refill's worth."""
    w = wait_for(n, tokens, spec.capacity, spec.rate)
    if w == math.inf:
        # Fits at scale 1.0 but not now: it waits for the scale to recover, which no
        # bucket can time; the refill of the missing tokens is a lower bound.
        w = max(estimate, (n - tokens) / spec.rate)
    return w


def decide(plan: Plan, inflight: int, by_class: Mapping[str, int], kv_inflight: int,
           pool_tokens: float | None, tenant_tokens: float | None) -> Refusal | None:
    """decide admits ``plan`` (None) or says which budget refuses it (a ``Refusal``).

    State, as of the decision's instant: ``inflight`` slots in use in the pool,
    ``by_class`` the same per class, ``kv_inflight`` reserved KV tokens, and the tokens in
    the pool's and the tenant's buckets after refill and after applying the plan's
    capacities (None when the plan has no such bucket). Nothing is changed.
    """
    limits = plan.limits
    n = plan.tokens
    pb = limits.bucket
    tb = plan.tenant_bucket
    # 1. Never fits: more than a budget holds even at full scale.
    if limits.base_kv_budget is not None and n > limits.base_kv_budget:
        return Refusal(Budget.KV, 0.0, False, n, kv_inflight, limits.base_kv_budget)
    ceilings = limits.kv_ceilings
    ceiling = ceilings.get(plan.class_name) if ceilings else None
    if ceiling is not None and n > ceiling[1]:
        return Refusal(Budget.CLASS_KV, 0.0, False, n, kv_inflight, ceiling[1])
    if tb is not None and n > tb.base_capacity + FIT_SLACK:
        return Refusal(Budget.TENANT_TPM, 0.0, False, n, 0, tb.base_capacity)
    if pb is not None and n > pb.base_capacity + FIT_SLACK:
        return Refusal(Budget.POOL_TPM, 0.0, False, n, 0, pb.base_capacity)

    first: Refusal | None = None
    wait = 0.0
    estimate = limits.retry_estimate_s
    slots = slot_refusal(inflight, by_class, plan.class_name, limits.limit, limits.guarantees)
    if slots is not None:
        first = Refusal(slots, estimate, True, 1, inflight, limits.limit)
        wait = estimate
    kv = limits.kv_budget
    if kv is not None and kv_inflight + n > kv:
        if first is None:
            first = Refusal(Budget.KV, estimate, True, n, kv_inflight, kv)
        wait = estimate
    elif ceiling is not None and kv_inflight + n > ceiling[0]:
        if first is None:
            first = Refusal(Budget.CLASS_KV, estimate, True, n, kv_inflight, ceiling[0])
        wait = estimate
    if tb is not None and tenant_tokens is not None and n > tenant_tokens + FIT_SLACK:
        w = _bucket_wait(n, tenant_tokens, tb, estimate)
        if first is None:
            first = Refusal(Budget.TENANT_TPM, w, True, n, tenant_tokens, tb.capacity)
        wait = max(wait, w)
    if pb is not None and pool_tokens is not None and n > pool_tokens + FIT_SLACK:
        w = _bucket_wait(n, pool_tokens, pb, estimate)
        if first is None:
            first = Refusal(Budget.POOL_TPM, w, True, n, pool_tokens, pb.capacity)
        wait = max(wait, w)
    if first is None:
        return None
    if wait != first.retry_after_s:
        first = Refusal(first.budget, wait, True, first.needed, first.used, first.limit)
    return first


def _seconds(s: float) -> str:
    if s < 1.0:
        return f"{max(1, math.ceil(s * 1000))}ms"
    return f"{s:.1f}s"


def message(refusal: Refusal, plan: Plan) -> str:
    """message words a refusal for the client: the budget, the numbers, when to retry.

    Names in it are configured pool and tenant names, never raw request input.
    """
    pool = plan.limits.pool
    b = refusal.budget
    if not refusal.retryable:
        if b is Budget.KV:
            what = f"the in-flight KV-token budget of pool '{pool}' ({int(refusal.limit)} tokens)"
        elif b is Budget.CLASS_KV:
            what = (f"the part of the in-flight KV-token budget of pool '{pool}' that class "
                    f"'{plan.class_name}' may fill ({int(refusal.limit)} tokens)")
        elif b is Budget.TENANT_TPM:
            what = f"the tokens-per-minute limit of tenant '{plan.tenant}' ({int(refusal.limit)} tokens)"
        elif b is Budget.NODE_KV:
            what = (f"the KV cache kvgate fills on the largest node of pool '{pool}' "
                    f"({int(refusal.limit)} tokens)")
        else:
            what = f"the tokens-per-minute limit of pool '{pool}' ({int(refusal.limit)} tokens)"
        return (f"This request needs {int(refusal.needed)} tokens (prompt + max_tokens), more than "
                f"{what}: it can never be admitted. Lower max_tokens or shorten the prompt.")
    retry = _seconds(refusal.retry_after_s)
    if b is Budget.SLOTS:
        return (f"Too many concurrent requests on pool '{pool}': {int(refusal.used)} of "
                f"{int(refusal.limit)} concurrency slots are in use. Please retry after {retry}.")
    if b is Budget.RESERVED_SLOTS:
        return (f"Too many concurrent requests on pool '{pool}': the free concurrency slots are "
                f"guaranteed to other classes. Please retry after {retry}.")
    if b is Budget.FAIR_SHARE:
        return (f"Pool '{pool}' is full across its gateway replicas: this one holds {int(refusal.used)} "
                f"of its requests and leaves the room that frees to a replica holding "
                f"{int(refusal.limit)} whose requests wait for it. Please retry after {retry}.")
    if b is Budget.KV:
        return (f"The in-flight KV-token budget of pool '{pool}' is full: this request needs "
                f"{int(refusal.needed)} tokens, {int(refusal.used)} of {int(refusal.limit)} are in use. "
                f"Please retry after {retry}.")
    if b is Budget.NODE_KV:
        return (f"No node of pool '{pool}' has room in its KV cache for this request now: it "
                f"needs {int(refusal.needed)} tokens, the node with the most room has "
                f"{max(0, int(refusal.used))} free. Please retry after {retry}.")
    if b is Budget.CLASS_KV:
        return (f"Requests of class '{plan.class_name}' may fill the in-flight KV-token budget of "
                f"pool '{pool}' only up to {int(refusal.limit)} tokens (the rest is kept for other "
                f"classes): this request needs {int(refusal.needed)} tokens, {int(refusal.used)} are "
                f"in use. Please retry after {retry}.")
    whose = f"tenant '{plan.tenant}'" if b is Budget.TENANT_TPM else f"pool '{pool}'"
    return (f"Rate limit reached for tokens per minute (TPM) on {whose}: limit {int(refusal.limit)}, "
            f"available {max(0, int(refusal.used))}, requested {int(refusal.needed)}. "
            f"Please retry after {retry}.")


def shed_message(pool: str, class_name: str, retry_after_s: float) -> str:
    """shed_message words a refusal by load shedding for the client."""
    return (f"Pool '{pool}' is overloaded (KV cache at or above its high watermark, or its "
            f"metrics are stale): requests of class '{class_name}' are shed first. "
            f"Please retry after {_seconds(retry_after_s)}.")


_BUDGET_WORDS = {
    Budget.SLOTS: "a concurrency slot",
    Budget.RESERVED_SLOTS: "a concurrency slot",
    Budget.FAIR_SHARE: "room that another gateway replica's requests wait for",
    Budget.KV: "room in the in-flight KV-token budget",
    Budget.CLASS_KV: "room in the part of the in-flight KV-token budget their class may fill",
    Budget.POOL_TPM: "tokens of the tokens-per-minute limit",
    Budget.TENANT_TPM: "tokens of the tokens-per-minute limit",
    Budget.NODE_KV: "a node with room in its KV cache",
}


def queued_message(refusal: Refusal, plan: Plan) -> str:
    """queued_message words a refusal because earlier requests wait for the same budget first.

    ``refusal`` is the waiting request's; the numbers in it are not this request's, so
    the message names the budget and the order, not amounts.
    """
    whose = (f"tenant '{plan.tenant}'" if refusal.budget is Budget.TENANT_TPM
             else f"pool '{plan.limits.pool}'")
    return (f"Requests queued earlier on {whose} are waiting for {_BUDGET_WORDS[refusal.budget]}, "
            f"and this request may not go ahead of them. Please retry after "
            f"{_seconds(refusal.retry_after_s)}.")


# --- nodes ------------------------------------------------------------------------------

def expected_growth(reserved: int, generated: int, lengths: Sequence[int] | None,
                    quantile: float) -> int:
    """expected_growth is how many more tokens a request is expected to generate.

    ``reserved`` is its completion reservation and ``generated`` what it produced so far
    (tokens). With ``lengths`` None (the worst case, or nothing learned yet) it is the rest
    of the reservation. Otherwise ``lengths`` are settled completion lengths of its class,
    sorted: among those above ``generated`` (requests that ran at least as long), the
    ``quantile`` one, minus ``generated``; never above the rest of the reservation. A
    request longer than every length learned gets the worst case: nothing says when it
    stops.
    """
    left = reserved - generated
    if left <= 0:
        return 0
    if lengths is None:
        return left
    first = bisect.bisect_right(lengths, generated)
    above = len(lengths) - first
    if above == 0:
        return left
    k = first + min(above - 1, max(0, math.ceil(quantile * above) - 1))
    return min(left, lengths[k] - generated)


def growth_moments(reserved: int, generated: int, lengths: Sequence[int] | None,
                   prefix: tuple[Sequence[float], Sequence[float]] | None) -> tuple[int, float, float]:
    """growth_moments is what a request may still generate: (the rest of its reservation,
    the mean and the variance of its remaining growth), in tokens and tokens squared.

    Among the settled ``lengths`` of its class (sorted) above ``generated``, each stands for
    a way the request may end: min(length, ``reserved``) - generated. ``prefix`` holds the
    running sums of the lengths and of their squares (``prefix[0][i]`` = sum of the first i).
    Nothing learned, or a request longer than every length learned: the rest of the
    reservation, with no spread (nothing says when it stops).
    """
    left = reserved - generated
    if left <= 0:
        return 0, 0.0, 0.0
    if lengths is None or prefix is None:
        return left, float(left), 0.0
    n = len(lengths)
    a = bisect.bisect_right(lengths, generated)
    if a == n:
        return left, float(left), 0.0
    b = max(a, bisect.bisect_left(lengths, reserved))   # lengths in [a, b) stop before the reservation
    s1, s2 = prefix
    stop1, stop2, k = s1[b] - s1[a], s2[b] - s2[a], b - a
    g, capped = float(generated), n - b
    total = stop1 - k * g + capped * left
    squares = stop2 - 2 * g * stop1 + k * g * g + capped * float(left) ** 2
    m = n - a
    mean = total / m
    return left, mean, max(0.0, squares / m - mean * mean)


def pooled_growth(moments: Iterable[tuple[int, float, float]], quantile: float) -> int:
    """pooled_growth bounds how many more tokens a node's requests generate together (tokens).

    The ``quantile`` of their summed growth, taken as normal: sum of means + z x the square
    root of the summed variances (z the standard normal's quantile); never above the sum of
    their rests of reservation. Far below the sum of each request's own quantile: requests
    that end late and requests that end early offset each other. ``moments`` are
    ``growth_moments`` of each request.
    """
    left, mean, var = 0, 0.0, 0.0
    for lft, m, v in moments:
        left += lft
        mean += m
        var += v
    return pooled_bound(left, mean, var, quantile)


def pooled_bound(left: int, mean: float, var: float, quantile: float) -> int:
    """pooled_bound is ``pooled_growth`` from the moments' sums: ``left`` the rests of
    reservation (tokens), ``mean`` and ``var`` the growths' means and variances (tokens,
    tokens squared; a sum kept as requests come and go may be a hair below 0)."""
    if quantile >= 1.0 or left <= 0:
        return max(0, left)
    bound = mean + z_of(quantile) * math.sqrt(max(0.0, var))
    return min(left, max(0, math.ceil(bound - 1e-9)))


@functools.lru_cache(maxsize=16)
def z_of(quantile: float) -> float:
    """z_of is the standard normal's ``quantile`` (below 1): the z of ``pooled_bound``, which
    the Redis admit script is handed rather than computing it."""
    return NormalDist().inv_cdf(quantile)


def node_hold(prompt: int, reserved: int, generated: int, lengths: Sequence[int] | None,
              quantile: float) -> int:
    """node_hold is the KV tokens a request is expected to hold on its node at most.

    prompt + generated so far + ``expected_growth``; at most prompt + reserved.
    """
    return prompt + generated + expected_growth(reserved, generated, lengths, quantile)


def effective_capacity(capacity: int, reserve_fraction: float) -> int:
    """effective_capacity is the part of a node's KV capacity kvgate fills: floor(C x (1 - r))."""
    return max(0, math.floor(capacity * (1.0 - reserve_fraction)))


def node_watermark(watermark: float, reserve_fraction: float) -> float:
    """node_watermark is a class's ``kv_watermark`` w as the share of a node's effective
    capacity that the per-node rule applies: w / (1 - reserve_fraction), at most 1 (w itself
    at 1 or above: no watermark).

    So the class fills at most w of the node's whole capacity. The reserve and the
    watermark both keep part of a node free; below 1 - reserve the watermark's part
    already holds the reserve, and cutting it by the reserve again would shrink the class
    by that share for nothing (a node of 32k tokens with a reserve of 0.1 would take one
    10k-token document of a class at 0.7 where it has room for two).
    """
    if watermark >= 1.0:
        return watermark
    return min(1.0, watermark / (1.0 - reserve_fraction))


def node_headroom(capacity: int, reserve_fraction: float, foreign: int, held: int) -> int:
    """node_headroom is the room left on a node for one more request, in tokens (may be < 0).

    ``foreign``: KV the node holds that kvgate did not admit; ``held``: what kvgate's own
    requests there are expected to hold at most (sum of ``node_hold``).
    """
    return effective_capacity(capacity, reserve_fraction) - foreign - held


@dataclass(slots=True)
class NodePass:
    """NodePass is the result of ``pick_node``: the chosen node, and why the others were not.

    ``chosen`` is None when no node fits; ``passed`` lists (node, reason) with reason
    ``no_room`` or ``class_watermark``; ``best_room`` is the most room any candidate has
    (tokens, None without candidates); ``by_watermark`` is True when some node had room but
    not within the class's watermark; ``by_affinity`` is True when an affinity bonus chose
    another node than the most room would have; ``fitting`` lists (score, node) of every
    node that fits, in candidate order (score: room plus affinity, tokens).
    """

    chosen: str | None
    passed: list[tuple[str, str]] = field(default_factory=list)
    best_room: int | None = None
    need: int = 0
    by_watermark: bool = False
    by_affinity: bool = False
    fitting: list[tuple[int, str]] = field(default_factory=list)

    def next_best(self, most: int) -> list[str]:
        """next_best is up to ``most`` nodes that fit besides the one chosen, the best score
        first (ties in candidate order, as the choice breaks them): the fallbacks to name."""
        if most <= 0:
            return []
        ranked = sorted(((-score, i, name) for i, (score, name) in enumerate(self.fitting)
                         if name != self.chosen))
        return [name for _s, _i, name in ranked[:most]]


def pick_node(candidates: Sequence[tuple[str, int | None, int, int]], need: int,
              reserve_fraction: float, watermark: float,
              affinity: Mapping[str, int] | None = None, last: frozenset[str] = frozenset()) -> NodePass:
    """pick_node picks, among candidate nodes, the one with the most room that fits ``need``.

    Each candidate is (name, capacity, foreign, held) in tokens, in a stable order (ties
    go to the first, so callers order by preference). A node fits when ``need`` is within
    its headroom and, for a ``watermark`` w' < 1 (``node_watermark`` of the class's), within
    floor(w' x effective capacity) - foreign - held. ``affinity``: tokens added to a node's room when ranking the nodes that
    fit, never when fitting (a prefix cached there; missing: 0). ``last``: nodes chosen only
    when no other fits (``choose_node``). Nothing is changed.
    """
    rooms = []
    for name, capacity, foreign, held in candidates:
        if capacity is None:
            continue
        class_room = None if watermark >= 1.0 else \
            math.floor(watermark * effective_capacity(capacity, reserve_fraction)) - foreign - held
        rooms.append((name, node_headroom(capacity, reserve_fraction, foreign, held), class_room))
    return choose_node(rooms, need, affinity, last)


def choose_node(rooms: Iterable[tuple[str, int, int | None]], need: int,
                affinity: Mapping[str, int] | None = None, last: frozenset[str] = frozenset()) -> NodePass:
    """choose_node picks the node with the most room that fits ``need`` (tokens): the walk of
    every per-node rule, whatever works out each node's room.

    Each entry is (name, room, class_room) in tokens, in order of preference (ties go to
    the first): ``room`` the node's room for one more request, ``class_room`` its room
    within the class's watermark (None: no watermark). ``affinity``: see ``pick_node``.
    ``last``: nodes chosen only when no other fits (where another replica's waiting request
    gathers room, ``store.fairshare``). Nothing is changed.
    """
    verdict = NodePass(chosen=None, need=need)
    best: int | None = None
    last_best: tuple[int, str] | None = None
    last_roomiest: tuple[int, str] | None = None
    roomiest: tuple[int, str] | None = None
    for name, room, class_room in rooms:
        if verdict.best_room is None or room > verdict.best_room:
            verdict.best_room = room
        if need > room:
            verdict.passed.append((name, "no_room"))
            continue
        if class_room is not None and need > class_room:
            verdict.passed.append((name, "class_watermark"))
            verdict.by_watermark = True
            continue
        score = room + (affinity.get(name, 0) if affinity else 0)
        verdict.fitting.append((score, name))
        if name in last:
            if last_roomiest is None or room > last_roomiest[0]:
                last_roomiest = (room, name)
            if last_best is None or score > last_best[0]:
                last_best = (score, name)
            continue
        if roomiest is None or room > roomiest[0]:
            roomiest = (room, name)
        if best is None or score > best:
            best, verdict.chosen = score, name
    if verdict.chosen is None and last_best is not None:
        verdict.chosen, roomiest = last_best[1], last_roomiest
    verdict.by_affinity = roomiest is not None and verdict.chosen != roomiest[1]
    return verdict
