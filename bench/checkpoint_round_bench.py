"""A checkpoint round's time on the engine's MLX thread, in-process: the rows' segments cut
from the batch together (checkpoints/segment_capture.py) against the baseline a user of
mlx-lm's API would write, each row extracted from the batch and captured on its own
(`BatchGenerator.extract_cache`, then a capture a row). Both are then staged as host bytes
and queued for the store the engine's way (GenerationCheckpoints.save_round, complete_round).

The staging goes through the pinned-region contract (HostStaging with a landing of kind
"pinned" whose push only hands out the spans' views: no GPU here) and the queue into a
SpillQueue whose sink drops the records, so what is timed is the MLX thread's own work, as
the engine's debug lines on a round's phases count it on a GPU (checkpoint_bench.py
--engine-log-level debug). Rounds alternate (ABAB), the first few warm up.

    python bench/checkpoint_round_bench.py [--layers 28] [--rows 8] [--rounds 24]
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

HEADS, WIDTH, PROMPT, EVERY = 8, 128, 64, 16


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


def batch(layers: int, rows: int) -> list[BatchQuantizedKVCache]:
    planes = mx.zeros((1, HEADS, PROMPT, WIDTH), mx.bfloat16)
    out = []
    for _ in range(layers):
        caches = []
        for _ in range(rows):
            cache = cache_lib.KVCache()
            cache.update_and_fetch(planes, planes)
            caches.append(cache)
        out.append(BatchQuantizedKVCache.merge(caches))
    return out


def jobs_for(rows: int, layers: int) -> list[Job]:
    jobs = []
    for uid in range(rows):
        request = GenerationRequest(
            f"r{uid}",
            list(range(PROMPT - 1)),
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
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-round-") as tmp:
        store = CheckpointStore(StoreConfig(data_dir=Path(tmp) / "store"))
        server, port, _ = create_server(store, "127.0.0.1:0")
        server.start()
        try:
            with StoreClient(f"127.0.0.1:{port}") as client, SharedRegion(1 << 30) as region:
                client.attach_region(region)
                ways: dict[str, tuple[GenerationCheckpoints, list[Job], list[Any]]] = {}
                spills = []
                for way in ("row by row", "together"):
                    counters = CheckpointCounters()
                    spill = SpillQueue(DroppingSink(), 1 << 36, counters)  # type: ignore[arg-type]
                    staging = HostStaging(ViewsOnlyPush(), client)
                    gens = GenerationCheckpoints("m", counters, None, spill, staging)
                    ways[way] = (
                        gens,
                        jobs_for(args.rows, args.layers),
                        batch(args.layers, args.rows),
                    )
                    spills.append(spill)
                times: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
                for r in range(args.rounds + 4):
                    for way, (gens, jobs, layers) in ways.items():
                        for _ in range(EVERY):  # the decode steps between two rounds
                            new = mx.zeros((args.rows, HEADS, 1, WIDTH), mx.bfloat16)
                            written = [layer.update_and_fetch(new, new) for layer in layers]
                            mx.eval(written)
                        for job in jobs:
                            job.tokens.extend([5] * EVERY)
                        phases = round_of(way, gens, jobs, layers)
                        if r >= 4:  # warm-up rounds left out
                            times[way].append(phases)
                for spill in spills:
                    spill.wait_sent()
        finally:
            server.stop(None)
    totals = {way: [sum(p.values()) for p in rounds] for way, rounds in times.items()}
    print(
        f"a checkpoint round of {args.rows} rows x {args.layers} layers on {mx.default_device()}:"
    )
    for way, rounds in times.items():
        shown = ", ".join(
            f"{name} {statistics.median(p[name] for p in rounds) * 1e3:.2f}" for name in rounds[0]
        )
        print(f"  {way}: {statistics.median(totals[way]) * 1e3:.2f} ms ({shown} ms, medians)")
    ratios = [a / b for a, b in zip(totals["row by row"], totals["together"], strict=True)]
    print(
        f"  row by row / together, median of paired ratios {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
