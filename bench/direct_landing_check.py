"""Checks and times the landing of direct Gets (engine_service/checkpoints/direct_landing.py)
on this machine's backend: records put into a real store, read directly, landed as MLX
arrays by the engine's landing, compared byte for byte with the host's copy of the same
chunks; then an 8k-token-shaped restore timed end to end, direct against the store's copy
into a region (ABAB). With --pool, a third route in the same rounds: direct with the device
pool keeping freed memory (bench/device_pool.py), after one untimed landing that
fills it; every landing starts from `mx.clear_cache()`, as a hit after a prefill does.

    python bench/direct_landing_check.py [--mib 896] [--rounds 5] [--pool]
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

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
# isort: on

from bench.device_pool import DevicePool, default_keep_bytes  # noqa: E402
from engine_service.checkpoints import direct_landing, direct_planes  # noqa: E402
from engine_service.checkpoints.device_landing import (  # noqa: E402
    as_they_arrive,
    host_array,
    host_plane,
    landing_for,  # noqa: E402
)
from engine_service.checkpoints.direct_landing import joined  # noqa: E402
from tandem_client import Checkpoint, StoreClient, Tensor  # noqa: E402
from tandem_client.direct import DirectHold  # noqa: E402
from tandem_client.regions import SharedRegion  # noqa: E402
from tests.servers import free_port, start_store_on  # noqa: E402


def record(key: bytes, layers: int, per_tensor: int, seed: int) -> Checkpoint:
    rng = np.random.default_rng(seed)
    tensors = []
    for i in range(layers):
        for kind in ("k", "v"):
            words = rng.integers(0, 1 << 16, per_tensor // 2, dtype=np.uint16)
            tensors.append(Tensor(f"l{i}.{kind}", "bfloat16", (per_tensor // 2,), words.tobytes()))
    tensors.append(Tensor("odd", "uint8", (1001,), rng.bytes(1001)))  # not 16-byte sized
    return Checkpoint(key=key, kind="prefix", tensors=tensors)


PHASES = ("get", "launch", "verdict", "settle", "release")


def check_planes(client: StoreClient, landing) -> None:  # noqa: ANN001
    """A KV-shaped record read directly and landed as planes with room (direct_planes.py):
    every plane equal to the host's (host_plane) of the same bytes."""
    rng = np.random.default_rng(3)
    shape = (1, 8, 1000, 128)  # a head's 1000 positions straddle the 1 MiB chunks
    tensors = [
        Tensor(f"l{i}.{kind}", "bfloat16", shape, rng.integers(0, 1 << 16, shape, np.uint16))
        for i in range(3)
        for kind in ("k", "v")
    ]
    kv = Checkpoint(key=b"planes", kind="prefix", tensors=tensors)
    client.put(kv)
    read = client.get_routed(b"planes", size_hint=kv.payload_bytes, progressive=True)
    assert isinstance(read.hold, DirectHold), read.route
    keep, columns = 900, 1156
    planes = landing.direct_planes(read.checkpoint.tensors, read.hold, keep, columns)
    read.hold.arrival.wait(read.hold.arrival.total, 60.0)
    landing.settle()
    for tensor in read.checkpoint.tensors:
        want = host_plane(joined(tensor, read.hold.segments(tensor)), keep, columns)
        same = mx.array_equal(planes[id(tensor)].view(mx.uint16), want.view(mx.uint16))
        assert bool(same), tensor.name
    assert read.hold.release() is not False
    print(
        f"  {len(planes)} KV tensors landed directly as planes with room, every byte equal"
        f" (the engine gathers planes: {landing.gathers_planes})"
    )


def land(
    client: StoreClient, landing, key: bytes, size: int
) -> tuple[list[mx.array], str, list[float]]:  # noqa: ANN001, E501
    """Lands a record; returns its arrays, its route and the phases' times (PHASES, then
    the whole)."""
    mx.clear_cache()  # as after a prefill (mlx-lm empties MLX's cache after each chunk)
    mx.synchronize()
    marks = [time.perf_counter()]
    read = client.get_routed(key, size_hint=size, progressive=True)
    marks.append(time.perf_counter())
    to_array = as_they_arrive(landing, read.checkpoint, read.hold, 60.0)
    arrays = [to_array(t) for t in read.checkpoint.tensors]
    marks.append(time.perf_counter())
    if isinstance(read.hold, DirectHold):
        read.hold.arrival.wait(read.hold.arrival.total, 60.0)
    marks.append(time.perf_counter())
    landing.settle()
    mx.eval(arrays)
    marks.append(time.perf_counter())
    if read.hold is not None and read.hold.release() is False:
        raise RuntimeError("the lease lapsed")
    marks.append(time.perf_counter())
    phases = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return arrays, read.route, [*phases, marks[-1] - marks[0]]


