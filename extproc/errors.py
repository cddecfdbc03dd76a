"""errors: the small set of named error types kvgate raises."""

from __future__ import annotations


class KvgateError(Exception):
    """KvgateError is the base of every error kvgate raises on purpose."""


class ConfigError(KvgateError):
    """ConfigError says which configuration key is wrong and why.

    ``key`` is a dotted path into the file (``pools.default.tpm``); ``reason`` is a
    sentence an operator can act on.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class RequestError(KvgateError):
    """RequestError is a client request kvgate refuses as malformed (answered with 4xx),
    or cannot evaluate now (a 503 of the tokenizer's count pool).

    ``status`` is the HTTP status, ``code`` the OpenAI error code (or None), ``param``
    the request field at fault (or None), ``retry_after_s`` the seconds after which the
    same request may succeed (None: it never will; the answer says not to retry), ``allow``
    the methods a 405 names in its ``allow`` header (None: no such header).
    """

    def __init__(self, message: str, *, status: int = 400, code: str | None = None,
                 param: str | None = None, error_type: str = "invalid_request_error",
                 retry_after_s: float | None = None, allow: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.error_type = error_type
        self.retry_after_s = retry_after_s
        self.allow = allow
