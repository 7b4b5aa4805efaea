"""Two "nodes" (a store each, with its own data directory) sharing a real Valkey cluster."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from store_service.tier.cluster_client import ClusterClient
from store_service.tier.config import TierConfig
from store_service.tier.local_cluster import USER, LocalCluster
from tests.servers import ServiceProcess, start_store


def start_cluster(root: Path, primaries: int = 3, replicas: int = 1) -> LocalCluster:
    # A primary is failed over 1 s after it stops answering (tandem up's clusters: 2 s).
    cluster = LocalCluster(root, secrets.token_hex(16), primaries, replicas, node_timeout_ms=1000)
    return cluster.start()


def password_file(cluster: LocalCluster) -> Path:
    path = cluster.root / "tier-password"
    if not path.exists():
        path.write_text(cluster.password)
        path.chmod(0o600)
    return path


def tier_args(cluster: LocalCluster, *extra: str) -> list[str]:
    return [
        "--tier",
        f"valkey://{USER}@{cluster.seeds}",
        "--tier-password-file",
        str(password_file(cluster)),
        *extra,
    ]


def start_tiered_store(root: Path, cluster: LocalCluster, *extra: str) -> ServiceProcess:
    return start_store(root, *tier_args(cluster, *extra))


def raw_client(cluster: LocalCluster) -> ClusterClient:
    """The tier as the stores see it, for tests that reach into Valkey."""
    config = TierConfig.from_url(f"valkey://{USER}@{cluster.seeds}", str(password_file(cluster)))
    return ClusterClient(config)


@contextmanager
def two_nodes(root: Path, cluster: LocalCluster, *extra: str) -> Iterator[list[ServiceProcess]]:
    stores = [start_tiered_store(root / f"node-{n}", cluster, *extra) for n in "ab"]
    try:
        yield stores
    finally:
        for store in stores:
            store.stop()
