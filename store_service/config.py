"""Store settings: flags, with TANDEM_STORE_* environment variables as defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from store_service.tier.config import TierConfig, add_tier_args, tier_from_args
from tandem_wire.server_flags import (
    AuthFlags,
    EnvDefaults,
    LogFlags,
    MetricsFlags,
    TlsFlags,
    add_auth_args,
    add_grace_arg,
    add_listen_arg,
    add_log_args,
    add_metrics_arg,
    add_tls_args,
    config_fields,
)


class SyncMode(StrEnum):
    # fsync once per committed checkpoint, before it is acknowledged.
    COMMIT = "commit"
    # fsync every sync_interval seconds: up to that much acknowledged work can be lost.
    PERIODIC = "periodic"
    # Only on Flush and shutdown (benchmarks, scratch stores).
    NONE = "none"


MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path
    listen: str = "127.0.0.1:50061"
    capacity_bytes: int = 8 * GiB
    sync_mode: SyncMode = SyncMode.COMMIT
    sync_interval_s: float = 1.0
    # Payload bytes per stored LMDB value (1-4 MiB values write fastest, see docs/performance.md).
    chunk_bytes: int = 1 * MiB
    max_workers: int = 32
    # Threads copying one Get into a shared-memory region; 0 = from the cores (4..16).
    region_copy_threads: int = 0
    # Concurrent Put/Get calls one client connection may have; 0 = max_workers / 2.
    bulk_calls_per_connection: int = 0
    # Concurrent Put/Get calls in all (0 = max_workers less a reserve of max(4, a quarter)
    # for small calls; each kind at most that less a third), and per principal with auth
    # (0 = as many as one kind).
    max_bulk_calls: int = 0
    bulk_calls_per_principal: int = 0
    # Same-host regions: the Unix socket fds are handed over on ("" = a random abstract
    # name, "@name" = that abstract name, a path, "off" = no regions), and how many regions
    # one principal and the store in all may hold (the latter at most half RLIMIT_NOFILE).
    region_socket: str = ""
    max_regions_per_principal: int = 64
    max_regions: int = 1024
    # Direct Gets (direct_reads.py): leases open at once (0 = none served) and how long one
    # keeps its pages before it lapses.
    max_direct_reads: int = 64
    direct_read_ttl_s: float = 5.0
    # Seconds a Put/PutMany stream may keep the store waiting for its next message before
    # the store ends it (DEADLINE_EXCEEDED) and frees its worker; 0 = wait for ever.
    put_idle_timeout_s: float = 10.0
    default_lease_s: int = 300
    max_lease_s: int = 24 * 3600
    grace_s: float = 10.0
    # Initial LMDB map size; 0 = sized from the capacity. It grows on demand either way.
    map_size_bytes: int = 0
    # PEM files; both given = listen with TLS; a client CA = client certificates required.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Security (docs/security.md): principals, StoreAdmin on a port of its own, and the
    # explicit opt-out that allows a non-loopback address without authentication.
    auth_file: str = ""
    admin_listen: str = ""
    insecure_no_auth: bool = False
    metrics_listen: str = ""  # Prometheus /metrics on HOST:PORT; "" = off
    log_format: str = "text"  # or "json" (tandem_wire/logs.py)
    log_level: str = "info"
    tier: TierConfig | None = None  # the shared tier (docs/scale-out.md); None = none

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("--capacity-bytes must be positive")
        if not 4096 <= self.chunk_bytes <= 4 * MiB:
            raise ValueError("--chunk-bytes must be between 4 KiB and 4 MiB")
        if self.sync_interval_s <= 0:
            raise ValueError("--sync-interval must be positive")
        if self.region_copy_threads < 0:
            raise ValueError("--region-copy-threads must be >= 0")
        if self.bulk_calls_per_connection < 0:
            raise ValueError("--max-bulk-calls-per-connection must be >= 0")
        if self.max_bulk_calls < 0 or self.bulk_calls_per_principal < 0:
            raise ValueError("--max-bulk-calls and --max-bulk-calls-per-principal must be >= 0")
        if self.max_bulk_calls > self.max_workers:
            raise ValueError("--max-bulk-calls must not exceed --max-workers")
        if self.max_direct_reads < 0 or not 0.05 <= self.direct_read_ttl_s <= 60:
            raise ValueError("--max-direct-reads must be >= 0, --direct-read-ttl 0.05..60 s")
        if self.max_regions_per_principal < 1 or self.max_regions < 1:
            raise ValueError("--max-regions-per-principal and --max-regions must be >= 1")
        if self.put_idle_timeout_s < 0:
            raise ValueError("--put-idle-timeout-s must be >= 0 (0: no limit)")


ENV = EnvDefaults("TANDEM_STORE_")


def parse_args(argv: list[str] | None = None) -> StoreConfig:
    parser = argparse.ArgumentParser(prog="tandem-store", description=__doc__)
    parser.add_argument("--data-dir", default=ENV("DATA_DIR", ".tandem/store"))
    add_listen_arg(parser, ENV, "127.0.0.1:50061")
    parser.add_argument(
        "--capacity-bytes", type=int, default=ENV.integer("CAPACITY_BYTES", 8 * GiB)
    )
    parser.add_argument(
        "--sync-mode",
        choices=[m.value for m in SyncMode],
        default=ENV("SYNC_MODE", SyncMode.COMMIT.value),
    )
    parser.add_argument(
        "--sync-interval",
        type=float,
        default=ENV.real("SYNC_INTERVAL", 1.0),
        help="seconds between syncs in periodic mode (the loss window)",
    )
    parser.add_argument("--chunk-bytes", type=int, default=ENV.integer("CHUNK_BYTES", MiB))
    parser.add_argument("--max-workers", type=int, default=ENV.integer("MAX_WORKERS", 32))
    parser.add_argument(
        "--region-copy-threads",
        type=int,
        default=ENV.integer("REGION_COPY_THREADS", 0),
        help="threads copying one Get into a same-host region (0: from the cores, 4..16)",
    )
    parser.add_argument(
        "--max-bulk-calls-per-connection",
        type=int,
        default=ENV.integer("MAX_BULK_CALLS_PER_CONNECTION", 0),
        help="concurrent Put/Get calls one client connection may have (0: max-workers / 2)",
    )
    parser.add_argument(
        "--max-bulk-calls",
        type=int,
        default=ENV.integer("MAX_BULK_CALLS", 0),
        help="concurrent Put/Get calls in all, each kind at most that less a third "
        "(0: max-workers less max(4, max-workers / 4), kept for small calls and health)",
    )
    parser.add_argument(
        "--max-bulk-calls-per-principal",
        type=int,
        default=ENV.integer("MAX_BULK_CALLS_PER_PRINCIPAL", 0),
        help="with --auth-file, concurrent Put/Get calls one principal may have "
        "(0: --max-bulk-calls less a third)",
    )
    parser.add_argument(
        "--region-socket",
        default=ENV("REGION_SOCKET", ""),
        help="Unix socket same-host callers hand their regions' fds over on: a path, "
        "@NAME (abstract), 'off' (no regions); default: a random abstract name",
    )
    parser.add_argument(
        "--max-direct-reads",
        type=int,
        default=ENV.integer("MAX_DIRECT_READS", 64),
        help="direct Gets (a same-host caller reads the data file itself) open at once; "
        "0: none, every same-host Get is copied into the caller's region",
    )
    parser.add_argument(
        "--direct-read-ttl",
        type=float,
        default=ENV.real("DIRECT_READ_TTL", 5.0),
        help="seconds a direct Get keeps its pages for the caller before its lease lapses",
    )
    parser.add_argument(
        "--max-regions-per-principal",
        type=int,
        default=ENV.integer("MAX_REGIONS_PER_PRINCIPAL", 64),
        help="same-host regions one principal may hold (registered or being handed over)",
    )
    parser.add_argument(
        "--max-regions",
        type=int,
        default=ENV.integer("MAX_REGIONS", 1024),
        help="same-host regions the store holds in all (at most half its open-file limit)",
    )
    parser.add_argument(
        "--put-idle-timeout-s",
        type=float,
        default=ENV.real("PUT_IDLE_TIMEOUT_S", 10),
        help="seconds a Put stream may send nothing before the store ends it with "
        "DEADLINE_EXCEEDED and frees its worker (0: no limit)",
    )
    add_grace_arg(parser, ENV, help="seconds SIGTERM waits for in-flight calls")
    parser.add_argument(
        "--map-size",
        type=int,
        default=ENV.integer("MAP_SIZE", 0),
        help="initial LMDB map size in bytes (grows on demand); 0 = from capacity",
    )
    add_tls_args(parser, ENV)
    add_auth_args(parser, ENV)
    add_log_args(parser, ENV)
    parser.add_argument(
        "--admin-listen",
        default=ENV("ADMIN_LISTEN", ""),
        help="HOST:PORT serving StoreAdmin (then not served on --listen)",
    )
    add_metrics_arg(parser, ENV)
    add_tier_args(parser, ENV)
    args = parser.parse_args(argv)
    try:
        return StoreConfig(
            tier=tier_from_args(args),
            data_dir=Path(args.data_dir),
            listen=args.listen,
            capacity_bytes=args.capacity_bytes,
            sync_mode=SyncMode(args.sync_mode),
            sync_interval_s=args.sync_interval,
            chunk_bytes=args.chunk_bytes,
            max_workers=args.max_workers,
            region_copy_threads=args.region_copy_threads,
            admin_listen=args.admin_listen,
            bulk_calls_per_connection=args.max_bulk_calls_per_connection,
            max_bulk_calls=args.max_bulk_calls,
            bulk_calls_per_principal=args.max_bulk_calls_per_principal,
            region_socket=args.region_socket,
            max_regions_per_principal=args.max_regions_per_principal,
            max_regions=args.max_regions,
            max_direct_reads=args.max_direct_reads,
            direct_read_ttl_s=args.direct_read_ttl,
            put_idle_timeout_s=args.put_idle_timeout_s,
            grace_s=args.grace,
            map_size_bytes=args.map_size,
            **config_fields(args, TlsFlags, AuthFlags, LogFlags, MetricsFlags),
        )
    except ValueError as exc:
        parser.error(str(exc))
