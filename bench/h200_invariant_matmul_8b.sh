#!/usr/bin/env bash
# Issue 39 on the lent H200, after h200_invariant_matmul.sh: the 8B shape at 128 streams,
# the deterministic mode with the invariant kernel and with padded blocks.
set -u
out=${OUT:-/tmp}
timeout 280 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 128 --cost-tokens 32 --pairs 3 --kernel 2>&1 | tee "$out/kernel_8b_128.txt"
timeout 280 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 128 --cost-tokens 32 --pairs 3 2>&1 | tee "$out/blocks_8b_128.txt"
