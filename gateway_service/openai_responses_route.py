"""The `/v1/responses` route: a Responses API request through the relay, as one Response
object or its event stream, its conversation kept in the store when the gateway has one
(openai_responses.py translates, openai_response_events.py shapes, conversations.py keeps)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway_service.conversations import Conversations
from gateway_service.openai_choices import Choice, close, interleaved, open_choices
from gateway_service.openai_errors import ApiError
from gateway_service.openai_http import (
    build_request,
    error_response,
    named_event,
    until_disconnected,
)
from gateway_service.openai_response_events import ResponseShaper
from gateway_service.openai_responses import chat_body, check_response_fields, response_echo
from gateway_service.relay import Caller, Relay


@dataclass(frozen=True)
class Kept:
    """Where a response's conversation goes once it is made (`store` with --store)."""

    conversations: Conversations
    caller: Caller
    namespace: str
    turn: list[dict[str, Any]]  # the history it continued and its input

    async def save(self, shaper: ResponseShaper) -> None:
        history = [*self.turn, shaper.assistant_message()]
        await self.conversations.save(self.caller, self.namespace, shaper.id, history)


def _namespace_of(body: dict[str, Any]) -> str:
    extra = body.get("tandem")
    value = extra.get("namespace") if isinstance(extra, dict) else None
    return value if isinstance(value, str) else ""


class ResponsesRoute:
    def __init__(self, relay: Relay, conversations: Conversations | None) -> None:
        self.relay = relay
        self.conversations = conversations

    async def answer(
        self, request: Request, caller: Caller, body: dict[str, Any], served: str
    ) -> Response:
        try:
            check_response_fields(body, self.conversations is not None)
            previous = body.get("previous_response_id")
            history = None
            if previous and self.conversations is not None:
                namespace = _namespace_of(body)
                history = await self.conversations.load(caller, namespace, previous)
            chat, turn = chat_body(body, history)
            req, model, (stream, _) = build_request(chat, chat=True)
            req.request_id = req.request_id or f"gw-{uuid.uuid4().hex}"
            (choice,) = await open_choices(self.relay, req, 1, caller, model, chat=True)
        except ApiError as exc:
            return error_response(exc)
        kept = None
        if self.conversations is not None and body.get("store", True) is not False:
            kept = Kept(self.conversations, caller, req.namespace, turn)
        shaper = ResponseShaper(model or served, {**response_echo(body), "store": kept is not None})
        if stream:
            return StreamingResponse(
                self._events(choice, shaper, kept),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            await until_disconnected(request, _collect(choice, shaper))
            if kept is not None:
                await kept.save(shaper)
        except ApiError as exc:
            return error_response(exc)
        except asyncio.CancelledError:
            return Response(status_code=499)
        return JSONResponse(shaper.response())

    async def _events(
        self, choice: Choice, shaper: ResponseShaper, kept: Kept | None
    ) -> AsyncIterator[str]:
        try:
            for event in shaper.opening():
                yield named_event(event)
            async for _, message in interleaved([choice]):
                events = shaper.add(message)
                if shaper.finished and kept is not None:
                    # Kept before the client hears it is complete: a next turn finds it.
                    for event in events[:-1]:
                        yield named_event(event)
                    await kept.save(shaper)
                    events = events[-1:]
                for event in events:
                    yield named_event(event)
        except ApiError as exc:  # after the status line: the error travels as an event
            error = exc.body()["error"]
            yield named_event({"type": "error", "sequence_number": shaper.sequence, **error})
        finally:
            await close([choice])


async def _collect(choice: Choice, shaper: ResponseShaper) -> None:
    async for _, message in interleaved([choice]):
        shaper.add(message)
