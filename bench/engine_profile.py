"""Where the engine's decode time goes at many streams: py-spy samples the engine core and
the gRPC front while N concurrent streams run, and prints, per process and thread, how busy
it was (share of wall time on a CPU) and the frames it was busiest in.

    python bench/engine_profile.py [--model qwen3-0.6b-shape] [--streams 128] [--rounds 3]
        [--py-spy .venv/bin/py-spy]

A diagnostic, not a figure: sampling slows both processes.
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.engine_bench import model_spec, prompts, through_engine  # noqa: E402
from tests.servers import child_pids, start_engine  # noqa: E402

IDLE = ("Condition.wait", "_wait_once", "EpollSelector.select", "Queue.get", "select", "poll")
RATE = 200


def summarize(name: str, raw: Path, seconds: float, top: int) -> None:
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    busy: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if frames[-1] in IDLE:
            continue
        thread = frames[0]
        busy[thread] += int(count)
        for frame in set(frames[1:]):
            threads[thread][frame] += int(count)
    for thread, samples in busy.most_common(4):
        share = samples / (RATE * seconds)
        print(f"{name} {thread}: busy {100 * share:.0f}% of the wall time")
        for frame, n in threads[thread].most_common(top):
            print(f"    {frame:<48} {100 * n / samples:5.1f}%")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--py-spy", default=str(ROOT / ".venv" / "bin" / "py-spy"))
    p.add_argument("--engine-arg", action="append", default=[], help="more engine flags")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-engine-profile-") as tmp:
        root = Path(tmp)
        spec = model_spec(a.model, root)
        engine = start_engine(root, "--model", spec, "--max-running", str(a.streams), log_dir=root)
        try:
            (core,) = child_pids(engine.pid)
            vocab = 1000
            for seed in (1, 2):  # warm
                through_engine(engine.address, prompts(a.streams, 64, vocab, seed), a.max_tokens)
            spies = {
                name: subprocess.Popen(
                    [a.py_spy, "record", "-p", str(pid), "-o", str(root / f"spy-{name}")]
                    + ["-f", "raw", "-r", str(RATE), "--nonblocking", "--threads"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for name, pid in (("core", core), ("front", engine.pid))
            }
            time.sleep(1.0)
            start = time.monotonic()
            for r in range(a.rounds):
                batch = prompts(a.streams, 64, vocab, 100 + r)
                result = through_engine(engine.address, batch, a.max_tokens)
                tps, ttft = result["tokens_per_s"], result["ttft_s"]
                print(f"round {r}: {tps:.0f} tok/s, TTFT {ttft:.3f} s")
            seconds = time.monotonic() - start + 1.0
            for spy in spies.values():
                spy.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
            for spy in spies.values():
                spy.wait(60)
            for name in spies:
                summarize(name, root / f"spy-{name}", seconds, a.top)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
