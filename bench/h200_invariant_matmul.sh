#!/usr/bin/env bash
# Issue 39's cost on the lent H200 (after the set-up of h200_determinism.sh): the
# batch-invariant projection kernel alone (at 1, 2 and 4 column tiles a block) against MLX's
# matmul and the padded block, then the deterministic mode with it (--kernel: the engine's
# --deterministic-matmul kernel) on both shapes.
set -u
out=${OUT:-/tmp}
timeout 100 python3 bench/invariant_matmul_bench.py --rounds 10 --reps 32 2>&1 |
  tee "$out/invariant_matmul.txt"
timeout 230 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --skip-agreement \
  --streams 1,8,32,128 --cost-tokens 48 --pairs 3 --kernel 2>&1 | tee "$out/kernel_06b.txt"
timeout 240 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 1,8,32 --cost-tokens 32 --pairs 3 --kernel 2>&1 | tee "$out/kernel_8b.txt"
