"""Where a store read lands: bytes in the shared-memory region -> MLX arrays, with the fewest
copies the backend allows.

- CPU (and Metal): `mx.array` of a numpy view of the region: one copy, the only one after the
  store's (the region's bytes are not kept: the span goes back to the next read).
- MLX-CUDA: the region is pinned once (`cudaHostRegister` through ctypes on the CUDA runtime
  MLX itself loaded) and each tensor is pulled by a one-loop `mx.fast.cuda_kernel` that reads
  the pinned pages straight into a fresh MLX array: 43 GB/s on the H200 against 2.4 GB/s for
  `mx.array(numpy)`, which goes through managed memory (../shared/gpu/README.md). The kernel's
  output is MLX's own buffer, so nothing is written behind MLX's back (a `cudaMemcpy` into an
  MLX buffer would need its address and a synchronize, and is unsafe while MLX holds it).

MLX has no API for either (no DLPack import of CUDA memory in 0.32.4, no host-pinning), which
is why this small layer exists; anything it cannot do falls back to the one-copy host path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.checkpoints.direct_landing import FilePins, HostPinning, joined
from engine_service.cuda_runtime import CudaRuntime
from tandem_client.direct import DirectHold
from tandem_client.records import Checkpoint, Tensor
from tandem_client.regions import RegionHold, SharedRegion

log = logging.getLogger(__name__)

# dtypes numpy cannot hold travel as same-width unsigned words (checkpoints/cache_records.py).
WORD_VIEWS = {"bfloat16": (mx.uint16, np.uint16)}
# Pull kernel launch: 16-byte words, a grid-stride loop over at most this many threads.
THREADS_PER_BLOCK = 256
MAX_THREADS = 132 * 8 * THREADS_PER_BLOCK
_PULL_SOURCE = """
  const uint4* src = reinterpret_cast<const uint4*>(p[0]);
  uint4* dst = reinterpret_cast<uint4*>(out);
  size_t n16 = (size_t)p[1];
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i < n16; i += stride) { dst[i] = src[i]; }
"""


_PUSH_SOURCE = """
  const uint4* src = reinterpret_cast<const uint4*>(x);
  uint4* dst = reinterpret_cast<uint4*>(p[0]);
  size_t n16 = (size_t)p[1];
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i < n16; i += stride) { dst[i] = src[i]; }
  if (blockIdx.x == 0 && threadIdx.x == 0) { done[0] = 1; }  // something to evaluate
"""
# Each pushed tensor starts on this boundary within its span.
PUSH_ALIGN = 64


def _threads(nbytes: int) -> int:
    """Threads for a copy of nbytes in 16-byte words: whole blocks, at most MAX_THREADS."""
    blocks = max(1, -(-(nbytes // 16) // THREADS_PER_BLOCK))
    return min(MAX_THREADS, blocks * THREADS_PER_BLOCK)


def push_bytes(arrays: list[mx.array]) -> int:
    """The span a push of these arrays needs."""
    return sum(-(-a.nbytes // PUSH_ALIGN) * PUSH_ALIGN for a in arrays)


def host_array(tensor: Tensor) -> mx.array:
    """One copy: MLX copies the bytes when the array is made, so the source may be reused."""
    view = WORD_VIEWS.get(tensor.dtype)
    np_dtype = view[1] if view else np.dtype(tensor.dtype)
    stored = mx.array(np.frombuffer(tensor.data, dtype=np_dtype).reshape(tensor.shape))
    return stored.view(getattr(mx, tensor.dtype)) if view else stored


def host_plane(tensor: Tensor, keep: int, columns: int) -> mx.array:
    """A KV plane [B, H, columns, D]: the tensor's first `keep` positions, then zeros, made
    as one host buffer that MLX copies. A batch takes a lone row's plane with room as it is
    (kv/planes.py), where the landed array and the plane the batch grew from it cost two
    copies and a fill (CPU, 16.8 MB in 8 planes: 2.6 ms against 5.7 ms)."""
    batch, heads, positions, dim = tensor.shape
    if not 0 < keep <= positions <= columns:
        raise ValueError(f"a plane of {columns} columns cannot keep {keep} of {positions}")
    view = WORD_VIEWS.get(tensor.dtype)
    np_dtype = view[1] if view else np.dtype(tensor.dtype)
    source = np.frombuffer(tensor.data, dtype=np_dtype).reshape(tensor.shape)
    staged = np.empty((batch, heads, columns, dim), dtype=np_dtype)
    staged[:, :, :keep, :] = source[:, :, :keep, :]
    staged[:, :, keep:, :] = 0
    plane = mx.array(staged)
    return plane.view(getattr(mx, tensor.dtype)) if view else plane


class Landing:
    """Turns tensors into MLX arrays; `settle()` before the bytes they came from are reused."""

    kind = "host"

    @property
    def gathers_planes(self) -> bool:
        """Whether direct reads land as planes with room on the device (direct_planes.py)."""
        return False

    def array(self, tensor: Tensor) -> mx.array:
        return host_array(tensor)

    def start(self, array: mx.array) -> mx.array:
        """Starts making array now, not when it is first needed (host copies are made)."""
        return array

    def arrays(self, tensors: list[Tensor]) -> dict[int, mx.array]:
        """A record's tensors as arrays, id(tensor) -> array (a host copy each here)."""
        return {id(t): host_array(t) for t in tensors}

    def settle(self) -> None:
        """Host copies are complete when made."""

    def direct(self, tensors: list[Tensor], hold: DirectHold) -> dict[int, mx.array]:
        """A direct Get's tensors (their chunks, views of the store's data file) as arrays:
        id(tensor) -> array."""
        return {id(t): host_array(joined(t, hold.segments(t))) for t in tensors}

    def direct_planes(
        self, tensors: list[Tensor], hold: DirectHold, keep: int, columns: int
    ) -> dict[int, mx.array]:
        """A direct Get's KV tensors as planes with room (`host_plane`): id(tensor) -> plane."""
        return {id(t): host_plane(joined(t, hold.segments(t)), keep, columns) for t in tensors}

    def push_many(
        self, pushes: list[tuple[list[mx.array], memoryview]]
    ) -> tuple[list[list[memoryview] | None], list[mx.array]]:
        """Each capture's arrays written into its span (pinned host memory) by the device, not
        waited on: the views (None: this landing cannot, the caller views the arrays' own
        memory instead), and the flags to evaluate before reading them."""
        return [None] * len(pushes), []

    def close(self) -> None:
        pass


