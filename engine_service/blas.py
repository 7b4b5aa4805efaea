"""Use a fast BLAS for MLX's CPU matmuls when one is installed.

The Linux `mlx[cpu]` wheel bundles the reference BLAS (~8 GFLOP/s fp32 matmul measured
here); OpenBLAS measured ~240 GFLOP/s on the same 2 cores. Loading OpenBLAS with
RTLD_GLOBAL before mlx is imported makes libmlx's cblas_* symbols bind to it. This must run
before the first `import mlx`, so engine_service/__init__.py calls it.
"""

from __future__ import annotations

import ctypes
import os
import sys

# Debian/Ubuntu's libopenblas0-pthread (what `make` installs where it can), then others.
_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "libopenblasp.so.0",
    "libmkl_rt.so.2",
)

_chosen: str | None = None


def preload() -> str:
    """Loads the first fast BLAS found; returns a description of the BLAS in use."""
    global _chosen
    if _chosen is not None:
        return _chosen
    if sys.platform == "darwin":
        _chosen = "Accelerate (macOS)"
    elif os.environ.get("TANDEM_BLAS", "") == "bundled":
        _chosen = "bundled reference BLAS (TANDEM_BLAS=bundled)"
    elif "mlx.core" in sys.modules:
        _chosen = "unknown: mlx was imported before the BLAS preload"
    else:
        _chosen = "bundled reference BLAS (slow: install libopenblas0-pthread)"
        for name in _CANDIDATES:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _chosen = name
            break
    return _chosen


def in_use() -> str:
    return _chosen or preload()
