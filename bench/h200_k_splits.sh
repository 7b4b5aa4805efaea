#!/usr/bin/env bash
# Issue 39 on the lent H200 (after the set-up of h200_determinism.sh): the projection kernel's
# K splits a block (warps; model/invariant_matmul_cuda.py `k_splits`) on every projection of
# the Llama-3-8B shape at 1, 8 and 128 rows, then the 8B's deterministic mode with the kernel
# at one and 8 streams with 16 splits a block wherever the shape allows (the default is 4).
set -u
out=${OUT:-/tmp}
timeout 150 python3 bench/invariant_matmul_bench.py --shapes 8b --rows 1,8,128 \
  --splits 4,8,16,32 --rounds 10 --reps 32 2>&1 | tee "$out/k_splits_8b.txt"
timeout 300 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 1,8 --cost-tokens 32 --pairs 3 --kernel --k-splits ${SPLITS:-16} 2>&1 \
  | tee "$out/kernel_8b_splits.txt"
