"""The CUDA runtime calls MLX does not offer, made through ctypes on the libcudart MLX itself
loaded: pinning host pages (checkpoints/device_landing.py, direct_landing.py), and the device
memory pool's release threshold for the probes in bench/ (direct_landing_check.py --pool,
step_floor_probe.py's way F).

The pool calls are not used by the engine: keeping freed memory in MLX-CUDA's default pool
(CUDA hands it back at every synchronisation) was measured on an H200 and made no difference
to a store hit (docs/performance.md, 2026-12-05, fifth session), although a sampled profile
puts the gather launches' host time inside `cudaMallocAsync`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Any

import mlx.core as mx

# enum cudaMemPoolAttr (cuda_runtime_api.h)
_POOL_RELEASE_THRESHOLD = 4
_POOL_RESERVED_CURRENT = 5


class CudaRuntime:
    """libcudart through ctypes: host registration and the default memory pool."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaHostGetDevicePointer.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        lib.cudaDeviceGetDefaultMemPool.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cudaMemPoolSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemPoolGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemPoolTrimTo.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]

    @classmethod
    def load(cls) -> CudaRuntime:
        """The runtime MLX loaded (OSError when there is none)."""
        mx.eval(mx.zeros(4) + 1)  # MLX has loaded its CUDA runtime by now
        candidates = []
        with open("/proc/self/maps") as maps:
            candidates += [line.split()[-1] for line in maps if "libcudart.so" in line]
        for folder in [*sys.path, "/usr/local/cuda"]:
            for pattern in ("nvidia/cu*/lib/libcudart.so*", "lib64/libcudart.so*"):
                candidates += sorted(glob.glob(os.path.join(folder, pattern)))
        if not candidates:
            raise OSError("no libcudart loaded or installed")
        return cls(ctypes.CDLL(candidates[0]))

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what}: {self._lib.cudaGetErrorString(err).decode()}")

    def register(self, address: int, nbytes: int, flags: int = 0) -> None:
        self._check(self._lib.cudaHostRegister(address, nbytes, flags), "cudaHostRegister")

    def device_pointer(self, address: int) -> int:
        pointer = ctypes.c_void_p()
        err = self._lib.cudaHostGetDevicePointer(ctypes.byref(pointer), address, 0)
        self._check(err, "cudaHostGetDevicePointer")
        return int(pointer.value or 0)

    def unregister(self, address: int) -> None:
        self._check(self._lib.cudaHostUnregister(address), "cudaHostUnregister")

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
