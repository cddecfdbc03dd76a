"""ending: one kind of ending per way an admitted request ends, each holding the request's
lease from its admission until it releases it, once, and counts its cause, once.

An ending is made at admission, of the kind the request's ``ReleaseMode`` names (``of_mode``;
the mode comes from the Envoy file's profile, ``extproc.request.profile``), and is then fed
the events of the request's end as they come: the response's headers and chunks (on the
admission stream, or on an observing one), the end of the admission stream, the end of an
observing stream, the access log entry of the request, kvgate giving up. Each kind decides
alone when those events end the request and with what cause (``extproc.request.causes``):

==============================  ====================================================
kind (mode)                     released
==============================  ====================================================
OnStream (STREAM)               at the response's end of stream, or the admission
                                stream's end (OnDuplexStream: the same, the response
                                body FULL_DUPLEX_STREAMED)
OnStreamAndLog (STREAM_AND_LOG) the same; a stream cut short is released at once and
                                its cause counted when the access log entry tells
                                who cut it (``told``)
Unread (UNREAD)                 at the admission stream's end: ``ended`` after the
                                response headers, a stream cut short before them
Observed (OBSERVED)             when the observing stream shows the response's end,
                                or ends, or never begins
                                (``extproc.request.registry.Endings.settle``)
ObservedAndLog                  the same, the cause of a stream cut short told by the
(OBSERVED_AND_LOG)              entry
Parked (ACCESS_LOG)             when the access log entry comes (``ended_by_log``);
                                periodic entries only tell its progress
                                (``progressed``)
==============================  ====================================================

Where the ending waits for something that comes from elsewhere (an observing stream, an access
log entry), the registry ``extproc.request.registry.Endings`` holds it by its link.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import openai_api as oai
from extproc import picker_protocol as epp
from extproc.admission import Lease, Outcome
from extproc.encoded import CONTINUE_RESPONSE_BODY, CONTINUE_RESPONSE_HEADERS, Answer, response_headers
from extproc.openai_usage import ResponseTracker
from extproc.request.causes import awaits_log_cause, cause_of, charged_completion
from extproc.request.profile import ReleaseMode

if TYPE_CHECKING:
    from extproc import usage_log
    from extproc.gate import Gate

__all__ = ["Ending", "Observed", "ObservedAndLog", "OnDuplexStream", "OnStream", "OnStreamAndLog",
           "Parked", "ToldByLog", "Unread", "of_mode", "response_facts"]


class Ending:
    """Ending is an admitted request's lease until its release (the module doc).

    ``pool``: the pool's name (the label its release is counted under); ``link``: the token
    that ties the request to its observing stream or access log entry (None: none);
    ``streamed``: the request asked for a streamed response; ``strip``: kvgate asked the
    upstream for stream usage the client did not ask for, and hides it. ``outcome`` is the
    cause of its release once released (None until then).
    """

    __slots__ = ("gate", "pool", "lease", "link", "streamed", "strip", "tracker", "status",
                 "upstream_error", "response_done", "outcome", "cut_by_upstream", "cause_pending")

    mode: ClassVar[ReleaseMode] = ReleaseMode.STREAM

    def __init__(self, gate: Gate, pool: str, lease: Lease, link: str | None, streamed: bool,
                 strip: bool) -> None:
        # Pairs, not one tuple of four: CPython builds no tuple to assign two or three.
        self.gate, self.pool = gate, pool
        self.lease, self.link = lease, link
        self.streamed, self.strip = streamed, strip
        # What the response has shown so far (on whichever stream kvgate sees it).
        self.tracker: ResponseTracker | None = None
        self.status, self.upstream_error, self.response_done = 0, False, False
        self.outcome: Outcome | None = None
        # What the access log entry told of a stream cut short (None: no entry yet; True: the
        # upstream broke it off), and whether a release's cause still awaits it (``told``).
        self.cut_by_upstream: bool | None = None
        self.cause_pending = False

    # --- the response on the admission stream -------------------------------------------

    def answer_headers(self, msg: pb.HttpHeaders, metadata: Any) -> Answer:
        """answer_headers takes the response headers Envoy sent on the admission stream (with
        the stream's ``metadata``: the endpoint the proxy says served the request) and answers
        them with the x-ratelimit-* headers; a response whose injected usage chunk is hidden
        loses its fixed length."""
        if self.outcome is not None:
            return CONTINUE_RESPONSE_HEADERS
        lease = self.lease
        if lease.node is not None:
            self.served_by(epp.served_endpoint(metadata))
        status, content_type = response_facts(msg.headers.headers)
        rate_headers = oai.rate_limit_headers(lease.rate)  # as of the admission, before a release
        # In deploy/envoy-reservation.yaml (Unread) no body follows: not a mode_override to
        # NONE, with which Envoy would close the stream at once. A hidden usage chunk:
        # chunks may shrink, so no fixed length.
        return response_headers(
            rate_headers, self.response_headers(status, content_type, msg.end_of_stream))

    def answer_chunk(self, msg: pb.HttpBody) -> Answer:
        """answer_chunk takes one response chunk on the admission stream (``response_chunk``)
        and answers it: as it came, or without the injected usage chunk."""
        replacement = self.response_chunk(msg.body, msg.end_of_stream)
        if replacement is None:
            return CONTINUE_RESPONSE_BODY
        resp = pb.ProcessingResponse()
        resp.response_body.response.body_mutation.body = replacement
        return resp

    # --- the response ----------------------------------------------------------------------

    def response_headers(self, status: int, content_type: str, end: bool) -> bool:
        """response_headers takes the response's status and content type; returns whether the
        injected usage chunk is hidden (then the response has no fixed length)."""
        self.status = status
        self.upstream_error = status >= 400
        streamed = content_type.startswith("text/event-stream")
        strip = self.strip and streamed and not self.upstream_error
        self.tracker = ResponseTracker(streamed, strip)  # positional: keywords build a dict
        if end:
            self.response_end()
        return strip

    def response_chunk(self, body: bytes, end: bool) -> bytes | None:
        """response_chunk reads one response chunk: usage, the tokens generated so far (for a
        picked node's ledger), and the response's end (released at once). Returns the
        chunk's replacement (the injected usage chunk hidden), or None to pass it as it came."""
        tracker = self.tracker
        if tracker is None:
            return None
        replacement = tracker.feed(body, end)
        lease = self.lease
        if lease.node is not None and tracker.delivered_chunks:
            lease.progress(tracker.delivered_chunks)
        if end:
            self.response_end()
        return replacement

    def response_end(self) -> None:
        """response_end: the response is complete; the slot is freed now rather than when
        Envoy gets round to closing the ext_proc stream."""
        self.response_done = True
        self.finish()

    def served_by(self, served: str | None) -> None:
        """served_by moves the node charge to the endpoint the proxy says served the request
        when it is another node of the pool; an address that is no node of the pool leaves the
        charge where it was picked, loudly (``Gate.served_elsewhere``)."""
        lease = self.lease
        if served is None or lease.node is None or served == lease.node:
            return
        if not lease.served(served):
            self.gate.served_elsewhere(self.pool, served)

    # --- the release ---------------------------------------------------------------------

    def finish(self, gave_up: bool = False) -> Outcome | None:
        """finish releases the lease with the cause of what was seen (None if already
        released). ``gave_up``: kvgate itself ends the request (a timeout). Idempotent."""
        if self.outcome is not None:
            return None
        tracker = self.tracker
        # [DONE] passed through kvgate to the client: the generation ended. openai-python
        # closes on it, often before the upstream's end of body reaches Envoy.
        done = self.response_done or (tracker is not None and tracker.done_seen)
        cut = self.cut_by_upstream
        outcome = cause_of(self._cause_mode(), upstream_error=self.upstream_error,
                           response_done=done, gave_up=gave_up, cut_by_upstream=cut)
        self.outcome = outcome
        charged = charged_completion(self.mode, outcome, tracker, self.streamed, cut)
        if self.lease.release(outcome, charged):
            if awaits_log_cause(self.mode, outcome, cut):
                self.cause_pending = True  # counted when the entry tells it (``told``)
            else:
                # The Outcome itself: a StrEnum is the string it names (``.value`` is a
                # Python property, read on every release).
                self.gate.metrics.release(self.pool, outcome)
        return outcome

    def _cause_mode(self) -> ReleaseMode:
        """_cause_mode is the row of the cause table this ending's release reads."""
        return self.mode


class OnStream(Ending):
    """OnStream: the response comes on the admission stream; its end, or the stream's, releases."""

    __slots__ = ()


class OnDuplexStream(OnStream):
    """OnDuplexStream: as OnStream, with the response body FULL_DUPLEX_STREAMED (the endpoint
    picker protocol, deploy/envoy-inference-pool.yaml): every chunk goes back at once, as it
    came or without the injected usage chunk; none is held."""

    __slots__ = ()

    def answer_chunk(self, msg: pb.HttpBody) -> Answer:
        replacement = self.response_chunk(msg.body, msg.end_of_stream)
        return epp.streamed_chunk("response_body", msg.body if replacement is None else replacement,
                                  msg.end_of_stream)


class ToldByLog(Ending):
    """ToldByLog: a stream cut short is released at once, and its cause counted when its
    access log entry tells whether the upstream broke it off (``told``)."""

    __slots__ = ()

    def told(self, cut_by_upstream: bool) -> Outcome | None:
        """told takes what the access log entry tells of the request: whether the upstream
        broke the response off. Before the release it is kept for it; after a release whose
        cause waited for it, the release is counted now and its cause returned (None
        otherwise). ``told(False)`` is also the fallback when the entry never comes."""
        if self.outcome is None:
            self.cut_by_upstream = cut_by_upstream
            return None
        if not self.cause_pending:
            return None
        self.cause_pending = False
        outcome = Outcome.UPSTREAM_ERROR if cut_by_upstream else Outcome.CLIENT_DISCONNECT
        self.outcome = self.lease.outcome = outcome
        self.gate.metrics.release(self.pool, outcome)
        return outcome


class OnStreamAndLog(ToldByLog):
    """OnStreamAndLog: as OnStream, the cause of a stream cut short told by the access log."""

    __slots__ = ()
    mode = ReleaseMode.STREAM_AND_LOG


class Unread(Ending):
    """Unread: the response headers come on the admission stream, never the body
    (deploy/envoy-reservation.yaml): the stream's end releases the lease, the completion
    charged at its reservation."""

    __slots__ = ()
    mode = ReleaseMode.UNREAD

    def response_headers(self, status: int, content_type: str, end: bool) -> bool:
        self.status = status
        self.upstream_error = status >= 400
        return False

    def _cause_mode(self) -> ReleaseMode:
        # Ended before its response headers came: the client left or the upstream failed
        # before answering, as for a response observed elsewhere that never began.
        return ReleaseMode.UNREAD if self.status else ReleaseMode.OBSERVED


class Observed(Ending):
    """Observed: the response is read from a second, observability-mode stream, which Envoy
    begins with the response (``began``) and ends after it (``ended``): its headers come by
    ``observed_headers``. Headers on the admission stream (a file that sends them without
    saying ``release: unread``) are not followed: no body follows them there."""

    __slots__ = ("began", "ended")
    mode = ReleaseMode.OBSERVED

    def response_headers(self, status: int, content_type: str, end: bool) -> bool:
        return False

    def observed_headers(self, status: int, content_type: str, end: bool) -> None:
        """observed_headers takes the response's headers from the observing stream."""
        Ending.response_headers(self, status, content_type, end)

    def __init__(self, gate: Gate, pool: str, lease: Lease, link: str | None, streamed: bool,
                 strip: bool) -> None:
        super().__init__(gate, pool, lease, link, streamed, strip)
        self.began = asyncio.Event()
        self.ended = asyncio.Event()


class ObservedAndLog(ToldByLog, Observed):
    """ObservedAndLog: as Observed, the cause of a stream cut short told by the access log."""

    __slots__ = ()
    mode = ReleaseMode.OBSERVED_AND_LOG


class Parked(Ending):
    """Parked: kvgate sees no response; the request's access log entry ends it (the request is
    parked until then), and periodic entries tell how far it has got."""

    __slots__ = ()
    mode = ReleaseMode.ACCESS_LOG

    def response_headers(self, status: int, content_type: str, end: bool) -> bool:
        return False  # never sent in the files of this mode; its entry tells the response

    def ended_by_log(self, status: int, cut_short: bool, upstream_failed: bool = False,
                     usage: usage_log.LoggedUsage | None = None) -> Outcome | None:
        """ended_by_log releases the lease as Envoy's access log entry of the request tells:
        the response status (0: none was sent), whether the stream was cut short (the client
        went away, an idle timeout) and whether the upstream failed (reset or closed its
        connection): a stream cut short by the upstream is an upstream_error. The completion
        is charged as the usage filter saw it (``usage``), at its reservation without it."""
        if usage is not None:
            self.gate.metrics.logged_usage(usage.result)
            self.tracker = usage.tracker(self.streamed)
            self.cut_by_upstream = cut_short and upstream_failed
        self.status = status
        self.upstream_error = status >= 400 or (cut_short and upstream_failed)
        self.response_done = status != 0 and not cut_short
        return self.finish()

    def progressed(self, events: int | None, served: str | None) -> bool:
        """progressed takes a periodic access log entry of the request still in flight
        (deploy/envoy-endpoint-picker-log.yaml): ``events``, the SSE events with choices the
        usage filter has seen so far, become the tokens its node's ledger counts as generated
        (``Lease.progress``, which also notes the first token), and ``served``, the upstream
        address Envoy connected to, re-homes the node charge when it is another node. Never
        releases nor settles. False when the entry's event count is not a count."""
        lease = self.lease
        if lease.released or lease.node is None:
            return True
        self.served_by(served)
        if events is None:
            return False
        if events:
            lease.progress(events)
        return True


def response_facts(headers: Any) -> tuple[int, str]:
    """response_facts is a response's status (0: none, or not a number) and content type
    (empty: none), read from its header map's entries (``HeaderValue``s).

    The first entry of each counts, and the reading stops once both are found: Envoy sends
    ``:status`` first and content-type among the first few, and each entry read costs about
    a thousand instructions on every response (a response with two content types, which
    HTTP does not allow, is read by its first).
    """
    status, content_type = 0, ""
    found_status = found_type = False
    for h in headers:
        key = h.key
        if key == ":status":
            if found_status:
                continue
            found_status = True
            try:
                status = int(h.raw_value)
            except ValueError:
                status = 0
            if found_type:
                break
        elif key == "content-type":
            if found_type:
                continue
            found_type = True
            content_type = h.raw_value.decode("latin-1")
            if found_status:
                break
    return status, content_type


_KINDS: dict[ReleaseMode, type[Ending]] = {
    ReleaseMode.STREAM: OnStream, ReleaseMode.STREAM_AND_LOG: OnStreamAndLog,
    ReleaseMode.UNREAD: Unread, ReleaseMode.OBSERVED: Observed,
    ReleaseMode.OBSERVED_AND_LOG: ObservedAndLog, ReleaseMode.ACCESS_LOG: Parked,
}


def of_mode(mode: ReleaseMode, duplex: bool = False) -> type[Ending]:
    """of_mode is the kind of ending of a request admitted in ``mode``; ``duplex``: its response
    body is FULL_DUPLEX_STREAMED (then its mode is STREAM, ``ReleaseMode.choose``)."""
    return OnDuplexStream if duplex else _KINDS[mode]
