"""admit: the decision on one request's whole body: count it, acquire its lease, answer it.

``decide`` is the decision, fed a request its arrival (``extproc.request.arrival``) has
identified (``Identified``) and collected the whole body of; it returns ``Refused`` or
``Admitted``, and the service feeds the admitted request's ending the response from then on.
Its steps: ``count`` parses the body and counts its prompt tokens (off the event loop for a
large body) and the completion tokens to reserve; ``acquire`` asks the admission core for a
lease and returns it, or ``Refused`` with the answer that ends the request (a budget's 429, a
503 when the pool went away or the shared store cannot answer); ``admit`` puts the lease into
the ending its ``ReleaseMode`` names (``extproc.request.ending``) and answers the body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeAlias

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import encoded
from extproc import openai_api as oai
from extproc import usage_log
from extproc.admission import Demand, Lease, Rejection, StoreError, UnknownPoolError
from extproc.answers import (NOTHING_MORE, body_answer, duplex_answer, immediate, message_timeout,
                             name_node, unavailable)
from extproc.config import ClassConfig
from extproc.engine_blocks import token_keys
from extproc.errors import RequestError
from extproc.gate import WAIT_TIMEOUT_MARGIN_S, Gate, PoolRuntime, RouteSettings
from extproc.outcomes import REJECTED_BY, RequestOutcome
from extproc.prefix import prefix_of, prompt_ids
from extproc.request.ending import Ending, of_mode
from extproc.request.profile import ReleaseMode
from extproc.request.refusals import no_eligible_endpoint, refusal
from extproc.request.registry import LINK_KEY

log = logging.getLogger("kvgate.exchange")

__all__ = ["Admitted", "Identified", "Refused", "acquire", "admit", "cap_of", "count", "decide", "pass_to_node",
           "refusal_outcome"]

# Read on every admission as module names: reading an attribute of an Enum class goes
# through EnumType.__getattr__'s hook in Python 3.11 (~1k instructions, a global ~0.1k).
_ADMITTED, _choose_mode = RequestOutcome.ADMITTED, ReleaseMode.choose
_ACCESS_LOG, _STREAM_AND_LOG = ReleaseMode.ACCESS_LOG, ReleaseMode.STREAM_AND_LOG

# What one message is answered with: one response, or several in order (FULL_DUPLEX_STREAMED).
Answer: TypeAlias = "encoded.Answer | list[pb.ProcessingResponse]"


class Refused:
    """Refused is a request kvgate will not admit: ``answer`` ends it (nothing is held)."""

    __slots__ = ("answer",)

    def __init__(self, answer: encoded.Answer) -> None:
        self.answer = answer


class Admitted:
    """Admitted is a request just admitted: ``answer`` lets it go upstream, ``ending`` holds
    its lease until its release."""

    __slots__ = ("answer", "ending")

    def __init__(self, answer: Answer, ending: Ending) -> None:
        self.answer = answer
        self.ending = ending

    @property
    def lease(self) -> Lease:
        """lease is the admitted request's lease (held by its ending)."""
        return self.ending.lease


class Identified(Protocol):
    """Identified is what admission reads of a request its arrival has identified: its
    endpoint, pool and class (None before identification), tenant, route settings, the
    endpoints the proxy allows (``hint``, None: any), and how its stream's protocol carries
    the response (``response_sent``, ``duplex``, ``response_duplex``; ``usage_filter``: the
    access log's usage filter announced itself)."""

    endpoint: oai.Endpoint | None
    pool: PoolRuntime | None
    pool_name: str
    class_cfg: ClassConfig | None
    tenant: str
    fairness_id: str | None
    route: RouteSettings
    content_type: str | None
    hint: frozenset[str] | None
    response_sent: bool
    duplex: bool
    response_duplex: bool
    usage_filter: bool


