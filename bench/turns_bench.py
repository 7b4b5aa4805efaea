"""Turns under contention (--turn-tokens) on vs off: readers beside never-reading streams,
and the throughput of a batch that is simply oversubscribed.

Two engines (same model, --max-running 32), one with --turn-tokens 0 (the baseline: a row
keeps its slot until it ends, as before turns) and one with turns. Each pair of rounds runs
on both, in alternating order (ABAB):

1. starvation: 40 streams opened on a default gRPC channel and never read (BDP probing grows
   their windows, so the engine never sees them stop), then 200 readers asked at once; the
   readers' median and p95 completion time, and the engine's token rate meanwhile;
2. contention: 48 readers of `--long-tokens` each on 32 slots (no one stalls): the
   engine's token rate, what turns cost when every row is read.

Figures are medians over the rounds; ratios are medians of the paired ratios (turns/off)
with their min-max.

With --gateway it measures instead what the gateway's small windows cost: one engine, two
gateways in front of it, one with --engine-window-bytes 0 --http-send-buffer-bytes 0 (gRPC's
and the kernel's defaults), one with its defaults; 32 streams read through each, ABAB, over
the gRPC front and over SSE.

    python bench/turns_bench.py [--pairs 3] [--turn-tokens 128] [--unread-tokens 600]
    python bench/turns_bench.py --gateway [--pairs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import grpc  # noqa: E402

from bench.engine_bench import prompts, through_engine  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tandem_client.engine_client import generate_request  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import GatewayProcess, start_engine  # noqa: E402

MAX_RUNNING = 32


def _request(i: int, max_tokens: int, tag: str) -> engine_pb2.GenerateRequest:
    req = generate_request([5, 6, 7, 8 + i % 50], max_tokens=max_tokens, request_id=f"{tag}-{i}")
    req.sampling.seed = i
    req.sampling.temperature = 0.9
    req.sampling.ignore_eos = True
    return req


def _stats(address: str) -> engine_pb2.EngineStatsResponse:
    with EngineClient(address) as c:
        return c.stats()


def _wait(address: str, until: object) -> None:
    while not until(_stats(address)):  # type: ignore[operator]
        time.sleep(0.05)


async def _readers(address: str, n: int, max_tokens: int, tag: str) -> list[float]:
    """n streams asked at once and read as they come: each one's completion time (s)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        start = time.perf_counter()

        async def one(i: int) -> float:
            got = 0
            async for message in stub.Generate(_request(i, max_tokens, tag)):
                got += len(message.token_ids)
            assert got == max_tokens
            return time.perf_counter() - start

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def starvation(
    address: str, r: int, unread: int, readers: int, unread_tokens: int
) -> dict[str, float]:
    channel = grpc.insecure_channel(address)  # default options: BDP probing on
    stub = engine_pb2_grpc.EngineStub(channel)
    calls = [stub.Generate(_request(i, unread_tokens, f"u{r}")) for i in range(unread)]
    _wait(address, lambda s: s.running == MAX_RUNNING)
    before, start = _stats(address).generated_tokens_total, time.perf_counter()
    done = asyncio.run(_readers(address, readers, 16, f"r{r}"))
    elapsed = time.perf_counter() - start
    rate = (_stats(address).generated_tokens_total - before) / elapsed
    for call in calls:
        call.cancel()
    channel.close()
    _wait(address, lambda s: s.running + s.queued + s.parked == 0)
    done.sort()
    return {
        "p50": statistics.median(done),
        "p95": done[int(0.95 * (len(done) - 1))],
        "all": done[-1],
        "rate": rate,
    }


def contention(address: str, r: int, streams: int, tokens: int) -> float:
    before, start = _stats(address).generated_tokens_total, time.perf_counter()
    asyncio.run(_readers(address, streams, tokens, f"c{r}"))
    return (_stats(address).generated_tokens_total - before) / (time.perf_counter() - start)


