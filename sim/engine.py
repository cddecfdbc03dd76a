"""engine: a clock-driven model of one vLLM V1 engine (block pool, scheduler, batching).

The engine is pure: no I/O, no sleeping, no wall clock. It runs one forward pass ("step")
at a time over simulated seconds; the caller says what time it is (``advance(now)``) and
gets back what happened up to then. The HTTP layer drives it in real time; tests drive it
with explicit instants.

What it copies from vLLM V1's scheduler (facts, not code):
- Running requests are scheduled first, in arrival order, each asking for the tokens it
  has not computed yet (a decode asks for one), within a per-step token budget
  (``max_num_batched_tokens``: chunked prefill).
- Blocks are allocated for the tokens scheduled. When a running request cannot get a
  block, the newest running request is preempted: its blocks are freed, its computed
  tokens forgotten (recompute), and it goes back to the front of the waiting queue.
  With ``overflow="crash"`` the node instead fails every running request and empties the
  pool and its prefix cache (the OOM of an engine without preemption headroom).
- Waiting requests are admitted in FIFO order (a request that does not fit blocks those
  behind it), only in steps with no preemption, up to ``max_num_seqs`` running.
- A request whose computed tokens catch up with its tokens samples one new token; it
  finishes when it has generated its target output length.

Step time: prefill tokens / ``prefill_tokens_per_s`` plus, when any request decodes,
``(1 / decode_tokens_per_s) * (1 + batch_slowdown * (decoding - 1))`` seconds: a decode
step grows with batch size.

Prefix caching (``enable_prefix_caching``, off by default here; vLLM V1 turns it on by
default), as vLLM's KV cache manager and scheduler do it (vllm/v1/core/kv_cache_manager.py,
sched/scheduler.py):
- A waiting request (new, or preempted) starts from the longest chain of cached full blocks
  of its tokens (prompt and, after a preemption, its generated tokens), but never all of
  them: the last token is always computed, and hits are whole blocks, so a prompt of
  exactly k blocks reuses k - 1. Reused tokens are computed already: they cost no prefill
  time and take no step budget.
- Admission needs free blocks for the new blocks and for the hit blocks that sit in the
  free queue (taking them makes them unevictable).
- Full blocks get their hash when they are allocated for the tokens a step computes,
  generated tokens included, so a request admitted after that, even in the same step, can
  hit them.
- Prefix-cache queries and hits (in tokens) are counted when a new request is admitted;
  a preempted request that comes back is not counted (vLLM keeps those apart and does not
  export them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from sim.blocks import ROOT_HASH, BlockPool, CachedBlock, PrefixCache, blocks_for, hash_block

OVERFLOW_MODES = ("preempt", "crash")


class SeqStatus(StrEnum):
    """SeqStatus is where a sequence stands in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class EventKind(StrEnum):
    """EventKind says what an ``Event`` reports."""

    TOKEN = "token"          # one new output token was sampled
    FINISHED = "finished"    # the sequence generated its target length (after its last TOKEN)
    FAILED = "failed"        # the engine crashed while the sequence ran


@dataclass(frozen=True, slots=True)
class Event:
    """Event is something that happened to sequence ``seq_id`` at simulated instant ``at`` (s)."""

    seq_id: int
    kind: EventKind
    at: float


@dataclass(slots=True)
class EngineParams:
    """EngineParams are the engine's settings; the runtime ones may change between steps.

    Capacities in tokens, rates in tokens per simulated second. ``batch_slowdown`` is the
    relative growth of a decode step per extra decoding sequence (0.01: 100 sequences
    make a step about twice as long as one). ``background_kv_tokens`` are KV tokens held
    by phantom load. ``enable_prefix_caching`` (fixed at start) shares and keeps full
    blocks by the hash of their token ids, as vLLM's flag of that name does.
    """

    kv_capacity_tokens: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 50.0
    batch_slowdown: float = 0.01
    overflow: str = "preempt"
    background_kv_tokens: int = 0
    enable_prefix_caching: bool = False

    def validate(self) -> None:
        """validate raises ValueError naming the first setting out of range."""
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.prefill_tokens_per_s > 0 or not self.decode_tokens_per_s > 0:
            raise ValueError("prefill_tokens_per_s and decode_tokens_per_s must be > 0")
        if not self.batch_slowdown >= 0:
            raise ValueError("batch_slowdown must be >= 0")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}")
        if self.background_kv_tokens < 0:
            raise ValueError("background_kv_tokens must be >= 0")


