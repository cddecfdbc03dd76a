"""The scraper against real HTTP servers on 127.0.0.1: engine samples, faults, staleness.

Time that decides staleness is a ManualClock moved by the test; the only real waits are
socket timeouts (0.2 s) against servers that answer too slowly on purpose. A fault that is
not about time gets a generous scrape timeout, so that a busy machine cannot turn it into one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from extproc.admission import Admission
from extproc.admission.types import PoolSignals
from extproc.clock import ManualClock, MonotonicClock
from extproc.config import Config
from extproc.configparse import parse_config
from extproc.signals import ScrapeError, Scraper
from kvgate_testkit import EXPOSITIONS
from kvgate_testkit.procs import LOOPBACK, free_port, wait_until

SAMPLES = EXPOSITIONS
TIMEOUT_S = 0.2  # for the faults about time
GENEROUS_TIMEOUT_S = 3.0  # for the rest; the most make_config allows with stale_after_s 3 s


def sample(name: str) -> bytes:
    return (SAMPLES / name).read_bytes()


def vllm_body(usage: float | str, waiting: int = 0) -> bytes:
    """vllm_body is the vLLM V1 sample with its usage and queue replaced."""
    out = []
    for line in sample("vllm_v1.prom").decode().splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            line = f"{line.rsplit(' ', 1)[0]} {usage}"
        elif line.startswith("vllm:num_requests_waiting{"):
            line = f"{line.rsplit(' ', 1)[0]} {waiting}"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


class Behavior:
    """Behavior is what a fake metrics server does with the next request (settable live)."""

    def __init__(self, body: bytes = b"", status: int = 200, ctype: str = "text/plain; version=0.0.4",
                 mode: str = "serve") -> None:
        self.body, self.status, self.ctype, self.mode = body, status, ctype, mode


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        b = self.server.behavior
        self.server.hits += 1
        if b.mode == "slow":  # answers, but only after the scraper's timeout
            self.server.release.wait(5.0)
        if b.mode == "short":  # promises more than it sends, then hangs up
            self.send_response(200)
            self.send_header("Content-Type", b.ctype)
            self.send_header("Content-Length", str(len(b.body) + 1000))
            self.end_headers()
            self.wfile.write(b.body)
            return
        if b.mode == "drip":  # a byte at a time, never finishing within the timeout
            self.send_response(200)
            self.send_header("Content-Type", b.ctype)
            self.end_headers()
            for byte in b.body:
                if self.server.release.wait(0.05):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            return
        self.send_response(b.status)
        self.send_header("Content-Type", b.ctype)
        if b.mode != "no_length":
            self.send_header("Content-Length", str(len(b.body)))
        self.end_headers()
        try:
            self.wfile.write(b.body)
        except OSError:
            pass  # the scraper hung up on a body too large: expected

    def log_message(self, *args: object) -> None:
        pass


class MetricsServer(ThreadingHTTPServer):
    """MetricsServer serves one Behavior on 127.0.0.1; stop() closes the port (a dead node)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, behavior: Behavior, port: int = 0) -> None:
        super().__init__((LOOPBACK, port), _Handler)
        self.behavior = behavior
        self.hits = 0
        self.release = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/metrics"

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()
        self._thread.join(5)


class Recorder:
    """Recorder is a ScrapeObserver that keeps every call, for assertions."""

    def __init__(self) -> None:
        self.done: list[tuple[str, str, bool]] = []
        self.errors: list[tuple[str, str, str]] = []
        self.states: list[tuple[str, str, bool, float | None, int | None]] = []
        self.stale: list[tuple[str, bool]] = []

    def scrape_done(self, pool: str, backend: str, seconds: float, ok: bool) -> None:
        assert seconds >= 0.0
        self.done.append((pool, backend, ok))

    def scrape_error(self, pool: str, backend: str, reason: str) -> None:
        self.errors.append((pool, backend, reason))

    def backend_state(self, pool: str, backend: str, up: bool, kv_usage: float | None,
                      waiting: int | None) -> None:
        self.states.append((pool, backend, up, kv_usage, waiting))

    def pool_stale(self, pool: str, stale: bool) -> None:
        self.stale.append((pool, stale))

    def clear(self) -> None:
        self.done.clear(), self.errors.clear(), self.states.clear(), self.stale.clear()


