"""How the engine reaches its store: TLS, token, the same-host region and direct reads, the
spill's batching (the flags; config.py holds their values)."""

from __future__ import annotations

import argparse

from tandem_wire.server_flags import EnvDefaults


def add_store_link_args(parser: argparse.ArgumentParser, env: EnvDefaults) -> None:
    """--store-direct-reads auto: direct on MLX-CUDA (0.73-0.82x the region's hit time on
    the H200), the region on the CPU (where direct measured 1.10x: its two host copies run
    on the MLX thread); docs/performance.md, "Direct reads"."""
    parser.add_argument("--store-tls-ca", default=env("STORE_TLS_CA", ""), help="the store's CA")
    parser.add_argument("--store-tls-cert", default=env("STORE_TLS_CERT", ""), help="client cert")
    parser.add_argument("--store-tls-key", default=env("STORE_TLS_KEY", ""), help="client key")
    parser.add_argument(
        "--store-token-file",
        default=env("STORE_TOKEN_FILE", ""),
        help="file holding the bearer token the engine presents to the store",
    )
    parser.add_argument(
        "--store-region-bytes",
        type=int,
        default=env.integer("STORE_REGION_BYTES", -1),
        help="shared memory the store writes restores into when it is on this host (0: off; "
        "-1: 256 MiB, 8 GiB with MLX-CUDA, at most half of /dev/shm's free space)",
    )
    parser.add_argument(
        "--store-direct-reads",
        choices=("auto", "on", "off"),
        default=env("STORE_DIRECT_READS", "auto"),
        help="with a region, read restores straight out of the store's data file when the "
        "store gives it (a principal of every namespace); off: the store copies them into "
        "the region; auto (default): on with MLX-CUDA, off on the CPU",
    )
    parser.add_argument(
        "--spill-batch-records",
        type=int,
        default=env.integer("SPILL_BATCH_RECORDS", 32),
        help="checkpoint records queued together that leave in one PutMany (1: one Put each)",
    )
