"""Engine throughput: gRPC streams through `tandem-engine` beside mlx-lm's BatchGenerator
and beside `mlx_lm.server` (the HTTP server a user would otherwise run).

On the same model in one run, for each concurrency (default 1, 8, 32): "direct" calls
BatchGenerator in this process (every request inserted at once); "engine" opens that many
concurrent Generate streams to an engine process; "server" sends the same prompts (as text)
to `mlx_lm.server` through its OpenAI-compatible /v1/completions, streamed, one connection a
stream. All three run side by side, are warmed identically, and alternate in order over
--pairs rounds (ABC, CBA, ...) with fresh prompts each round; the figures are medians of the
per-round ratios with their spread, since these machines swing more between runs than the
effects measured.

    python bench/engine_bench.py [--model tandem-tiny|PATH|qwen3-0.6b-shape] [--streams 1,8,32]
        [--pairs 5] [--no-server]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
# isort: on

import grpc  # noqa: E402

from bench.shapes import SHAPES, model_spec  # noqa: E402, F401  (other benches import them here)
from engine_service import blas  # noqa: E402
from engine_service.model.default_model import ensure_model  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import free_port, start_engine  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def direct(
    model,
    batch: list[list[int]],
    max_tokens: int,  # noqa: ANN001
    temperature: float = 0.0,
) -> dict[str, float]:
    # Sampled baseline: mlx-lm's own sampler, one shared object (one batched draw per step
    # from the global random state) - what BatchGenerator does without per-request seeds.
    sampler = make_sampler(temp=temperature) if temperature else None
    bg = BatchGenerator(
        model, sampler=sampler, completion_batch_size=max(32, len(batch)), prefill_batch_size=8
    )
    start = time.perf_counter()
    uids = bg.insert(batch, max_tokens=[max_tokens] * len(batch))
    first: dict[int, float] = {}
    stamps: dict[int, list[float]] = {uid: [] for uid in uids}
    done = 0
    total = 0
    while done < len(uids):
        _, responses = bg.next()
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now - start)
            stamps[r.uid].append(now)
            total += 1
            if r.finish_reason is not None:
                done += 1
    wall = time.perf_counter() - start
    bg.close()
    # Three MLX processes share the GPU here (this one, the engine core, the server): give
    # back the buffers this run cached, as the engine core does when it goes idle.
    mx.clear_cache()
    return {
        "tokens_per_s": total / wall,
        "ttft_s": statistics.median(first.values()),
        "tokens": total,
        "decode_tokens_per_s": decode_rate(list(stamps.values())),
    }


def decode_rate(stamps: list[list[float]]) -> float:
    """Tokens a second once every stream is decoding: those after the last stream's second
    token, over the time from it to the last token (prefills left out, whatever the prompt
    length). 0 when a stream has fewer than 3 tokens."""
    if any(len(s) < 3 for s in stamps):
        return 0.0
    start, end = max(s[1] for s in stamps), max(s[-1] for s in stamps)
    tokens = sum(1 for s in stamps for t in s if t > start)
    return tokens / (end - start) if end > start else 0.0


def through_engine(
    address: str, batch: list[list[int]], max_tokens: int, temperature: float = 0.0
) -> dict[str, float]:
    """All streams from one asyncio client (one thread), so the client's own CPU use stays
    small on a 2-core machine where it competes with the engine."""
    return asyncio.run(_through_engine(address, batch, max_tokens, temperature))


async def _through_engine(
    address: str, batch: list[list[int]], max_tokens: int, temperature: float
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        start = time.perf_counter()

        async def one(i: int, prompt: list[int]) -> list[float]:
            sampling = engine_pb2.SamplingParams(ignore_eos=True, temperature=temperature, seed=i)
            request = engine_pb2.GenerateRequest(
                token_ids=prompt, max_tokens=max_tokens, sampling=sampling
            )
            stamps: list[float] = []
            async for message in stub.Generate(request):
                now = time.perf_counter()
                stamps += [now] * len(message.token_ids)
            return stamps

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        wall = time.perf_counter() - start
    total = sum(len(s) for s in results)
    return {
        "tokens_per_s": total / wall,
        "ttft_s": statistics.median(s[0] - start for s in results),
        "tokens": total,
        "decode_tokens_per_s": decode_rate(results),
    }


def through_server(port: int, texts: list[str], max_tokens: int) -> dict[str, float]:
    """The same requests to `mlx_lm.server` (its OpenAI-compatible HTTP endpoint, streamed),
    one thread a stream; tokens counted from its usage report."""

    def one(text: str) -> tuple[int, float]:
        body = json.dumps(
            {
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        for attempt in range(10):  # its listen backlog is socketserver's 5: bursts reset
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                break
            except (ConnectionResetError, http.client.RemoteDisconnected):
                time.sleep(0.05 * (attempt + 1))
        else:
            raise RuntimeError("mlx_lm.server kept resetting connections")
        first, tokens = 0.0, 0
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not first and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
        conn.close()
        return tokens, first

    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(one, texts))
    wall = time.perf_counter() - start
    total = sum(c for c, _ in results)
    if not total:
        raise RuntimeError("mlx_lm.server generated nothing: see its log")
    return {
        "tokens_per_s": total / wall,
        "ttft_s": statistics.median(f for _, f in results),
        "tokens": total,
    }


def start_mlx_lm_server(model_dir: str, streams: int, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--host", "127.0.0.1"]
        + ["--port", str(port), "--decode-concurrency", str(max(32, streams))]
        + ["--prompt-concurrency", "8", "--max-tokens", "100000"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"mlx_lm.server did not start: see {log}")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=5, help="interleaved rounds per row")
    parser.add_argument(
        "--no-server", action="store_true", help="leave out the mlx_lm.server baseline"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: seeded per-request sampling in the engine vs mlx-lm's "
        "shared sampler in the baseline (the server baseline stays greedy)",
    )
    parser.add_argument(
        "--server-streams", default="", help="stream counts the server runs at (default: all)"
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tandem-engine-bench-") as tmp:
        data_dir = Path(tmp)
        spec = model_spec(args.model, data_dir)
        loaded = load_model(spec, data_dir)
        vocab = loaded.vocab_size
        streams = [int(s) for s in args.streams.split(",")]
        mode = f"sampled T={args.temperature}" if args.temperature else "greedy"
        out: dict[str, object] = {
            "model": args.model,
            "model_id": loaded.model_id,
            "device": str(mx.default_device()),
            "blas": blas.in_use(),
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "sampling": mode,
            "pairs": args.pairs,
            "rows": [],
        }
        engine = start_engine(
            data_dir, "--model", spec, "--max-running", str(max(streams)), log_dir=data_dir
        )
        server = None
        try:
            if not args.no_server:
                # The server loads a directory: an embedded model's is built where it can.
                model_dir = spec if Path(spec).is_dir() else str(ensure_model(spec, data_dir))
                server = start_mlx_lm_server(
                    model_dir, max(streams), data_dir / "mlx_lm_server.log"
                )

            def batch(n: int, seed: int) -> list[list[int]]:
                return prompts(n, args.prompt_tokens, vocab, seed)

            def texts(n: int, seed: int) -> list[str]:
                return [loaded.tokenizer.decode(p) for p in batch(n, seed)]

            sides = {
                "direct": lambda n, seed: direct(
                    loaded.model, batch(n, seed), args.max_tokens, args.temperature
                ),
                "engine": lambda n, seed: through_engine(
                    engine.address, batch(n, seed), args.max_tokens, args.temperature
                ),
            }
            if server is not None:
                port = server[1]
                sides["server"] = lambda n, seed: through_server(
                    port, texts(n, seed), args.max_tokens
                )
            server_streams = (
                {int(x) for x in args.server_streams.split(",")} if args.server_streams else None
            )

            def sides_for(n: int) -> dict:
                if server_streams is None or n in server_streams:
                    return sides
                return {k: v for k, v in sides.items() if k != "server"}

            # Warm every side identically: each stream count once (kernels, shapes).
            for n in streams:
                for name, run in sides_for(n).items():
                    try:
                        run(n, 7)
                    except RuntimeError as exc:
                        if name != "server":
                            raise
                        log = (data_dir / "mlx_lm_server.log").read_text()[-3000:]
                        print(f"mlx_lm.server left out: {exc}\n{log}")
                        sides.pop("server")
                        server[0].terminate()
                        server = None
                        break
            print(
                f"model {args.model} on {out['device']} (BLAS: {out['blas']}), {mode}, prompt "
                f"{args.prompt_tokens} tokens, {args.max_tokens} generated per stream, "
                f"{args.pairs} interleaved rounds (order alternating), medians of paired "
                "ratios (min-max)"
            )
            header = f"{'streams':>7} {'direct':>8} {'engine':>8} {'engine/direct':>18} "
            header += f"{'TTFT engine/direct':>19} {'decode engine/direct':>21}"
            if server is not None:
                header += f" {'server':>8} {'engine/server':>18}"
            print(header + "   (tok/s)")
            for n in streams:
                here = sides_for(n)
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in here}
                for r in range(args.pairs):
                    order = list(here.items())
                    for name, run in order if r % 2 == 0 else order[::-1]:
                        runs[name].append(run(n, 1000 * n + r))
                tps = {k: [x["tokens_per_s"] for x in v] for k, v in runs.items()}
                ttft = {k: [x["ttft_s"] for x in v] for k, v in runs.items()}
                ratio = [e / d for e, d in zip(tps["engine"], tps["direct"], strict=True)]
                ttft_ratio = [e / d for e, d in zip(ttft["engine"], ttft["direct"], strict=True)]
                decode = [
                    e["decode_tokens_per_s"] / d["decode_tokens_per_s"]
                    for e, d in zip(runs["engine"], runs["direct"], strict=True)
                    if d["decode_tokens_per_s"]
                ]
                row = {
                    "streams": n,
                    "direct_tps": statistics.median(tps["direct"]),
                    "engine_tps": statistics.median(tps["engine"]),
                    "ratio": statistics.median(ratio),
                    "ratio_min": min(ratio),
                    "ratio_max": max(ratio),
                    "ttft_ratio": statistics.median(ttft_ratio),
                    "direct_ttft_s": statistics.median(ttft["direct"]),
                    "engine_ttft_s": statistics.median(ttft["engine"]),
                    "decode_ratio": statistics.median(decode) if decode else None,
                }
                line = (
                    f"{n:>7} {row['direct_tps']:>8.0f} {row['engine_tps']:>8.0f} "
                    f"{_spread(ratio):>18} {_spread(ttft_ratio):>19} "
                    f"{_spread(decode) if decode else '-':>21}"
                )
                if "server" in here:
                    vs = [e / s for e, s in zip(tps["engine"], tps["server"], strict=True)]
                    row.update(
                        server_tps=statistics.median(tps["server"]),
                        engine_vs_server=statistics.median(vs),
                        server_ttft_s=statistics.median(ttft["server"]),
                    )
                    line += f" {row['server_tps']:>8.0f} {_spread(vs):>18}"
                out["rows"].append(row)  # type: ignore[attr-defined]
                print(line)
        finally:
            engine.stop()
            if server is not None:
                server[0].terminate()
                server[0].wait(30)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
