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
  pool (the OOM of an engine without preemption headroom).
- Waiting requests are admitted in FIFO order (a request that does not fit blocks those
  behind it), only in steps with no preemption, up to ``max_num_seqs`` running.
- A request whose computed tokens catch up with its tokens samples one new token; it
  finishes when it has generated its target output length.

Step time: prefill tokens / ``prefill_tokens_per_s`` plus, when any request decodes,
``(1 / decode_tokens_per_s) * (1 + batch_slowdown * (decoding - 1))`` seconds: a decode
step grows with batch size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from sim.blocks import BlockPool, blocks_for

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
    by phantom load.
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
    how many pool blocks it holds. Times are simulated seconds.
    """

    __slots__ = ("id", "prompt_tokens", "target_tokens", "max_tokens", "arrival", "status",
                 "num_computed", "output_tokens", "blocks", "first_token_at", "finished_at",
                 "preemptions")

    def __init__(self, seq_id: int, prompt_tokens: int, target_tokens: int, max_tokens: int,
                 arrival: float) -> None:
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
    ``generation_tokens``: sampled tokens).
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


class Engine:
    """Engine is one simulated vLLM V1 engine over simulated time (seconds).

    Call ``add`` when a request arrives, ``abort`` when its client leaves, and
    ``advance(now)`` to run every step that ends by ``now``; events come back from
    ``advance``. Instants passed in must not go backwards.
    """

    __slots__ = ("params", "pool", "_running", "_waiting", "_seqs", "_step", "_free_at",
                 "_events", "_next_id", "preemptions", "crashes", "prompt_tokens_total",
                 "generation_tokens_total", "finished_by_reason")

    def __init__(self, params: EngineParams) -> None:
        params.validate()
        self.params = params
        self.pool = BlockPool(params.kv_capacity_tokens // params.block_size, params.block_size)
        self.pool.set_background_tokens(params.background_kv_tokens)
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

    # --- inputs ------------------------------------------------------------------

    def add(self, now: float, prompt_tokens: int, target_tokens: int,
            max_tokens: int | None = None) -> int:
        """add queues a request of ``prompt_tokens`` that will generate ``target_tokens``; returns its id.

        ``max_tokens`` (default: ``target_tokens``) is the request's output cap, used only
        for the finish reason. Raises ValueError for a request that could never fit the
        KV cache.
        """
        cap = target_tokens if max_tokens is None else max_tokens
        if prompt_tokens < 1 or target_tokens < 1 or cap < target_tokens:
            raise ValueError("a request needs >= 1 prompt token and 1 <= target <= max_tokens")
        if blocks_for(prompt_tokens + target_tokens, self.pool.block_size) > self.pool.total:
            raise ValueError("request larger than the whole KV cache")
        seq = Seq(self._next_id, prompt_tokens, target_tokens, cap, now)
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
        return EngineStats(
            running=len(self._running), waiting=len(self._waiting),
            total_blocks=self.pool.total, used_blocks=self.pool.used,
            background_blocks=self.pool.background, kv_usage=self.pool.usage,
            preemptions=self.preemptions, crashes=self.crashes,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            finished=dict(self.finished_by_reason))

    def held_blocks(self) -> int:
        """held_blocks sums the blocks every live sequence holds (equals ``pool.used``)."""
        return sum(s.blocks for s in self._seqs.values())

    # --- the scheduler -----------------------------------------------------------

    def _kick(self, now: float) -> None:
        # An idle engine starts a step as soon as something changes; a busy one picks
        # the change up when its step ends.
        if self._step is None:
            self._step = self._schedule(max(now, self._free_at))

    def _allocate(self, seq: Seq, tokens: int) -> bool:
        need = blocks_for(tokens, self.pool.block_size) - seq.blocks
        if not self.pool.take(need):
            return False
        if need > 0:
            seq.blocks += need
        return True

    def _free(self, seq: Seq) -> None:
        self.pool.give_back(seq.blocks)
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
                new = min(seq.num_tokens - seq.num_computed, budget)
                if not self._allocate(seq, seq.num_computed + new):
                    break
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