def allocation_host_times(cuda: DevicePool | None, nbytes: int, rounds: int) -> None:
    """The host time of starting a kernel whose output (nbytes) is a fresh allocation after
    `mx.clear_cache()` and a sync, with CUDA's default pool and with it keeping freed memory
    (ABAB): what a gather's launches and a batch merge pay for new memory."""
    times: dict[str, list[float]] = {"default": [], "kept": []}
    for r in range(rounds + 1):
        for name in times:
            if cuda is not None and name == "kept":
                cuda.keep_freed(default_keep_bytes())
                mx.eval(mx.ones((nbytes // 4,), mx.float32) + 1)  # fills the pool once
            mx.clear_cache()
            mx.synchronize()
            start = time.perf_counter()
            out = mx.ones((nbytes // 4,), mx.float32) + 1  # a real output (zeros broadcast)
            mx.async_eval(out)
            launched = time.perf_counter()
            mx.eval(out)
            if r:
                times[name].append((launched - start) * 1e3)
            del out
            if cuda is not None and name == "kept":
                cuda.keep_freed(0)
                cuda.trim()
    print(
        f"  a fresh {nbytes >> 20} MiB output's host time: "
        + ", ".join(f"pool {n} {statistics.median(v):.2f} ms" for n, v in times.items())
    )


def time_planes(  # noqa: PLR0913
    client: StoreClient,
    landing,  # noqa: ANN001
    mib: int,
    counts: list[int],
    rounds: int,
    layers: int,
) -> None:
    """A KV-shaped record of about mib MiB (layers of [1, 8, T, 128] keys and values) landed
    as planes with room at each count of planes a launch (0: all in one, the engine's),
    interleaved: the launches' host time and the landing's whole time, medians."""
    positions = (mib << 20) // (2 * layers * 8 * 256)
    shape = (1, 8, positions, 128)
    kv = Checkpoint(
        key=b"planes-timed",
        kind="prefix",
        tensors=[
            Tensor(f"l{i}.{kind}", "bfloat16", shape, np.zeros(shape, np.uint16))
            for i in range(layers)
            for kind in ("k", "v")
        ],
    )
    client.put(kv)
    keep, columns = positions - 16, positions - 16 + 256
    # Each count twice: MLX's buffer cache emptied first (every plane a fresh allocation, as
    # after the engine's idle release), and kept (the planes of the count's last round reused:
    # no allocation while the gathers run).
    runs = [(c, cleared) for c in counts for cleared in (True, False)]
    times: dict[tuple[int, bool], list[tuple[float, float]]] = {run: [] for run in runs}
    for r in range(rounds + 1):
        for count, cleared in runs:
            direct_planes.PLANES_PER_LAUNCH = count
            if cleared:
                mx.clear_cache()
            mx.synchronize()
            read = client.get_routed(b"planes-timed", size_hint=kv.payload_bytes, progressive=True)
            assert isinstance(read.hold, DirectHold), read.route
            start = time.perf_counter()
            planes = landing.direct_planes(read.checkpoint.tensors, read.hold, keep, columns)
            launched = time.perf_counter()
            read.hold.arrival.wait(read.hold.arrival.total, 60.0)
            landing.settle()
            mx.eval(list(planes.values()))
            done = time.perf_counter()
            read.hold.release()
            del planes
            if r:
                times[(count, cleared)].append((launched - start, done - start))
    direct_planes.PLANES_PER_LAUNCH = 0
    for (count, cleared), pairs in times.items():
        launch = statistics.median(p[0] for p in pairs) * 1e3
        whole = statistics.median(p[1] for p in pairs) * 1e3
        cache = "MLX's cache emptied" if cleared else "MLX's cache kept"
        width = count or "all"
        print(
            f"  planes, {width} a launch, {cache} ({mib} MiB, {layers} layers): launches "
            f"{launch:.1f} ms, all {whole:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=896)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--gather-blocks",
        default="",
        help="also the direct landing with each of these GATHER_BLOCKS (e.g. 256,512,4096)",
    )
    parser.add_argument("--pool", action="store_true", help="also direct with the pool kept")
    parser.add_argument(
        "--planes-per-launch",
        default="",
        help="also the planes landing at each of these counts of planes a launch (e.g. 8,64;"
        " 0: all in one, the engine's)",
    )
    parser.add_argument(
        "--layers", type=int, default=28, help="the planes landing's layers (28: Qwen3-0.6B's)"
    )
    parser.add_argument(
        "--groups",
        default="",
        help="also the direct landing's phases with each of these GROUPS (e.g. 1,8,32)",
    )
    args = parser.parse_args()
    cuda = DevicePool.load() if args.pool and mx.cuda.is_available() else None
    with tempfile.TemporaryDirectory(prefix="tandem-direct-") as tmp:
        port = free_port()
        store = start_store_on(
            Path(tmp) / "store", port, "--sync-mode", "none", "--capacity-bytes", str(32 << 30)
        )
        try:
            with SharedRegion(max(256 << 20, (args.mib + 64) << 20)) as region:
                direct = StoreClient(f"127.0.0.1:{port}", timeout=600)
                direct.attach_region(region, direct=True)
                landing = landing_for(region, 2 * args.layers)
                print(f"{mx.default_device()}: landing {landing.kind}")
                if args.pool:
                    for nbytes in (1 << 30, args.mib << 20):
                        allocation_host_times(cuda, nbytes, args.rounds)
                # 1. Bytes: every tensor equal to the host's copy of its chunks.
                small = record(b"check", 4, 3 << 20, seed=1)
                direct.put(small)
                arrays, route, _ = land(direct, landing, b"check", small.payload_bytes)
                assert route == "direct", route
                for stored, array in zip(small.tensors, arrays, strict=True):
                    want = host_array(joined(stored, [memoryview(stored.data)]))
                    same = mx.array_equal(array.view(mx.uint8), want.view(mx.uint8))
                    assert bool(same), stored.name
                print(f"  {len(arrays)} tensors landed directly, every byte equal")
                check_planes(direct, landing)
                # 2. Time: an 8k-token-shaped record, direct vs the region, ABAB.
                per_tensor = (args.mib << 20) // 56
                per_tensor -= per_tensor % 16
                big = record(b"big", 28, per_tensor, seed=2)
                direct.put(big)
                direct.flush()
                time.sleep(0.5)  # the engine registers the file's new pages meanwhile
                with (
                    StoreClient(f"127.0.0.1:{port}", timeout=600) as copied,
                    SharedRegion(region.size) as copied_region,
                ):
                    copied.attach_region(copied_region, direct=False)
                    routes = {
                        "direct": (direct, landing),
                        "region": (copied, landing_for(copied_region, 2 * args.layers)),
                    }
                    if args.pool:
                        routes["direct, pool kept"] = (direct, landing)
                    times: dict[str, list[float]] = {name: [] for name in routes}
                    split: dict[str, list[list[float]]] = {name: [] for name in routes}
                    for r in range(args.rounds + 1):
                        for name, (client, lands) in routes.items():
                            kept = name.endswith("kept") and cuda is not None
                            if kept:
                                cuda.keep_freed(default_keep_bytes())
                                land(client, lands, b"big", big.payload_bytes)  # fills it
                            _, route, phases = land(client, lands, b"big", big.payload_bytes)
                            if kept:
                                cuda.keep_freed(0)
                                cuda.trim()
                            assert name.startswith(route), route
                            if r:
                                times[name].append(phases[-1])
                                split[name].append(phases[:-1])
                    routes["region"][1].close()
                gb = big.payload_bytes / 1e9
                for name, values in times.items():
                    best = statistics.median(values)
                    print(f"  {name}: {best * 1e3:.1f} ms, {gb / best:.1f} GB/s ({gb:.2f} GB)")
                    medians = [statistics.median(p) * 1e3 for p in zip(*split[name], strict=True)]
                    print(
                        "    "
                        + ", ".join(f"{n} {m:.1f}" for n, m in zip(PHASES, medians, strict=True))
                    )
                for name, base in (("direct", "region"), ("direct, pool kept", "direct")):
                    if name not in times:
                        continue
                    paired = [a / b for a, b in zip(times[name], times[base], strict=True)]
                    print(
                        f"  {name} / {base} median {statistics.median(paired):.2f}"
                        f" ({min(paired):.2f}-{max(paired):.2f})"
                    )
                for blocks in [int(b) for b in args.gather_blocks.split(",") if b]:
                    direct_landing.GATHER_BLOCKS = blocks
                    took = [
                        land(direct, landing, b"big", big.payload_bytes)[2][-1]
                        for _ in range(args.rounds + 1)
                    ][1:]
                    best = statistics.median(took)
                    print(
                        f"  direct, GATHER_BLOCKS {blocks}: {best * 1e3:.1f} ms,"
                        f" {gb / best:.1f} GB/s"
                    )
                counts = [int(c) for c in args.planes_per_launch.split(",") if c]
                if counts:
                    time_planes(direct, landing, args.mib, counts, args.rounds, args.layers)
                for groups in [int(g) for g in args.groups.split(",") if g]:
                    direct_landing.GROUPS = groups
                    direct_landing.MIN_GROUP_BYTES = 1 << 20
                    runs = [land(direct, landing, b"big", big.payload_bytes)[2] for _ in range(4)]
                    medians = [statistics.median(p) * 1e3 for p in zip(*runs[1:], strict=True)]
                    print(
                        f"  direct, GROUPS {groups}: "
                        + ", ".join(f"{n} {m:.1f}" for n, m in zip(PHASES, medians, strict=False))
                        + f", all {medians[-1]:.1f} ms"
                    )
                landing.close()
                direct.close()
        finally:
            store.stop()


if __name__ == "__main__":
    main()
