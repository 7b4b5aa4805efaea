"""The CUDA runtime calls MLX does not offer, made through ctypes on the libcudart MLX itself
loaded: pinning host pages (checkpoints/device_landing.py, direct_landing.py) and the
device memory pool's release threshold.

Why the pool matters: MLX-CUDA allocates a kernel's output with `cudaMallocAsync` from the
device's default memory pool, whose release threshold CUDA sets to 0. So at every
synchronisation the pool hands its unused memory back to the driver, and the next large
allocation maps physical pages again, on the host, in the launching thread: a store hit's
gather of 3.7 GB (a 32k prompt of a 0.6B model) spent 52 ms launching, and every prompt chunk
after `mx.clear_cache()` (mlx-lm's prefill calls it) pays the same. Keeping up to
`keep_bytes` of freed memory in the pool makes those allocations a free-list lookup; the
engine trims the pool when it goes idle (loop/idle_buffers.py), so a shared GPU still gets
its memory back (MLX 0.32.4 sets no threshold: mlx/backend/cuda/allocator.cpp).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)

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


class DevicePool:
    """The engine's hold on the default pool: keep freed memory while busy, trim when idle.
    Does nothing off MLX-CUDA, or where the runtime refuses (logged once)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._cuda: CudaRuntime | None = None
        if keep_bytes <= 0 or not mx.cuda.is_available():
            return
        try:
            cuda = CudaRuntime.load()
            cuda.keep_freed(keep_bytes)
        except (OSError, RuntimeError, AttributeError) as exc:
            log.warning("the device pool gives freed memory back at every sync (%s)", exc)
            return
        self._cuda = cuda
        log.info("the device pool keeps up to %d MiB of freed memory", keep_bytes >> 20)

    @property
    def active(self) -> bool:
        return self._cuda is not None

    def trim(self) -> None:
        if self._cuda is not None:
            self._cuda.trim()


def default_keep_bytes() -> int:
    """A quarter of the device's memory (0 off MLX-CUDA)."""
    if not mx.cuda.is_available():
        return 0
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0) // 4
