"""outcomes: the named values kvgate counts its decisions and access-log entries by.

``RequestOutcome`` is what kvgate decided on one request (the ``outcome`` label of
``kvgate_requests_total``); ``LogResult`` is what one entry of Envoy's access log did (the
``result`` label of ``kvgate_access_log_entries_total``). The cause a lease is released with
is the admission core's ``Outcome``. ``extproc.metrics`` takes every label value of these
families from the enums, so a value is written once, here.
"""

from __future__ import annotations

from enum import StrEnum

from extproc.admission.types import Reason


class RequestOutcome(StrEnum):
    """RequestOutcome is kvgate's decision on one request, in the order metrics list them."""

    ADMITTED = "admitted"
    # Let through without admission: a GET or HEAD without a body to a path of
    # limits.pass_paths, or anything not admitted with limits.unknown_paths: pass. Takes nothing.
    PASSED = "passed"
    REJECTED_CONCURRENCY = "rejected_concurrency"
    REJECTED_TPM = "rejected_tpm"
    REJECTED_KV_BUDGET = "rejected_kv_budget"
    REJECTED_SHED = "rejected_shed"
    # The request fitted, and this replica left the room to another replica sharing the pool
    # through Redis whose requests wait for it (store.fairshare).
    REJECTED_FAIR_SHARE = "rejected_fair_share"
    REJECTED_CONTEXT_LENGTH = "rejected_context_length"
    REJECTED_BODY_TOO_LARGE = "rejected_body_too_large"
    REJECTED_INVALID = "rejected_invalid"
    REJECTED_STORE_UNAVAILABLE = "rejected_store_unavailable"
    REJECTED_UNAUTHENTICATED = "rejected_unauthenticated"
    REJECTED_PATH = "rejected_path"
    REJECTED_NO_ENDPOINT = "rejected_no_endpoint"
    # The count pool could not count a long prompt without word breaks (busy, or its
    # worker ran past its timeout or died): a 503.
    REJECTED_TOKENIZER_UNAVAILABLE = "rejected_tokenizer_unavailable"

    @property
    def reason(self) -> str:
        """reason is the refusal's ``x-kvgate-reason`` header value (the outcome without
        ``rejected_``)."""
        return self.value.removeprefix("rejected_")


# The outcome of a refusal by the admission core, by the budget that refused.
REJECTED_BY = {
    Reason.CONCURRENCY: RequestOutcome.REJECTED_CONCURRENCY,
    Reason.TPM: RequestOutcome.REJECTED_TPM,
    Reason.KV_BUDGET: RequestOutcome.REJECTED_KV_BUDGET,
    Reason.SHED: RequestOutcome.REJECTED_SHED,
    Reason.FAIR_SHARE: RequestOutcome.REJECTED_FAIR_SHARE,
}


class LogResult(StrEnum):
    """LogResult is what one entry of Envoy's access log did (``Endings.logged``)."""

    # It released a request parked until its entry came (route ``release: access_log``).
    RELEASED = "released"
    # It told the cause of a request released by its stream (``release: stream_and_log``).
    CAUSE = "cause"
    # It came for a stream_and_log request whose stream ended complete: nothing to tell.
    COMPLETE = "complete"
    # The request has no lease here (refused, passed through).
    NO_LEASE = "no_lease"
    # Its link is known nowhere here (released by the TTL, another kvgate's, a restart's).
    UNMATCHED = "unmatched"
    # A periodic entry of a request in flight, parked here: its progress went to its node's
    # ledger (deploy/envoy-endpoint-picker-log.yaml). Never a release.
    PROGRESS = "progress"
    # A periodic entry whose event count is not a count (the upstream's stream is outside
    # input): ignored, the ledger keeps what it knew.
    PROGRESS_INVALID = "progress_invalid"
    # A periodic entry of a request not parked here (refused, passed through, released,
    # another mode's): nothing to do.
    PERIODIC = "periodic"
    # An entry that does not parse, or a batch whose framing is broken (one for the batch:
    # its entries cannot be counted): refused, nothing of it applied (endings.AccessLogReceiver).
    MALFORMED = "malformed"
