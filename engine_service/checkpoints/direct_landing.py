"""Where a direct Get lands (tandem_client/direct.py): a tensor's chunks, views of the store's
data file, -> one MLX array.

- CPU (and Metal): the chunks joined into one host buffer, then `mx.array` (MLX copies).
- MLX-CUDA: the data file's mapping is registered with CUDA in blocks, as restores first
  touch them (`cudaHostRegister`, read-only; ~30 ms a GiB, once), and a gather kernel has the
  GPU read every chunk of a tensor straight from those pages into a fresh MLX array: one DMA
  from the page cache, no host copy at all (../shared/gpu/README.md measured 52 GB/s for it).
  Registered blocks stay pinned, up to `PIN_LIMIT` bytes (least recently used let go first).
  The record is gathered in groups of consecutive tensors (a layer or two: payload order is
  the model's), each launched on a stream of its own (`mx.new_stream`) and evaluated
  asynchronously, so the first forward pass, on the generation stream, starts on layer 0
  while later layers are still crossing PCIe (MLX makes it wait on each group's event; LMCache
  pipelines its layer-wise loads the same way).
  Pinning costs ~30 ms a GiB (the pages are faulted in and locked), so a thread registers the
  file's new whole blocks as it grows (a record is put, then restored later), off the
  restore's path; a restore registers what is still missing itself.

MLX has no API for pinning host memory or importing it, hence this layer (as for the region:
device_landing.py); anything it cannot do falls back to the host copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engine_service.checkpoints import direct_planes
from engine_service.checkpoints.direct_planes import PlaneGather, plane_pieces
from tandem_client.data_file import DataFile
from tandem_client.records import Tensor

log = logging.getLogger(__name__)

BLOCK = 64 << 20  # registration unit within the data file's mapping
# Data-file bytes kept registered at most: pinned pages cannot be reclaimed, so a quarter of
# the host's memory, and no more than 32 GiB.
PIN_LIMIT = min(32 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)
GROWTH_POLL_S = 0.1  # how often the registering thread looks at the file's size
CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_READ_ONLY = 0x08
THREADS_PER_BLOCK = 256
MAX_BLOCKS_PER_CHUNK = 64
# Thread blocks one launch uses at most: PCIe, not the SMs, bounds a gather, so it leaves most
# of the GPU to the forward pass it overlaps (4 loads in flight per thread keep the link busy).
GATHER_BLOCKS = 512
# A record is gathered in about this many launches of consecutive tensors (each at least
# MIN_GROUP_BYTES), each evaluated on its own: a launch and its evaluation cost ~2 ms of host
# time on the H200's (docs/performance.md), traded against finer overlap.
GROUPS = 8
MIN_GROUP_BYTES = 64 << 20
# p holds, per chunk: (device address of its bytes, its offset in the output, 16-byte words).
_GATHER_SOURCE = """
  size_t chunk = blockIdx.y;
  const uint4* src = reinterpret_cast<const uint4*>(p[chunk * 3]);
  uint4* dst = reinterpret_cast<uint4*>(out + p[chunk * 3 + 1]);
  size_t n16 = (size_t)p[chunk * 3 + 2];
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n16; i += stride) { dst[i] = src[i]; }
"""


class HostPinning(Protocol):
    """What the restore paths need of the CUDA runtime (engine_service/cuda_runtime.py):
    host pages registered, and the address the device reads them at."""

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


def _aligned(tensor: Tensor, chunks: list[tuple[int, int]]) -> bool:
    """Whether the gather can read the tensor: every chunk on 16 bytes."""
    if not chunks or tensor.nbytes % 16:
        return False
    return all(not offset % 16 and not length % 16 for offset, length in chunks)


def _groups(
    tensors: list[tuple[Tensor, list[tuple[int, int]]]], group_bytes: int
) -> list[list[tuple[Tensor, list[tuple[int, int]]]]]:
    """Consecutive tensors in groups of about group_bytes (a group holds at least one)."""
    groups: list[list[tuple[Tensor, list[tuple[int, int]]]]] = [[]]
    size = 0
    for item in tensors:
        if groups[-1] and size + item[0].nbytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[0].nbytes
    return groups


class BlockPins:
    """Which BLOCK-sized pieces of the data file's mapping are registered with CUDA.

    A restore asks for every block its chunks touch at once (`ensure`): blocks it needs are
    never let go while it is being planned, so no row of its gather can point at pages that
    were unregistered meanwhile; to make room, least recently used other blocks go first.
    A thread registers new whole blocks as the file grows (`grow`), below the limit."""

    def __init__(self, cuda: HostPinning, settle: Any, limit: int = PIN_LIMIT) -> None:
        self._cuda = cuda
        self._settle = settle  # waits for every pull issued: before a block is let go (MLX's)
        self.limit = limit
        self.file: DataFile | None = None
        self.blocks: OrderedDict[int, int] = OrderedDict()  # k -> bytes registered
        self.failed = False
        self.lock = threading.Lock()  # the blocks, between the MLX thread and the grower

    def ensure(self, file: DataFile, chunks: list[tuple[int, int]]) -> bool:
        """Every block the chunks (offset, length) touch registered over what they need;
        False (nothing to gather from) when the limit or a registration refuses."""
        if file is not self.file:
            self.let_go()  # compacted: the old file's pages go back
            self.file = file
        needs: dict[int, int] = {}
        for offset, length in chunks:
            for k in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
                needs[k] = max(needs.get(k, 0), min(BLOCK, offset + length - k * BLOCK))
        missing = {k: n for k, n in needs.items() if self.blocks.get(k, 0) < n}
        for k in needs:
            if k in self.blocks:
                self.blocks.move_to_end(k)
        if not missing:
            return True
        size = file.size()
        extents = {k: min(BLOCK, size - k * BLOCK) for k in missing}
        if any(extents[k] < n for k, n in missing.items()):
            return False  # past the file's end: a stale placement
        self._settle()
        for k in missing:
            if k in self.blocks:  # registered short of what is needed now: again, longer
                self._cuda.unregister(file.base + k * BLOCK)
                del self.blocks[k]
        wanted = sum(extents.values())
        others = [k for k in self.blocks if k not in needs]
        while others and self.pinned() + wanted > self.limit:
            old = others.pop(0)
            self._cuda.unregister(file.base + old * BLOCK)
            del self.blocks[old]
        if self.pinned() + wanted > self.limit:
            return False
        return all(self.register(file, k, extents[k]) for k in missing)

    def pinned(self) -> int:
        return sum(self.blocks.values())

    def register(self, file: DataFile, k: int, size: int) -> bool:
        address = file.base + k * BLOCK
        try:
            self._cuda.register(
                address, size, CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_READ_ONLY
            )
            self.blocks[k] = size
            # A chunk may span two blocks: the gather needs the host's addresses (unified
            # addressing), not one device mapping per block.
            if self._cuda.device_pointer(address) != address:
                raise RuntimeError("a registered page's device address is not its host's")
        except (OSError, RuntimeError) as exc:
            log.warning("direct restores copy through the host (registering failed: %s)", exc)
            self.failed = True
            return False
        return True

    def grow(self, file: DataFile) -> None:
        """Registers the file's whole blocks not registered yet, while the limit allows
        (lets none go: only the MLX thread may, after a settle)."""
        for k in range(file.size() // BLOCK):
            with self.lock:
                if file is not self.file or self.failed:
                    return
                if k not in self.blocks and self.pinned() + BLOCK <= self.limit:
                    self.register(file, k, BLOCK)

    def let_go(self) -> None:
        if self.file is None:
            return
        self._settle()
        for k in self.blocks:
            self._cuda.unregister(self.file.base + k * BLOCK)
        self.blocks.clear()
        self.file = None


class FilePins:
    """The data file's pages registered with CUDA (BlockPins), and the gather kernel that
    reads them into MLX arrays."""

    def __init__(self, cuda: HostPinning, settle: Any) -> None:
        self._cuda = cuda
        self.blocks = BlockPins(cuda, settle)
        self._grower: threading.Thread | None = None
        self._stream: Any = None  # the gather stream (made on the MLX thread)
        self._stop = threading.Event()
        self._registered = 0  # bytes the last gather had to register itself
        self._planes = PlaneGather()
        self.gathers_planes = False  # until warm() has checked the plane gather
        self._kernel: Any = mx.fast.cuda_kernel(
            name="tandem_gather_pinned",
            input_names=["p"],
            output_names=["out"],
            source=_GATHER_SOURCE,
        )

    def arrays(
        self, tensors: list[tuple[Tensor, list[tuple[int, int]]]], file: DataFile
    ) -> dict[int, mx.array]:
        """The tensors (with their chunks: file offset, length) pulled by the GPU from the
        file's pages, a group of consecutive tensors per launch on the gather stream, each
        array a view of its group's buffer, all started: id(tensor) -> array. Tensors with
        an unaligned chunk are left out, and all are when the pages cannot be registered:
        the caller copies those through the host."""
        usable = [(t, chunks) for t, chunks in tensors if _aligned(t, chunks)]
        started = time.perf_counter()
        if not usable or not self._pinned(file, [c for _, chunks in usable for c in chunks]):
            return {}
        ensured = time.perf_counter()
        arrays: dict[int, mx.array] = {}
        total = sum(t.nbytes for t, _ in usable)
        with mx.stream(self._gather_stream()):
            for group in _groups(usable, max(MIN_GROUP_BYTES, total // GROUPS)):
                pulled = self._gather_group(group, file.base)
                # Started now, in the model's layer order, each group with its own event:
                # the forward pass waits for the group holding its layer, not for all.
                mx.async_eval(list(pulled.values()))
                arrays.update(pulled)
        self._log_phases(started, ensured)
        return arrays

    def planes(
        self,
        tensors: list[tuple[Tensor, list[tuple[int, int]]]],
        file: DataFile,
        keep: int,
        columns: int,
    ) -> dict[int, mx.array]:
        """As `arrays`, for KV tensors landed as planes with room, each its own buffer
        (direct_planes.py): [1, heads, columns, dim], the first keep positions from the file,
        zeros after. Tensors it cannot gather so are left out for the caller."""
        usable, needed = [], []
        for tensor, chunks in tensors:
            pieces = plane_pieces(tensor, chunks, keep, columns)
            if pieces is not None:
                usable.append((tensor, pieces))
                needed += chunks
        started = time.perf_counter()
        if not usable or not self._pinned(file, needed):
            return {}
        ensured = time.perf_counter()
        planes: dict[int, mx.array] = {}
        width = direct_planes.launch_width(len(usable))
        outputs = direct_planes.kernel_outputs(width)
        with mx.stream(self._gather_stream()):
            for at in range(0, len(usable), width):
                group = usable[at : at + width]
                pulled = self._planes.launch(group, file.base, columns, outputs)
                mx.async_eval(list(pulled.values()))  # in layer order, as `arrays`
                planes.update(pulled)
        self._log_phases(started, ensured)
        return planes

    def _pinned(self, file: DataFile, chunks: list[tuple[int, int]]) -> bool:
        """Every page the chunks touch registered (False: gather nothing, copy instead)."""
        if self._grower is None:
            self._grower = threading.Thread(target=self._grow, name="file-pins", daemon=True)
            self._grower.start()
        with self.blocks.lock:
            before = self.blocks.pinned()
            if self.blocks.failed or not self.blocks.ensure(file, chunks):
                return False
            self._registered = self.blocks.pinned() - before
        return True

    def _gather_stream(self) -> Any:
        if self._stream is None:  # MLX streams belong to the thread that made them
            self._stream = mx.new_stream(mx.gpu)
        return self._stream

    def _log_phases(self, started: float, ensured: float) -> None:
        log.debug(  # where a direct gather's host time went (bench/hit_floor_bench.py reads it)
            "direct gather phases (ms): pins %.1f, launches %.1f, MiB registered %d",
            (ensured - started) * 1e3,
            (time.perf_counter() - ensured) * 1e3,
            self._registered >> 20,
        )

    def _gather_group(
        self, group: list[tuple[Tensor, list[tuple[int, int]]]], device: int
    ) -> dict[int, mx.array]:
        """One launch: the group's tensors into one buffer (registered pages are read at
        their host addresses, checked at registration)."""
        table: list[int] = []
        placed: list[tuple[Tensor, int]] = []
        at = longest = 0
        for tensor, chunks in group:
            placed.append((tensor, at))
            for offset, length in chunks:
                table += [device + offset, at, length // 16]
                at += length
                longest = max(longest, length)
        raw = self._gather(table, at, longest)
        return {
            id(t): raw[start : start + t.nbytes].view(getattr(mx, t.dtype)).reshape(t.shape)
            for t, start in placed
        }

    def warm(self, device_address: int, host: memoryview, kv_planes: int) -> None:
        """Compiles the gather kernels now (a second or so each on first use), not in the
        first restore, which the restore-or-prefill choice would take for the route's speed:
        gathers host's bytes (pinned, at device_address) in two pieces and checks them; the
        plane gather's kernel is the one a hit of kv_planes planes launches."""
        half = host.nbytes // 32 * 16
        table = [device_address, 0, half // 16, device_address + half, half, half // 16]
        pulled = self._gather(table, 2 * half, half)
        want = np.frombuffer(host, np.uint8)[: 2 * half]
        if not bool(mx.array_equal(pulled, mx.array(want))):
            raise RuntimeError("the gather read other bytes than the host holds")
        outputs = direct_planes.kernel_outputs(direct_planes.launch_width(kv_planes))
        self.gathers_planes = self._plane_gather_works(device_address, host, outputs)

    def _plane_gather_works(self, device_address: int, host: memoryview, outputs: int) -> bool:
        """The plane gather checked the same way, 2 heads of 64 positions, 40 kept in planes
        of 96 columns; one that fails leaves direct hits to the group gather (logged)."""
        kv = Tensor("warm", "uint16", (1, 2, 64, 64), b"")
        pieces = plane_pieces(kv, [(0, 8192), (8192, 8192)], 40, 96)
        assert pieces is not None
        source = np.frombuffer(host, np.uint16)[: 2 * 64 * 64].reshape(1, 2, 64, 64)
        expected = np.zeros((1, 2, 96, 64), np.uint16)
        expected[:, :, :40] = source[:, :, :40]
        try:
            plane = self._planes.launch([(kv, pieces)], device_address, 96, outputs)[id(kv)]
            if bool(mx.array_equal(plane, mx.array(expected))):
                return True
            problem = "it read other bytes than the host holds"
        except (RuntimeError, ValueError) as exc:
            problem = str(exc)
        log.warning("direct hits land without planes with room (the plane gather: %s)", problem)
        return False

    def _gather(self, table: list[int], nbytes: int, longest: int) -> mx.array:
        chunks = len(table) // 3
        per_chunk = min(
            MAX_BLOCKS_PER_CHUNK,
            -(-(longest // 16) // THREADS_PER_BLOCK),
            max(1, GATHER_BLOCKS // chunks),
        )
        outputs: list[mx.array] = self._kernel(
            inputs=[mx.array(np.array(table, np.uint64))],
            output_shapes=[(nbytes,)],
            output_dtypes=[mx.uint8],
            grid=(per_chunk * THREADS_PER_BLOCK, chunks, 1),
            threadgroup=(THREADS_PER_BLOCK, 1, 1),
        )
        return outputs[0]

    def _grow(self) -> None:
        while not self._stop.wait(GROWTH_POLL_S):
            file = self.blocks.file
            if file is not None:
                self.blocks.grow(file)

    def close(self) -> None:
        self._stop.set()
        with self.blocks.lock:
            self.blocks.let_go()
