"""cli: the ``kvgate`` command (also ``python -m extproc``).

    kvgate serve --config FILE [--grpc-listen HOST:PORT] [--admin-listen HOST:PORT] [--log-level LEVEL]
    kvgate check-config FILE
    kvgate sim ARGS...            (the vLLM-compatible simulator; see ``kvgate sim --help``)

Exit codes: 0 success, 2 bad configuration or usage, 1 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from extproc.config import Config, load_config
from extproc.errors import ConfigError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def _hostport(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {value!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvgate", description="LLM admission control for Envoy (ext_proc)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the ext_proc service")
    serve.add_argument("--config", required=True, metavar="FILE", help="kvgate YAML configuration")
    serve.add_argument("--grpc-listen", type=_hostport, metavar="HOST:PORT",
                       help="ext_proc gRPC address (default: server.grpc_listen, 127.0.0.1:50051)")
    serve.add_argument("--admin-listen", type=_hostport, metavar="HOST:PORT",
                       help="admin HTTP address for /metrics /healthz /readyz "
                            "(default: server.admin_listen, 0.0.0.0:9464)")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"), help="default: info")
    check = sub.add_parser("check-config", help="validate a configuration file and its tokenizers")
    check.add_argument("file", metavar="FILE")
    sub.add_parser("sim", help="run the vLLM-compatible simulator (arguments go to it)",
                   add_help=False)
    return ap


def check_config(path: str) -> Config:
    """check_config loads a configuration and every pool's tokenizer; raises ConfigError."""
    from extproc.tokens import load_tokenizer  # heavy: only for the commands that need it

    config = load_config(path)
    for name, pool in config.pools.items():
        try:
            load_tokenizer(pool.tokenizer)
        except ConfigError as err:
            raise ConfigError(f"pools.{name}.tokenizer", err.reason) from None
    return config


def _run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = check_config(args.config)
    except ConfigError as err:
        print(f"error: {err.key}: {err.reason}", file=sys.stderr)
        return EXIT_CONFIG
    from prometheus_client import disable_created_metrics

    from extproc.server import serve
    disable_created_metrics()  # *_created series only double the exposition
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    return runner(serve(config, grpc_listen=args.grpc_listen, admin_listen=args.admin_listen,
                        config_path=args.config))


def main(argv: Sequence[str] | None = None) -> int:
    """main runs one kvgate command and returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from sim.cli import main as sim_main  # the simulator parses its own arguments
        return int(sim_main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            check_config(args.file)
        except ConfigError as err:
            print(f"error: {err.key}: {err.reason}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"{args.file}: ok")
        return EXIT_OK
    if args.command == "serve":
        try:
            return _run_serve(args)
        except OSError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILURE
    return EXIT_FAILURE
