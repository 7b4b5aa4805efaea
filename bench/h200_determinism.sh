#!/usr/bin/env bash
# Issue 39's deterministic mode on the lent H200, after `. .whl2/device-setup.sh` and the
# project's other wheels (../shared/gpu/README.md). Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
# The start-up probe on the device (the served shape and a mixture-of-experts zoo shape); the
# kernel against MLX's SDPA and compiled against eager; agreement of 8 target rows with their
# solo runs inside batches of 8/32/128, greedy and seeded, over 256 tokens, mode off and on
# (on: the engine's rows, steps of up to 8 rows compiled); the mode's cost against the
# engine's default and mlx-lm's BatchGenerator at 1/8/32/128 streams.
timeout 560 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --batches 8,32,128 \
  --tokens 256 --streams 1,8,32,128 --cost-tokens 48 --pairs 3 --probe-zoo qwen3_moe,llama3 \
  2>&1 | tee "$out/determinism_06b.txt"
