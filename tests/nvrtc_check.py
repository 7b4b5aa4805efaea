"""Our MLX-CUDA kernels compiled as MLX compiles them, without a GPU (CI has none).

`Recorder` stands in for `mx.fast.cuda_kernel`: the module under test builds its kernels and
calls them as it would on MLX-CUDA (on the CPU's arrays), and each call is recorded as the
whole source MLX would hand NVRTC (`mlx_source`, after MLX's `build_kernel` in
mlx/backend/cuda/custom_kernel.cpp) with its block size; the call returns zeros of the
declared outputs, so the module's code goes on. `compile_launch` then compiles that source
with NVRTC for the H100/H200's architecture (sm_90a) and the options MLX passes, and reads
ptxas's report: whether it compiled, the registers a thread, the bytes spilled, the shared
memory. A launch whose registers times its threads pass the 65,536 an SM has fails on the
device with "too many resources requested for launch"; this finds it here.

NVRTC and the CUDA headers come from NVIDIA's wheels (nvidia-cuda-nvrtc, -runtime, -cccl, CUDA
13 as MLX-CUDA's), dev dependencies on Linux x86_64. MLX's own device header is replaced by
the two types our kernels take from it (Shape and Strides).
"""

from __future__ import annotations

import ctypes
import importlib
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

ARCHITECTURE = "sm_90a"  # MLX's --gpu-architecture on an H100/H200 (compute capability 9.0)
REGISTERS_AN_SM = 65536

_CUDA_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}

# What our kernels use of MLX's mlx/backend/cuda/device/utils.cuh (MAX_NDIM is MLX's): the
# integer types and Shape and Strides, indexed. Light on purpose: libcu++'s headers cost a
# second a compile.
_UTILS = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
template <typename T>
struct Dims {
  T values[MAX_NDIM];
  __device__ T operator[](int i) const { return values[i]; }
  __device__ const T* data() const { return values; }
};
using Shape = Dims<int32_t>;
using Strides = Dims<int64_t>;
}
"""


def cuda_root() -> Path | None:
    """The CUDA 13 wheels' folder (nvidia/cu13), None where they are not installed."""
    try:  # the namespace package of NVIDIA's wheels (untyped)
        nvidia = importlib.import_module("nvidia")
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        root = Path(base) / "cu13"
        if (root / "lib" / "libnvrtc.so.13").exists():
            return root
    return None


@dataclass(frozen=True)
class Launch:
    """One recorded kernel call: the source MLX would compile and the block's threads."""

    name: str
    source: str
    threads: int
    template: tuple[tuple[str, Any], ...] = ()  # the constants it was built with


@dataclass(frozen=True)
class Compiled:
    launch: Launch
    ok: bool
    log: str
    registers: int
    spilled_bytes: int
    shared_bytes: int
    cubin: bytes  # the machine code (bench/kernel_sass.py disassembles it); b"" if not ok

    @property
    def fits_an_sm(self) -> bool:
        """Whether a block's registers fit one SM (else the launch fails on the device)."""
        return self.registers * self.launch.threads <= REGISTERS_AN_SM


def mlx_source(
    kernel_name: str,
    source: str,
    input_names: list[str],
    inputs: list[mx.array],
    output_names: list[str],
    output_dtypes: list[Any],
    template: list[tuple[str, Any]],
    header: str = "",
) -> str:
    """The kernel as MLX's build_kernel writes it: inputs as const pointers (with _shape,
    _strides and _ndim where the source names them), outputs, template arguments as
    constants, then the body."""
    text = '#include "mlx/backend/cuda/device/utils.cuh"\n\n'
    groups = "cooperative_groups" in source or "cg::" in source
    if groups:  # MLX always includes it; here only where used (its headers are slow)
        text += "#include <cooperative_groups.h>\n\n"
    text += header
    text += "namespace mlx::core::cu {\n\n"
    if groups:
        text += "namespace cg = cooperative_groups;\n\n"
    params = []
    for name, array in zip(input_names, inputs, strict=True):
        params.append(f"    const {_CUDA_TYPES[array.dtype]}* {name}")
        if array.ndim > 0:
            if f"{name}_shape" in source:
                params.append(f"    const __grid_constant__ Shape {name}_shape")
            if f"{name}_strides" in source:
                params.append(f"    const __grid_constant__ Strides {name}_strides")
            if f"{name}_ndim" in source:
                params.append(f"    const __grid_constant__ int {name}_ndim")
    for name, dtype in zip(output_names, output_dtypes, strict=True):
        params.append(f"    {_CUDA_TYPES[dtype]}* {name}")
    text += f"__global__ void {kernel_name}(\n" + ",\n".join(params) + ") {\n"
    for name, value in template:
        if isinstance(value, bool):
            text += f"  constexpr bool {name} = {'true' if value else 'false'};\n"
        elif isinstance(value, int):
            text += f"  constexpr int {name} = {value};\n"
        else:
            text += f"  using {name} = {_CUDA_TYPES[value]};\n"
    return text + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"


