"""Checkpoint figures, each beside its baseline, in one run.

1. Time to first token for a long prompt whose prefix is in the store (engine with no local
   cache, so every hit is a store hit) vs a cold prefill of the same prompt.
2. Resume after an engine crash: a generation killed after --resume-tokens generated tokens,
   the time from the resume call to its first new token vs regenerating those tokens.
3. Restore bandwidth, broken down: LMDB read in-process, store Get (read + wire + client),
   deserialization into MLX arrays, host-to-device (evaluation on the default device).
4. Decode tokens/s with checkpoint_interval 16 vs off, at 1 and 8 streams.
5. A local (in-memory) prefix hit of --restore-tokens tokens: the engine's restore
   (materialize_prefix) beside the host round trip it would make through bytes
   (device arrays -> host buffers -> numpy -> MLX), interleaved, median of paired ratios.

    python bench/checkpoint_bench.py [--model tandem-tiny|qwen3-0.6b-shape|PATH]
                                     [--prompts 1024,4096] [--resume-tokens 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
# isort: on

import grpc  # noqa: E402

from bench.checkpoint_restore import (  # noqa: E402
    bench_floor,
    bench_local_hit,
    bench_restore,
    random_prompt,
)
from bench.decode_cost import bench_decode  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from engine_service import blas  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from tandem_client import EngineClient, StoreClient  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import (  # noqa: E402
    free_port,
    generation_progress,
    start_engine,
    start_store_on,
)


def _ttft(
    client: EngineClient, prompt: list[int], namespace: str, record_bits: int = 0
) -> tuple[float, int]:
    start = time.perf_counter()
    options = dict(max_tokens=1, ignore_eos=True, namespace=namespace)
    for chunk in client.stream(prompt, prefix_record_bits=record_bits, **options):
        if chunk.usage is not None:
            return time.perf_counter() - start, chunk.usage.cached_prompt_tokens
    raise RuntimeError("no usage")


def bench_ttft(
    address: str,
    store: StoreClient,
    lengths: list[int],
    vocab: int,
    repeat: int,
    record_bits: int = 0,
) -> list[dict]:
    rows = []
    with EngineClient(address, timeout=1800) as client:
        for n in lengths:
            colds, hits, cached = [], [], 0
            for r in range(repeat):
                base = random_prompt(n, vocab, seed=n * 100 + r)
                follow_up = base + random_prompt(16, vocab, seed=r)  # a second turn on the prefix
                # saves the prefix to the store (compressed with --prefix-record-bits)
                _ttft(client, base, f"bench-{n}-{r}", record_bits)
                client.flush()
                hit, cached = _ttft(client, follow_up, f"bench-{n}-{r}", record_bits)
                # Each run saves its own prompt's prefix after its first token: let that
                # spill finish so the next measurement does not share the machine with it.
                client.flush()
                cold, _ = _ttft(client, follow_up, f"cold-{n}-{r}")
                client.flush()
                hits.append(hit)
                colds.append(cold)
            rows.append(
                {
                    "prompt_tokens": n + 16,
                    "cached_tokens": cached,
                    "cold_ttft_s": statistics.median(colds),
                    "store_hit_ttft_s": statistics.median(hits),
                }
            )
            row = rows[-1]
            print(
                f"  {n + 16:>6} tokens: cold prefill {row['cold_ttft_s'] * 1e3:8.1f} ms   "
                f"store hit ({cached} cached) {row['store_hit_ttft_s'] * 1e3:8.1f} ms   "
                f"{row['cold_ttft_s'] / row['store_hit_ttft_s']:5.1f}x"
            )
    return rows


def bench_resume(stack: dict, vocab: int, tokens: int, samples: int = 1) -> dict:
    """A generation killed after `tokens` tokens, resumed on a fresh engine: the time to its
    first new token against the time its tokens took to generate. Each further sample kills
    the engine again under the resumed stream and resumes it once more (the checkpoint may
    then be ahead of what the client holds: the engine replays from it).

    The first new token is the checkpoint's own (its pending token, and any it holds past
    what the client has), sent once the checkpoint is read and checked; the first token the
    restored engine computes comes in the next chunk, after the caches are rebuilt and a
    step ran: both are reported."""
    prompt = random_prompt(64, vocab, seed=5)
    request = dict(
        max_tokens=tokens * 8,  # still running when it is killed
        ignore_eos=True,
        checkpoint_interval=tokens // 4,
        request_id="crash-me",
    )
    engine = stack["engine"]
    firsts: list[float] = []
    computed: list[float] = []
    with EngineClient(engine.address, timeout=1800) as client:
        start = time.perf_counter()
        received = 0
        stream = client.stream_request(client.request(prompt, **request))
        for chunk in stream:
            received += len(chunk.token_ids)
            if received >= tokens:
                break
        regenerate_s = time.perf_counter() - start  # prompt + `tokens` generated
        _wait_covered(stack["store"], client, len(prompt) + received)
    for _ in range(samples):
        engine.kill()
        engine = stack["restart"]()
        with EngineClient(engine.address, timeout=1800) as client:
            # Warm the fresh engine's kernels (first use compiles on a GPU), as a replacement
            # engine that already serves traffic would be.
            client.generate(prompt, max_tokens=4, ignore_eos=True, namespace="warm-up")
            start = time.perf_counter()
            stream = client.stream(prompt, resume=True, tokens_held=received, **request)
            for chunk in stream:
                if chunk.token_ids:
                    (computed if len(firsts) > len(computed) else firsts).append(
                        time.perf_counter() - start
                    )
                    if len(computed) == len(firsts):
                        break
            _wait_covered(stack["store"], client, len(prompt) + received)
    stack["engine"] = engine
    marker = "first token phases, resume (ms): "
    phases = [
        line.split(marker, 1)[1].strip()
        for line in (stack["log_dir"] / "engine.log").read_text(errors="replace").splitlines()
        if marker in line
    ]
    if phases:  # the engines ran at --log-level debug
        print("  the resume's phases in the core, each sample: " + "; ".join(phases))
        lines = (stack["log_dir"] / "engine.log").read_text(errors="replace").splitlines()
        for marker, what in (
            ("resume load phases (ms): ", "of its plan, the checkpoint's reads and checks"),
            ("resume restore phases (ms): ", "of its restore, on the MLX thread"),
        ):
            found = [line.split(marker, 1)[1].strip() for line in lines if marker in line]
            print(f"    {what}: " + "; ".join(found))
    first_new, first_computed = statistics.median(firsts), statistics.median(computed)
    print(
        f"  resume after {received} tokens: {first_new * 1e3:.1f} ms to the first new token "
        f"(median of {len(firsts)}: {', '.join(f'{x * 1e3:.1f}' for x in firsts)}); "
        f"regenerating them took {regenerate_s * 1e3:.0f} ms ({regenerate_s / first_new:.0f}x)"
    )
    print(
        f"    the first token the restored engine computed: {first_computed * 1e3:.1f} ms "
        f"(samples {', '.join(f'{x * 1e3:.1f}' for x in computed)}; "
        f"{regenerate_s / first_computed:.0f}x)"
    )
    return {
        "tokens": received,
        "resume_first_token_s": first_new,
        "samples_s": firsts,
        "first_computed_token_s": first_computed,
        "computed_samples_s": computed,
        "regenerate_s": regenerate_s,
    }


def _wait_covered(store_address: str, client: EngineClient, tokens: int) -> None:
    """Until the store holds a checkpoint of at least `tokens` tokens (prompt included), as
    a crash after that point would find it. The snapshot covering what the client holds is
    taken at the next interval and queued a step later."""
    deadline = time.monotonic() + 120
    with StoreClient(store_address) as store:
        # A chain's later segments have no manifest of their own: its newest segment's
        # count is the generation's (generation_progress).
        while max(generation_progress(store).values(), default=0) < tokens:
            assert time.monotonic() < deadline, "no checkpoint covering the held tokens"
            client.flush()
            time.sleep(0.05)


def bench_batched_resume(stack: dict, vocab: int, streams: int, tokens: int) -> dict:
    """Kills the engine under `streams` concurrent checkpointed generations, resumes them all
    at once, and counts how many equal their uninterrupted run (run concurrently too)."""
    prompts = [random_prompt(64 + 7 * i, vocab, seed=300 + i) for i in range(streams)]

    def request(i: int, rid: str) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(
            token_ids=prompts[i],
            max_tokens=tokens,
            checkpoint_interval=8,
            request_id=rid,
            sampling=engine_pb2.SamplingParams(ignore_eos=True, temperature=0.8, seed=i),
        )

    async def run(address: str, reqs: list, stop_after: int = 0) -> list[list[int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)

            async def one(req: engine_pb2.GenerateRequest) -> list[int]:
                got: list[int] = []
                call = stub.Generate(req)
                async for message in call:
                    got.extend(message.token_ids)
                    if stop_after and len(got) >= stop_after:
                        call.cancel()
                        break
                return got

            return list(await asyncio.gather(*(one(r) for r in reqs)))

    address = stack["engine"].address
    full = asyncio.run(run(address, [request(i, f"ref-{i}") for i in range(streams)]))
    partial = asyncio.run(
        run(address, [request(i, f"cut-{i}") for i in range(streams)], stop_after=tokens // 2)
    )
    with EngineClient(address) as client:
        client.flush()
    stack["engine"].kill()
    stack["engine"] = stack["restart"]()
    resumes = []
    for i in range(streams):
        req = request(i, f"cut-{i}")
        req.resume, req.tokens_held = True, len(partial[i])
        resumes.append(req)
    rest = asyncio.run(run(stack["engine"].address, resumes))
    equal = sum(p + r == f for p, r, f in zip(partial, rest, full, strict=True))
    print(f"  {equal}/{streams} concurrently resumed streams equal their uninterrupted run")
    return {"streams": streams, "equal": equal}


def round_phases(log: Path) -> None:
    """The medians of the engine's debug lines on its checkpoint rounds (--engine-log-level
    debug), by the rows in a round: where the step loop's time on checkpoints goes."""
    by_rows: dict[str, dict[str, list[float]]] = {}
    together = taken = 0  # first snapshots cut from the batch together, of those taken
    for line in log.read_text(errors="replace").splitlines():
        if "first snapshots: " in line:
            cut, _, of = line.split("first snapshots: ", 1)[1].partition(" of ")
            together, taken = together + int(cut), taken + int(of.split()[0])
        for marker in ("checkpoint round phases (ms): ", "checkpoint capture phases (ms): "):
            if marker not in line:
                continue
            body, _, rows = line.split(marker, 1)[1].partition("(rows ")
            phases = by_rows.setdefault(rows.rstrip(")\n "), {})
            for part in body.split(","):
                name, _, value = part.strip().rpartition(" ")
                phases.setdefault(name, []).append(float(value))
    for rows, phases in sorted(by_rows.items()):
        shown = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in phases.items())
        print(f"  a round of {rows} row(s), medians (ms): {shown}")
    if taken:
        print(f"  first snapshots cut from the batch together: {together} of {taken}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--prompts", default="1024,4096")
    parser.add_argument("--resume-tokens", type=int, default=1000)
    parser.add_argument("--restore-tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--decode-tokens", type=int, default=256, help="tokens a stream in each decode-cost run"
    )
    parser.add_argument(
        "--decode-prompt",
        type=int,
        default=64,
        help="each stream's prompt in the decode-cost runs (its checkpoints carry it)",
    )
    parser.add_argument(
        "--decode-logprobs",
        type=int,
        default=-1,
        help="the decode-cost runs ask for logprobs with this many alternatives (-1: none); "
        "their checkpoints then write logprob pages too",
    )
    parser.add_argument(
        "--region-bytes",
        type=int,
        default=-1,
        help="the engine's --store-region-bytes (-1: its default, sized for the backend; a "
        "store hit larger than a free span streams)",
    )
    parser.add_argument(
        "--skip", default="", help="comma list of ttft,resume,batched,decode,restore,floor,local"
    )
    parser.add_argument(
        "--prefix-record-bits",
        type=int,
        default=0,
        help="the TTFT's prefix records compressed to 8 or 4 bits (0: exact)",
    )
    parser.add_argument(
        "--engine-log-level",
        default="info",
        help="debug: the resume's phases in the core (plan, wait, restore and step) printed",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    out: dict[str, object] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "blas": blas.in_use(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cores",
    }
    with tempfile.TemporaryDirectory(prefix="tandem-ckpt-bench-") as tmp:
        root = Path(tmp)
        spec = model_spec(args.model, root)
        port = free_port()
        store_proc = start_store_on(
            root / "store", port, "--capacity-bytes", str(64 << 30), "--sync-mode", "none"
        )
        store = StoreClient(f"127.0.0.1:{port}", timeout=1800)

        def engine_proc():  # noqa: ANN202
            return start_engine(
                root,
                "--model",
                spec,
                "--store",
                f"127.0.0.1:{port}",
                "--prefix-cache-bytes",
                "0",
                "--max-running",
                "8",
                "--spill-queue-bytes",
                str(16 << 30),
                "--store-region-bytes",
                str(args.region_bytes),
                "--log-level",
                args.engine_log_level,
                log_dir=root,
            )

        stack = {
            "engine": engine_proc(),
            "restart": engine_proc,
            "store": f"127.0.0.1:{port}",
            "log_dir": root,
        }
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset: a thread a core")
        print(
            f"model {args.model} on {out['device']} (BLAS {out['blas']}, OPENBLAS_NUM_THREADS "
            f"{threads}), medians of {args.repeat}"
        )
        try:
            with EngineClient(stack["engine"].address) as c:
                vocab = c.model_info().vocab_size
            if "ttft" not in skip:
                print("time to first token, store hit vs cold prefill:")
                out["ttft"] = bench_ttft(
                    stack["engine"].address,
                    store,
                    [int(x) for x in args.prompts.split(",")],
                    vocab,
                    args.repeat,
                    args.prefix_record_bits,
                )
                with EngineClient(stack["engine"].address) as c:
                    print(
                        "  engine checkpoint stats:", str(c.stats().checkpoints).replace("\n", "; ")
                    )
                if any(row["cached_tokens"] == 0 for row in out["ttft"]):
                    lines = (root / "engine.log").read_text().splitlines()
                    print("\n".join(x for x in lines if "WARN" in x or "ERROR" in x)[-3000:])
            if "resume" not in skip:
                print("resume after an engine crash vs regenerating:")
                out["resume"] = bench_resume(stack, vocab, args.resume_tokens, args.repeat)
            if "batched" not in skip:
                print("resume under continuous batching (8 streams, seeded):")
                out["batched_resume"] = bench_batched_resume(stack, vocab, 8, 64)
            if "decode" not in skip:
                print("decode with generation checkpoints every 16 tokens vs off:")
                out["decode"] = bench_decode(
                    stack["engine"].address,
                    vocab,
                    args.repeat,
                    args.decode_tokens,
                    args.decode_prompt,
                    args.decode_logprobs,
                )
                round_phases(root / "engine.log")  # lines only at --engine-log-level debug
            if "restore" not in skip:
                stack["engine"].stop()
                loaded = load_model(spec, root)
                print("restore bandwidth:")
                out["restore"] = bench_restore(
                    loaded,
                    store,
                    root / "store",
                    args.restore_tokens,
                    args.repeat,
                    args.region_bytes,
                )
            if "floor" not in skip:
                stack["engine"].stop()
                loaded = load_model(spec, root)
                print("raw mlx-lm BatchGenerator, 16 new tokens after the prefix:")
                lengths = [int(x) for x in args.prompts.split(",")]
                out["floor"] = bench_floor(loaded, lengths, args.repeat)
            if "local" not in skip:
                stack["engine"].stop()
                loaded = load_model(spec, root)
                print("local prefix hit, engine restore vs a host round trip:")
                out["local_hit"] = bench_local_hit(loaded, args.restore_tokens, args.repeat)
        finally:
            stack["engine"].stop()
            store.close()
            store_proc.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
