#!/usr/bin/env bash
# Issue 19's structured-output figures on the lent H200, after `. .whl2/device-setup.sh`
# (../shared/gpu/README.md). .whl2 also holds mistral-common's Tekken vocabulary
# (tekken_240911.json.xz, for bench/vocab_masks.py). Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
timeout 120 python3 bench/vocab_masks.py --tekken .whl2/tekken_240911.json.xz --rows 32 \
  --steps 100 2>&1 | tee "$out/vocab_masks.txt"
timeout 260 python3 bench/structured_bench.py --model qwen3-0.6b-shape --constrained 0,8,32 \
  --pairs 4 2>&1 | tee "$out/structured_qwen06b.txt"
timeout 170 python3 bench/structured_bench.py --model llama3-8b-shape --constrained 32 \
  --pairs 3 --replay-tokens 200 2>&1 | tee "$out/structured_llama8b.txt"
