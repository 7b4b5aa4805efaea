"""Payloads in a region: where a Put's tensors lie in it or are copied to, and the answers of
Gets the store wrote into it, whole or progressive (docs/store.md, "Shared-memory regions").

Progressive Gets: the payload's verified beginning is usable while the store copies the rest
(GetRequest.progressive).

The store answers the header before it copies, then `progress` messages, each saying how many
leading payload bytes are in the region and verified, then `placed`. `read_progressive`
returns after the header with tensors viewing the region and an `Arrival` that a thread of
its own keeps up to date from the rest of the stream; a reader calls `arrival.wait(end)`
before it touches bytes below `end`. A damaged chunk, a store that dies, or a stream that
ends early makes every later wait raise: bytes past the last verified count are never used.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator

import grpc
import numpy as np

from tandem_client.bulk import PayloadAssembler, RegionPut
from tandem_client.errors import DataLoss, TandemError, from_rpc_error
from tandem_client.records import Checkpoint
from tandem_client.regions import Arrival, SharedRegion, Span
from tandem_wire.chunks import decode_chunk
from tandem_wire.pb import store_pb2


def read_progressive(
    messages: Iterator[bytes], region: SharedRegion, offset: int
) -> tuple[Checkpoint, Arrival | None]:
    """The header of a progressive Get into region at offset, tensors viewing the region,
    and the Arrival of their bytes (followed on a thread of its own until the call ends);
    (checkpoint, None) when the store streamed the payload instead (it did not fit)."""
    first = next(messages)
    second = next(messages, None)
    if second is None or decode_chunk(second) is not None:  # streamed after all
        head = [first] if second is None else [first, second]
        checkpoint, _ = read_placed(itertools.chain(head, messages), region, offset)
        return checkpoint, None
    messages = itertools.chain([second], messages)
    header = store_pb2.GetResponse.FromString(first).header
    checkpoint = Checkpoint.from_header(header)
    arrival = Arrival(view_placed(checkpoint, region, offset))

    def follow() -> None:
        error: TandemError | None = None
        ended_by_rpc = False
        try:
            for raw in messages:
                message = store_pb2.GetResponse.FromString(raw)
                kind = message.WhichOneof("item")
                if kind == "progress":
                    arrival.advance(min(message.progress.verified_bytes, arrival.total))
                elif kind == "placed":
                    placement_of(message.placed, region, offset, arrival.total)
                    arrival.advance(arrival.total)
                else:
                    raise DataLoss(f"unexpected {kind!r} in a progressive Get's answer")
        except grpc.RpcError as exc:
            error, ended_by_rpc = from_rpc_error(exc), True
        except TandemError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a broken answer: nothing of it is used
            error = DataLoss(f"reading the store's answer failed: {exc}")
        if error is not None and not ended_by_rpc:
            _drain(messages)  # refused here: the store's copy still runs to its end
        arrival.end(error)

    threading.Thread(target=follow, name="progressive-get", daemon=True).start()
    return checkpoint, arrival


def _drain(messages: Iterator[bytes]) -> None:
    try:
        for _ in messages:
            pass
    except grpc.RpcError:
        pass  # over either way


def placement_in(region: SharedRegion, checkpoint: Checkpoint) -> RegionPut | None:
    """Where the checkpoint's tensors lie in region, when every one of them is a view of it
    (pushed there by the caller); None otherwise."""
    base = np.frombuffer(region.buf, np.uint8).ctypes.data
    offsets = []
    for tensor in checkpoint.all_tensors():
        data = memoryview(tensor.data)
        if not data.nbytes:
            offsets.append(0)
            continue
        if not data.c_contiguous:
            return None
        at = np.frombuffer(data.cast("B"), np.uint8).ctypes.data - base
        if at < 0 or at + data.nbytes > region.size:
            return None
        offsets.append(at)
    return RegionPut(region.name, offsets)


def copy_into(region: SharedRegion, span: Span, checkpoint: Checkpoint) -> RegionPut:
    """Copies the checkpoint's tensors into span back to back (64-byte aligned)."""
    target = np.frombuffer(region.buf, np.uint8)
    offsets, at = [], span.offset
    for tensor in checkpoint.all_tensors():
        n = tensor.nbytes
        np.copyto(target[at : at + n], np.frombuffer(memoryview(tensor.data).cast("B"), np.uint8))
        offsets.append(at)
        at += _aligned(n)
    return RegionPut(region.name, offsets)


def put_span_bytes(checkpoint: Checkpoint) -> int:
    return sum(_aligned(t.nbytes) for t in checkpoint.all_tensors())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # a cache line: each tensor of a copied Put starts on one


def read_placed(
    messages: Iterable[bytes], region: SharedRegion, offset: int
) -> tuple[Checkpoint, bool]:
    """A Get-into-region's answer: (checkpoint, True) with tensors viewing the region where
    the store placed them, or (checkpoint, False) when the store streamed it instead."""
    stream = iter(messages)
    first = next(stream)
    second = next(stream, None)
    placed = _placement(second)
    if placed is None:  # streamed: header, then chunks
        assembler = PayloadAssembler(first)
        for raw in [second] if second is not None else []:
            assembler.feed(raw)
        for raw in stream:
            assembler.feed(raw)
        return assembler.finish(), False
    checkpoint = Checkpoint.from_header(store_pb2.GetResponse.FromString(first).header)
    placement_of(placed, region, offset, view_placed(checkpoint, region, offset))
    return checkpoint, True


def view_placed(checkpoint: Checkpoint, region: SharedRegion, offset: int) -> int:
    """Points the checkpoint's tensors at where a Get placed them (back to back from offset,
    in header order); returns the payload's size."""
    at = offset
    for tensor in checkpoint.all_tensors():
        tensor.data = region.buf[at : at + tensor.nbytes]
        at += tensor.nbytes
    return at - offset


def placement_of(
    placed: store_pb2.RegionPlacement, region: SharedRegion, offset: int, payload_bytes: int
) -> None:
    """Checks a `placed` message against what was asked and what the header says."""
    if placed.region != region.name or placed.offset != offset:
        raise DataLoss("the store placed the payload elsewhere than asked")
    if placed.payload_bytes != payload_bytes:
        raise DataLoss("the placed payload's size disagrees with the header")


def own_tensors(checkpoint: Checkpoint) -> None:
    """Copies a checkpoint's tensors out of the region into buffers of their own."""
    for tensor in checkpoint.all_tensors():
        owned = np.empty(tensor.nbytes, np.uint8)
        np.copyto(owned, np.frombuffer(tensor.data, np.uint8))
        tensor.data = memoryview(owned.data)


def _placement(raw: bytes | None) -> store_pb2.RegionPlacement | None:
    """The `placed` message of a Get into a region; None when the payload was streamed."""
    if raw is None or decode_chunk(raw) is not None:
        return None
    message = store_pb2.GetResponse.FromString(raw)
    return message.placed if message.WhichOneof("item") == "placed" else None
