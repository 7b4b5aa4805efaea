"""The device out of memory, as MLX reports it, wherever a room meets it (the loop's steps and
captures, a KV probe, a kernel's first run, a snapshot's copy): what counts, and giving MLX's
cached buffers back. What the loop does about it: loop/memory_pressure.py.

MLX raises when an allocation fails (MLX-CUDA: "cudaMallocAsync(...) failed: out of memory";
Metal: "[metal::malloc] ..." or a command buffer's "Insufficient Memory"; the CPU:
std::bad_alloc). It is the device's state at that moment, never a verdict on the model or the
request: nothing decided from it may outlast it.
"""

from __future__ import annotations

import mlx.core as mx

# Lower-cased pieces of the messages MLX's backends raise when an allocation fails.
_MARKERS = (
    "out of memory",
    "insufficient memory",
    "outofmemory",
    "cudaerrormemoryallocation",
    "metal::malloc",
    "bad_alloc",
)


def is_out_of_memory(failure: BaseException | str) -> bool:
    """Whether a step's exception (or its message) is an allocation MLX could not make."""
    if isinstance(failure, MemoryError):
        return True
    text = str(failure).lower()
    return any(marker in text for marker in _MARKERS)


def cache_given_back(failure: BaseException) -> bool:
    """Whether failure is the device out of memory; if so MLX's cached buffers go back first,
    for the rows that go on."""
    if not is_out_of_memory(failure):
        return False
    mx.clear_cache()
    return True
