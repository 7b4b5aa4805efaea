"""The gateway's HTTP input: a body past --max-body-bytes is refused 413 while it is read
(Content-Length or chunked, before its end), a request the engine's gRPC limit refuses is
413 too (not a 429 that invites a retry), and every malformed body is a 400 in OpenAI's
error shape, never a 500."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.servers import GatewayProcess, ServiceProcess

LIMIT = 64 << 10
CHAT = {"model": "tandem-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, engine: ServiceProcess) -> Iterator[str]:
    """HOST:PORT of a gateway's HTTP front with a 64 KiB body limit."""
    root = tmp_path_factory.mktemp("gateway-input")
    proc = GatewayProcess([engine.address], root / "gateway.log", "--max-body-bytes", str(LIMIT))
    try:
        proc.wait_engines(1)
        yield urlsplit(proc.http).netloc
    finally:
        proc.stop()


def _post(address: str, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one HTTP/1.1 response (Content-Length framed)."""
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, json.loads(reader.read(length))


def _assert_error(status: int, body: dict[str, Any], expected: int) -> None:
    assert status == expected, body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def _head(address: str, framing: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def test_a_declared_oversized_body_is_413_before_it_is_sent(gateway: str) -> None:
    # Content-Length says 64 MB; only the first bytes are sent, the answer comes anyway.
    host, port = gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_head(gateway, f"Content-Length: {64 << 20}") + b'{"model": "')
        status, body = _read_reply(sock)
    _assert_error(status, body, 413)


def test_a_chunked_oversized_body_is_413_before_its_end(gateway: str) -> None:
    # No Content-Length: the gateway counts while it reads and answers at the limit, without
    # the body's last chunk (a gateway that buffers to the end would never answer).
    host, port = gateway.rsplit(":", 1)
    chunk = b"x" * (16 << 10)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_head(gateway, "Transfer-Encoding: chunked"))
        for _ in range(2 * LIMIT // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body = _read_reply(sock)
    _assert_error(status, body, 413)


def test_a_body_within_the_limit_still_works(gateway: str) -> None:
    # A field the gateway passes over; no early end of stream (the API samples at T=1).
    padded = dict(CHAT, user="x" * (LIMIT - 1024), tandem={"ignore_eos": True})
    status, body = _post(gateway, json.dumps(padded).encode())
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


def test_a_request_over_the_engines_message_limit_is_413_not_429(
    tmp_path_factory: pytest.TempPathFactory, engine: ServiceProcess
) -> None:
    # Within the gateway's default 8 MiB, past the engine's 4 MiB gRPC message limit: gRPC
    # says RESOURCE_EXHAUSTED, which is no rate limit (a retry fails the same way).
    root = tmp_path_factory.mktemp("gateway-default-limit")
    proc = GatewayProcess([engine.address], root / "gateway.log")
    try:
        proc.wait_engines(1)
        prompt = "word " * (1 << 20)  # 5 MiB of text
        body = json.dumps({"model": "tandem-tiny", "prompt": prompt, "max_tokens": 1}).encode()
        status, reply = _post(urlsplit(proc.http).netloc, body, "/v1/completions")
    finally:
        proc.stop()
    _assert_error(status, reply, 413)


def _with(fields: str) -> bytes:
    """CHAT with raw JSON fields added (raw: NaN and 1e400 cannot be written by json.dumps)."""
    return json.dumps(CHAT).encode()[:-1] + b", " + fields.encode() + b"}"


MALFORMED = {
    "NaN": _with('"tandem": {"top_k": NaN}'),
    "Infinity": _with('"tandem": {"tokens_held": Infinity}'),
    "-Infinity": _with('"max_tokens": -Infinity'),
    "1e400": _with('"max_tokens": 1e400'),
    "top_k 2^40": _with(f'"tandem": {{"top_k": {2**40}}}'),
    "max_tokens 2^70": _with(f'"max_tokens": {2**70}'),
    "checkpoint_interval 2^31": _with(f'"tandem": {{"checkpoint_interval": {2**31}}}'),
    "token id 2^40": json.dumps({"prompt": [1, 2**40], "max_tokens": 2}).encode(),
    "nested 30,000 deep": _with('"metadata": ' + "[" * 30_000 + "]" * 30_000),  # < LIMIT
    "nested 100 deep": _with('"metadata": ' + "[" * 100 + "]" * 100),
    "lone surrogate": json.dumps(
        {"model": "tandem-tiny", "messages": [{"role": "user", "content": "a\ud800b"}]}
    ).encode(),
    "lone surrogate in a key": _with('"\\udfff": 1'),
    "a list where a scheme goes": _with('"tandem": {"kv_scheme": []}'),
    "a string where a flag goes": _with('"stream": "false"'),
    "an object where a namespace goes": _with('"tandem": {"namespace": {"a": 1}}'),
    "a number where text goes": json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    ).encode(),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_body_is_400(gateway: str, name: str) -> None:
    body = MALFORMED[name]
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    status, reply = _post(gateway, body, path)
    _assert_error(status, reply, 400)


def test_the_gateway_serves_after_malformed_bodies(gateway: str) -> None:
    for body in MALFORMED.values():
        _post(gateway, body)
    status, reply = _post(gateway, json.dumps(CHAT).encode())
    assert status == 200, reply
    assert reply["choices"][0]["message"]["role"] == "assistant"