class Published:
    """Published records what the scraper hands to the admission core."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, PoolSignals]] = []
        self.event = threading.Event()

    def __call__(self, pool: str, signals: PoolSignals) -> None:
        self.calls.append((pool, signals))
        self.event.set()

    def last(self, pool: str) -> PoolSignals:
        return [s for p, s in self.calls if p == pool][-1]


def make_config(pools: dict[str, list[dict]], *, aggregate: str = "max", poll: float = 1.0,
                timeout: float = 1.0, stale: float = 3.0) -> Config:
    """make_config: the scrape timeout is as long as the poll interval unless a test about
    time asks for a short one, so that a busy machine cannot turn another fault into one."""
    return parse_config({
        "pools": {name: {"backends": backends, "signals": {"aggregate": aggregate}}
                  for name, backends in pools.items()},
        "adaptive": {"poll_interval_s": poll, "scrape_timeout_s": timeout, "stale_after_s": stale},
    })


@pytest.fixture
def servers() -> Iterator[list[MetricsServer]]:
    started: list[MetricsServer] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def new_scraper() -> Iterator[Callable[..., Scraper]]:
    """new_scraper makes Scrapers and stops them all after the test (no pool outlives it)."""
    made: list[Scraper] = []

    def make(*args: Any, **kwargs: Any) -> Scraper:
        s = Scraper(*args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def serve(servers: list[MetricsServer], behavior: Behavior, port: int = 0) -> MetricsServer:
    s = MetricsServer(behavior, port)
    servers.append(s)
    return s


def test_each_engine_served_over_http_reaches_its_pool(new_scraper, servers):
    vllm = serve(servers, Behavior(sample("vllm_v1_dp.prom")))
    sgl = serve(servers, Behavior(sample("sglang_dp.prom")))
    tgi = serve(servers, Behavior(sample("tgi.prom")))
    gpu = serve(servers, Behavior(sample("dcgm_Hostname.prom")))
    cfg = make_config({
        "llama": [{"name": "node-a", "metrics_url": vllm.url, "engine": "vllm"},
                  {"name": "node-a-gpu", "metrics_url": gpu.url, "engine": "dcgm"}],
        "qwen": [{"name": "sgl-0", "metrics_url": sgl.url, "engine": "sglang"},
                 {"name": "tgi-0", "metrics_url": tgi.url, "engine": "tgi"}],
        "plain": [],
    })
    rec, pub, clock = Recorder(), Published(), ManualClock(100.0)
    out = new_scraper(cfg, pub, rec, clock).poll_once()

    assert sorted(out) == ["llama", "qwen"]  # a pool without backends is never published
    assert sorted(p for p, _ in pub.calls) == ["llama", "qwen"]
    llama, qwen = out["llama"], out["qwen"]
    assert llama == pub.last("llama") and llama.at == 100.0 and not llama.stale
    assert llama.kv_usage == pytest.approx(73339 / (73339 + 8149))  # max: the GPU is fuller
    assert (llama.waiting, llama.kv_capacity_tokens) == (7, 2 * 444832)
    assert qwen.kv_usage == pytest.approx(0.70)  # max(SGLang 0.70, TGI 0.375)
    assert (qwen.waiting, qwen.kv_capacity_tokens) == (10 + 3, 2 * 161721 + 163840)
    assert sorted(rec.done) == sorted([("llama", "node-a", True), ("llama", "node-a-gpu", True),
                                       ("qwen", "sgl-0", True), ("qwen", "tgi-0", True)])
    assert rec.errors == []
    assert ("llama", "node-a", True, pytest.approx(0.6), 7) in rec.states
    assert sorted(rec.stale) == [("llama", False), ("qwen", False)]


def test_bodies_are_read_one_at_a_time_while_fetched_together(new_scraper, servers, monkeypatch):
    """Reading holds the GIL: concurrent reads would keep the event loop waiting behind
    every worker. Each read here lingers 0.05 s, so overlapping
    reads, if allowed, would be seen."""
    import extproc.signals.scraper as scraper_mod

    real_read, inside, most = scraper_mod.read, [0], [0]
    guard = threading.Lock()
    never = threading.Event()

    def read(engine, body, model):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        never.wait(0.05)
        with guard:
            inside[0] -= 1
        return real_read(engine, body, model)

    monkeypatch.setattr(scraper_mod, "read", read)
    nodes = [serve(servers, Behavior(sample("vllm_v1.prom"))) for _ in range(4)]
    cfg = make_config({"p": [{"name": f"n{i}", "metrics_url": n.url, "engine": "vllm"}
                             for i, n in enumerate(nodes)]}, poll=2.0, timeout=1.5)
    rec = Recorder()
    out = new_scraper(cfg, Published(), rec, ManualClock(100.0)).poll_once()
    assert len(rec.done) == 4 and all(ok for _, _, ok in rec.done)
    assert not out["p"].stale
    assert most[0] == 1


def test_mean_aggregate_is_selectable(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.2)))
    b = serve(servers, Behavior(vllm_body(0.6)))
    cfg = make_config({"p": [{"name": "a", "metrics_url": a.url}, {"name": "b", "metrics_url": b.url}]},
                      aggregate="mean")
    out = new_scraper(cfg, Published(), Recorder(), ManualClock()).poll_once()
    assert out["p"].kv_usage == pytest.approx(0.4)


BIG = b"# HELP filler x\n" + b"filler_metric 1\n" * (5 * 1024 * 1024 // 16)

# (behavior, reason counted, usable): every fault of the issue
FAULTS = {
    "html_page": (Behavior(b"<html><body><h1>Service Unavailable</h1></body></html>\n", ctype="text/html"),
                  ScrapeError.PARSE),
    "html_as_text": (Behavior(b"<!DOCTYPE html>\n<html><body>oops</body></html>\n"), ScrapeError.PARSE),
    "garbage": (Behavior(b"Hello from the load balancer, all good here\n"), ScrapeError.PARSE),
    "truncated": (Behavior(vllm_body(0.05)[:-40]), ScrapeError.PARSE),
    "short_body": (Behavior(vllm_body(0.05), mode="short"), ScrapeError.PARSE),
    "http_500": (Behavior(b"internal error\n", status=500), ScrapeError.HTTP_STATUS),
    "http_404": (Behavior(b"not found\n", status=404), ScrapeError.HTTP_STATUS),
    "slow": (Behavior(vllm_body(0.05), mode="slow"), ScrapeError.TIMEOUT),
    "drip": (Behavior(vllm_body(0.05), mode="drip"), ScrapeError.TIMEOUT),
    "too_large": (Behavior(BIG), ScrapeError.TOO_LARGE),
    "too_large_no_length": (Behavior(BIG, mode="no_length"), ScrapeError.TOO_LARGE),
    "nan": (Behavior(vllm_body("NaN")), ScrapeError.BAD_VALUE),
    "negative": (Behavior(vllm_body(-0.4)), ScrapeError.BAD_VALUE),
    "missing_names": (Behavior(sample("tgi.prom")), ScrapeError.MISSING_METRICS),
    "empty": (Behavior(b""), ScrapeError.MISSING_METRICS),
}


def _fault_setup(servers: list[MetricsServer], fault: str) -> tuple[str, MetricsServer | None]:
    if fault == "refused":
        return f"http://{LOOPBACK}:{free_port()}/metrics", None
    behavior, _ = FAULTS[fault]
    s = serve(servers, Behavior(vllm_body(0.05)))
    s.behavior = behavior
    return s.url, s


@pytest.mark.parametrize("fault", sorted(FAULTS) + ["refused"])
def test_a_fault_is_counted_by_reason_and_never_read_as_idle(new_scraper, servers, fault):
    reason = ScrapeError.CONNECT if fault == "refused" else FAULTS[fault][1]
    url, _ = _fault_setup(servers, fault)
    good = serve(servers, Behavior(vllm_body(0.05)))
    # A 5 MB body or an HTML page must read as what it is even when a loaded machine takes
    # longer than 0.2 s to move it; only the faults about time keep the short timeout.
    timeout = TIMEOUT_S if reason is ScrapeError.TIMEOUT else GENEROUS_TIMEOUT_S
    cfg = make_config({"p": [{"name": "bad", "metrics_url": url}, {"name": "good", "metrics_url": good.url}]},
                      timeout=timeout, poll=max(1.0, timeout))
    rec, pub, clock = Recorder(), Published(), ManualClock()
    scraper = new_scraper(cfg, pub, rec, clock, log_every_s=3600.0)

    t0 = time.monotonic()
    scraper.poll_once()
    if reason is ScrapeError.TIMEOUT:
        # the faulty node costs the round at most its timeout (the slow server would hold 5 s)
        assert time.monotonic() - t0 < 2.0
    assert [e for e in rec.errors if e[1] == "bad"] == [("p", "bad", reason.value)]
    assert ("p", "bad", False) in rec.done and ("p", "good", True) in rec.done
    assert ("p", "bad", False, None, None) in rec.states
    # never sampled: not counted yet, and once stale_after_s passes it counts as saturated
    assert pub.last("p").kv_usage == pytest.approx(0.05)
    for _ in range(3):
        clock.advance(1.0)
        scraper.poll_once()
    assert pub.last("p").kv_usage == 1.0
    assert len([e for e in rec.errors if e[1] == "bad"]) == 4  # counted every round


def test_usage_above_one_is_clamped_and_counted(new_scraper, servers):
    s = serve(servers, Behavior(vllm_body(1.3)))
    rec = Recorder()
    out = new_scraper(make_config({"p": [{"name": "n", "metrics_url": s.url}]}), Published(), rec,
                  ManualClock()).poll_once()
    assert out["p"].kv_usage == 1.0 and not out["p"].stale
    assert rec.errors == [("p", "n", "bad_value")]
    assert rec.done == [("p", "n", True)]


def test_a_failed_scrape_keeps_the_last_sample_until_stale(new_scraper, servers):
    s = serve(servers, Behavior(vllm_body(0.3, waiting=2)))
    rec, pub, clock = Recorder(), Published(), ManualClock()
    scraper = new_scraper(make_config({"p": [{"name": "n", "metrics_url": s.url}]}), pub, rec, clock)
    scraper.poll_once()
    s.behavior = Behavior(vllm_body("NaN"))
    for t in (1.0, 2.0):
        clock.set(t)
        scraper.poll_once()
        assert pub.last("p").kv_usage == pytest.approx(0.3) and not pub.last("p").stale
    clock.set(3.0)
    scraper.poll_once()
    last = pub.last("p")
    assert last.stale and last.kv_usage is None and last.at == 3.0
    assert rec.stale[-1] == ("p", True) and rec.stale[0] == ("p", False)


def test_a_dead_node_saturates_its_pool_within_stale_after_and_returns(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    b = serve(servers, Behavior(vllm_body(0.4)))
    cfg = make_config({"p": [{"name": "a", "metrics_url": a.url}, {"name": "b", "metrics_url": b.url}]})
    rec, pub, clock = Recorder(), Published(), ManualClock()
    scraper = new_scraper(cfg, pub, rec, clock)
    scraper.poll_once()
    assert pub.last("p").kv_usage == pytest.approx(0.4)

    port = b.port
    b.stop()  # the node dies: its port refuses connections
    seen = []
    for t in (1.0, 2.0, 3.0):
        clock.set(t)
        scraper.poll_once()
        seen.append(pub.last("p").kv_usage)
    assert seen == [pytest.approx(0.4), pytest.approx(0.4), 1.0]
    assert ("p", "b", "connect") in rec.errors

    serve(servers, Behavior(vllm_body(0.2)), port=port)  # it comes back on the same port
    clock.set(4.0)
    scraper.poll_once()
    assert pub.last("p").kv_usage == pytest.approx(0.3) and not pub.last("p").stale


def test_every_node_dead_makes_the_pool_stale(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    rec, pub, clock = Recorder(), Published(), ManualClock()
    scraper = new_scraper(make_config({"p": [{"name": "a", "metrics_url": a.url}]}), pub, rec, clock)
    scraper.poll_once()
    a.stop()
    clock.set(3.0)
    scraper.poll_once()
    assert pub.last("p").stale and pub.last("p").kv_usage is None
    assert rec.stale == [("p", False), ("p", True)]


def test_reconfigure_keeps_known_nodes_and_drops_removed_pools(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    b = serve(servers, Behavior(vllm_body(0.5)))
    clock, pub = ManualClock(), Published()
    first = make_config({"p": [{"name": "a", "metrics_url": a.url}],
                         "q": [{"name": "b", "metrics_url": b.url}]})
    scraper = new_scraper(first, pub, Recorder(), clock)
    scraper.poll_once()
    a.stop()  # node a will not answer again; its sample must survive the reload
    second = make_config({"p": [{"name": "a", "metrics_url": a.url}, {"name": "b2", "metrics_url": b.url}]})
    scraper.reconfigure(second)
    pub.calls.clear()
    clock.set(1.0)
    scraper.poll_once()
    assert [p for p, _ in pub.calls] == ["p"]
    assert pub.last("p").kv_usage == pytest.approx(0.5)  # a's 0.3 kept, b2 new: max 0.5


def test_a_failing_observer_or_publisher_does_not_stop_the_round(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))

    class Broken(Recorder):
        def backend_state(self, *args: object) -> None:
            raise RuntimeError("observer bug")

    calls = []

    def publish(pool: str, signals: PoolSignals) -> None:
        calls.append(pool)
        raise RuntimeError("publisher bug")

    cfg = make_config({"p": [{"name": "a", "metrics_url": a.url}], "q": [{"name": "b", "metrics_url": a.url}]})
    rec = Broken()
    out = new_scraper(cfg, publish, rec, ManualClock()).poll_once()
    assert calls == ["p", "q"] and out["p"].kv_usage == pytest.approx(0.3)
    assert len(rec.done) == 2


def test_the_thread_polls_until_stopped(new_scraper, servers):
    a = serve(servers, Behavior(vllm_body(0.3)))
    pub = Published()
    scraper = new_scraper(make_config({"p": [{"name": "a", "metrics_url": a.url}]}, poll=0.05, timeout=0.05,
                                  stale=1.0), pub, Recorder(), MonotonicClock())
    scraper.start()
    try:
        wait_until(lambda: a.hits >= 3, timeout=10.0, what="three scrapes by the thread")
        assert scraper.running
    finally:
        scraper.stop()
    assert not scraper.running
    assert pub.last("p").kv_usage == pytest.approx(0.3)


def test_the_admission_scale_follows_a_node_death_and_its_return(new_scraper, servers):
    """min_scale within stale_after_s + one poll of a node's death; smooth recovery after."""
    a = serve(servers, Behavior(vllm_body(0.3)))
    b = serve(servers, Behavior(vllm_body(0.4)))
    cfg = make_config({"p": [{"name": "a", "metrics_url": a.url}, {"name": "b", "metrics_url": b.url}]})
    ad = cfg.adaptive
    clock = ManualClock()
    adm = Admission(cfg, clock)
    scraper = new_scraper(cfg, adm.update_signals, Recorder(), clock)
    base = cfg.pools["p"].max_concurrency
    assert adm.snapshot("p").scale == ad.min_scale  # no signals yet: fail safe

    def poll_for(seconds: float) -> list[float]:
        scales = []
        for _ in range(int(round(seconds / ad.poll_interval_s))):
            clock.advance(ad.poll_interval_s)
            scraper.poll_once()
            scales.append(adm.snapshot("p").scale)
        return scales

    scraper.poll_once()
    assert poll_for(10.0)[-1] == 1.0
    assert adm.snapshot("p").concurrency_limit == base
    node_tokens = 444832  # kv_cache_size_tokens of the vLLM sample
    fraction = cfg.pools["p"].signals.kv_budget_fraction
    assert adm.snapshot("p").kv_budget == math.floor(2 * node_tokens * fraction)  # derived, not configured

    port = b.port
    b.stop()
    died = clock.now()
    scales = poll_for(ad.stale_after_s + ad.poll_interval_s)
    assert scales[-1] == pytest.approx(ad.min_scale)
    assert scales[0] == 1.0  # one lost scrape is not an outage
    first_min = next(i for i, s in enumerate(scales) if s == pytest.approx(ad.min_scale))
    assert (first_min + 1) * ad.poll_interval_s <= ad.stale_after_s + ad.poll_interval_s
    assert clock.now() - died <= ad.stale_after_s + ad.poll_interval_s
    assert adm.snapshot("p").concurrency_limit < base
    # the dead node's KV cache no longer counts, and what is left is scaled down
    assert adm.snapshot("p").kv_budget == math.floor(math.floor(node_tokens * fraction) * ad.min_scale)

    serve(servers, Behavior(vllm_body(0.4)), port=port)
    scales = poll_for(10.0)
    steps = [later - earlier for earlier, later in zip([ad.min_scale] + scales, scales)]
    assert all(0.0 <= d <= ad.recovery_per_s * ad.poll_interval_s + 1e-9 for d in steps)  # smooth
    assert scales[0] < 1.0 and scales[-1] == 1.0
    assert adm.snapshot("p").concurrency_limit == base


