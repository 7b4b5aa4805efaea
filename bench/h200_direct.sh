#!/usr/bin/env bash
# Issue 37's direct reads on the lent H200, after `. .whl2/device-setup.sh` and the project's
# other wheels (../shared/gpu/README.md). Part a: the landing checked byte for byte and timed
# against the region, then the 0.6B shape's store hits at 8k tokens, direct and through the
# region, beside the engine's cold prefill and raw mlx-lm from memory (ABAB), and 8-bit records.
# Part b: the landing again, the 0.6B shape at 32k tokens and the 8B shape at 8k. Part c:
# the 32k line alone.
# Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
hit="python3 bench/hit_floor_bench.py --cold"
if [ "${1:-a}" = "c" ]; then  # the 32k line alone
  timeout 170 $hit --model qwen3-0.6b-shape --tokens 32768 --pairs 2 --routes direct,region \
    --think-s 1.0 --capacity-gib 40 2>&1 | tee "$out/hit_32k.txt"
  exit
fi
timeout 70 python3 bench/direct_landing_check.py --mib 896 --rounds 5 2>&1 | tee "$out/landing.txt"
if [ "${1:-a}" = "a" ]; then
  timeout 300 $hit --model qwen3-0.6b-shape --tokens 8192 --pairs 7 --routes direct,region \
    --think-s 0.5 2>&1 | tee "$out/hit_8k.txt"
  timeout 150 $hit --model qwen3-0.6b-shape --tokens 8192 --pairs 5 --routes direct \
    --think-s 0.5 --record-bits 8 2>&1 | tee "$out/hit_8k_8bit.txt"
else
  timeout 170 $hit --model qwen3-0.6b-shape --tokens 32768 --pairs 2 --routes direct,region \
    --think-s 1.0 --capacity-gib 40 2>&1 | tee "$out/hit_32k.txt"
  timeout 300 $hit --model llama3-8b-shape --tokens 8000 --pairs 3 --routes direct,region \
    --think-s 0.5 2>&1 | tee "$out/hit_8b.txt"
fi