async def decide(gate: Gate, request: Identified, raw: bytes,
                 send: Callable[[pb.ProcessingResponse], Awaitable[None]] | None) -> Refused | Admitted:
    """decide is the decision on the identified ``request``'s whole body ``raw``: count it,
    acquire a lease, and put it into the ending its mode names (``Admitted``), or ``Refused``
    (a body kvgate refuses, no eligible endpoint, a budget's 429, a 503). ``send``: as for
    ``acquire``."""
    started = gate.clock.now()
    pool, cls, endpoint, pool_name = request.pool, request.class_cfg, request.endpoint, request.pool_name
    assert pool is not None and cls is not None and endpoint is not None
    try:
        parsed, prompt_tokens, reserved = await count(gate, endpoint, raw, request.content_type,
                                                      pool, request.route)
    except RequestError as err:
        outcome = refusal_outcome(err)
        gate.metrics.request(pool_name, cls.name, outcome)
        return Refused(refusal(err, outcome))
    among = request.hint if pool.picks else None
    if among is not None and not gate.admission.eligible_nodes(pool_name, among):
        gate.metrics.request(pool_name, cls.name, RequestOutcome.REJECTED_NO_ENDPOINT)
        return Refused(no_eligible_endpoint(gate.admission.named_nodes(pool_name, among) > 0))
    # Positional, in Demand's field order: keywords double what making one costs.
    demand = Demand(pool_name, request.tenant, cls.name, prompt_tokens, reserved, among,
                    parsed.prefix, request.fairness_id, parsed.blocks)
    lease = await acquire(gate, demand, cls, send, started)
    if type(lease) is Refused:
        return lease
    assert isinstance(lease, Lease)
    gate.metrics.request(pool_name, cls.name, _ADMITTED)
    duplex, response_duplex = request.duplex, request.response_duplex
    # A FULL_DUPLEX_STREAMED body either way carries no link (``ReleaseMode.choose``).
    mode = _choose_mode(request.response_sent, request.route.release, duplex or response_duplex)
    return admit(gate, lease, mode, parsed, raw, cap=cap_of(pool, parsed, reserved),
                 duplex=duplex, response_duplex=response_duplex, usage_filter=request.usage_filter)


def _evaluate(endpoint: oai.Endpoint, body: bytes, content_type: str | None,
              pool: PoolRuntime) -> tuple[oai.ParsedRequest, int]:
    """_evaluate parses a body, counts its prompt tokens and, where the pool counts shared
    prefixes once, chains its prompt (``ParsedRequest.prefix``), where it reads its nodes' KV
    events, keys its engine token ids (``ParsedRequest.blocks``; may run in a worker thread)."""
    parsed = oai.parse_request(endpoint, body, content_type)
    tokens = oai.count_prompt_tokens(parsed, pool.tokenizer, pool.template)
    if pool.picks and pool.config.picking.shared_prefix:
        parsed.prefix = prefix_of(parsed, pool.tokenizer, pool.template)
    if pool.picks and pool.config.picking.kv_events is not None:
        ids = prompt_ids(parsed, pool.tokenizer)
        parsed.blocks = None if ids is None else token_keys(ids)
    return parsed, tokens


async def count(gate: Gate, endpoint: oai.Endpoint, raw: bytes, content_type: str | None,
                pool: PoolRuntime, route: RouteSettings) -> tuple[oai.ParsedRequest, int, int]:
    """count parses the body ``raw`` and counts its prompt tokens (in the gate's executor above
    ``offload_bytes``); returns them with the completion tokens to reserve. Raises
    RequestError for a body kvgate refuses, the context window's included."""
    if len(raw) > gate.offload_bytes:
        loop = asyncio.get_running_loop()
        parsed, prompt_tokens = await loop.run_in_executor(
            gate.executor, _evaluate, endpoint, raw, content_type, pool)
    else:
        parsed, prompt_tokens = _evaluate(endpoint, raw, content_type, pool)
    window = route.context_window or pool.config.context_window
    reserved = oai.request_reservation(parsed, prompt_tokens, window,
                                       pool.config.default_max_tokens)
    oai.check_context(parsed, prompt_tokens, reserved, window)
    return parsed, prompt_tokens, reserved


def refusal_outcome(err: RequestError) -> RequestOutcome:
    """refusal_outcome is how a body ``count`` refused is counted."""
    return (RequestOutcome.REJECTED_CONTEXT_LENGTH if err.code == "context_length_exceeded"
            else RequestOutcome.REJECTED_BODY_TOO_LARGE if err.status == 413
            else RequestOutcome.REJECTED_TOKENIZER_UNAVAILABLE if err.status == 503
            else RequestOutcome.REJECTED_INVALID)


async def acquire(gate: Gate, demand: Demand, cls: ClassConfig,
                  send: Callable[[pb.ProcessingResponse], Awaitable[None]] | None,
                  started: float) -> Lease | Refused:
    """acquire is the lease for ``demand`` (of class ``cls``), or its refusal: a budget's 429,
    or a 503 when the pool went away or the shared store cannot answer. A class that waits
    first asks Envoy for a longer message timeout through ``send`` (None: the caller cannot);
    ``started``: when the decision began (seconds, the gate's clock)."""
    pool = demand.pool
    waits = cls.max_wait_s > 0 and send is not None
    if waits:
        assert send is not None
        await send(message_timeout(cls.max_wait_s + WAIT_TIMEOUT_MARGIN_S))
    try:
        result = await gate.admission.acquire(demand)
    except asyncio.CancelledError:  # the stream ended while the request waited
        if waits:
            gate.wait_cut(cls.name, cls.max_wait_s + WAIT_TIMEOUT_MARGIN_S, gate.clock.now() - started)
        raise
    except UnknownPoolError:
        # A reload removed the pool between the choice (headers, or before counting off
        # the loop) and now: nothing was taken; the client's retry meets the new config.
        log.warning("refusing a request: its pool %r was removed by a reload", pool)
        return Refused(unavailable("pool_reconfigured", "The gateway was reconfigured while this "
                                   "request was being admitted. Retry."))
    except StoreError as err:
        # The shared store cannot answer and is set to fail closed: retry shortly.
        gate.metrics.decision_time(pool, gate.clock.now() - started)
        gate.metrics.request(pool, cls.name, RequestOutcome.REJECTED_STORE_UNAVAILABLE)
        log.warning("refusing a request: %s", err)
        return Refused(unavailable("store_unavailable", f"Admission is unavailable: {err}. Retry shortly."))
    gate.metrics.decision_time(pool, gate.clock.now() - started)
    if isinstance(result, Rejection):
        gate.metrics.request(pool, cls.name, REJECTED_BY[result.reason])
        status, headers, payload = oai.rejection_response(result)
        return Refused(immediate(status, headers, payload, f"kvgate_{result.reason.value}"))
    return result


