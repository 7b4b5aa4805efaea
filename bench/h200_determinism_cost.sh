#!/usr/bin/env bash
# Issue 39 on the lent H200, the second call (after the set-up of h200_determinism.sh): the
# mode's cost on the Llama-3-8B shape, then batched seeded streams killed and resumed on a
# fresh --deterministic engine against solo runs, both shapes. With `alone`: the decode
# attention a row at a time against the chunked kernel, both shapes, 1 and 8 streams.
set -u
out=${OUT:-/tmp}
if [ "${1:-}" = alone ]; then
  # Each row's decode attention alone through MLX's SDPA (--deterministic-attention alone:
  # eager steps), against the chunked kernel with compiled steps (the default on the GPU).
  for model in llama3-8b-shape qwen3-0.6b-shape; do
    for attention in alone chunks; do
      timeout 140 python3 bench/determinism_bench.py --model $model --skip-agreement \
        --attention $attention --streams 1,8 --cost-tokens 32 --pairs 3 2>&1 \
        | tee "$out/cost_${model}_${attention}.txt"
    done
  done
  exit 0
fi
timeout 200 python3 bench/determinism_bench.py --model llama3-8b-shape --skip-agreement \
  --streams 1,8,32 --cost-tokens 32 --pairs 3 2>&1 | tee "$out/cost_8b.txt"
timeout 170 python3 bench/determinism_resume.py --model qwen3-0.6b-shape --runs 1 --tokens 96 \
  2>&1 | tee "$out/resume_06b.txt"
timeout 190 python3 bench/determinism_resume.py --model llama3-8b-shape --runs 1 --tokens 64 \
  2>&1 | tee "$out/resume_8b.txt"
