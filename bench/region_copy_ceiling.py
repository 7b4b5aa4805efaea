"""What bounds the store's checked copy into a region (issue 14): this machine's ceilings for
the copy's parts, and the real store's region Get by copy threads, fresh and warm.

    python bench/region_copy_ceiling.py [--mib 1024] [--threads 1,4,8,16,32]

In-process ceilings, 1 MiB chunks on T threads (a store chunk's size): memcpy alone, CRC-32
alone, CRC then copy (what the store does), and a copy out of a file mapping touched for the
first time (page faults, as for a record the store has just written) with and without
MADV_POPULATE_READ first. Then the store process: the first region Get of an object just put
(its LMDB pages never mapped by the store yet), of a prefix a second after its Put (the
store maps a prefix's pages after the commit: map_warmer.py), and later Gets.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import numpy as np  # noqa: E402

from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tandem_client.regions import DEFAULT_OFFSET, SharedRegion  # noqa: E402
from tandem_wire.checksum import crc32  # noqa: E402
from tests.servers import start_store  # noqa: E402

CHUNK = 1 << 20
MADV_POPULATE_READ = 22  # Linux 5.14+
_libc = ctypes.CDLL(None, use_errno=True)


def parallel(threads: int, n_chunks: int, work: Callable[[int], None]) -> float:
    def run(part: range) -> None:
        for i in part:
            work(i)

    parts = [range(w, n_chunks, threads) for w in range(threads)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, parts))
    return time.perf_counter() - start


def ceilings(nbytes: int, thread_counts: list[int]) -> None:
    n = nbytes // CHUNK
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = SharedRegion(nbytes + DEFAULT_OFFSET)
    out = np.frombuffer(dst.buf, np.uint8)[DEFAULT_OFFSET : DEFAULT_OFFSET + nbytes]
    out[:] = 0  # faulted in, as a pinned region is

    def copy(i: int) -> None:
        np.copyto(out[i * CHUNK : (i + 1) * CHUNK], src[i * CHUNK : (i + 1) * CHUNK])

    def crc(i: int) -> None:
        crc32(src[i * CHUNK : (i + 1) * CHUNK], 0)

    def crc_copy(i: int) -> None:
        crc(i)
        copy(i)

    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.write(fd, src.tobytes())

    def fresh(populate: bool) -> Callable[[int], None]:
        mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        view = np.frombuffer(mapped, np.uint8)
        if populate:
            address = ctypes.c_void_p(view.ctypes.data)
            if _libc.madvise(address, ctypes.c_size_t(nbytes), MADV_POPULATE_READ) != 0:
                print("  madvise(MADV_POPULATE_READ) failed:", os.strerror(ctypes.get_errno()))

        def work(i: int) -> None:
            part = view[i * CHUNK : (i + 1) * CHUNK]
            crc32(part, 0)
            np.copyto(out[i * CHUNK : (i + 1) * CHUNK], part)

        return work

    print(f"in-process ceilings, {nbytes >> 20} MiB in 1 MiB chunks (GB/s, median of 3):")
    for t in thread_counts:
        row = {}
        for name, fn in (("memcpy", copy), ("crc", crc), ("crc+copy", crc_copy)):
            row[name] = statistics.median(nbytes / parallel(t, n, fn) / 1e9 for _ in range(3))
        populate_start = time.perf_counter()
        work = fresh(True)
        populated = nbytes / (parallel(t, n, work) + time.perf_counter() - populate_start) / 1e9
        faulting = nbytes / parallel(t, n, fresh(False)) / 1e9
        print(
            f"  {t:>3} threads: memcpy {row['memcpy']:6.2f}  crc {row['crc']:6.2f}  crc+copy "
            f"{row['crc+copy']:6.2f}  fresh mapping {faulting:6.2f}  with populate {populated:6.2f}"
        )
    os.close(fd)
    os.unlink(path)
    dst.close()


def store_gets(nbytes: int, thread_counts: list[int]) -> None:
    print(f"store region Get of a {nbytes >> 20} MiB record (8 tensors), GB/s:")
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    per = nbytes // 8
    for t in thread_counts:
        root = Path(tempfile.mkdtemp(prefix="region-ceiling-"))
        store = start_store(
            root / "data",
            *("--sync-mode", "none", "--capacity-bytes", str(4 * nbytes)),
            *("--region-copy-threads", str(t)),
        )
        region = SharedRegion(nbytes + DEFAULT_OFFSET)
        np.frombuffer(region.buf, np.uint8)[DEFAULT_OFFSET:] = 0  # faulted in
        try:
            with StoreClient(store.address, timeout=600) as client:
                client.register_region(region, ttl_s=600)
                figures: dict[str, list[float]] = {"object": [], "prefix": [], "warm": []}
                for k in range(4):
                    tensors = [
                        Tensor(f"t{i}", "uint8", (per,), data[i * per : (i + 1) * per])
                        for i in range(8)
                    ]
                    key, kind = f"r{k}".encode(), ("object", "prefix")[k % 2]
                    client.put(Checkpoint(key=key, kind=kind, tensors=tensors))
                    if kind == "prefix":
                        time.sleep(1.0)  # the next turn: the store maps its pages meanwhile
                    for r in range(3):
                        start = time.perf_counter()
                        got = client.get_into(key, region)
                        seconds = time.perf_counter() - start
                        del got
                        figures[kind if r == 0 else "warm"].append(nbytes / seconds / 1e9)
                client.unregister_region(region)
            med = {k: statistics.median(v) for k, v in figures.items()}
            print(
                f"  {t:>3} copy threads: first Get right after an object's Put {med['object']:6.2f}"
                f"  a second after a prefix's {med['prefix']:6.2f}  warm {med['warm']:6.2f}"
            )
        finally:
            region.close()
            store.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--threads", default="1,4,8,16,32")
    a = p.parse_args()
    counts = [int(x) for x in a.threads.split(",")]
    print(f"{os.cpu_count()} cores")
    ceilings(a.mib << 20, counts)
    store_gets(a.mib << 20, counts)


if __name__ == "__main__":
    main()
