"""One OpenAI request's choices (`n`): n generations of the same prompt, each its own relayed
stream with its own seed and request id, their messages interleaved as they arrive.

Choice 0 is the request itself (its seed and request id: `n = 1` is unchanged). The others
start once choice 0's first token is out: by then an engine with a store has cached the
prompt's prefix, and affinity sends them to that engine, so they prefill only the prompt's
last token (the prefill is paid once). Each has the seed derived from the request's and
index i, and the request id `<id>.<i>`: each checkpoints, fails over and resumes alone.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from gateway_service.openai_chunks import Shaper
from gateway_service.openai_errors import ApiError
from gateway_service.relay import Caller, GatewayError, Relay
from tandem_wire.pb import engine_pb2

Messages = AsyncGenerator[engine_pb2.GenerateResponse, None]
MAX_CHOICES = 16


@dataclass
class Choice:
    index: int
    messages: Messages
    first: engine_pb2.GenerateResponse
    shaper: Shaper


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's for choice 0, a hash of (seed, index) after."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits, what the engine takes


def choice_request(req: engine_pb2.GenerateRequest, index: int) -> engine_pb2.GenerateRequest:
    if index == 0:
        return req
    other = engine_pb2.GenerateRequest()
    other.CopyFrom(req)
    other.request_id = f"{req.request_id}.{index}"
    other.sampling.seed = choice_seed(req.sampling.seed, index)
    return other


async def open_choices(
    relay: Relay,
    req: engine_pb2.GenerateRequest,
    n: int,
    caller: Caller,
    model: str,
    chat: bool,
    echo: str = "",
) -> list[Choice]:
    """The n choices, each with its first message in hand (an error before any token is an
    ApiError, so the response has not started); choice 0 first, then the rest together."""
    choices: list[Choice] = []

    async def open_one(index: int) -> Choice:
        request = choice_request(req, index)
        messages = relay.generate(request, caller, model)
        shaper = Shaper(
            chat=chat,
            model=model,
            request_id=request.request_id,
            tokens_held=request.tokens_held,
            index=index,
            echo=echo,
        )
        try:
            return Choice(index, messages, await next_message(messages), shaper)
        except BaseException:
            await messages.aclose()
            raise

    try:
        choices.append(await open_one(0))
        if n > 1:
            rest = await asyncio.gather(*(open_one(i) for i in range(1, n)), return_exceptions=True)
            choices += [c for c in rest if isinstance(c, Choice)]
            for failed in rest:
                if isinstance(failed, BaseException):
                    raise failed
    except BaseException:
        await close(choices)
        raise
    return choices


async def interleaved(
    choices: list[Choice],
) -> AsyncIterator[tuple[Choice, engine_pb2.GenerateResponse]]:
    """Every choice's messages, first messages first, then as they arrive; ApiError from any
    choice ends them all. The choices' streams are closed when this ends."""
    pending: dict[asyncio.Future[Any], Choice] = {}
    try:
        for choice in choices:
            yield choice, choice.first
            if not finished(choice.first):
                pending[asyncio.ensure_future(next_message(choice.messages))] = choice
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                choice = pending.pop(task)
                message = task.result()  # an ApiError ends every choice
                yield choice, message
                if not finished(message):
                    pending[asyncio.ensure_future(next_message(choice.messages))] = choice
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await close(choices)


def finished(message: engine_pb2.GenerateResponse) -> bool:
    return message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


async def close(choices: list[Choice]) -> None:
    for choice in choices:
        await choice.messages.aclose()  # a choice still running: its engine call is cancelled


def combined_usage(choices: list[Choice]) -> dict[str, Any] | None:
    """OpenAI's usage for n choices: the prompt once, every choice's completion tokens."""
    usages = [c.shaper.usage for c in choices]
    if any(u is None for u in usages):
        return None
    first = dict(usages[0] or {})
    completion = sum((u or {})["completion_tokens"] for u in usages)
    first["completion_tokens"] = completion
    first["total_tokens"] = first["prompt_tokens"] + completion
    first["failovers"] = sum((u or {})["failovers"] for u in usages)
    return first


async def next_message(messages: Messages) -> engine_pb2.GenerateResponse:
    try:
        return await messages.__anext__()
    except StopAsyncIteration:
        raise ApiError(502, "the engine's stream ended early", "api_error") from None
    except grpc.aio.AioRpcError as exc:
        raise ApiError.from_grpc(exc.code(), exc.details() or exc.code().name) from None
    except GatewayError as exc:
        raise ApiError.from_grpc(exc.code, str(exc)) from None
