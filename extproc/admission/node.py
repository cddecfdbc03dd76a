"""node: one node's ledger (``Node``) and the charges kvgate holds on it (``Charge``).

Counting a request once, before and after the node reports it. A scrape round starts
with ``mark``: every node's charges whose first token has been seen are, from then on,
certainly in the node's KV cache when the node renders its metrics, so the report that
follows the mark carries them. ``report`` subtracts their footprint at the mark from the
reported usage: what is left is KV that kvgate did not admit (``foreign``), and kvgate's
own requests are then counted once, by their footprint now and growth to come. A charge
admitted after the mark is not subtracted (it may be missing from the report): if the
node did hold it, it is counted twice until the next report, which errs on the safe side.
A charge released before its report arrives is not subtracted either, for the same reason.
A report without a mark (the loop was too busy to take one) subtracts nothing.

A charge in a mark may be missing from its report all the same, and the report's foreign KV
then reads low by what it subtracted of it: the node ended it (its stop token, its
``max_tokens``) or preempted it before it rendered its metrics, while kvgate had yet to see
its end (a slow client holds the stream). Charges sharing a prefix are likewise subtracted
their prompts less the credit, up to a block less than the blocks the node shares. The
charge's hold covers that only while it is held: once released, it counted nowhere, and a
request admitted with credit for the prefix it shared with it was short of those blocks
too, until the next report (the property test of the ledger against the engine found
both). Hence two rules:

- What a report subtracted of a charge stays counted, in the node's foreign KV, once the
  charge is released, until the next report (``Node.kept``). Where the node did hold it
  until then, it is counted twice for at most a report interval: the safe side.
- A charge that has generated its whole reservation is left out of a mark: an engine ends a
  request at its ``max_tokens`` and frees its blocks at once. (A reservation below what
  the engine may generate only counts a request that outruns it twice, the safe side.) A
  request that stopped short of it by its stop token, its last tokens not yet seen at the
  mark, is still subtracted; a request sharing its prefix admitted before its end is seen
  is then short of the shared blocks until that end (a known gap, tests/unit/admission/
  test_ledger_vs_engine.py; closing it means crediting no prefix against the charges of the
  last report, which the Redis store's script would have to follow too). So is a charge
  the node preempted before it rendered the report and took up again before the next one:
  its footprint is in the node's cache again and still out of that report's foreign KV.

A charge with no first token at the mark is *settled* when it has been held longer than
the pool's recent requests typically took from admission to their first token (the
median, ``PoolNodes.settle_s``). A node schedules a request, and allocates its blocks, as
the first thing it does with it; the first token comes after its prefill and is seen
after the way back through the proxy, so a request older than that has reached the
cache unless the node queues it. It is therefore subtracted when the report also says the
node queues nothing (``NodeReport.waiting`` == 0); otherwise, or before any first token
was seen, it is not. This is what counts a request whose response is not streamed once:
kvgate sees no token of it before its end, and counted it twice, in its footprint and as
foreign KV, for its whole life (one 10k-token document looked like 20k on its node, which
then took no second one).

Foreign KV on the rise. While a node's foreign KV grows (a batch job ramping up, another
gateway's burst), it may go on growing at the same rate, and kvgate's requests on the node
cannot be taken back: they free their KV only as they end. So a node's room keeps free
the rise projected over the time kvgate's requests typically hold a node (the pool's
median hold time, from the report's instant, so a report read a while ago projects
further; at least one report interval): ``Node.foreign_ahead``. Rates are read between
the reports of the scrape rounds: an early report (``NodeReport.early``) comes a fraction
of an interval after the last, and the rise over it, nothing between two steps, wiped
out the rise the round had just read (the trace replay's background load preempted so).
The rise is read at the faster of two rates: over the last report interval, and over the reports of the last
hold time. The second remembers a load that rises in steps: one report interval between
two steps shows no growth, and the first rate alone then opened the node again in the
middle of the ramp (the trace replay's background load, 4 steps 1 s apart, preempted so).
A rise is the smaller of two readings' growth, the foreign KV above and the floor (usage
minus every held charge's footprint): kvgate's own requests missing from one of them
(admitted after the mark, or not yet in the cache at the last report) make only that one
jump, so they are not taken for a rise. The two always differ by the footprint of the
charges not subtracted, and from the numbers alone a foreign step cannot be told from one
of them entering the cache: a request admitted just before a report and not yet in the
cache hides a step of its size from the floor (the trace replay's background rose by 4k
beside a 4k prompt in flight, and the node stayed open for a report interval). The node's
running count tells them apart: when it runs no more requests than the charges subtracted
(``NodeReport.running``), none of the others is in its cache, the foreign reading holds
nothing of kvgate's, and its growth is taken: never below the smaller reading, and a lower
bound of the true rise (the reading before may have held some of kvgate's). One of
kvgate's requests ending on the node just as another enters its cache can pass that test
with the second in the foreign reading: a rise read too high for one report, on the safe
side.

Everything runs on the event-loop thread; times are seconds on the admission clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from enum import StrEnum

from extproc.admission.sharing import Prefixes
from extproc.admission.types import Chain, NodeReport
from extproc.config import BackendConfig


# Reports remembered per node to read the foreign KV's rise over the last hold time.
RISE_REPORTS = 32


# A charge's growth to come, for pooled growth (``rules.growth_moments``): the rest of its
# reservation, the mean and the variance of what it may still generate (tokens, tokens
# squared).
Moments = tuple[int, float, float]


class NodeState(StrEnum):
    """NodeState is whether a node may be picked: the ``state`` of its snapshot.

    ``pending``: never reported (just configured or discovered); ``up``: fresh report;
    ``stale``: no report for ``stale_after_s``; ``down``: its last scrape was refused
    (nothing listens): not picked until it answers again.
    """

    PENDING = "pending"
    UP = "up"
    STALE = "stale"
    DOWN = "down"


class PassedOver(StrEnum):
    """PassedOver is why a node was not picked for a request (a counted label)."""

    PENDING = "pending"
    STALE = "stale"
    DOWN = "down"
    NO_CAPACITY = "no_capacity"
    NO_ROOM = "no_room"
    CLASS_WATERMARK = "class_watermark"


class Charge:
    """Charge is one admitted request's hold on one node, until it is released.

    ``prompt`` and ``reserved`` (completion) are tokens; ``generated`` is the tokens seen
    on the response stream so far; ``first_at`` the instant its first token was seen;
    ``own`` and ``moments`` what its node's sums count of it: its own expected hold
    (``rules.node_hold``, tokens; 0 with pooled growth) and its growth's ``Moments`` (None
    without pooled growth), as worked out when it was admitted, last progressed or the
    lengths learned were last applied (``PoolNodes.relearn``); ``seen`` what the node's
    cache certainly held of it at the last mark (tokens: its footprint when its first token
    had been seen and not its whole reservation, minus its footprint when it was only
    settled there, 0 otherwise), which
    a shared store publishes to the other replicas (``shared_nodes``), its prefix shared
    with the charges seen before it counted once; ``chain``: its prompt's prefix chain
    (None: no prefix shared, or the pool does not share them); ``fallbacks``: the addresses
    of the other nodes that fitted the request when it was picked, best first, named after
    its node for the proxy's retries (``PickingConfig.fallbacks``; their room not reserved).
    """

    __slots__ = ("node", "class_name", "prompt", "reserved", "generated", "first_at",
                 "admitted_at", "held", "own", "moments", "seen", "chain", "fallbacks")

    def __init__(self, node: Node, class_name: str, prompt: int, reserved: int, now: float,
                 chain: Chain | None = None) -> None:
        self.node = node
        self.chain = chain
        self.class_name = class_name
        self.prompt = prompt
        self.reserved = reserved
        self.generated = 0
        self.first_at: float | None = None
        self.admitted_at = now
        self.held = True
        self.own = 0
        self.moments: Moments | None = None
        self.seen = 0
        self.fallbacks: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        """address is the node's inference endpoint (``HOST:PORT``), where the request goes."""
        return self.node.address

    def drop(self) -> None:
        """drop takes the charge off its node, teaching nothing (a grant taken back, or a
        release after its pool was reconfigured away): held no more."""
        self.held = False
        self.node.drop(self)

    @property
    def footprint(self) -> int:
        """footprint is the KV tokens the request holds on the node now: prompt + generated."""
        return self.prompt + self.generated