def cap_of(pool: PoolRuntime, parsed: oai.ParsedRequest, reserved: int) -> int | None:
    """cap_of is the max_tokens each sequence of an admitted request is held to, where its pool
    enforces its reservation (None: the request's own)."""
    if pool.config.enforce_max_tokens and parsed.sequences:
        return reserved // parsed.sequences
    return None


def pass_to_node(gate: Gate, pool_name: str, hint: frozenset[str] | None,
                 duplex: bool) -> pb.ProcessingResponse | Refused | None:
    """pass_to_node lets a request kvgate does not admit go to an up node of a picking pool
    (uncharged): Envoy routes by the node kvgate names, so even these need one. None when the
    pool does not pick; Refused (503) when no node is up among those the subset ``hint``
    allows. ``duplex``: no mode_override (the bodies are passed back one by one)."""
    pool = gate.pools.get(pool_name)
    if pool is None or not pool.picks:
        return None
    address = gate.admission.any_node(pool.config.name, hint)
    if address is None:
        return Refused(unavailable("no_node", "No node of this pool answers its metrics now. Retry "
                                   "shortly.", retry_after_ms=False))
    resp = pb.ProcessingResponse() if duplex else pb.ProcessingResponse(mode_override=NOTHING_MORE)
    name_node(resp, resp.request_headers.response, address)
    return resp


def admit(gate: Gate, lease: Lease, mode: ReleaseMode, parsed: oai.ParsedRequest, raw: bytes, *,
          cap: int | None, duplex: bool, response_duplex: bool, usage_filter: bool) -> Admitted:
    """admit takes ``lease`` into the ending ``mode`` names, and answers the body ``raw``: the
    upstream body (max_tokens capped at ``cap``, stream usage asked for when kvgate reads the
    response and the client did not, or where the access log's usage filter, announced by
    ``usage_filter``, hides it), the node picked, the link. ``duplex``: the request body is
    FULL_DUPLEX_STREAMED (the answer is the owed headers answer, then the body's chunks);
    ``response_duplex``: the response body is."""
    node, link, strip = lease.destination, None, False
    answer: Answer
    if not mode.on_stream:
        # Observed elsewhere or not at all: usage the client did not ask for could not be
        # hidden from it, so none is asked of the upstream, except where the access log's
        # usage filter reads it and hides it (told in the answer's metadata).
        usage = mode is _ACCESS_LOG and usage_filter
        capped, stripped = oai.upstream_body(parsed, cap_max_tokens=cap, stream_usage=usage)
        link = gate.new_link()
        answer = _linked_continue(lease, link, capped, node=node)
        if stripped:
            # The rates beside the link: a message, never wire bytes (``body_answer``).
            assert isinstance(answer, pb.ProcessingResponse)
            usage_log.ask_to_strip(answer)
    else:
        new_body, strip = oai.upstream_body(parsed, cap_max_tokens=cap)
        if duplex:
            answer = duplex_answer(raw if new_body is None else new_body, new_body is not None, node)
        elif mode is _STREAM_AND_LOG:
            link = gate.new_link()
            answer = _linked_continue(lease, link, new_body, rates=False, node=node)
        else:
            answer = body_answer(new_body, node)
    kind = of_mode(mode, response_duplex and mode.on_stream)
    return Admitted(answer, kind(gate, lease.demand.pool, lease, link, parsed.stream, strip))


def _linked_continue(lease: Lease, link: str, new_body: bytes | None = None, *,
                     rates: bool = True, node: str | None = None) -> encoded.Answer:
    """_linked_continue admits a request whose response is observed on another stream, or
    whose access log entry kvgate reads: the ``link`` and (``rates``) the x-ratelimit-* values
    go into the request's dynamic metadata, where the observing filter, the access log (and
    Envoy's response_headers_to_add) find them (``body_answer``)."""
    metadata = [(LINK_KEY, link)]
    if rates:
        metadata += oai.rate_limit_headers(lease.rate)
    return body_answer(new_body, node, metadata)
