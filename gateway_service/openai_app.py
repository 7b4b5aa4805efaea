"""The OpenAI-compatible HTTP front (Starlette): /v1/completions, /v1/chat/completions and
/v1/responses (server-sent events or one JSON object), /v1/models and /v1/models/{id}, /tokenize and
/detokenize (vLLM's shapes), /health; CORS only for the origins `--cors-origin` names.

A request's first engine message is awaited before the response starts, so an error before
any token gets its HTTP status; one after that ends the event stream with an error event. A
client that disconnects cancels its generation on the engine.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway_service.backends import BackendPool
from gateway_service.conversations import Conversations
from gateway_service.grpc_front import caller_of, on_any_engine
from gateway_service.openai_body import read_json
from gateway_service.openai_choices import (
    MAX_CHOICES,
    Choice,
    close,
    combined_usage,
    interleaved,
    open_choices,
)
from gateway_service.openai_errors import ApiError
from gateway_service.openai_fields import Endpoint, check_fields
from gateway_service.openai_http import (
    build_request,
    error_response,
    sse,
    until_disconnected,
)
from gateway_service.openai_responses_route import ResponsesRoute
from gateway_service.openai_tools import tools_pb
from gateway_service.openai_wire import (
    add_messages,
)
from gateway_service.relay import Caller, GatewayError, Relay
from tandem_wire.auth import Authenticator, AuthError
from tandem_wire.pb import engine_pb2

log = logging.getLogger("tandem.gateway")


class OpenAIFront:
    def __init__(
        self,
        pool: BackendPool,
        relay: Relay,
        authenticator: Authenticator | None,
        max_body_bytes: int = 8 << 20,
        cors_origins: list[str] | None = None,
        conversations: Conversations | None = None,
    ) -> None:
        self.pool = pool
        self.responses_route = ResponsesRoute(relay, conversations)
        self.relay = relay
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        # Starlette's CORS: preflights answered for the named origins only; without any, no
        # CORS headers at all, so browsers keep cross-origin pages out.
        cors = [
            Middleware(
                CORSMiddleware,
                allow_origins=cors_origins or [],
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
                max_age=600,
            )
        ]
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
            ],
            middleware=cors if cors_origins else [],
            exception_handlers={404: _not_found, 405: _not_allowed},
        )

    async def health(self, request: Request) -> Response:
        up, total = len(self.pool.healthy()), len(self.pool.backends)
        body = {"status": "ok" if up else "unavailable", "engines": {"serving": up, "total": total}}
        return JSONResponse(body, status_code=200 if up else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._caller(request)
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": self._model_objects()})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: `client.models.retrieve`."""
        try:
            self._caller(request)
        except ApiError as exc:
            return error_response(exc)
        wanted = request.path_params["model_id"]
        for model in self._model_objects():
            if model["id"] == wanted:
                return JSONResponse(model)
        message = f"the model '{wanted}' does not exist"
        return error_response(
            ApiError(404, message, "invalid_request_error", "model", "model_not_found")
        )

    def _model_objects(self) -> list[dict[str, Any]]:
        return [
            {
                "id": f.name,
                "object": "model",
                "created": f.seen_at,
                "owned_by": "tandem",
                "tandem": {"model_id": f.model_id, "context_length": f.context_length},
            }
            for f in self.pool.models()
        ]

    async def tokenize(self, request: Request) -> Response:
        """vLLM's shape: {"prompt": text} or {"messages": [...], "tools": [...]},
        "add_special_tokens" (default true) -> {"tokens", "count", "max_model_len"}."""
        try:
            caller = self._caller(request)
            body = await read_json(request, self.max_body_bytes)
            _only(body, {"model", "prompt", "messages", "add_special_tokens", "tools"})
            req = engine_pb2.TokenizeRequest(add_special_tokens=_bool(body, "add_special_tokens"))
            if isinstance(body.get("prompt"), str) and "messages" not in body:
                req.text = body["prompt"]
            elif "prompt" not in body:
                add_messages(body.get("messages"), req.messages)
                req.tools.extend(tools_pb(body.get("tools")))  # as the chat renders them
            else:
                raise ApiError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
            reply = await self._unary(caller, lambda b, md: b.stub.Tokenize(req, metadata=md))
        except ApiError as exc:
            return error_response(exc)
        models = self.pool.models()
        tokens = list(reply.token_ids)
        limit = models[0].context_length if models else 0
        return JSONResponse({"count": len(tokens), "max_model_len": limit, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's shape: {"tokens": [ids]} -> {"prompt": text}."""
        try:
            caller = self._caller(request)
            body = await read_json(request, self.max_body_bytes)
            _only(body, {"model", "tokens"})
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                type(t) is int and 0 <= t < 2**31 for t in tokens
            ):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
            req = engine_pb2.DetokenizeRequest(token_ids=tokens)
            reply = await self._unary(caller, lambda b, md: b.stub.Detokenize(req, metadata=md))
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"prompt": reply.text})

    async def _echo(
        self, body: dict[str, Any], req: engine_pb2.GenerateRequest, caller: Caller
    ) -> str:
        """A completion's `echo`: its prompt as text (token ids detokenized by an engine)."""
        echo = body.get("echo")
        if echo is None or echo is False:
            return ""
        if echo is not True:
            raise ApiError(400, "'echo' must be true or false", param="echo")
        if req.sampling.HasField("logprobs"):
            message = "'echo' with 'logprobs' would need the prompt's logprobs: not supported"
            raise ApiError(400, message, param="echo")
        if req.text:
            return req.text
        ids = engine_pb2.DetokenizeRequest(token_ids=req.token_ids)
        reply = await self._unary(caller, lambda b, md: b.stub.Detokenize(ids, metadata=md))
        return str(reply.text)

    async def _unary(self, caller: Caller, call: Any) -> Any:
        try:
            return await on_any_engine(self.pool, caller, call)
        except grpc.aio.AioRpcError as exc:
            raise ApiError.from_grpc(exc.code(), exc.details() or exc.code().name) from None
        except GatewayError as exc:
            raise ApiError.from_grpc(exc.code, str(exc)) from None

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            caller = self._caller(request)
            body = await read_json(request, self.max_body_bytes)
            check_fields(body, Endpoint.CHAT if chat else Endpoint.COMPLETIONS)
            req, model, (stream, include_usage) = build_request(body, chat)
            n = _choices(body, req)
            req.request_id = req.request_id or f"gw-{uuid.uuid4().hex}"  # told in each chunk
            served = model or self._served_name()
            echo = "" if chat else await self._echo(body, req, caller)
            choices = await open_choices(self.relay, req, n, caller, model, chat, echo)
        except ApiError as exc:
            return error_response(exc)
        for choice in choices:
            choice.shaper.model = served
        if stream:
            events = self._events(choices, include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            await until_disconnected(request, _collect(choices))
        except ApiError as exc:
            return error_response(exc)
        except asyncio.CancelledError:
            return Response(status_code=499)
        whole = [c.shaper.final_choice() for c in choices]
        return JSONResponse(choices[0].shaper.final(whole, combined_usage(choices)))

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses (openai_responses_route.py)."""
        try:
            caller = self._caller(request)
            body = await read_json(request, self.max_body_bytes)
        except ApiError as exc:
            return error_response(exc)
        return await self.responses_route.answer(request, caller, body, self._served_name())

    async def _events(self, choices: list[Choice], include_usage: bool) -> AsyncIterator[str]:
        try:
            async for choice, message in interleaved(choices):
                choice.shaper.add(message)
                for chunk in choice.shaper.chunks(message):
                    yield sse(chunk)
            if include_usage:
                yield sse(choices[0].shaper.usage_chunk(combined_usage(choices)))
            yield "data: [DONE]\n\n"
        except ApiError as exc:  # after the status line: the error travels as an event
            yield sse(exc.body())
        finally:
            await close(choices)  # the client left: the engines' calls are cancelled

    def _caller(self, request: Request) -> Caller:
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header else []
        if self.authenticator is not None:
            peer = request.client.host if request.client else "unknown"
            try:
                self.authenticator.authenticate(metadata, list, f"ipv4:{peer}:0")
            except AuthError as exc:
                status = 401 if exc.status == "UNAUTHENTICATED" else 403
                raise ApiError(status, str(exc), "authentication_error") from None
        return caller_of(metadata)

    def _served_name(self) -> str:
        models = self.pool.models()
        return models[0].name if models else ""


async def _collect(choices: list[Choice]) -> None:
    async for choice, message in interleaved(choices):
        choice.shaper.add(message)


def _choices(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> int:
    """OpenAI's `n`: 1..MAX_CHOICES; a resume names one generation, so it takes n = 1."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer in 1..{MAX_CHOICES}", param="n")
    if n > 1 and req.resume:
        raise ApiError(
            400, "a resume continues one choice: resume each by its request id", param="n"
        )
    return n


def _only(body: dict[str, Any], fields: set[str]) -> None:
    for name in body:
        if name not in fields:
            raise ApiError(400, f"unknown field '{name}'", param=name)


def _bool(body: dict[str, Any], name: str, default: bool = True) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", param=name)
    return value


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", "not_found_error"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
