"""A checkpoint round's time on the engine's MLX thread, in-process: the rows' segments cut
from the batch together (checkpoints/segment_capture.py) against the baseline a user of
mlx-lm's API would write, each row extracted from the batch and captured on its own
(`BatchGenerator.extract_cache`, then a capture a row). Both are then staged as host bytes
and queued for the store the engine's way (GenerationCheckpoints.save_round, complete_round).

The staging goes through the pinned-region contract (HostStaging with a landing of kind
"pinned" whose push only hands out the spans' views: no GPU here) and the queue into a
SpillQueue whose sink drops the records, so what is timed is the MLX thread's own work, as
the engine's debug lines on a round's phases count it on a GPU (checkpoint_bench.py
--engine-log-level debug). With `--sink store` the spill queue sends each round to a real
store (in this process, through the region) and the spill thread's CPU time a round is
reported too: the engine's other thread that holds the GIL for checkpoints. `--prompt`
sets the rows' prompt length (their token lists travel with every record). Rounds alternate
(ABAB), the first few warm up.

    python bench/checkpoint_round_bench.py [--layers 28] [--rows 8] [--rounds 24]
        [--sink store] [--prompt 8192 --heads 1 --width 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.device_landing import PUSH_ALIGN, Landing
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.segment_capture import capture_together
from engine_service.checkpoints.spill import SpillQueue
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.jobs import Job, ReadySnapshot
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions
from store_service.config import StoreConfig
from store_service.server import create_server
from store_service.store import CheckpointStore
from tandem_client import StoreClient
from tandem_client.regions import SharedRegion

EVERY = 16  # decode steps between two rounds


class ViewsOnlyPush(Landing):
    """PinnedLanding's push contract without a GPU: each array's place in its span, no copy."""

    kind = "pinned"

    def push_many(
        self, pushes: list[tuple[list[mx.array], memoryview]]
    ) -> tuple[list[list[memoryview] | None], list[mx.array]]:
        out: list[list[memoryview] | None] = []
        done: list[mx.array] = []
        for arrays, span in pushes:
            views, at = [], 0
            for array in arrays:
                views.append(span[at : at + array.nbytes])
                at += -(-array.nbytes // PUSH_ALIGN) * PUSH_ALIGN
            out.append(views)
            done.append(mx.array([1], dtype=mx.uint8))
        return out, done


class TimedSink:
    """The store client as the spill queue's sink, counting the spill thread's CPU time."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.cpu_s = 0.0

    def put_many(self, items: Any) -> Any:
        start = time.thread_time()
        try:
            return self.client.put_many(items)
        finally:
            self.cpu_s += time.thread_time() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class DroppingSink:
    """A store that takes every record and keeps none (the queue's sender stays cheap)."""

    def put(self, *args: Any, **kwargs: Any) -> None:
        return None

    def put_many(self, items: Any) -> None:
        return None

    def delete(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def delete_many(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def flush(self) -> bool:
        return True


def batch(
    layers: int, rows: int, prompt: int, heads: int, width: int
) -> list[BatchQuantizedKVCache]:
    planes = mx.zeros((1, heads, prompt, width), mx.bfloat16)
    out = []
    for _ in range(layers):
        caches = []
        for _ in range(rows):
            cache = cache_lib.KVCache()
            cache.update_and_fetch(planes, planes)
            caches.append(cache)
        out.append(BatchQuantizedKVCache.merge(caches))
    return out


def jobs_for(rows: int, layers: int, prompt: int) -> list[Job]:
    jobs = []
    for uid in range(rows):
        request = GenerationRequest(
            f"r{uid}",
            list(range(prompt - 1)),
            1 << 16,
            SamplingOptions(),
            "",
            layout=["kv:plain"] * layers,
        )
        job = Job(request, lambda events: None, uid=uid, tokens=[7])
        job.checkpoint_key = bytes([uid]) * 32
        jobs.append(job)
    return jobs


def round_of(
    way: str, gens: GenerationCheckpoints, jobs: list[Job], layers: list[Any]
) -> dict[str, float]:
    """One round: capture, then (as a step later) stage, then (a step later) queue."""
    started = time.perf_counter()
    if way == "together":
        snapshots = capture_together(gens, jobs, list(range(len(jobs))), layers)
    else:
        snapshots = {
            job.uid: gens.capture(job, [layer.extract(job.uid) for layer in layers]) for job in jobs
        }
    captured = time.perf_counter()
    mx.synchronize()  # the copies run beside the next step on a GPU: not the MLX thread's time
    ready = [ReadySnapshot(job, snapshots[job.uid], pending=5) for job in jobs]
    staging = time.perf_counter()
    gens.save_round(ready)
    staged = time.perf_counter()
    gens.complete_round()
    queued = time.perf_counter()
    return {
        "capture": captured - started,
        "stage": staged - staging,
        "queue": queued - staged,
        "bytes": float(sum(s.captured.nbytes for s in snapshots.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=64, help="positions each row holds at first")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument(
        "--sink", choices=("drop", "store"), default="drop", help="store: the spill thread sends"
    )
    args = parser.parse_args()
    shape = (args.prompt, args.heads, args.width)
    with tempfile.TemporaryDirectory(prefix="tandem-round-") as tmp:
        store = CheckpointStore(StoreConfig(data_dir=Path(tmp) / "store", capacity_bytes=16 << 30))
        server, port, _ = create_server(store, "127.0.0.1:0")
        server.start()
        try:
            with StoreClient(f"127.0.0.1:{port}") as client, SharedRegion(1 << 30) as region:
                client.attach_region(region)
                ways: dict[str, tuple[GenerationCheckpoints, list[Job], list[Any]]] = {}
                spills: dict[str, SpillQueue] = {}
                sinks: dict[str, TimedSink] = {}
                for way in ("row by row", "together"):
                    counters = CheckpointCounters()
                    if args.sink == "store":
                        sink: Any = sinks.setdefault(way, TimedSink(client))
                    else:
                        sink = DroppingSink()
                    spill = spills[way] = SpillQueue(sink, 1 << 36, counters)
                    staging = HostStaging(ViewsOnlyPush(), client)
                    gens = GenerationCheckpoints("m", counters, None, spill, staging)
                    ways[way] = (
                        gens,
                        jobs_for(args.rows, args.layers, args.prompt),
                        batch(args.layers, args.rows, *shape),
                    )
                times: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
                for r in range(args.rounds + 4):
                    for way, (gens, jobs, layers) in ways.items():
                        for _ in range(EVERY):  # the decode steps between two rounds
                            new = mx.zeros((args.rows, args.heads, 1, args.width), mx.bfloat16)
                            written = [layer.update_and_fetch(new, new) for layer in layers]
                            mx.eval(written)
                        for job in jobs:
                            job.tokens.extend([5] * EVERY)
                        sent = sinks[way].cpu_s if way in sinks else 0.0
                        phases = round_of(way, gens, jobs, layers)
                        if way in sinks:  # round_of queued the round: sent, then counted
                            spills[way].wait_sent()
                            phases["spill thread"] = sinks[way].cpu_s - sent
                        if r >= 4:  # warm-up rounds left out
                            times[way].append(phases)
                for spill in spills.values():
                    spill.wait_sent()
        finally:
            server.stop(None)
    mlx_thread = ("capture", "stage", "queue")
    totals = {
        way: [sum(p[name] for name in mlx_thread) for p in rounds] for way, rounds in times.items()
    }
    print(
        f"a checkpoint round of {args.rows} rows x {args.layers} layers ({args.heads} heads of "
        f"{args.width}, prompts of {args.prompt - 1} tokens) on {mx.default_device()}:"
    )
    for way, rounds in times.items():
        timed = [name for name in rounds[0] if name != "bytes"]
        shown = ", ".join(
            f"{name} {statistics.median(p[name] for p in rounds) * 1e3:.2f}" for name in timed
        )
        spill = [p["spill thread"] for p in rounds if "spill thread" in p]
        print(
            f"  {way}: {statistics.median(totals[way]) * 1e3:.2f} ms of the MLX thread ({shown} "
            f"ms, medians); means a round, chain restarts included: MLX thread "
            f"{statistics.mean(totals[way]) * 1e3:.2f} ms"
            + (f", spill thread {statistics.mean(spill) * 1e3:.2f} ms" if spill else "")
            + f", {statistics.mean(p['bytes'] for p in rounds) / 2**20:.2f} MiB captured"
        )
    ratios = [a / b for a, b in zip(totals["row by row"], totals["together"], strict=True)]
    print(
        f"  row by row / together, median of paired ratios {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
