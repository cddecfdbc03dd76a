"""reload: hot reload of kvgate's configuration file, on change and on SIGHUP.

A ``ConfigWatcher`` re-reads the configuration file every ``poll_s`` seconds on a small
daemon thread (file I/O and YAML parsing stay off the event loop) and whenever SIGHUP
arrives. A change is detected by the SHA-256 of the file's content, not its mtime:
Kubernetes updates a mounted ConfigMap by swapping a ``..data`` symlink, which leaves the
path's own mtime and inode of the link unchanged and may even move mtimes backwards.

Delivery rules:
- a new content is read only once it is *settled*: seen with the same fingerprint by two
  checks at least ``settle_s`` apart. A plain file rewritten in place passes through
  truncated states that may be valid YAML and a valid configuration (a file cut after the
  pools drops every class and tenant); a ConfigMap update (an atomic symlink swap) or a
  write-then-rename never shows one, and is merely delivered a poll later;
- a valid new content -> ``on_config(Config)`` once;
- an invalid content (unreadable, not YAML, a bad key) -> ``on_error(ConfigError)`` once,
  and the configuration in force stays what it was: nothing is delivered;
- the same content again (valid or not) -> nothing, so a broken file left in place does
  not log an error every second; SIGHUP re-reads and re-delivers even an unchanged file.

What applying a configuration means (new limits for new admissions, granted leases
untouched), the log lines an operator reads and the metrics
``kvgate_config_reload_total`` / ``..._errors_total`` belong to the ``on_config`` /
``on_error`` callbacks that the server passes in; the watcher itself logs at debug level.
So does the reload guard: settling keeps out the truncated states a writer passes through, not
a file left cut short (a writer that died, an editor's half save), so the server compares each
delivered ``Config`` with the one in force and refuses one that would remove pools, backends
or keyed tenants unless the file allows it (``configdiff``). A refused content is not
delivered again until it changes (or SIGHUP), like an invalid one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from extproc.clock import Clock
from extproc.config import Config
from extproc.configparse import load_config
from extproc.errors import ConfigError

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""MAX_CONFIG_BYTES is the largest configuration file read (bytes): a bigger one is refused."""
SETTLE_S = 0.5
"""SETTLE_S is how long (seconds) a new content must stay unchanged before it is read."""

_T = TypeVar("_T")


