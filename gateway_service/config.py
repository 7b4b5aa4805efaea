"""The gateway's settings: flags, TANDEM_GATEWAY_* environment, defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gateway_service.discovery import dns_name
from tandem_wire.registry import ValkeyTarget
from tandem_wire.server_flags import (
    AuthFlags,
    EnvDefaults,
    LogFlags,
    MetricsFlags,
    add_auth_args,
    add_log_args,
    add_metrics_arg,
    add_valkey_args,
    config_fields,
)


@dataclass(frozen=True)
class GatewayConfig:
    engines: list[str] = field(default_factory=list)
    # One engine address a line (# comments); read again when it changes: engines come and go.
    engines_file: str = ""
    # Engines announced in the shared tier's registry (gateway_service/discovery.py): a
    # valkey:// URL, and the file holding its user's password.
    discover: str = ""
    discover_password_file: str = ""
    # DNS names whose A/AAAA records are engines (HOST:PORT; a Kubernetes headless Service).
    engines_dns: list[str] = field(default_factory=list)
    http_listen: str = ""  # "" = no HTTP front
    grpc_listen: str = ""  # "" = no gRPC front
    # Streams the gateway proxies checkpoint every N tokens (on engines with a store), so a
    # failover resumes at most N tokens back.
    checkpoint_interval: int = 16
    # How often each engine's health and load are read.
    poll_interval_s: float = 0.5
    # A stream whose engine fails waits this long for a healthy engine before it fails.
    failover_wait_s: float = 10.0
    max_failovers: int = 8
    # Requests sharing a prompt prefix prefer the engine that served it unless its load is
    # more than this above the least loaded engine's.
    affinity_slack: int = 4
    # Callers: the same auth file format as the engines (docs/security.md). The caller's
    # bearer token is forwarded, so each engine decides tenancy itself.
    auth_file: str = ""
    insecure_no_auth: bool = False
    # The gateway's own calls to engines (Stats needs `admin` on an engine with auth).
    engine_token_file: str = ""
    engine_tls_ca: str = ""  # the CA of the engines' (and the store's) certificates
    # The store where /v1/responses keeps conversations (previous_response_id); "" = none,
    # and previous_response_id is refused (gateway_service/conversations.py).
    store: str = ""
    metrics_listen: str = ""  # Prometheus /metrics on HOST:PORT; "" = off
    # An HTTP body past this is refused 413 while it is read. Twice the engine's 4 MiB gRPC
    # message limit: JSON spells a request out longer than protobuf (token ids, escapes).
    max_body_bytes: int = 8 << 20
    # The HTTP/2 window of each stream from an engine (BDP probing off): how far the gateway
    # reads ahead of a client that stopped reading, so the engine sees it stop (and parks its
    # row) after this many bytes rather than megabytes. 0: gRPC's default (64 KiB, grown by
    # BDP probing).
    engine_window_bytes: int = 16 << 10
    # The kernel send buffer of each HTTP connection (0: the kernel's autotuning, up to
    # net.ipv4.tcp_wmem's maximum, 4 MiB by default): bytes of events a client that stopped
    # reading holds in the gateway's kernel before the relay stops reading its engine.
    http_send_buffer_bytes: int = 64 << 10
    # Browser origins allowed to call the HTTP API (CORS; "*" for any). None: no CORS headers,
    # so browsers refuse cross-origin calls.
    cors_origins: list[str] = field(default_factory=list)
    log_format: str = "text"  # or "json" (tandem_wire/logs.py)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.http_listen and not self.grpc_listen:
            raise ValueError("give --http-listen, --grpc-listen or both")
        if not (self.engines or self.engines_file or self.discover or self.engines_dns):
            raise ValueError(
                "give at least one --engine ADDR, --engines-file, --engines-dns or --discover"
            )
        for name in self.engines_dns:
            dns_name(name)
        if self.discover:
            ValkeyTarget.parse(self.discover, "--discover")
        if self.checkpoint_interval < 0:
            raise ValueError("--checkpoint-interval must be >= 0 (0: no checkpoints)")
        if self.poll_interval_s <= 0 or self.failover_wait_s < 0 or self.max_failovers < 0:
            raise ValueError(
                "--poll-interval must be > 0, --failover-wait and --max-failovers >= 0"
            )
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be >= 1024")
        if self.engine_window_bytes and self.engine_window_bytes < 1024:
            raise ValueError("--engine-window-bytes must be 0 (gRPC's default) or >= 1024")
        if self.http_send_buffer_bytes and self.http_send_buffer_bytes < 4096:
            raise ValueError("--http-send-buffer-bytes must be 0 (the kernel's) or >= 4096")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"--cors-origin {origin!r}: an origin is http(s)://host[:port]")


ENV = EnvDefaults("TANDEM_GATEWAY_")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(
        prog="tandem-gateway",
        description="OpenAI-compatible HTTP and Tandem gRPC in front of many engines.",
    )
    env_engines = [e for e in ENV("ENGINES", "").split(",") if e.strip()]
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        help="an engine's HOST:PORT (repeat; or TANDEM_GATEWAY_ENGINES=a,b)",
    )
    p.add_argument("--engines-file", default=ENV("ENGINES_FILE", ""))
    env_dns = [e for e in ENV("ENGINES_DNS", "").split(",") if e.strip()]
    p.add_argument(
        "--engines-dns",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="engines at every A/AAAA record of HOST, read every poll interval (repeat; "
        "a Kubernetes headless Service's name)",
    )
    add_valkey_args(
        p, ENV, "discover", "the Valkey cluster engines announce themselves in with --announce"
    )
    p.add_argument("--http-listen", default=ENV("HTTP_LISTEN", ""), help="HOST:PORT (:0 = any)")
    p.add_argument("--grpc-listen", default=ENV("GRPC_LISTEN", ""), help="HOST:PORT (:0 = any)")
    p.add_argument(
        "--checkpoint-interval", type=int, default=ENV.integer("CHECKPOINT_INTERVAL", 16)
    )
    p.add_argument("--poll-interval", type=float, default=ENV.real("POLL_INTERVAL", 0.5))
    p.add_argument("--failover-wait", type=float, default=ENV.real("FAILOVER_WAIT", 10))
    p.add_argument("--max-failovers", type=int, default=ENV.integer("MAX_FAILOVERS", 8))
    p.add_argument("--affinity-slack", type=int, default=ENV.integer("AFFINITY_SLACK", 4))
    add_auth_args(
        p,
        ENV,
        auth_help=None,
        insecure_help="allow a non-loopback listen address without --auth-file",
    )
    p.add_argument("--engine-token-file", default=ENV("ENGINE_TOKEN_FILE", ""))
    p.add_argument("--engine-tls-ca", default=ENV("ENGINE_TLS_CA", ""))
    add_metrics_arg(p, ENV)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=ENV.integer("MAX_BODY_BYTES", 8 << 20),
        help="HTTP bodies larger than this are refused 413 (default 8 MiB)",
    )
    p.add_argument(
        "--engine-window-bytes",
        type=int,
        default=ENV.integer("ENGINE_WINDOW_BYTES", 16 << 10),
        help="HTTP/2 window of each engine stream, no BDP probing (0: gRPC's default)",
    )
    p.add_argument(
        "--http-send-buffer-bytes",
        type=int,
        default=ENV.integer("HTTP_SEND_BUFFER_BYTES", 64 << 10),
        help="kernel send buffer of each HTTP connection (0: the kernel's autotuning)",
    )
    p.add_argument(
        "--store",
        default=ENV("STORE", ""),
        metavar="HOST:PORT",
        help="a store to keep /v1/responses conversations in, for previous_response_id "
        "(env TANDEM_GATEWAY_STORE); default: none (previous_response_id refused)",
    )
    env_origins = [o for o in ENV("CORS_ORIGINS", "").split(",") if o.strip()]
    p.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="a browser origin allowed to call the HTTP API, e.g. https://app.example "
        "(repeat; * for any; or TANDEM_GATEWAY_CORS_ORIGINS=a,b); default: none",
    )
    add_log_args(p, ENV)
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            engines=a.engine if a.engine is not None else env_engines,
            engines_file=a.engines_file,
            discover=a.discover,
            discover_password_file=a.discover_password_file,
            engines_dns=a.engines_dns if a.engines_dns is not None else env_dns,
            http_listen=a.http_listen,
            grpc_listen=a.grpc_listen,
            checkpoint_interval=a.checkpoint_interval,
            poll_interval_s=a.poll_interval,
            failover_wait_s=a.failover_wait,
            max_failovers=a.max_failovers,
            affinity_slack=a.affinity_slack,
            engine_token_file=a.engine_token_file,
            engine_tls_ca=a.engine_tls_ca,
            max_body_bytes=a.max_body_bytes,
            engine_window_bytes=a.engine_window_bytes,
            http_send_buffer_bytes=a.http_send_buffer_bytes,
            cors_origins=a.cors_origin if a.cors_origin is not None else env_origins,
            store=a.store,
            **config_fields(a, AuthFlags, LogFlags, MetricsFlags),
        )
    except ValueError as exc:
        p.error(str(exc))
