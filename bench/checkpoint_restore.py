"""The in-process parts of bench/checkpoint_bench.py: what a restore is made of (raw LMDB,
the streamed Get, numpy, the device; the same-host region paths), the floor under any store
hit (raw mlx-lm from a cache in memory), and a local prefix hit against a host round trip.
Run through checkpoint_bench.py (`--skip` names them restore, floor, local)."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import lmdb
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import engine_service  # noqa: F401  (the fast BLAS must load before mlx)
from engine_service.checkpoints.cache_records import capture, restore, to_host
from engine_service.checkpoints.device_landing import as_they_arrive, landing_for
from tandem_client import StoreClient
from tandem_client.regions import SharedRegion
from tandem_client.store_client import Checkpoint


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids drawn from the vocabulary (ids 0-2 left out: special on most models)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def bench_restore(
    loaded,
    store: StoreClient,
    store_dir: Path,
    tokens: int,  # noqa: ANN001
    repeat: int,
    region_bytes: int,
) -> dict:
    ids = mx.array([random_prompt(tokens, loaded.vocab_size, seed=9)])
    caches = make_prompt_cache(loaded.model)
    loaded.model(ids, cache=caches)
    captured = capture(caches, tokens)
    nbytes = captured.nbytes
    store.purge(include_pinned=True)  # so the raw LMDB read below sees only this record
    store.compact()
    record = Checkpoint(
        key=b"restore-bench",
        model_id="bench",
        layout=captured.layout,
        metadata=captured.meta(),
        tensors=to_host(captured),
    )
    store.put(record)
    store.flush()
    times: dict[str, list[float]] = {
        "lmdb_read": [],
        "store_get": [],
        "deserialize": [],
        "to_device": [],
    }
    env = lmdb.open(str(store_dir), max_dbs=8, readonly=True, lock=False)
    chunks = env.open_db(b"chunks", create=False)
    for _ in range(repeat):
        out = bytearray(nbytes)
        start = time.perf_counter()
        with env.begin(buffers=True, db=chunks) as txn:
            pos = 0
            for _, value in txn.cursor():
                out[pos : pos + len(value)] = value
                pos += len(value)
        times["lmdb_read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        got = store.get(b"restore-bench")
        times["store_get"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with mx.stream(mx.cpu):
            restored = restore(got.metadata, got.tensors, captured.layout)
        times["deserialize"].append(time.perf_counter() - start)
        start = time.perf_counter()
        moved = [mx.array(a) for c in restored for a in c.state if isinstance(a, mx.array)]
        mx.eval(moved)
        times["to_device"].append(time.perf_counter() - start)
    env.close()
    # The engine's same-host path: the store copies (checked) into a region, the landing
    # makes device arrays of it (a GPU pull from the pinned region on MLX-CUDA), ABAB with
    # the plain Get above; every restore is compared with the original on the device.
    times["same_host"], times["region_get"], times["region_land"] = [], [], []
    times["progressive"] = []  # the engine's path: pulls overlap the store's copy
    region = SharedRegion(max(region_bytes, nbytes + (64 << 20)))
    near = StoreClient(store.address, timeout=1800)
    near.attach_region(region, slots=1)
    landing = landing_for(region, 2 * len(caches))
    originals = [a for c in caches for a in c.state if isinstance(a, mx.array)]
    try:
        for i in range(2 * repeat + 2):
            progressive = i % 2 == 1
            start = time.perf_counter()
            got, hold = near.get_held(b"restore-bench", size_hint=nbytes, progressive=progressive)
            assert hold is not None, "the record did not fit the region"
            got_s = time.perf_counter() - start
            to_array = as_they_arrive(landing, got, hold, 60.0)
            restored = restore(got.metadata, got.tensors, captured.layout, to_array)
            landing.settle()
            hold.release()
            arrays = [a for c in restored for a in c.state if isinstance(a, mx.array)]
            mx.eval(arrays)
            if i >= 2 and progressive:  # the first pair is a warm-up
                times["progressive"].append(time.perf_counter() - start)
            elif i >= 2:
                times["same_host"].append(time.perf_counter() - start)
                times["region_get"].append(got_s)
                times["region_land"].append(times["same_host"][-1] - got_s)
            assert all(
                bool(mx.array_equal(a[..., :tokens, :], b[..., :tokens, :]))
                for a, b in zip(arrays, originals, strict=True)
            ), "the same-host restore differs from the cache it came from"
    finally:
        landing.close()
        near.detach_region()
        near.close()
        region.close()
    result = {"bytes": nbytes, "tokens": tokens, "landing": landing.kind}
    print(f"  restoring a {tokens}-token cache ({nbytes / 2**20:.1f} MiB):")
    for name, values in times.items():
        t = statistics.median(values)
        result[f"{name}_s"] = t
        print(f"    {name:<12} {t * 1e3:8.1f} ms  {nbytes / t / 1e9:6.2f} GB/s")
    return result


def bench_floor(loaded, lengths: list[int], repeat: int) -> list[dict]:  # noqa: ANN001
    """The floor under any store hit: mlx-lm's BatchGenerator given the prefix's cache
    already in memory (nothing restored) and the same 16 new tokens, to its first token.
    A cold prefill divided by this is the most a store hit could gain on this machine.
    Beside it, the same BatchGenerator's cold prefill of the whole prompt (the engine's
    cold TTFT against raw mlx-lm's)."""
    import copy

    from mlx_lm.generate import BatchGenerator

    rows = []
    for n in lengths:
        base = random_prompt(n, loaded.vocab_size, seed=n * 100)
        cache = make_prompt_cache(loaded.model)
        for at in range(0, n, 2048):
            loaded.model(mx.array([base[at : at + 2048]]), cache=cache)
            mx.eval([c.state for c in cache])
        times, colds = [], []
        for r in range(repeat + 1):
            bg = BatchGenerator(loaded.model, stop_tokens=set())
            whole = base + random_prompt(16, loaded.vocab_size, seed=r)
            start = time.perf_counter()
            bg.insert([whole], max_tokens=[1])
            while not bg.next()[1]:
                pass
            if r:
                colds.append(time.perf_counter() - start)
            del bg
            copied = [copy.deepcopy(c) for c in cache]
            mx.eval([c.state for c in copied])
            bg = BatchGenerator(loaded.model, stop_tokens=set())
            start = time.perf_counter()
            bg.insert(
                [random_prompt(16, loaded.vocab_size, seed=r)], max_tokens=[1], caches=[copied]
            )
            while not bg.next()[1]:
                pass
            if r:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        rows.append(
            {
                "prompt_tokens": n + 16,
                "floor_ttft_s": statistics.median(times),
                "mlx_lm_cold_ttft_s": statistics.median(colds),
            }
        )
        row = rows[-1]
        print(
            f"  {n + 16:>6} tokens: from the cache in memory {row['floor_ttft_s'] * 1e3:8.1f} ms"
            f"   cold prefill {row['mlx_lm_cold_ttft_s'] * 1e3:8.1f} ms"
        )
    return rows


