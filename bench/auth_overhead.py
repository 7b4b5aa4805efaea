"""What authentication costs a caller: the store with --auth-file (bearer token checked on every
call) beside the same store without, on small calls (Lookup) and a 64 MiB Get.

Both stores run side by side; each round times both in alternating order (ABAB) and the ratio
is authenticated / plain time of the round.

    python bench/auth_overhead.py [--rounds 5] [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tandem_wire.auth import token_sha256  # noqa: E402
from tests.servers import ServiceProcess  # noqa: E402


def start(root: Path, *args: str) -> ServiceProcess:
    return ServiceProcess(
        "store_service",
        ["--data-dir", str(root / "data"), "--sync-mode", "none", *args],
        "tandem-store listening on",
        root / "store.log",
    ).start()


def lookups(client: StoreClient, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        client.lookup(
            namespace="", model_id="m", layout=["kv:plain"], block_size=16,
            block_hashes=[b"\0" * 32], token_count=16,
        )  # fmt: skip
    return time.perf_counter() - start


def big_get(client: StoreClient) -> float:
    start = time.perf_counter()
    client.get(b"big")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=500)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="auth-bench-"))
    token = secrets.token_urlsafe(32)
    auth = root / "auth.json"
    principals = [{"name": "bench", "token_sha256": token_sha256(token), "namespaces": ["*"],
                   "roles": ["store", "admin"]}]  # fmt: skip
    auth.write_text(json.dumps({"principals": principals}))
    (root / "plain").mkdir()
    (root / "auth").mkdir()
    stores = {
        "plain": start(root / "plain"),
        "auth": start(root / "auth", "--auth-file", str(auth)),
    }
    clients = {
        "plain": StoreClient(stores["plain"].address),
        "auth": StoreClient(stores["auth"].address, token=token),
    }
    data = bytes(64 << 20)
    try:
        for c in clients.values():
            c.put(Checkpoint(key=b"big", kind="object",
                             tensors=[Tensor("t", "uint8", (len(data),), data)]))  # fmt: skip
            lookups(c, 50)  # warm
            big_get(c)
        small: dict[str, list[float]] = {"plain": [], "auth": []}
        large: dict[str, list[float]] = {"plain": [], "auth": []}
        for r in range(a.rounds):
            order = ["plain", "auth"] if r % 2 == 0 else ["auth", "plain"]
            for name in order:
                small[name].append(lookups(clients[name], a.calls) / a.calls)
                large[name].append(big_get(clients[name]))
        for label, times in (("Lookup", small), ("64 MiB Get", large)):
            ratios = [x / y for x, y in zip(times["auth"], times["plain"], strict=True)]
            unit = 1e6 if label == "Lookup" else 1e3
            suffix = "us" if label == "Lookup" else "ms"
            print(
                f"{label}: plain median {statistics.median(times['plain']) * unit:.0f} {suffix}, "
                f"with auth {statistics.median(times['auth']) * unit:.0f} {suffix}; "
                f"auth/plain median {statistics.median(ratios):.2f}x "
                f"(spread {min(ratios):.2f}-{max(ratios):.2f}, {a.rounds} rounds)"
            )
    finally:
        for c in clients.values():
            c.close()
        for s in stores.values():
            s.stop()


if __name__ == "__main__":
    main()
