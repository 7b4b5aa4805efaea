"""Where a store hit's time to first token goes inside the engine: py-spy samples the engine
process while it serves store hits, and the inclusive share of the frames that matter is
printed per thread (MLX loop, handler threads, spill).

    python bench/hit_profile.py [--model tandem-tiny] [--prompt 4096] [--hits 20]
        [--py-spy .venv/bin/py-spy]

Every hit is a fresh 16-token turn on one stored prefix (the engine's local tier is off, so
each is restored from the store). A diagnostic, not a figure: sampling slows the engine.
"""

from __future__ import annotations

import argparse
import collections
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.checkpoint_bench import _ttft  # noqa: E402
from bench.checkpoint_restore import random_prompt  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tests.servers import free_port, start_engine, start_store_on  # noqa: E402

# Frames whose inclusive share is printed, in this order, when they were sampled.
WATCHED = (
    "Scheduler._run",
    "Scheduler._admit",
    "PrefixReuse.materialize",
    "Arrival.wait",
    "Landing.array",
    "PinnedLanding.array",
    "PinnedLanding.settle",
    "NewRows.insert",
    "Scheduler._step",
    "BatchGenerator.next",
    "PromptProcessingBatch.prompt",
    "PromptProcessingBatch.generate",
    "GenerationBatch.next",
    "StepCheckpoints.save_prefixes",
    "PrefixReuse.save",
    "Scheduler._flush_outbox",
    "Scheduler._drain_inbox",
    "Planner.plan",
    "PrefixReuse.find",
    "StoreClient.lookup",
    "StoreClient.get_held",
    "block_hashes",
    "EngineServicer.Generate",
    "SpillQueue._run",
)


def summarize(raw: Path) -> None:
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    samples: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if frames[-1] in ("Condition.wait", "_wait_once", "EpollSelector.select", "Queue.get"):
            continue  # idle
        thread = next((f for f in frames if f in WATCHED[:1] + ("_worker", "SpillQueue._run")), "")
        thread = thread or frames[min(3, len(frames) - 1)]
        samples[thread] += int(count)
        for name in set(frames):
            by_thread[thread][name] += int(count)
    for thread, total in samples.most_common(6):
        print(f"thread around {thread}: {total} busy samples")
        for name in WATCHED:
            n = by_thread[thread][name]
            if n:
                print(f"    {name:<34} {100 * n / total:5.1f}%")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--hits", type=int, default=20)
    p.add_argument("--py-spy", default=str(ROOT / ".venv" / "bin" / "py-spy"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-hit-profile-") as tmp:
        root = Path(tmp)
        port = free_port()
        store = start_store_on(
            root / "store", port, "--capacity-bytes", str(64 << 30), "--sync-mode", "none"
        )
        engine = start_engine(
            root,
            "--model",
            model_spec(a.model, root),
            "--store",
            f"127.0.0.1:{port}",
            "--prefix-cache-bytes",
            "0",
            log_dir=root,
        )
        try:
            with EngineClient(engine.address, timeout=1800) as client:
                vocab = client.model_info().vocab_size
                base = random_prompt(a.prompt, vocab, seed=1)
                _ttft(client, base, "profile")
                client.flush()
                turns = [base + random_prompt(16, vocab, seed=1000 + i) for i in range(a.hits + 2)]
                for turn in turns[:2]:  # warm: kernels, the cost model's first measurements
                    _ttft(client, turn, "profile")
                spy = subprocess.Popen(
                    [a.py_spy, "record", "-p", str(engine.proc.pid), "-o", str(root / "spy")]
                    + ["-f", "raw", "-r", "250", "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)
                hits = [_ttft(client, turn, "profile")[0] for turn in turns[2:]]
                spy.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
                spy.wait(30)
                stats = client.stats().checkpoints
            median_ms = statistics.median(hits) * 1e3
            print(
                f"{a.model}, {a.prompt + 16} tokens, {a.hits} store hits under py-spy: TTFT "
                f"median {median_ms:.1f} ms (store hits {stats.prefix_hits_store})"
            )
            summarize(root / "spy")
        finally:
            engine.stop()
            store.stop()


if __name__ == "__main__":
    main()
