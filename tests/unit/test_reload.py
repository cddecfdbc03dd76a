"""Tests of extproc.reload: content-hash change detection, refusal of bad files, delivery."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest

import extproc.reload as reload_mod
from extproc.clock import ManualClock, MonotonicClock
from extproc.config import Config
from extproc.errors import ConfigError
from extproc.reload import MAX_CONFIG_BYTES, ConfigWatcher
from kvgate_testkit.procs import wait_until


def config_text(concurrency: int, tpm: int | None = None) -> str:
    lines = ["pools:", "  default:", f"    max_concurrency: {concurrency}"]
    if tpm is not None:
        lines.append(f"    tpm: {tpm}")
    return "\n".join(lines) + "\n"


class Recorder:
    """Recorder keeps what a watcher delivered, and on which thread."""

    def __init__(self) -> None:
        self.configs: list[Config] = []
        self.errors: list[Exception] = []
        self.threads: list[int] = []

    def on_config(self, config: Config) -> None:
        self.threads.append(threading.get_ident())
        self.configs.append(config)

    def on_error(self, exc: Exception) -> None:
        self.threads.append(threading.get_ident())
        self.errors.append(exc)

    def concurrencies(self) -> list[int]:
        return [c.pool(None).max_concurrency for c in self.configs]


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(config_text(8))
    return path


def make(path: Path, rec: Recorder, clock=None, poll_s: float = 1.0, **kw) -> ConfigWatcher:
    # Delivery at the first check unless a test is about settling.
    kw.setdefault("settle_s", 0.0)
    return ConfigWatcher(path, rec.on_config, rec.on_error, clock or ManualClock(100.0),
                         poll_s, **kw)


def test_a_file_caught_mid_write_is_not_read_until_it_stays_the_same(cfg_file: Path) -> None:
    clock = ManualClock(100.0)
    rec = Recorder()
    w = make(cfg_file, rec, clock=clock, settle_s=0.5)
    w.load_initial()
    full = config_text(9, tpm=1000) + "tenants:\n  default_class: standard\n"
    # A writer in the middle of rewriting the file in place: what is there so far is a
    # valid configuration without the tenants section.
    cut = full[: full.index("tenants:")]
    cfg_file.write_text(cut)
    assert w.check_now() is False
    clock.advance(0.3)
    cfg_file.write_text(full)             # the write completes before it settled
    assert w.check_now() is False
    clock.advance(0.3)
    assert w.check_now() is False         # seen 0.3 s ago: not settled yet
    clock.advance(0.2)
    assert w.check_now() is True          # unchanged for 0.5 s: read
    assert rec.concurrencies() == [9] and rec.configs[0].tenants.default_class == "standard"
    assert rec.errors == []


def test_sighup_reads_at_once(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec, settle_s=0.5)
    w.load_initial()
    cfg_file.write_text(config_text(4))
    assert w.check_now(force=True) is True and rec.concurrencies() == [4]


def test_initial_load_then_unchanged_content_delivers_nothing(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    assert w.load_initial().pool(None).max_concurrency == 8
    assert w.check_now() is False
    # Rewriting identical bytes (a new mtime) is no change.
    cfg_file.write_text(config_text(8))
    assert w.check_now() is False
    assert rec.configs == [] and rec.errors == []


def test_changed_content_is_delivered_once(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    cfg_file.write_text(config_text(16, tpm=60000))
    assert w.check_now() is True
    assert rec.concurrencies() == [16]
    assert rec.configs[0].pool(None).tpm == 60000
    assert w.check_now() is False
    assert rec.concurrencies() == [16]


def test_without_initial_load_the_first_check_delivers_the_file(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    assert w.check_now() is True
    assert rec.concurrencies() == [8]


@pytest.mark.parametrize("bad, key", [
    ("pools:\n  default:\n    max_concurency: 4\n", "pools.default.max_concurency"),
    ("pools:\n  default:\n    max_concurrency: -1\n", "pools.default.max_concurrency"),
    ("pools: [unclosed\n", None),
    ("pools: {}\n", "pools"),
])
def test_invalid_file_is_refused_once_and_old_config_stays(cfg_file: Path, bad: str,
                                                           key: str | None) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    applied_at = w.loaded_at
    cfg_file.write_text(bad)
    assert w.check_now() is False
    assert len(rec.errors) == 1 and isinstance(rec.errors[0], ConfigError)
    if key is not None:
        assert rec.errors[0].key == key
    else:
        assert "YAML" in rec.errors[0].reason
    assert rec.configs == []
    assert w.loaded_at == applied_at and w.refused_at is not None
    # The same broken content on the next polls: no repeated error.
    assert w.check_now() is False and w.check_now() is False
    assert len(rec.errors) == 1
    # Fixed: delivered.
    cfg_file.write_text(config_text(4))
    assert w.check_now() is True
    assert rec.concurrencies() == [4]


def test_returning_to_the_config_in_force_after_a_bad_file_delivers_nothing(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    cfg_file.write_text("pools: 3\n")
    w.check_now()
    cfg_file.write_text(config_text(8))  # the content already in force
    assert w.check_now() is False
    assert rec.configs == [] and len(rec.errors) == 1
    # And a later bad file (the same one as before) is reported again: it is news again.
    cfg_file.write_text("pools: 3\n")
    assert w.check_now() is False
    assert len(rec.errors) == 2


def test_force_redelivers_unchanged_content(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    assert w.check_now(force=True) is True
    assert rec.concurrencies() == [8]


def test_missing_file_is_reported_once_then_recovered(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    cfg_file.unlink()
    assert w.check_now() is False and w.check_now() is False
    assert len(rec.errors) == 1 and "cannot read" in rec.errors[0].reason
    cfg_file.write_text(config_text(8))  # back as it was: the config in force
    assert w.check_now() is False
    cfg_file.write_text(config_text(2))
    assert w.check_now() is True
    assert rec.concurrencies() == [2]


def test_oversized_file_is_refused(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    cfg_file.write_text(config_text(9) + "#" * MAX_CONFIG_BYTES)
    assert w.check_now() is False
    assert len(rec.errors) == 1 and "limit" in rec.errors[0].reason
    assert rec.configs == []


def test_initial_load_of_an_invalid_file_raises(cfg_file: Path) -> None:
    cfg_file.write_text("pools:\n  default:\n    tpm: many\n")
    with pytest.raises(ConfigError) as err:
        make(cfg_file, Recorder()).load_initial()
    assert err.value.key == "pools.default.tpm"


def _configmap_dir(root: Path, stamp: str, text: str) -> None:
    """_configmap_dir lays out a version of a mounted ConfigMap as the kubelet does."""
    version = root / f"..{stamp}"
    version.mkdir()
    (version / "kvgate.yaml").write_text(text)
    tmp_link = root / "..data_tmp"
    tmp_link.symlink_to(version.name)
    os.replace(tmp_link, root / "..data")  # the atomic swap
    if not (root / "kvgate.yaml").is_symlink():
        (root / "kvgate.yaml").symlink_to("..data/kvgate.yaml")


def test_configmap_symlink_swap_is_seen_even_with_an_older_mtime(tmp_path: Path) -> None:
    _configmap_dir(tmp_path, "2024_01_01_00_00_00.1", config_text(8))
    path = tmp_path / "kvgate.yaml"
    rec = Recorder()
    w = make(path, rec)
    w.load_initial()
    old_mtime = path.stat().st_mtime
    _configmap_dir(tmp_path, "2024_01_01_00_05_00.2", config_text(24))
    os.utime(tmp_path / "..2024_01_01_00_05_00.2" / "kvgate.yaml", (old_mtime - 60, old_mtime - 60))
    assert path.stat().st_mtime < old_mtime
    assert w.check_now() is True
    assert rec.concurrencies() == [24]


def test_file_rewritten_while_read_is_left_for_the_next_check(cfg_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    w = make(cfg_file, rec)
    w.load_initial()
    real_load = reload_mod.load_config
    rewrites = [config_text(12)]

    def load_then_rewrite(path):
        config = real_load(path)
        if rewrites:
            cfg_file.write_text(rewrites.pop())
        return config

    monkeypatch.setattr(reload_mod, "load_config", load_then_rewrite)
    cfg_file.write_text(config_text(11))
    assert w.check_now() is False
    assert rec.configs == [] and rec.errors == []
    assert w.check_now() is True
    assert rec.concurrencies() == [12]


def test_check_if_due_follows_the_injected_clock(cfg_file: Path) -> None:
    clock = ManualClock(100.0)
    rec = Recorder()
    w = make(cfg_file, rec, clock=clock, poll_s=2.0)
    w.load_initial()
    assert w.check_now() is False  # checked at t=100: next due at 102
    cfg_file.write_text(config_text(5))
    clock.advance(1.9)
    assert w.check_if_due() is False
    assert rec.configs == []
    clock.advance(0.1)
    assert w.check_if_due() is True
    assert rec.concurrencies() == [5]
    # Explicit instants work the same way.
    cfg_file.write_text(config_text(6))
    assert w.check_if_due(103.0) is False
    assert w.check_if_due(104.0) is True
    assert rec.concurrencies() == [5, 6]


def test_a_failing_callback_does_not_stop_later_deliveries(cfg_file: Path) -> None:
    seen: list[int] = []

    def on_config(config: Config) -> None:
        seen.append(config.pool(None).max_concurrency)
        if len(seen) == 1:
            raise RuntimeError("server could not apply it")

    w = ConfigWatcher(cfg_file, on_config, lambda exc: None, ManualClock(), settle_s=0.0)
    w.load_initial()
    cfg_file.write_text(config_text(3))
    assert w.check_now() is True
    cfg_file.write_text(config_text(4))
    assert w.check_now() is True
    assert seen == [3, 4]


def test_poll_period_must_be_positive(cfg_file: Path) -> None:
    with pytest.raises(ValueError):
        make(cfg_file, Recorder(), poll_s=0)


async def test_callbacks_run_on_the_loop_thread(cfg_file: Path) -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder()
    w = make(cfg_file, rec, loop=loop)
    w.load_initial()
    cfg_file.write_text(config_text(7))
    delivered = await loop.run_in_executor(None, w.check_now)
    assert delivered is True
    await asyncio.sleep(0)  # let the loop run what the executor thread scheduled on it
    assert rec.concurrencies() == [7]
    assert rec.threads == [threading.get_ident()]


async def test_sighup_forces_a_reload(cfg_file: Path) -> None:
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    rec = Recorder()

    def on_config(config: Config) -> None:
        rec.on_config(config)
        got.set()

    w = ConfigWatcher(cfg_file, on_config, rec.on_error, MonotonicClock(), loop=loop)
    w.load_initial()
    w.install_sighup(loop)
    try:
        cfg_file.write_text(config_text(13))
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(got.wait(), timeout=10)
    finally:
        w.remove_sighup(loop)
    assert rec.concurrencies() == [13]


def test_polling_thread_picks_up_a_change_and_stops(cfg_file: Path) -> None:
    rec = Recorder()
    w = make(cfg_file, rec, clock=MonotonicClock(), poll_s=0.05)
    w.load_initial()
    w.start()
    try:
        cfg_file.write_text(config_text(21))
        wait_until(lambda: rec.concurrencies() == [21], timeout=10, what="reload by polling")
        cfg_file.write_text("pools: nope\n")
        wait_until(lambda: len(rec.errors) == 1, timeout=10, what="refusal by polling")
    finally:
        w.stop()
    assert rec.concurrencies() == [21]
    assert all(t != threading.get_ident() for t in rec.threads)


def test_request_reload_wakes_the_polling_thread(cfg_file: Path) -> None:
    rec = Recorder()
    # A long period: only the request can explain a prompt delivery.
    w = make(cfg_file, rec, clock=MonotonicClock(), poll_s=60.0)
    w.load_initial()
    w.start()
    try:
        w.request_reload()  # unchanged content, forced: re-delivered
        wait_until(lambda: rec.concurrencies() == [8], timeout=10, what="forced reload")
    finally:
        w.stop()
