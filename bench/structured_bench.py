"""What structured output costs, on a real engine process.

1. Decode throughput with 0 / 8 / 32 of 32 streams constrained, beside the same 32 streams
   all unconstrained (the baseline a user has without constraints). Constrained streams use
   a fixed-length regex, so they never end before max_tokens and every side makes the same
   number of tokens. Sides alternate (ABAB), both are warmed, and the figures are medians of
   paired ratios with their min-max.
2. The work a resume adds for a constraint: rebuilding the matcher by replaying the tokens
   generated before the checkpoint (llguidance has no serialized matcher state), timed for
   1,000 tokens of a regex constraint, beside a fresh matcher and one mask (the per-step
   cost) for scale.

    python bench/structured_bench.py [--model tandem-tiny|PATH] [--streams 32]
        [--constrained 0,8,32] [--pairs 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.decode_cost import stream_times  # noqa: E402
from bench.engine_bench import model_spec, prompts  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import start_engine  # noqa: E402

# Never complete before max_tokens: at most ~8 characters a token here.
LONG_REGEX = "[a-z0-9 ,.]{1200}"


def _ratio(ours: list[float], base: list[float]) -> str:
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


async def _run(address: str, batch: list[list[int]], constrained: int, max_tokens: int) -> float:
    """Tokens per second over the whole batch; the first `constrained` streams constrained."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        start = time.perf_counter()

        async def one(i: int, prompt: list[int]) -> int:
            request = engine_pb2.GenerateRequest(
                token_ids=prompt,
                max_tokens=max_tokens,
                sampling=engine_pb2.SamplingParams(ignore_eos=True, temperature=0.8, seed=i),
            )
            if i < constrained:
                request.constraint.regex = LONG_REGEX
            return sum((await stream_times(stub, request)).tokens)

        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        return sum(counts) / (time.perf_counter() - start)


def throughput(root: Path, spec: str, streams: int, sides: list[int], pairs: int, n: int) -> None:
    engine = start_engine(
        root / "engine", "--model", spec, "--max-running", str(streams), log_dir=root
    )
    try:
        with EngineClient(engine.address) as client:
            vocab = client.model_info().vocab_size
        print(f"{'constrained':>11} {'tok/s':>8} {'plain tok/s':>12} {'constrained/plain':>18}")
        for k in sides:
            for c in (0, k):  # warm both
                asyncio.run(_run(engine.address, prompts(streams, 32, vocab, 3), c, 16))
            ours: list[float] = []
            base: list[float] = []
            for r in range(pairs):
                batch = prompts(streams, 32, vocab, 50 + r)
                order = [(base, 0), (ours, k)]
                for into, c in order if r % 2 == 0 else order[::-1]:
                    into.append(asyncio.run(_run(engine.address, batch, c, n)))
            print(
                f"{k:>8}/{streams:<2} {statistics.median(ours):>8.0f} "
                f"{statistics.median(base):>12.0f} {_ratio(ours, base):>18}"
            )
    finally:
        engine.stop()
        switches = [
            line for line in (root / "engine.log").read_text().splitlines() if "queue the" in line
        ]
        print(f"step order switches to forward-first (sampling/masks.StepOrder): {len(switches)}")
        for line in switches[:3]:
            print("  ", line[-140:])


def replay(spec: str, data_dir: Path, tokens: int) -> None:
    """The matcher rebuilt past `tokens` generated tokens (what a resume adds)."""
    import numpy as np

    from engine_service.model.loading import load_model
    from engine_service.protocol.constraint import Constraint, ConstraintKind
    from engine_service.sampling.constraints import Grammars, mask_words

    loaded = load_model(spec, data_dir)
    grammars = Grammars.for_model(loaded)
    # A regex that cannot complete within `tokens`, so a random walk over its own masks
    # makes a valid output of exactly that length.
    constraint = Constraint(ConstraintKind.REGEX, f"[a-z0-9 ,.]{{{tokens * 20}}}")
    row = grammars.row(constraint, [])
    made: list[int] = []
    rng = np.random.default_rng(0)
    mask_s: list[float] = []
    bitmask = np.zeros((mask_words(loaded.vocab_size),), dtype=np.int32)
    while len(made) < tokens:
        t = time.perf_counter()
        row.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.size * 4)
        mask_s.append(time.perf_counter() - t)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: loaded.vocab_size]
        allowed = [i for i in np.flatnonzero(bits) if i not in loaded.eos_token_ids]
        token = int(rng.choice(allowed))
        assert row.matcher.consume_token(token)
        made.append(token)
    timings = []
    for _ in range(5):
        t = time.perf_counter()
        grammars.row(constraint, made)
        timings.append(time.perf_counter() - t)
    fresh = []
    for _ in range(5):
        t = time.perf_counter()
        grammars.row(constraint, [])
        fresh.append(time.perf_counter() - t)
    print(
        f"matcher replay of {tokens} tokens: {statistics.median(timings) * 1e3:.2f} ms "
        f"(a fresh matcher: {statistics.median(fresh) * 1e3:.2f} ms; one mask: "
        f"{statistics.median(mask_s) * 1e6:.0f} us median, vocab {loaded.vocab_size})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--constrained", default="0,8,32")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--replay-tokens", type=int, default=1000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-structured-") as tmp:
        root = Path(tmp)
        spec = model_spec(a.model, root)
        sides = [int(x) for x in a.constrained.split(",")]
        throughput(root, spec, a.streams, sides, a.pairs, a.max_tokens)
        replay(spec, root / "engine", a.replay_tokens)


if __name__ == "__main__":
    main()
