"""The CUDA runtime calls MLX does not offer, made through ctypes on the libcudart MLX itself
loaded: pinning host pages for the restore paths (checkpoints/device_landing.py,
direct_landing.py). MLX has no API for it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Any

import mlx.core as mx


class CudaRuntime:
    """libcudart through ctypes: host registration (bench/device_pool.py adds the memory
    pool's calls for the probes)."""

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
