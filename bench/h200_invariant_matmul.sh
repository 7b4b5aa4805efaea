#!/usr/bin/env bash
# Issue 39's one-stream cost on the lent H200 (after the set-up of h200_determinism.sh): the
# batch-invariant projection kernel alone against MLX's matmul and the padded block, then the
# deterministic mode with it (--kernel: the engine's --deterministic-matmul kernel).
# 2026-12-04 it ran with agreement in the 0.6B call, which used up the call before the cost
# table; the next run takes the costs alone (agreement with the kernel was 8/8 that day).
set -u
out=${OUT:-/tmp}
timeout 60 python3 bench/invariant_matmul_bench.py --rounds 15 2>&1 | tee "$out/invariant_matmul.txt"
timeout 200 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --skip-agreement \
  --streams 1,8,32,128 --cost-tokens 48 --pairs 3 --kernel 2>&1 | tee "$out/kernel_06b.txt"
timeout 200 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 1,8,32 --cost-tokens 32 --pairs 3 --kernel 2>&1 | tee "$out/kernel_8b.txt"