def bench_local_hit(loaded, tokens: int, repeat: int) -> dict:  # noqa: ANN001
    """Restore time of a local prefix hit: the engine's path vs a round trip through host
    bytes (what a store hit does after its Get), ABAB, both trimmed to the matched length."""
    from mlx_lm.models.cache import trim_prompt_cache

    from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings

    prompt = random_prompt(tokens + 64, loaded.vocab_size, seed=11)
    manager = CheckpointManager(loaded, CheckpointSettings(local_cache_bytes=8 << 30))
    layout = list(loaded.layout)
    caches = make_prompt_cache(loaded.model)
    loaded.model(mx.array([prompt[: tokens + 1]]), cache=caches)
    mx.eval([c.state for c in caches])
    manager.prefixes.saves.save(caches, prompt[:tokens], "bench", layout)
    plan = manager.prefixes.find(prompt, "bench", layout)
    assert plan is not None and plan.matched == tokens, plan
    captured = plan.local
    assert captured is not None

    def ours() -> float:
        start = time.perf_counter()
        restored, _ = manager.prefixes.materialize(plan)
        assert restored is not None
        mx.eval([c.state for c in restored])
        return time.perf_counter() - start

    def host_round_trip() -> float:
        start = time.perf_counter()
        restored = restore(captured.meta(), to_host(captured), layout)
        if captured.tokens > plan.matched:
            trim_prompt_cache(restored, captured.tokens - plan.matched)
        mx.eval([c.state for c in restored])
        return time.perf_counter() - start

    ours(), host_round_trip()  # warm both
    pairs = [(host_round_trip(), ours()) for _ in range(max(repeat, 5))]
    ratios = [base / mine for base, mine in pairs]
    base = statistics.median(b for b, _ in pairs)
    mine = statistics.median(m for _, m in pairs)
    ratio = statistics.median(ratios)
    print(
        f"  {tokens}-token local hit ({captured.nbytes / 2**20:.1f} MiB): host round trip "
        f"{base * 1e3:7.2f} ms   engine restore {mine * 1e3:7.2f} ms   "
        f"{ratio:5.1f}x (median of {len(pairs)} pairs, {min(ratios):.1f}-{max(ratios):.1f})"
    )
    return {"tokens": tokens, "host_round_trip_s": base, "engine_s": mine, "ratio": ratio}
