"""refusals: the answers kvgate ends a request with before admitting it, and the errors they
carry: a path or method it does not admit, a pass path asked for wrongly, no endpoint the proxy
allows. Counting them is the caller's (the arrival's), in the pool and class it names."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import openai_api as oai
from extproc.answers import immediate, unavailable
from extproc.errors import RequestError
from extproc.outcomes import RequestOutcome

__all__ = ["no_eligible_endpoint", "pass_error", "path_error", "refusal", "shown"]


def shown(path: str) -> str:
    """shown is a request path as an error message may quote it (100 characters, ASCII)."""
    return path[:100].encode("ascii", "backslashreplace").decode()


def refusal(err: RequestError, outcome: RequestOutcome) -> pb.ProcessingResponse:
    """refusal is the ImmediateResponse that refuses a request with ``err`` (OpenAI's error
    shape), named by ``outcome`` in ``x-kvgate-reason`` unless the error names its own."""
    status, headers, payload = oai.request_error_response(err)
    if not any(k == "x-kvgate-reason" for k, _ in headers):
        headers = [*headers, ("x-kvgate-reason", outcome.reason)]
    return immediate(status, headers, payload, f"kvgate_{outcome}")


def path_error(path: str, admitted_path: bool) -> RequestError:
    """path_error refuses a path kvgate neither admits nor lets through (404), or an admitted
    path with another method than POST (405): on an inference route nothing reaches the GPUs
    unadmitted (``limits.unknown_paths``). Counted ``rejected_path``."""
    if admitted_path:
        return RequestError(f"{shown(path)} accepts POST only.", status=405, code="method_not_allowed",
                            allow="POST")
    return RequestError(f"Unknown request URL: {shown(path)}. This gateway serves "
                        "/v1/chat/completions, /v1/completions, /v1/embeddings and "
                        "/v1/responses.", status=404, code="unknown_url")


def pass_error(path: str, method: str, body: bool) -> tuple[RequestError, RequestOutcome] | None:
    """pass_error refuses a pass path (``limits.pass_paths``) asked for otherwise than as a GET
    or HEAD without a body (``body``): 405 with ``allow: GET, HEAD``, or 400; None: it passes."""
    if method not in oai.PASS_METHODS:
        return RequestError(f"{shown(path)} accepts GET and HEAD only.", status=405,
                            code="method_not_allowed", allow=oai.PASS_ALLOW), RequestOutcome.REJECTED_PATH
    if body:
        return RequestError(f"{shown(path)} takes no request body; send the {method} without one.",
                            code="body_not_allowed"), RequestOutcome.REJECTED_INVALID
    return None


def no_eligible_endpoint(retry: bool) -> pb.ProcessingResponse:
    """no_eligible_endpoint is the protocol's 503 when the proxy's subset hint allows no node
    kvgate may pick (empty, unknown addresses, or every allowed node not up).

    ``retry``: the hint names nodes of the pool that are not up now and may come back, so a
    retry may pass (``x-should-retry: true``, ``retry-after``); a hint that names none of them
    (empty, or addresses of no node: a gateway/pool mismatch) would be refused again
    (``x-should-retry: false``). Counted ``rejected_no_endpoint``."""
    if retry:
        return unavailable("no_endpoint", "None of the endpoints this request may go to can "
                           "take it now. Retry shortly.", code="no_eligible_endpoint",
                           retry_after_ms=False)
    return unavailable("no_endpoint", "None of the endpoints this request may go to is a "
                       "node of this pool; retrying will not change that.",
                       code="no_eligible_endpoint", should_retry=False)
