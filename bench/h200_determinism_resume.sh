#!/usr/bin/env bash
# Issue 39 on the lent H200 through the engine (after the set-up of h200_determinism.sh): batched
# seeded streams killed and resumed on a fresh --deterministic engine, against solo runs.
set -u
out=${OUT:-/tmp}
timeout 190 python3 bench/determinism_resume.py --model qwen3-0.6b-shape --runs 2 --tokens 96 \
  2>&1 | tee "$out/resume_06b.txt"
timeout 170 python3 bench/determinism_resume.py --model llama3-8b-shape --runs 1 --tokens 64 \
  2>&1 | tee "$out/resume_8b.txt"
