"""Time to the next token across a node loss (issue 34), beside the inter-token gap.

Two nodes (a store with --tier and an engine each) on a local Valkey cluster behind the
gateway, as tests/test_tier_nodes.py builds them. Each round streams 8 seeded generations
through the gateway's gRPC front and loses the busiest node (store and engine SIGKILLed,
its disk gone) after ~30% of the tokens; the streams it carried resume on the other node
from the tier's checkpoints. For every stream that moved, the gap around the loss (the last
token before it to the first after it) is set beside the median gap between its tokens
outside the loss, measured in the same stream.

    python bench/node_loss_bench.py [--rounds 3] [--tokens 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from tandem_client import EngineClient  # noqa: E402
from tests.servers import GatewayProcess, start_engine  # noqa: E402
from tests.test_tier_nodes import Node  # noqa: E402
from tests.tier_stack import start_cluster  # noqa: E402

STREAMS = 8


@dataclass
class Timed:
    index: int
    arrivals: list[float] = field(default_factory=list)  # one per token
    failovers: int = 0
    error: str = ""


def stream(address: str, s: Timed, tokens: int, progress: list[int]) -> None:
    try:
        with EngineClient(address) as client:
            for chunk in client.stream(
                f"Story number {s.index} begins:",
                max_tokens=tokens,
                seed=1000 + s.index,
                temperature=0.9,
                ignore_eos=True,
            ):
                now = time.perf_counter()
                s.arrivals += [now] * len(chunk.token_ids)
                progress[0] += len(chunk.token_ids)
                if chunk.usage is not None:
                    s.failovers = chunk.usage.failovers
    except Exception as exc:  # noqa: BLE001 - reported
        s.error = repr(exc)


def gaps(s: Timed, lost_at: float) -> tuple[float, float]:
    """(the gap that spans the loss, the median of the others) in seconds."""
    spans = [(b - a, a, b) for a, b in zip(s.arrivals, s.arrivals[1:], strict=False) if b > a]
    across = [g for g, a, b in spans if a <= lost_at <= b]
    others = [g for g, a, b in spans if not a <= lost_at <= b]
    return (max(across) if across else 0.0), statistics.median(others)


def loss_args() -> argparse.Namespace:
    """--rounds, --tokens and --json, as both loss benches take them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--json")
    return parser.parse_args()


def main() -> None:
    args = loss_args()
    root = Path(tempfile.mkdtemp(prefix="node-loss-"))
    data_dir = root / "engine-data"
    start_engine(data_dir).stop()  # builds the embedded model once
    cluster = start_cluster(root / "valkey", primaries=3, replicas=0)
    nodes = [Node(root / name, cluster, data_dir).start() for name in "ab"]
    gateway = GatewayProcess(
        [n.engine.address for n in nodes if n.engine is not None],
        root / "gateway.log",
        "--checkpoint-interval",
        "8",
        "--poll-interval",
        "0.2",
    )
    gateway.wait_engines(2)
    results = []
    try:
        for r in range(args.rounds):
            streams = [Timed(i) for i in range(STREAMS)]
            progress = [0]
            threads = [
                threading.Thread(target=stream, args=(gateway.grpc, s, args.tokens, progress))
                for s in streams
            ]
            for t in threads:
                t.start()
            while progress[0] < STREAMS * args.tokens * 3 // 10:
                time.sleep(0.005)
            running = []
            for node in nodes:
                assert node.engine is not None
                with EngineClient(node.engine.address) as c:
                    running.append(c.stats().running)
            victim = nodes[max(range(2), key=lambda i: running[i])]
            lost_at = time.perf_counter()
            victim.lose()
            for t in threads:
                t.join(300)
            for s in streams:
                if s.error:
                    raise SystemExit(f"round {r} stream {s.index}: {s.error}")
                if s.failovers:
                    across, usual = gaps(s, lost_at)
                    results.append((across, usual))
            moved = sum(s.failovers > 0 for s in streams)
            print(f"round {r}: {moved} of {STREAMS} streams moved", flush=True)
            victim.start()
            gateway.wait_engines(2)
    finally:
        gateway.stop()
        for node in nodes:
            node.stop()
        cluster.stop()
    report(
        f"node loss under {STREAMS} streams x {args.tokens} tokens, {args.rounds} rounds",
        results,
        args.json,
    )


def report(title: str, results: list[tuple[float, float]], json_path: str | None) -> None:
    """The gaps across the loss beside the usual ones, printed (and written as JSON)."""
    across = [a for a, _ in results]
    usual = [u for _, u in results]
    ratios = [a / u for a, u in results if u > 0]
    print(
        f"{title}, {len(results)} streams: time to the next token across the loss median "
        f"{statistics.median(across) * 1e3:.0f} ms (min {min(across) * 1e3:.0f}, max "
        f"{max(across) * 1e3:.0f}); the same streams' inter-token gap median "
        f"{statistics.median(usual) * 1e3:.1f} ms; ratio median {statistics.median(ratios):.0f}x "
        f"({min(ratios):.0f}-{max(ratios):.0f})"
    )
    if json_path:
        Path(json_path).write_text(json.dumps({"across_s": across, "usual_s": usual}))


if __name__ == "__main__":
    main()
