"""faultproxy: a TCP proxy on a free loopback port that breaks the path to a server on demand.

Tests and benchmarks put it between a kvgate replica and Redis to do to the network what
stopping the server cannot: reset every connection (TCP RST, as a middlebox or a dying
peer does), stall replies while the connection stays up (a hung server or a congested
link), or refuse new connections. It runs in a thread of its own with blocking sockets,
so it works beside any event loop, uvloop included.

Modes (``FaultProxy.mode``): ``pass`` forwards both ways; ``reset`` resets the open
connections at once and every new one as soon as it is accepted; ``stall`` keeps the
connections but forwards nothing until the mode changes (bytes are held, not lost);
``refuse`` closes the listening socket's accepted connections with a reset and forwards
nothing (what a closed port looks like to a pooled client that reconnects).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvgate_testkit.procs import LOOPBACK

MODES = ("pass", "reset", "stall", "refuse")


def _reset(sock: socket.socket) -> None:
    """_reset closes ``sock`` with a TCP RST (SO_LINGER 0) instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """FaultProxy forwards 127.0.0.1:``port`` to ``target_port`` until told to break (see the module doc).

    ``resets`` counts the connections it reset. Start with ``start`` (or ``running``), stop
    with ``stop``; ``set_mode`` changes the mode at once, from any thread.
    """

    def __init__(self, target_port: int, target_host: str = LOOPBACK) -> None:
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.resets = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._peer: dict[socket.socket, socket.socket] = {}
        self._held: dict[socket.socket, bytearray] = {}  # bytes not yet written to each socket
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._stopping = False

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def set_mode(self, mode: str) -> None:
        """set_mode switches to ``mode`` (one of ``MODES``); ``reset`` and ``refuse`` reset the
        connections open now."""
        if mode not in MODES:
            raise ValueError(f"mode is one of {MODES}, not {mode!r}")
        with self._lock:
            self.mode = mode
        self._wake_w.send(b"m")

    def reset_open(self) -> None:
        """reset_open resets the connections open now and keeps the mode: what a middlebox
        that forgot its flows does; the client finds out when it next writes."""
        self._wake_w.send(b"r")

    def stop(self) -> None:
        self._stopping = True
        self._wake_w.send(b"s")
        self._thread.join(timeout=5)
        for s in list(self._peer):
            s.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stopping:
            for key, events in self._sel.select(timeout=0.5):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    got = self._wake_r.recv(64)
                    if self.mode in ("reset", "refuse") or b"r" in got:
                        self._reset_all()
                    self._update_interest()
                else:
                    self._io(key.fileobj, events)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self.mode in ("reset", "refuse"):
            self.resets += 1
            _reset(client)
            return
        try:
            server = socket.create_connection(self.target, timeout=1.0)
        except OSError:
            self.resets += 1
            _reset(client)
            return
        for s in (client, server):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._held[s] = bytearray()
        self._peer[client], self._peer[server] = server, client
        for s in (client, server):
            self._sel.register(s, self._interest(s), "io")

    def _interest(self, sock: socket.socket) -> int:
        if self.mode == "stall":
            return selectors.EVENT_READ  # read to hold bytes, write nothing
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if self._held.get(sock) else 0)

    def _update_interest(self) -> None:
        for s in list(self._peer):
            self._sel.modify(s, self._interest(s), "io")

    def _io(self, sock: socket.socket, events: int) -> None:
        peer = self._peer.get(sock)
        if peer is None:
            return
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._close_pair(sock, reset=False)
                return
            if data:
                self._held[peer] += data
                self._sel.modify(peer, self._interest(peer), "io")
        if events & selectors.EVENT_WRITE and self.mode != "stall":
            buf = self._held[sock]
            try:
                n = sock.send(buf)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._close_pair(sock, reset=True)
                return
            del buf[:n]
            self._sel.modify(sock, self._interest(sock), "io")

    def _close_pair(self, sock: socket.socket, reset: bool) -> None:
        peer = self._peer.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peer.pop(s, None)
            self._held.pop(s, None)
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            if reset:
                _reset(s)
            else:
                s.close()

    def _reset_all(self) -> None:
        """_reset_all resets every open connection, both sides (one count per pair)."""
        while self._peer:
            sock = next(iter(self._peer))
            self.resets += 1
            self._close_pair(sock, reset=True)


@contextmanager
def running(target_port: int) -> Iterator[FaultProxy]:
    """running is a started ``FaultProxy`` to 127.0.0.1:``target_port``, stopped afterwards."""
    proxy = FaultProxy(target_port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
