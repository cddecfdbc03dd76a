"""openai_api: what kvgate understands of the OpenAI HTTP API.

Request side: which paths are admitted, parsing and validating a body into a
``ParsedRequest`` (every bad input is a ``RequestError`` with OpenAI's error shape; the
prompt-bearing fields are validated into ``openai_shapes``' shapes),
prompt tokens, the completion reservation, the context-window check, and asking the
upstream for stream usage. Response side (reading the usage reported): ``openai_usage``. Answers: the
OpenAI-shaped error bodies, 429s and ``x-ratelimit-*`` headers.

Nothing here knows about gRPC or Envoy; bodies are bytes in, bytes out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import unquote

import orjson

from extproc.admission.kvbudget import reserved_completion
from extproc.admission.types import Chain, RateInfo, Reason, Rejection
from extproc.errors import RequestError
from extproc.openai_shapes import (
    ChatShape,
    ChatTemplate,
    PromptShape,
    chat_shape,
    count_prompt_shape,
    count_shape,
    prompt_shape,
    responses_shape,
)
from extproc.tokens import Tokenizer

MAX_TOKENS_LIMIT = 10_000_000
"""MAX_TOKENS_LIMIT is the largest max_tokens accepted (tokens): anything above is absurd."""
MAX_CHOICES = 128
"""MAX_CHOICES is the largest ``n`` (and ``best_of``) accepted, OpenAI's own cap."""


