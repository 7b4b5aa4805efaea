"""The machine code (SASS) of one of our MLX-CUDA kernels, compiled here as MLX would for an
H100/H200 (sm_90a; tests/nvrtc_check.py), without a GPU: where its global loads sit against
its tensor-core instructions, which decides how much a warp keeps in flight.

Found with it (2026-12-05): the projection kernel's w loads for UNROLL steps are issued
together, but each step's x loads wait behind a branch per row tile, one step after another;
without the branches ptxas sank the w loads to each step instead (fewer registers, no
prefetch). A latency-bound kernel at a few rows (ncu: 88% of stalls on global loads) needs
its loads early: read this before spending device time on a variant.

    python bench/kernel_sass.py projection --rows 1 --k 4096 --n 1024 [--columns 1 --unroll 8]
    python bench/kernel_sass.py attention --heads 32 --kv-heads 8 --dim 128 --keys 160
    [--all]  (every instruction, not only loads, stores, tensor-core ops, barriers, branches)

Needs NVIDIA's nvrtc, runtime, cccl and nvdisasm wheels (CUDA 13), dev dependencies on Linux
x86_64.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import mlx.core as mx  # noqa: E402

from engine_service.kv import row_attention_cuda  # noqa: E402
from engine_service.model import invariant_matmul_cuda  # noqa: E402
from tests.nvrtc_check import Launch, Nvrtc, Recorder, cuda_root  # noqa: E402

SHOWN = re.compile(r"\b(LDG|STG|LDS|STS|LDGSTS|HMMA|BAR|BRA|SHFL)\b")


def record(args: argparse.Namespace) -> Launch:
    """The first launch the module makes for the asked shape."""
    recorder = Recorder()
    mx.fast.cuda_kernel = recorder  # type: ignore[assignment]
    if args.kernel == "projection":
        x = mx.zeros((args.rows, args.k), dtype=mx.bfloat16)
        w = mx.zeros((args.n, args.k), dtype=mx.bfloat16)
        asked = invariant_matmul_cuda.Asked(
            args.columns, args.block_tiles, args.unroll, args.prefetch or None
        )
        invariant_matmul_cuda.invariant_matmul(x, w, asked)
    else:
        q = mx.zeros((args.rows, args.heads, 1, args.dim), dtype=mx.bfloat16)
        kv = mx.zeros((args.rows, args.kv_heads, args.keys, args.dim), dtype=mx.bfloat16)
        row_attention_cuda.row_attention(q, kv, kv, args.dim**-0.5, [0] * args.rows)
    return recorder.launches[0]


def sass(nvrtc: Nvrtc, launch: Launch, root: Path) -> tuple[str, str]:
    """The kernel's disassembly and ptxas's report."""
    compiled = nvrtc.compile(launch)
    if not compiled.ok:
        raise SystemExit(f"does not compile:\n{compiled.log}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(compiled.cubin)
        file.flush()
        tool = root / "bin" / "nvdisasm"
        text = subprocess.run(
            [str(tool), "-c", file.name], capture_output=True, text=True, check=True
        ).stdout
    report = (
        f"{compiled.registers} registers, {launch.threads} threads a block, "
        f"{compiled.spilled_bytes} bytes spilled, {compiled.shared_bytes} bytes shared"
    )
    return text, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel", choices=["projection", "attention"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--columns", type=int, default=None)
    parser.add_argument("--block-tiles", type=int, default=None)
    parser.add_argument("--unroll", type=int, default=None)
    parser.add_argument("--prefetch", action="store_true", help="x loaded with w (<= 8 rows)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--keys", type=int, default=160)
    parser.add_argument("--all", action="store_true", help="every instruction")
    args = parser.parse_args()
    root = cuda_root()
    if root is None or not (root / "bin" / "nvdisasm").exists():
        raise SystemExit("needs NVIDIA's CUDA 13 nvrtc/runtime/cccl/nvdisasm wheels")
    nvrtc = Nvrtc(root)
    try:
        launch = record(args)
        text, report = sass(nvrtc, launch, root)
    finally:
        nvrtc.close()
    lines = [line.strip() for line in text.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]
    shown = lines if args.all else [line for line in lines if SHOWN.search(line)]
    first_mma = next((i for i, line in enumerate(lines) if "HMMA" in line), len(lines))
    loads = [i for i, line in enumerate(lines) if re.search(r"\bLDG", line)]
    print(f"{launch.name}: {report}")
    print(
        f"{len(lines)} instructions; {len(loads)} global loads, "
        f"{sum(i < first_mma for i in loads)} of them before the first tensor-core op"
    )
    for line in shown:
        print("  " + line)


if __name__ == "__main__":
    main()
