"""waitwatch: notices that Envoy ignored kvgate's message-timeout override for a waiting request.

A request that may wait in its class's queue first asks Envoy for a longer message timeout
(``override_message_timeout``: ``max_wait_s`` plus a margin). Envoy ignores an override above
its ``max_message_timeout`` (silently, on its side), and then resets the stream at the base
``message_timeout``: the client gets a 504 after that time, every time. From kvgate's side the
signature is a waiting request whose stream ends about the base timeout after its body
arrived, long before the wait it asked for. A client that gives up could look alike once;
this looks alike for every waiting request.
"""

from __future__ import annotations

# How far from the base timeout a reset still counts as cut there (seconds, and a ratio of
# the base): the reset reaches kvgate a little after Envoy fires it, later on a busy machine.
EARLY_S = 0.05
LATE_S = 0.5
LATE_RATIO = 0.5


def cut_at_base_timeout(waited_s: float, base_s: float, asked_s: float) -> bool:
    """cut_at_base_timeout tells whether a wait that ended after ``waited_s`` seconds was cut
    by Envoy's base ``message_timeout`` (``base_s``) although kvgate had asked for ``asked_s``.

    True when the override would have reached clearly past the base timeout and the wait
    ended within [base - EARLY_S, base * (1 + LATE_RATIO) + LATE_S].
    """
    late = base_s * (1.0 + LATE_RATIO) + LATE_S
    return asked_s > late and base_s - EARLY_S <= waited_s <= late
