#!/usr/bin/env bash
# Issue 36's figures on the lent H200, after `. .whl2/device-setup.sh` (../shared/gpu/README.md;
# .whl2 also holds the project's wheels for Python 3.12: grpcio, llguidance, starlette, ...).
# Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
timeout 280 python3 bench/tool_call_bench.py --model qwen3-0.6b-shape --pairs 5 2>&1 \
  | tee "$out/tool_call_qwen06b.txt"
timeout 280 python3 bench/openai_n_bench.py --model qwen3-0.6b-shape --pairs 5 \
  --prompt-tokens 4096 2>&1 | tee "$out/openai_n_qwen06b.txt"
