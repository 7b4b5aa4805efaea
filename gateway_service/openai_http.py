"""What the HTTP routes of the OpenAI-compatible front share: a body into the engine's
request, a response cancelled when its client disconnects, server-sent events, errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway_service.openai_errors import ApiError
from gateway_service.openai_formats import apply_constraint
from gateway_service.openai_wire import chat_request, completion_request, streaming
from tandem_wire.pb import engine_pb2

DISCONNECT_POLL_S = 0.25
# What the standard library raises on a value no field can take (protobuf's range and UTF-8
# checks, int() of a float): a 400 at the one boundary, should a check above miss one.
MALFORMED = (ValueError, TypeError, OverflowError, UnicodeError, RecursionError)


def build_request(
    body: dict[str, Any], chat: bool
) -> tuple[engine_pb2.GenerateRequest, str, tuple[bool, bool]]:
    """The engine's request, the model asked for, (stream, include_usage); ApiError 400 for
    anything the body holds that the request cannot."""
    try:
        req = chat_request(body) if chat else completion_request(body)
        apply_constraint(body, req)
        model = body.get("model") or ""
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        return req, model, streaming(body)
    except MALFORMED as exc:
        raise ApiError(400, f"the body holds a value no field takes: {exc}"[:300]) from None


async def until_disconnected(request: Request, work: Any) -> None:
    """Runs work; cancels it when the client disconnects first (raises CancelledError)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            task.result()  # raises what the work raised
            return
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise asyncio.CancelledError


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def named_event(payload: dict[str, Any]) -> str:
    """A Responses API event: named, as OpenAI sends them."""
    return f"event: {payload['type']}\n" + sse(payload)


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)
