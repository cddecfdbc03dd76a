"""profile: the Envoy files kvgate is served by, one row each, and how a request's end
reaches kvgate in each (its ``ReleaseMode``).

A ``Profile`` is one file of deploy/ (``kvgate envoy-filter --mode NAME``): what Envoy sends
kvgate and what kvgate must make of it. ``PROFILES`` is the only table of them: the Envoy
writer (``envoyconf``) reads its columns to write each file, and the route metadata it writes
(``release``) is what the processor reads back to name a request's mode once, at admission
(``ReleaseMode.choose``), with the stream's protocol. Nothing renames it later.

=====================  ============  ======  ========  ==========  =========  =====  ================
profile                headers sent  duplex  response  cause log   periodic   picks  mode
=====================  ============  ======  ========  ==========  =========  =====  ================
three-message          no            no      stream    yes         no         no     STREAM_AND_LOG
four-message           yes           no      stream    yes         no         no     STREAM_AND_LOG
reservation            no            no      headers   no          no         no     UNREAD
observe                no            no      observed  yes         no         no     OBSERVED_AND_LOG
access-log             no            no      log       (the end)   no         no     ACCESS_LOG
endpoint-picker        yes           no      stream    yes         no         yes    STREAM_AND_LOG
endpoint-picker-log    yes           no      log       (the end)   yes        yes    ACCESS_LOG
inference-pool         yes           yes     stream    no          no         yes    STREAM
=====================  ============  ======  ========  ==========  =========  =====  ================

(A declarative table: the rows below are the table above, checked by tests/unit/test_profile.py.)
A route without a ``release`` key (an operator's own file) is STREAM where the stream's protocol
sends the response body, OBSERVED where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum

__all__ = ["PROFILES", "Profile", "ReleaseMode", "RouteRelease", "Seen"]


class RouteRelease(StrEnum):
    """RouteRelease is the route key ``release`` (namespace ``kvgate``): how the route says its
    requests end, as the profile row of its file writes it."""

    # The end of the request's ext_proc stream (the default).
    STREAM = "stream"
    # An entry of Envoy's gRPC access log (deploy/envoy-access-log.yaml).
    ACCESS_LOG = "access_log"
    # The end of its stream for the budget and, for a stream cut short, the access log entry
    # for the cause: Envoy ends the ext_proc stream alike whether the client left or the
    # upstream died, and only its access log tells them apart.
    STREAM_AND_LOG = "stream_and_log"
    # The end of its stream, which sees the response headers and never the body
    # (deploy/envoy-reservation.yaml): the completion is charged at its reservation.
    UNREAD = "unread"


# The key's values as plain strings, for Envoy files and error messages.
RELEASES = tuple(r.value for r in RouteRelease)
STREAM_AND_LOG = RouteRelease.STREAM_AND_LOG.value


class ReleaseMode(Enum):
    """ReleaseMode is how an admitted request's end reaches kvgate (``extproc.request.ending``
    has one kind of ending per mode)."""

    STREAM = "stream"
    STREAM_AND_LOG = "stream_and_log"
    OBSERVED = "observed"
    OBSERVED_AND_LOG = "observed_and_log"
    UNREAD = "unread"
    ACCESS_LOG = "access_log"

    # Members are singletons, equal by identity alone: hashed so, in C (Enum's own __hash__
    # is a Python call, and the ending's kind is looked up by its mode on every admission).
    __hash__ = object.__hash__

    @classmethod
    def choose(cls, response_sent: bool, route: RouteRelease | None, duplex: bool) -> ReleaseMode:
        """choose names the mode of a request admitted now: ``response_sent`` is False when
        the stream's protocol says response body NONE (the response is observed elsewhere, seen
        by its headers only, or not at all), ``route`` the route's ``release`` key, ``duplex`` a
        FULL_DUPLEX_STREAMED request body (its answer carries no link yet, so no entry can be
        matched to it)."""
        if not response_sent:
            if route is _ROUTE_ACCESS_LOG:
                return _ACCESS_LOG
            if route is _ROUTE_UNREAD:
                return _UNREAD
            return _OBSERVED_AND_LOG if route is _ROUTE_STREAM_AND_LOG else _OBSERVED
        if route is _ROUTE_STREAM_AND_LOG and not duplex:
            return _STREAM_AND_LOG
        return _STREAM

    @property
    def on_stream(self) -> bool:
        """on_stream: the response body comes on the admission stream, read by its ending."""
        return self is _STREAM or self is _STREAM_AND_LOG

    @property
    def observed(self) -> bool:
        """observed: the response is read from an observability-mode stream."""
        return self is _OBSERVED or self is _OBSERVED_AND_LOG

    @property
    def cause_from_log(self) -> bool:
        """cause_from_log: the cause of a stream cut short comes from its access log entry."""
        return self is _STREAM_AND_LOG or self is _OBSERVED_AND_LOG


# The members as module names for the request path: reading an attribute of an Enum class
# goes through EnumType.__getattr__'s hook in Python 3.11 (~1k instructions, a global ~0.1k).
_STREAM, _STREAM_AND_LOG = ReleaseMode.STREAM, ReleaseMode.STREAM_AND_LOG
_OBSERVED, _OBSERVED_AND_LOG = ReleaseMode.OBSERVED, ReleaseMode.OBSERVED_AND_LOG
_UNREAD, _ACCESS_LOG = ReleaseMode.UNREAD, ReleaseMode.ACCESS_LOG
_ROUTE_ACCESS_LOG, _ROUTE_UNREAD = RouteRelease.ACCESS_LOG, RouteRelease.UNREAD
_ROUTE_STREAM_AND_LOG = RouteRelease.STREAM_AND_LOG


class Seen(Enum):
    """Seen is how kvgate sees an admitted request's response in a file."""

    STREAM = "stream"  # the body on the admission stream (STREAMED, or FULL_DUPLEX_STREAMED)
    HEADERS = "headers"  # its headers on the admission stream, never the body
    OBSERVED = "observed"  # on a second, observability-mode ext_proc filter's stream
    LOG = "log"  # not at all: the access log entry tells its end and usage


