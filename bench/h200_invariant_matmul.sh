#!/usr/bin/env bash
# Issue 39's one-stream cost on the lent H200 (after the set-up of h200_determinism.sh): the
# batch-invariant projection kernel alone against MLX's matmul and the padded block, then the
# deterministic mode with it (--kernel: the engine's --deterministic-matmul kernel).
set -u
out=${OUT:-/tmp}
timeout 60 python3 bench/invariant_matmul_bench.py --rounds 15 2>&1 | tee "$out/invariant_matmul.txt"
timeout 240 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --batches 8,32,128 \
  --tokens 128 --streams 1,8,32,128 --cost-tokens 48 --pairs 3 --kernel 2>&1 | tee "$out/kernel_06b.txt"
timeout 110 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 1,8 --cost-tokens 32 --pairs 3 --kernel 2>&1 | tee "$out/kernel_8b.txt"
