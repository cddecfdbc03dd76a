"""nodes: what kvgate knows of each node of a pool that picks nodes, and the charges it holds there.

A pool picks nodes when every backend has an ``address`` (``PoolConfig.picks``). Each
node then has a ledger: its KV capacity (configured, or as reported), its last report
(KV usage, when it was read) and the requests kvgate admitted to it, each a ``Charge``
(prompt, reserved completion, tokens generated so far as seen on the response stream).
``rules.node_hold`` and ``rules.node_headroom`` turn that into the node's room;
``PoolNodes.pick`` charges the node with the most room that fits a request.

How a node counts kvgate's requests once, and reads foreign KV's rise: ``extproc.admission.node``;
what a request is expected to grow to, by the lengths its class learned: ``extproc.admission.growth``.

What a pick reads. A node keeps the sums of its charges' footprints and expected holds,
changed as a charge comes, progresses, moves or goes, so a pick costs the same whatever
the requests held (a walk of them per pick grew with them: bench/results/pick.md). A
charge's expected growth follows the lengths its class had
learned when it was admitted or last progressed; a length learned reaches the others from
the next scrape round (``mark``) on, RECOUNT_PER_ROUND charges a round (a round, once a
second on the event loop, recounted every charge held, a stall that grew with them:
bench/results/pick-rounds.md); a charge whose count does not change is
not touched.

Everything runs on the event-loop thread; times are seconds on the admission clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from extproc.admission import rules
from extproc.admission.growth import GrowthRule
from extproc.admission.node import Charge, Moments, Node, NodeState, PassedOver
from extproc.admission.retry import MAX_WAIT_S, HoldTimes, expected_wait, own_share
from extproc.admission.shared_nodes import Candidate, NodeAsk, Pooled
from extproc.admission.types import Chain, NodeReport
from extproc.config import PickingConfig, PoolConfig

# Admission-to-first-token times remembered to learn when a request is surely prefilled.
FIRST_TOKEN_SAMPLES = 200
# The charges a scrape round recounts at most with the lengths learned since the last pass;
# the rest follow in the next rounds, oldest first.
RECOUNT_PER_ROUND = 1024
# What a node's KV events say it caches of a prompt (``extproc.signals.kv_events``): tokens,
# and whether that is exact (the view is complete); None where the node's events are not read.
Seen = Callable[[str], "tuple[int, bool] | None"]


def cached_guess(recorded: int, seen: tuple[int, bool] | None) -> int:
    """cached_guess is the tokens of a prompt a node is taken to cache, for placement: what its
    KV events say where they are exact, the larger of that and kvgate's ``recorded`` guess
    where they may miss blocks, the guess alone without events (``seen`` None)."""
    if seen is None:
        return recorded
    tokens, exact = seen
    return tokens if exact else max(tokens, recorded)


def allows(among: frozenset[str] | None, address: str) -> bool:
    """allows tells whether a node at ``address`` (``HOST:PORT``) is within ``among``, the
    endpoints the proxy allows for a request (None allows all): an entry is ``host:port``,
    or a bare host that allows every port of it."""
    if among is None or address in among:
        return True
    host, sep, _ = address.rpartition(":")
    return bool(sep) and host in among


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """NodeSnapshot is one node's state for metrics: tokens, room and counts.

    ``inflight_tokens``: footprint now of kvgate's requests on it; ``held_tokens``: what
    they are expected to hold at most (footprint + growth to come); ``headroom_tokens``:
    room left for a new request (None: unknown capacity or report); ``foreign_tokens``: KV
    the node reported that kvgate did not admit (and what that report subtracted of
    kvgate's requests ended since, ``Node.kept``); ``shared_tokens``: of the inflight
    tokens, those of prompt prefixes counted once (``Node.shared``); ``picks``,
    ``affinity_picks`` (picks its cached prefix won against a roomier node),
    ``prompt_tokens`` (of the requests sent there), ``credit_tokens`` (of those, shared
    with requests running there when sent: kvgate's estimate of the node's prefix hits)
    and ``passed_over`` are cumulative counts.
    """

    name: str
    address: str
    state: NodeState
    requests: int
    inflight_tokens: int
    held_tokens: int
    foreign_tokens: int
    capacity_tokens: int | None
    headroom_tokens: int | None
    kv_usage: float | None
    picks: int
    passed_over: dict[str, int] = field(default_factory=dict)
    shared_tokens: int = 0
    affinity_picks: int = 0
    prompt_tokens: int = 0
    credit_tokens: int = 0


def shared_short(need: int, n: Node, own: int, every: int, reserve_fraction: float, horizon_s: float,
                 now: float) -> int:
    """shared_short is what this replica's requests on node ``n`` must free (tokens) for
    ``need`` to fit there beside other replicas, at ``now``: the node's room is its capacity
    less its foreign KV net of the others' requests (with the rise over ``horizon_s``) and
    less ``every`` replica's holds there (a shared store's last reading; at least this
    replica's ``own``); this replica's requests are taken to free their share of what is
    missing, the others' requests being like them (all of it when this replica holds
    nothing there: its requests cannot tell). A replica's own holds alone show rooms the
    others' have taken, and a refused client sent back at once spends its retries before
    the room comes back."""
    every = max(own, every)
    room = rules.node_headroom(n.capacity or 0, reserve_fraction, n.net + n.kept + n.rise_ahead(horizon_s, now), every)
    return own_share(need - room, own, every)


class PoolNodes:
    """PoolNodes holds the nodes of one picking pool and picks one for each request.

    ``stale_after_s``: a node without a report for this long is not picked (seconds).
    ``poke(node)``, when set, asks for an early scrape of a node whose last report
    subtracted a charge released since (its ``kept`` just turned non-zero): that report
    counts it twice, where the node held it, until the next one. It must return at once
    (the server's hands the node to the scraper's thread, ``Scraper.poke``).
    """

    def __init__(self, config: PoolConfig, stale_after_s: float) -> None:
        self.nodes: dict[str, Node] = {}
        self.picking: PickingConfig = config.picking
        self.stale_after_s = stale_after_s
        self.growth = GrowthRule(config.picking)
        self.holds = HoldTimes()
        # Seconds from admission to the first token of the latest requests that streamed one.
        self.first_tokens: deque[float] = deque(maxlen=FIRST_TOKEN_SAMPLES)
        self._turn = 0  # rotates the order in which equal nodes are offered
        self._recount: list[Charge] = []  # the charges this pass has still to recount, last first
        self.poke: Callable[[str], None] | None = None
        self.reconfigure(config, stale_after_s)

    def reconfigure(self, config: PoolConfig, stale_after_s: float) -> None:
        """reconfigure follows a reload: unchanged nodes keep their ledger, new ones start pending.

        A node removed by the reload is no longer picked; its charges stay valid and are
        released as their requests end.
        """
        self.picking = self.growth.picking = config.picking
        self.stale_after_s = stale_after_s
        nodes: dict[str, Node] = {}
        block = config.picking.block_tokens
        for b in config.backends:
            old = self.nodes.get(b.name)
            if old is not None and old.address == b.address:
                old.configured_capacity = b.kv_capacity_tokens
                if old.reported_block is None and old.prefixes.block != block:
                    old.count_prefixes(block)
                nodes[b.name] = old
            else:
                nodes[b.name] = Node(b, block)
        self.nodes = nodes
        self.relearn()  # the growth rule or its quantile may have changed

    def relearn(self) -> None:
        """relearn counts every charge of every node again with the lengths learned now, all at
        once (a reload: the growth rule or its quantile may have changed)."""
        self.growth.taught = False
        self._recount = [c for n in self.nodes.values() for c in n.charges]
        self._recount_some(len(self._recount))

    def _recount_some(self, most: int) -> None:
        """_recount_some recounts up to ``most`` charges of the pass under way with the lengths
        learned now; a charge released since is passed over, one moved is recounted where it
        is, and one whose count comes out the same is left as it is."""
        todo = self._recount
        for _ in range(min(most, len(todo))):
            c = todo.pop()
            n = c.node
            if not c.held or c not in n.charges:
                continue
            own, moments = self.growth.expect(c.class_name, c.prompt, c.reserved, c.generated)
            if own != c.own or moments != c.moments:
                n.count_again(c, c.generated, own, moments)

    # --- reports -------------------------------------------------------------------

    def mark(self, mark: int, now: float, since: float | None = None, only: set[str] | None = None) -> None:
        """mark starts a scrape round at ``now``, ``since`` being the store's instant of the latest
        answer received (None: none; see ``Node.mark``): see the module doc. ``only``: the
        nodes an early round scrapes, marked alone (the rounds' recount is left to them)."""
        settle = self.settle_s()
        if only is not None:
            for name in only:
                if name in self.nodes:
                    self.nodes[name].mark(mark, now, settle, since)
            return
        for n in self.nodes.values():
            n.mark(mark, now, settle, since)
        if self.growth.taught and not self._recount:  # a pass over every charge held, oldest first
            self.growth.taught = False
            self._recount = [c for n in self.nodes.values() for c in reversed(n.charges)]
        if self._recount:
            self._recount_some(RECOUNT_PER_ROUND)

    def settle_s(self) -> float | None:
        """settle_s is how long a request is held before the node has it in its cache, first
        token seen or not, unless the node queues it: the median of the latest
        admission-to-first-token times (seconds; None before any first token was seen). Not
        the longest: one slow stream would keep every document counted twice."""
        if not self.first_tokens:
            return None
        return sorted(self.first_tokens)[len(self.first_tokens) // 2]

    def report(self, name: str, r: NodeReport,
               others: Callable[[str, float | None, bool], int] | None = None) -> bool:
        """report hands one node's scrape in, with what the other replicas published of their
        requests per node (``Store.others_seen``; None: no others); False for a node not
        configured (any more)."""
        n = self.nodes.get(name)
        if n is None:
            return False
        n.report(r, None if others is None else lambda since, idle: others(name, since, idle))
        return True

    # --- the rule ------------------------------------------------------------------

    def held(self, n: Node, extra: tuple[str, int, int] | None = None) -> int:
        """held is what kvgate's charges on ``n`` are expected to hold at most (``GrowthRule.held``)."""
        return self.growth.held(n, extra)

    def headroom(self, n: Node, now: float) -> int | None:
        """headroom is the room left on ``n`` for a new request at ``now`` (tokens; None:
        capacity unknown)."""
        cap = n.capacity
        if cap is None:
            return None
        return rules.node_headroom(cap, self.picking.reserve_fraction,
                                   n.foreign_ahead(self._horizon_s(), now), self.held(n))

    def _horizon_s(self) -> float:
        """_horizon_s is how long a request admitted now typically holds its node (s; 0 before any ended)."""
        return self.holds.median() or 0.0

    def _eligible_in_turn(self, among: frozenset[str] | None, now: float) -> list[tuple[Node, int]]:
        """_eligible_in_turn is the nodes a request may go to, with their capacities, in the
        order of preference before room (fewer of kvgate's requests first, the rest in
        turn): up, of known capacity, and allowed by ``among``. The others are counted as
        passed over, for their state."""
        order = [n for n in self.nodes.values() if allows(among, n.address)]
        turn = self._turn % len(order) if order else 0
        self._turn += 1
        eligible: list[tuple[Node, int]] = []
        for n in sorted(order[turn:] + order[:turn], key=lambda n: len(n.charges)):
            state = n.state(now, self.stale_after_s)
            if state is not NodeState.UP:
                n.pass_over(PassedOver(state.value))
            elif n.capacity is None:
                n.pass_over(PassedOver.NO_CAPACITY)
            else:
                eligible.append((n, n.capacity))
        return eligible

    def pick(self, class_name: str, prompt: int, reserved: int, watermark: float,
             now: float, among: frozenset[str] | None = None,
             chain: Chain | None = None, seen: Seen | None = None) -> Charge | rules.NodePass:
        """pick charges the node with the most room that fits the request, or says why none does.

        ``watermark`` is the class's ``kv_watermark`` (the share of a node's capacity up to
        which requests of the class may fill it). Nodes that are pending, stale or down are
        never picked. Ties go to the node with fewer of kvgate's requests, then to the next
        in turn (so equal idle nodes share light traffic instead of the first taking it all).
        ``among``: the endpoints the proxy allows (see ``allows``; None: all);
        nodes outside it are not considered (nor counted as passed over). ``chain``: the
        prompt's prefix chain (None: none); on a node whose requests share part of it the
        request needs that much less (``Prefixes.credit``). ``seen``: per node, what its KV
        events say it caches of the prompt (None: no events read): where exact it ranks the
        node instead of kvgate's record, where partial beside it (``cached_guess``).
        """
        need = self.growth.hold(prompt, reserved, 0, class_name)
        if not self.picking.shared_prefix:
            chain = None
        candidates: list[tuple[str, int | None, int, int]] = []
        affinity: dict[str, int] = {}
        credits: dict[str, int] = {}
        horizon = self._horizon_s()
        for n, cap in self._eligible_in_turn(among, now):
            held = self.held(n)
            if self.growth.pooled:
                # What the request adds to the node's pooled bound is its need there: handed
                # to pick_node as held + need, whose sum is the bound with the request.
                held = self.held(n, (class_name, prompt, reserved)) - need
            # Handed to pick_node as less held, since its need is one for every node.
            credit = min(prompt, n.prefixes.credit(chain))
            held -= credit
            if credit:
                credits[n.name] = credit
            # Ranked by what its cache holds (its events) or may hold (running or recently
            # ended); fitted by credit alone.
            guess = n.cached(chain)
            if seen is not None:
                guess = cached_guess(guess, seen(n.name))
            bonus = max(credit, min(prompt, guess))
            if bonus:
                affinity[n.name] = math.floor(bonus * self.picking.prefix_affinity)
            candidates.append((n.name, cap, n.foreign_ahead(horizon, now), held))
        verdict = rules.pick_node(candidates, need, self.picking.reserve_fraction,
                                  rules.node_watermark(watermark, self.picking.reserve_fraction), affinity)
        for name, why in verdict.passed:
            self.nodes[name].pass_over(PassedOver(why))
        if verdict.chosen is None:
            return verdict
        n = self.nodes[verdict.chosen]
        charge = Charge(n, class_name, prompt, reserved, now, chain)
        charge.fallbacks = tuple(self.nodes[name].address for name in verdict.next_best(self.picking.fallbacks))
        n.add(charge, *self.growth.expect(class_name, prompt, reserved, 0))
        n.count_pick(prompt, credits.get(n.name, 0), verdict.by_affinity)
        return charge

    def ask(self, class_name: str, prompt: int, reserved: int, watermark: float,
            now: float, among: frozenset[str] | None = None, chain: Chain | None = None) -> NodeAsk:
        """ask is the per-node question for a store that shares the nodes' ledger.

        The same candidates as ``pick`` (up nodes of known capacity that ``among``
        allows, in the same order of preference), each with this replica's foreign KV, own
        holds, block size and what it saw of ``chain`` cached there; the store applies the
        rule over every replica's holds and prefixes. Nodes left out for their state are
        counted as passed over here.
        """
        if not self.picking.shared_prefix:
            chain = None
        horizon = self._horizon_s()
        rows = []
        for n, cap in self._eligible_in_turn(among, now):
            rise = n.rise_ahead(horizon, now)
            rows.append(Candidate(n.name, cap, n.foreign + n.kept + rise, self.held(n), rise, n.since, n.idle,
                                  n.prefixes.block if chain is not None else 0, min(prompt, n.cached(chain))))
        pooled = None
        if self.growth.pooled:
            pooled = Pooled(prompt, *self.growth.moments(reserved, 0, class_name), self.picking.quantile)
        return NodeAsk(tuple(rows), self.growth.hold(prompt, reserved, 0, class_name),
                       self.picking.reserve_fraction, rules.node_watermark(watermark, self.picking.reserve_fraction), pooled,
                       chain, prompt, self.picking.prefix_affinity)

    def pooled_of(self, charge: Charge) -> Pooled | None:
        """pooled_of is what ``charge`` adds to its node's sums in a shared ledger with pooled
        growth, as last counted (None without pooled growth)."""
        if charge.moments is None:
            return None
        return Pooled(charge.footprint, *charge.moments, self.picking.quantile)

    def passed_over_all(self, ask: NodeAsk, why: PassedOver) -> None:
        """passed_over_all counts every candidate of ``ask`` as passed over for ``why`` (a shared
        store refused them all)."""
        for c in ask.candidates:
            n = self.nodes.get(c.name)
            if n is not None:
                n.pass_over(why)

    def charge(self, name: str, class_name: str, prompt: int, reserved: int, now: float,
               chain: Chain | None = None, credit: int = 0, by_affinity: bool = False) -> Charge | None:
        """charge records a request a shared store admitted to node ``name`` (None: the node is
        no longer configured; the store's hold there ends with the lease), charged ``credit``
        tokens less for the prefix it shares there, the node chosen by it or not.

        ``chain`` is kept whole (where the pool shares prefixes) even where the store took
        fewer of its keys or none (a request admitted alone): this replica's marks then
        count more of its requests' sharing once than the store does, and subtract less
        from a report: the safe side (``sharing``)."""
        n = self.nodes.get(name)
        if n is None:
            return None
        c = Charge(n, class_name, prompt, reserved, now, chain if self.picking.shared_prefix else None)
        n.add(c, *self.growth.expect(class_name, prompt, reserved, 0))
        n.count_pick(prompt, credit, by_affinity)
        return c

    def never_fits(self, class_name: str, prompt: int, reserved: int) -> int | None:
        """never_fits is the largest node capacity (tokens) when the request is above it, else None.

        Only nodes of known capacity count; with none known nothing is said yet.
        """
        caps = [n.capacity for n in self.nodes.values() if n.capacity is not None]
        if not caps:
            return None
        largest = max(rules.effective_capacity(c, self.picking.reserve_fraction) for c in caps)
        need = self.growth.hold(prompt, reserved, 0, class_name)
        return largest if need > largest else None

    # --- the requests ----------------------------------------------------------------

    def progress(self, charge: Charge, generated: int, now: float) -> None:
        """progress records the tokens a request has generated so far (seen on its stream)."""
        if not charge.held:
            return
        if charge.first_at is None and generated > 0:
            charge.first_at = now
            self.first_tokens.append(max(0.0, now - charge.admitted_at))
        if generated > charge.generated:
            charge.node.count_again(charge, generated, *self.growth.expect(
                charge.class_name, charge.prompt, charge.reserved, generated))

    def release(self, charge: Charge, completion_tokens: int | None, completed: bool,
                now: float) -> bool:
        """release frees a charge once (False if it was already freed).

        A completed request with a known completion count teaches its class's lengths,
        and its hold time teaches when room comes back. The charges held count it from the
        next scrape round on (``mark``, RECOUNT_PER_ROUND of them a round), or from their
        next progress, whichever comes first: a release does not walk every request held.
        """
        if not charge.held:
            return False
        charge.held = False
        self._drop(charge)
        if charge.chain is not None:
            charge.node.ended(charge.chain, self.picking.prefix_record_keys)
        if completed:
            self.holds.add(now - charge.admitted_at, charge.reserved)
            if completion_tokens is not None and completion_tokens >= 0:
                self.growth.learn(charge.class_name, completion_tokens)
        return True

    def _drop(self, charge: Charge) -> None:
        """_drop takes a charge off its node, poking the node when its ``kept`` turns non-zero."""
        n = charge.node
        was = n.kept
        n.drop(charge)
        if not was and n.kept and self.poke is not None:
            self.poke(n.name)

    def named(self, among: frozenset[str] | None) -> int:
        """named counts the nodes that ``among`` allows (None: all), whatever their state."""
        return sum(1 for n in self.nodes.values() if allows(among, n.address))

    def eligible(self, among: frozenset[str] | None, now: float) -> int:
        """eligible counts the up nodes of known capacity that ``among`` allows (None: all)."""
        return sum(1 for n in self.nodes.values() if allows(among, n.address)
                   and n.capacity is not None and n.state(now, self.stale_after_s) is NodeState.UP)

    def move(self, charge: Charge, address: str) -> bool:
        """move re-homes a held charge on the node at ``address`` (the endpoint that really
        served it, when the proxy fell back to another than the one picked).

        False, and nothing changes, when the charge is released or no node has that
        address: the charge then stays where it was picked (kvgate never drops a charge on
        an address it does not know). The charge leaves the old node's scrape marks, so
        the old node's next report does not subtract KV it no longer holds.
        """
        if not charge.held or charge.address == address:
            return False
        target = next((n for n in self.nodes.values() if n.address == address), None)
        if target is None:
            return False
        old = charge.node
        self._drop(charge)
        for _since, seen in old.marks.values():
            seen.pop(charge, None)
        charge.node = target
        target.add(charge, charge.own, charge.moments)
        return True

    def retry_after(self, need: int, now: float, fallback_s: float,
                    shared: Mapping[str, int] | None = None) -> float:
        """retry_after estimates when some node has room for ``need`` tokens (seconds).

        ``retry.expected_wait`` per up node, over the requests kvgate holds there (oldest
        first), each expected to end after its residual hold given its age, summed in order
        of expected end until enough would be freed; the soonest node wins. ``fallback_s``
        before any request completed; when no release would make room (KV held by others
        must shrink first), the longer of ``fallback_s`` and a mean hold (at most the hint's
        ceiling). ``shared``: every replica's holds per node (``shared_short``; None: none).
        """
        holds = self.holds
        if not len(holds):
            return fallback_s
        best: float | None = None
        horizon = self._horizon_s()
        for n in self.nodes.values():
            if n.state(now, self.stale_after_s) is not NodeState.UP:
                continue
            if n.capacity is None:
                continue
            short = need - (self.headroom(n, now) or 0) if shared is None else shared_short(
                need, n, self.held(n), shared.get(n.name, 0), self.picking.reserve_fraction, horizon, now)
            t = expected_wait(now, ((c.admitted_at, self.growth.alone(c), c.reserved) for c in n.charges),
                              short, holds)
            if t is not None and (best is None or t < best):
                best = t
        return best if best is not None else min(MAX_WAIT_S, max(fallback_s, holds.residual(0.0) or 0.0))

    def snapshot(self, now: float) -> tuple[NodeSnapshot, ...]:
        """snapshot reports every node for metrics and health pages."""
        out = []
        for n in self.nodes.values():
            out.append(NodeSnapshot(
                name=n.name, address=n.address, state=n.state(now, self.stale_after_s),
                requests=len(n.charges), inflight_tokens=n.footprints,
                held_tokens=self.held(n), foreign_tokens=n.net + n.kept, capacity_tokens=n.capacity,
                headroom_tokens=self.headroom(n, now) if n.report_at is not None else None,
                kv_usage=n.usage, picks=n.picks,
                passed_over={k.value: v for k, v in n.passed_over.items()}, shared_tokens=n.shared,
                affinity_picks=n.affinity_picks, prompt_tokens=n.prompt_tokens,
                credit_tokens=n.credit_tokens))
        return tuple(out)

    def any_address(self, now: float, skip: Iterable[str] = (),
                    among: frozenset[str] | None = None) -> str | None:
        """any_address is an up node's address for a request kvgate does not admit (None: no node
        up); ``among`` restricts it to the endpoints the proxy allows (None: all)."""
        up = [n for n in self.nodes.values()
              if n.name not in skip and n.state(now, self.stale_after_s) is NodeState.UP
              and allows(among, n.address)]
        if not up:
            return None
        return min(up, key=lambda n: (len(n.charges), n.name)).address
