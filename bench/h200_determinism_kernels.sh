#!/usr/bin/env bash
# Issue 39 on the lent H200 (after the set-up of ../shared/gpu/README.md): deterministic mode's
# two kernels, each load-bound at a few rows, rebuilt to keep more loads in flight.
# Part a: the projection kernel per call (every tiling and unroll, bits checked equal) on the
# 8B's shapes and the 0.6B's; the decode attention kernel against MLX's SDPA (with --legacy
# FILE, a copy of an earlier build, against that too); the mode's cost with the kernel
# on the 8B shape at 1 and 8 streams, and at 1 stream with the old column tiling (4).
# Part b: the 0.6B shape's probe, kernel check and agreement with solo runs (greedy and
# seeded, batches 8 and 32), then its cost at 1/8/32/128 streams. Part c: the 8B's cost at
# 32 streams and its agreement at batch 8. Part d (eight warps a block in the projection
# kernel, chunks of 64 keys in the attention kernel): the projection kernel per call, a
# kernel-by-kernel profile of the 8B's one-stream step (bench/decode_kernel_profile.py), the
# 0.6B's agreement; part e: the cost on both shapes; part f: the 8B at 128 streams, and its
# streams killed and resumed against solo runs; part g: the x prefetch at 1 and 8 streams
# (against part e's runs without it). The whole table with the kernel build: part h,
# the 0.6B's cost at 1/8/32/128 streams; part i, the 8B's at 1/8 and its streams killed and
# resumed; part j, the 0.6B's agreement over 256 tokens in batches of 8/32/128 and its resume.
# Part k: what h and j left out on their first device run. Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
det="python3 bench/determinism_bench.py --kernel"
for part in ${1:-a}; do
  case "$part" in
    a)
      timeout 110 python3 bench/invariant_matmul_bench.py --shapes 8b --rounds 8 --reps 32 \
        2>&1 | tee "$out/matmul_8b.txt"
      timeout 60 python3 bench/invariant_matmul_bench.py --rows 1,128 --rounds 8 --reps 32 \
        --unrolls 1,8 2>&1 | tee "$out/matmul_06b.txt"
      timeout 60 python3 bench/row_attention_bench.py 2>&1 | tee "$out/attention.txt"
      timeout 170 $det --model llama3-8b-shape --skip-agreement --streams 1,8 --cost-tokens 32 \
        --pairs 3 2>&1 | tee "$out/cost_8b.txt"
      timeout 110 $det --model llama3-8b-shape --skip-agreement --streams 1 --cost-tokens 32 \
        --pairs 3 --few-row-columns 4 2>&1 | tee "$out/cost_8b_c4.txt"
      ;;
    b)
      timeout 250 $det --model qwen3-0.6b-shape --batches 8,32 --tokens 64 --streams 1 \
        --cost-tokens 32 --pairs 3 2>&1 | tee "$out/agree_06b.txt"
      timeout 230 $det --model qwen3-0.6b-shape --skip-agreement --streams 8,32,128 \
        --cost-tokens 48 --pairs 3 2>&1 | tee "$out/cost_06b.txt"
      ;;
    d)
      timeout 100 python3 bench/invariant_matmul_bench.py --shapes 8b --reps 32 --unrolls 1,2,8 \
        --device-time 2>&1 | tee "$out/matmul_8b.txt"
      timeout 40 python3 bench/row_attention_bench.py --rounds 3 --device-time 2>&1 \
        | tee "$out/attention.txt"
      timeout 150 python3 bench/decode_kernel_profile.py --model llama3-8b-shape --streams 1,8 \
        --kernel --steps 16 --top 10 2>&1 | grep -v -i warn | tee "$out/profile_8b.txt"
      timeout 200 $det --model qwen3-0.6b-shape --batches 8,32 --tokens 64 --streams 1 \
        --cost-tokens 32 --pairs 3 2>&1 | tee "$out/agree_06b.txt"
      ;;
    e)
      timeout 250 $det --model llama3-8b-shape --skip-agreement --streams 1,8,32 --cost-tokens 32 \
        --pairs 3 2>&1 | tee "$out/cost_8b.txt"
      timeout 250 $det --model qwen3-0.6b-shape --skip-agreement --streams 8,32,128 \
        --cost-tokens 48 --pairs 3 2>&1 | tee "$out/cost_06b.txt"
      ;;
    g)
      # The kernel's x loaded with its w at up to 8 rows (bench/kernel_sass.py: every global
      # load ahead of the first tensor-core op, 146 registers against 86), both shapes.
      for model in llama3-8b-shape qwen3-0.6b-shape; do
        timeout 200 $det --model $model --skip-agreement --streams 1,8 --cost-tokens 32 \
          --pairs 3 --prefetch 2>&1 | tee "$out/prefetch_$model.txt"
      done
      ;;
    f)
      timeout 280 $det --model llama3-8b-shape --skip-agreement --streams 128 --cost-tokens 32 \
        --pairs 3 2>&1 | tee "$out/cost_8b_128.txt"
      timeout 280 python3 bench/determinism_resume.py --model llama3-8b-shape --runs 1 --matmul kernel \
        --tokens 64 2>&1 | tee "$out/resume_8b.txt"
      ;;
    h)
      timeout 270 $det --model qwen3-0.6b-shape --skip-agreement --streams 1,8,32,128 \
        --cost-tokens 48 --pairs 3 2>&1 | tee "$out/cost_06b.txt"
      ;;
    i)
      timeout 270 $det --model llama3-8b-shape --skip-agreement --streams 1,8 --cost-tokens 32 \
        --pairs 3 2>&1 | tee "$out/cost_8b.txt"
      timeout 280 python3 bench/determinism_resume.py --model llama3-8b-shape --runs 1 \
        --matmul kernel --tokens 64 2>&1 | tee "$out/resume_8b.txt"
      ;;
    j)
      timeout 330 $det --model qwen3-0.6b-shape --batches 8,32,128 --tokens 256 --streams "" \
        2>&1 | tee "$out/agree_06b.txt"
      timeout 230 python3 bench/determinism_resume.py --model qwen3-0.6b-shape --runs 1 \
        --matmul kernel 2>&1 | tee "$out/resume_06b.txt"
      ;;
    k)
      # What part h and j left out when their calls came back short: the 0.6B's cost, and
      # its seeded agreement in a batch of 128 with the mode on.
      timeout 270 $det --model qwen3-0.6b-shape --skip-agreement --streams 1,8,32,128 \
        --cost-tokens 48 --pairs 3 2>&1 | tee "$out/cost_06b.txt"
      timeout 240 $det --model qwen3-0.6b-shape --batches 128 --tokens 256 --streams "" \
        --modes on --kinds seeded 2>&1 | tee "$out/agree_06b_128.txt"
      ;;
    c)
      timeout 200 $det --model llama3-8b-shape --skip-agreement --streams 32 --cost-tokens 32 \
        --pairs 3 2>&1 | tee "$out/cost_8b_32.txt"
      timeout 200 $det --model llama3-8b-shape --batches 8 --tokens 64 --streams 1 \
        --cost-tokens 16 --pairs 1 2>&1 | tee "$out/agree_8b.txt"
      ;;
  esac
done
