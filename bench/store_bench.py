"""Store throughput: our gRPC path beside raw py-lmdb, in one run.

Puts and gets 1, 64 and 256 MiB checkpoints through a real store process over loopback
(one fsync per checkpoint in sync mode `commit`, none in `none`), and the same bytes through
py-lmdb in-process (1 MiB values, 8 per write transaction, then the same sync; reads into a
preallocated buffer). Prints MB/s of both, the ratio, and a sweep of the wire chunk size.
Medians of --repeat runs.

    python bench/store_bench.py [--sizes 1,64,256] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tests.servers import start_store  # noqa: E402

MiB = 1 << 20


def _median_rate(nbytes: int, repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e6


def _checkpoint(key: bytes, nbytes: int) -> Checkpoint:
    # A KV-cache-like split: two bf16 planes and a small int8 one.
    third = nbytes // 3 // 2 * 2
    parts = [third, third, nbytes - 2 * third]
    names = ["keys", "values", "extra"]
    dtypes = ["bfloat16", "bfloat16", "int8"]
    tensors = []
    for name, dtype, size in zip(names, dtypes, parts, strict=True):
        width = 2 if dtype == "bfloat16" else 1
        tensors.append(Tensor(name, dtype, (size // width,), os.urandom(size)))
    return Checkpoint(key=key, model_id="bench@0", layout=["kv:plain"], tensors=tensors)


def raw_lmdb(path: Path, ckpt: Checkpoint, repeat: int, sync: bool) -> tuple[float, float]:
    """The baseline: py-lmdb in-process, same bytes, 1 MiB values, one sync per put
    (none when sync is False); reads go into a preallocated buffer (buffers=True)."""
    env = lmdb.open(str(path), map_size=4 << 30, sync=False, metasync=False, readahead=False)
    data = b"".join(bytes(t.data) for t in ckpt.tensors)
    view = memoryview(data)
    n = len(data)

    def put() -> None:
        # Groups of 8 values per write transaction (as the store does): one transaction for
        # a whole 256 MiB checkpoint measured ~6x slower here, an unfair baseline.
        for group in range(0, n, 8 * MiB):
            with env.begin(write=True) as txn:
                for start in range(group, min(group + 8 * MiB, n), MiB):
                    txn.put((start // MiB).to_bytes(4, "big"), view[start : start + MiB])
        if sync:
            env.sync(True)

    out = bytearray(n)

    def get() -> None:
        with env.begin(buffers=True) as txn:
            for i, start in enumerate(range(0, n, MiB)):
                buf = txn.get(i.to_bytes(4, "big"))
                out[start : start + len(buf)] = buf

    rates = _median_rate(n, repeat, put), _median_rate(n, repeat, get)
    assert bytes(out) == data
    env.close()
    return rates


def ours(
    client: StoreClient, ckpt: Checkpoint, repeat: int, chunk_bytes: int
) -> tuple[float, float]:
    n = sum(t.nbytes for t in ckpt.tensors)
    put = _median_rate(n, repeat, lambda: client.put(ckpt, chunk_bytes=chunk_bytes))
    client.flush()
    time.sleep(0.5)  # let the kernel finish writing back before reads are timed
    get = _median_rate(n, repeat, lambda: client.get(ckpt.key, max_chunk_bytes=chunk_bytes))
    got = client.get(ckpt.key)
    assert bytes(got.tensors[0].data) == bytes(ckpt.tensors[0].data)
    return put, get


def run_mode(tmp: Path, mode: str, sizes: list[int], args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    proc = start_store(tmp / "store", "--sync-mode", mode, "--capacity-bytes", str(4 << 30))
    try:
        client = StoreClient(proc.address, timeout=600)
        rows = []
        print(
            f"\nsync mode {mode!r} (baseline: py-lmdb {'with' if mode == 'commit' else 'without'}"
            " one sync per put)"
        )
        print(
            f"{'size':>8} {'lmdb put':>10} {'ours put':>10} {'ratio':>6} "
            f"{'lmdb get':>10} {'ours get':>10} {'ratio':>6}   (MB/s, medians)"
        )
        for size in sizes:
            ckpt = _checkpoint(b"bench-%d" % size, size * MiB)
            base_put, base_get = raw_lmdb(
                tmp / f"raw{size}", ckpt, args.repeat, sync=mode == "commit"
            )
            put, get = ours(client, ckpt, args.repeat, MiB)
            client.delete(ckpt.key)
            rows.append(
                {"mib": size, "lmdb_put": base_put, "put": put, "lmdb_get": base_get, "get": get}
            )
            print(
                f"{size:>6}Mi {base_put:>10.0f} {put:>10.0f} {put / base_put:>6.2f} "
                f"{base_get:>10.0f} {get:>10.0f} {get / base_get:>6.2f}"
            )
        out["sizes"] = rows
        if args.sweep:
            print("wire chunk sweep, 64 MiB checkpoint:")
            ckpt = _checkpoint(b"sweep", 64 * MiB)
            sweep = []
            for chunk in (int(c) for c in args.sweep.split(",")):
                put, get = ours(client, ckpt, args.repeat, chunk)
                sweep.append({"chunk_bytes": chunk, "put": put, "get": get})
                print(f"  {chunk >> 10:>5} KiB: put {put:>6.0f} MB/s  get {get:>6.0f} MB/s")
            out["sweep"] = sweep
        client.close()
    finally:
        proc.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,64,256", help="checkpoint sizes in MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--sweep",
        default="65536,262144,1048576,2097152,4194304",
        help="wire chunk sizes for the sweep (at 64 MiB)",
    )
    parser.add_argument(
        "--sync-modes",
        default="commit,none",
        help="store sync modes to run (commit: one fsync per checkpoint)",
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, object] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "python": platform.python_version(),
        "lmdb": lmdb.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "repeat": args.repeat,
    }
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for mode in args.sync_modes.split(","):
            results[mode] = run_mode(Path(tmp) / mode, mode, sizes, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
