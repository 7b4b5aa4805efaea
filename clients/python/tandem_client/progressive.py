"""Progressive Gets into a region: the payload's verified beginning is usable while the store
copies the rest (GetRequest.progressive; docs/store.md, "Shared-memory regions").

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
from collections.abc import Iterator

import grpc

from tandem_client.errors import DataLoss, TandemError, from_rpc_error
from tandem_client.records import Checkpoint
from tandem_client.regions import Arrival, SharedRegion, placement_of, read_placed, view_placed
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
