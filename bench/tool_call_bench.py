"""What a forced tool call's grammar costs in decoding, on a real engine process.

32 chat streams that offer the same two tools, all at once: with `tool_choice` auto (the
model decides, nothing constrains it: what a server without forced calls gives) beside the
same streams with `tool_choice` naming get_weather, where every token is a step of llguidance's
grammar over the call format with the functions' JSON schemas (engine_service/front/
tools.py) and the front cuts the calls out of the text as they stream (front/tool_calls.py).
The auto side ignores end-of-sequence and the forced call is one no row can finish within
--max-tokens (a constrained row stops at its grammar's end), so each stream makes exactly
--max-tokens tokens. Sides alternate (ABAB), both are warmed; the figure is the median of
paired ratios (forced / auto tokens per second) with its min-max.

    python bench/tool_call_bench.py [--model tandem-tiny|SHAPE] [--streams 32] [--pairs 5]
        [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.shapes import SHAPES, model_spec  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import start_engine  # noqa: E402
from tests.tool_model import add_tool_format, build_tool_model  # noqa: E402

# A call no row can finish within --max-tokens (50 items of ~12 tokens each), so every row
# runs its full length, and in JSON structure all the way (keys, enums, bounded integers):
# the grammar's busy case, not a long string it would only pass characters through.
WEATHER = {
    "type": "object",
    "properties": {
        "forecasts": {
            "type": "array",
            "minItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["forecasts"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}}
TOOLS = [("get_weather", WEATHER), ("get_time", ZONE)]


def _request(i: int, forced: bool, max_tokens: int) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(
        max_tokens=max_tokens,
        sampling=engine_pb2.SamplingParams(ignore_eos=True, temperature=0.8, seed=i),
        parallel_tool_calls=True,
    )
    request.messages.add(role="user", content=f"Question {i}: what is the weather like?")
    for name, schema in TOOLS:
        request.tools.add(name=name, parameters_json=json.dumps(schema))
    if forced:
        request.tool_choice.mode = engine_pb2.ToolChoice.MODE_FUNCTION
        request.tool_choice.function_name = "get_weather"
    return request


async def _run(address: str, streams: int, forced: bool, max_tokens: int) -> tuple[float, int]:
    """(tokens per second over the batch, calls made)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        start = time.perf_counter()

        async def one(i: int) -> tuple[int, int]:
            tokens, calls = 0, set()
            async for m in stub.Generate(_request(i, forced, max_tokens)):
                tokens += len(m.token_ids)
                calls |= {d.index for d in m.tool_calls}
            return tokens, len(calls)

        done = await asyncio.gather(*(one(i) for i in range(streams)))
        elapsed = time.perf_counter() - start
    tokens = sum(t for t, _ in done)
    assert tokens == streams * max_tokens, (tokens, streams * max_tokens)
    return tokens / elapsed, sum(c for _, c in done)


def _model(spec: str, root: Path) -> str:
    if spec == "tandem-tiny":
        return str(build_tool_model(root / "tandem-tiny-tools"))
    if spec in SHAPES:
        path = Path(model_spec(spec, root))
        add_tool_format(path)
        return str(path)
    raise SystemExit(f"--model: tandem-tiny or one of {sorted(SHAPES)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        engine = start_engine(root / "data", "--model", _model(args.model, root), log_dir=root)
        try:
            run = lambda forced: asyncio.run(  # noqa: E731
                _run(engine.address, args.streams, forced, args.max_tokens)
            )
            run(False), run(True)  # warm both: compile, grammar caches
            auto, forced, calls = [], [], []
            for _ in range(args.pairs):
                auto.append(run(False)[0])
                rate, made = run(True)
                forced.append(rate)
                calls.append(made)
        finally:
            engine.stop()
    ratios = [f / a for f, a in zip(forced, auto, strict=True)]
    print(
        f"model {args.model}, {args.streams} streams x {args.max_tokens} tokens, {args.pairs} pairs"
    )
    for name, rates in (("auto (unconstrained)", auto), ("required (grammar)", forced)):
        print(f"{name:21} {statistics.median(rates):8.1f} tok/s  {[round(x) for x in rates]}")
    print(f"calls made per forced batch: {calls}")  # one per row, cut by max_tokens
    print(
        f"forced / auto: median {statistics.median(ratios):.2f} "
        f"(spread {min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
