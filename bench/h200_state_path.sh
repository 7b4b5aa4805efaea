#!/usr/bin/env bash
# The fast-state-path figures on the lent H200 (issue 14), in one device call after
# `. .whl2/device-setup.sh` (../shared/gpu/README.md). Writes JSON under $OUT.
set -u
out=${OUT:-/tmp}
nproc; df -h /dev/shm | tail -1
# 1. The pinned landing: region bytes pulled by the GPU equal the host's, every dtype.
python3 - <<'PY'
import numpy as np, mlx.core as mx
from engine_service.checkpoints.device_landing import landing_for, host_array
from tandem_client.regions import SharedRegion
from tandem_client.records import Tensor
region = SharedRegion(256 << 20)
landing = landing_for(region)
print("landing:", landing.kind)
rng = np.random.default_rng(0)
region.buf[4096:4096 + (64 << 20)] = rng.integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
for dtype, shape in (("bfloat16", (8, 1024, 128)), ("float32", (4, 512, 64)), ("uint8", (1000, 3))):
    n = int(np.prod(shape)) * {"bfloat16": 2, "float32": 4, "uint8": 1}[dtype]
    t = Tensor("t", dtype, shape, region.buf[4096:4096 + n])
    a, b = landing.array(t), host_array(t)
    landing.settle()
    same = bool(mx.array_equal(a.view(mx.uint8) if dtype != "uint8" else a, b.view(mx.uint8) if dtype != "uint8" else b))
    print(f"  {dtype} {shape}: equal={same}")
    assert same
landing.close(); region.close()
PY
# 2. Store hit vs cold prefill at 8k and 32k, resume, checkpoint cost, restore bandwidth at 8k.
timeout 420 python3 bench/checkpoint_bench.py --model qwen3-0.6b-shape --prompts 8192,32768 \
  --repeat 3 --region-bytes -1 --restore-tokens 8192 --skip batched,local \
  --json "$out/checkpoint_qwen06b.json" 2>&1 | tail -40
