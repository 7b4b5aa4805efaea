"""Where a direct Get lands (tandem_client/direct.py): a tensor's chunks, views of the store's
data file, -> one MLX array.

- CPU (and Metal): the chunks joined into one host buffer, then `mx.array` (MLX copies).
- MLX-CUDA: the data file's mapping is registered with CUDA in blocks, as restores first
  touch them (`cudaHostRegister`, read-only; ~30 ms a GiB, once), and a gather kernel has the
  GPU read every chunk of a tensor straight from those pages into a fresh MLX array: one DMA
  from the page cache, no host copy at all (../shared/gpu/README.md measured 52 GB/s for it).
  Registered blocks stay pinned, up to `PIN_LIMIT` bytes (least recently used let go first).
  Pinning costs ~30 ms a GiB (the pages are faulted in and locked), so a thread registers the
  file's new whole blocks as it grows (a record is put, then restored later), off the
  restore's path; a restore registers what is still missing itself.

MLX has no API for pinning host memory or importing it, hence this layer (as for the region:
device_landing.py); anything it cannot do falls back to the host copy.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from tandem_client.data_file import DataFile
from tandem_client.records import Tensor

log = logging.getLogger(__name__)

BLOCK = 64 << 20  # registration unit within the data file's mapping
PIN_LIMIT = 32 << 30  # data-file bytes kept registered at most
GROWTH_POLL_S = 0.1  # how often the registering thread looks at the file's size
CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_READ_ONLY = 0x08
THREADS_PER_BLOCK = 256
MAX_BLOCKS_PER_CHUNK = 64
# p holds, per chunk: (device address of its bytes, its offset in the output, 16-byte words).
_GATHER_SOURCE = """
  size_t chunk = blockIdx.y;
  const uint4* src = reinterpret_cast<const uint4*>(p[chunk * 3]);
  uint4* dst = reinterpret_cast<uint4*>(out + p[chunk * 3 + 1]);
  size_t n16 = (size_t)p[chunk * 3 + 2];
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
    dst[i] = src[i];
  }
