"""causes: the cause an admitted request is released with, and the completion tokens it is
settled with, as pure functions of what was seen (a table, one row per ``ReleaseMode``).

A lease is granted at the request body and released once, with a cause (the admission core's
``Outcome``). The ending of each mode (``extproc.request.ending``) feeds these functions what
it saw: the upstream status, the response's end, kvgate giving up, and what the access log
entry told of a stream cut short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extproc.admission import Outcome
from extproc.request.profile import ReleaseMode

if TYPE_CHECKING:
    from extproc.openai_usage import ResponseTracker

__all__ = ["awaits_log_cause", "cause_of", "charged_completion"]

# The members as module names: reading an attribute of an Enum class goes through
# EnumType.__getattr__'s hook in Python 3.11 (~1k instructions, a global ~0.1k), and these
# functions run at every release.
_COMPLETED, _CLIENT_DISCONNECT = Outcome.COMPLETED, Outcome.CLIENT_DISCONNECT
_UPSTREAM_ERROR, _TIMEOUT, _ENDED = Outcome.UPSTREAM_ERROR, Outcome.TIMEOUT, Outcome.ENDED
_UNREAD = ReleaseMode.UNREAD


def cause_of(mode: ReleaseMode, *, upstream_error: bool, response_done: bool, gave_up: bool,
             cut_by_upstream: bool | None) -> Outcome:
    """cause_of is the cause an admitted request is released with.

    upstream_error for an upstream 4xx/5xx; completed once the response's end (or a stream's
    ``[DONE]`` event) was seen (``response_done``); timeout when kvgate itself gave up; ended
    for a response whose body was not read (UNREAD: complete or cut short, Envoy ends the
    stream alike, by a half-close or a reset at random); upstream_error for a stream the
    access log says the upstream broke off (``cut_by_upstream``); client_disconnect otherwise.
    """
    if upstream_error:
        return _UPSTREAM_ERROR
    if response_done:
        return _COMPLETED
    if gave_up:
        return _TIMEOUT
    if mode is _UNREAD:
        return _ENDED
    if cut_by_upstream:
        return _UPSTREAM_ERROR
    return _CLIENT_DISCONNECT


def charged_completion(mode: ReleaseMode, outcome: Outcome, tracker: ResponseTracker | None,
                       streamed: bool, cut_by_upstream: bool | None) -> int | None:
    """charged_completion is the completion tokens a lease is settled with (None: unknown,
    the whole reservation stays charged): the reported usage; for a streamed response cut
    short, the chunks delivered (the upstream is reset within a millisecond of the client's
    disconnect, so what reached the client is what was generated)."""
    if tracker is not None and tracker.completion_tokens is not None:
        return tracker.completion_tokens
    if tracker is None and not mode.on_stream:
        return None  # the response was never observed
    if (outcome in (_CLIENT_DISCONNECT, _TIMEOUT) or cut_by_upstream) and streamed:
        return tracker.delivered_chunks if tracker is not None else 0
    return None


def awaits_log_cause(mode: ReleaseMode, outcome: Outcome, cut_by_upstream: bool | None) -> bool:
    """awaits_log_cause: a release whose cause is counted only when the access log entry
    comes (a stream cut short in a ``*_AND_LOG`` mode before its entry told who cut it)."""
    return (mode.cause_from_log and outcome is _CLIENT_DISCONNECT
            and cut_by_upstream is None)
