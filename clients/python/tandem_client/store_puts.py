"""The Puts of StoreClient: one record (put) or several (put_many), through the attached
region where a payload lies there, in one PutRecords message when the payloads are small or
placed, streamed (Put, PutMany) otherwise. A mixin so that store_client.py keeps the rest."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tandem_client.bulk import (
    DEFAULT_CHUNK_BYTES,
    RegionPut,
    fits_one_message,
    put_messages,
    put_records_request,
)
from tandem_client.errors import NotFound, PutManyFailed, TandemError, from_rpc_error
from tandem_client.records import Checkpoint, PutItem, PutResult
from tandem_client.regions import RegionHold
from tandem_wire.pb import store_pb2

T = TypeVar("T")


class StorePuts:
    """Put calls of StoreClient (which provides the attributes declared here)."""

    timeout: float | None
    _put: Any  # grpc multi-callables (called, or .future)
    _put_many: Any
    _put_records: Any
    _put_records_known: bool  # False once a store answered UNIMPLEMENTED (an older one)

    if TYPE_CHECKING:  # provided by StoreClient, SameHostReads and GrpcClient

        def _call(self, fn: Callable[[], T]) -> T: ...

        def _bulk_slot(self) -> contextlib.AbstractContextManager[object]: ...

        def _place_for_put(
            self, checkpoint: Checkpoint
        ) -> tuple[RegionPut | None, RegionHold | None]: ...

        def _forgot_region(self, error: TandemError) -> bool: ...

    def put(
        self,
        checkpoint: Checkpoint,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> PutResult:
        """Stores a checkpoint (with a region attached, its payload goes through the region:
        the store reads and checks it there instead of receiving chunks)."""
        placed, hold = self._place_for_put(checkpoint)
        item = PutItem(checkpoint, if_absent, pin_ttl_s, pin_holder)
        if self._put_records_known and fits_one_message([item], [placed]):
            try:
                return self._put_placed([item], [(placed, hold)], chunk_bytes)[0]
            except PutManyFailed as exc:
                raise exc.cause from None
            finally:
                if hold is not None:
                    hold.release()

        def requests_again() -> Iterator[store_pb2.PutRequest | bytes]:
            return put_messages(checkpoint, if_absent, pin_ttl_s, pin_holder, chunk_bytes, placed)

        try:
            requests = requests_again()
            with self._bulk_slot():
                try:
                    r: store_pb2.PutResponse = self._call(
                        lambda: self._put(requests, timeout=self.timeout)
                    )
                except NotFound as exc:
                    if placed is None or not self._forgot_region(exc):
                        raise
                    r = self._call(lambda: self._put(requests_again(), timeout=self.timeout))
        finally:
            if hold is not None:
                hold.release()
        return PutResult(r.key, r.payload_bytes, r.replaced, r.lease_id)

    def put_many(
        self, items: Sequence[PutItem], chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> list[PutResult]:
        """Several records in one call, stored in order, each atomically (one call's
        overhead instead of one per record; through the attached region like put()).
        Raises PutManyFailed saying how many landed."""
        # Checked before the call: an exception inside the request stream reaches the
        # caller as grpc's UNKNOWN "Exception iterating requests!".
        for i in items:
            if not isinstance(i, PutItem):
                raise TypeError(f"put_many takes PutItem values, not {type(i).__name__}")
        placements = [self._place_for_put(i.checkpoint) for i in items]
        try:
            return self._put_placed(items, placements, chunk_bytes)
        finally:
            for _, hold in placements:
                if hold is not None:
                    hold.release()

    def _put_placed(
        self,
        items: Sequence[PutItem],
        placements: Sequence[tuple[RegionPut | None, object]],
        chunk_bytes: int,
    ) -> list[PutResult]:
        """put_many once its payloads are placed, sent again once if the store had forgotten
        the region (it restarted)."""
        try:
            return self._put_many_once(items, placements, chunk_bytes)
        except PutManyFailed as exc:
            if not isinstance(exc.cause, NotFound) or not self._forgot_region(exc.cause):
                raise
            done = exc.stored  # those landed; the rest go again, the region known again
        try:
            rest = self._put_many_once(items[done:], placements[done:], chunk_bytes)
        except PutManyFailed as again:
            raise PutManyFailed(again.cause, done + again.stored) from None
        # Their answers were lost with the first call: what the client knows of them.
        known = [PutResult(i.checkpoint.key, i.checkpoint.payload_bytes, False, "") for i in items]
        return known[:done] + rest

    def _put_many_once(
        self,
        items: Sequence[PutItem],
        placements: Sequence[tuple[RegionPut | None, object]],
        chunk_bytes: int,
    ) -> list[PutResult]:
        """One PutRecords call when every payload is in the region or small (no stream), else
        one PutMany; a store that has no PutRecords (older) is sent PutMany from then on."""

        def messages() -> Iterator[store_pb2.PutRequest | bytes]:
            for i, (placed, _) in zip(items, placements, strict=True):
                yield from put_messages(
                    i.checkpoint, i.if_absent, i.pin_ttl_s, i.pin_holder, chunk_bytes, placed
                )

        places = [placed for placed, _ in placements]
        one_message = None
        if self._put_records_known and fits_one_message(items, places):
            one_message = put_records_request(items, places)
        with self._bulk_slot():
            try:
                r: store_pb2.PutManyResponse = (
                    self._put_records(one_message, timeout=self.timeout)
                    if one_message is not None
                    else self._put_many(messages(), timeout=self.timeout)
                )
                return [
                    PutResult(x.key, x.payload_bytes, x.replaced, x.lease_id) for x in r.results
                ]
            except grpc.RpcError as exc:
                if one_message is None or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    trailing = dict(exc.trailing_metadata() or ())
                    stored = int(trailing.get("tandem-stored", "0"))
                    raise PutManyFailed(from_rpc_error(exc), stored) from None
        self._put_records_known = False  # nothing was stored: all go again as PutMany
        return self._put_many_once(items, placements, chunk_bytes)
