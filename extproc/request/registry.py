"""registry: the admitted requests whose end comes from elsewhere than their own ext_proc
stream, held by link until it comes.

``Endings`` holds the endings (``extproc.request.ending``) that wait for something: the
observed requests by link (``Observed``, whose observing stream's begin and end it follows),
the parked requests of ACCESS_LOG routes, and the requests of the ``*_AND_LOG`` modes whose
cause waits for their entry. Envoy ends an ext_proc stream alike whether the client left or
the upstream died, so a stream cut short is released at once and only the counting of its
cause waits for the entry (written only for requests with a response flag), at most
``CAUSE_WAIT_S``: then it is counted ``client_disconnect`` (the fallback, logged).
``Endings.logged`` takes each entry of Envoy's access log (read by ``extproc.request.accesslog``).
Only an entry of a stream's end settles anything: a periodic entry of a stream in flight (the
endpoint-picker-log file's ``access_log_flush_interval``) tells a parked request's node ledger
its tokens so far and the node that serves it (``Parked.progressed``), and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from extproc import usage_log
from extproc.clock import Clock
from extproc.gate import METADATA_NAMESPACE
from extproc.metrics import Metrics
from extproc.outcomes import LogResult
from extproc.request.accesslog import cut_short_by, is_final, upstream_address
from extproc.request.ending import Ending, Observed, Parked, ToldByLog, response_facts
from extproc.request.profile import STREAM_AND_LOG

log = logging.getLogger("kvgate.server")

__all__ = ["CAUSE_WAIT_S", "LINK_GRACE_S", "LINK_KEY", "OBSERVE_CAP_S", "Endings"]

# Dynamic metadata key (namespace ``kvgate``) of the token that ties a request's response,
# seen on an observability-mode stream or in an access log entry, to the ending that holds
# its lease.
LINK_KEY = "link"
# How long an ended admission stream waits for its observing stream to begin (seconds):
# Envoy sent the response's first message before ending the request, but a new gRPC stream
# can be read after an old one's end.
LINK_GRACE_S = 0.05
# The most an ended admission stream waits for its observing stream to end (seconds),
# whatever deferred_close_timeout Envoy is given.
OBSERVE_CAP_S = 10.0
# How long the cause of a stream cut short waits for its access log entry (seconds): the
# entry comes within milliseconds (buffer_flush_interval 5 ms); past this it was lost.
CAUSE_WAIT_S = 5.0


class Endings:
    """Endings holds, by link, every admitted request whose end comes from elsewhere than its
    own ext_proc stream (module doc), and settles each when that end comes.

    ``links``: the OBSERVED* requests. ``parked``: the ACCESS_LOG requests (their time to live
    runs from their lease's ``admitted_at``, on the clock the admission core shares with this
    one). ``causes``: the ``*_AND_LOG`` requests until the cause of their end is known, with
    when they were admitted or, once their release waits for the cause, released. ``changed``
    is called when a parked request is released (the service may have become idle).
    """

    def __init__(self, clock: Clock, metrics: Metrics, changed: Callable[[], None]) -> None:
        self._clock = clock
        self._metrics = metrics
        self._changed = changed
        self.links: dict[str, Observed] = {}
        # The ending alone, not (ending, instant): one request parked is one dict entry, and
        # thousands of them stream at once.
        self.parked: dict[str, Parked] = {}
        self.causes: dict[str, tuple[ToldByLog, float]] = {}
        # Parked requests whose stream ended before the write of their answer returned, and
        # when: kept for their log entry at most CAUSE_WAIT_S (``stream_ended``).
        self.unsure: dict[str, float] = {}
        # Set by give_up: every release from then on is a timeout.
        self.given_up = False

    # --- the admission stream ----------------------------------------------------------

    def admitted(self, ending: Ending) -> bool:
        """admitted registers a request just admitted, before Envoy can send its response
        or log its end: a Parked request is parked, an Observed one linked, and one whose
        cause the access log tells kept for its cause. Returns whether the request was handed
        over to the access log (Parked): its stream may end now, the lease held."""
        link = ending.link
        if link is None:
            return False
        if isinstance(ending, Parked):
            self.parked[link] = ending
            return True
        if isinstance(ending, Observed):
            self.links[link] = ending
        if isinstance(ending, ToldByLog):
            self.causes[link] = (ending, self._clock.now())
        return False

    def stream_ended(self, ending: Ending | None, handed_over: bool) -> Observed | None:
        """stream_ended follows the end of a request's admission stream, however it ended
        (``ending``: None when nothing was admitted).

        A request handed over to the access log stays parked; so does, for at most
        CAUSE_WAIT_S, a parked one whose stream ended before the write of its answer
        returned (``unsure``). An observed request whose response has not been seen to end
        is returned: ``settle`` releases it once the observing stream shows its end. Any
        other is released now.
        """
        if handed_over or ending is None:
            return None
        link_key = ending.link
        if (link_key is not None and link_key in self.parked and ending.outcome is None
                and not self.given_up):
            # Parked, but the stream ended before the write of its answer returned: a fast
            # answer (JSON) can finish the request that soon, and its log entry then tells its
            # end and usage. If the answer never reached Envoy, no entry will name the link:
            # ``sweep_parked`` releases it CAUSE_WAIT_S after this.
            self.unsure.setdefault(link_key, self._clock.now())
            return None
        observed = self.links.get(link_key) if link_key is not None else None
        if observed is not None and ending.outcome is None and not self.given_up:
            return observed
        self._release(ending)
        return None

    async def settle(self, ending: Observed) -> None:
        """settle releases an observed request whose admission stream ended before its
        response was seen to end: once the observing stream has shown it, or ended, or never
        began within LINK_GRACE_S (the response never started); at most OBSERVE_CAP_S."""
        try:
            if not ending.began.is_set():
                await asyncio.wait_for(ending.began.wait(), LINK_GRACE_S)
            if ending.outcome is None:
                await asyncio.wait_for(ending.ended.wait(), OBSERVE_CAP_S)
        except TimeoutError:
            pass
        finally:
            self._release(ending)

    def _release(self, ending: Ending) -> None:
        """_release finishes an ending (if not already) and forgets its link; a release whose
        cause awaits the access log entry stays in ``causes``, from now."""
        ending.finish(gave_up=self.given_up)
        link = ending.link
        if link is None:
            return
        self.links.pop(link, None)
        if isinstance(ending, ToldByLog) and link in self.causes:
            if ending.cause_pending:
                self.causes[link] = (ending, self._clock.now())
            else:
                del self.causes[link]

    # --- the observing stream ------------------------------------------------------------

    async def observe(self, req: Any, read: Callable[[], Any]) -> None:
        """observe follows an observability-mode stream (its first message ``req``, the next
        by ``read``): the response of a request admitted on another stream. Nothing is
        answered (Envoy waits for nothing)."""
        ending = None
        space = req.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
        if space is not None and LINK_KEY in space.fields:
            ending = self.links.get(space.fields[LINK_KEY].string_value)
        eof = grpc.aio.EOF
        if ending is None:  # not admitted here (refused, passed through, another process)
            while req is not eof:
                req = await read()
            return
        ending.began.set()
        try:
            while req is not eof:
                kind = req.WhichOneof("request")
                if kind == "response_body":
                    body = req.response_body
                    ending.response_chunk(body.body, body.end_of_stream)
                elif kind == "response_headers":
                    headers = req.response_headers
                    if ending.outcome is None:
                        status, content_type = response_facts(headers.headers.headers)
                        ending.observed_headers(status, content_type, headers.end_of_stream)
                req = await read()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._metrics.internal_errors.inc()
            log.exception("observing stream failed; its request is released as it stands")
        finally:
            ending.ended.set()

    # --- the access log ------------------------------------------------------------------

    def logged(self, entry: Any) -> LogResult:
        """logged handles one entry of Envoy's access log (an ``HTTPAccessLogEntry``): it
        releases the parked request it tells the end of, or tells the cause of a request
        released by its stream (``causes``); a periodic entry only tells a parked request's
        progress (``_progressed``). Returns what it did (``LogResult``)."""
        common = entry.common_properties
        space = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
        final = is_final(common)
        if space is None or LINK_KEY not in space.fields:
            return LogResult.NO_LEASE if final else LogResult.PERIODIC
        link = space.fields[LINK_KEY].string_value
        if not final:
            return self._progressed(link, entry)
        cut_short, upstream_failed = cut_short_by(entry)
        parked = self.parked.pop(link, None)
        self.unsure.pop(link, None)
        if parked is not None:
            parked.ended_by_log(entry.response.response_code.value, cut_short, upstream_failed,
                                usage_log.from_entry(entry))
            self._changed()
            return LogResult.RELEASED
        told = self.causes.get(link)
        if told is None:
            release = space.fields.get("release")
            if release is not None and release.string_value == STREAM_AND_LOG and not cut_short:
                return LogResult.COMPLETE  # a flag such as the client's close on the last byte
            return LogResult.UNMATCHED
        ending = told[0]
        ending.told(cut_short and upstream_failed)
        if ending.outcome is not None:  # finished: nothing more to learn of it
            del self.causes[link]
        return LogResult.CAUSE

    def _progressed(self, link: str, entry: Any) -> LogResult:
        """_progressed applies a periodic entry (a stream still in flight) to the parked request
        it names: its tokens so far and the node that serves it (``Parked.progressed``).
        Nothing is released, settled or unparked, whatever the entry says."""
        parked = self.parked.get(link)
        if parked is None:
            return LogResult.PERIODIC
        if parked.progressed(usage_log.events_so_far(entry), upstream_address(entry)):
            return LogResult.PROGRESS
        return LogResult.PROGRESS_INVALID

    def settle_causes(self, now: float, wait_s: float = CAUSE_WAIT_S) -> int:
        """settle_causes counts as ``client_disconnect`` the releases whose cause has waited
        ``wait_s`` seconds or more for an access log entry that never came (Envoy's buffer
        overflowed, the log stream broke); returns how many."""
        late = [link for link, (ending, at) in self.causes.items()
                if ending.cause_pending and now - at >= wait_s]
        for link in late:
            self.causes.pop(link)[0].told(False)
        if late:
            log.warning("counted %d releases as client_disconnect: their access log entry, which "
                        "would tell an upstream failure, never came within %.0f s", len(late), wait_s)
        return len(late)

    def sweep_parked(self, now: float, ttl_s: float) -> int:
        """sweep_parked releases, with cause ``timeout``, the requests parked for longer than
        ``ttl_s`` seconds (their log entry was lost: Envoy's buffer overflowed, the log stream
        broke); returns how many."""
        stale = [link for link, ending in self.parked.items()
                 if now - ending.lease.admitted_at >= ttl_s]
        for link in stale:
            self.unsure.pop(link, None)
            self.parked.pop(link).finish(gave_up=True)
        unsure = [link for link, at in self.unsure.items() if now - at >= CAUSE_WAIT_S]
        for link in unsure:
            del self.unsure[link]
            self.parked.pop(link).finish()  # the answer never reached Envoy: as a disconnect
        if stale:
            log.warning("released %d requests whose access log entry never came within %.0f s",
                        len(stale), ttl_s)
        if stale or unsure:
            self._changed()
        return len(stale) + len(unsure)

    def give_up(self) -> int:
        """give_up releases every parked request with cause ``timeout`` and counts every cause
        still awaited as ``client_disconnect``; every later release is a timeout. Returns
        how many requests were parked."""
        self.given_up = True
        parked = list(self.parked.values())
        self.parked.clear()
        self.unsure.clear()
        for ending in parked:
            ending.finish(gave_up=True)
        self.settle_causes(float("inf"), 0.0)
        return len(parked)
