"""A store hit against the floor under any store hit, interleaved (ABAB).

A: the engine (no local tier, so the hit is the store's) answers a follow-up turn of 16 new
   tokens after a prefix of --tokens tokens it saved to the store: time to its first token
   over gRPC.
B: raw mlx-lm's `BatchGenerator`, in this process, given that prefix's cache already in
   memory (a deep copy) and the same 16 tokens: time to its first token.

Each pair is a new prompt; the first pair warms both up and is dropped. Prints the median of
the paired ratios A / B and their spread (issue 37's CPU aim: within 1.3x).

With --routes direct,region, A is measured on two engines in each round, one reading store hits
straight out of the store's data file (--store-direct-reads on, the default) and one having
the store copy them into its region (off): each beside the same raw B.

    python bench/hit_floor_bench.py [--model tandem-tiny] [--tokens 4096] [--pairs 7]
        [--routes direct|region|direct,region]
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
# isort: on

from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.checkpoint_restore import random_prompt  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tandem_client.engine_client import GenerationChunk, Usage  # noqa: E402
from tests.servers import free_port, start_engine, start_store_on  # noqa: E402


def engine_hit(
    client: EngineClient,
    base: list[int],
    turn: list[int],
    namespace: str,
    think_s: float = 0.0,
    bits: int = 0,
    scheme: str | None = None,
) -> tuple[float, int]:
    """The follow-up's time to first token and the token, its prefix saved to the store
    first (and think_s of a user's pause between the answer and the next turn); bits: the
    prefix record compressed to 8 or 4 bits (0: exact); scheme: the codes' scheme ("affine",
    the default, or "turboquant": 4, 3 or 2 bits)."""
    where = dict(
        ignore_eos=True, namespace=namespace, prefix_record_bits=bits, prefix_record_scheme=scheme
    )
    client.generate(base, max_tokens=1, **where)
    client.flush()  # the prefix is in the store
    time.sleep(think_s)
    elapsed, usage, token = first_token(lambda: client.stream(base + turn, max_tokens=1, **where))
    if usage.cached_prompt_tokens < len(base) - 64:
        raise RuntimeError(f"not a store hit: {usage}")
    client.flush()  # its own prefix's save ends before the next measurement
    return elapsed, token


def engine_cold(client: EngineClient, prompt: list[int], namespace: str) -> float:
    """The engine's time to first token for a prompt nothing of which is stored."""
    elapsed, usage, _ = first_token(
        lambda: client.stream(prompt, max_tokens=1, ignore_eos=True, namespace=namespace)
    )
    if usage.cached_prompt_tokens:
        raise RuntimeError(f"not cold: {usage}")
    client.flush()
    return elapsed


def first_token(
    stream: Callable[[], Iterator[GenerationChunk]],
) -> tuple[float, Usage, int]:
    """The time from asking for a stream to its first token (its end may come a step later:
    the engine sends a first token as soon as it is sampled), the stream's usage and that
    token."""
    start = time.perf_counter()
    elapsed, token = 0.0, -1
    for chunk in stream():
        if chunk.token_ids and not elapsed:
            elapsed, token = time.perf_counter() - start, chunk.token_ids[0]
        if chunk.usage is not None:
            return elapsed, chunk.usage, token
    raise RuntimeError("no usage")