class PinnedLanding(Landing):
    """MLX-CUDA: tensors viewing the pinned region are pulled by the GPU itself."""

    kind = "pinned"

    def __init__(self, region: SharedRegion, cuda: HostPinning) -> None:
        self.region = region
        self._cuda = cuda
        self._base = np.frombuffer(region.buf, np.uint8).ctypes.data
        cuda.register(self._base, region.size)
        # The address the GPU reads the pinned pages at (the host's, with unified addressing).
        self._device_base = cuda.device_pointer(self._base)
        self._pending: list[mx.array] = []
        self._file_pins: FilePins | None = None  # made at the first direct restore
        self._kernel: Any = mx.fast.cuda_kernel(
            name="tandem_pull_pinned",
            input_names=["p"],
            output_names=["out"],
            source=_PULL_SOURCE,
        )
        self._pusher: Any = mx.fast.cuda_kernel(
            name="tandem_push_pinned",
            input_names=["x", "p"],
            output_names=["done"],
            source=_PUSH_SOURCE,
        )

    def _in_region(self, address: int, nbytes: int) -> bool:
        return self._base <= address and address + nbytes <= self._base + self.region.size

    def array(self, tensor: Tensor) -> mx.array:
        nbytes = tensor.nbytes
        address = _address(tensor)
        if not nbytes or address % 16 or nbytes % 16 or not self._in_region(address, nbytes):
            return host_array(tensor)  # not a pinned, 16-byte-aligned span: one host copy
        typed: mx.array = (
            self._pull(address, nbytes).view(getattr(mx, tensor.dtype)).reshape(tensor.shape)
        )
        return typed

    def _pull(self, address: int, nbytes: int) -> mx.array:
        """nbytes (a multiple of 16) of the pinned region from address, as a uint8 array."""
        (raw,) = self._kernel(
            inputs=[
                mx.array(
                    np.array([self._device_base + address - self._base, nbytes // 16], np.uint64)
                )
            ],
            output_shapes=[(nbytes,)],
            output_dtypes=[mx.uint8],
            grid=(_threads(nbytes), 1, 1),
            threadgroup=(THREADS_PER_BLOCK, 1, 1),
        )
        self._pending.append(raw)
        return raw  # type: ignore[no-any-return]

    def arrays(self, tensors: list[Tensor]) -> dict[int, mx.array]:
        """A record's tensors lying together in the region (a placed Get's payload) pulled by
        one launch over their whole extent, each array a view of that buffer: a launch costs
        the host about as much as pulling a few MB, so a record of many small tensors (a
        chain segment: 2 per layer, a few hundred KB each) would cost more a tensor at a time
        than through mx.array. Anything else is pulled (or copied) a tensor at a time."""
        placed = [(t, _address(t)) for t in tensors if t.nbytes]
        low = min((a for _, a in placed), default=0)
        high = max((a + t.nbytes for t, a in placed), default=0)
        extent = -(-(high - low) // 16) * 16
        together = extent <= 2 * sum(t.nbytes for t, _ in placed)  # not scattered
        whole = placed and together and low % 16 == 0 and self._in_region(low, extent)
        if not whole or any((a - low) % 16 for _, a in placed):
            return {id(t): self.array(t) for t in tensors}
        raw = self._pull(low, extent)
        out = {
            id(t): raw[a - low : a - low + t.nbytes].view(getattr(mx, t.dtype)).reshape(t.shape)
            for t, a in placed
        }
        out.update({id(t): self.array(t) for t in tensors if not t.nbytes})
        return out

    def direct(self, tensors: list[Tensor], hold: DirectHold) -> dict[int, mx.array]:
        """Pulled by the GPU straight from the data file's pages, a launch per group of layers
        (direct_landing.py); what it cannot pull is copied through the host."""
        if self._file_pins is None:  # made by warm()
            self._file_pins = FilePins(self._cuda, self.settle)
        wanted = [(t, hold.chunks(t)) for t in tensors]
        pulled = self._file_pins.arrays(wanted, hold.data_file)
        self._pending.extend(pulled.values())  # views of one buffer per launched group
        for tensor in tensors:
            if id(tensor) not in pulled:
                pulled[id(tensor)] = host_array(joined(tensor, hold.segments(tensor)))
        return pulled

    @property
    def gathers_planes(self) -> bool:
        return self._file_pins is not None and self._file_pins.gathers_planes

    def direct_planes(
        self, tensors: list[Tensor], hold: DirectHold, keep: int, columns: int
    ) -> dict[int, mx.array]:
        """A direct Get's KV tensors gathered by the GPU into planes with room, each its own
        buffer (direct_planes.py); what it cannot gather so is copied through the host."""
        if self._file_pins is None:
            self._file_pins = FilePins(self._cuda, self.settle)
        wanted = [(t, hold.chunks(t)) for t in tensors]
        planes = self._file_pins.planes(wanted, hold.data_file, keep, columns)
        self._pending.extend(planes.values())
        left = [t for t in tensors if id(t) not in planes]
        planes.update(super().direct_planes(left, hold, keep, columns))
        return planes

    def push(self, arrays: list[mx.array], span: memoryview) -> list[memoryview] | None:
        """Device -> pinned region: one kernel a tensor writes it into span, ~40 GB/s, where
        a host view of an MLX-CUDA array would migrate it through managed memory (~3 GB/s)
        on the MLX thread. Waits for the copies; returns a view of span per array."""
        views, done = self.push_many([(arrays, span)])
        mx.eval(done)
        return views[0]

    def push_many(
        self, pushes: list[tuple[list[mx.array], memoryview]]
    ) -> tuple[list[list[memoryview] | None], list[mx.array]]:
        """Several captures pushed, each into its span, without waiting: the views are
        written once the returned flags are evaluated. A wait right after a push is a pipeline
        bubble (the next decode step is queued ahead of the copies); a checkpoint round's
        pushes are waited on one step later (checkpoints/generations.py)."""
        out: list[list[memoryview] | None] = []
        done: list[mx.array] = []
        for arrays, span in pushes:
            address = np.frombuffer(span, np.uint8).ctypes.data
            fits = self._in_region(address, span.nbytes) and push_bytes(arrays) <= span.nbytes
            if not fits or any(a.nbytes % 16 for a in arrays) or address % PUSH_ALIGN:
                out.append(None)
                continue
            views, at = [], 0
            for array in arrays:
                n = array.nbytes
                target = self._device_base + address + at - self._base
                (flag,) = self._pusher(
                    inputs=[
                        mx.contiguous(array).reshape(-1).view(mx.uint8),
                        mx.array(np.array([target, n // 16], np.uint64)),
                    ],
                    output_shapes=[(1,)],
                    output_dtypes=[mx.uint8],
                    grid=(_threads(n), 1, 1),
                    threadgroup=(THREADS_PER_BLOCK, 1, 1),
                )
                done.append(flag)
                views.append(span[at : at + n])
                at += -(-n // PUSH_ALIGN) * PUSH_ALIGN
            out.append(views)
        return out, done

    def start(self, array: mx.array) -> mx.array:
        """Launches the pull behind array now, so it overlaps what the host does next."""
        mx.async_eval(array)
        return array

    def settle(self) -> None:
        """Waits for every pull issued so far: the region's bytes may then be reused."""
        pending, self._pending = self._pending, []
        if pending:
            mx.eval(pending)

    def warm(self, kv_planes: int) -> None:
        """Compiles the kernels now (~1.4 s on first use) rather than on the first restore;
        the plane gather's for a hit of the model's kv_planes (keys and values a layer)."""
        probe = self.region.buf[4096 : 4096 + (1 << 20)]
        arr = self.array(Tensor("warm", "uint8", (probe.nbytes,), probe))
        self.settle()
        if not bool(mx.array_equal(arr, host_array(Tensor("w", "uint8", arr.shape, probe)))):
            raise RuntimeError("the pinned pull read other bytes than the region holds")
        source = mx.arange(1 << 18, dtype=mx.uint32)  # 1 MiB
        target = self.region.buf[8192 : 8192 + (1 << 20)]
        pushed = self.push([source], target)
        if pushed is None or bytes(pushed[0]) != np.array(source).tobytes():
            raise RuntimeError("the pinned push wrote other bytes than the device holds")
        self._file_pins = FilePins(self._cuda, self.settle)
        self._file_pins.warm(self._device_base + 4096, probe, kv_planes)

    def close(self) -> None:
        self.settle()
        if self._file_pins is not None:
            self._file_pins.close()
        self._cuda.unregister(self._base)


def _address(tensor: Tensor) -> int:
    """Where a tensor's bytes lie in this process's memory (0 for none)."""
    data = memoryview(tensor.data)
    return np.frombuffer(data, np.uint8).ctypes.data if data.nbytes else 0


def landing_for(region: SharedRegion | None, kv_planes: int) -> Landing:
    """The best landing this backend offers for the region (the host copy when in doubt), for
    a model whose prefix records hold kv_planes KV planes (its direct hits' launch width)."""
    if region is None or not mx.cuda.is_available():
        return Landing()
    try:
        pinned = PinnedLanding(region, CudaRuntime.load())
        pinned.warm(kv_planes)
    except (OSError, RuntimeError, AttributeError) as exc:
        log.warning("restores copy through the host (no pinned device path: %s)", exc)
        return Landing()
    log.info("restores are pulled by the GPU from the pinned region (%d MiB)", region.size >> 20)
    return pinned


def as_they_arrive(
    landing: Landing,
    stored: Checkpoint,
    hold: RegionHold | DirectHold | None,
    timeout_s: float,
) -> Callable[[Tensor], mx.array]:
    """How a restore's tensors become arrays: each once the store has verified its bytes in
    the region (a progressive Get: hold.arrival), its pull started at once so the device
    copies it while the store copies the next part. Raises the Get's error (DataLoss, ...)
    for a tensor whose bytes never arrive. A direct Get's tensors are read at once, while the
    store checks them: the caller waits for its verdict before using them."""
    if isinstance(hold, DirectHold):
        arrays = landing.direct(stored.all_tensors(), hold)  # started as they are made
        return lambda tensor: arrays[id(tensor)]
    arrival = hold.arrival if hold is not None else None
    if arrival is None:
        return landing.array
    ends = _arrival_ends(stored)

    def to_array(tensor: Tensor) -> mx.array:
        arrival.wait(ends[id(tensor)], timeout_s)
        return landing.start(landing.array(tensor))

    return to_array


def planes_as_they_arrive(
    stored: Checkpoint, hold: RegionHold | None, timeout_s: float
) -> Callable[[Tensor, int, int], mx.array]:
    """As `as_they_arrive`, for the host landing's KV planes with room (`host_plane`): each
    tensor landed once its bytes are in the region (a direct read's: `Landing.direct_planes`)."""
    arrival = hold.arrival if hold is not None else None
    ends = _arrival_ends(stored)

    def to_plane(tensor: Tensor, keep: int, columns: int) -> mx.array:
        if arrival is not None:
            arrival.wait(ends[id(tensor)], timeout_s)
        return host_plane(tensor, keep, columns)

    return to_plane


def _arrival_ends(stored: Checkpoint) -> dict[int, int]:
    """id(tensor) -> the payload's bytes up to its end (payload order)."""
    ends, at = {}, 0
    for tensor in stored.all_tensors():
        at += tensor.nbytes
        ends[id(tensor)] = at
    return ends
