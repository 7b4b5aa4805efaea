"""Clients of the gateway's SSE endpoint that never read cannot starve its readers.

Kernel socket buffers and the gateway's own buffers take thousands of tokens of events
before a stopped SSE client shows at the engine; the engine's turns (engine_service/loop/turns.py)
bound what those streams take while readers wait, and they end exactly once read.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.servers import GatewayProcess, start_engine
from tests.test_engine_backpressure import _stats, _wait

STALLED, READERS = 16, 32
MAX_RUNNING = 8  # fewer slots than stalled clients: without turns the readers wait them out
TURN_TOKENS = 16
STALLED_TOKENS = 8 * TURN_TOKENS  # 8 turns each: none can end while the readers go first
CHECKED = 8  # stalled streams compared with an uninterrupted run (the rest: lengths)
READER_TOKENS = 16


def _body(i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tandem-tiny",
        "prompt": f"client {i} of many",
        "max_tokens": max_tokens,
        "seed": 300 + i,
        "temperature": 0.9,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "tandem": {"ignore_eos": True},
    }


def _stalled_client(http: str, i: int) -> socket.socket:
    """Sends a streaming request and reads nothing (a small receive buffer, as a client
    that stopped reading has)."""
    host, port = http.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(_body(i, STALLED_TOKENS, True)).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _events(data: bytes) -> list[dict[str, Any]]:
    """The SSE events of a whole HTTP/1.1 response (chunked transfer encoding)."""
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if not n:
            break
        body, rest = body + rest[:n], rest[n + 2 :]
    lines = body.decode().split("\n")
    assert "data: [DONE]" in lines
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def _read_socket(sock: socket.socket) -> str:
    """Reads the stalled client's whole response: its text (usage checked)."""
    data = b""
    with sock:
        sock.settimeout(300)
        while chunk := sock.recv(1 << 16):
            data += chunk
    events = _events(data)
    assert events[-1]["usage"]["completion_tokens"] == STALLED_TOKENS
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def _reader(http: str, i: int) -> int:
    """A client that reads its stream as it comes: the tokens it got."""
    body = json.dumps(_body(1000 + i, READER_TOKENS, True)).encode()
    request = urllib.request.Request(
        http + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    tokens = 0
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


def _reference(http: str, i: int) -> str:
    body = json.dumps(_body(i, STALLED_TOKENS, False)).encode()
    request = urllib.request.Request(
        http + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        text: str = json.load(reply)["choices"][0]["text"]
    return text


def test_16_stalled_sse_clients_leave_32_readers_served(tmp_path: Path) -> None:
    engine = start_engine(
        tmp_path / "engine", "--max-running", str(MAX_RUNNING), "--turn-tokens", str(TURN_TOKENS)
    )
    gateway = GatewayProcess([engine.address], tmp_path / "gateway.log")
    try:
        gateway.wait_engines(1)
        stalled = [_stalled_client(gateway.http, i) for i in range(STALLED)]
        _wait(engine.address, lambda s: s.running == MAX_RUNNING)

        with ThreadPoolExecutor(READERS) as pool:
            got = list(pool.map(lambda i: _reader(gateway.http, i), range(READERS)))
        assert got == [READER_TOKENS] * READERS

        # Every reader is done, and none of the stalled streams has ended.
        s = _stats(engine.address)
        assert s.running + s.queued + s.parked == STALLED, s
        assert s.turns_yielded_total >= STALLED - MAX_RUNNING

        # Read now: each stream is whole, and CHECKED of them are exactly the uninterrupted
        # runs' text.
        with ThreadPoolExecutor(STALLED) as pool:
            texts = list(pool.map(_read_socket, stalled))
        with ThreadPoolExecutor(CHECKED) as pool:
            want = list(pool.map(lambda i: _reference(gateway.http, i), range(CHECKED)))
        assert texts[:CHECKED] == want
    finally:
        gateway.stop()
        engine.stop()
