#!/usr/bin/env bash
# The Llama-3-8B-shape store hit vs cold prefill at ~8k (its context is 8,192) on the lent H200 (issue 14): a second
# device call right after bench/h200_state_path.sh (the machine still warm).
set -u
out=${OUT:-/tmp}
timeout 540 python3 bench/checkpoint_bench.py --model llama3-8b-shape --prompts 8000 \
  --repeat 3 --region-bytes -1 --restore-tokens 8000 --skip resume,batched,decode,local \
  --json "$out/checkpoint_llama8b.json" 2>&1 | tail -30
