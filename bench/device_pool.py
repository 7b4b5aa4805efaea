"""The device memory pool's calls, for the probes (direct_landing_check.py --pool,
step_floor_probe.py's way F): MLX-CUDA allocates kernel outputs with `cudaMallocAsync` from the
device's default pool, whose release threshold CUDA sets to 0 (freed memory goes back to the
driver at every synchronisation). Keeping it was measured on an H200 and made no difference to
a store hit, so the engine does not (docs/performance.md, 2026-12-05, fifth session).
"""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx

from engine_service.cuda_runtime import CudaRuntime

# enum cudaMemPoolAttr (cuda_runtime_api.h)
_POOL_RELEASE_THRESHOLD = 4
_POOL_RESERVED_CURRENT = 5


class DevicePool(CudaRuntime):
    """The runtime, with the default memory pool's threshold, trim and size."""

    def __init__(self, lib: Any) -> None:
        super().__init__(lib)
        lib.cudaDeviceGetDefaultMemPool.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cudaMemPoolSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemPoolGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemPoolTrimTo.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]

    def _pool(self) -> ctypes.c_void_p:
        device = ctypes.c_int()
        self._check(self._lib.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice")
        pool = ctypes.c_void_p()
        err = self._lib.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), device.value)
        self._check(err, "cudaDeviceGetDefaultMemPool")
        return pool

    def keep_freed(self, keep_bytes: int) -> None:
        """The pool keeps up to keep_bytes of freed memory mapped across synchronisations."""
        value = ctypes.c_uint64(keep_bytes)
        err = self._lib.cudaMemPoolSetAttribute(
            self._pool(), _POOL_RELEASE_THRESHOLD, ctypes.byref(value)
        )
        self._check(err, "cudaMemPoolSetAttribute")

    def trim(self) -> None:
        """The pool's unused memory back to the driver now."""
        self._check(self._lib.cudaMemPoolTrimTo(self._pool(), 0), "cudaMemPoolTrimTo")

    def reserved(self) -> int:
        """Bytes the pool holds mapped (in use or kept)."""
        value = ctypes.c_uint64()
        err = self._lib.cudaMemPoolGetAttribute(
            self._pool(), _POOL_RESERVED_CURRENT, ctypes.byref(value)
        )
        self._check(err, "cudaMemPoolGetAttribute")
        return int(value.value)


def default_keep_bytes() -> int:
    """What the probes keep in the pool: a quarter of the device's memory (0 off MLX-CUDA)."""
    if not mx.cuda.is_available():
        return 0
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0) // 4
