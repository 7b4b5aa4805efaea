"""An HTTP request's JSON body, read and parsed within bounds.

The body is streamed and counted: past `max_bytes` the answer is 413 at once, whatever
Content-Length says or when it is absent (chunked), so no oversized body is ever held.
Parsing refuses what Python's json accepts but no protobuf field can take: NaN and
Infinity, numbers that overflow a float, nesting deeper than MAX_DEPTH, lone surrogates
(they cannot be encoded as UTF-8). Every refusal is ApiError 400 / 413, never a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from gateway_service.openai_errors import ApiError

# Far deeper than any legitimate body (a JSON schema rarely passes 20 levels), far below
# Python's recursion limit, so walking the body later can never raise RecursionError.
MAX_DEPTH = 64


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, or ApiError (413 past max_bytes, 400 when malformed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise _too_large(max_bytes)  # before reading a byte of it
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)  # the rest is read and dropped by the server
        chunks.append(chunk)
    return parse(b"".join(chunks))


def parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except RecursionError:
        raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check(body, 1)
    return body


def _constant(name: str) -> Any:
    raise ApiError(400, f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(400, f"the number {text[:40]} is out of range")
    return value


def _check(value: Any, depth: int) -> None:
    """Nesting within MAX_DEPTH and strings that are valid Unicode, everywhere in the body."""
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        _text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key)
            _check(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            if type(item) is not int:  # long token-id lists: skip the common case quickly
                _check(item, depth + 1)


def _text(value: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"at character {exc.start}"
        raise ApiError(400, f"a string holds a lone surrogate {where}: not valid Unicode") from None


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"the body is larger than {max_bytes} bytes (--max-body-bytes)", code="body_too_large"
    )