"""


class CudaRuntime(Protocol):
    def register(self, address: int, nbytes: int, flags: int = 0) -> None: ...

    def unregister(self, address: int) -> None: ...

    def device_pointer(self, address: int) -> int: ...


def joined(tensor: Tensor, segments: list[memoryview]) -> Tensor:
    """The tensor with its chunks in one buffer of its own (a view when there is one chunk)."""
    if len(segments) == 1:
        data: Any = segments[0]
    elif segments:
        data = np.concatenate([np.frombuffer(s, np.uint8) for s in segments])
    else:
        data = b""
    return Tensor(tensor.name, tensor.dtype, tensor.shape, data)


class FilePins:
    """The data file's blocks registered with CUDA, and the gather kernel reading them."""

    def __init__(self, cuda: CudaRuntime, settle: Any) -> None:
        self._cuda = cuda
        self._settle = settle  # waits for every pull issued: before a block is let go (MLX's)
        self._file: DataFile | None = None
        self._blocks: OrderedDict[int, tuple[int, int]] = OrderedDict()  # k -> (bytes, device)
        self._lock = threading.Lock()  # the blocks, between the MLX thread and the grower
        self._grower: threading.Thread | None = None
        self._stop = threading.Event()
        self._kernel: Any = mx.fast.cuda_kernel(
            name="tandem_gather_pinned",
            input_names=["p"],
            output_names=["out"],
            source=_GATHER_SOURCE,
        )
        self.failed = False

    def arrays(
        self, tensors: list[tuple[Tensor, list[tuple[int, int]]]], file: DataFile
    ) -> dict[int, mx.array]:
        """The tensors (with their chunks) pulled by the GPU from the file's pages in one
        launch, into one buffer each array is a view of: id(tensor) -> array. Tensors that
        cannot be (unaligned, or registration failed) are left out: the caller copies them
        through the host."""
        if self.failed:
            return {}
        table: list[int] = []
        placed: list[tuple[Tensor, int]] = []
        at = longest = 0
        with self._lock:
            for tensor, chunks in tensors:
                rows = self._rows(chunks, file, at)
                if rows is None or not chunks or tensor.nbytes % 16:
                    continue
                table += rows
                placed.append((tensor, at))
                at += tensor.nbytes
                longest = max(longest, *(length for _, length in chunks))
        if not placed:
            return {}
        raw = self._gather(table, at, longest)
        return {
            id(t): raw[start : start + t.nbytes].view(getattr(mx, t.dtype)).reshape(t.shape)
            for t, start in placed
        }

    def _rows(self, chunks: list[tuple[int, int]], file: DataFile, at: int) -> list[int] | None:
        """The gather table's rows for one tensor's chunks (file offset, length) from output
        offset at; None: one of them is unaligned or cannot be registered."""
        rows: list[int] = []
        for offset, length in chunks:
            if offset % 16 or length % 16:
                return None
            device = self._device_address(file, offset, length)
            if device is None:
                return None
            rows += [device, at, length // 16]
            at += length
        return rows

    def warm(self, device_address: int, host: memoryview) -> None:
        """Compiles the gather kernel now (a second or so on first use), not in the first
        restore, which the restore-or-prefill choice would take for the route's speed:
        gathers host's bytes (pinned, at device_address) in two pieces and checks them."""
        half = host.nbytes // 32 * 16
        table = [device_address, 0, half // 16, device_address + half, half, half // 16]
        pulled = self._gather(table, 2 * half, half)
        want = np.frombuffer(host, np.uint8)[: 2 * half]
        if not bool(mx.array_equal(pulled, mx.array(want))):
            raise RuntimeError("the gather read other bytes than the host holds")

    def _gather(self, table: list[int], nbytes: int, longest: int) -> mx.array:
        per_chunk = min(MAX_BLOCKS_PER_CHUNK, -(-(longest // 16) // THREADS_PER_BLOCK))
        outputs: list[mx.array] = self._kernel(
            inputs=[mx.array(np.array(table, np.uint64))],
            output_shapes=[(nbytes,)],
            output_dtypes=[mx.uint8],
            grid=(per_chunk * THREADS_PER_BLOCK, len(table) // 3, 1),
            threadgroup=(THREADS_PER_BLOCK, 1, 1),
        )
        return outputs[0]

    def _device_address(self, file: DataFile, offset: int, nbytes: int) -> int | None:
        if file is not self._file:
            self._let_go()  # compacted: the old file's pages go back
            self._file = file
            if self._grower is None:
                self._grower = threading.Thread(target=self._grow, name="file-pins", daemon=True)
                self._grower.start()
        first, last = offset // BLOCK, (offset + nbytes - 1) // BLOCK
        if first != last:  # a chunk across two blocks: both registered (one address space)
            end = offset + nbytes - last * BLOCK
            if not (self._pin(file, first, BLOCK) and self._pin(file, last, end)):
                return None
        elif not self._pin(file, first, offset + nbytes - first * BLOCK):
            return None
        return self._blocks[first][1] + offset - first * BLOCK

    def _pin(self, file: DataFile, k: int, needed: int) -> bool:
        """Block k registered over at least its first `needed` bytes."""
        held = self._blocks.get(k)
        if held is not None and held[0] >= needed:
            self._blocks.move_to_end(k)
            return True
        size = min(BLOCK, file.size() - k * BLOCK)
        if size < needed:
            return False
        self._settle()
        if held is not None:
            self._cuda.unregister(file.base + k * BLOCK)
            del self._blocks[k]
        while self._blocks and self._pinned() + size > PIN_LIMIT:
            old, _ = self._blocks.popitem(last=False)
            self._cuda.unregister(file.base + old * BLOCK)
        return self._register(file, k, size)

    def _pinned(self) -> int:
        return sum(b for b, _ in self._blocks.values())

    def _register(self, file: DataFile, k: int, size: int) -> bool:
        address = file.base + k * BLOCK
        try:
            self._cuda.register(
                address, size, CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_READ_ONLY
            )
            device = self._cuda.device_pointer(address)
        except (OSError, RuntimeError) as exc:
            log.warning("direct restores copy through the host (registering failed: %s)", exc)
            self.failed = True
            return False
        self._blocks[k] = (size, device)
        return True

    def _grow(self) -> None:
        """Registers the file's whole blocks not yet registered, as the file grows, while
        PIN_LIMIT allows (never lets a block go: only the MLX thread may, after a settle)."""
        while not self._stop.wait(GROWTH_POLL_S):
            file = self._file
            if file is None or self.failed:
                continue
            whole = file.size() // BLOCK
            for k in range(whole):
                with self._lock:
                    if file is not self._file or self.failed:
                        break
                    held = self._blocks.get(k)
                    if held is not None or self._pinned() + BLOCK > PIN_LIMIT:
                        continue
                    self._register(file, k, BLOCK)

    def _let_go(self) -> None:
        if self._file is None:
            return
        self._settle()
        for k in self._blocks:
            self._cuda.unregister(self._file.base + k * BLOCK)
        self._blocks.clear()
        self._file = None

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._let_go()
