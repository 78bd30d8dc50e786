"""`lightgate` command line: serve, rebuild-queues, proxy, passwd, analytics."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lightgate import ban_cli
from lightgate.config import ConfigError, GatewayConfig
from lightgate.config_load import (
    KEYS,
    config_from_json,
    load_config,
    unknown_env_names,
    unknown_key_error,
)
from lightgate.logs import setup_logging
from lightgate.split import INTERNAL_SECRET_ENV

log = logging.getLogger("lightgate")

_SERVE_FLAGS = (
    "data_dir",
    "host",
    "mqtt_port",
    "mqtts_port",
    "ws_port",
    "wss_port",
    "kafka_port",
    "kafka_tls_port",
    "http_port",
    "core_secret_file",
)
_SECRET_HELP = "file holding the core link's shared secret (core_secret_file)"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (also LIGHTGATE_CONFIG)")
    p.add_argument("--data-dir", help="data directory (default ./data)")


def _version() -> str:
    """The installed distribution's version; the source tree's when run uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightgate")
    except PackageNotFoundError:
        from lightgate import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightgate",
        description="MQTT-compatible IoT gateway on one shared commitlog (MQTT, Kafka, Spark).",
    )
    parser.add_argument("--version", action="version", version=f"lightgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run store, light queues, notify, MQTT and Kafka listeners in one process. "
        "Every flag is also an env var LIGHTGATE_<NAME> and a key in the TOML config. "
        "Port 0 picks a free port; -1 disables the listener. Every key, its default and its "
        "allowed values: lightgate.example.toml and docs/configuration.md.",
    )
    _add_common(serve)
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    for flag, default in (
        ("mqtt-port", 1883),
        ("mqtts-port", 8883),
        ("ws-port", 8083),
        ("wss-port", 8084),
        ("kafka-port", 9092),
        ("kafka-tls-port", 9093),
        ("http-port", 8080),
    ):
        serve.add_argument(f"--{flag}", type=int, help=f"default {default}")
    serve.add_argument("--core-secret-file", metavar="FILE", help=_SECRET_HELP)
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other config key, e.g. --set fsync=interval_ms (see docs/configuration.md)",
    )

    rebuild = sub.add_parser(
        "rebuild-queues",
        help="rebuild every light queue from the commitlog (gateway must be stopped)",
    )
    _add_common(rebuild)

    proxy = sub.add_parser(
        "proxy",
        help="run an MQTT proxy against a core (`serve` starts them itself with mqtt_processes = N)",
        description="Run the MQTT listeners, sessions and delivery in this process, with the "
        "store, light queues and notify of a core reached over its core link (`core_listen`). "
        "Listener flags and --set work as for serve.",
    )
    proxy.add_argument("--config", help="TOML config file (also LIGHTGATE_CONFIG)")
    proxy.add_argument("--core", required=True, help="core link address: host:port or unix:/path")
    proxy.add_argument("--proxy-id", default="mqtt-1", help="this proxy's id (default mqtt-1)")
    proxy.add_argument("--host", help="listen address (default 127.0.0.1)")
    for flag, default in (
        ("mqtt-port", 1883),
        ("mqtts-port", 8883),
        ("ws-port", 8083),
        ("wss-port", 8084),
    ):
        proxy.add_argument(f"--{flag}", type=int, help=f"default {default}")
    proxy.add_argument("--core-secret-file", metavar="FILE", help=_SECRET_HELP)
    proxy.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    proxy.add_argument("--config-json", help=argparse.SUPPRESS)  # serve passes its resolved config
    proxy.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)

    sub.add_parser(
        "passwd",
        help="manage a password_file like mosquitto_passwd (run `lightgate passwd --help`)",
        add_help=False,
    ).add_argument("args", nargs=argparse.REMAINDER)
    status = sub.add_parser(
        "status",
        help="key figures of a running gateway (from its /api/stats) in the terminal",
        description="Connections, message rates, sessions, dispatch lag, disk and latency "
        "percentiles of a running gateway. Exit status 0 healthy, 1 unhealthy, 2 unreachable.",
    )
    status.add_argument("--config", help="TOML config file: its host and http_port give the URL")
    status.add_argument("--url", help="the gateway's HTTP listener (default http://HOST:HTTP_PORT)")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument("--count", type=int, default=0, help="with --watch: stop after N frames")

    ban_cli.add_parser(sub)

    analytics = sub.add_parser(
        "analytics",
        help="device analytics jobs on the log with Spark (run `lightgate analytics --help`)",
        add_help=False,
    )
    analytics.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _config_from(ns: argparse.Namespace) -> GatewayConfig:
    overrides: dict[str, object] = {}
    for name in _SERVE_FLAGS:
        value = getattr(ns, name, None)
        if value is not None:
            overrides[name] = value
    for item in getattr(ns, "set", []) or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        if key not in KEYS and not key.startswith("kafka_client_"):
            raise unknown_key_error(key, "--set")
        overrides[key] = value
    return load_config(ns.config, overrides=overrides)


