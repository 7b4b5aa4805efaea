"""asyncio clients: AsyncEngineClient and AsyncStoreClient, with the sync clients' types."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from tandem_client.bulk import (
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    PayloadAssembler,
    bulk_methods,
    fits_one_message,
    put_messages,
    put_records_request,
)
from tandem_client.channel import AsyncGrpcClient
from tandem_client.engine_client import Generation, GenerationChunk, Prompt, generate_request
from tandem_client.errors import PutManyFailed, from_rpc_error
from tandem_client.failover import (
    FAILOVER_WAIT_S,
    AddressedStubs,
    Move,
    StreamAttempts,
    split_addresses,
)
from tandem_client.records import (
    Checkpoint,
    LookupResult,
    PutItem,
    PutResult,
    RecordSummary,
    kind_to_pb,
    lookup_request,
)
from tandem_wire.pb import engine_pb2, store_pb2, store_pb2_grpc


class AsyncEngineClient(AsyncGrpcClient, AddressedStubs):
    """asyncio client of `tandem.v1.Engine`: an engine, or gateways in front of engines.

    address: one HOST:PORT, or several ("a,b" or a list) of one service: a stream whose
    server dies goes on through the next, as EngineClient's (tandem_client/failover.py).
    The other calls go to the address the last stream used.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
        failover_wait_s: float = FAILOVER_WAIT_S,
    ) -> None:
        self.addresses = split_addresses(address)
        self.failover_wait_s = failover_wait_s
        super().__init__(self.addresses[0], timeout, credentials, token=token)
        self._init_stubs()

    def request(self, prompt: Prompt, **options: Any) -> engine_pb2.GenerateRequest:
        return generate_request(prompt, **options)

    async def stream(self, prompt: Prompt, **options: Any) -> AsyncIterator[GenerationChunk]:
        request = self.request(prompt, **options)
        if len(self.addresses) == 1:
            call = self._stub.Generate(request, timeout=self.timeout)
            try:
                async for message in call:
                    yield GenerationChunk.from_pb(message)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            finally:
                call.cancel()
            return
        attempts = StreamAttempts(request, len(self.addresses), self.failover_wait_s)
        at = self._preferred
        while True:
            call = self._stub_at(at).Generate(attempts.request(), timeout=self.timeout)
            try:
                async for message in call:
                    attempts.received(len(message.token_ids))
                    yield GenerationChunk.from_pb(message)
                return
            except grpc.RpcError as exc:
                step = attempts.after(exc.code())
                if step.move is Move.GIVE_UP:
                    raise from_rpc_error(exc) from None
            finally:
                call.cancel()
            if step.move is Move.NEXT_ADDRESS:
                at = self._moved_from(at)
            await asyncio.sleep(step.pause_s)

    async def generate(self, prompt: Prompt, **options: Any) -> Generation:
        chunks = [c async for c in self.stream(prompt, **options)]
        return Generation.collect(iter(chunks))

    async def tokenize(self, text: str) -> list[int]:
        r = await self._call(
            self._stub.Tokenize(engine_pb2.TokenizeRequest(text=text), timeout=self.timeout)
        )
        return list(r.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        r = await self._call(
            self._stub.Detokenize(
                engine_pb2.DetokenizeRequest(token_ids=list(token_ids)), timeout=self.timeout
            )
        )
        return str(r.text)

    async def model_info(self) -> engine_pb2.ModelInfoResponse:
        r: engine_pb2.ModelInfoResponse = await self._call(
            self._stub.ModelInfo(engine_pb2.ModelInfoRequest(), timeout=self.timeout)
        )
        return r

    async def cancel(self, request_id: str) -> None:
        await self._call(
            self._stub.Cancel(engine_pb2.CancelRequest(request_id=request_id), timeout=self.timeout)
        )

    async def stats(self) -> engine_pb2.EngineStatsResponse:
        r: engine_pb2.EngineStatsResponse = await self._call(
            self._stub.Stats(engine_pb2.EngineStatsRequest(), timeout=self.timeout)
        )
        return r

    async def flush(self) -> engine_pb2.EngineFlushResponse:
        r: engine_pb2.EngineFlushResponse = await self._call(
            self._stub.Flush(engine_pb2.EngineFlushRequest(), timeout=self.timeout)
        )
        return r


class AsyncStoreClient(AsyncGrpcClient):
    """asyncio client of `tandem.v1.Store` and `tandem.v1.StoreAdmin`."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
    ) -> None:
        super().__init__(
            address,
            timeout,
            credentials,
            [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
            token,
        )
        self._store = store_pb2_grpc.StoreStub(self._channel)
        self._admin = store_pb2_grpc.StoreAdminStub(self._channel)
        self._put, self._get, self._put_many = bulk_methods(self._channel)
        self._put_records_known = True  # False once a store answered UNIMPLEMENTED (older)

    async def put(
        self,
        checkpoint: Checkpoint,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> PutResult:
        """Stores a checkpoint: a small one in one PutRecords message, a larger one streamed."""
        item = PutItem(checkpoint, if_absent, pin_ttl_s, pin_holder)
        if self._put_records_known and fits_one_message([item], [None]):
            try:
                return (await self.put_many([item], chunk_bytes))[0]
            except PutManyFailed as exc:
                raise exc.cause from None
        # grpc.aio takes a plain iterator as a request stream too.
        requests = put_messages(checkpoint, if_absent, pin_ttl_s, pin_holder, chunk_bytes)
        r = await self._call(self._put(requests, timeout=self.timeout))
        return PutResult(r.key, r.payload_bytes, r.replaced, r.lease_id)

    async def put_many(
        self, items: Sequence[PutItem], chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> builtins.list[PutResult]:
        """Several records in one call, stored in order, each atomically: one PutRecords
        message when they are small, else a PutMany stream (as StoreClient.put_many).
        Raises PutManyFailed saying how many landed."""
        for i in items:
            if not isinstance(i, PutItem):
                raise TypeError(f"put_many takes PutItem values, not {type(i).__name__}")
        places = [None] * len(items)
        one_message = None
        if self._put_records_known and fits_one_message(items, places):
            one_message = put_records_request(items, places)
        try:
            if one_message is not None:
                r = await self._store.PutRecords(one_message, timeout=self.timeout)
            else:
                messages = (
                    m
                    for i in items
                    for m in put_messages(
                        i.checkpoint, i.if_absent, i.pin_ttl_s, i.pin_holder, chunk_bytes
                    )
                )
                r = await self._put_many(messages, timeout=self.timeout)
        except grpc.RpcError as exc:
            if one_message is None or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                stored = int(dict(exc.trailing_metadata() or ()).get("tandem-stored", "0"))
                raise PutManyFailed(from_rpc_error(exc), stored) from None
            self._put_records_known = False  # nothing was stored: all go again as PutMany
            return await self.put_many(items, chunk_bytes)
        return [PutResult(x.key, x.payload_bytes, x.replaced, x.lease_id) for x in r.results]

    async def get(self, key: bytes, namespace: str = "") -> Checkpoint:
        return await self._retry_unavailable(lambda: self._get_once(key, namespace))

    async def _get_once(self, key: bytes, namespace: str) -> Checkpoint:
        call = self._get(store_pb2.GetRequest(namespace=namespace, key=key), timeout=self.timeout)
        try:
            assembler: PayloadAssembler | None = None
            async for raw in call:
                if assembler is None:
                    assembler = PayloadAssembler(raw)
                else:
                    assembler.feed(raw)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        assert assembler is not None
        return assembler.finish()

    async def lookup(
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
        return LookupResult.from_pb(
            await self._call(self._store.Lookup(request, timeout=self.timeout))
        )

    async def list(
        self, *, namespace: str = "", kind: str = "", page_size: int = 0, page_token: str = ""
    ) -> tuple[builtins.list[RecordSummary], str]:
        r = await self._call(
            self._admin.List(
                store_pb2.ListRequest(
                    filter=store_pb2.RecordFilter(namespace=namespace, kind=kind_to_pb(kind)),
                    page_size=page_size,
                    page_token=page_token,
                ),
                timeout=self.timeout,
            )
        )
        return [RecordSummary.from_pb(s) for s in r.records], r.next_page_token

    async def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        """Removes a record of the caller's own namespaces (`Store.Delete`, the store role)."""
        r = await self._call(
            self._store.Delete(
                store_pb2.DeleteRequest(namespace=namespace, key=key, force=force),
                timeout=self.timeout,
            )
        )
        return int(r.freed_bytes)

    async def stats(self) -> store_pb2.StatsResponse:
        r: store_pb2.StatsResponse = await self._call(
            self._admin.Stats(store_pb2.StatsRequest(), timeout=self.timeout)
        )
        return r

    async def flush(self) -> bool:
        r = await self._call(self._store.Flush(store_pb2.FlushRequest(), timeout=self.timeout))
        return bool(r.durable)
