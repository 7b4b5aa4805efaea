"""Several records read into the attached region in one call (`Store.GetRecords`), a mixin of
StoreClient beside same_host.py.

A Get a record is a call and a stream of two messages; for a checkpoint chain's small
segments that, not the bytes, was most of a resume's reads (docs/performance.md, seventh
session). GetRecords answers every read in one message. A read the call cannot serve (no span
free, larger than its span), a client without a region and a store without GetRecords (an
older release) fall back to a Get a record, with the same answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tandem_client.direct import DirectHold
from tandem_client.errors import DataLoss, NotFound, TandemError
from tandem_client.progressive import view_placed
from tandem_client.records import Checkpoint
from tandem_client.regions import SETTLED_CODES, RegionHold, RegionReads, Span, Tag
from tandem_client.same_host import ReadRoutes, RoutedRead
from tandem_wire.pb import store_pb2

T = TypeVar("T")


@dataclass(frozen=True)
class HeldRead:
    """One key of StoreClient.get_held_many: the record (its tensors viewing `hold`'s span
    until it is released; hold None: they own their bytes), or None when the namespace holds
    no such record; damaged: it is quarantined."""

    checkpoint: Checkpoint | None
    hold: RegionHold | None = None
    damaged: bool = False


class RecordReads:
    """GetRecords for StoreClient (which provides the attributes declared here)."""

    timeout: float | None
    _reads: RegionReads | None
    _store: Any
    _routes: ReadRoutes
    _get_records_known: bool  # False once a store answered UNIMPLEMENTED

    if TYPE_CHECKING:  # provided by StoreClient, SameHostReads and GrpcClient

        def _call(self, fn: Callable[[], T]) -> T: ...

        def _retry_unavailable(self, fn: Callable[[], T]) -> T: ...

        def _bulk_slot(self) -> contextlib.AbstractContextManager[object]: ...

        def _forgot_region(self, error: TandemError) -> bool: ...

        def get_held(
            self, key: bytes, namespace: str = "", *, size_hint: int = 0, progressive: bool = False
        ) -> tuple[Checkpoint, RegionHold | DirectHold | None]: ...

    def get_held_many(
        self, keys: Sequence[bytes], namespace: str, size_hints: Sequence[int]
    ) -> list[HeldRead]:
        """The records of `keys` (at most 64), in order, their payloads read into spans of
        the attached region of their size_hints (their headers' payload_bytes) in one call.
        Release each hold once its tensors are copied. Raises the call's error (every span
        it took given back, or kept from reuse while the store may still write into it)."""
        reads = self._reads
        if reads is None or not self._get_records_known:
            return [self._held_read(k, namespace, n) for k, n in zip(keys, size_hints, strict=True)]
        try:
            answers = self._retry_unavailable(
                lambda: self._call(lambda: self._read_many(reads, keys, namespace, size_hints))
            )
        except TandemError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                if not self._forgot_region(exc):
                    raise
                answers = self._call(lambda: self._read_many(reads, keys, namespace, size_hints))
            else:
                self._get_records_known = False
                answers = [None] * len(keys)
        return [
            answer if answer is not None else self._held_read(key, namespace, size)
            for answer, key, size in zip(answers, keys, size_hints, strict=True)
        ]

    def _read_many(
        self, reads: RegionReads, keys: Sequence[bytes], namespace: str, size_hints: Sequence[int]
    ) -> list[HeldRead | None]:
        """One GetRecords call for the keys a span could be taken for; None where a key is
        left to a Get of its own (no span free, larger than its span)."""
        spans = [reads.acquire(size) if size > 0 else None for size in size_hints]
        asked = [(key, span) for key, span in zip(keys, spans, strict=True) if span is not None]
        tag: Tag = reads.tag
        request = store_pb2.GetRecordsRequest(
            namespace=namespace,
            region=reads.region.name,
            region_registration=tag[1],
            reads=[
                store_pb2.RegionRead(key=key, region_offset=span.offset, region_bytes=span.size)
                for key, span in asked
            ],
        )
        try:
            with self._bulk_slot():
                answer = self._store.GetRecords(request, timeout=self.timeout) if asked else None
        except BaseException as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            for span in spans:
                if span is None:
                    continue
                if code in SETTLED_CODES:
                    reads.release(span)
                else:  # cut short: the store may still be copying into it
                    reads.retire(span, tag)
            raise
        outcomes = iter(answer.records if answer is not None else [])
        held = [None if span is None else _held(reads, span, next(outcomes)) for span in spans]
        for read in held:
            if read is not None and read.checkpoint is not None:
                self._routes.count(RoutedRead(read.checkpoint, read.hold, "region"))
        return held

    def _held_read(self, key: bytes, namespace: str, size_hint: int) -> HeldRead:
        try:
            checkpoint, hold = self.get_held(key, namespace, size_hint=size_hint)
        except NotFound:
            return HeldRead(None)
        except DataLoss:
            return HeldRead(None, damaged=True)
        assert not isinstance(hold, DirectHold)  # only progressive Gets read directly
        return HeldRead(checkpoint, hold)


def _held(reads: RegionReads, span: Span, outcome: store_pb2.RecordRead) -> HeldRead | None:
    """A read's answer: the record viewing its span, or its span given back (nothing was
    written into it) and why; None: larger than its span, left to a Get of its own."""
    kind = outcome.WhichOneof("outcome")
    if kind != "header":
        reads.release(span)
        return None if kind == "larger" else HeldRead(None, damaged=kind == "damaged")
    checkpoint = Checkpoint.from_header(outcome.header)
    view_placed(checkpoint, reads.region, span.offset)
    reads.reads += 1
    return HeldRead(checkpoint, RegionHold(reads, span))