class Seq:
    """Seq is one request inside the engine.

    ``prompt_tokens`` and ``target_tokens`` (the output length it will generate) in
    tokens; ``max_tokens`` the request's cap (a target below it ends with "stop", as at an
    end-of-sequence token); ``num_computed`` is how many of its tokens have KV in the cache; ``blocks``
    how many pool blocks it holds, of which the first ``len(cached)`` are hashed blocks
    (shared with other sequences, with prefix caching). ``token_ids`` are the prompt's
    token ids (None: unknown, so shared with nobody); ``hashes`` the chain hashes of its
    full blocks so far; ``cached_tokens`` the tokens its first admission found cached.
    Times are simulated seconds.
    """

    __slots__ = ("id", "prompt_tokens", "target_tokens", "max_tokens", "arrival", "status",
                 "num_computed", "output_tokens", "blocks", "first_token_at", "finished_at",
                 "preemptions", "token_ids", "cached", "hashes", "cached_tokens")

    def __init__(self, seq_id: int, prompt_tokens: int, target_tokens: int, max_tokens: int,
                 arrival: float, token_ids: Sequence[int] | None = None) -> None:
        self.id = seq_id
        self.prompt_tokens = prompt_tokens
        self.target_tokens = target_tokens
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.output_tokens = 0
        self.blocks = 0
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.preemptions = 0
        self.token_ids = token_ids
        self.cached: list[CachedBlock] = []
        self.hashes: list[bytes] = []
        self.cached_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """num_tokens is prompt + generated tokens: what the sequence's KV must cover."""
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class _Step:
    """_Step is one forward pass in flight: what it computes and when it ends (s)."""

    start: float
    end: float
    scheduled: list[tuple[Seq, int]]


@dataclass(slots=True)
class EngineStats:
    """EngineStats is a snapshot of the engine for metrics and tests.

    Block counts in blocks; ``kv_usage`` a ratio in [0, 1]; counters are totals since
    start (``prompt_tokens``: prompts of requests that produced their first token;
    ``generation_tokens``: sampled tokens; ``prefix_cache_queries`` and
    ``prefix_cache_hits``: tokens of new requests looked up, and found, in the prefix
    cache). ``used_blocks`` counts a shared block once; ``cached_free_blocks`` are hashed
    blocks nobody holds (free, kept until evicted).
    """

    running: int
    waiting: int
    total_blocks: int
    used_blocks: int
    background_blocks: int
    kv_usage: float
    preemptions: int
    crashes: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int] = field(default_factory=dict)
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_free_blocks: int = 0


