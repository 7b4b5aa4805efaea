#!/usr/bin/env bash
# Issue 37 on the lent H200, after `. .whl2/device-setup.sh` and the project's other wheels
# (../shared/gpu/README.md): direct store hits whose gather overlaps the first forward pass
# (the gather on a stream of its own, in groups of layers; the store's verdict confirmed after
# the step). Part a: the landing alone (and its thread-block budget), the 0.6B shape at 8k
# (direct and region) and at 32k (direct). Part b: the 8B shape at 8k.
# Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
hit="python3 bench/hit_floor_bench.py --cold"
if [ "${1:-a}" = "a" ]; then
  timeout 80 python3 bench/direct_landing_check.py --mib 896 --rounds 5 \
    --gather-blocks 256,1024,8192 2>&1 | tee "$out/landing.txt"
  timeout 200 $hit --model qwen3-0.6b-shape --tokens 8192 --pairs 5 --routes direct,region \
    --think-s 0.5 2>&1 | tee "$out/hit_8k.txt"
  timeout 220 $hit --model qwen3-0.6b-shape --tokens 32768 --pairs 2 --routes direct \
    --think-s 1.0 --capacity-gib 40 2>&1 | tee "$out/hit_32k.txt"
else
  timeout 330 $hit --model llama3-8b-shape --tokens 8000 --pairs 3 --routes direct,region \
    --think-s 0.5 2>&1 | tee "$out/hit_8b.txt"
fi