class Node:
    """Node is one node's ledger: capacity, last report, foreign KV and kvgate's charges.

    The charges are summed as they come, progress and go, so that a pick reads a node's
    hold without a walk of its requests: ``footprints`` (tokens held now), ``owns`` (the
    charges' own holds), ``left``, ``mean`` and ``var`` (the sums of their ``Moments``, for
    pooled growth), and ``prefixes``, their prompts' shared blocks (``shared``: tokens
    counted once, to take from the sums). Only ``add``, ``drop`` and ``count_again``
    change the charges.
    """

    __slots__ = ("name", "address", "configured_capacity", "reported_capacity", "usage",
                 "report_at", "refused", "foreign", "net", "since", "idle", "floor", "rise", "rise_s", "history",
                 "subtracted", "kept", "base",
                 "charges", "marks", "picks", "passed_over", "exact", "footprints", "owns", "left", "mean", "var",
                 "prefixes", "reported_block", "affinity_picks", "prompt_tokens", "credit_tokens",
                 "recent")

    def __init__(self, backend: BackendConfig, block: int = 16) -> None:
        self.name = backend.name
        self.address: str = backend.address or ""
        self.configured_capacity = backend.kv_capacity_tokens
        self.reported_capacity: int | None = None
        self.usage: float | None = None
        self.report_at: float | None = None
        self.refused = False
        self.foreign = 0
        # foreign less what other replicas published of their requests there (shared_nodes)
        self.net = 0
        # the store's instant the last report's mark saw (None: none), and whether the node
        # queued nothing then: what a shared store needs to subtract the other replicas'
        self.since: float | None = None
        self.idle = False
        self.floor: int | None = None   # net of the others' too, last report
        # what the last report subtracted of each of kvgate's charges (tokens), and of those
        # released since, the sum: still counted until the next report (module doc)
        self.subtracted: dict[Charge, int] = {}
        self.kept = 0
        self.rise = 0                   # tokens foreign KV grew by over the last interval (module doc)
        self.rise_s = 0.0               # that interval, seconds
        # (instant, net, floor) of the last report of a round, whence the next reads its rise
        self.base: tuple[float, int, int] | None = None
        # (instant, net, floor) of the latest reports with a usable sample, oldest first.
        self.history: deque[tuple[float, int, int]] = deque(maxlen=RISE_REPORTS)
        # kvgate's requests on the node, oldest admitted first (a refusal's retry hint walks
        # them in the order they are expected to end).
        self.charges: dict[Charge, None] = {}
        # mark id -> the store's instant then (None: none), and (footprint at the mark, first
        # token seen) of each charge certainly in the node's cache (first token seen) or
        # settled there (module doc).
        self.marks: dict[int, tuple[float | None, dict[Charge, tuple[int, bool]]]] = {}
        self.picks = 0
        self.passed_over: dict[PassedOver, int] = {}
        self.exact = False  # the last report's foreign KV holds none of kvgate's (module doc)
        self.footprints = 0
        self.owns = 0
        self.left = 0
        self.mean = 0.0
        self.var = 0.0
        self.prefixes = Prefixes(block)
        self.reported_block: int | None = None  # the block size the node reported last
        self.affinity_picks = 0  # picks its cached prefix won against a roomier node
        self.prompt_tokens = 0   # prompt tokens of the requests sent here
        self.credit_tokens = 0   # of those, shared with requests running here when sent
        # prefix keys of the requests that ended here, each with its end (tokens), oldest first
        self.recent: OrderedDict[int, int] = OrderedDict()

    @property
    def shared(self) -> int:
        """shared is the tokens of prompt blocks kvgate's charges on the node share, counted
        once (``Prefixes.shared``)."""
        return self.prefixes.shared

    def ended(self, chain: Chain, keep: int) -> None:
        """ended remembers the prefix of a request that ended on the node: its cache may hold
        it a while longer (at most ``keep`` keys, the least recently ended first out;
        ``PickingConfig.prefix_record_keys``)."""
        recent = self.recent
        for key, end in zip(chain.keys, chain.ends):
            recent[key] = end
            recent.move_to_end(key)
        while len(recent) > keep:
            recent.popitem(last=False)

    def cached(self, chain: Chain | None) -> int:
        """cached is the whole blocks of ``chain``'s longest prefix that the node's requests
        hold or recently held (tokens; placement only, see ``ended``)."""
        if chain is None or not (self.recent or self.prefixes.refs):
            return 0
        got = 0
        for key, end in zip(chain.keys, chain.ends):
            if key not in self.prefixes.refs and key not in self.recent:
                break
            got = end
        return self.prefixes.whole_blocks(got)

    def count_pick(self, prompt: int, credit: int, by_affinity: bool) -> None:
        """count_pick counts a request sent to the node: its ``prompt`` tokens, the ``credit``
        of them shared there, and whether its prefix chose the node over a roomier one."""
        self.picks += 1
        self.prompt_tokens += prompt
        self.credit_tokens += credit
        if by_affinity:
            self.affinity_picks += 1

    def count_prefixes(self, block: int) -> None:
        """count_prefixes counts the charges' prefixes again in blocks of ``block`` tokens (the
        node reported its block size, or the configured one changed)."""
        self.prefixes = Prefixes(block)
        for c in self.charges:
            if c.chain is not None:
                self.prefixes.add(c.chain)

    def add(self, c: Charge, own: int, moments: Moments | None) -> None:
        """add counts charge ``c`` on the node with its ``own`` hold and ``moments``."""
        if self.charges and c.admitted_at < next(reversed(self.charges)).admitted_at:
            # A charge moved here from another node: keep the oldest first.
            self.charges = dict.fromkeys(sorted([*self.charges, c], key=lambda x: x.admitted_at))
        else:
            self.charges[c] = None
        c.own, c.moments = own, moments
        self._sum(c, 1)
        if c.chain is not None:
            self.prefixes.add(c.chain)

    def drop(self, c: Charge) -> None:
        """drop stops counting charge ``c`` (nothing when it is not on the node)."""
        if c not in self.charges:
            return
        del self.charges[c]
        self.kept += self.subtracted.pop(c, 0)
        if c.chain is not None:
            self.prefixes.drop(c.chain)
        if self.charges:
            self._sum(c, -1)
        else:  # exact zeros: no float left over from the sums of the variances
            self.footprints = self.owns = self.left = 0
            self.mean = self.var = 0.0
            self.prefixes = Prefixes(self.prefixes.block)

    def count_again(self, c: Charge, generated: int, own: int, moments: Moments | None) -> None:
        """count_again recounts charge ``c`` (on the node) with ``generated`` tokens, its ``own``
        hold and ``moments``."""
        self._sum(c, -1)
        c.generated, c.own, c.moments = generated, own, moments
        self._sum(c, 1)

    def _sum(self, c: Charge, sign: int) -> None:
        self.footprints += sign * (c.prompt + c.generated)
        self.owns += sign * c.own
        if c.moments is not None:
            left, mean, var = c.moments
            self.left += sign * left
            self.mean += sign * mean
            self.var += sign * var

    @property
    def capacity(self) -> int | None:
        """capacity is the node's KV capacity in tokens: configured, else reported (None: unknown)."""
        return self.configured_capacity if self.configured_capacity is not None else self.reported_capacity

    def state(self, now: float, stale_after_s: float) -> NodeState:
        """state is whether the node may be picked at ``now`` (see ``NodeState``)."""
        if self.report_at is None:
            return NodeState.PENDING
        if self.refused:
            return NodeState.DOWN
        if now - self.report_at >= stale_after_s:
            return NodeState.STALE
        return NodeState.UP

    def mark(self, mark: int, now: float, settle_s: float | None, since: float | None = None) -> None:
        """mark records the charges certainly in the node's cache at ``now``, and those settled
        there (held ``settle_s`` seconds or more without a first token; None: none is), see
        the module doc, with ``since``, the store's instant of the latest answer received
        (None: none); each charge's ``seen`` follows."""
        held: dict[Charge, tuple[int, bool]] = {}
        settled: list[Charge] = []
        for c in self.charges:
            if c.first_at is not None and c.generated < c.reserved:
                c.seen = c.footprint
                held[c] = (c.seen, True)
            elif c.first_at is not None:  # its whole reservation generated: ended there (module doc)
                c.seen = 0
            elif settle_s is not None and now - c.admitted_at >= settle_s:
                settled.append(c)
            else:
                c.seen = 0
        for c in settled:
            c.seen = -c.footprint
            held[c] = (c.footprint, False)
        if self.prefixes.extra:
            self._count_shared_once(held)
        self.marks[mark] = (since, held)
        while len(self.marks) > 4:  # reports lost or never taken: keep the newest few
            del self.marks[next(iter(self.marks))]

    def _count_shared_once(self, held: dict[Charge, tuple[int, bool]]) -> None:
        """_count_shared_once takes from each charge of a mark what it shares with the charges
        before it there (firm ones first: the settled ones are subtracted only with them), so
        that the mark's sum counts a shared prefix once, as ``shared`` does for every
        charge: the report's foreign KV and the node's sums then agree on it."""
        among = Prefixes(self.prefixes.block)
        for c, (fp, first) in held.items():
            if c.chain is None:
                continue
            less = among.credit(c.chain)
            among.add(c.chain)
            less = min(less, c.prompt)
            if less:
                held[c] = (fp - less, first)
                c.seen = fp - less if first else -(fp - less)

    def report(self, r: NodeReport, others: Callable[[float | None, bool], int] | None = None) -> None:
        """report takes one scrape's result; a round without a usable sample keeps the last one.

        ``others`` says what the other replicas published of their requests in the node's
        cache for a mark's store instant and whether the node queued nothing (tokens;
        ``Store.others_seen``; None: no other replicas): the rise is read net of it."""
        entry = self.marks.pop(r.mark, None) if r.mark is not None else None
        since, seen = entry if entry is not None else (None, None)
        if r.mark is not None:
            for m in [m for m in self.marks if m < r.mark]:
                del self.marks[m]
        self.refused = r.refused
        if r.block_tokens is not None:
            self.reported_block = r.block_tokens
            if r.block_tokens != self.prefixes.block:
                self.count_prefixes(r.block_tokens)
        if r.kv_usage is None or not math.isfinite(r.kv_usage):
            return
        if r.capacity_tokens is not None:
            self.reported_capacity = r.capacity_tokens
        scale = self.reported_capacity if self.reported_capacity is not None else self.configured_capacity
        self.usage = min(1.0, max(0.0, r.kv_usage))
        self.report_at = r.at
        self.kept = 0
        if scale is None:
            self.foreign, self.net, self.floor, self.rise, self.since = 0, 0, None, 0, None
            self.subtracted = {}
            self.history.clear()
            self.base = None
            return
        used = math.ceil(self.usage * scale)
        idle = r.waiting == 0
        subtracted = {c: fp for c, (fp, first) in seen.items() if c.held and (first or idle)} if seen else {}
        self.subtracted = subtracted
        ours = sum(subtracted.values())
        foreign = max(0, used - ours)
        gone = others(since, idle) if others is not None and since is not None else 0
        net = max(0, foreign - gone)
        floor = max(0, used - (self.footprints - self.shared) - gone)
        # The node runs no request beyond those subtracted: none of kvgate's others is in its
        # cache yet, so the foreign reading holds nothing of kvgate's (module doc).
        self.exact = r.running is not None and r.running <= len(subtracted)
        self.foreign, self.net, self.floor, self.since, self.idle = foreign, net, floor, since, idle
        if r.early:
            return
        base, self.base = self.base, (r.at, net, floor)
        if base is None:
            self.rise, self.rise_s = 0, 0.0
        else:
            rise = net - base[1] if self.exact else min(net - base[1], floor - base[2])
            self.rise, self.rise_s = max(0, rise), r.at - base[0]
        self.history.append((r.at, net, floor))

    def foreign_ahead(self, horizon_s: float, now: float) -> int:
        """foreign_ahead is the KV (tokens) the node may hold for others while requests admitted
        at ``now`` run, ``horizon_s`` seconds: foreign + ``kept`` + ``rise_ahead``."""
        return self.foreign + self.kept + self.rise_ahead(horizon_s, now)

    def rise_ahead(self, horizon_s: float, now: float) -> int:
        """rise_ahead is how much (tokens) the foreign KV may grow while requests admitted at
        ``now`` run, ``horizon_s`` seconds: its rise at the faster of its rates over the last
        report interval and over the reports of the last ``horizon_s``, from the report to
        the end of that horizon (never below the last interval's rise; module doc). The
        report's age counts: a rise read 0.9 s ago has had 0.9 s more to go on."""
        if self.report_at is None:
            return 0
        ahead = horizon_s + max(0.0, now - self.report_at)
        extra = 0
        if self.rise > 0:
            extra = (self.rise if self.rise_s <= 0 or ahead <= self.rise_s
                     else math.ceil(self.rise * ahead / self.rise_s))
        oldest = next((h for h in self.history if h[0] >= self.report_at - horizon_s), None)
        if oldest is not None and self.floor is not None and oldest[0] < self.report_at:
            grew = (self.net - oldest[1] if self.exact
                    else min(self.net - oldest[1], self.floor - oldest[2]))
            if grew > 0:
                extra = max(extra, math.ceil(grew * ahead / (self.report_at - oldest[0])))
        return extra

    def pass_over(self, why: PassedOver) -> None:
        self.passed_over[why] = self.passed_over.get(why, 0) + 1
