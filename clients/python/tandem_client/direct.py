"""A direct Get's answer (docs/store.md, "Direct reads"): where the payload's chunks lie in
the store's data file, read by the caller itself, usable once the store has checked them and
its lease was held for the whole read.

The answer is the header, a DirectPlacement, then one progress message (the whole payload
verified) or an error (DATA_LOSS: a chunk failed its check). A hold's `arrival` follows that
verdict on a thread of its own; `release()` ends the lease and says whether it held.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from tandem_client.data_file import DataFile, FileIdentity
from tandem_client.errors import DataLoss, TandemError, from_rpc_error
from tandem_client.records import Checkpoint, Tensor
from tandem_client.regions import Arrival
from tandem_wire.pb import store_pb2

# ReleaseDirect(lease) -> whether the lease was still held.
Release = Callable[[int], bool]


class StaleDataFile(Exception):
    """The placement names another data file than the one mapped (the store compacted)."""


class DirectHold:
    """The chunks of one direct Get, as views of the data file, while the store keeps them."""

    region = None  # not a region span (callers that copy out of one test this)

    def __init__(
        self,
        checkpoint: Checkpoint,
        placement: store_pb2.DirectPlacement,
        data_file: DataFile,
        release: Release,
    ) -> None:
        lengths = list(placement.chunk_lengths)
        if len(lengths) != len(placement.chunk_offsets):
            raise DataLoss("a direct placement's offsets and lengths disagree")
        if sum(lengths) != checkpoint.payload_bytes:
            raise DataLoss("a direct placement's chunks disagree with the header's size")
        self.lease = placement.lease
        self.data_file = data_file
        self.arrival = Arrival(checkpoint.payload_bytes)
        self._chunks = chunks_by_tensor(checkpoint.all_tensors(), placement)
        offsets = np.asarray(placement.chunk_offsets, dtype=np.int64)
        end = int((offsets + np.asarray(lengths, dtype=np.int64)).max()) if lengths else 0
        data_file.view(0, end)  # every chunk inside the file (FailedPrecondition if not)
        self._held: bool | None = None
        self._finalizer = weakref.finalize(self, _release_quietly, release, placement.lease)
        self._release = release

    def chunks(self, tensor: Tensor) -> list[tuple[int, int]]:
        """Where the tensor's bytes lie in the data file, in order: (offset, length)."""
        return self._chunks[id(tensor)]

    def segments(self, tensor: Tensor) -> list[memoryview]:
        """The tensor's bytes, in order, as views of the data file (valid until release)."""
        return [self.data_file.view(offset, length) for offset, length in self.chunks(tensor)]

    def copy(self, tensor: Tensor) -> np.ndarray:
        """The tensor's bytes in a buffer of its own (one copy)."""
        parts = [np.frombuffer(v, np.uint8) for v in self.segments(tensor)]
        if len(parts) == 1:
            return parts[0].copy()
        return np.concatenate(parts) if parts else np.empty(0, np.uint8)

    def release(self) -> bool:
        """Ends the lease (once); True when it held throughout, so what was read from it is
        the record's bytes. Anything read after this is not."""
        if self._held is None:
            self._finalizer.detach()
            self._chunks.clear()
            try:
                self._held = self._release(self.lease)
            except TandemError:
                self._held = False
        return self._held

    @property
    def released(self) -> bool:
        return self._held is not None


def chunks_by_tensor(
    tensors: list[Tensor], placement: store_pb2.DirectPlacement
) -> dict[int, list[tuple[int, int]]]:
    """Each tensor's chunks (offset, length), in payload order: the chunks' running ends must
    meet every tensor's end (a 32k-token prefix record has thousands of chunks: numpy, not a
    Python loop over them)."""
    lengths = np.asarray(placement.chunk_lengths, dtype=np.int64)
    if lengths.size and lengths.min() <= 0:
        raise DataLoss("a direct placement has an empty chunk")
    ends = np.cumsum(lengths)
    sizes = np.asarray([t.nbytes for t in tensors], dtype=np.int64)
    bounds = np.cumsum(sizes)
    sized = sizes > 0
    # The chunk each tensor's bytes end in (an empty tensor's: the one before it ends in).
    last = np.where(
        sized, np.searchsorted(ends, bounds), np.searchsorted(ends, bounds, side="right") - 1
    )
    inside = last[sized] < ends.size
    if not inside.all() or (ends[last[sized]] != bounds[sized]).any():
        raise DataLoss("a direct placement's chunks do not fit its tensors")
    pairs = list(zip(placement.chunk_offsets, placement.chunk_lengths, strict=True))
    first = np.concatenate([[0], last[:-1] + 1]) if len(tensors) else last
    chunks: dict[int, list[tuple[int, int]]] = {}
    for tensor, size, a, b in zip(tensors, sizes, first.tolist(), last.tolist(), strict=True):
        chunks[id(tensor)] = pairs[a : b + 1] if size else []
    return chunks


def _release_quietly(release: Release, lease: int) -> None:
    try:
        release(lease)
    except Exception:  # noqa: BLE001 - dropped unreleased: the lease lapses on its own
        pass


def read_direct(
    header: store_pb2.GetResponse,
    placement: store_pb2.DirectPlacement,
    messages: Iterator[bytes],
    data_file: DataFile,
    release: Release,
) -> tuple[Checkpoint, DirectHold]:
    """The checkpoint and its hold; the store's verdict is followed on a thread of its own.
    Raises StaleDataFile (after releasing the lease) when the placement names another file."""
    named = FileIdentity(placement.file_device, placement.file_inode)
    if named != data_file.identity:
        _release_quietly(release, placement.lease)
        raise StaleDataFile(f"the store now reads {named}, this client maps {data_file.identity}")
    checkpoint = Checkpoint.from_header(header.header)
    try:
        hold = DirectHold(checkpoint, placement, data_file, release)
    except BaseException:
        _release_quietly(release, placement.lease)
        raise
    arrival = hold.arrival

    def follow() -> None:
        error: TandemError | None = None
        try:
            for raw in messages:
                message = store_pb2.GetResponse.FromString(raw)
                if message.WhichOneof("item") != "progress":
                    raise DataLoss("unexpected message in a direct Get's answer")
                arrival.advance(min(message.progress.verified_bytes, arrival.total))
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        except TandemError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a broken answer: nothing of it is used
            error = DataLoss(f"reading the store's answer failed: {exc}")
        arrival.end(error)

    threading.Thread(target=follow, name="direct-get", daemon=True).start()
    return checkpoint, hold
