#!/usr/bin/env bash
# Issue 18's TurboQuant figures on the lent H200, after `. .whl2/device-setup.sh`
# (../shared/gpu/README.md). Writes text and JSON under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
timeout 120 python3 bench/turboquant_probe.py --rows 8,32 --positions 2304 2>&1 \
  | tee "$out/turboquant_probe.txt"
timeout 330 python3 bench/kv_quant_bench.py --model qwen3-0.6b-shape --streams 8,32 \
  --codecs plain,4-bit,tq-3/3 --prompt 2048 --steps 48 --repeat 3 --budget-gib 64 \
  --stream-tokens 8192 --json "$out/kv_quant_06b.json" 2>&1 | tee "$out/kv_quant_06b.txt"
