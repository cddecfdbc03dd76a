"""poll: one HTTP GET of a metrics endpoint, bounded in time and in size.

Blocking (stdlib ``http.client``), meant for the scraper's worker threads. Every way
the GET can go wrong is a ``ScrapeFailure`` with its reason; nothing else escapes.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from urllib.parse import urlsplit

from extproc.signals.sample import ScrapeError, ScrapeFailure

_CHUNK = 65536
# Ask for the classic text format: prometheus_client-based servers (vLLM, SGLang) answer
# OpenMetrics only to clients that ask for it.
_HEADERS = {
    "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "Accept-Encoding": "identity",
    "User-Agent": "kvgate-scraper",
}


def fetch(url: str, timeout_s: float, max_bytes: int) -> bytes:
    """fetch GETs ``url`` and returns the body (at most ``max_bytes`` bytes).

    The whole exchange (connect, headers, body) must end within ``timeout_s`` seconds:
    the deadline is re-armed on the socket before every read, so a server that drips
    bytes cannot hold the worker longer than a silent one. Raises ``ScrapeFailure``:
    ``connect`` (refused, reset, unreachable, bad URL), ``timeout``, ``http_status``
    (not 200, or not HTTP), ``too_large``, ``parse`` (body cut short).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeFailure(ScrapeError.CONNECT, f"not an http(s) URL: {url[:100]!r}")
    try:
        port = parts.port
    except ValueError:
        raise ScrapeFailure(ScrapeError.CONNECT, f"bad port in {url[:100]!r}") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    deadline = time.monotonic() + timeout_s
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout_s,
                                           context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s)
    resp: http.client.HTTPResponse | None = None
    try:
        conn.connect()
        sock = conn.sock  # kept: the connection drops its reference once the response owns it
        conn.request("GET", target, headers=_HEADERS)
        _rearm(sock, deadline)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeFailure(ScrapeError.HTTP_STATUS, f"HTTP {resp.status}")
        length = resp.getheader("content-length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise ScrapeFailure(ScrapeError.TOO_LARGE, f"content-length {int(length)} > {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            _rearm(sock, deadline)
            chunk = resp.read1(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeFailure(ScrapeError.TOO_LARGE, f"body over {max_bytes} bytes")
            chunks.append(chunk)
        # read1 ends quietly at EOF even when fewer bytes came than announced.
        if length is not None and length.strip().isdigit() and size < int(length):
            raise ScrapeFailure(ScrapeError.PARSE, f"body cut short: {size} of {int(length)} bytes")
        return b"".join(chunks)
    except ScrapeFailure:
        raise
    except (TimeoutError, socket.timeout):
        raise ScrapeFailure(ScrapeError.TIMEOUT, f"no complete answer within {timeout_s}s") from None
    except http.client.IncompleteRead as exc:
        raise ScrapeFailure(ScrapeError.PARSE, f"body cut short after {len(exc.partial)} bytes") from None
    except http.client.HTTPException as exc:
        raise ScrapeFailure(ScrapeError.HTTP_STATUS, f"not an HTTP answer: {type(exc).__name__}") from None
    except (OSError, ValueError) as exc:  # refused, reset, unreachable, DNS, TLS
        raise ScrapeFailure(ScrapeError.CONNECT, f"{type(exc).__name__}: {str(exc)[:120]}") from None
    finally:
        if resp is not None:
            resp.close()
        conn.close()


def _rearm(sock: socket.socket | None, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    if sock is not None:
        sock.settimeout(remaining)
