"""admission: driving the admission core through the seams the request path uses, in-process.

``demand_of`` builds a request's ``Demand`` as the request path does (the tenant's class,
the completion it reserves by ``kvbudget.reserved_completion``); ``acquire_now`` runs
``Admission.acquire``, the request path's call, to an answer that comes without waiting.
The wait queues' timers follow a ``ManualClock`` given as the admission's ``timers``.
"""

from __future__ import annotations

import asyncio

from extproc.admission import Admission, Demand, Lease, Rejection
from extproc.admission.kvbudget import reserved_completion
from extproc.config import Config


def demand_of(config: Config, tenant: str, prompt_tokens: int, max_tokens: int | None = None,
              pool: str | None = None) -> Demand:
    """demand_of is a request's Demand under ``config``: ``tenant`` a configured tenant name
    (unknown ones get the default class); ``max_tokens`` the request's max_tokens (None: the
    pool's ``min(context_window - prompt, default_max_tokens)``); ``pool`` None the default
    pool. Raises KeyError for a pool that is not configured."""
    name = pool or config.default_pool
    cfg = config.pools[name]
    return Demand(pool=name, tenant=tenant, class_name=config.class_of(tenant).name, prompt_tokens=prompt_tokens,
                  reserved_completion=reserved_completion(prompt_tokens, max_tokens, cfg.context_window,
                                                          cfg.default_max_tokens))


def acquire_now(adm: Admission, demand: Demand) -> Lease | Rejection:
    """acquire_now is ``adm.acquire(demand)``'s answer where it comes at once: a demand admitted
    or refused without waiting, by a store that answers at once (no event loop is needed).

    A demand that would wait for capacity, or a store that answers asynchronously, is
    cancelled where it suspended (it leaves the queue and holds nothing) and raises
    AssertionError: await ``acquire`` instead.
    """
    coro = adm.acquire(demand)
    try:
        coro.send(None)
    except StopIteration as done:
        answer: Lease | Rejection = done.value
        return answer
    try:
        coro.throw(asyncio.CancelledError())
    except asyncio.CancelledError:
        pass
    finally:
        coro.close()
    raise AssertionError(f"acquire suspended for {demand!r}: await it instead")

