"""redis_lua: the Redis store's Lua scripts, and the one definition of what they read.

Every script reads positional KEYS and ARGV. Their layouts are defined once, here, as
NamedTuples: the Python side builds a script's words by field name (``pack``,
``Script.command``), and each script reads the same words into Lua locals of the same
names, in a preamble generated from the same definition (``lua_locals``, ``lua_each``).
Adding, removing or moving a field thus changes both sides at once. The rule's constants
reach the Lua the same way: ``bucket.FIT_SLACK`` as ``FIT``, each ``Budget`` as
``B_<NAME>``. The refill formula has one Lua twin of ``bucket.refilled`` (``refill`` in
the prelude); the admission rule itself is ``rules.decide`` and ``shared_nodes.pick_shared``,
mirrored line for line in ``_ADMIT`` and held equal by the differential tests.

Words: ``None`` goes as ``-`` (the script reads it as nil: none), floats as ``repr`` (they
round-trip exactly), ints and text as they are. Text has no spaces (configured names and
lease ids). Several small words in one ARGV string keep the client's encoding cheap on
the hot path (``args`` in the prelude splits them).

Size: the module passes 700 lines by its Lua source text (``_PRELUDE``, ``_ADMIT``,
``_SETTLE``, ``_REFRESH`` ..., about 600 of its lines): a declarative part, excepted from
the module size rule as a table is; the Python around it is some 380 lines. Cutting the
scripts into another module would part each from the layouts its preamble is generated from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, get_type_hints

from extproc.admission import rules
from extproc.admission.bucket import FIT_SLACK
from extproc.admission.store.fairshare import FAIR_FAR, FAIR_SLACK, FAIR_WINDOW_S, WANTING
from extproc.admission.store.fallback import LOCAL_PREFIX
from extproc.admission.store.redis_sharing import SHARING_LUA
from extproc.admission.shared_nodes import NodeAsk
from extproc.admission.sharing import MAX_LINKS, MAX_NODE_KEYS, bounded
from extproc.admission.types import Budget

# --- layouts --------------------------------------------------------------------------


class PoolKeys(NamedTuple):
    """PoolKeys are the KEYS of the admit and settle scripts (see ``store.redis_ledger``'s key layout).

    A plan without a pool or a tenant bucket passes ``st`` for it: the script never
    touches a bucket it was not given limits for.
    """

    st: str
    lz: str
    lh: str
    done: str
    pbk: str
    tbk: str
    nk: str
    rb: str
    sn: str
    sr: str
    nm: str
    pk: str
    ps: str
    lk: str


class RefreshKeys(NamedTuple):
    """RefreshKeys are the KEYS of the refresh script: a pool's, without the tenant bucket."""

    st: str
    lz: str
    lh: str
    done: str
    pbk: str
    nk: str
    sn: str
    sr: str
    nm: str
    pk: str
    ps: str
    lk: str


class HeartbeatKeys(NamedTuple):
    """HeartbeatKeys are the KEYS of the heartbeat script: the zset of present replicas (id ->
    heartbeat expiry), their advertised addresses (hash id -> host:port) and the zset of
    replicas whose heartbeat expired (id -> when to forget them)."""

    replicas: str
    addrs: str
    gone: str


class AdmitPool(NamedTuple):
    """AdmitPool is the pool's part of ``AdmitArg``: it changes only with the pool's limits.

    ``limit``: slots; ``kvb``, ``base_kv``: the KV budget now and at scale 1.0 (tokens);
    ``est``: the retry estimate (s); ``pcap``, ``prate``, ``pbase``: the pool bucket's
    capacity (tokens), rate (tokens/s) and capacity at scale 1.0.
    """

    limit: int
    kvb: int | None
    base_kv: int | None
    est: float
    pcap: float | None
    prate: float | None
    pbase: float | None


class Guarantee(NamedTuple):
    """Guarantee is one class's guaranteed slots, repeated at the end of ``AdmitArg``."""

    name: str
    g: int


class AdmitArg(NamedTuple):
    """AdmitArg is ARGV[1] of the admit script.

    ``now``: the instant (s), None for Redis ``TIME``; ``id``: the lease; ``ttl``: its
    lifetime (s); ``cls``, ``n``: the plan's class and tokens; ``pool``: ``AdmitPool``,
    packed; ``tcap``, ``trate``, ``tbase``: the tenant bucket as ``pcap`` ...; ``texp``:
    how long (s) a tenant bucket lives after it would be full (< 0: forever); ``ckv``,
    ``cbase``: the class's KV ceiling now and at scale 1.0 (tokens); ``waits``: 1 when a
    retryable refusal keeps the request waiting (``Plan.waits``), else 0; ``guarantees``:
    ``Guarantee`` words, packed.
    """

    now: float | None
    id: str
    ttl: float
    cls: str
    n: int
    pool: str
    tcap: float | None
    trate: float | None
    tbase: float | None
    texp: float
    ckv: int | None
    cbase: int | None
    waits: int
    guarantees: str


class NodeArg(NamedTuple):
    """NodeArg is ARGV[2] of the admit script when the pool picks nodes (else ``-``).

    ``need``: the request's hold (tokens); ``reserve``: the part of each node's capacity
    kvgate never fills; ``wm``: the class's watermark as ``rules.node_watermark`` gives it
    (w / (1 - reserve), at most 1; 1.0: none); with pooled growth
    (``shared_nodes.Pooled``, else None), ``fp``, ``pl``, ``pm``, ``pv``: its footprint
    and moments, ``z``: ``rules.z_of`` its quantile (None: 1, no bound below the sum of the
    reservations); ``pt``: the prompt's tokens and ``aff`` the pool's prefix affinity
    (``shared_nodes.NodeAsk``); ``nodes``: ``NodeCandidate`` words, packed. The prompt's
    prefix chain is ARGV[3]: ``ChainLink`` words (``-``: none).
    """

    need: int
    reserve: float
    wm: float
    fp: int | None
    pl: int | None
    pm: float | None
    pv: float | None
    z: float | None
    pt: int
    aff: float
    nodes: str


class NodeCandidate(NamedTuple):
    """NodeCandidate is one node the admit script may pick: ``shared_nodes.Candidate`` without
    this replica's own holds (the script reads every replica's); ``idle`` as 1/0."""

    name: str
    cap: int
    foreign: int
    rise: int
    since: float | None
    idle: int
    block: int
    cached: int


class ChainLink(NamedTuple):
    """ChainLink is one key of a prompt's prefix chain (``types.Chain``) in ARGV[3] of the admit
    script: the key as text (a 64-bit hash: Lua's numbers would round it) and its end (``upto``,
    tokens)."""

    key: str
    upto: int


class SettleArg(NamedTuple):
    """SettleArg is ARGV[1] of the settle script: the lease, what it is charged in the end
    (tokens), the tombstone's lifetime (s) and the buckets' limits as in ``AdmitArg``."""

    now: float | None
    id: str
    charged: int
    ttl: float
    pcap: float | None
    prate: float | None
    tcap: float | None
    trate: float | None
    texp: float


class RefreshArg(NamedTuple):
    """RefreshArg is the ARGV of the refresh script: the instant, the leases' new lifetime
    (s), whether the pool has a bucket (1/0), the replica and its refresh round (a number
    that grows by one per refresh round trip: the first call of a round starts a new
    generation of what it saw, ``shared_nodes.SeenGen``), its leases as ``RefreshLease``
    words after."""

    now: float | None
    ttl: float
    has_pb: int
    replica: str
    round: int


class RefreshLease(NamedTuple):
    """RefreshLease is one live lease as the refresh script extends (or re-takes) it: its
    class, tokens, node (``-``: none), the node hold the controller now expects (tokens;
    with pooled growth its footprint), what its node's cache certainly holds of it
    (``node.Charge.seen``: its footprint, negative when only a node that queues nothing
    holds it; 0: nothing known) and, with pooled growth, its growth's moments (``l``
    tokens, ``m``, ``v``; zeros without)."""

    id: str
    cls: str
    tok: int
    node: str
    hold: int
    seen: int
    l: int
    m: float
    v: float


class HeartbeatArg(NamedTuple):
    """HeartbeatArg is the ARGV of the heartbeat script: instant, replica id, the heartbeat's
    lifetime (s), where the replica answers whether it runs (host:port, ``-``: nowhere) and
    how long (s) a replica whose heartbeat expired is remembered (its leases' TTL)."""

    now: float | None
    replica: str
    ttl: float
    addr: str
    gone_ttl: float


class ReleaseArg(NamedTuple):
    """ReleaseArg is the ARGV of the release script: the instant, the tombstones' lifetime (s)
    and the replica whose leases go."""

    now: float | None
    ttl: float
    replica: str


def word(v: object) -> str:
    """word is one value as a script reads it: ``-`` for None, else ``str`` (for a float, its
    shortest repr, which round-trips exactly); anything but text and numbers is refused."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise TypeError(f"a script word is text, a number or None, not {v!r}")
    return str(v)


def pack(values: Iterable[object]) -> str:
    """pack is ``values``, a layout's fields in order, as one space-separated script argument:
    each as ``word`` has it. On the path of every admission, so the layout's types stand
    for ``word``'s check."""
    return " ".join(["-" if v is None else str(v) for v in values])


def node_arg(ask: NodeAsk) -> str:
    """node_arg is ``ask`` as the admit script's ``NodeArg``: the rule's constants travel in
    it, never copied into Lua; the script computes floor(C x (1 - r)) on the same double
    as ``rules.effective_capacity``."""
    nodes = pack(w for c in ask.candidates
                 for w in NodeCandidate(c.name, int(c.cap), int(c.foreign), int(c.rise),
                                        None if c.since is None else float(c.since), 1 if c.idle else 0,
                                        int(c.block), int(c.cached)))
    p = ask.pooled
    if p is None:
        return pack(NodeArg(int(ask.need), float(ask.reserve_fraction), float(ask.watermark),
                            None, None, None, None, None, int(ask.prompt), float(ask.affinity), nodes))
    return pack(NodeArg(int(ask.need), float(ask.reserve_fraction), float(ask.watermark),
                        int(p.footprint), int(p.left), float(p.mean), float(p.var),
                        None if p.quantile >= 1.0 else rules.z_of(p.quantile),
                        int(ask.prompt), float(ask.affinity), nodes))


def chain_arg(ask: NodeAsk) -> str:
    """chain_arg is ``ask``'s prefix chain as the admit script's ARGV[3]: its first MAX_LINKS
    keys as ``ChainLink`` words (``-``: no chain)."""
    if ask.chain is None or not ask.chain.keys:
        return "-"
    chain = bounded(ask.chain)
    return pack(w for key, end in zip(chain.keys, chain.ends) for w in ChainLink(str(key), int(end)))


# --- Lua from the layouts ----------------------------------------------------------------

Layout = type[tuple[Any, ...]]
"""Layout is a NamedTuple class: the order and names of a script's words."""


def _fields(layout: Layout) -> tuple[str, ...]:
    """_fields is a layout's field names, in order (a NamedTuple's ``_fields``, which the
    ``type[tuple]`` that stands for any NamedTuple class does not declare)."""
    fields: tuple[str, ...] = getattr(layout, "_fields")
    return fields


def _read(name: str, kind: object, at: str) -> str:
    """_read is the Lua that reads field ``name`` of Python type ``kind`` from ``at``: text
    stays text, ``now`` becomes an instant (``now_of``), anything else a number."""
    if name == "now":
        return f"now_of({at})"
    return at if kind is str else f"tonumber({at})"


def lua_locals(layout: Layout, table: str, expand: Mapping[str, Layout] | None = None,
               group: str | None = None) -> str:
    """lua_locals is the Lua that reads ``layout`` from ``table`` (from index 1) into locals of
    its field names.

    A field named in ``expand`` stands for the fields of that layout, read in its place; the
    ``group`` field, the last, is a run of repeated words: its local is the index of its
    first word (``lua_each`` walks the run).
    """
    reads: list[tuple[str, object]] = []
    for name, kind in get_type_hints(layout).items():
        if name == group:
            if name != _fields(layout)[-1]:
                raise ValueError(f"the group {name!r} must be the last field of {layout.__name__}")
            break
        sub = expand.get(name) if expand else None
        reads.extend(get_type_hints(sub).items() if sub is not None else [(name, kind)])
    lines = [f"local {name} = {_read(name, kind, f'{table}[{i}]')}"
             for i, (name, kind) in enumerate(reads, 1)]
    if group is not None:
        lines.append(f"local {group} = {len(reads) + 1}")
    return "\n".join(lines)


def lua_each(layout: Layout, table: str, first: str | int) -> str:
    """lua_each is the head of a Lua loop over the repeated ``layout`` words of ``table`` from
    index ``first`` on, each one's fields in locals of their names (the body and ``end``
    follow in the script)."""
    hints = list(get_type_hints(layout).items())
    size = len(hints)
    names = ", ".join(name for name, _ in hints)
    reads = ", ".join(_read(name, kind, f"{table}[i + {k}]" if k else f"{table}[i]")
                      for k, (name, kind) in enumerate(hints))
    return f"for i = {first}, #{table} - {size - 1}, {size} do\n  local {names} = {reads}"


def _constants() -> str:
    """_constants is the rule's constants as Lua locals: the fit slack and the budget names."""
    lines = [f"local FIT = {FIT_SLACK!r}", f"local LOCAL = '{LOCAL_PREFIX}'",
             f"local MAX_LINKS = {MAX_LINKS}", f"local MAX_NODE_KEYS = {MAX_NODE_KEYS}"]
    lines += [f"local B_{b.name} = '{b.value}'" for b in Budget]
    lines += [f"local FAIR_S = {FAIR_WINDOW_S!r}", f"local FAIR_SLACK = {FAIR_SLACK!r}", f"local FAIR_FAR = {FAIR_FAR!r}",
              "local WANTING = {" + ", ".join(f"[B_{b.name}] = true" for b in WANTING) + "}"]
    return "\n".join(lines)


def _script(source: str, **parts: str) -> str:
    """_script fills a script's ``$name`` places (Lua uses no ``$``), each alone on its line,
    with generated Lua, indented as the place is."""
    out: list[str] = []
    for line in source.split("\n"):
        body = line.lstrip()
        if body.startswith("$"):
            indent = line[:len(line) - len(body)]
            out.extend(indent + x for x in parts[body[1:]].split("\n"))
        elif "$" in line:
            raise ValueError(f"a $place must stand alone on its line: {line!r}")
        else:
            out.append(line)
    return "\n".join(out)


# --- Lua -------------------------------------------------------------------------------
# The clock and number formatting, shared by every script.
_CLOCK = r"""
-- args splits one argument into its words (separated by spaces).
local function args(s)
  local a = {}
  for w in string.gmatch(s, '%S+') do a[#a + 1] = w end
  return a
end
local function now_of(arg)
  if arg ~= '-' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- Lua's tostring keeps 14 digits; %.17g round-trips a double exactly.
local function fmt(x) return string.format('%.17g', x) end
"""

# The prelude of the pool scripts: the purge of expired leases, the token bucket (a mirror
# of extproc.admission.bucket.TokenBucket) and the view every reply ends with.
_PRELUDE = _CLOCK + _constants() + r"""
-- rec_fields splits a lease record: class, tokens, and node, node hold, what the
-- replica's refresh round rnd saw of it in the cache (fn) and the round before (fo), and
-- its growth's moments with pooled growth (l, m, v) ('-' and zeros when the pool does not
-- pick nodes; zero moments without pooled growth).
local function rec_fields(rec)
  local f = {}
  for w in string.gmatch(rec, '[^\t]+') do f[#f + 1] = w end
  return f[1], tonumber(f[2]), f[3] or '-', tonumber(f[4]) or 0, tonumber(f[5]) or 0,
    tonumber(f[6]) or 0, tonumber(f[7]) or 0, tonumber(f[8]) or 0, tonumber(f[9]) or 0, tonumber(f[10]) or 0
end
-- record is what a lease holds, as rec_fields reads it.
local function record(cls, tok, node, hold, rnd, fn, fo, l, m, v)
  if node == '-' then return cls .. '\t' .. fmt(tok) end
  local r = cls .. '\t' .. fmt(tok) .. '\t' .. node .. '\t' .. fmt(hold) .. '\t' .. fmt(rnd) .. '\t'
    .. fmt(fn) .. '\t' .. fmt(fo)
  if l == 0 then return r end
  return r .. '\t' .. fmt(l) .. '\t' .. fmt(m) .. '\t' .. fmt(v)
end
-- moments_of is the sums of the moments of the requests on node (left, mean, var).
local function moments_of(nm, node)
  local s = redis.call('HMGET', nm, node .. '\tl', node .. '\tm', node .. '\tv')
  return tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or 0
end
-- moments_add adds sign x a request's moments to node's sums. Every request with moments
-- has l > 0, so a left sum of 0 means none is left: the sums go, and with them what the
-- floating sums of mean and var drifted.
local function moments_add(nm, node, l, m, v, sign)
  if l == 0 then return end
  local sl, sm, sv = moments_of(nm, node)
  sl = sl + sign * l
  if sl <= 0 then
    redis.call('HDEL', nm, node .. '\tl', node .. '\tm', node .. '\tv')
  else
    redis.call('HSET', nm, node .. '\tl', fmt(sl), node .. '\tm', fmt(sm + sign * m), node .. '\tv', fmt(sv + sign * v))
  end
end
-- replica_of is the replica that took a lease (ids are <replica>.<n>, LOCAL<replica>.<n>).
local function replica_of(id)
  if string.sub(id, 1, #LOCAL) == LOCAL then id = string.sub(id, #LOCAL + 1) end
  return string.match(id, '^(.*)%.') or id
end
-- leases_add moves a replica's count of live leases (fairshare: r:<replica> in st) by d.
local function leases_add(st, replica, d)
  if redis.call('HINCRBY', st, 'r:' .. replica, d) <= 0 then redis.call('HDEL', st, 'r:' .. replica) end
end
-- stamps is a replica's generations in sr: the instants of the newest and the one before
-- (nil: none) and its round (nil: none yet).
local function stamps(sr, replica)
  local v = redis.call('HGET', sr, replica)
  if not v then return nil, nil, nil end
  local s = args(v)
  return tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
end
-- seen_add adds sign x |v| to the sum of replica's generation (old or new) on node that v
-- belongs to: firm (v > 0: F, f) or idle (v < 0: I, i). An empty sum leaves the hash.
local function seen_add(sn, replica, node, old, v, sign)
  if v == 0 then return end
  local kind = 'F'
  if v < 0 then kind = 'I'; v = 0 - v end
  if old then kind = string.lower(kind) end
  local field = replica .. '\t' .. node .. '\t' .. kind
  if redis.call('HINCRBY', sn, field, sign * v) <= 0 then redis.call('HDEL', sn, field) end
end
-- clamp_seen keeps what a lease's generations count within its hold, so that what another
-- replica subtracts of it is always still held on its node.
local function clamp_seen(v, hold)
  if v > hold then return hold end
  if v < 0 - hold then return 0 - hold end
  return v
end
""" + SHARING_LUA + r"""
local function untake(st, nk, nm, sn, sr, pk, ps, lk, id, rec)
  local cls, tok, node, hold, rnd, fn, fo, l, m, v = rec_fields(rec)
  redis.call('HINCRBY', st, 'n', -1)
  leases_add(st, replica_of(id), -1)
  redis.call('HINCRBY', st, 'c:' .. cls, -1)
  -- 0 - tok, not -tok: Lua writes -0 as "-0", which HINCRBY refuses
  redis.call('HINCRBY', st, 'kv', 0 - tok)
  if node ~= '-' and hold ~= 0 then redis.call('HINCRBY', nk, node, 0 - hold) end
  if node ~= '-' then
    moments_add(nm, node, l, m, v, -1)
    prefix_drop(pk, ps, lk, id, node)
  end
  if node ~= '-' and (fn ~= 0 or fo ~= 0) then
    -- what the lease's replica published of it leaves with its hold
    local replica = replica_of(id)
    local _, _, cur = stamps(sr, replica)
    if cur == rnd then
      seen_add(sn, replica, node, false, fn, -1)
      seen_add(sn, replica, node, true, fo, -1)
    elseif cur == rnd + 1 then
      seen_add(sn, replica, node, true, fn, -1)
    end
  end
  return tok
end
-- purge returns the slots and KV tokens of leases whose expiry has passed (their replica
-- stopped refreshing them: it died) and forgets tombstones that served their time.
local function purge(st, lz, lh, done, nk, nm, sn, sr, pk, ps, lk, now)
  local ids = redis.call('ZRANGEBYSCORE', lz, '-inf', now, 'LIMIT', 0, 256)
  for i = 1, #ids do
    local rec = redis.call('HGET', lh, ids[i])
    if rec then
      untake(st, nk, nm, sn, sr, pk, ps, lk, ids[i], rec)
      redis.call('HDEL', lh, ids[i])
    end
    redis.call('ZREM', lz, ids[i])
  end
  redis.call('ZREMRANGEBYSCORE', done, '-inf', now)
end
-- refill is bucket.refilled: tokens held at t, refilled to now at rate up to top; an
-- instant not after t adds nothing and keeps t.
local function refill(tok, t, now, top, rate)
  local dt = now - t
  if dt > 0 then
    tok = tok + dt * rate
    if not (tok < top) then tok = top end
    return tok, now
  end
  return tok, t
end
-- bucket_read is a stored bucket {tok, t, cap, rate}, or nil when there is none.
local function bucket_read(key)
  local v = redis.call('HMGET', key, 'tok', 't', 'cap', 'rate')
  if not v[1] then return nil end
  return {tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])}
end
-- bucket_load is TokenBucket(cap, rate, now) for a new bucket, else set_limits(cap, rate,
-- now): the elapsed time refilled at the stored rate up to the larger capacity, then a
-- shrink clamps.
local function bucket_load(key, cap, rate, now)
  local b = bucket_read(key)
  if not b then return {cap, now, cap, rate} end
  local top = b[3]
  if cap > top then top = cap end
  b[1], b[2] = refill(b[1], b[2], now, top, b[4])
  if cap ~= b[3] or rate ~= b[4] then
    b[3] = cap
    b[4] = rate
    if b[1] > cap then b[1] = cap end
  end
  return b
end
-- bucket_save writes a bucket; a tenant's (expire_s >= 0) goes away once it would be full.
local function bucket_save(key, b, expire_s)
  redis.call('HSET', key, 'tok', fmt(b[1]), 't', fmt(b[2]), 'cap', fmt(b[3]), 'rate', fmt(b[4]))
  if expire_s >= 0 then
    local full_in = (b[3] - b[1]) / b[4]
    redis.call('PEXPIRE', key, math.ceil((full_in + expire_s) * 1000))
  end
end
-- bucket_give is TokenBucket.give(n, now) on a stored bucket; a missing one is full at cap.
local function bucket_give(key, n, cap, rate, now, expire_s)
  local b = bucket_read(key)
  if b then
    b[1], b[2] = refill(b[1], b[2], now, b[3], b[4])
  else
    b = {cap, now, cap, rate}
  end
  local tok = b[1] + n
  if not (tok < b[3]) then tok = b[3] end
  b[1] = tok
  bucket_save(key, b, expire_s)
end
-- view is what every reply ends with, after a '|': the store's instant, the version of
-- the pool's counters (it orders replies that arrive on different connections), slots in
-- use, KV tokens in flight, the pool bucket (tok t cap rate, '-' without one) and the
-- slots per class as class=n. One string: cheap for the client to read.
local function view(now, st, pbk, has_pb)
  local v = redis.call('HINCRBY', st, 'v', 1)
  local h = redis.call('HGETALL', st)
  local n, kv, cls = '0', '0', {}
  for i = 1, #h, 2 do
    local f = h[i]
    if f == 'n' then n = h[i + 1]
    elseif f == 'kv' then kv = h[i + 1]
    elseif string.sub(f, 1, 2) == 'c:' then cls[#cls + 1] = string.sub(f, 3) .. '=' .. h[i + 1] end
  end
  local pb = '- - - -'
  if has_pb then
    local b = redis.call('HMGET', pbk, 'tok', 't', 'cap', 'rate')
    if b[1] then pb = b[1] .. ' ' .. b[2] .. ' ' .. b[3] .. ' ' .. b[4] end
  end
  return '|' .. fmt(now) .. ' ' .. v .. ' ' .. n .. ' ' .. kv .. ' ' .. pb .. ' ' .. table.concat(cls, ' ')
end
"""

# KEYS: PoolKeys; ARGV[1]: AdmitArg; ARGV[2]: NodeArg, or '-' when the pool picks no node;
# ARGV[3]: ChainLink words, or '-'. Returns "1 inflight b_tok b_cap b_rate node keys credit
# by_affinity|view" (granted; '-' without a bucket or a node; keys: the prefix keys the lease
# took, credit: the tokens it was charged less, by_affinity: 1 when the prefix chose the
# node), "0 budget retry retryable needed used limit [node holds]...|view" (refused; a node
# refusal names every candidate's holds over every replica, as ``redis_ledger.node_totals``
# reads them), "2|view" (id cancelled),
# "3 seconds|view" (the ledger is being rebuilt after Redis lost it: no admission for that long).
_ADMIT = _PRELUDE + r"""
$keys
local a = args(ARGV[1])
$admit
purge(st, lz, lh, done, nk, nm, sn, sr, pk, ps, lk, now)
if redis.call('ZSCORE', done, id) then return '2' .. view(now, st, pbk, pcap ~= nil) end
local sv = redis.call('HMGET', st, 'n', 'kv')
local inflight, kvin = tonumber(sv[1]) or 0, tonumber(sv[2]) or 0
local pb, tb
if pcap then pb = bucket_load(pbk, pcap, prate, now) end
if tcap then tb = bucket_load(tbk, tcap, trate, now) end
local function save()
  if pb then bucket_save(pbk, pb, -1) end
  if tb then bucket_save(tbk, tb, texp) end
end
-- granted's node part: the node, the prefix keys the lease took there, its credit (tokens)
-- and whether affinity chose it over a roomier node (1/0)
local function granted(nin, node, k, credit, by_aff)
  local b = pb
  if tb and (b == nil or tb[1] < b[1]) then b = tb end
  local head = '1 ' .. nin
  if b then head = head .. ' ' .. fmt(b[1]) .. ' ' .. fmt(b[3]) .. ' ' .. fmt(b[4])
  else head = head .. ' - - -' end
  return head .. ' ' .. node .. ' ' .. k .. ' ' .. fmt(credit) .. ' ' .. by_aff .. view(now, st, pbk, pb ~= nil)
end
local held_rec = redis.call('HGET', lh, id)
if held_rec then
  -- a retried round trip whose first attempt was applied: the grant stands, once
  save()
  local _, _, node = rec_fields(held_rec)
  local k = 0
  local ks = redis.call('HGET', lk, id)
  if ks then for _ in string.gmatch(ks, '%S+') do k = k + 1 end end
  return granted(inflight, node, k, 0, 0)
end
-- the rebuild window: Redis lost the ledger (a restart) and the replicas take their live
-- leases again before anyone decides over it
local rebuild_ms = redis.call('PTTL', rb)
if rebuild_ms > 0 then return '3 ' .. fmt(rebuild_ms / 1000) .. view(now, st, pbk, pb ~= nil) end
local function refused(r)
  save()
  -- fairshare.wants: a refusal for lack of room of a request that waits makes this replica
  -- want room (a 429 answered at once wants nothing)
  if waits == 1 and r[3] == 1 and WANTING[r[1]] then
    local w = fmt(now) .. ' ' .. n
    if r[8] then w = w .. ' ' .. r[8] end
    redis.call('HSET', st, 'w:' .. replica_of(id), w)
  end
  local holds = ''
  if r[7] then holds = ' ' .. r[7] end
  return '0 ' .. r[1] .. ' ' .. fmt(r[2]) .. ' ' .. r[3] .. ' ' .. fmt(r[4]) .. ' ' .. fmt(r[5]) .. ' '
    .. fmt(r[6]) .. holds .. view(now, st, pbk, pb ~= nil)
end
-- pick_node is shared_nodes.pick_shared (rules.pick_node over every replica's holds) on
-- the NodeArg words q: the node picked, its hold and the moments that join the node's
-- sums (zeros without pooled growth), or nil, 0 and the refusal.
-- others is shared_nodes.others_seen: what the other replicas' leases on node that a
-- report with mark instant since (nil: none) saw in the cache still hold there.
local me, gens = replica_of(id), nil
-- fairshare: the wants this replica defers to (another replica's, recent, for a request no
-- larger than this one, of a replica holding fewer leases), read before the pick
local mine = tonumber(redis.call('HGET', st, 'r:' .. me)) or 0
local deferred = {}
if mine > 0 then
  local h = redis.call('HGETALL', st)
  for i = 1, #h, 2 do
    local f = h[i]
    if string.sub(f, 1, 2) == 'w:' then
      local who, w = string.sub(f, 3), args(h[i + 1])
      if now - tonumber(w[1]) >= FAIR_S then redis.call('HDEL', st, f)
      elseif who ~= me and tonumber(w[2]) <= n then
        w.leases = tonumber(redis.call('HGET', st, 'r:' .. who)) or 0
        if w.leases < FAIR_SLACK * mine then deferred[#deferred + 1] = w end
      end
    end
  end
end
-- target is the node a node want is closest to fitting by its reading over every
-- replica's holds now (held_at), nil for a want of slots or pool KV
local held_at = {}
local function target(w)
  if #w <= 2 then return nil end
  local t, tr = nil, nil
  for i = 4, #w - 1, 2 do
    local h = held_at[w[i]]
    if h then
      local r = tonumber(w[i + 1]) - h
      if tr == nil or r > tr then t, tr = w[i], r end
    end
  end
  return t
end
local function others(node, since, idle)
  if since == nil then return 0 end
  if gens == nil then gens = redis.call('HGETALL', sr) end
  local total = 0
  for i = 1, #gens, 2 do
    if gens[i] ~= me then
      local s = args(gens[i + 1])
      local new_at, old_at = tonumber(s[1]), tonumber(s[2])
      local kf, ki = nil, nil
      if new_at and new_at < since then kf, ki = 'F', 'I'
      elseif old_at and old_at < since then kf, ki = 'f', 'i' end
      if kf then
        local p = gens[i] .. '\t' .. node .. '\t'
        total = total + (tonumber(redis.call('HGET', sn, p .. kf)) or 0)
        if idle == 1 then total = total + (tonumber(redis.call('HGET', sn, p .. ki)) or 0) end
      end
    end
  end
  return total
end
-- bound is rules.pooled_bound of a node's sums with the request's, at the z of the NodeArg.
local function bound(l, m, v, z)
  if z == nil or l <= 0 then return math.max(0, l) end
  local b = m + z * math.sqrt(math.max(0.0, v))
  return math.min(l, math.max(0, math.ceil(b - 1e-9)))
end
-- links: the prompt's prefix chain, {key, end} each (ARGV[3]; at most MAX_LINKS)
local links = {}
if ARGV[3] and ARGV[3] ~= '-' then
  local c = args(ARGV[3])
  $each_link
    if #links < MAX_LINKS then links[#links + 1] = {key, upto} end
  end
end
local function pick_node(q)
  $node
  local best, best_room, by_wm, chosen = nil, nil, false, nil
  local roomiest, roomiest_name, got, keys, blk = nil, nil, 0, 0, 0
  -- holds: every replica's holds on each node as the refusal saw them (node_totals), so
  -- that the refused replica's retry hint does not read them as old as its last refresh
  local holds = {}
  local bases = {}
  local fitting = {}
  $each_node
    local b, d, e, kn, x = ps_read(ps, name)
    local gone = others(name, since, idle) - x
    if gone > 0 then foreign = foreign - gone end
    if foreign < rise then foreign = rise end
    local held = tonumber(redis.call('HGET', nk, name)) or 0
    local sharing = ps_shared(b, d, e)
    if pl then
      -- pooled growth: the footprints, and the bound of every request's growth with this one's
      local sl, sm, sv = moments_of(nm, name)
      held_at[name] = held + bound(sl, sm, sv, z) - sharing
      held = held + fp + bound(sl + pl, sm + pm, sv + pv, z) - need
    else
      held_at[name] = held - sharing
    end
    holds[#holds + 1] = name .. ' ' .. fmt(held_at[name])
    -- the prompt blocks the node's leases share, and what this request shares with them
    local cr, k = credit(pk, links, name, block, b, d, e, kn)
    if cr > pt then cr = pt end
    held = held - sharing - cr
    local bonus = cr
    if cached > bonus then bonus = cached end
    local eff = math.floor(cap * (1.0 - reserve))
    if eff < 0 then eff = 0 end
    local room = eff - foreign - held
    local lim = eff
    if wm < 1.0 and math.floor(wm * eff) < lim then lim = math.floor(wm * eff) end
    bases[#bases + 1] = name .. ' ' .. fmt(lim - foreign)
    if best_room == nil or room > best_room then best_room = room end
    if need > room then
      -- no room
    elseif wm < 1.0 and foreign + held + need > math.floor(wm * eff) then
      by_wm = true
    else
      local score = room
      if bonus > 0 then score = room + math.floor(bonus * aff) end
      fitting[#fitting + 1] = {score, name, cr, k, block, room}
    end
  end
  -- the nodes the deferred wants gather room on are taken last (w.t: each want's target,
  -- read again by the yield below)
  local avoid = {}
  for _, w in ipairs(deferred) do
    w.t = target(w)
    if w.t then avoid[w.t] = true end
  end
  local best_avoided, roomiest_avoided = nil, nil
  for _, f in ipairs(fitting) do
    if avoid[f[2]] then
      if best_avoided == nil or f[1] > best_avoided[1] then best_avoided = f end
      if roomiest_avoided == nil or f[6] > roomiest_avoided[6] then roomiest_avoided = f end
    else
      if roomiest == nil or f[6] > roomiest then roomiest, roomiest_name = f[6], f[2] end
      if best == nil or f[1] > best then best, chosen, got, keys, blk = f[1], f[2], f[3], f[4], f[5] end
    end
  end
  if chosen == nil and best_avoided then
    best, chosen, got, keys, blk = best_avoided[1], best_avoided[2], best_avoided[3], best_avoided[4], best_avoided[5]
    roomiest_name = roomiest_avoided[2]
  end
  if chosen then
    local by_aff = 0
    if chosen ~= roomiest_name then by_aff = 1 end
    -- with pooled growth the lease holds its footprint, and its moments join the node's sums
    if pl then return chosen, fp, nil, pl, pm, pv, got, keys, by_aff, blk end
    return chosen, need, nil, 0, 0, 0, got, keys, by_aff, blk
  end
  local r = best_room or 0
  local budget = B_NODE_KV
  if by_wm then budget = B_CLASS_KV end
  return nil, 0, {budget, est, 1, need, r, r, table.concat(holds, ' '), fmt(need) .. ' ' .. table.concat(bases, ' ')}
end
local function wait_for(tokens, cap, rate)
  if n <= tokens + FIT then return 0 end
  if n > cap + FIT then return math.huge end
  return (n - tokens) / rate
end
local function bucket_wait(tokens, cap, rate)
  local w = wait_for(tokens, cap, rate)
  if w == math.huge then w = math.max(est, (n - tokens) / rate) end
  return w
end
-- slot_refusal is slots.slot_refusal: B_SLOTS, B_RESERVED_SLOTS or nil (a slot is free).
local function slot_refusal()
  if inflight >= limit then return B_SLOTS end
  if #a < guarantees then return nil end
  local reserved = 0
  $each_guarantee
    if name ~= cls then
      local free = g - (tonumber(redis.call('HGET', st, 'c:' .. name)) or 0)
      if free > 0 then reserved = reserved + free end
    end
  end
  if inflight + 1 + reserved > limit then return B_RESERVED_SLOTS end
  return nil
end
-- decide is rules.decide on the state loaded above: nil (admit) or the refusal
-- {budget, retry, retryable, needed, used, limit}.
local function decide()
  -- step 1: never fits, not even at scale 1.0
  if base_kv and n > base_kv then return {B_KV, 0, 0, n, kvin, base_kv} end
  if cbase and n > cbase then return {B_CLASS_KV, 0, 0, n, kvin, cbase} end
  if tb and n > tbase + FIT then return {B_TENANT_TPM, 0, 0, n, 0, tbase} end
  if pb and n > pbase + FIT then return {B_POOL_TPM, 0, 0, n, 0, pbase} end
  local first = nil
  local wait = 0
  -- step 2: slots
  local slots = slot_refusal()
  if slots then
    first = {slots, est, 1, 1, inflight, limit}
    wait = est
  end
  -- step 3: in-flight KV tokens: the pool's budget, then the class's ceiling
  if kvb and kvin + n > kvb then
    if not first then first = {B_KV, est, 1, n, kvin, kvb} end
    wait = est
  elseif ckv and kvin + n > ckv then
    if not first then first = {B_CLASS_KV, est, 1, n, kvin, ckv} end
    wait = est
  end
  -- step 4: the tenant's bucket, then the pool's
  if tb and n > tb[1] + FIT then
    local w = bucket_wait(tb[1], tb[3], tb[4])
    if not first then first = {B_TENANT_TPM, w, 1, n, tb[1], tb[3]} end
    wait = math.max(wait, w)
  end
  if pb and n > pb[1] + FIT then
    local w = bucket_wait(pb[1], pb[3], pb[4])
    if not first then first = {B_POOL_TPM, w, 1, n, pb[1], pb[3]} end
    wait = math.max(wait, w)
  end
  if first then first[2] = wait end
  return first
end
-- the node is checked before the pool's budgets, as the controller does with an
-- in-process store
local node, hold, gl, gm, gv, got, keys, by_aff, block = '-', 0, 0, 0, 0, 0, 0, 0, 0
if ARGV[2] ~= '-' then
  local picked, need, refusal, l, m, v, cr, k, ba, blk = pick_node(args(ARGV[2]))
  if refusal then return refused(refusal) end
  node, hold, gl, gm, gv, got, keys, by_aff, block = picked, need, l, m, v, cr, k, ba, blk
end
local refusal = decide()
if refusal then return refused(refusal) end
-- fairshare.yields: another replica wanted room lately for a request no larger than this
-- one and holds fewer leases: this one leaves the room to it (refused as fair_share,
-- retryable, with this replica's leases and the other's; it wants nothing)
-- (a node want is yielded to only where this request took the node it gathers room on;
-- w.t is its target as the pick read it, nil without a pick)
for _, w in ipairs(deferred) do
  if #w <= 2 or w.t == nil or w.t == node or w.leases < FAIR_FAR * mine then
    save()
    return '0 ' .. B_FAIR_SHARE .. ' ' .. fmt(est) .. ' 1 1 ' .. mine .. ' ' .. w.leases .. view(now, st, pbk, pb ~= nil)
  end
end
redis.call('HDEL', st, 'w:' .. me)
leases_add(st, me, 1)
local nin = redis.call('HINCRBY', st, 'n', 1)
redis.call('HINCRBY', st, 'c:' .. cls, 1)
redis.call('HINCRBY', st, 'kv', n)
if node ~= '-' then
  redis.call('HINCRBY', nk, node, hold)
  moments_add(nm, node, gl, gm, gv, 1)
  prefix_take(pk, ps, lk, id, node, links, keys, block)
end
redis.call('HSET', lh, id, record(cls, n, node, hold, 0, 0, 0, gl, gm, gv))
redis.call('ZADD', lz, now + ttl, id)
if pb then pb[1] = pb[1] - n end
if tb then tb[1] = tb[1] - n end
save()
return granted(nin, node, keys, got, by_aff)
"""

# KEYS: PoolKeys; ARGV[1]: SettleArg.
# Returns "1|view" when this call released the lease, "0|view" when nothing was held.
_SETTLE = _PRELUDE + r"""
$keys
local a = args(ARGV[1])
$settle
purge(st, lz, lh, done, nk, nm, sn, sr, pk, ps, lk, now)
-- the tombstone keeps a refresh or a late admit already on the wire from bringing it back
redis.call('ZADD', done, now + ttl, id)
local rec = redis.call('HGET', lh, id)
if not rec then return '0' .. view(now, st, pbk, pcap ~= nil) end
redis.call('HDEL', lh, id)
redis.call('ZREM', lz, id)
local tok = untake(st, nk, nm, sn, sr, pk, ps, lk, id, rec)
local refund = tok - charged
if refund ~= 0 then
  if pcap then bucket_give(pbk, refund, pcap, prate, now, -1) end
  if tcap then bucket_give(tbk, refund, tcap, trate, now, texp) end
end
return '1' .. view(now, st, pbk, pcap ~= nil)
"""

# KEYS: RefreshKeys; ARGV: RefreshArg, then RefreshLease words.
# Extends this replica's live leases and moves each one's node hold to the one given
# (the growth estimate changes as tokens are generated); re-takes those Redis lost (a
# restart) unless settled. Returns "restored|view".
_REFRESH = _PRELUDE + r"""
$keys
$refresh
local exp = now + ttl
local restored = 0
-- the replica's generations: the first call of a round makes the newest the one before
local new_at, old_at, cur = stamps(sr, replica)
if cur ~= round then
  local p = replica .. '\t'
  local h = redis.call('HGETALL', sn)
  for i = 1, #h, 2 do
    local kind = string.sub(h[i], -1)
    if string.sub(h[i], 1, #p) == p and (kind == 'f' or kind == 'i') then redis.call('HDEL', sn, h[i]) end
  end
  for i = 1, #h, 2 do
    local kind = string.sub(h[i], -1)
    if string.sub(h[i], 1, #p) == p and (kind == 'F' or kind == 'I') then
      redis.call('HDEL', sn, h[i])
      redis.call('HSET', sn, string.sub(h[i], 1, -2) .. string.lower(kind), h[i + 1])
    end
  end
  old_at = new_at
end
local old_word = '-'
if old_at then old_word = fmt(old_at) end
redis.call('HSET', sr, replica, fmt(now) .. ' ' .. old_word .. ' ' .. round)
$each_lease
  seen = clamp_seen(seen, hold)
  if redis.call('ZSCORE', lz, id) then
    redis.call('ZADD', lz, exp, id)
    local old = redis.call('HGET', lh, id)
    if old and node ~= '-' then
      local _, _, old_node, old_hold, rnd, fn, fo, ol, om, ov = rec_fields(old)
      if old_node == node then
        if old_hold ~= hold then redis.call('HINCRBY', nk, node, hold - old_hold) end
        if ol ~= l or om ~= m or ov ~= v then
          moments_add(nm, node, ol, om, ov, -1)
          moments_add(nm, node, l, m, v, 1)
        end
        -- what this round saw of it joins the newest generation; what the round before
        -- saw is in the one before (older rounds' sums are gone)
        local before = 0
        if rnd == round then
          before = fo
          seen_add(sn, replica, node, false, fn, -1)
        elseif rnd == round - 1 then
          before = fn
        end
        seen_add(sn, replica, node, false, seen, 1)
        local kept = clamp_seen(before, hold)
        if kept ~= before then
          seen_add(sn, replica, node, true, before, -1)
          seen_add(sn, replica, node, true, kept, 1)
        end
        redis.call('HSET', lh, id, record(cls, tok, node, hold, round, seen, kept, l, m, v))
      end
    end
  elseif not redis.call('ZSCORE', done, id) then
    redis.call('ZADD', lz, exp, id)
    redis.call('HSET', lh, id, record(cls, tok, node, hold, round, seen, 0, l, m, v))
    redis.call('HINCRBY', st, 'n', 1)
    leases_add(st, replica_of(id), 1)
    redis.call('HINCRBY', st, 'c:' .. cls, 1)
    redis.call('HINCRBY', st, 'kv', tok)
    if node ~= '-' then
      redis.call('HINCRBY', nk, node, hold)
      moments_add(nm, node, l, m, v, 1)
      seen_add(sn, replica, node, false, seen, 1)
    end
    restored = restored + 1
  end
end
purge(st, lz, lh, done, nk, nm, sn, sr, pk, ps, lk, now)
return restored .. view(now, st, pbk, has_pb == 1)
"""

# KEYS: HeartbeatKeys; ARGV: HeartbeatArg. Returns {present replicas (this one included),
# then id, address of each replica whose heartbeat expired and that is still remembered}.
_HEARTBEAT = _CLOCK + r"""
$keys
$heartbeat
redis.call('ZADD', replicas, now + ttl, replica)
redis.call('ZREM', gone, replica)
if addr ~= '-' then redis.call('HSET', addrs, replica, addr) end
local expired = redis.call('ZRANGEBYSCORE', replicas, '-inf', now)
for i = 1, #expired do
  redis.call('ZADD', gone, 'NX', now + gone_ttl, expired[i])
  redis.call('ZREM', replicas, expired[i])
end
local forgotten = redis.call('ZRANGEBYSCORE', gone, '-inf', now)
for i = 1, #forgotten do redis.call('HDEL', addrs, forgotten[i]) end
redis.call('ZREMRANGEBYSCORE', gone, '-inf', now)
local out = {redis.call('ZCARD', replicas)}
local ids = redis.call('ZRANGE', gone, 0, -1)
for i = 1, #ids do
  out[#out + 1] = ids[i]
  out[#out + 1] = redis.call('HGET', addrs, ids[i]) or '-'
end
return out
"""

# KEYS: RefreshKeys; ARGV: ReleaseArg. Releases every lease of a replica that is known to be
# dead (its own and those it granted alone), with tombstones. Returns "released|view".
_RELEASE = _PRELUDE + r"""
$keys
$release
local mine, alone = replica .. '.', 'local:' .. replica .. '.'
local released = 0
local ids = redis.call('ZRANGE', lz, 0, -1)
for i = 1, #ids do
  local id = ids[i]
  if string.sub(id, 1, #mine) == mine or string.sub(id, 1, #alone) == alone then
    local rec = redis.call('HGET', lh, id)
    if rec then
      untake(st, nk, nm, sn, sr, pk, ps, lk, id, rec)
      redis.call('HDEL', lh, id)
      released = released + 1
    end
    redis.call('ZREM', lz, id)
    redis.call('ZADD', done, now + ttl, id)
  end
end
redis.call('HDEL', sr, replica)
local p = replica .. '\t'
local h = redis.call('HKEYS', sn)
for i = 1, #h do
  if string.sub(h[i], 1, #p) == p then redis.call('HDEL', sn, h[i]) end
end
return released .. view(now, st, pbk, pbk ~= st)
"""


class Script:
    """Script is a Lua script, its SHA1 (the name ``EVALSHA`` knows it by) and its KEYS layout."""

    __slots__ = ("source", "sha", "keys")

    def __init__(self, source: str, keys: Layout) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.keys = keys

    def command(self, keys: tuple[str, ...], *argv: Any) -> tuple[Any, ...]:
        """command is the ``EVALSHA`` of this script on ``keys`` (a value of its KEYS layout)."""
        if type(keys) is not self.keys:
            raise TypeError(f"{self.keys.__name__} expected, got {type(keys).__name__}")
        return ("EVALSHA", self.sha, len(keys), *keys, *argv)


def _keys(layout: Layout) -> str:
    return lua_locals(layout, "KEYS")


ADMIT = Script(_script(_ADMIT, keys=_keys(PoolKeys),
                       admit=lua_locals(AdmitArg, "a", expand={"pool": AdmitPool}, group="guarantees"),
                       node=lua_locals(NodeArg, "q", group="nodes"),
                       each_node=lua_each(NodeCandidate, "q", "nodes"),
                       each_link=lua_each(ChainLink, "c", 1),
                       each_guarantee=lua_each(Guarantee, "a", "guarantees")), PoolKeys)
SETTLE = Script(_script(_SETTLE, keys=_keys(PoolKeys), settle=lua_locals(SettleArg, "a")), PoolKeys)
REFRESH = Script(_script(_REFRESH, keys=_keys(RefreshKeys),
                         refresh=lua_locals(RefreshArg, "ARGV"),
                         each_lease=lua_each(RefreshLease, "ARGV", len(_fields(RefreshArg)) + 1)),
                 RefreshKeys)
HEARTBEAT = Script(_script(_HEARTBEAT, keys=_keys(HeartbeatKeys), heartbeat=lua_locals(HeartbeatArg, "ARGV")),
                   HeartbeatKeys)
RELEASE = Script(_script(_RELEASE, keys=_keys(RefreshKeys), release=lua_locals(ReleaseArg, "ARGV")), RefreshKeys)
SCRIPTS = (ADMIT, SETTLE, REFRESH, HEARTBEAT, RELEASE)
"""SCRIPTS are every script the store runs, loaded again when Redis lost them (NOSCRIPT)."""