def _without_hypothesis() -> None:
    """kio (the Kafka schemas) registers a hypothesis strategy per type whenever hypothesis is
    importable, as it is in a dev install: 0.3-0.4 s of every `serve`/`proxy` start (the test
    suite starts hundreds) for nothing a gateway uses. These commands run in a process of
    their own, so hiding it here touches no other code."""
    sys.modules.setdefault("hypothesis", None)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["analytics"]:
        from spark_analytics.cli import main as analytics_main

        return analytics_main(argv[1:])
    if argv[:1] == ["passwd"]:
        from lightgate.passwd import main as passwd_main

        return passwd_main(argv[1:])
    ns = parser.parse_args(argv)
    try:
        cfg = _config_from(ns)
    except ConfigError as exc:
        print(f"lightgate: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level)
    if not getattr(ns, "config_json", None):  # a proxy started by serve: serve warned already
        for warning in unknown_env_names():
            log.warning(warning)
    if ns.command == "serve":
        _without_hypothesis()
        from lightgate.app import serve

        tune_gc(cfg.gc_gen0)
        return _run(serve(cfg))
    if ns.command == "proxy":
        _without_hypothesis()
        from lightgate.proxy_main import exit_with_parent, run_proxy
        from lightgate.security import build_security, reload_security, reload_tls
        from lightgate.tls import TlsReloader, tls_context
        from store.auth import Security

        if ns.exit_with_parent:
            exit_with_parent()
        if ns.config_json:
            cfg = config_from_json(ns.config_json)
            # serve hands its core_secret over in the environment, not in argv (lightgate/supervisor.py)
            cfg.core_secret = os.environ.get("LIGHTGATE_CORE_SECRET", "")
            setup_logging(cfg.log_format, cfg.log_level)
        tune_gc(cfg.gc_gen0)
        certificates = TlsReloader(cfg)

        def reload(security: Security) -> bool:
            reload_tls(certificates)
            return reload_security(security)

        return _run(
            run_proxy(
                cfg,
                ns.core,
                ns.proxy_id,
                lambda: build_security(cfg),
                reload=reload,
                tls_ctx=lambda: certificates.add(tls_context(cfg)),
                # serve's probes (lightgate/supervisor.py); absent for a proxy started by hand
                internal_secret=bytes.fromhex(os.environ.get(INTERNAL_SECRET_ENV, "")),
            )
        )
    if ns.command == "status":
        from lightgate.status import main as status_main

        url = ns.url or f"http://{cfg.host}:{cfg.http_port}"
        return status_main(url, ns.watch, ns.count)
    if ns.command == "ban":
        url = ns.url or f"http://{cfg.host}:{cfg.http_port}"
        return ban_cli.main(ns, url, cfg.http_admin_token_file)
    if ns.command == "rebuild-queues":
        from lightgate.app import check_data_dir
        from lightgate.rebuild_command import rebuild_queues

        try:
            check_data_dir(cfg, must_exist=True)
        except ConfigError as exc:
            print(f"lightgate: {exc}", file=sys.stderr)
            return 2
        return _run(rebuild_queues(cfg))
    parser.error(f"unknown command {ns.command}")
    return 2


def tune_gc(gen0: int = 5_000) -> None:
    """The gateway keeps 10^5-10^6 long-lived objects (message caches, queue state) and allocates
    a few per message; CPython's default thresholds (700, 10, 10) run full collections over every
    cache too often (resolving stored records: 10 us each with defaults vs 1.9 us with a large
    young threshold, bench/RESULTS.md, light queues). The young threshold is also the length of
    each young pause: 50000 gave one ~15 ms stall a second at 1k msg/s (the p999 latency), 5000
    gives ~2 ms with no fan-in throughput difference measurable (docs/performance-history.md).
    Our hot
    paths make almost no reference cycles, so collecting rarely loses little memory. 0 keeps
    CPython's thresholds."""
    import gc

    if gen0 > 0:
        gc.set_threshold(gen0, 20, 100)


def _run(coro: Coroutine[Any, Any, int]) -> int:
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        return int(runner(coro))
    except ConfigError as exc:  # found while starting (e.g. a TLS file `proxy` cannot load)
        print(f"lightgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
