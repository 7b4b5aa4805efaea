#!/usr/bin/env bash
# Issue 37 on the lent H200, after `. .whl2/device-setup.sh` and the project's other wheels
# (../shared/gpu/README.md; py-spy and pytest among them). Part g: the resume and direct-read
# tests on MLX-CUDA (a chain's segments pulled from the pinned region, each by one launch; a
# direct hit gathered into planes with room). Part r:
# resume after 1,000 tokens, 3 samples (a chain's headers, then its payloads in spans of
# their size, landed from the region), and 8 batched streams resumed after a SIGKILL,
# checked against their uninterrupted runs. Part p: the 0.6B
# shape's 8k store hit with py-spy sampling every process of the bench (engine front, core,
# store) to find the ~25 ms of a hit outside its logged phases. Part t: the same hit with
# 4-bit TurboQuant prefix records (the engine's path, not only the in-process restore).
# Part c: decode with a checkpoint every 16 tokens against off, 16 ABBA pairs of 512 tokens,
# and the share of each run the engine's step loop spent on checkpoints (Stats'
# capture_seconds; issue 37's aim is at most 3%), the steady cost beside the plain one (each
# gap between tokens capped at 4x the median: bench/decode_cost.py), and where a round's time
# goes (the engine's debug lines: capture, stage, wait, queue). Part s: part r's resume alone. Part n: the
# 8k hit with MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS=0), for the gather launches' host
# time: MLX-CUDA adds each kernel to a graph it instantiates or updates at each evaluation,
# the suspect for ~2 ms a launch group. Part f: mlx-lm's BatchGenerator against the engine's
# folding one (a prompt's first token from its last chunk), in-process, a 16-token turn after
# 8k and 32k cached positions and 8 cold 512-token prompts. Part h: the engine's 8k and 32k
# hits against cold prefills and raw mlx-lm (the first token sent as soon as it is sampled).
# Part m: raw mlx-lm's 16-token turn after 8k and 32k cached positions three ways (its
# generator, the same with mx.clear_cache a no-op, the bare forward pass): where its 133 ms
# at 32k goes (and F: the generator with the device pool kept). Part k: the planes landing
# at 8 and 64 planes a launch (one launch: nothing allocated while gathers run), each with
# MLX's buffer cache emptied first and kept (the planes reused), at 8k and 32k sizes (the
# pool and group probes: direct_landing_check.py --pool --groups 1,8,32). Part e: the 8B
# shape's 8k hit, one launch against launches of 8. Part q:
# the quick round (the planes' bytes, the pool probe at 8k size, the 8k and 32k hits).
# Part w: the 8k and 32k hits by the plane gather in one launch against launches of 8
# planes (two engines, interleaved). Part d: a 64-layer model's hit (128 planes) in one launch
# against launches of 64. Issue 37's device calls in the thirteenth session: "d e", "c", "l"
# (twice more after the out-of-memory changes). The next: "e" (paired now), "o" (decode
# after 8k prompts beside raw mlx-lm), "s" (the resume's plan after the regions' prefault),
# "w" at 32k.
# PAIRS: the ABBA pairs of parts c and l (16 and 8). Writes text under $OUT.
set -u
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; nproc
hit="python3 bench/hit_floor_bench.py --cold --routes direct --model qwen3-0.6b-shape"
for part in ${1:-g r p t}; do
  case "$part" in
    g)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_domain.py \
        tests/test_checkpoints.py -k "chain or segment or resume or direct" 2>&1 | tail -15 \
        | tee "$out/gpu_tests.txt"
      ;;
    r)
      timeout 240 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape --repeat 3 \
        --skip ttft,decode,restore,floor,local --engine-log-level debug 2>&1 \
        | tee "$out/resume.txt"
      ;;
    p)
      # CPU samples only (--idle floods the file: 84 MB at 250 Hz), summarized here.
      timeout 200 py-spy record --subprocesses --threads -r 100 -f raw \
        -o /tmp/hit_8k_profile.txt -- $hit --tokens 8192 --pairs 4 --think-s 0.5 \
        2>&1 | grep -v 'behind in sampling' | tee "$out/hit_8k_profiled.txt"
      python3 bench/profile_summary.py /tmp/hit_8k_profile.txt > "$out/hit_8k_profile.txt"
      ;;
    t)
      timeout 150 $hit --tokens 8192 --pairs 4 --think-s 0.5 --record-bits 4 \
        --record-scheme turboquant 2>&1 | tee "$out/hit_8k_tq4.txt"
      ;;
    n)
      for graphs in 1 0; do
        MLX_USE_CUDA_GRAPHS=$graphs timeout 150 $hit --tokens 8192 --pairs 4 --think-s 0.5 \
          2>&1 | grep -v '^  round' | tee "$out/hit_8k_graphs$graphs.txt"
      done
      ;;
    f)
      for prefix in 8192 32768; do
        timeout 150 python3 bench/folded_prefill_bench.py --model qwen3-0.6b-shape \
          --prefix $prefix --pairs 7 2>&1 | tail -1 | tee -a "$out/fold.txt"
      done
      timeout 150 python3 bench/folded_prefill_bench.py --model qwen3-0.6b-shape --prefix 0 \
        --turn 512 --rows 8 --pairs 7 2>&1 | tail -1 | tee -a "$out/fold.txt"
      ;;
    h)
      for tokens in 8192 32768; do
        timeout 200 $hit --tokens $tokens --pairs 4 --think-s 0.5 2>&1 | grep -v '^  round' \
          | tee "$out/hit_${tokens}_folded.txt"
      done
      ;;
    k)
      for mib in 896 3584; do
        timeout 150 python3 bench/direct_landing_check.py --mib $mib --rounds 4 \
          --planes-per-launch 8,64 2>&1 \
          | tee -a "$out/pool_landing.txt"
      done
      ;;
    q)
      # The quick round: the planes' bytes checked and the pool probed at 8k size, then the
      # engine's 8k and 32k hits (pool kept, planes with room).
      timeout 120 python3 bench/direct_landing_check.py --mib 896 --rounds 3 --pool 2>&1 \
        | tee -a "$out/pool_landing.txt"
      timeout 170 $hit --tokens 8192 --pairs 4 --think-s 0.5 2>&1 | grep -v '^  round' \
        | tee "$out/hit_8192_planes.txt"
      timeout 250 $hit --tokens 32768 --pairs 3 --think-s 0.5 2>&1 | grep -v '^  round' \
        | tee "$out/hit_32768_planes.txt"
      ;;
    s)
      # Resume alone (part r without the batched streams), with the core's phases.
      timeout 200 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape --repeat 3 \
        --skip ttft,decode,restore,floor,local,batched --engine-log-level debug 2>&1 \
        | tee "$out/resume_alone.txt"
      ;;
    w)
      # Direct hits landed by one launch of the plane gather (the default since the eighth
      # session: nothing allocated while gathers run) against launches of 8 planes, two
      # engines, interleaved hits.
      for tokens in 8192 32768; do
        timeout 240 $hit --tokens $tokens --pairs 4 --think-s 0.5 \
          --routes direct,direct-8-a-launch 2>&1 | grep -v '^  round' \
          | tee "$out/hit_${tokens}_one_launch.txt"
      done
      ;;
    d)
      # A model of more than 32 layers (Qwen3-32B's 64: 128 planes, 2 GiB at 8k): its hit's
      # planes in one launch (the engine's now) against launches of 64 (the engine's widest
      # before), the landing alone, then the engine's hits on two engines, interleaved.
      timeout 150 python3 bench/direct_landing_check.py --mib 2048 --rounds 4 --layers 64 \
        --planes-per-launch 64,0 2>&1 | tee "$out/deep_landing.txt"
      timeout 300 python3 bench/hit_floor_bench.py --cold --routes direct,direct-64-a-launch \
        --model qwen3-64-layers-shape --tokens 8192 --pairs 4 --think-s 0.5 --capacity-gib 16 \
        2>&1 | grep -v '^  round' | tee "$out/hit_deep_8k.txt"
      ;;
    e)
      # One launch against launches of 8 planes (the forward pass overlapping the later
      # layers' gather), two engines interleaved: the 8B's heavier forward pass may make the
      # overlap worth more than the allocations it costs (thirteenth session: not paired yet).
      timeout 400 python3 bench/hit_floor_bench.py --cold --routes direct,direct-8-a-launch \
        --model llama3-8b-shape --tokens 8000 --pairs 4 --think-s 0.5 --capacity-gib 16 2>&1 \
        | grep -v '^  round' | tee "$out/hit_8b_8k.txt"
      ;;
    m)
      for prefix in 8192 32768; do
        timeout 200 python3 bench/step_floor_probe.py --prefix $prefix --rounds 5 2>&1 \
          | tail -7 | tee -a "$out/step_floor.txt"
      done
      ;;
    l)
      # Part c after 8,192-token prompts: the chains' parts (no whole snapshot of the prompt
      # every 16 segments) and the later segments' own tokens, where they weigh.
      timeout 450 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape \
        --repeat "${PAIRS:-8}" --decode-tokens 512 --decode-prompt 8192 --skip ttft,resume,batched,restore,floor,local \
        --engine-log-level debug 2>&1 | tee "$out/checkpoint_cost_long.txt"
      ;;
    o)
      # 8 streams after 8,192-token prompts decoded at ~242 tok/s against ~712 after short
      # ones (thirteenth session): the engine against raw mlx-lm's BatchGenerator there, the
      # decode phase apart (the bench's "decode engine/direct" column).
      timeout 500 python3 bench/engine_bench.py --model qwen3-0.6b-shape --streams 8 \
        --prompt-tokens 8192 --max-tokens 256 --pairs 3 --no-server 2>&1 \
        | tee "$out/decode_after_8k.txt"
      ;;
    c)
      # Runs of 512 tokens a stream: a lent GPU's rare stalls swung 256-token pairs by tens
      # of percent (24 pairs, 2026-12-05).
      timeout 450 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape \
        --repeat "${PAIRS:-16}" --decode-tokens 512 --skip ttft,resume,batched,restore,floor,local \
        --engine-log-level debug 2>&1 | tee "$out/checkpoint_cost.txt"
      ;;
  esac
done
