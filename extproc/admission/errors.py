"""errors: the admission core's named errors (refusals are values, not errors)."""

from __future__ import annotations

from extproc.errors import KvgateError


class AdmissionError(KvgateError):
    """AdmissionError is a call the admission core cannot serve (a caller's mistake)."""


class UnknownPoolError(AdmissionError):
    """UnknownPoolError is a pool name the current configuration does not have."""

    def __init__(self, pool: str) -> None:
        super().__init__(f"no pool named {pool!r} is configured")
        self.pool = pool


class InvalidDemandError(AdmissionError):
    """InvalidDemandError is a demand with token counts that are not integers >= 0."""