class ConfigWatcher:
    """ConfigWatcher loads a configuration file again when its content changes.

    ``on_config`` receives each new valid ``Config``; ``on_error`` each refused file's
    ``ConfigError``. With ``loop`` given, both run on that event loop's thread (through
    ``call_soon_threadsafe``); without it, on the thread that read the file (the watcher
    thread, or the caller of ``check_now``). ``poll_s`` is the polling period in seconds,
    measured on ``clock``; ``settle_s`` how long a new content must stay the same before
    it is read (seconds; 0 reads it at the first check). A forced check (SIGHUP) does not
    wait: the operator says the file is complete.

    Typical use by the server::

        watcher = ConfigWatcher(path, apply, refuse, MonotonicClock(), loop=loop)
        config = watcher.load_initial()      # raises ConfigError: refuse to start
        watcher.start(); watcher.install_sighup(loop)
        ...
        watcher.stop()
    """

    __slots__ = ("_path", "_on_config", "_on_error", "_clock", "_poll_s", "_loop",
                 "_lock", "_applied", "_refused", "_next_due", "_thread", "_wake",
                 "_stopping", "_forced", "loaded_at", "refused_at", "_settle_s", "_pending")

    def __init__(self, path: str | Path, on_config: Callable[[Config], None],
                 on_error: Callable[[Exception], None], clock: Clock, poll_s: float = 1.0,
                 *, loop: asyncio.AbstractEventLoop | None = None,
                 settle_s: float = SETTLE_S) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0 seconds, got {poll_s!r}")
        if not settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0 seconds, got {settle_s!r}")
        self._settle_s = float(settle_s)
        # (fingerprint, first seen at) of a new content not yet settled.
        self._pending: tuple[str, float] | None = None
        self._path = Path(path)
        self._on_config = on_config
        self._on_error = on_error
        self._clock = clock
        self._poll_s = float(poll_s)
        self._loop = loop
        # One check at a time: the poll thread and a SIGHUP or a test may ask at once.
        self._lock = threading.Lock()
        self._applied: str | None = None   # fingerprint of the configuration in force
        self._refused: str | None = None   # fingerprint of the last refused content
        self._next_due = clock.now()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._forced = False
        self.loaded_at: float | None = None
        """loaded_at is the clock instant (seconds) the configuration in force was read."""
        self.refused_at: float | None = None
        """refused_at is the clock instant (seconds) of the last refused file, or None."""

    @property
    def path(self) -> Path:
        """path is the watched configuration file."""
        return self._path

    def load_initial(self) -> Config:
        """load_initial reads the file for startup and marks it as the configuration in force.

        Raises ``ConfigError`` when the file does not validate; no callback runs either way,
        so the first poll afterwards delivers nothing unless the file changed meanwhile.
        """
        with self._lock:
            for _ in range(3):
                fingerprint = self._fingerprint()
                try:
                    config = self._load(fingerprint)
                except _Changed:
                    continue
                self._applied, self._refused = fingerprint, None
                self.loaded_at = self._clock.now()
                return config
            raise ConfigError(str(self._path), "keeps changing while being read")

    def check_now(self, force: bool = False) -> bool:
        """check_now re-reads the file and delivers it if its content changed.

        Returns True when a new configuration was delivered to ``on_config``; False when
        the content is unchanged or was refused (``on_error`` then ran, once per content).
        ``force`` re-delivers an unchanged file and reports an unchanged refused one again.
        Synchronous: with no ``loop`` the callback has run when this returns.
        """
        with self._lock:
            now = self._clock.now()
            self._next_due = now + self._poll_s
            fingerprint = self._fingerprint()
            if not force and fingerprint == self._applied:
                self._refused = None  # back to the file in force: a later bad file is news
                return False
            if not force and fingerprint == self._refused:
                return False
            if not force and self._settle_s > 0:
                pending = self._pending
                if pending is None or pending[0] != fingerprint:
                    self._pending = (fingerprint, now)
                    self._next_due = now + min(self._settle_s, self._poll_s)
                    return False
                if now - pending[1] < self._settle_s:
                    return False
            self._pending = None
            try:
                config = self._load(fingerprint)
            except _Changed:
                return False  # rewritten while read: the next check sees the final content
            except ConfigError as exc:
                self._refused = fingerprint
                self.refused_at = now
                # The on_error callback logs and counts it (one line, not two).
                log.debug("configuration %s refused: %s", self._path, exc)
                self._deliver(self._on_error, exc)
                return False
            self._applied, self._refused = fingerprint, None
            self.loaded_at = now
            log.debug("configuration %s changed (%s)", self._path, fingerprint[:19])
            self._deliver(self._on_config, config)
            return True

    def check_if_due(self, now: float | None = None) -> bool:
        """check_if_due runs ``check_now`` if ``poll_s`` seconds passed since the last check.

        ``now`` is an instant on the watcher's clock (default: the clock's now). Returns
        what ``check_now`` returned, or False when no check was due.
        """
        if now is None:
            now = self._clock.now()
        if now < self._next_due:
            return False
        return self.check_now()

    def request_reload(self) -> None:
        """request_reload asks for a forced re-read (what SIGHUP does).

        With the watcher thread running it wakes that thread and returns at once; without
        it the check runs here, synchronously.
        """
        if self._thread is not None and self._thread.is_alive():
            self._forced = True
            self._wake.set()
        else:
            self.check_now(force=True)

    def install_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        """install_sighup makes SIGHUP force a reload; call it on ``loop``'s thread."""
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

    def remove_sighup(self, loop: asyncio.AbstractEventLoop) -> None:
        """remove_sighup undoes ``install_sighup``."""
        loop.remove_signal_handler(signal.SIGHUP)

    def start(self) -> None:
        """start runs the polling thread (a daemon: it never holds the process open)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-config-watcher",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """stop ends the polling thread, waiting at most ``timeout`` seconds for it."""
        self._stopping = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- inside ----------------------------------------------------------------

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading configuration %s", self._path)
        self.request_reload()

    def _run(self) -> None:
        while not self._stopping:
            try:
                if self._forced:
                    self._forced = False
                    self.check_now(force=True)
                else:
                    self.check_if_due()
            except Exception:  # a watcher that dies silently would freeze the config
                log.exception("configuration watcher: check of %s failed", self._path)
            # Wake when the next check is due (by the injected clock), or on SIGHUP/stop.
            delay = self._next_due - self._clock.now()
            self._wake.wait(min(max(delay, 0.01), self._poll_s))
            self._wake.clear()

    def _fingerprint(self) -> str:
        """_fingerprint names the file's current content.

        ``sha256:<hex>`` of its bytes, or ``unreadable:``/``too-large:`` with the reason,
        so that a missing or oversized file is also reported once, not on every poll.
        """
        try:
            size = self._path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                return f"too-large:{size}"
            data = self._path.read_bytes()
        except OSError as exc:
            return f"unreadable:{exc.strerror or exc}"
        if len(data) > MAX_CONFIG_BYTES:  # grew between stat and read
            return f"too-large:{len(data)}"
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def _load(self, fingerprint: str) -> Config:
        """_load validates the file whose content ``fingerprint`` names.

        ``load_config`` reads the file again, so the fingerprint is taken again afterwards:
        ``_Changed`` when they differ (the parsed bytes may not be the hashed ones).
        """
        if fingerprint.startswith("unreadable:"):
            raise ConfigError(str(self._path), f"cannot read: {fingerprint.split(':', 1)[1]}")
        if fingerprint.startswith("too-large:"):
            raise ConfigError(str(self._path), f"is {fingerprint.split(':', 1)[1]} bytes, "
                                               f"above the limit of {MAX_CONFIG_BYTES}")
        config = load_config(self._path)
        if self._fingerprint() != fingerprint:
            raise _Changed()
        return config

    def _deliver(self, callback: Callable[[_T], None], value: _T) -> None:
        if self._loop is None:
            _call(callback, value)
            return
        try:
            self._loop.call_soon_threadsafe(_call, callback, value)
        except RuntimeError:  # the loop is closed: the server is shutting down
            log.warning("configuration watcher: event loop closed, %s not delivered",
                        type(value).__name__)


class _Changed(Exception):
    """_Changed says the file was rewritten while it was being read."""


def _call(callback: Callable[[_T], None], value: _T) -> None:
    """_call runs a callback, logging its failure instead of killing the watcher."""
    try:
        callback(value)
    except Exception:
        log.exception("configuration watcher: callback %r failed", callback)
