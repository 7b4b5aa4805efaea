"""What generation checkpoints cost decode (checkpoint_bench.py's part 4): the engine's
tokens/s with a checkpoint every 16 tokens against none, in ABBA pairs of runs on one engine
(the interval is a request's), at 1 and 8 streams.

Three figures, from the steadiest down:
- the share of each checkpointed run's wall time the engine's step loop spent on checkpoints
  (Stats' capture_seconds): what they take on the critical path, with no run-to-run drift;
- the steady cost: each stream's tokens over its time between tokens, every gap capped at
  STALL_FACTOR times the run's median gap a token. A lent GPU stalls now and then for tens
  of ms (no side's doing); a stall in one run of a pair swung the plain ratio by 20-40
  points (docs/performance.md, twelfth session). A checkpoint round lengthens its step by a
  fraction, far under the cap, so it counts whole; the capped gaps of each side are printed,
  so stalls the checkpoints themselves cause would show as more of them on that side;
- the plain cost: tokens over wall time, the client's view, stalls and all.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc

from bench.checkpoint_restore import random_prompt
from tandem_wire.pb import engine_pb2, engine_pb2_grpc

STALL_FACTOR = 4.0  # a gap over 4x the median is a stall (a round adds ~15% to its step)
INTERVAL = 16


@dataclass
class StreamTimes:
    """When a stream's messages came, and how many tokens each carried."""

    arrivals: list[float]
    tokens: list[int]


async def stream_times(stub: engine_pb2_grpc.EngineStub, request: Any) -> StreamTimes:
    """A Generate stream read to its end: when each message with tokens came, and how many
    (bench/structured_bench.py counts them too)."""
    times = StreamTimes([], [])
    async for message in stub.Generate(request):
        if message.token_ids:
            times.arrivals.append(time.perf_counter())
            times.tokens.append(len(message.token_ids))
    return times


@dataclass
class DecodeRun:
    """One decode run: its tokens/s (plain, and with stalls capped), how many gaps were
    capped, and the share of its wall time the engine's step loop spent on generation
    checkpoints (Stats' capture_seconds)."""

    tokens_per_second: float
    steady_tokens_per_second: float
    capped_gaps: int
    capture_share: float
    saved_bytes: int  # what its checkpoints stored (Stats' saved_bytes)


def steady_rate(streams: list[StreamTimes], factor: float = STALL_FACTOR) -> tuple[float, int]:
    """The streams' summed tokens/s after their first message, each gap capped at factor x
    the median gap a token of all the streams' gaps; and how many were capped. Streams run
    side by side, so their rates add. (Every message recorded carries a token.)"""
    gaps = [
        [(s.arrivals[i] - s.arrivals[i - 1], s.tokens[i]) for i in range(1, len(s.arrivals))]
        for s in streams
    ]
    per_token = [gap / count for stream in gaps for gap, count in stream]
    if not per_token:
        return 0.0, 0
    cap = factor * statistics.median(per_token)
    rate, capped = 0.0, 0
    for stream in gaps:
        kept = [min(gap, cap * count) for gap, count in stream]
        capped += sum(k < gap for k, (gap, _) in zip(kept, stream, strict=True))
        seconds = sum(kept)
        rate += sum(count for _, count in stream) / seconds if seconds > 0 else 0.0
    return rate, capped


async def _decode(
    address: str, prompts: list[list[int]], tokens: int, interval: int, logprobs: int = -1
) -> DecodeRun:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        stats = engine_pb2.EngineStatsRequest()

        async def one(i: int, prompt: list[int]) -> StreamTimes:
            request = engine_pb2.GenerateRequest(
                token_ids=prompt,
                max_tokens=tokens,
                checkpoint_interval=interval,
                request_id=f"decode-{interval}-{i}-{time.monotonic_ns()}",
                # Asking for logprobs: the checkpoints write their pages too.
                sampling=engine_pb2.SamplingParams(
                    ignore_eos=True, **({"logprobs": logprobs} if logprobs >= 0 else {})
                ),
            )
            return await stream_times(stub, request)

        before = (await stub.Stats(stats)).checkpoints
        captured, saved = before.capture_seconds, before.saved_bytes
        start = time.perf_counter()
        streams = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - start
        if interval:  # the records reached the store (prefixes too: a Flush waits for them)
            await stub.Flush(engine_pb2.EngineFlushRequest())
        after = (await stub.Stats(stats)).checkpoints
        steady, capped = steady_rate(list(streams))
        return DecodeRun(
            sum(sum(s.tokens) for s in streams) / seconds,
            steady,
            capped,
            (after.capture_seconds - captured) / seconds,
            after.saved_bytes - saved,
        )