def test_stale_pool_and_broken_node_say_so_in_logs_without_flooding(new_scraper, servers, caplog):
    a = serve(servers, Behavior(vllm_body(0.3)))
    bad = serve(servers, Behavior(b"garbage page\n"))
    clock = ManualClock()
    cfg = make_config({"p": [{"name": "a", "metrics_url": a.url}],
                       "q": [{"name": "bad", "metrics_url": bad.url}]})
    scraper = new_scraper(cfg, Published(), Recorder(), clock, log_every_s=10.0)
    caplog.set_level("INFO", logger="extproc.signals")
    for _ in range(25):  # 25 s of a broken node, polled every second
        scraper.poll_once()
        clock.advance(1.0)
    about_bad = [r for r in caplog.records if "q/bad" in r.getMessage()]
    assert len(about_bad) == 3  # t=0, 10, 20: one line per log_every_s
    assert "9 similar lines held back" in about_bad[1].getMessage()
    stale = [r for r in caplog.records if "pool q" in r.getMessage()]
    assert len(stale) == 1 and stale[0].levelname == "WARNING" and "min_scale" in stale[0].getMessage()
    assert not [r for r in caplog.records if "pool p" in r.getMessage()]


class NodeReports:
    """NodeReports is a node sink (``scraper.NodeSink``) that keeps what it is handed."""

    def __init__(self) -> None:
        self.marks: list[int] = []
        self.reports: list[tuple[str, str, Any]] = []

    def mark(self, mark: int, only: Any = None) -> bool:
        self.marks.append(mark)
        return True

    def report(self, pool: str, backend: str, report: Any) -> None:
        self.reports.append((pool, backend, report))


def test_a_picking_pool_hears_each_nodes_usage_queue_and_batch(new_scraper, servers):
    node = serve(servers, Behavior(vllm_body(0.5, waiting=3)))
    cfg = make_config({"llama": [{"name": "n0", "metrics_url": node.url, "engine": "vllm",
                                  "address": "127.0.0.1:9"}]})
    sink, clock = NodeReports(), ManualClock(100.0)
    new_scraper(cfg, Published(), Recorder(), clock, nodes=sink).poll_once()
    assert len(sink.marks) == 1                            # a round starts with a mark
    ((pool, backend, report),) = sink.reports
    assert (pool, backend) == ("llama", "n0")
    # the sample's batch (vllm:num_requests_running 7): what tells a foreign rise from
    # kvgate's own request entering the cache (admission/nodes.py)
    assert (report.kv_usage, report.waiting, report.running, report.mark) == (0.5, 3, 7, sink.marks[0])
