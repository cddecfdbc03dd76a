"""bench_log_batches: what reading Envoy's access log batches costs kvgate, per entry.

kvgate reads each batch of the access log from its raw bytes entry by entry
(``extproc.logwire``, ``AccessLogReceiver.batch``) instead of parsing the whole
``StreamAccessLogsMessage`` first. This times both on the same batches, in-process: the
endpoint-picker-log file's periodic entries of ``--held`` parked requests (each entry with
what Envoy writes beside kvgate's metadata: addresses, times, the request's path and
headers, about 700 B), in batches of ``--batch`` entries, handled by the same ``Endings``;
"whole" is main's receiver (``Batch.FromString``, then every entry to ``Endings.logged``).
The two alternate, ``--repeats`` times; the report gives each one's median and spread, and
the Python and C heap memory each leaves behind.

    python bench/bench_log_batches.py [--held 3000] [--batch 430] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:  # run as a script from the repository root
        sys.path.insert(0, str(path))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from bench import reports  # noqa: E402
from bench.reports import machine, publish  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def envoy_like(msg: Any) -> None:
    """envoy_like adds to every entry of a batch what Envoy writes beside kvgate's metadata."""
    for i, e in enumerate(msg.http_logs.log_entry):
        c = e.common_properties
        for addr in (c.downstream_remote_address, c.downstream_local_address,
                     c.upstream_local_address, c.downstream_direct_remote_address):
            addr.socket_address.address, addr.socket_address.port_value = "127.0.0.1", 40000 + i
        c.start_time.seconds, c.start_time.nanos = 1_700_000_000, 123_456_789
        for d in (c.time_to_last_rx_byte, c.time_to_first_upstream_tx_byte,
                  c.time_to_last_upstream_tx_byte, c.time_to_first_upstream_rx_byte,
                  c.time_to_first_downstream_tx_byte, c.duration):
            d.nanos = 1_234_567
        c.upstream_cluster, c.route_name, c.stream_id = "nodes", "chat", f"{i:032x}"
        c.upstream_request_attempt_count = 1
        c.downstream_wire_bytes_received, c.upstream_wire_bytes_sent = 300, 400
        c.metadata.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint": "127.0.0.1:7000"})
        r = e.request
        r.request_method, r.scheme, r.authority = 1, "http", "gateway.local"
        r.path, r.user_agent, r.request_id = "/v1/chat/completions", "python-httpx/0.27", f"{i:036x}"
        r.request_headers_bytes, r.request_body_bytes = 200, 180
        e.response.response_headers_bytes = 120
        e.response.response_code_details = "via_upstream"
        e.protocol_version = 2


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--held", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=430, help="entries a batch (Envoy's average at 3,000 streams)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "log-batches.md")
    args = ap.parse_args(argv)

    from bench_memory import _service
    from envoy.service.accesslog.v3 import als_pb2

    from extproc.request.accesslog import AccessLogReceiver
    from kvgate_testkit.held import chat, hold, periodic_message

    service, metrics = _service("endpoint-picker-log")
    asyncio.run(hold(service, "endpoint-picker-log", chat(20), args.held))
    links = list(service.endings.parked)
    batches = []
    for start in range(0, len(links), args.batch):
        msg = periodic_message(links[start:start + args.batch], 5)
        envoy_like(msg)
        batches.append(msg.SerializeToString())
    entries = len(links)
    size = sum(map(len, batches))
    receiver = AccessLogReceiver(service.endings, metrics)
    logged, count = service.endings.logged, metrics.access_log_entry

    def whole() -> None:  # main's AccessLogReceiver.StreamAccessLogs, batch by batch
        for data in batches:
            for entry in als_pb2.StreamAccessLogsMessage.FromString(data).http_logs.log_entry:
                count(logged(entry))

    def by_entry() -> None:
        for data in batches:
            receiver.batch(data)

    ways: dict[str, Callable[[], None]] = {"whole": whole, "by entry": by_entry}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in ways.values():  # warm-up: the first token of each, caches
        run()
    for _ in range(args.repeats):
        for name, run in ways.items():
            gc.collect()
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) / entries * 1e6)
    lines = [
        "# Reading the access log's batches: whole or entry by entry", "",
        f"Command: `{reports.command('bench/bench_log_batches.py', ap, args)}`", "",
        f"Machine: {machine()}; "
        f"load average {os.getloadavg()[0]:.2f} at the end. {entries} periodic entries of parked "
        f"requests in {len(batches)} batches ({size / entries:.0f} B an entry), each repeat "
        "handling all of them.", "",
        "| reading | us / entry, median | min - max |",
        "|---|---:|---:|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} - {max(ts):.2f} |")
    ratio = statistics.median(times["by entry"]) / statistics.median(times["whole"])
    lines += ["", f"By entry over whole (medians): {ratio:.2f}x", ""]
    text = "\n".join(lines)
    return publish(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