class Engine:
    """Engine is one simulated vLLM V1 engine over simulated time (seconds).

    Call ``add`` when a request arrives, ``abort`` when its client leaves, and
    ``advance(now)`` to run every step that ends by ``now``; events come back from
    ``advance``. Instants passed in must not go backwards.

    ``output_token(seq_id, index)`` gives the token id of a sequence's ``index``-th
    generated token (hashed into blocks that fill with output); by default every
    generated token is unique to its sequence.
    """

    __slots__ = ("params", "pool", "prefix_cache", "_output_token", "_running", "_waiting", "_seqs",
                 "_step", "_free_at", "_events", "_next_id", "preemptions", "crashes",
                 "prompt_tokens_total", "generation_tokens_total", "finished_by_reason",
                 "prefix_cache_queries", "prefix_cache_hits")

    def __init__(self, params: EngineParams,
                 output_token: Callable[[int, int], int] | None = None) -> None:
        params.validate()
        self.params = params
        self.pool = BlockPool(params.kv_capacity_tokens // params.block_size, params.block_size)
        self.pool.set_background_tokens(params.background_kv_tokens)
        self.prefix_cache = PrefixCache(self.pool) if params.enable_prefix_caching else None
        self._output_token = output_token
        self._running: list[Seq] = []
        self._waiting: deque[Seq] = deque()
        self._seqs: dict[int, Seq] = {}
        self._step: _Step | None = None
        self._free_at = 0.0
        self._events: list[Event] = []
        self._next_id = 0
        self.preemptions = 0
        self.crashes = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason = {"length": 0, "stop": 0, "abort": 0, "error": 0}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- inputs ------------------------------------------------------------------

    def add(self, now: float, prompt_tokens: int, target_tokens: int,
            max_tokens: int | None = None, token_ids: Sequence[int] | None = None) -> int:
        """add queues a request of ``prompt_tokens`` that will generate ``target_tokens``; returns its id.

        ``max_tokens`` (default: ``target_tokens``) is the request's output cap, used only
        for the finish reason. ``token_ids`` are the prompt's token ids (after the chat
        template), what prefix caching hashes; without them the prompt shares no block.
        Raises ValueError for a request that could never fit the KV cache, or ids that
        are not ``prompt_tokens`` long.
        """
        cap = target_tokens if max_tokens is None else max_tokens
        if prompt_tokens < 1 or target_tokens < 1 or cap < target_tokens:
            raise ValueError("a request needs >= 1 prompt token and 1 <= target <= max_tokens")
        if blocks_for(prompt_tokens + target_tokens, self.pool.block_size) > self.pool.total:
            raise ValueError("request larger than the whole KV cache")
        if token_ids is not None and len(token_ids) != prompt_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a prompt of {prompt_tokens} tokens")
        seq = Seq(self._next_id, prompt_tokens, target_tokens, cap, now, token_ids)
        self._next_id += 1
        self._seqs[seq.id] = seq
        self._waiting.append(seq)
        self._kick(now)
        return seq.id

    def abort(self, now: float, seq_id: int) -> bool:
        """abort drops a waiting or running request and frees its blocks; False if it had ended."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None or seq.status not in (SeqStatus.WAITING, SeqStatus.RUNNING):
            return False
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.ABORTED
        seq.finished_at = now
        self.finished_by_reason["abort"] += 1
        self._kick(now)
        return True

    def configure(self, now: float, **changes: object) -> None:
        """configure changes runtime parameters (rates, slowdown, overflow, background) from the next step.

        Raises ValueError (and changes nothing) for an unknown name or a value out of range.
        """
        allowed = {"prefill_tokens_per_s", "decode_tokens_per_s", "batch_slowdown", "overflow",
                   "background_kv_tokens"}
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"unknown runtime parameter {sorted(unknown)[0]!r}")
        trial = EngineParams(**{name: getattr(self.params, name) for name in EngineParams.__slots__})
        for name, value in changes.items():
            setattr(trial, name, value)
        trial.validate()
        for name, value in changes.items():
            setattr(self.params, name, value)
        self.pool.set_background_tokens(self.params.background_kv_tokens)
        if self.prefix_cache is not None:
            self.prefix_cache.trim()  # phantom load took the room of cached free blocks
        self._kick(now)

    # --- time --------------------------------------------------------------------

    def advance(self, now: float) -> list[Event]:
        """advance runs every step that ends at or before ``now`` (s) and returns the events so far."""
        while self._step is not None and self._step.end <= now:
            step = self._step
            self._step = None
            self._free_at = step.end
            self._complete(step)
            self._kick(step.end)
        events, self._events = self._events, []
        return events

    def next_step_end(self) -> float | None:
        """next_step_end is when the step in flight ends (s), or None while the engine idles."""
        return self._step.end if self._step is not None else None

    # --- views -------------------------------------------------------------------

    def seq(self, seq_id: int) -> Seq | None:
        """seq returns a live (waiting or running) sequence by id, or None."""
        return self._seqs.get(seq_id)

    def stats(self) -> EngineStats:
        """stats returns a snapshot of queues, blocks and counters."""
        cache = self.prefix_cache
        return EngineStats(
            running=len(self._running), waiting=len(self._waiting),
            total_blocks=self.pool.total, used_blocks=self.pool.used,
            background_blocks=self.pool.background, kv_usage=self.pool.usage,
            preemptions=self.preemptions, crashes=self.crashes,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            finished=dict(self.finished_by_reason), prefix_caching=cache is not None,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            cached_free_blocks=len(cache.free_queue) if cache is not None else 0)

    def cached_prefix(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """cached_prefix is what the prefix cache holds now of a prompt with ``token_ids``
        (after the chat template): (tokens of its longest cached prefix, of those the tokens
        in blocks running requests hold). As ``_admit`` looks up, never its last token;
        (0, 0) without prefix caching. Changes nothing: a benchmark's oracle reads it."""
        cache = self.prefix_cache
        if cache is None:
            return 0, 0
        bs = self.pool.block_size
        parent, hashes = ROOT_HASH, []
        for k in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[k * bs:(k + 1) * bs])
            hashes.append(parent)
        hit = cache.longest_hit(hashes)
        return len(hit) * bs, sum(1 for b in hit if b.ref > 0) * bs

    def held_blocks(self) -> int:
        """held_blocks counts the blocks live sequences hold, a shared one once (equals ``pool.used``)."""
        seqs = self._seqs.values()
        shared = {id(b) for s in seqs for b in s.cached}
        return sum(s.blocks - len(s.cached) for s in seqs) + len(shared)

    def running(self) -> list[Seq]:
        """running returns the running sequences, oldest first (a copy)."""
        return list(self._running)

    # --- the scheduler -----------------------------------------------------------

    def _kick(self, now: float) -> None:
        # An idle engine starts a step as soon as something changes; a busy one picks
        # the change up when its step ends.
        if self._step is None:
            self._step = self._schedule(max(now, self._free_at))

    def _allocate(self, seq: Seq, tokens: int) -> bool:
        need = blocks_for(tokens, self.pool.block_size) - seq.blocks
        cache = self.prefix_cache
        if not (self.pool.take(need) if cache is None else cache.take(need)):
            return False
        if need > 0:
            seq.blocks += need
        if cache is not None:
            self._commit(seq, cache, tokens)
        return True

    def _token(self, seq: Seq, i: int) -> int:
        # The id of the sequence's i-th token (prompt, then generated).
        if i >= seq.prompt_tokens:
            if self._output_token is None:
                return _unique_token(seq.id, i)
            return self._output_token(seq.id, i - seq.prompt_tokens)
        return _unique_token(seq.id, i) if seq.token_ids is None else seq.token_ids[i]

    def _hashes(self, seq: Seq, n: int) -> list[bytes]:
        # Chain hashes of the sequence's first n full blocks, computed once each.
        bs = self.pool.block_size
        hashes = seq.hashes
        while len(hashes) < n:
            k = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            end = (k + 1) * bs
            if seq.token_ids is not None and end <= seq.prompt_tokens:
                block = seq.token_ids[k * bs:end]
            else:
                block = [self._token(seq, i) for i in range(k * bs, end)]
            hashes.append(hash_block(parent, block))
        return hashes[:n]

    def _commit(self, seq: Seq, cache: PrefixCache, tokens: int) -> None:
        # The blocks full once this step computes up to ``tokens`` get their hash now, as
        # vLLM caches them at allocation (capped at the tokens the sequence has).
        full = min(tokens, seq.num_tokens) // self.pool.block_size
        if full > len(seq.cached):
            for h in self._hashes(seq, full)[len(seq.cached):]:
                seq.cached.append(cache.commit(h))

    def _admit(self, seq: Seq, budget: int) -> int | None:
        # A waiting sequence's first allocation: the longest cached prefix (never its last
        # token), then new blocks for the tokens this step computes. Returns the tokens to
        # compute, or None (nothing changed) when the blocks are not free.
        cache = self.prefix_cache
        if cache is None:
            new = min(seq.num_tokens - seq.num_computed, budget)
            return new if self._allocate(seq, seq.num_computed + new) else None
        bs = self.pool.block_size
        hit = cache.longest_hit(self._hashes(seq, (seq.num_tokens - 1) // bs))
        hit_tokens = len(hit) * bs
        new = min(seq.num_tokens - hit_tokens, budget)
        need = blocks_for(hit_tokens + new, bs) - len(hit)
        if need + sum(1 for b in hit if b.ref == 0) > self.pool.free:
            return None
        cache.touch(hit)
        seq.cached = hit
        seq.blocks = len(hit)
        seq.num_computed = hit_tokens
        if seq.cached_tokens is None:
            seq.cached_tokens = hit_tokens
        if seq.preemptions == 0:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit_tokens
        if not self._allocate(seq, hit_tokens + new):
            raise AssertionError("blocks counted free must be allocatable")
        return new

    def _free(self, seq: Seq) -> None:
        if self.prefix_cache is None:
            self.pool.give_back(seq.blocks)
        else:
            self.prefix_cache.release(seq.cached, seq.blocks - len(seq.cached))
            seq.cached = []
        seq.blocks = 0

    def _preempt(self, seq: Seq) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(seq)

    def _crash(self, at: float) -> None:
        self.crashes += 1
        for seq in self._running:
            self._free(seq)
            seq.status = SeqStatus.FAILED
            seq.finished_at = at
            del self._seqs[seq.id]
            self.finished_by_reason["error"] += 1
            self._events.append(Event(seq.id, EventKind.FAILED, at))
        self._running.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # a crashed engine comes back with an empty cache

    def _schedule(self, t: float) -> _Step | None:
        p = self.params
        budget = p.max_num_batched_tokens
        scheduled: dict[Seq, int] = {}
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            new = min(seq.num_tokens - seq.num_computed, budget)
            if not self._allocate(seq, seq.num_computed + new):
                if p.overflow == "crash":
                    self._crash(t)
                    return self._schedule(t)
                fits = False
                while self._running:
                    victim = self._running.pop()
                    budget += scheduled.pop(victim, 0)
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                    if self._allocate(seq, seq.num_computed + new):
                        fits = True
                        break
                if not fits:
                    break
            scheduled[seq] = new
            budget -= new
            i += 1
        if not preempted:
            while self._waiting and budget > 0 and len(self._running) < p.max_num_seqs:
                seq = self._waiting[0]
                admitted = self._admit(seq, budget)
                if admitted is None:
                    break
                new = admitted
                self._waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self._running.append(seq)
                scheduled[seq] = new
                budget -= new
        if not scheduled:
            # Everything running was preempted: the freed blocks may now admit the head
            # of the queue, as the engine's next iteration would.
            return self._schedule(t) if preempted else None
        prefill = 0
        decoding = 0
        for seq, new in scheduled.items():
            if new == 1 and seq.output_tokens > 0:
                decoding += 1
            else:
                prefill += new
        duration = prefill / p.prefill_tokens_per_s
        if decoding:
            duration += (1.0 + p.batch_slowdown * (decoding - 1)) / p.decode_tokens_per_s
        return _Step(start=t, end=t + duration, scheduled=list(scheduled.items()))

    def _complete(self, step: _Step) -> None:
        at = step.end
        for seq, new in step.scheduled:
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += new
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk: no token yet
            seq.output_tokens += 1
            self.generation_tokens_total += 1
            if seq.first_token_at is None:
                seq.first_token_at = at
                self.prompt_tokens_total += seq.prompt_tokens
            self._events.append(Event(seq.id, EventKind.TOKEN, at))
            if seq.output_tokens >= seq.target_tokens:
                self._running.remove(seq)
                self._free(seq)
                seq.status = SeqStatus.FINISHED
                seq.finished_at = at
                self.finished_by_reason["length" if seq.output_tokens >= seq.max_tokens else "stop"] += 1
                del self._seqs[seq.id]
                self._events.append(Event(seq.id, EventKind.FINISHED, at))


def _unique_token(seq_id: int, position: int) -> int:
    """_unique_token is the id of a sequence's token at ``position`` that no other sequence has.

    It lies below every tokenizer id (>= 0) and the simulator's template ids (small negatives).
    """
    return -(1 << 62) + (seq_id << 32) + position