def _spread(costs: list[float]) -> str:
    """A cost's median with its quartiles and extremes, in percent."""
    median = statistics.median(costs)
    low, _, high = statistics.quantiles(costs, n=4) if len(costs) > 1 else (median,) * 3
    return (
        f"{100 * median:5.1f}% (quartiles {100 * low:.1f} to {100 * high:.1f}, extremes "
        f"{100 * min(costs):.1f} to {100 * max(costs):.1f})"
    )


def bench_decode(
    address: str,
    vocab: int,
    repeat: int,
    tokens: int = 256,
    prompt_tokens: int = 64,
    logprobs: int = -1,
) -> list[dict]:
    """Off and on runs alternate, and each cost is the median of the pairs' ratios: a box's
    speed drifts by tens of percent between runs, which separate blocks would mistake for
    cost."""
    rows = []
    for streams in (1, 8):
        prompts = [random_prompt(prompt_tokens, vocab, seed=1000 + i) for i in range(streams)]
        offs: list[DecodeRun] = []
        ons: list[DecodeRun] = []
        asyncio.run(_decode(address, prompts, 64, 0, logprobs))  # warm both paths first
        asyncio.run(_decode(address, prompts, 64, INTERVAL, logprobs))
        for pair in range(repeat):
            # ABBA: the side that runs first alternates, so a drift within a pair cancels.
            for interval in (0, INTERVAL) if pair % 2 == 0 else (INTERVAL, 0):
                run = asyncio.run(_decode(address, prompts, tokens, interval, logprobs))
                (ons if interval else offs).append(run)
        pairs = list(zip(offs, ons, strict=True))
        costs = [1 - on.tokens_per_second / off.tokens_per_second for off, on in pairs]
        steady = [
            1 - on.steady_tokens_per_second / off.steady_tokens_per_second for off, on in pairs
        ]
        shares = [on.capture_share for on in ons]
        stored = [on.saved_bytes / streams for on in ons]
        off_tps = statistics.median(r.tokens_per_second for r in offs)
        on_tps = statistics.median(r.tokens_per_second for r in ons)
        share = statistics.median(shares)
        rows.append(
            {
                "streams": streams,
                "off_tps": off_tps,
                "interval16_tps": on_tps,
                "cost": statistics.median(costs),
                "costs": costs,
                "steady_cost": statistics.median(steady),
                "steady_costs": steady,
                "capped_gaps": {
                    "off": [r.capped_gaps for r in offs],
                    "on": [r.capped_gaps for r in ons],
                },
                "capture_share": share,
                "capture_shares": shares,
                "stored_bytes_a_generation": stored,
            }
        )
        print(
            f"  {streams} stream(s): off {off_tps:7.0f} tok/s   every {INTERVAL} tokens "
            f"{on_tps:7.0f} tok/s   (medians of {repeat} ABBA pairs of {tokens} tokens a stream)\n"
            f"    the step loop's time on checkpoints {100 * share:.2f}% of the runs' wall time "
            f"({100 * min(shares):.2f}-{100 * max(shares):.2f})\n"
            f"    steady cost {_spread(steady)}; gaps over {STALL_FACTOR:g}x the median capped: "
            f"off {sum(r.capped_gaps for r in offs)}, on {sum(r.capped_gaps for r in ons)}\n"
            f"    plain cost  {_spread(costs)}\n"
            f"    stored a generation {statistics.median(stored) / 2**20:.1f} MiB (its "
            f"checkpoints, and a prompt's prefix record when one was saved)"
        )
    return rows
