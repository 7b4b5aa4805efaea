"""Responses API conversations kept in the store, for `previous_response_id` (a gateway
started with `--store`).

A response made with `store` (OpenAI's default) is kept as the chat history it ends: the
messages it was asked with, the previous response's history before them, and its own answer
as an assistant message (text and tool calls; a reasoning model's thinking is not kept, as
chat templates drop it from history). The record is a store object (kind `object`): key
blake2b("tandem.responses.conversation" + response id), in the caller's namespace, the
history as JSON in one uint8 tensor, CRC-checked like every record. The store is called
with the caller's own bearer token, so the store decides tenancy: another tenant's
`previous_response_id` is not found there. The KV of a continued conversation is the
engines' business: its prompt starts with the stored history, so their prefix cache (in
memory, then the store's) restores it instead of prefilling it.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import grpc

from gateway_service.openai_errors import ApiError
from gateway_service.relay import Caller
from tandem_client.errors import TandemError

if TYPE_CHECKING:
    from tandem_client.aio import AsyncStoreClient

SCHEMA = "tandem.responses.conversation.v1"
MAX_HISTORY_BYTES = 8 << 20  # as the HTTP body a history could have come in
TIMEOUT_S = 10.0


class Conversations:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.address = address
        self.credentials = credentials

    async def load(self, caller: Caller, namespace: str, response_id: str) -> list[dict[str, Any]]:
        """The history a response ended; ApiError 400 `previous_response_not_found` when the
        store (in this caller's namespace) has none."""
        try:
            async with self._client(caller) as store:
                record = await store.get(_key(response_id), namespace)
        except TandemError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                raise ApiError(
                    400,
                    f"no stored response {response_id!r} (not made with store, made by another "
                    "caller, or evicted): send the history in `input`",
                    param="previous_response_id",
                    code="previous_response_not_found",
                ) from None
            raise ApiError.from_grpc(exc.code, f"the store: {exc}") from None
        if record.metadata.get("schema") != SCHEMA or len(record.tensors) != 1:
            raise ApiError(400, f"{response_id!r} is not a response", param="previous_response_id")
        history: list[dict[str, Any]] = json.loads(bytes(record.tensors[0].data))
        return history

    async def save(
        self, caller: Caller, namespace: str, response_id: str, history: list[dict[str, Any]]
    ) -> None:
        data = json.dumps(history, ensure_ascii=False).encode()
        if len(data) > MAX_HISTORY_BYTES:
            raise ApiError(
                413, f"the conversation is over {MAX_HISTORY_BYTES} bytes: it cannot be kept"
            )
        from tandem_client.records import Checkpoint, Tensor  # with the store client, below

        record = Checkpoint(
            key=_key(response_id),
            kind="object",
            namespace=namespace,
            tensors=[Tensor("history", "uint8", (len(data),), data)],
            metadata={"schema": SCHEMA, "response_id": response_id},
        )
        try:
            async with self._client(caller) as store:
                await store.put(record)
        except TandemError as exc:
            raise ApiError.from_grpc(
                exc.code, f"the response was made but could not be kept in the store: {exc}"
            ) from None

    def _client(self, caller: Caller) -> AsyncStoreClient:
        # Imported here: a gateway without --store never loads the store client (nor numpy).
        from tandem_client.aio import AsyncStoreClient

        token = ""
        for key, value in caller.metadata:
            if key == "authorization" and value.lower().startswith("bearer "):
                token = value[7:]
        return AsyncStoreClient(
            self.address, timeout=TIMEOUT_S, credentials=self.credentials, token=token
        )


def _key(response_id: str) -> bytes:
    return hashlib.blake2b(f"tandem.responses.conversation\0{response_id}".encode()).digest()[:32]
