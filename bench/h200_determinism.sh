#!/usr/bin/env bash
# Issue 39's deterministic mode on the lent H200, after `. .whl2/device-setup.sh` and the
# project's other wheels (../shared/gpu/README.md). Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
# Where a row's bits first depend on its batch, op by op: today, then with the mode.
for mode in "" --deterministic; do
  timeout 120 python3 bench/batch_invariance.py --model qwen3-0.6b-shape --batches 2,8,32,128 \
    --steps 4 $mode 2>&1 | tee -a "$out/batch_invariance.txt"
done
# The kernel against MLX's SDPA; agreement of 8 target rows with their solo runs inside
# batches of 8/32/128, greedy and seeded, over 256 tokens, mode off and on; the mode's cost.
timeout 330 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --batches 8,32,128 \
  --tokens 256 --streams 1,8,32,128 --cost-tokens 64 --pairs 3 2>&1 | tee "$out/determinism_06b.txt"
