#!/usr/bin/env bash
# Issue 15's engine figures on the lent H200, after `. .whl2/device-setup.sh`
# (../shared/gpu/README.md; .whl2 also holds pyzmq and msgspec wheels for Python 3.12).
# Usage: bash bench/h200_engine.sh MODEL_SHAPE [STREAMS] [PAIRS]. Writes JSON under $OUT.
set -u
out=${OUT:-/tmp}
model=${1:-qwen3-0.6b-shape}
streams=${2:-1,8,32,128}
pairs=${3:-5}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 560 python3 bench/engine_bench.py --model "$model" --streams "$streams" \
  --pairs "$pairs" --server-streams "${SERVER_STREAMS:-32}" --json "$out/engine_$model.json" 2>&1 | tail -40
