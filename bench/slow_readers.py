"""A normal client beside 32 streams whose clients stopped reading: parking on vs off.

Two engines run side by side (same model, --max-running 32): one with --park-after-tokens 0
(the baseline: unread streams keep their slots, as in any engine without preemption), one
with parking on. Each round opens 32 streams on each, never read (their channel has a 1 KiB
HTTP/2 window), waits until the parking engine parked them, then times a normal client's
16-token generation on each, in alternating order (ABAB); the ratio is baseline / parking
time of each round.

    python bench/slow_readers.py [--rounds 3] [--unread-tokens 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import grpc  # noqa: E402

from tandem_client import EngineClient  # noqa: E402
from tandem_client.engine_client import generate_request  # noqa: E402
from tandem_wire.pb import engine_pb2_grpc  # noqa: E402
from tests.servers import start_engine  # noqa: E402

SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def open_unread(address: str, n: int, tokens: int, tag: str) -> tuple[grpc.Channel, list]:  # noqa: ANN001
    channel = grpc.insecure_channel(address, options=SMALL_WINDOW)
    stub = engine_pb2_grpc.EngineStub(channel)
    calls = []
    for i in range(n):
        req = generate_request([5, 6, 7, 8 + i], max_tokens=tokens, request_id=f"{tag}-{i}")
        req.sampling.ignore_eos = True
        calls.append(stub.Generate(req, timeout=600))
    return channel, calls


def normal_client(address: str) -> float:
    start = time.perf_counter()
    with EngineClient(address, timeout=600) as c:
        c.generate("a normal client", max_tokens=16, ignore_eos=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--unread-tokens", type=int, default=600)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slow-readers-"))
    engines = {
        "no parking": start_engine(root / "a", "--park-after-tokens", "0"),
        "parking": start_engine(root / "b", "--park-after-tokens", "256"),
    }
    try:
        for engine in engines.values():  # warm both
            normal_client(engine.address)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(a.rounds):
            opened = {
                name: open_unread(e.address, 32, a.unread_tokens, f"r{r}")
                for name, e in engines.items()
            }
            # Measure once the parking engine has parked them all (the baseline's streams
            # are decoding meanwhile, as they would).
            with EngineClient(engines["parking"].address) as c:
                deadline = time.monotonic() + 300
                while c.stats().parked < 32 and time.monotonic() < deadline:
                    time.sleep(0.2)
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                times[name].append(normal_client(engines[name].address))
            for channel, calls in opened.values():
                for call in calls:
                    call.cancel()
                channel.close()
            for e in engines.values():  # let the cancels land
                with EngineClient(e.address) as c:
                    while c.stats().running or c.stats().parked:
                        time.sleep(0.2)
            print(
                f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in engines), flush=True
            )
        ratios = [b / p for b, p in zip(times["no parking"], times["parking"], strict=True)]
        print(
            f"normal client, 16 tokens beside 32 unread streams: no parking median "
            f"{statistics.median(times['no parking']):.2f}s, parking median "
            f"{statistics.median(times['parking']):.2f}s; "
            f"ratio median {statistics.median(ratios):.1f}x "
            f"(spread {min(ratios):.1f}-{max(ratios):.1f}x, {a.rounds} rounds)"
        )
    finally:
        for e in engines.values():
            e.stop()


if __name__ == "__main__":
    main()