@dataclass
class Recorder:
    """Stands in for mx.fast.cuda_kernel (module docstring); `launches` in call order."""

    launches: list[Launch] = field(default_factory=list)

    def __call__(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        **_: Any,
    ) -> Callable[..., list[mx.array]]:
        def call(
            inputs: list[mx.array],
            output_shapes: list[tuple[int, ...]],
            output_dtypes: list[Any],
            grid: tuple[int, int, int],
            threadgroup: tuple[int, int, int],
            template: list[tuple[str, Any]] | None = None,
            **__: Any,
        ) -> list[mx.array]:
            block = [min(t, g) for t, g in zip(threadgroup, grid, strict=True)]
            kernel_name = f"custom_kernel_{name}"
            text = mlx_source(
                kernel_name,
                source,
                input_names,
                inputs,
                output_names,
                output_dtypes,
                template or [],
                header,
            )
            threads = block[0] * block[1] * block[2]
            self.launches.append(Launch(kernel_name, text, threads, tuple(template or [])))
            return [
                mx.zeros(shape, dtype=dtype)
                for shape, dtype in zip(output_shapes, output_dtypes, strict=True)
            ]

        return call

    def distinct(self) -> list[Launch]:
        """Each source once (a module calls the same kernel for many layers)."""
        seen: dict[tuple[str, int], Launch] = {}
        for launch in self.launches:
            seen.setdefault((launch.source, launch.threads), launch)
        return list(seen.values())


class Nvrtc:
    """NVRTC through ctypes, with a folder holding the stand-in for MLX's device header."""

    def __init__(self, root: Path) -> None:
        self.lib = ctypes.CDLL(str(root / "lib" / "libnvrtc.so.13"))
        self._headers = tempfile.TemporaryDirectory(prefix="tandem-nvrtc-")
        utils = Path(self._headers.name) / "mlx" / "backend" / "cuda" / "device" / "utils.cuh"
        utils.parent.mkdir(parents=True)
        utils.write_text(_UTILS)
        include = root / "include"
        self.options = [
            "--device-as-default-execution-space",  # as MLX compiles (jit_module.cpp)
            f"--gpu-architecture={ARCHITECTURE}",
            f"--include-path={self._headers.name}",
            f"--include-path={include}",
            f"--include-path={include / 'cccl'}",
            "-Xptxas",
            "-v",  # ptxas's report: registers, spills, shared memory
        ]

    def compile(self, launch: Launch) -> Compiled:
        program = ctypes.c_void_p()
        created = self.lib.nvrtcCreateProgram(
            ctypes.byref(program), launch.source.encode(), b"kernel.cu", 0, None, None
        )
        assert created == 0, f"nvrtcCreateProgram: {created}"
        try:
            options = [o.encode() for o in self.options]
            result = self.lib.nvrtcCompileProgram(
                program, len(options), (ctypes.c_char_p * len(options))(*options)
            )
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(program, buffer)
            log = buffer.value.decode(errors="replace")
            cubin = b""
            if result == 0:
                self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
                code = ctypes.create_string_buffer(size.value)
                self.lib.nvrtcGetCUBIN(program, code)
                cubin = code.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))
        return Compiled(
            launch,
            ok=result == 0,
            log=log,
            registers=_number(r"Used (\d+) registers", log),
            spilled_bytes=_number(r"(\d+) bytes spill stores", log),
            shared_bytes=_number(r"(\d+) bytes smem", log),
            cubin=cubin,
        )

    def close(self) -> None:
        self._headers.cleanup()


def _number(pattern: str, log: str) -> int:
    found = re.search(pattern, log)
    return int(found.group(1)) if found else 0
