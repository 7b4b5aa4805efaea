"""`n = 4` against four separate requests for the same prompt (issue 36), through the gateway.

One engine with a store behind a gateway. Each pair runs, in alternating order (ABAB):
- baseline: four `/v1/completions` requests for one prompt sent together, as a client
  without `n` would (each in its own namespace, so none finds another's prefix; sent
  together, they would race for it anyway);
- ours: one request with `n = 4`.
Each pair uses a fresh prompt, so neither side finds a prefix from an earlier round. Reported:
wall time until all four completions are in (median of the paired ratios, and their
spread), and how many whole prompts the engine prefilled (its Stats' prefix misses; a hit
feeds only the prompt's last token).

    python bench/openai_n_bench.py [--pairs 7] [--prompt-tokens 1024] [--tokens 32]
        [--model tandem-tiny|SHAPE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.shapes import model_spec  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tests.servers import GatewayProcess, start_engine, start_store  # noqa: E402

N = 4


def _post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        base + "/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        result: dict[str, Any] = json.load(reply)
        return result


def _prefilled(engine: EngineClient) -> int:
    """Whole prompts the engine prefilled so far (prefix lookups that found nothing)."""
    return int(engine.stats().checkpoints.prefix_misses)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", default="tandem-tiny", help="the embedded default or a SHAPE")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="openai-n-"))
    store = start_store(root / "store")
    model = model_spec(args.model, root)
    engine = start_engine(root / "data", "--model", model, "--store", store.address, log_dir=root)
    gateway = GatewayProcess([engine.address], root / "gateway.log")
    gateway.wait_engines(1)
    client = EngineClient(engine.address)

    def body(pair: int, side: str) -> dict[str, Any]:
        ids = [
            (pair * 7919 + i * 31 + (side == "n") * 13) % 1800 + 5
            for i in range(args.prompt_tokens)
        ]
        return {  # no "model": the one the engine serves
            "prompt": ids,
            "max_tokens": args.tokens,
            "seed": abs(pair),
            "tandem": {"ignore_eos": True},
        }

    def separate(pair: int) -> tuple[float, int]:
        before = _prefilled(client)
        start = time.perf_counter()
        with ThreadPoolExecutor(N) as pool:
            bodies = [
                {**body(pair, "sep"), "tandem": {"ignore_eos": True, "namespace": f"s{pair}-{i}"}}
                for i in range(N)
            ]
            replies = list(pool.map(lambda b: _post(gateway.http, b), bodies))
        took = time.perf_counter() - start
        assert all(r["usage"]["completion_tokens"] == args.tokens for r in replies)
        return took, _prefilled(client) - before

    def choices(pair: int) -> tuple[float, int]:
        before = _prefilled(client)
        start = time.perf_counter()
        reply = _post(gateway.http, {**body(pair, "n"), "n": N})
        took = time.perf_counter() - start
        assert reply["usage"]["completion_tokens"] == N * args.tokens
        return took, _prefilled(client) - before

    try:
        separate(-1), choices(-1)  # warm both
        rows = []
        for pair in range(args.pairs):
            order = [separate, choices] if pair % 2 == 0 else [choices, separate]
            got = {run.__name__: run(pair) for run in order}
            rows.append(got)
            (a, a_tok), (b, b_tok) = got["separate"], got["choices"]
            print(
                f"pair {pair}: four requests {a:.2f} s ({a_tok} prefills); "
                f"n=4 {b:.2f} s ({b_tok} prefills); ratio {a / b:.2f}",
                flush=True,
            )
        ratios = [r["separate"][0] / r["choices"][0] for r in rows]
        print(
            f"wall: four separate / n=4 median {statistics.median(ratios):.2f} "
            f"(spread {min(ratios):.2f}-{max(ratios):.2f}); whole prompts prefilled: "
            f"four separate {statistics.median(r['separate'][1] for r in rows)}, "
            f"n=4 {statistics.median(r['choices'][1] for r in rows)} (medians)"
        )
    finally:
        client.close()
        gateway.stop()
        engine.stop()
        store.stop()


if __name__ == "__main__":
    main()