def _ratio(ours: list[float], base: list[float]) -> str:
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _sse(http: str, i: int, max_tokens: int) -> int:
    body = {
        "model": "tandem-tiny",
        "prompt": f"stream {i}",
        "max_tokens": max_tokens,
        "stream": True,
        "tandem": {"ignore_eos": True},
    }
    request = urllib.request.Request(
        http + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return sum(line.startswith(b"data: {") for line in reply)


def sse_rate(http: str, streams: int, max_tokens: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        events = sum(pool.map(lambda i: _sse(http, i, max_tokens), range(streams)))
    return events / (time.perf_counter() - start)


def gateway_windows(pairs: int, streams: int = 32, max_tokens: int = 128) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        engine = start_engine(root / "engine", "--max-running", str(streams))
        gateways = {
            "grpc defaults": GatewayProcess(
                [engine.address],
                root / "gw-defaults.log",
                "--engine-window-bytes",
                "0",
                "--http-send-buffer-bytes",
                "0",
            ),
            "small windows": GatewayProcess([engine.address], root / "gw-small.log"),
        }
        try:
            for g in gateways.values():
                g.wait_engines(1)
            with EngineClient(engine.address) as client:
                vocab = client.model_info().vocab_size
            grpc_rate: dict[str, list[float]] = {k: [] for k in gateways}
            sse: dict[str, list[float]] = {k: [] for k in gateways}
            for g in gateways.values():  # warm both
                through_engine(g.grpc, prompts(streams, 64, vocab, 7), 16)
            for r in range(pairs):
                order = list(gateways.items())
                batch = prompts(streams, 64, vocab, 100 + r)
                for name, g in order if r % 2 == 0 else order[::-1]:
                    grpc_rate[name].append(
                        through_engine(g.grpc, batch, max_tokens)["tokens_per_s"]
                    )
                    sse[name].append(sse_rate(g.http, streams, max_tokens))
        finally:
            for g in gateways.values():
                g.stop()
            engine.stop()
    base, ours = gateways
    print(f"\n{streams} streams x {max_tokens} tokens through the gateway, {pairs} pairs")
    print(f"{'':>12} {base:>14} {ours:>14} {'small/defaults':>18}")
    for label, rates in (("gRPC tok/s", grpc_rate), ("SSE events/s", sse)):
        print(
            f"{label:>12} {statistics.median(rates[base]):>14.0f} "
            f"{statistics.median(rates[ours]):>14.0f} {_ratio(rates[ours], rates[base]):>18}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--unread", type=int, default=40)
    p.add_argument("--readers", type=int, default=200)
    p.add_argument("--unread-tokens", type=int, default=600)
    p.add_argument("--long-streams", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=384)
    p.add_argument("--gateway", action="store_true", help="the gateway's windows instead")
    a = p.parse_args()
    if a.gateway:
        gateway_windows(a.pairs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        flags = ["--max-running", str(MAX_RUNNING), "--max-context", "8192"]
        sides = {
            "off": start_engine(root / "off", *flags, "--turn-tokens", "0"),
            "turns": start_engine(root / "on", *flags, "--turn-tokens", str(a.turn_tokens)),
        }
        try:
            for engine in sides.values():  # warm both
                contention(engine.address, -1, 8, 16)
            starved: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
            rates: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(a.pairs):
                order = list(sides.items())
                for name, engine in order if r % 2 == 0 else order[::-1]:
                    starved[name].append(
                        starvation(engine.address, r, a.unread, a.readers, a.unread_tokens)
                    )
                    rates[name].append(contention(engine.address, r, a.long_streams, a.long_tokens))
                    print(f"round {r} {name}: {starved[name][-1]}, {rates[name][-1]:.0f} tok/s")
        finally:
            for engine in sides.values():
                engine.stop()
    print(
        f"\n{a.unread} never-reading streams ({a.unread_tokens} tokens) + {a.readers} readers "
        f"(16 tokens), --max-running {MAX_RUNNING}, --turn-tokens {a.turn_tokens} vs 0, "
        f"{a.pairs} pairs"
    )
    print(f"{'':>24} {'off':>8} {'turns':>8} {'turns/off':>18}")
    for key, label in (
        ("p50", "reader p50 (s)"),
        ("p95", "reader p95 (s)"),
        ("all", "all readers done (s)"),
        ("rate", "engine tok/s"),
    ):
        off = [x[key] for x in starved["off"]]
        on = [x[key] for x in starved["turns"]]
        print(
            f"{label:>24} {statistics.median(off):>8.2f} {statistics.median(on):>8.2f} "
            f"{_ratio(on, off):>18}"
        )
    print(f"\n{a.long_streams} read streams x {a.long_tokens} tokens on {MAX_RUNNING} slots")
    print(
        f"{'engine tok/s':>24} {statistics.median(rates['off']):>8.0f} "
        f"{statistics.median(rates['turns']):>8.0f} {_ratio(rates['turns'], rates['off']):>18}"
    )


if __name__ == "__main__":
    main()
