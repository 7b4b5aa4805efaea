"""Summarizes a `py-spy record --subprocesses --threads -f raw` file: for each process and
thread, the functions holding the most samples (inclusive), so a profile taken on a lent
device comes back as a page of text rather than the raw file.

    python bench/profile_summary.py RAW [--top 25] [--min-samples 200]
"""

from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--min-samples", type=int, default=200)
    args = parser.parse_args()
    totals: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(args.raw, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            # process "python -m engine_service.core.process ..." ; thread ; frames...
            process = re.sub(r"\s+--.*", "", frames[0])[:70]
            thread = re.sub(r"0x[0-9a-f]+", "", frames[1]) if len(frames) > 1 else ""
            where = f"{process} | {thread}"
            n = int(count)
            totals[where] += n
            for frame in set(frames[2:]):
                inclusive[where][frame] += n
    for where, total in totals.most_common():
        if total < args.min_samples:
            continue
        print(f"== {where}: {total} samples")
        for frame, n in inclusive[where].most_common(args.top):
            print(f"  {n:7d} {100 * n / total:5.1f}%  {frame[:140]}")


if __name__ == "__main__":
    main()
