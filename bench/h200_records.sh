#!/usr/bin/env bash
# Issue 37's compressed prefix records on the lent H200, after `. .whl2/device-setup.sh` and the
# project's other wheels (../shared/gpu/README.md). Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
# Bytes and restore time of an 8k prefix record (host bytes -> device arrays, codes expanded
# on the GPU), exact / 8-bit / 4-bit interleaved; random weights, so no quality here.
timeout 150 python3 bench/record_codec_bench.py --model qwen3-0.6b-shape --prompt 8192 \
  --length 8200 --windows 1 --repeat 7 --no-quality 2>&1 | tee "$out/record_codec_06b.txt"
# The engine's store hit against its cold prefill, with exact, 8-bit and 4-bit records.
for bits in 0 8 4; do
  timeout 140 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape --prompts 8192 \
    --repeat 5 --prefix-record-bits "$bits" --skip resume,batched,decode,restore,floor,local \
    2>&1 | tee "$out/ttft_bits$bits.txt"
done
