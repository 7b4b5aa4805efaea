#!/usr/bin/env bash
# Issue 37 on the lent H200, after `. .whl2/device-setup.sh` and the project's other wheels
# (../shared/gpu/README.md): direct store hits whose gather overlaps the first forward pass
# (the gather on a stream of its own, in groups of layers; the store's verdict confirmed after
# the step) and whose places the store learnt at put time. Part a: the 0.6B shape at 8k and
# at 32k; part b: the 8B shape at 8k; part l: the landing alone and its thread-block budget;
# part c: decode with a checkpoint every 16 tokens against off, at 1 and 8 streams, 8 ABBA
# pairs (a round's segments cut together, pushed as one buffer, waited on a step later).
# Each hit line prints where a direct hit's time went (engine and store phases).
# Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
hit="python3 bench/hit_floor_bench.py --cold --routes direct"
case "${1:-a}" in
  a)
    timeout 150 $hit --model qwen3-0.6b-shape --tokens 8192 --pairs 4 --think-s 0.5 \
      2>&1 | tee "$out/hit_8k.txt"
    timeout 330 $hit --model qwen3-0.6b-shape --tokens 32768 --pairs 2 --think-s 1.0 \
      --capacity-gib 40 2>&1 | tee "$out/hit_32k.txt"
    ;;
  b)
    timeout 330 $hit --model llama3-8b-shape --tokens 8000 --pairs 3 --think-s 0.5 \
      2>&1 | tee "$out/hit_8b.txt"
    ;;
  c)
    timeout 300 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape --repeat 8 \
      --skip ttft,resume,batched,restore,floor,local 2>&1 | tee "$out/checkpoint_cost.txt"
    ;;
  l)
    timeout 80 python3 bench/direct_landing_check.py --mib 896 --rounds 5 \
      --gather-blocks 256,1024,8192 2>&1 | tee "$out/landing.txt"
    ;;
esac
