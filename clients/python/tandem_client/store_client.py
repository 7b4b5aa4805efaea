"""StoreClient: put, get and look up checkpoints, and administer the store, with typed results.

The record types live in records.py and the bulk Put/Get plumbing in bulk.py (shared with the
asyncio client); both are re-exported here, where callers have always imported them from.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from tandem_client.bulk import (
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    PayloadAssembler,
    bulk_methods,
    payload_chunks,
    put_messages,
    receive,
)
from tandem_client.channel import GrpcClient
from tandem_client.data_file import DataFile
from tandem_client.direct import DirectHold
from tandem_client.errors import DataLoss, NotFound, TandemError
from tandem_client.progressive import own_tensors
from tandem_client.record_reads import RecordReads
from tandem_client.records import (
    Attachment,
    Checkpoint,
    HeaderRead,
    Inspection,
    Kind,
    Lease,
    LookupResult,
    PutItem,
    PutResult,
    RecordSummary,
    Tensor,
    kind_name,
    kind_to_pb,
    lookup_request,
    record_filter,
)
from tandem_client.regions import RegionHold, RegionReads
from tandem_client.same_host import ReadRoutes, RoutedRead, SameHostReads
from tandem_client.store_puts import StorePuts
from tandem_wire.pb import store_pb2, store_pb2_grpc

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_MESSAGE_BYTES",
    "Attachment",
    "Checkpoint",
    "HeaderRead",
    "Inspection",
    "Kind",
    "Lease",
    "LookupResult",
    "PayloadAssembler",
    "PutItem",
    "PutResult",
    "RecordSummary",
    "StoreClient",
    "Tensor",
    "bulk_methods",
    "kind_name",
    "kind_to_pb",
    "lookup_request",
    "payload_chunks",
    "put_messages",
]


class StoreClient(SameHostReads, RecordReads, StorePuts, GrpcClient):
    """Synchronous client of `tandem.v1.Store` and `tandem.v1.StoreAdmin`."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_bulk_calls: int = 0,
        token: str = "",
    ) -> None:
        """max_bulk_calls: at most this many Put/Get calls of this client at once (0: no
        bound); a store refuses a connection more than --max-bulk-calls-per-connection."""
        self._bulk = threading.BoundedSemaphore(max_bulk_calls) if max_bulk_calls else None
        self._reads: RegionReads | None = None  # same-host mode (attach_region)
        self._routes = ReadRoutes()
        self._renewing = threading.Event()
        self._data_file: DataFile | None = None
        self._want_data_file = False
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        super().__init__(address, timeout, credentials, options, token)
        self._store = store_pb2_grpc.StoreStub(self._channel)
        # Bulk paths with hand-encoded chunks (see wire.py).
        self._put, self._get, self._put_many = bulk_methods(self._channel)
        self._put_records = self._store.PutRecords
        self._put_records_known = True
        self._get_headers_known = True  # False once a store answered UNIMPLEMENTED
        self._get_records_known = True  # the same, for GetRecords
        self._admin = store_pb2_grpc.StoreAdminStub(self._channel)

    # -- data plane --------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channel; an attached region's lease renewals stop with it (the store
        lets the region lapse)."""
        self._renewing.set()
        self._reads = None
        super().close()

    def get(
        self, key: bytes, namespace: str = "", *, max_chunk_bytes: int = 0, size_hint: int = 0
    ) -> Checkpoint:
        """The checkpoint with its tensors' bytes, each tensor's CRC checked end to end (or,
        with a region attached, by the store as it wrote them into the region). size_hint:
        the payload's size when known (from its header), so a region span that fits it is
        taken rather than a default one."""
        if max_chunk_bytes:
            with self._bulk_slot():
                return self._retry_unavailable(
                    lambda: self._call(lambda: self._get_streamed(key, namespace, max_chunk_bytes))
                )
        read = self.get_routed(key, namespace, size_hint=size_hint)
        if read.hold is not None:  # copied out: the span is free again once this returns
            own_tensors(read.checkpoint)
            read.hold.release()
        return read.checkpoint

    def get_held(
        self, key: bytes, namespace: str = "", *, size_hint: int = 0, progressive: bool = False
    ) -> tuple[Checkpoint, RegionHold | DirectHold | None]:
        """get_routed() without the route."""
        read = self.get_routed(key, namespace, size_hint=size_hint, progressive=progressive)
        return read.checkpoint, read.hold

    def get_routed(
        self, key: bytes, namespace: str = "", *, size_hint: int = 0, progressive: bool = False
    ) -> RoutedRead:
        """Like get(), but a payload the store placed in the attached region stays there:
        the tensors view the region until the read's hold is released (None: the bytes are
        the checkpoint's own, streamed, and `route` says why). size_hint: the payload's size
        when known (Lookup's payload_bytes), so a span that fits it is taken. progressive:
        returns once the header is in, while the store still copies; the hold's `arrival`
        says which bytes may be used (progressive.py)."""
        reads = self._reads
        with self._bulk_slot():
            if reads is None:
                checkpoint = self._retry_unavailable(
                    lambda: self._call(lambda: self._get_streamed(key, namespace))
                )
                return self._routes.count(RoutedRead(checkpoint, None, "no region"))
            read = self._retry_unavailable(
                lambda: self._call(
                    lambda: self._get_through_region(reads, key, namespace, size_hint, progressive)
                )
            )
            return self._routes.count(read)

    def _get_streamed(self, key: bytes, namespace: str, max_chunk_bytes: int = 0) -> Checkpoint:
        request = store_pb2.GetRequest(
            namespace=namespace, key=key, max_chunk_bytes=max_chunk_bytes
        )
        return receive(self._get(request, timeout=self.timeout))

    def _bulk_slot(self) -> contextlib.AbstractContextManager[object]:
        return self._bulk if self._bulk is not None else contextlib.nullcontext()

    def get_header(
        self, key: bytes, namespace: str = "", *, retry_unavailable: bool = False
    ) -> Checkpoint:
        """The record's header (its tensors' specs, no bytes). retry_unavailable: retried
        while the store is UNAVAILABLE, as get() is (off for a probe that should answer at
        once)."""
        request = store_pb2.GetRequest(namespace=namespace, key=key, header_only=True)

        def read() -> Checkpoint:
            stream = self._store.Get(request, timeout=self.timeout)
            return Checkpoint.from_header(next(iter(stream)).header)

        with self._bulk_slot():
            if retry_unavailable:
                return self._retry_unavailable(lambda: self._call(read))
            return self._call(read)

    def get_headers(self, keys: Sequence[bytes], namespace: str = "") -> list[HeaderRead]:
        """The headers of several records of one namespace, in order, in one call (at most
        64 keys); each found, missing or damaged. Retried while the store is UNAVAILABLE; a
        store without GetHeaders (an older release) is asked a Get a key from then on."""
        if self._get_headers_known:
            request = store_pb2.GetHeadersRequest(namespace=namespace, keys=list(keys))
            try:
                get_headers = self._store.GetHeaders
                answer: store_pb2.GetHeadersResponse = self._retry_unavailable(
                    lambda: self._call(lambda: get_headers(request, timeout=self.timeout))
                )
                return [
                    HeaderRead(Checkpoint.from_header(h.header) if h.found else None, h.damaged)
                    for h in answer.headers
                ]
            except TandemError as exc:
                if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._get_headers_known = False
        return [self._header_read(key, namespace) for key in keys]

    def _header_read(self, key: bytes, namespace: str) -> HeaderRead:
        try:
            return HeaderRead(self.get_header(key, namespace, retry_unavailable=True))
        except NotFound:
            return HeaderRead(None)
        except DataLoss:
            return HeaderRead(None, damaged=True)

    def lookup(
        self,
        *,
        namespace: str,
        model_id: str,
        layout: Sequence[str],
        block_size: int,
        block_hashes: Sequence[bytes],
        token_count: int,
        kind: str = "",
    ) -> LookupResult:
        request = lookup_request(
            namespace, model_id, layout, block_size, block_hashes, token_count, kind
        )
        r = self._call(lambda: self._store.Lookup(request, timeout=self.timeout))
        return LookupResult.from_pb(r)

    def pin(
        self,
        key: bytes,
        namespace: str = "",
        *,
        ttl_s: int = 0,
        holder: str = "",
        lease_id: str = "",
    ) -> Lease:
        r = self._call(
            lambda: self._store.Pin(
                store_pb2.PinRequest(
                    namespace=namespace,
                    key=key,
                    ttl_seconds=ttl_s,
                    holder=holder,
                    lease_id=lease_id,
                ),
                timeout=self.timeout,
            )
        )
        return Lease(r.lease_id, holder, r.expires_at_unix_ms)

    def unpin(self, key: bytes, lease_id: str, namespace: str = "") -> None:
        self._call(
            lambda: self._store.Unpin(
                store_pb2.UnpinRequest(namespace=namespace, key=key, lease_id=lease_id),
                timeout=self.timeout,
            )
        )

    def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        """Removes a record of the caller's own namespaces on the data plane (`Store.Delete`:
        the `store` role is enough); returns the bytes freed. NOT_FOUND, FAILED_PRECONDITION
        when pinned without force."""
        r: store_pb2.DeleteResponse = self._call(
            lambda: self._store.Delete(
                store_pb2.DeleteRequest(namespace=namespace, key=key, force=force),
                timeout=self.timeout,
            )
        )
        return r.freed_bytes

    def delete_many(self, keys: list[bytes], namespace: str = "", *, force: bool = False) -> int:
        """Removes several records of one of the caller's namespaces in one call and one store
        transaction (`Store.DeleteMany`); keys holding nothing are skipped. Returns the bytes
        freed. FAILED_PRECONDITION (nothing removed) when one is pinned without force."""
        r: store_pb2.DeleteManyResponse = self._call(
            lambda: self._store.DeleteMany(
                store_pb2.DeleteManyRequest(namespace=namespace, keys=keys, force=force),
                timeout=self.timeout,
            )
        )
        return r.freed_bytes

    # -- admin -------------------------------------------------------------------------------

    def admin_delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        """`delete` through `StoreAdmin.Delete` (the admin role; the port of
        `--admin-listen`): the operators' call."""
        r: store_pb2.DeleteResponse = self._call(
            lambda: self._admin.Delete(
                store_pb2.DeleteRequest(namespace=namespace, key=key, force=force),
                timeout=self.timeout,
            )
        )
        return r.freed_bytes

    def list(
        self,
        *,
        namespace: str = "",
        model_id: str = "",
        kind: str = "",
        older_than_s: int = 0,
        idle_for_s: int = 0,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[builtins.list[RecordSummary], str]:
        r = self._call(
            lambda: self._admin.List(
                store_pb2.ListRequest(
                    filter=record_filter(namespace, model_id, kind, older_than_s, idle_for_s),
                    page_size=page_size,
                    page_token=page_token,
                ),
                timeout=self.timeout,
            )
        )
        return [RecordSummary.from_pb(s) for s in r.records], r.next_page_token

    def list_all(self, **filters: Any) -> builtins.list[RecordSummary]:
        records, token = self.list(**filters)
        while token:
            more, token = self.list(page_token=token, **filters)
            records.extend(more)
        return records

    def inspect(self, key: bytes, namespace: str = "") -> Inspection:
        r = self._call(
            lambda: self._admin.Inspect(
                store_pb2.InspectRequest(namespace=namespace, key=key), timeout=self.timeout
            )
        )
        return Inspection(
            RecordSummary.from_pb(r.summary),
            Checkpoint.from_header(r.header),
            [Lease(x.lease_id, x.holder, x.expires_at_unix_ms) for x in r.leases],
            r.chunk_count,
            r.chunk_bytes,
        )

    def purge(
        self,
        *,
        namespace: str = "",
        model_id: str = "",
        kind: str = "",
        older_than_s: int = 0,
        idle_for_s: int = 0,
        include_pinned: bool = False,
        dry_run: bool = False,
    ) -> builtins.list[RecordSummary]:
        r = self._call(
            lambda: self._admin.Purge(
                store_pb2.PurgeRequest(
                    filter=record_filter(namespace, model_id, kind, older_than_s, idle_for_s),
                    include_pinned=include_pinned,
                    dry_run=dry_run,
                ),
                timeout=self.timeout,
            )
        )
        return [RecordSummary.from_pb(s) for s in r.removed]

    def stats(self) -> store_pb2.StatsResponse:
        r: store_pb2.StatsResponse = self._call(
            lambda: self._admin.Stats(store_pb2.StatsRequest(), timeout=self.timeout)
        )
        return r

    def flush(self) -> bool:
        """The store's durability barrier: True once everything acknowledged is on disk."""
        r: store_pb2.FlushResponse = self._call(
            lambda: self._store.Flush(store_pb2.FlushRequest(), timeout=self.timeout)
        )
        return r.durable

    def compact(self) -> tuple[int, int]:
        r = self._call(lambda: self._admin.Compact(store_pb2.CompactRequest(), timeout=None))
        return r.file_bytes_before, r.file_bytes_after