def raw_from_memory(loaded, base: list[int], turn: list[int]) -> tuple[float, int]:  # noqa: ANN001
    """mlx-lm's BatchGenerator from the prefix's cache in memory, to its first token: the
    time and the token."""
    cache = make_prompt_cache(loaded.model)
    for at in range(0, len(base), 2048):
        loaded.model(mx.array([base[at : at + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    copied = [copy.deepcopy(c) for c in cache]
    mx.eval([c.state for c in copied])
    generator = BatchGenerator(loaded.model, stop_tokens=set())
    start = time.perf_counter()
    generator.insert([turn], max_tokens=[1], caches=[copied])
    while not (responses := generator.next()[1]):
        pass
    return time.perf_counter() - start, responses[0].token


def phase_medians(log: Path, marker: str) -> str:
    """The medians of the "NAME VALUE" phases on the log's lines holding marker (the
    engine's and store's debug lines for direct hits), the first (warm-up) line left out."""
    rows = [
        line.split(marker, 1)[1]
        for line in log.read_text(errors="replace").splitlines()
        if marker in line
    ][1:]
    phases: dict[str, list[float]] = {}
    for row in rows:
        for part in row.split("(")[0].split(","):
            name, _, value = part.strip().rpartition(" ")
            phases.setdefault(name, []).append(float(value))
    return ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in phases.items())


def front_ttfts(log: Path) -> list[float]:
    """The engine front's time to first token of each store hit it logged (its request
    lines), the first (warm-up) left out."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if int(fields.get("cached_tokens", "0") or 0) > 0 and "ttft_s" in fields:
            out.append(float(fields["ttft_s"]))
    return out[1:] or out


def _launch_width_env(route: str) -> dict[str, str] | None:
    """direct-N-a-launch: the engine's environment that makes its direct hits launch N planes
    at a time."""
    match = re.fullmatch(r"direct-(\d+)-a-launch", route)
    return {"TANDEM_PLANES_PER_LAUNCH": match.group(1)} if match else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument(
        "--routes",
        default="direct",
        help="comma list of direct, region, and direct-N-a-launch (direct hits landed by "
        "launches of N planes each, TANDEM_PLANES_PER_LAUNCH=N, against the default: all in one)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="also the engine's cold prefill of a new prompt"
    )
    parser.add_argument(
        "--think-s", type=float, default=0.0, help="pause between a prefix's save and its hit"
    )
    parser.add_argument("--capacity-gib", type=int, default=8, help="the store's capacity")
    parser.add_argument(
        "--record-bits", type=int, default=0, help="prefix records as 8- or 4-bit codes"
    )
    parser.add_argument(
        "--record-scheme",
        choices=["affine", "turboquant"],
        default=None,
        help="the --record-bits codes' scheme (turboquant: 4, 3 or 2 bits)",
    )
    args = parser.parse_args()
    routes = args.routes.split(",")
    with tempfile.TemporaryDirectory(prefix="tandem-hit-floor-") as tmp:
        root = Path(tmp)
        spec = model_spec(args.model, root)
        port = free_port()
        store = start_store_on(
            root / "store",
            port,
            "--log-level",  # the direct Gets' phases (phase_medians)
            "debug",
            "--sync-mode",
            "none",
            "--capacity-bytes",
            str(args.capacity_gib << 30),
        )
        engines = {
            route: start_engine(
                root,
                "--model",
                spec,
                "--store",
                f"127.0.0.1:{port}",
                "--prefix-cache-bytes",
                "0",
                "--spill-queue-bytes",  # a 32k-token prefix of the 0.6B shape is 3.5 GiB
                str(16 << 30),
                "--store-direct-reads",
                "off" if route == "region" else "on",
                "--log-level",
                "debug",
                log_dir=root / route,
                env=_launch_width_env(route),
            )
            for route in routes
        }
        loaded = load_model(spec, root)
        hits: dict[str, list[float]] = {r: [] for r in routes}
        ratios: dict[str, list[float]] = {r: [] for r in routes}
        raws: list[float] = []
        colds: list[float] = []
        by_route, bandwidth = {}, {}
        same: dict[str, int] = {r: 0 for r in routes}  # first tokens equal to raw mlx-lm's
        warm: dict[str, tuple[int, float]] = {}
        try:
            clients = {r: EngineClient(e.address, timeout=1800) for r, e in engines.items()}
            vocab = clients[routes[0]].model_info().vocab_size
            for r in range(args.pairs + 1):
                base = random_prompt(args.tokens, vocab, seed=7_000 + r)
                turn = random_prompt(16, vocab, seed=r)
                got = {
                    k: engine_hit(
                        c,
                        base,
                        turn,
                        f"{k}-{r}",
                        args.think_s,
                        args.record_bits,
                        args.record_scheme,
                    )
                    for k, c in clients.items()
                }
                raw, raw_token = raw_from_memory(loaded, base, turn)
                cold = 0.0
                if args.cold:
                    fresh = random_prompt(args.tokens, vocab, seed=9_000 + r) + turn
                    cold = engine_cold(clients[routes[0]], fresh, f"cold-{r}")
                if not r:  # the first round warms everything up
                    for k, c in clients.items():
                        stats = c.stats().checkpoints
                        warm[k] = (stats.restored_bytes, stats.restore_seconds)
                    continue
                raws.append(raw)
                if args.cold:
                    colds.append(cold)
                for k, (hit, token) in got.items():
                    hits[k].append(hit)
                    ratios[k].append(hit / raw)
                    same[k] += token == raw_token
                shown = ", ".join(f"{k} hit {v[0] * 1e3:7.1f} ms" for k, v in got.items())
                print(f"  round {r}: {shown}, raw {raw * 1e3:7.1f} ms, cold {cold * 1e3:7.1f} ms")
            for k, c in clients.items():
                stats = c.stats().checkpoints
                by_route[k] = dict(stats.store_reads_by_route)
                moved = stats.restored_bytes - warm[k][0]
                bandwidth[k] = moved / max(stats.restore_seconds - warm[k][1], 1e-9) / 1e9
                c.close()
        finally:
            for engine in engines.values():
                engine.stop()
            store.stop()
        phases = {}
        for route in routes:
            if route.startswith("direct"):
                engine_log = root / route / "engine.log"
                phases[route] = (
                    phase_medians(engine_log, "direct hit phases (ms):"),
                    phase_medians(engine_log, "direct gather phases (ms):"),
                    phase_medians(engine_log, "first token phases, store hit (ms):"),
                    statistics.median(front_ttfts(engine_log)) * 1e3,
                )
        store_phases = phase_medians(root / "store-store.log", "direct Get phases (ms):")
    print(
        f"{args.model} on {mx.default_device()}, {args.tokens} + 16 tokens, {args.pairs} rounds,"
        f" records {args.record_bits or 'exact'}{'-bit' if args.record_bits else ''}"
        f"{' ' + args.record_scheme if args.record_bits and args.record_scheme else ''}:"
        f" raw mlx-lm from memory {statistics.median(raws) * 1e3:.1f} ms"
    )
    for k in routes:
        print(
            f"  {k}: store hit {statistics.median(hits[k]) * 1e3:.1f} ms; hit / raw median"
            f" {statistics.median(ratios[k]):.2f} ({min(ratios[k]):.2f}-{max(ratios[k]):.2f});"
            f" store reads by route {by_route[k]}; restores {bandwidth[k]:.1f} GB/s end to end;"
            f" first tokens equal to raw mlx-lm's {same[k]}/{len(hits[k])}"
        )
        if colds:
            gain = [c / h for c, h in zip(colds, hits[k], strict=True)]
            print(
                f"    cold prefill {statistics.median(colds) * 1e3:.1f} ms; cold / hit median"
                f" {statistics.median(gain):.2f} ({min(gain):.2f}-{max(gain):.2f})"
            )
    if phases:
        print(f"  direct Gets' phases in the store, medians (ms): {store_phases}")
    for route, (engine_phases, gather_phases, first_token, front_ttft) in phases.items():
        print(f"  {route} hits' phases, medians (ms): engine {engine_phases}")
        print(
            f"    in the core, arrival to first token: {first_token}; the front's time to"
            f" first token {front_ttft:.1f} ms"
        )
        if gather_phases:  # MLX-CUDA only
            print(f"    of its caches: {gather_phases}")
    if len(routes) == 2:
        paired = [a / b for a, b in zip(hits[routes[0]], hits[routes[1]], strict=True)]
        print(
            f"  {routes[0]} / {routes[1]} hit, median of paired ratios"
            f" {statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"
        )


if __name__ == "__main__":
    main()
