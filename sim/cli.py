"""cli: ``kvgate sim`` / ``python -m sim``: parse the flags and serve one simulated vLLM node."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from sim.engine import OVERFLOW_MODES, EngineParams
from sim.server import OUTPUT_LENGTHS, SimServer, SimSettings


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return x


def build_parser() -> argparse.ArgumentParser:
    """build_parser returns the argument parser of ``kvgate sim``."""
    p = argparse.ArgumentParser(
        prog="kvgate sim",
        description="Simulated vLLM node: OpenAI-compatible API, KV block pool with continuous "
                    "batching and preemption, vLLM V1 /metrics, POST /sim/config for pressure.")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 8000), metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8000; port 0 picks a free one)")
    p.add_argument("--model", required=True, help="served model name (requests must name it)")
    p.add_argument("--max-model-len", type=_positive_int, required=True, metavar="N",
                   help="context window in tokens (prompt + max_tokens)")
    p.add_argument("--kv-capacity-tokens", type=_positive_int, required=True, metavar="N",
                   help="KV cache size in tokens (num_gpu_blocks = N // block size)")
    p.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                   help="tokens per KV block (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="cache full KV blocks by the hash of their token ids and reuse them for "
                        "later prompts with the same prefix, as vLLM V1 does (vLLM's default is on; "
                        "the simulator's is off)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256, metavar="N",
                   help="most requests running at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192, metavar="N",
                   help="token budget of one step: prefill is chunked to fit (default 8192)")
    p.add_argument("--prefill-tokens-per-s", type=_positive_float, default=20_000.0, metavar="N",
                   help="prefill speed in tokens per simulated second (default 20000)")
    p.add_argument("--decode-tokens-per-s", type=_positive_float, default=50.0, metavar="N",
                   help="decode speed of one sequence alone, tokens per simulated second (default 50)")
    p.add_argument("--batch-slowdown", type=float, default=0.01, metavar="X",
                   help="relative growth of a decode step per extra sequence in the batch (default 0.01)")
    p.add_argument("--speedup", type=_positive_float, default=1.0, metavar="X",
                   help="simulated seconds per real second (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of output lengths and ids (default 0)")
    p.add_argument("--overflow", choices=OVERFLOW_MODES, default="preempt",
                   help="when a running request needs a block and none is free: preempt the "
                        "newest request (vLLM) or crash, failing every running request")
    p.add_argument("--output-lengths", choices=OUTPUT_LENGTHS, default="max",
                   help="max: generate exactly max_tokens (reproducible); uniform: draw a length in "
                        "[1, max_tokens] per request from the seed; a request's header "
                        "x-sim-output-tokens: N overrides both (min(N, max_tokens) tokens, then stop)")
    p.add_argument("--default-max-tokens", type=_positive_int, default=256, metavar="N",
                   help="output length when a request sets no max_tokens (default 256)")
    p.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="tokens a stream buffers before writing; the first goes at once (default 1)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


async def _serve(server: SimServer, host: str, port: int) -> None:
    from aiohttp import web

    # handler_cancellation: a client that disconnects cancels its handler, whose
    # finally-block aborts the request and frees its blocks (vLLM does the same).
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    p = server.engine.params
    print(f"kvgate sim: serving {server.settings.model!r} on http://{host}:{bound} "
          f"({server.engine.pool.total} KV blocks of {p.block_size} tokens, "
          f"max_model_len {server.settings.max_model_len}, speedup {server.settings.speedup:g}, "
          f"prefix caching {'on' if p.enable_prefix_caching else 'off'})",
          flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """main runs the simulator until SIGINT/SIGTERM; returns the exit status (2: bad flags)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    params = EngineParams(
        kv_capacity_tokens=args.kv_capacity_tokens, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_tokens_per_s=args.prefill_tokens_per_s, decode_tokens_per_s=args.decode_tokens_per_s,
        batch_slowdown=args.batch_slowdown, overflow=args.overflow,
        enable_prefix_caching=args.enable_prefix_caching)
    settings = SimSettings(
        model=args.model, max_model_len=args.max_model_len, speedup=args.speedup, seed=args.seed,
        output_lengths=args.output_lengths, default_max_tokens=args.default_max_tokens,
        stream_interval=args.stream_interval)
    try:
        server = SimServer(settings, params)
    except ValueError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    host, port = args.listen
    try:
        import uvloop  # optional (the "fast" extra): a quicker event loop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(_serve(server, host, port))
        except OSError as exc:
            print(f"kvgate sim: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 1
    return 0
