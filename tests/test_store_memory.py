"""Many concurrent large Puts hold a bounded amount of the store's memory, and give it back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tandem_client import Checkpoint, StoreClient, Tensor
from tests.servers import start_store

MiB = 1 << 20
# What 16 concurrent 64 MiB Puts may hold at their peak: the writer's shared in-flight budget
# (96 MiB), each Put's group being assembled (8 MiB) and gRPC's bounded per-stream windows
# (4 MiB), with room to spare; before these bounds the same load peaked near 1 GiB.
PEAK_BOUND = 768 * MiB
# After the burst, the heap goes back to the store's baseline (malloc_trim while idle).
SETTLED_BOUND = 96 * MiB


def _anon_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc status")


def test_sixteen_concurrent_64_mib_puts_stay_bounded_and_give_memory_back(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "s", "--capacity-bytes", str(4 << 30), "--sync-mode", "none")
    try:
        baseline = _anon_rss(store.pid)
        peak, stop = [baseline], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _anon_rss(store.pid))
                time.sleep(0.005)

        data = bytes(range(256)) * (64 * MiB // 256)
        errors: list[BaseException] = []

        def put(i: int) -> None:
            try:
                with StoreClient(store.address, timeout=300) as client:
                    tensor = Tensor("t", "uint8", (len(data),), data)
                    client.put(Checkpoint(key=f"big{i}".encode(), tensors=[tensor]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        writers = [threading.Thread(target=put, args=(i,)) for i in range(16)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        assert not errors, errors
        deadline = time.monotonic() + 10
        while _anon_rss(store.pid) > baseline + SETTLED_BOUND and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        watcher.join()
        settled = _anon_rss(store.pid)
        assert peak[0] < PEAK_BOUND, f"peak {peak[0] // MiB} MiB"
        assert settled < baseline + SETTLED_BOUND, f"{settled // MiB} MiB after"
        with StoreClient(store.address) as client:
            assert client.stats().records == 16
            got = client.get(b"big7")
            assert bytes(got.tensors[0].data[:512]) == data[:512]
    finally:
        store.stop()
