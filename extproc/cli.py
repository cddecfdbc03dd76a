"""cli: the ``kvgate`` command (also ``python -m extproc``).

    kvgate serve --config FILE [--grpc-listen HOST:PORT] [--admin-listen HOST:PORT] [--log-level LEVEL]
                 [--log-format text|json]
    kvgate check-config FILE [--envoy ENVOY.yaml]   (either may be a ConfigMap manifest carrying it)
    kvgate envoy-filter --config FILE [--mode MODE] [--upstream HOST:PORT] [--bootstrap [--listen HOST:PORT]]
    kvgate health [--address HOST:PORT] [--timeout SECONDS]
    kvgate sim ARGS...            (the vLLM-compatible simulator; see ``kvgate sim --help``)

Exit codes: 0 success, 2 bad configuration or usage, 1 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from extproc.config import Config
from extproc.configparse import load_config
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
    serve.add_argument("--log-format", default="text", choices=("text", "json"),
                       help="text (default) or json: one JSON object a line, for log pipelines; "
                            "times in UTC either way")
    check = sub.add_parser("check-config", help="validate a configuration file and its tokenizers")
    check.add_argument("file", metavar="FILE",
                       help="kvgate's file, or a ConfigMap manifest carrying it as data key kvgate.yaml")
    check.add_argument("--envoy", metavar="ENVOY.yaml",
                       help="also report every value of this Envoy file (or of a ConfigMap manifest "
                            "carrying it as data key envoy.yaml) that disagrees with FILE")
    from extproc.envoyconf import DEFAULT_MODE, MODES, PICKING_MODE
    ef = sub.add_parser("envoy-filter", help="print the Envoy ext_proc filter and cluster for a configuration")
    ef.add_argument("--config", required=True, metavar="FILE", help="kvgate YAML configuration")
    ef.add_argument("--mode", choices=MODES, default=None,
                    help=f"which Envoy file of deploy/ to follow (default: {PICKING_MODE} where the "
                         f"default pool picks its nodes, else {DEFAULT_MODE}); a mode that does not "
                         f"fit the pool is refused")
    ef.add_argument("--bootstrap", action="store_true",
                    help="print a whole Envoy file, not the blocks keyed by where each goes")
    ef.add_argument("--listen", type=_hostport, default="0.0.0.0:8080", metavar="HOST:PORT",
                    help="with --bootstrap: Envoy's listener (default 0.0.0.0:8080)")
    ef.add_argument("--upstream", type=_hostport, default="inference:8000", metavar="HOST:PORT",
                    help="the pool-level inference cluster's DNS name and port (default inference:8000)")
    health = sub.add_parser("health", help="ask a running kvgate's gRPC health service; exit 0 when SERVING")
    health.add_argument("--address", type=_hostport, default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="kvgate's ext_proc gRPC address (default 127.0.0.1:50051)")
    health.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS", help="default: 3")
    sub.add_parser("sim", help="run the vLLM-compatible simulator (arguments go to it)",
                   add_help=False)
    return ap


def check_config(path: str, *, manifest: bool = False) -> Config:
    """check_config loads a configuration and every pool's tokenizer; raises ConfigError.

    With ``manifest``, ``path`` may also be a Kubernetes ConfigMap manifest that carries the
    file as ``data.kvgate.yaml`` (``extproc.manifest``).
    """
    from extproc.tokens import load_tokenizer  # heavy: only for the commands that need it

    if manifest:
        from extproc.configparse import parse_config, read_yaml
        from extproc.manifest import unwrap
        config = parse_config(unwrap(read_yaml(path), "kvgate.yaml")[0])
    else:
        config = load_config(path)
    for name, pool in config.pools.items():
        try:
            load_tokenizer(pool.tokenizer)
        except ConfigError as err:
            raise ConfigError(f"pools.{name}.tokenizer", err.reason) from None
    return config


def _run_serve(args: argparse.Namespace) -> int:
    from extproc.logfmt import configure
    configure(args.log_level, args.log_format)
    try:
        config = check_config(args.config)
    except ConfigError as err:
        print(f"error: {err.key}: {err.reason}", file=sys.stderr)
        return EXIT_CONFIG
    from extproc.configparse import warnings
    for line in warnings(config):
        logging.getLogger("kvgate").warning("%s", line)
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


def _check_envoy(config: Config, path: str, envoy_path: str) -> int:
    import yaml

    from extproc import yamlload
    from extproc.envoycheck import check_envoy
    from extproc.manifest import unwrap
    try:
        with open(envoy_path, encoding="utf-8") as f:
            doc = yamlload.load(f.read())
        doc, _ = unwrap(doc, "envoy.yaml")
    except (OSError, yaml.YAMLError) as err:
        print(f"error: --envoy: cannot read {envoy_path}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as err:
        print(f"error: --envoy: {envoy_path}: {err.key}: {err.reason}", file=sys.stderr)
        return EXIT_CONFIG
    found = check_envoy(config, doc)
    for d in found:
        print(f"error: {d.key}: {d.reason} (envoy: {d.where})", file=sys.stderr)
    if found:
        print(f"{envoy_path}: {len(found)} disagreement(s) with {path}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{path}: ok; {envoy_path} agrees with it")
    return EXIT_OK


def _health(address: str, timeout_s: float) -> int:
    """_health asks the gRPC health service at ``address`` about the whole server (service "");
    0 when it answers SERVING, 1 otherwise (not serving, draining, unreachable). For a
    container's HEALTHCHECK: the ext_proc port itself, not only the admin port."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                             timeout=timeout_s)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return EXIT_FAILURE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{address}: {status}")
    return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILURE


def _envoy_filter(args: argparse.Namespace) -> int:
    from extproc.envoyconf import envoy_bootstrap, envoy_filter, mode_for, render
    try:
        config = load_config(args.config)
        mode = args.mode or mode_for(config)
        doc = (envoy_bootstrap(config, mode, listen=args.listen, upstream=args.upstream)
               if args.bootstrap else envoy_filter(config, mode, upstream=args.upstream))
    except ConfigError as err:
        print(f"error: {err.key}: {err.reason}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(render(doc, args.config, mode))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """main runs one kvgate command and returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from sim.cli import main as sim_main  # the simulator parses its own arguments
        return int(sim_main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            config = check_config(args.file, manifest=True)
        except ConfigError as err:
            print(f"error: {err.key}: {err.reason}", file=sys.stderr)
            return EXIT_CONFIG
        from extproc.configparse import warnings
        for line in warnings(config):
            print(f"warning: {line}")
        if args.envoy:
            return _check_envoy(config, args.file, args.envoy)
        print(f"{args.file}: ok")
        return EXIT_OK
    if args.command == "envoy-filter":
        return _envoy_filter(args)
    if args.command == "health":
        return _health(args.address, args.timeout)
    if args.command == "serve":
        try:
            return _run_serve(args)
        except OSError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILURE
    return EXIT_FAILURE
