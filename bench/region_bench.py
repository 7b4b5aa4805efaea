"""Same-host Get into a shared-memory region vs a single-threaded memcpy of the same bytes
vs the streamed gRPC Get, and a Put through the region vs a streamed Put, in one run (ABAB
rounds, medians of the paired ratios).

    python bench/region_bench.py [--mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import numpy as np  # noqa: E402

from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tandem_client.regions import DEFAULT_OFFSET, SharedRegion  # noqa: E402
from tests.servers import start_store  # noqa: E402


def timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    nbytes = a.mib << 20
    root = Path(tempfile.mkdtemp(prefix="region-bench-"))
    store = start_store(root / "data", "--sync-mode", "none", "--capacity-bytes", str(4 * nbytes))
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    destination = np.empty_like(source)
    region = SharedRegion(nbytes + DEFAULT_OFFSET)
    try:
        with StoreClient(store.address, timeout=600) as client:
            tensor = Tensor("t", "uint8", (nbytes,), source.tobytes())
            client.put(Checkpoint(key=b"big", kind="object", tensors=[tensor]))
            client.register_region(region, ttl_s=600)

            def into() -> None:
                got = client.get_into(b"big", region)
                del got

            def streamed() -> None:
                client.get(b"big")

            def memcpy() -> None:
                np.copyto(destination, source)

            for fn in (into, streamed, memcpy):  # warm: page faults, LMDB pages cached
                fn()
            times: dict[str, list[float]] = {"memcpy": [], "region": [], "grpc": []}
            for r in range(a.rounds):
                order = [("memcpy", memcpy), ("region", into), ("grpc", streamed)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    times[name].append(timed(fn))
            check = client.get_into(b"big", region)
            assert bytes(check.tensors[0].data[:4096]) == source[:4096].tobytes()
            del check
            client.unregister_region(region)
        # Puts: streamed over gRPC against through the region (the client copies the bytes
        # into a span, the store reads and checks them there), ABAB.
        record = Checkpoint(key=b"put", kind="object", tensors=[tensor])
        with (
            StoreClient(store.address, timeout=600) as far,
            StoreClient(store.address, timeout=600) as near,
        ):
            near.attach_region(region, slots=1)
            for client in (far, near):  # warm
                client.put(record)
            for r in range(a.rounds):
                order = [("put_grpc", far), ("put_region", near)]
                for name, client in order if r % 2 == 0 else order[::-1]:
                    times.setdefault(name, []).append(timed(lambda c=client: c.put(record)))
            got = far.get(b"put")
            assert bytes(got.tensors[0].data[-4096:]) == source[-4096:].tobytes()
            near.detach_region()

        def gbps(t: float) -> float:
            return nbytes / t / 1e9

        ratio = [m / g for m, g in zip(times["memcpy"], times["region"], strict=True)]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{a.mib} MiB: memcpy {gbps(med['memcpy']):.2f} GB/s, region Get "
            f"{gbps(med['region']):.2f} GB/s, gRPC Get {gbps(med['grpc']):.2f} GB/s; region/memcpy "
            f"speed median {statistics.median(ratio):.2f}x (spread {min(ratio):.2f}-"
            f"{max(ratio):.2f}, {a.rounds} rounds); region/gRPC "
            f"{med['grpc'] / med['region']:.1f}x"
        )
        puts = [g / r for g, r in zip(times["put_grpc"], times["put_region"], strict=True)]
        print(
            f"{a.mib} MiB Put: streamed over gRPC {gbps(med['put_grpc']):.2f} GB/s, through the "
            f"region {gbps(med['put_region']):.2f} GB/s; region/gRPC median "
            f"{statistics.median(puts):.2f}x (spread {min(puts):.2f}-{max(puts):.2f})"
        )
    finally:
        region.close()
        store.stop()


if __name__ == "__main__":
    main()
