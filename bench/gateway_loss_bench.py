"""Time to the next token across a gateway's loss (issue 35), beside the inter-token gap.

Three engines on one store behind two gateways, as tests/test_gateway_pair.py builds them.
Each round streams 8 seeded generations through the Python client given both gateways'
addresses (each stream starts on the first) and SIGKILLs that gateway after ~30% of the
tokens; the client resumes each stream through the other with its request id and the tokens
it holds. For every stream, the gap around the loss (the last token before it to the first
after it) is set beside the median gap between its tokens outside the loss, measured in the
same stream. The killed gateway is started again (new ports) for the next round.

    python bench/gateway_loss_bench.py [--rounds 3] [--tokens 96] [--json out.json]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.node_loss_bench import STREAMS, Timed, gaps, loss_args, report, stream  # noqa: E402
from tests.servers import GatewayProcess, start_engine, start_store  # noqa: E402

GATEWAY_FLAGS = ["--checkpoint-interval", "8", "--poll-interval", "0.2"]


def main() -> None:
    args = loss_args()
    root = Path(tempfile.mkdtemp(prefix="gateway-loss-"))
    data_dir = root / "engine-data"
    store = start_store(root / "store")
    engines = [
        start_engine(data_dir, "--store", store.address, log_dir=root / f"e{i}") for i in range(3)
    ]
    addresses = [e.address for e in engines]
    survivor = GatewayProcess(addresses, root / "gateway-b.log", *GATEWAY_FLAGS)
    survivor.wait_engines(3)
    results: list[tuple[float, float]] = []
    try:
        for r in range(args.rounds):
            victim = GatewayProcess(addresses, root / f"gateway-a{r}.log", *GATEWAY_FLAGS)
            victim.wait_engines(3)
            both = f"{victim.grpc},{survivor.grpc}"
            streams = [Timed(i) for i in range(STREAMS)]
            progress = [0]
            threads = [
                threading.Thread(target=stream, args=(both, s, args.tokens, progress))
                for s in streams
            ]
            for t in threads:
                t.start()
            while progress[0] < STREAMS * args.tokens * 3 // 10:
                time.sleep(0.005)
            lost_at = time.perf_counter()
            victim.proc.kill()
            victim.proc.wait(30)
            for t in threads:
                t.join(300)
            for s in streams:
                if s.error:
                    raise SystemExit(f"round {r} stream {s.index}: {s.error}")
                if len(s.arrivals) != args.tokens:
                    raise SystemExit(f"round {r} stream {s.index}: {len(s.arrivals)} tokens")
                results.append(gaps(s, lost_at))
            print(f"round {r}: {STREAMS} streams went on through the other gateway", flush=True)
    finally:
        survivor.stop()
        for e in engines:
            e.stop()
        store.stop()
    title = f"gateway loss under {STREAMS} streams x {args.tokens} tokens, {args.rounds} rounds"
    report(title, results, args.json)


if __name__ == "__main__":
    main()
