"""The same-host data plane of StoreClient (docs/store.md, "Shared-memory regions"): register a
region, have Gets written into it, hold a payload there, lend spans. A mixin so that
store_client.py keeps the calls every client makes; it uses the client's channel and stubs."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import grpc

from tandem_client.bulk import RegionPut
from tandem_client.data_file import DataFile
from tandem_client.direct import DirectHold, StaleDataFile, read_direct
from tandem_client.errors import TandemError
from tandem_client.progressive import (
    copy_into,
    placement_in,
    put_span_bytes,
    read_placed,
    read_progressive,
)
from tandem_client.records import Checkpoint
from tandem_client.regions import (
    DEFAULT_OFFSET,
    SETTLED_CODES,
    RegionHold,
    RegionReads,
    SharedRegion,
    Span,
    Tag,
    hand_over,
)
from tandem_wire.pb import store_pb2

T = TypeVar("T")
log = logging.getLogger(__name__)

# Smaller payloads stream: a region span and a copy are not worth it below this.
MIN_REGION_PUT_BYTES = 256 << 10

# How a Get's payload came: written by the store into the attached region, or streamed over
# gRPC because no region is attached, the record is larger than the whole region, every
# span was lent to other reads, or the record was larger than the span taken (no size was
# known; the store streams what does not fit).
# "direct": read by this client out of the store's data file (direct.py).
ReadRoute = Literal[
    "region",
    "direct",
    "no region",
    "larger than the region",
    "region busy",
    "larger than the span",
]


@dataclass(frozen=True)
class RoutedRead:
    checkpoint: Checkpoint
    hold: RegionHold | DirectHold | None  # where the payload's bytes are while they are
    route: ReadRoute


class ReadRoutes:
    """Gets counted by route, so a read that could not use the region is never silent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def count(self, read: RoutedRead) -> RoutedRead:
        with self._lock:
            self._counts[read.route] = self._counts.get(read.route, 0) + 1
        if read.route not in ("region", "direct", "no region"):  # "no region": said at attach
            log.info(
                "a store read of %d bytes streamed over gRPC: %s",
                read.checkpoint.payload_bytes,
                read.route,
            )
        return read

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class SameHostReads:
    """Region calls of StoreClient (which provides the attributes declared here)."""

    timeout: float | None
    _reads: RegionReads | None
    _routes: ReadRoutes
    _renewing: threading.Event
    _data_file: DataFile | None  # the store's, for direct Gets (attach_region(direct=True))
    _want_data_file: bool
    _store: Any
    _get: Callable[..., Iterator[bytes]]

    if TYPE_CHECKING:  # provided by StoreClient and GrpcClient

        def _call(self, fn: Callable[[], T]) -> T: ...

        def _retry_unavailable(self, fn: Callable[[], T]) -> T: ...

        def _bulk_slot(self) -> contextlib.AbstractContextManager[object]: ...

        def _get_streamed(
            self, key: bytes, namespace: str, max_chunk_bytes: int = 0
        ) -> Checkpoint: ...

    def register_region(self, region: SharedRegion, ttl_s: int = 60) -> int:
        """Lets the store write into `region` and read Puts out of it (renew before ttl_s
        passes): renews the registration in force, else hands the region's fd over (a
        ticket from the store, the fd with it over the store's region socket, the ticket
        back). Returns when the lease ends, unix ms."""
        wanted = self._want_data_file
        lease = self._register(region, ttl_s, registration=region.registration, data_file=wanted)
        if lease.ticket:
            fd = hand_over(lease.region_socket, lease.ticket, region.fd, self.timeout or 10.0)
            lease = self._register(region, ttl_s, ticket=lease.ticket)
            if fd is not None:
                self._data_file = DataFile(fd)
        region.registration, region.store_instance = lease.registration, lease.store_instance
        reads = self._reads
        if reads is not None and reads.region is region:
            reads.settle(lease.store_instance, lease.registration, lease.superseded_copies)
        return int(lease.expires_at_unix_ms)

    def _register(
        self, region: SharedRegion, ttl_s: int, **fields: Any
    ) -> store_pb2.RegisterRegionResponse:
        request = store_pb2.RegisterRegionRequest(
            name=region.name, size_bytes=region.size, ttl_seconds=ttl_s, **fields
        )
        response: store_pb2.RegisterRegionResponse = self._call(
            lambda: self._store.RegisterRegion(request, timeout=self.timeout)
        )
        return response

    def unregister_region(self, region: SharedRegion) -> None:
        request = store_pb2.UnregisterRegionRequest(name=region.name)
        self._call(lambda: self._store.UnregisterRegion(request, timeout=self.timeout))

    def get_into(
        self,
        key: bytes,
        region: SharedRegion,
        namespace: str = "",
        offset: int = DEFAULT_OFFSET,
        span: int = 0,
        stream_if_larger: bool = False,
    ) -> Checkpoint:
        """The checkpoint, its payload written by the store into `region` from `offset`
        (within `span` bytes, 0 = to the region's end): the tensors' data are views of the
        region, valid until the region is reused. With stream_if_larger a payload that does
        not fit arrives streamed instead (tensors in a buffer of their own)."""
        with self._bulk_slot():
            return self._call(
                lambda: self._read_region(
                    key, region, namespace, Span(offset, span), stream_if_larger
                )[0]
            )

    def attach_region(
        self, region: SharedRegion, slots: int = 4, ttl_s: int = 60, direct: bool = False
    ) -> None:
        """Same-host mode: from now on get() has the store write payloads into `region`
        (registered here, its lease renewed every ttl_s / 3) and copies them out, streaming
        only what does not fit a slot or when every slot is busy. Spans of Gets cut short
        come back once the renewals show the store can no longer write into them.
        direct: ask for the store's data file, so that get_routed(progressive=True) reads
        payloads straight out of it (direct.py; given to a principal of every namespace)."""
        self._want_data_file = direct
        self.register_region(region, ttl_s)
        reads = self._reads = RegionReads(region, slots)
        stop = self._renewing = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    if reads.needs_new_registration():
                        region.registration = 0  # superseded: its cut Gets can end
                    self.register_region(region, ttl_s)
                except TandemError:
                    pass  # the next read registers it again
                except ValueError:  # the channel was closed under us: nothing to renew
                    return

        threading.Thread(target=renew, name="region-lease", daemon=True).start()

    def detach_region(self) -> None:
        if self._reads is None:
            return
        self._renewing.set()
        with contextlib.suppress(TandemError):
            self.unregister_region(self._reads.region)
        self._reads = None

    def reserve_span(self, nbytes: int) -> RegionHold | None:
        """A span of the attached region for bytes of the caller's own (None: no region, or
        none free); it is free again once the hold is released or dropped."""
        reads = self._reads
        span = reads.acquire(nbytes) if reads is not None else None
        return RegionHold(reads, span) if reads is not None and span is not None else None

    def _place_for_put(self, checkpoint: Checkpoint) -> tuple[RegionPut | None, RegionHold | None]:
        """Where a Put's payload is in the attached region: where it lies already (pushed
        there), else copied into a span of its own (held until the call is answered);
        (None, None): stream it (no region, a small payload, or no span free)."""
        reads = self._reads
        if reads is None:
            return None, None
        placed = placement_in(reads.region, checkpoint)
        if placed is not None:
            return placed, None
        size = put_span_bytes(checkpoint)
        span = reads.acquire(size) if size >= MIN_REGION_PUT_BYTES else None
        if span is None:
            return None, None
        return copy_into(reads.region, span, checkpoint), RegionHold(reads, span)

    def _forgot_region(self, error: TandemError) -> bool:
        """After a store restart the region is unknown to it: registers it again and says
        so (the caller then repeats its call); False for any other error."""
        reads = self._reads  # once: a detach on another thread may clear it meanwhile
        if reads is None or "no region" not in str(error):
            return False
        self.register_region(reads.region)  # settles retired spans too
        return True

    @property
    def region_reads(self) -> int:
        return self._reads.reads if self._reads is not None else 0

    @property
    def read_routes(self) -> dict[str, int]:
        """Gets by route (ReadRoute): how many came through the region, and why the others
        streamed."""
        return self._routes.snapshot()

    def _get_through_region(
        self, reads: RegionReads, key: bytes, namespace: str, size_hint: int, progressive: bool
    ) -> RoutedRead:
        span = reads.acquire(size_hint)
        if span is None:
            route: ReadRoute = (
                "larger than the region" if size_hint > reads.usable else "region busy"
            )
            return RoutedRead(self._get_streamed(key, namespace), None, route)
        read = self._read_progressive if progressive else self._read_placed
        tag = reads.tag
        try:
            try:
                checkpoint, hold = read(key, reads, namespace, span, tag)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND or "no region" not in str(exc.details()):
                    raise
                # The store forgot the region (it restarted) or superseded it: register it
                # again (the first try copied nothing: a NOT_FOUND starts no copy).
                self.register_region(reads.region)
                tag = reads.tag
                checkpoint, hold = read(key, reads, namespace, span, tag)
        except BaseException as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else getattr(exc, "code", None)
            if code in SETTLED_CODES:
                reads.release(span)
            else:  # cut short: the store may still be copying into it
                reads.retire(span, tag)
            raise
        if hold is None:  # streamed: it did not fit after all
            reads.release(span)
            return RoutedRead(checkpoint, None, "larger than the span")
        if isinstance(hold, DirectHold):  # the store wrote nothing into the span
            reads.release(span)
            return RoutedRead(checkpoint, hold, "direct")
        reads.reads += 1
        return RoutedRead(checkpoint, hold, "region")

    def _read_placed(
        self, key: bytes, reads: RegionReads, namespace: str, span: Span, tag: Tag
    ) -> tuple[Checkpoint, RegionHold | None]:
        request = self._region_request(key, reads.region, namespace, span, True, tag[1])
        checkpoint, placed = read_placed(
            self._get(request, timeout=self.timeout), reads.region, span.offset
        )
        return checkpoint, RegionHold(reads, span) if placed else None

    def _read_progressive(
        self, key: bytes, reads: RegionReads, namespace: str, span: Span, tag: Tag
    ) -> tuple[Checkpoint, RegionHold | DirectHold | None]:
        request = self._region_request(key, reads.region, namespace, span, True, tag[1])
        request.progressive = True
        data_file = self._data_file
        request.direct = data_file is not None
        messages = iter(self._get(request, timeout=self.timeout))
        if data_file is not None:
            first = next(messages)
            second = next(messages, None)
            answer = store_pb2.GetResponse.FromString(second) if second is not None else None
            if answer is not None and answer.WhichOneof("item") == "direct":
                header = store_pb2.GetResponse.FromString(first)
                try:
                    return read_direct(header, answer.direct, messages, data_file, self._release)
                except StaleDataFile as exc:
                    # Compacted: a fresh handover at the next renewal brings the new file.
                    log.info("direct reads paused until the region is registered again: %s", exc)
                    self._data_file, reads.region.registration = None, 0
                    return self._read_progressive(key, reads, namespace, span, tag)
            head = [first] if second is None else [first, second]
            messages = itertools.chain(head, messages)
        checkpoint, arrival = read_progressive(messages, reads.region, span.offset)
        if arrival is None:
            return checkpoint, None
        return checkpoint, RegionHold(reads, span, arrival, tag)

    def _release(self, lease: int) -> bool:
        request = store_pb2.ReleaseDirectRequest(lease=lease)
        answer = self._call(lambda: self._store.ReleaseDirect(request, timeout=self.timeout))
        return bool(answer.held)

    def _read_region(
        self,
        key: bytes,
        region: SharedRegion,
        namespace: str,
        span: Span,
        stream_if_larger: bool,
    ) -> tuple[Checkpoint, bool]:
        request = self._region_request(key, region, namespace, span, stream_if_larger, 0)
        return read_placed(self._get(request, timeout=self.timeout), region, span.offset)

    @staticmethod
    def _region_request(
        key: bytes,
        region: SharedRegion,
        namespace: str,
        span: Span,
        stream_if_larger: bool,
        registration: int,
    ) -> store_pb2.GetRequest:
        return store_pb2.GetRequest(
            namespace=namespace,
            key=key,
            region=region.name,
            region_offset=span.offset,
            region_bytes=span.size,
            stream_if_larger=stream_if_larger,
            region_registration=registration,
        )
