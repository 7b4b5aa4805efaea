"""The gateway's cost and its failover gap, on real processes.

1. Throughput and TTFT at each stream count through the gateway vs directly to the one
   engine behind it. The same asyncio gRPC client and prompts are used for both sides. Rounds
   alternate (ABAB...), both sides are warmed first, and the figures are medians of the
   paired ratios with their min-max.
2. Time to next token across a failover: streams through the gateway to two engines sharing
   a store, the engine serving them SIGKILLed mid-stream. For each stream it moved, the gap
   at the failover is set against the stream's median inter-token time.

    python bench/gateway_bench.py [--model tandem-tiny|PATH] [--streams 8,32] [--pairs 5]
        [--max-tokens 128] [--checkpoint-interval 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.engine_bench import model_spec, prompts, through_engine  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import (  # noqa: E402
    GatewayProcess,
    InProcessStore,
    ServiceProcess,
    start_engine,
)


def _ratio(ours: list[float], base: list[float]) -> str:
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def overhead(root: Path, spec: str, streams: list[int], pairs: int, max_tokens: int) -> None:
    engine = start_engine(
        root / "engine", "--model", spec, "--max-running", str(max(streams)), log_dir=root
    )
    gateway = GatewayProcess([engine.address], root / "gateway-1.log")
    try:
        gateway.wait_engines(1)
        with EngineClient(engine.address) as client:
            vocab = client.model_info().vocab_size
        sides = {"direct": engine.address, "gateway": gateway.grpc}
        print(
            f"{'streams':>7} {'direct':>8} {'gateway':>8} {'gateway/direct':>18} "
            f"{'TTFT gateway/direct':>20}   (tok/s)"
        )
        for n in streams:
            for address in sides.values():  # warm both
                through_engine(address, prompts(n, 64, vocab, 7), 16)
            rate: dict[str, list[float]] = {k: [] for k in sides}
            ttft: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(pairs):
                batch = prompts(n, 64, vocab, 100 + r)
                order = list(sides.items())
                for name, address in order if r % 2 == 0 else order[::-1]:
                    result = through_engine(address, batch, max_tokens)
                    rate[name].append(result["tokens_per_s"])
                    ttft[name].append(result["ttft_s"])
            print(
                f"{n:>7} {statistics.median(rate['direct']):>8.0f} "
                f"{statistics.median(rate['gateway']):>8.0f} "
                f"{_ratio(rate['gateway'], rate['direct']):>18} "
                f"{_ratio(ttft['gateway'], ttft['direct']):>20}"
            )
    finally:
        gateway.stop()
        engine.stop()


async def _timed_stream(
    address: str, prompt: list[int], max_tokens: int
) -> tuple[list[float], int]:
    """Each token's arrival time, and how many failovers the stream's usage reports."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.GenerateRequest(
            token_ids=prompt,
            max_tokens=max_tokens,
            sampling=engine_pb2.SamplingParams(ignore_eos=True),
        )
        stamps, failovers = [], 0
        async for message in stub.Generate(request):
            stamps += [time.perf_counter()] * len(message.token_ids)
            failovers = message.usage.failovers
        return stamps, failovers


def failover_gap(root: Path, spec: str, n: int, max_tokens: int, interval: int) -> None:
    store = InProcessStore(root / "store")
    engines: list[ServiceProcess] = [
        start_engine(
            root / "engine", "--model", spec, "--store", store.address, log_dir=root / f"fo{i}"
        )
        for i in range(2)
    ]
    gateway = GatewayProcess(
        [e.address for e in engines],
        root / "gateway-2.log",
        "--checkpoint-interval",
        str(interval),
        "--poll-interval",
        "0.2",
    )
    try:
        gateway.wait_engines(2)
        with EngineClient(engines[0].address) as client:
            vocab = client.model_info().vocab_size
        batch = prompts(n, 64, vocab, 11)
        results: list[tuple[list[float], int]] = []

        def run() -> None:
            async def all_streams() -> list[tuple[list[float], int]]:
                return list(
                    await asyncio.gather(
                        *(_timed_stream(gateway.grpc, p, max_tokens) for p in batch)
                    )
                )

            results.extend(asyncio.run(all_streams()))

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            for e in engines:
                with EngineClient(e.address) as c:
                    stats = c.stats()
                if stats.running and stats.generated_tokens_total > n * max_tokens // 3:
                    victim = e
                    break
            time.sleep(0.02)
        assert victim is not None, "no engine got a third of the way"
        victim.kill()
        thread.join(300)
        gaps, normal = [], []
        for stamps, failovers in results:
            steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            if failovers and steps:  # this stream moved: its widest gap is the failover's
                gaps.append(max(steps))
                normal.append(statistics.median(steps))
        print(
            f"failover: {len(gaps)} of {n} streams moved; time to next token across it "
            f"{statistics.median(gaps) * 1e3:.0f} ms (max {max(gaps) * 1e3:.0f}) vs "
            f"{statistics.median(normal) * 1e3:.1f} ms between tokens "
            f"({statistics.median(g / m for g, m in zip(gaps, normal, strict=True)):.0f}x)"
        )
    finally:
        gateway.stop()
        for e in engines:
            e.stop()
        store.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--streams", default="8,32")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--failover-streams", type=int, default=8)
    p.add_argument("--failover-tokens", type=int, default=400)
    p.add_argument("--checkpoint-interval", type=int, default=16)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-gateway-bench-") as tmp:
        root = Path(tmp)
        spec = model_spec(a.model, root)
        print(
            f"model {a.model}, prompt 64 tokens, {a.max_tokens} generated, greedy, "
            f"{a.pairs} interleaved rounds, medians of paired ratios (min-max)"
        )
        if a.streams:  # --streams "": the failover part only
            overhead(root, spec, [int(s) for s in a.streams.split(",")], a.pairs, a.max_tokens)
        failover_gap(root, spec, a.failover_streams, a.failover_tokens, a.checkpoint_interval)


if __name__ == "__main__":
    main()
