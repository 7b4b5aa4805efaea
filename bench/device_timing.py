"""Device time of an MLX call on MLX-CUDA, from the kernels' own durations (CUPTI, through
torch's profiler: the lent device's image has torch; it records every kernel of the process,
MLX's too). Wall time of eager MLX calls at a few rows is the host's (Python and graph
building, 10-30 us a call), not the kernel's: on the H200 a 4096 x 1024 projection timed
16.5 us by the wall and 7.5 us in the kernel (bench/invariant_matmul_bench.py, ncu).

    micros = kernel_micros(lambda: x @ w.T, reps=32)  # {kernel name: us a call}, or None
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class KernelTotal:
    """One kernel's device time over a profiled run, and how many times it ran."""

    micros: float = 0.0
    calls: int = 0


def profile_kernels(run: Callable[[], None]) -> dict[str, KernelTotal] | None:
    """Each kernel's device time while `run` runs (it ends synchronized); None without
    torch's CUDA profiler."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.zeros(1, device="cuda")  # CUPTI needs the runtime up
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        mx.synchronize()
    totals: dict[str, KernelTotal] = defaultdict(KernelTotal)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            total = totals[event.name]
            total.micros += event.time_range.elapsed_us()
            total.calls += 1
    return dict(totals)


def kernel_micros(call: Callable[[], Any], reps: int = 32) -> dict[str, float] | None:
    """Microseconds of device time a call, by kernel name (over `reps` calls, after a warm
    one); None without torch's CUDA profiler."""
    mx.eval(call())

    def run() -> None:
        for _ in range(reps):
            mx.eval(call())

    totals = profile_kernels(run)
    return None if totals is None else {name: t.micros / reps for name, t in totals.items()}


def total_micros(call: Callable[[], Any], reps: int = 32) -> float | None:
    """All of a call's kernels' device time, in microseconds a call (None: no profiler)."""
    micros = kernel_micros(call, reps)
    return None if micros is None else sum(micros.values())
