#!/usr/bin/env bash
# Issue 39's cost of deterministic mode on the lent H200 (after the set-up of h200_determinism.sh):
# decode tokens/s with the mode off and on, ABAB, Qwen3-0.6B shape and Llama-3-8B shape.
set -u
out=${OUT:-/tmp}
# Next run: 128 streams, which the 2026-12-04 runs did not reach:
#   python3 bench/determinism_bench.py --model qwen3-0.6b-shape --skip-agreement --streams 128
timeout 80 python3 bench/batch_invariance.py --model qwen3-0.6b-shape --batches 8,128 \
  --steps 2 --deterministic 2>&1 | tail -1 | tee "$out/invariance_check.txt"
timeout 170 python3 bench/determinism_bench.py --model qwen3-0.6b-shape --skip-agreement \
  --streams 1,8,32,128 --cost-tokens 48 --pairs 3 2>&1 | tee "$out/cost_06b.txt"
timeout 150 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 8,32 --cost-tokens 32 --pairs 3 2>&1 | tee "$out/cost_8b.txt"
