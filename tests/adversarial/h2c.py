"""h2c: a deliberately small HTTP/2 (prior knowledge, cleartext) client for hostile tests.

It writes frames by hand so a test can do what well-behaved clients never do: open
several streams on one connection, reset some mid-response (RST_STREAM), drop the
connection with streams open. Request headers are HPACK literals without indexing;
response headers are not decoded (the tests read the DATA frames).
"""

from __future__ import annotations

import socket
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """frame is one HTTP/2 frame: 9-byte header (length, type, flags, stream id), payload."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _int(value: int, prefix_bits: int) -> bytes:
    """_int is an HPACK integer with an N-bit prefix (RFC 7541, 5.1)."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out = bytearray([top])
    value -= top
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """literal is a header field as an HPACK literal without indexing, new name, no Huffman."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


class H2Connection:
    """H2Connection is one h2c connection: requests out, frames in, per-stream results."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=5)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self._buf = b""
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self.goaway = False

    def request(self, stream: int, path: str, body: bytes,
                headers: list[tuple[bytes, bytes]] = ()) -> None:
        """request opens ``stream`` with a POST of ``body`` (one DATA frame, at most 16 KiB)."""
        block = b"".join(literal(k, v) for k, v in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
            (b":authority", b"gw"), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *headers])
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, block) +
                          frame(DATA, END_STREAM, stream, body))

    def cancel(self, stream: int) -> None:
        """cancel resets ``stream`` (RST_STREAM CANCEL), as a client giving up does."""
        self.sock.sendall(frame(RST_STREAM, 0, stream, CANCEL.to_bytes(4, "big")))

    def pump(self, done: object, timeout: float = 5.0) -> bool:
        """pump reads frames until ``done()`` is true or ``timeout`` passes; answers SETTINGS
        and PING as a client must. Returns whether ``done()`` became true."""
        deadline = time.monotonic() + timeout
        while not done():  # type: ignore[operator]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                return False
            if not chunk:
                self.goaway = True
                return bool(done())  # type: ignore[operator]
            self._buf += chunk
            self._frames()
        return True

    def _frames(self) -> None:
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[:3], "big")
            if len(self._buf) < 9 + length:
                return
            kind, flags = self._buf[3], self._buf[4]
            stream = int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF
            payload = self._buf[9:9 + length]
            self._buf = self._buf[9 + length:]
            if kind == SETTINGS and not flags & ACK:
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == DATA:
                self.data[stream] = self.data.get(stream, b"") + payload
            elif kind == RST_STREAM:
                self.reset.add(stream)
            elif kind == GOAWAY:
                self.goaway = True
            if kind in (DATA, HEADERS) and flags & END_STREAM:
                self.ended.add(stream)

    def close(self) -> None:
        self.sock.close()
