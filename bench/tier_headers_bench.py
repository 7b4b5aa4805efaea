"""A checkpoint chain probed on a node that holds none of it (a resume after a node's loss):
one `Store.GetHeaders` against a Get a key in parallel, ABAB, on a real Valkey cluster.

Node A (a tiered `tandem-store`) writes --segments generation records of --mib MiB (written
through: in the tier when answered). Node B, whose LMDB holds none of them, is asked for
their headers: A, the baseline: a thread each, `StoreClient.get_header` (the resume's probe
before GetHeaders); B: one `StoreClient.get_headers` call. Either way node B brings every
record over from the tier (payload and all) before it answers. Each round writes two fresh
sets, one per side; the first round warms up and is dropped. Prints the medians and the
median of the paired ratios B / A with their spread.

    python bench/tier_headers_bench.py [--segments 16] [--mib 4] [--pairs 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.tier_bench import NAMESPACE, checkpoint  # noqa: E402
from tandem_client import StoreClient  # noqa: E402
from tests.tier_stack import start_cluster, two_nodes  # noqa: E402


def written(node: StoreClient, base: object, prefix: str, count: int) -> list[bytes]:
    keys = [f"{prefix}-{i}".encode() for i in range(count)]
    for key in keys:
        node.put(dataclasses.replace(base, key=key))  # type: ignore[type-var]
    return keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=7)
    args = ap.parse_args()
    base = checkpoint(b"segment", args.mib << 20)
    with tempfile.TemporaryDirectory(prefix="tandem-headers-") as tmp:
        cluster = start_cluster(Path(tmp) / "valkey")
        try:
            with (
                two_nodes(Path(tmp), cluster) as (a, b),
                StoreClient(a.address, timeout=600) as writer,
                StoreClient(b.address, timeout=600) as reader,
                ThreadPoolExecutor(args.segments) as pool,
            ):
                gets: list[float] = []
                calls: list[float] = []
                for r in range(args.pairs + 1):
                    sides = ["gets", "call"] if r % 2 == 0 else ["call", "gets"]
                    for side in sides:
                        keys = written(writer, base, f"{side}-{r}", args.segments)
                        start = time.perf_counter()
                        if side == "gets":
                            found = list(pool.map(lambda k: reader.get_header(k, NAMESPACE), keys))
                        else:
                            found = [h.checkpoint for h in reader.get_headers(keys, NAMESPACE)]
                        elapsed = time.perf_counter() - start
                        assert all(h is not None for h in found), side
                        if r:
                            (gets if side == "gets" else calls).append(elapsed)
                        for key in keys:
                            writer.delete(key, NAMESPACE)
                            reader.delete(key, NAMESPACE)
                    if r:
                        print(
                            f"  round {r}: gets {gets[-1] * 1e3:7.1f} ms, one call "
                            f"{calls[-1] * 1e3:7.1f} ms",
                            flush=True,
                        )
                hits = reader.stats().tier.hits
        finally:
            cluster.stop()
    ratios = sorted(c / g for g, c in zip(gets, calls, strict=True))
    print(
        f"{args.segments} segments of {args.mib} MiB only in the tier, {args.pairs} pairs: "
        f"{args.segments} parallel Gets {statistics.median(gets) * 1e3:.1f} ms, one GetHeaders "
        f"{statistics.median(calls) * 1e3:.1f} ms; GetHeaders / Gets median "
        f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}); reader tier hits "
        f"{hits}"
    )


if __name__ == "__main__":
    main()
