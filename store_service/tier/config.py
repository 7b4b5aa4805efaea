"""The shared tier's settings: where the Valkey cluster is, how a store authenticates to it,
and when a Put counts as stored."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tandem_wire.registry import ValkeyTarget
from tandem_wire.server_flags import EnvDefaults, add_valkey_args


class Durability(StrEnum):
    # Acknowledged once in the local LMDB file; the tier gets generations in the background.
    LOCAL = "local"
    # Acknowledged once the tier's primaries hold it (a primary lost before its replica
    # copied it loses what it had: docs/scale-out.md).
    TIER = "tier"
    # Acknowledged once at least one replica of each primary written holds it (WAIT).
    REPLICATED = "replicated"


@dataclass(frozen=True)
class TierConfig:
    # host:port of cluster nodes to discover the rest from.
    seeds: tuple[tuple[str, int], ...]
    tls: bool = False
    tls_ca: Path | None = None
    user: str = ""
    password: str = ""  # read from --tier-password-file, never a flag (argv is public)
    durability: Durability = Durability.TIER
    # Records expire after this long without being written again (the tier is a cache of
    # what nodes computed, not an archive); the cluster's memory policy evicts before that.
    ttl_s: int = 24 * 3600
    # Prefix records queued for the tier, in bytes; more are dropped (counted).
    write_behind_bytes: int = 256 << 20
    # Bytes one namespace may hold in the tier through this store; 0 = no limit.
    namespace_quota_bytes: int = 0
    # How long a replica may take to confirm (replicated), and any one command.
    replica_wait_ms: int = 2000
    op_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0

    @classmethod
    def from_url(cls, url: str, password_file: str = "", **fields: object) -> TierConfig:
        """`valkey://[USER@]HOST:PORT[,HOST:PORT...]` (`valkeys://` for TLS), the password
        from password_file: the registry's URL form (tandem_wire/registry.py).

        Raises:
            ValueError: a malformed URL, or a password file that cannot be read.
        """
        try:
            target = ValkeyTarget.from_flags(url, password_file, "--tier")
        except OSError as exc:
            raise ValueError(str(exc)) from exc
        seeds, tls, user, password = target.seeds, target.tls, target.user, target.password
        return cls(seeds=seeds, tls=tls, user=user, password=password, **fields)  # type: ignore[arg-type]

    def describe(self) -> str:
        """For logs: where and how, never the password."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.seeds)
        who = f"{self.user}@" if self.user else ""
        return f"valkey{'s' if self.tls else ''}://{who}{hosts} ({self.durability})"


def add_tier_args(parser: argparse.ArgumentParser, env: EnvDefaults) -> None:
    group = parser.add_argument_group("shared tier (docs/scale-out.md)")
    add_valkey_args(group, env, "tier", "a Valkey cluster sharing records between nodes")
    group.add_argument("--tier-ca", default=env("TIER_CA", ""), help="PEM CA of the tier's TLS")
    group.add_argument(
        "--tier-durability",
        choices=[d.value for d in Durability],
        default=env("TIER_DURABILITY", Durability.TIER.value),
        help="when a generation checkpoint's Put is answered: stored locally (local), in the "
        "tier's primaries (tier), or also in a replica (replicated)",
    )
    group.add_argument(
        "--tier-ttl-s",
        type=int,
        default=env.integer("TIER_TTL_S", 24 * 3600),
        help="seconds a record lives in the tier after its last write",
    )
    group.add_argument(
        "--tier-write-behind-bytes",
        type=int,
        default=env.integer("TIER_WRITE_BEHIND_BYTES", 256 << 20),
        help="prefix bytes queued for the tier; more are dropped (counted)",
    )
    group.add_argument(
        "--tier-namespace-quota-bytes",
        type=int,
        default=env.integer("TIER_NAMESPACE_QUOTA_BYTES", 0),
        help="bytes one namespace may write to the tier through this store (0: no limit)",
    )


def tier_from_args(args: argparse.Namespace) -> TierConfig | None:
    """The tier the flags name, None without --tier.

    Raises:
        ValueError: a malformed URL or setting, an unreadable password file.
    """
    if not args.tier:
        return None
    if args.tier_ttl_s <= 0 or args.tier_write_behind_bytes < 0:
        raise ValueError("--tier-ttl-s must be positive and --tier-write-behind-bytes >= 0")
    return TierConfig.from_url(
        args.tier,
        args.tier_password_file,
        tls_ca=Path(args.tier_ca) if args.tier_ca else None,
        durability=Durability(args.tier_durability),
        ttl_s=args.tier_ttl_s,
        write_behind_bytes=args.tier_write_behind_bytes,
        namespace_quota_bytes=args.tier_namespace_quota_bytes,
    )