@dataclass(frozen=True, slots=True)
class Profile:
    """Profile is one Envoy file of deploy/ as kvgate sees it (the module doc's table).

    ``headers_sent``: the request headers come to kvgate (else its body is the first message,
    with request attributes); ``duplex``: both bodies FULL_DUPLEX_STREAMED (the endpoint
    picker protocol); ``response``: how the response is seen; ``cause_from_log``: the access
    log entry of a stream cut short tells its cause; ``periodic``: Envoy writes a periodic
    access log entry of each stream in flight; ``picks``: Envoy routes by the node kvgate
    names (a pool that picks its nodes goes with these files and no other).
    """

    name: str
    file: str
    headers_sent: bool
    duplex: bool
    response: Seen
    cause_from_log: bool
    periodic: bool
    picks: bool

    @property
    def release(self) -> RouteRelease | None:
        """release is the route metadata ``release`` the file's routes carry (None: none)."""
        if self.response is Seen.LOG:
            return RouteRelease.ACCESS_LOG
        if self.response is Seen.HEADERS:
            return RouteRelease.UNREAD
        return RouteRelease.STREAM_AND_LOG if self.cause_from_log else None

    @property
    def mode(self) -> ReleaseMode:
        """mode is the ReleaseMode of every request admitted through this file: what
        ``ReleaseMode.choose`` makes of the route's ``release`` and the stream's protocol."""
        return ReleaseMode.choose(self.response is Seen.STREAM, self.release, self.duplex)


_ROWS = (
    Profile("three-message", "envoy.yaml", False, False, Seen.STREAM, True, False, False),
    Profile("four-message", "envoy-four-message.yaml", True, False, Seen.STREAM, True, False, False),
    Profile("reservation", "envoy-reservation.yaml", False, False, Seen.HEADERS, False, False, False),
    Profile("observe", "envoy-observe.yaml", False, False, Seen.OBSERVED, True, False, False),
    Profile("access-log", "envoy-access-log.yaml", False, False, Seen.LOG, False, False, False),
    Profile("endpoint-picker", "envoy-endpoint-picker.yaml", True, False, Seen.STREAM, True, False, True),
    Profile("endpoint-picker-log", "envoy-endpoint-picker-log.yaml", True, False, Seen.LOG, False, True,
            True),
    Profile("inference-pool", "envoy-inference-pool.yaml", True, True, Seen.STREAM, False, False, True),
)
PROFILES: dict[str, Profile] = {p.name: p for p in _ROWS}
"""PROFILES are the Envoy files kvgate is served by, by name (``kvgate envoy-filter --mode``)."""