class Endpoint(StrEnum):
    """Endpoint is an OpenAI API kvgate admits; other paths pass through unchecked."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"  # the OpenAI Responses API: generates like chat


# The members as module names for the request path: reading an attribute of an Enum class
# goes through EnumType.__getattr__'s hook in Python 3.11 (~1k instructions, a global ~0.1k).
_CHAT, _COMPLETIONS, _EMBEDDINGS, _RESPONSES = (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS,
                                                Endpoint.RESPONSES)

_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    "/v1/responses": Endpoint.RESPONSES,
}
_SLASHES = re.compile(r"/{2,}")


def normalise_path(path: str) -> str:
    """normalise_path is a request path as the inference server's router sees it: without
    query or fragment, percent-decoded, repeated and trailing slashes dropped."""
    end = len(path)
    for sep in ("?", "#"):
        i = path.find(sep)
        if 0 <= i < end:
            end = i
    p = path[:end]
    if p in _PATHS:
        return p
    if "%" in p:
        p = unquote(p, errors="strict") if _valid_escapes(p) else p
    if "//" in p:
        p = _SLASHES.sub("/", p)
    if len(p) > 1 and p.endswith("/"):
        p = p.rstrip("/")
    return p


def endpoint_for_path(path: str) -> Endpoint | None:
    """endpoint_for_path maps a request path (query allowed) to its Endpoint, or None.

    The path is normalised first (``normalise_path``), so ``/v1//chat/%63ompletions/``
    cannot slip past admission to a server that routes it to chat completions.
    """
    hit = _PATHS.get(path)
    return hit if hit is not None else _PATHS.get(normalise_path(path))


# The methods a path of ``limits.pass_paths`` (an engine's endpoint that generates nothing:
# models, health, version, metrics) is let through with, as a 405's ``allow`` header says them.
PASS_METHODS = frozenset({"GET", "HEAD"})
PASS_ALLOW = "GET, HEAD"


def path_passes(path: str, patterns: tuple[str, ...]) -> bool:
    """path_passes tells whether a normalised path matches one of ``patterns``: an exact
    path, or a prefix when the pattern ends with ``*``."""
    for pattern in patterns:
        if pattern.endswith("*"):
            if path.startswith(pattern[:-1]):
                return True
        elif path == pattern:
            return True
    return False


def _valid_escapes(p: str) -> bool:
    try:
        unquote(p, errors="strict")
    except UnicodeDecodeError:
        return False
    return True


@dataclass(slots=True)
class ParsedRequest:
    """ParsedRequest is a validated OpenAI request body and what admission needs of it.

    ``max_tokens``: the explicit completion cap per choice (``max_completion_tokens``
    wins over ``max_tokens``), None when absent, 0 for embeddings; ``n``: choices per
    prompt; ``best_of``: sequences generated per prompt when larger than n (None when
    absent); ``prompts``: prompts in the request (a completions batch); ``chat`` /
    ``prompt``: the validated shapes to count; ``max_prompt_tokens``: the longest single
    prompt in tokens, set by ``count_prompt_tokens``; ``suffix``: a completions suffix,
    read by the model with every prompt; ``prefix``: the prompt's prefix chain, where the
    pool counts shared prefixes once (``extproc.prefix``; None: not chained); ``blocks``: the
    keys of its prompt's engine token ids, where the pool reads KV events
    (``engine_blocks.token_keys``; None: not known).
    """

    endpoint: Endpoint
    model: str | None
    stream: bool
    client_wants_usage: bool
    max_tokens: int | None
    n: int
    body: dict[str, Any]
    best_of: int | None = None
    prompts: int = 1
    chat: ChatShape | None = None
    prompt: PromptShape | None = None
    max_prompt_tokens: int | None = None
    suffix: str | None = None
    prefix: Chain | None = None
    blocks: tuple[int, ...] | None = None

    @property
    def sequences(self) -> int:
        """sequences is how many completions the server generates for this request."""
        n, best_of = self.n, self.best_of
        return (best_of if best_of is not None and best_of > n else n) * self.prompts


def _bad(message: str, param: str | None, *, status: int = 400, code: str | None = None) -> RequestError:
    return RequestError(message, status=status, code=code, param=param)


def _check_content_type(content_type: str | None) -> None:
    """_check_content_type refuses (415) a body that is declared as something but JSON.

    A missing content-type is accepted, as the inference servers do.
    """
    if content_type is None or content_type == "application/json":  # the usual one, read at once
        return
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if not media:
        return
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise _bad(f"Unsupported Content-Type {media[:100]!r}: the body must be application/json.",
                   None, status=415, code="unsupported_media_type")
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8", "us-ascii"):
            raise _bad(f"Unsupported charset {value.strip()[:40]!r}: JSON bodies must be UTF-8.",
                       None, status=415, code="unsupported_media_type")


def _load_json(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    if not body:
        raise _bad("We could not parse the JSON body of your request: the body is empty. "
                   "The OpenAI API expects a JSON payload.", None)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if "UTF-8" in reason or "surrogate" in reason:
            msg = "The request body is not valid UTF-8 JSON."
        elif "depth" in reason or "recursion" in reason:
            msg = "The JSON body of your request is nested too deeply."
        else:
            msg = "We could not parse the JSON body of your request: " + reason[:200]
        raise _bad(msg, None) from None
    if not isinstance(obj, dict):
        raise _bad(f"The JSON body must be an object, not {_json_type(obj)}.", None)
    return obj


def _json_type(x: Any) -> str:
    if isinstance(x, list):
        return "an array"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, bool):
        return "a boolean"
    if x is None:
        return "null"
    return "a number"


def _opt_int(body: dict[str, Any], key: str, *, minimum: int, maximum: int) -> int | None:
    """_opt_int reads an optional integer field in [minimum, maximum]; null counts as absent."""
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int:  # bools are not counts; neither are decimals (OpenAI agrees)
        raise _bad(f"Invalid type for '{key}': expected an integer, but got {_json_type(value)}.", key)
    if value < minimum:
        raise _bad(f"Invalid '{key}': integer below minimum value. Expected a value >= {minimum}, "
                   f"but got {value} instead.", key, code="integer_below_min_value")
    if value > maximum:
        raise _bad(f"Invalid '{key}': integer above maximum value. Expected a value <= {maximum}, "
                   f"but got {value} instead.", key, code="integer_above_max_value")
    return value


def _opt_bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        param = param or key
        raise _bad(f"Invalid type for '{param}': expected a boolean, but got {_json_type(value)}.", param)
    return value


def parse_request(endpoint: Endpoint, body: bytes, content_type: str | None) -> ParsedRequest:
    """parse_request validates an OpenAI request body and returns what admission needs.

    ``max_tokens`` (and ``max_completion_tokens``) must be integers in [1, 10M]: inference
    servers refuse 0 (vLLM: "max_tokens must be at least 1"), so kvgate answers it at once.
    Raises RequestError: 415 for a declared content-type other than JSON; 400 for an
    empty, malformed, non-UTF-8 or too deeply nested body, a body that is not an object,
    a missing or malformed ``messages`` / ``prompt`` / ``input``, and any field of the
    wrong type or out of range (``param`` names it).
    """
    _check_content_type(content_type)
    obj = _load_json(body)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"Invalid type for 'model': expected a string, but got {_json_type(model)}.", "model")
    if endpoint is _EMBEDDINGS:
        if "input" not in obj:
            raise _bad("Missing required parameter: 'input'.", "input", code="missing_required_parameter")
        shape = prompt_shape(obj["input"], "input")
        return ParsedRequest(endpoint=endpoint, model=model, stream=False, client_wants_usage=False,
                             max_tokens=0, n=1, body=obj, prompts=shape.prompts, prompt=shape)

    if endpoint is _RESPONSES:
        return _parse_responses(obj, model)
    # A field's check is called only when the body has it: most bodies have few of these,
    # and a call costs more than the lookup.
    stream = _opt_bool(obj, "stream") if "stream" in obj else False
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("Invalid type for 'stream_options': expected an object.", "stream_options")
        include_usage = _opt_bool(options, "include_usage", "stream_options.include_usage")
    n = (_opt_int(obj, "n", minimum=1, maximum=MAX_CHOICES) if "n" in obj else None) or 1
    best_of = _opt_int(obj, "best_of", minimum=1, maximum=MAX_CHOICES) if "best_of" in obj else None
    max_tokens = (_opt_int(obj, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
                  if "max_tokens" in obj else None)
    if endpoint is _CHAT:
        explicit = (_opt_int(obj, "max_completion_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
                    if "max_completion_tokens" in obj else None)
        if explicit is not None:
            max_tokens = explicit  # the newer name wins, as in vLLM
        if "messages" not in obj:
            raise _bad("Missing required parameter: 'messages'.", "messages", code="missing_required_parameter")
        chat = chat_shape(obj["messages"], obj.get("tools"))
        return ParsedRequest(endpoint=endpoint, model=model, stream=stream,
                             client_wants_usage=stream and include_usage, max_tokens=max_tokens,
                             n=n, body=obj, best_of=best_of, chat=chat)
    if "prompt" not in obj:
        raise _bad("Missing required parameter: 'prompt'.", "prompt", code="missing_required_parameter")
    shape = prompt_shape(obj["prompt"], "prompt")
    suffix = obj.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise _bad(f"Invalid type for 'suffix': expected a string, but got {_json_type(suffix)}.", "suffix")
    return ParsedRequest(endpoint=endpoint, model=model, stream=stream,
                         client_wants_usage=stream and include_usage, max_tokens=max_tokens,
                         n=n, body=obj, best_of=best_of, prompts=shape.prompts, prompt=shape,
                         suffix=suffix or None)


def _parse_responses(obj: dict[str, Any], model: str | None) -> ParsedRequest:
    """_parse_responses validates a Responses API body (``input``, ``instructions``,
    ``max_output_tokens``, ``stream``); the prompt is ``responses_shape``'s."""
    if "input" not in obj:
        raise _bad("Missing required parameter: 'input'.", "input", code="missing_required_parameter")
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("Invalid type for 'instructions': expected a string, but got "
                   f"{_json_type(instructions)}.", "instructions")
    shape = responses_shape(obj["input"], instructions)
    max_tokens = _opt_int(obj, "max_output_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    stream = _opt_bool(obj, "stream")
    return ParsedRequest(endpoint=Endpoint.RESPONSES, model=model, stream=stream,
                         client_wants_usage=stream, max_tokens=max_tokens, n=1, body=obj,
                         prompt=shape)


def count_prompt_tokens(req: ParsedRequest, tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """count_prompt_tokens returns the request's prompt tokens, chat-template overhead included.

    Also records ``req.max_prompt_tokens``, the longest single prompt, which the context
    check uses for a completions batch.
    """
    if req.chat is not None:
        n = count_shape(req.chat, tokenizer, template)
        req.max_prompt_tokens = n
        return n
    if req.prompt is None:  # a ParsedRequest built by hand
        raise ValueError("ParsedRequest has neither a chat nor a prompt shape")
    counts = count_prompt_shape(req.prompt, tokenizer)
    if req.suffix:  # the model reads the suffix with every prompt
        extra = tokenizer.count(req.suffix)
        counts = [c + extra for c in counts]
    req.max_prompt_tokens = max(counts, default=0)
    return sum(counts)


def request_reservation(req: ParsedRequest, prompt_tokens: int, context_window: int,
                        default_max_tokens: int) -> int:
    """request_reservation is the completion tokens to reserve for a whole request (tokens).

    Per generated sequence, the admission core's rule (``kvbudget.reserved_completion``)
    against the longest prompt of the request; times the sequences the server generates
    (n or best_of, per prompt). Embeddings reserve 0.
    """
    if req.endpoint is _EMBEDDINGS:
        return 0
    longest = req.max_prompt_tokens if req.max_prompt_tokens is not None else prompt_tokens
    return reserved_completion(longest, req.max_tokens, context_window, default_max_tokens) * req.sequences


def check_context(req: ParsedRequest, prompt_tokens: int, reserved: int, context_window: int) -> None:
    """check_context refuses a request that cannot fit the model's context window.

    Every sequence must hold its prompt plus its completion: the longest prompt (for a
    batch) plus the reserved completion per sequence; a chat or completion also needs
    room for at least one generated token. Raises RequestError 400
    ``context_length_exceeded`` in OpenAI's words.
    """
    longest = req.max_prompt_tokens if req.max_prompt_tokens is not None else prompt_tokens
    sequences = req.sequences
    per_seq = reserved // sequences if sequences > 0 else reserved
    if req.endpoint is _EMBEDDINGS:
        if longest <= context_window:
            return
        per_seq = 0
    elif longest + (1 if per_seq < 1 else per_seq) <= context_window:
        return
    param = {Endpoint.CHAT: "messages", Endpoint.COMPLETIONS: "prompt"}.get(req.endpoint, "input")
    where = "messages" if req.endpoint is _CHAT else "prompt"
    raise _bad(f"This model's maximum context length is {context_window} tokens. However, you "
               f"requested {longest + per_seq} tokens ({longest} in the {where}, {per_seq} in the "
               f"completion). Please reduce the length of the {where} or completion.",
               param, code="context_length_exceeded")


def upstream_body(req: ParsedRequest, *, cap_max_tokens: int | None = None,
                  stream_usage: bool = True) -> tuple[bytes | None, bool]:
    """upstream_body is the body to send upstream instead of the client's, and whether the
    usage chunk it asks for must be hidden from the client: ``(None, False)`` leaves the
    body as it is.

    Two rewrites. Stream usage: when the client streams without
    ``stream_options.include_usage``, the upstream would never report usage, so kvgate asks
    for it (the ResponseTracker then hides the usage chunk from the client) and turns vLLM's
    ``continuous_usage_stats`` off with it, so no other chunk changes. The cap: when
    ``cap_max_tokens`` is given and the request sets no completion cap, ``max_tokens =
    cap_max_tokens`` (tokens per sequence: the completion kvgate reserved), so generation
    cannot outgrow the reservation that the KV budget and the TPM bucket were charged.
    ``stream_usage=False`` skips the first (the response is not seen by this stream, so
    nothing could hide it).
    """
    if req.endpoint is _EMBEDDINGS:
        return None, False
    # A Responses stream always reports usage (its response.completed event).
    add_usage = stream_usage and req.stream and not req.client_wants_usage
    set_cap = cap_max_tokens is not None and req.max_tokens is None
    if not add_usage and not set_cap:
        return None, False
    body = dict(req.body)
    if req.endpoint is _RESPONSES:
        body["max_output_tokens"] = cap_max_tokens
        try:
            return orjson.dumps(body), False
        except orjson.JSONEncodeError:
            return None, False
    if add_usage:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        if options.get("continuous_usage_stats"):
            options["continuous_usage_stats"] = False
        body["stream_options"] = options
    if set_cap:
        body["max_tokens"] = cap_max_tokens
    try:
        return orjson.dumps(body), add_usage
    except orjson.JSONEncodeError:
        # orjson reads 1024 levels but writes only 254: such a body goes upstream as sent,
        # and without a reported usage the whole reservation is charged.
        return None, False


# --- answers -----------------------------------------------------------------------

def error_body(message: str, *, error_type: str, code: str | None, param: str | None = None) -> bytes:
    """error_body is OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def format_reset(seconds: float) -> str:
    """format_reset writes a delay as OpenAI's reset headers do: ``12ms``, ``1s``, ``6m0s``, ``1h2m3.5s``.

    Under a second: whole milliseconds, rounded up (a positive delay is at least 1ms).
    Zero, negative or not finite: ``0s``.
    """
    if not math.isfinite(seconds) or seconds <= 0:
        return "0s"
    ms = math.ceil(seconds * 1000 - 1e-9)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}" if rest % 1000 == 0 else f"{rest / 1000:.3f}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(rate: RateInfo | None) -> list[tuple[str, str]]:
    """rate_limit_headers are the ``x-ratelimit-*`` headers of a decision (none for None).

    The ``-requests`` family reports concurrency slots; the ``-tokens`` family the TPM
    bucket, only when the pool has one. Remaining counts never go below 0 (a bucket in
    debt reports 0).
    """
    if rate is None:
        return []
    # Conditional expressions, not max(): a builtin's call costs several times as many
    # instructions, and this runs on every admitted request.
    limit, remaining, reset = rate.limit_requests, rate.remaining_requests, rate.reset_requests_s
    headers = [
        ("x-ratelimit-limit-requests", str(limit) if limit > 0 else "0"),
        ("x-ratelimit-remaining-requests", str(remaining) if remaining > 0 else "0"),
        ("x-ratelimit-reset-requests", format_reset(reset) if reset > 0 else "0s"),
    ]
    limit_tokens = rate.limit_tokens
    if limit_tokens is not None:
        left = rate.remaining_tokens
        left = int(left) if left is not None else limit_tokens
        reset = rate.reset_tokens_s
        headers += (
            ("x-ratelimit-limit-tokens", str(limit_tokens) if limit_tokens > 0 else "0"),
            ("x-ratelimit-remaining-tokens", str(left) if left > 0 else "0"),
            ("x-ratelimit-reset-tokens", format_reset(reset) if reset > 0 else "0s"),
        )
    return headers


_MAX_RETRY_S = 86_400.0
_RATE_TYPES = {Reason.TPM: "tokens", Reason.KV_BUDGET: "tokens"}


def rejection_response(rej: Rejection) -> tuple[int, list[tuple[str, str]], bytes]:
    """rejection_response is the 429 a refused request gets: status, headers, body.

    ``retry-after`` is whole seconds (at least 1), ``retry-after-ms`` the exact delay (what
    openai-python reads first); ``x-kvgate-reason`` names the budget; a request that can
    never fit adds ``x-should-retry: false``. The body's ``type`` is ``tokens`` for TPM and
    KV refusals, ``requests`` for concurrency and shedding, as OpenAI's 429s are.
    """
    delay = rej.retry_after_s
    if not math.isfinite(delay) or delay < 0:
        delay = _MAX_RETRY_S
    delay = min(delay, _MAX_RETRY_S)
    headers = [
        ("content-type", "application/json"),
        ("retry-after", str(max(1, math.ceil(delay)))),
        ("retry-after-ms", str(max(1, math.ceil(delay * 1000)))),
        ("x-kvgate-reason", rej.reason.value),
    ]
    if not rej.retryable:
        headers.append(("x-should-retry", "false"))
    headers += rate_limit_headers(rej.rate)
    body = error_body(rej.message, error_type=_RATE_TYPES.get(rej.reason, "requests"),
                      code="rate_limit_exceeded")
    return 429, headers, body


def request_error_response(err: RequestError) -> tuple[int, list[tuple[str, str]], bytes]:
    """request_error_response is the answer to a request kvgate refuses before admission:
    with ``x-should-retry: false`` (a malformed request), or ``x-should-retry: true`` and
    ``retry-after`` when the same request may pass later (``err.retry_after_s``, seconds);
    a 405 names the methods it allows (``allow``)."""
    if err.retry_after_s is None:
        headers = [("content-type", "application/json"), ("x-should-retry", "false")]
    else:
        headers = [("content-type", "application/json"), ("x-should-retry", "true"),
                   ("retry-after", str(max(1, math.ceil(err.retry_after_s)))),
                   ("retry-after-ms", str(max(1, math.ceil(err.retry_after_s * 1000))))]
    if err.allow is not None:
        headers.append(("allow", err.allow))
    body = error_body(err.message, error_type=err.error_type, code=err.code, param=err.param)
    return err.status, headers, body
