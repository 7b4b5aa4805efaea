"""A generation stream over several addresses of one service (gateways in front of the same
engines): when the server a stream uses dies, the stream goes on through the next one.

The next server is asked to resume the same request id with the tokens the caller already
holds (`resume`, `tokens_held`): it restores the engine's last checkpoint of the request,
generates what was lost since, and sends only what the caller does not have, so the caller
sees one unbroken stream. Gateways route a request id's prompt to the same engine
(gateway_service/affinity.py), so the engine that held the row usually resumes it.

The moves, decided by `StreamAttempts.after` on the status that ended an attempt:
- UNAVAILABLE (the server died, restarted, or is unreachable): the next address, resuming;
- ALREADY_EXISTS after a move: the engine still runs the row the dead server had opened (it
  notices the closed connection within moments), so the same address again, after a pause;
- NOT_FOUND or FAILED_PRECONDITION to a resume this client asked for (no checkpoint of the
  request reached the store, or no store): the request again from its start, the engine
  skipping the tokens held (the same tokens for greedy or seeded sampling);
- anything else, or no progress for `wait_s`: the error goes to the caller.

Hand-written: gRPC's own retries never replay a stream that has sent messages.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem_wire.pb import engine_pb2, engine_pb2_grpc

FAILOVER_WAIT_S = 15.0  # without a token or a move that worked, the stream gives up
_PAUSES_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # between rounds over every address, growing


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """ "a,b" or ["a", "b"] as a list of addresses, in order, each once."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    found = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not found:
        raise ValueError("no address given")
    return found


class Move(enum.Enum):
    NEXT_ADDRESS = "next address"
    SAME_ADDRESS = "same address"
    GIVE_UP = "give up"


@dataclass(frozen=True)
class Step:
    move: Move
    pause_s: float = 0.0  # before the next attempt


class StreamAttempts:
    """One generation's attempts across addresses: what to ask next, and when to stop."""

    def __init__(
        self, request: engine_pb2.GenerateRequest, addresses: int, wait_s: float = FAILOVER_WAIT_S
    ) -> None:
        self._first = engine_pb2.GenerateRequest()
        self._first.CopyFrom(request)
        if not self._first.request_id:  # a resume names the request: the client picks the id
            self._first.request_id = f"py-{uuid.uuid4().hex}"
        self._addresses = addresses
        self._wait_s = wait_s
        self._received = 0  # tokens this stream gave the caller
        self._resume = request.resume
        self._moved = False  # a move happened: resuming is this client's doing
        self._unavailable = 0  # attempts in a row that found no server
        self._conflicts = 0  # attempts in a row that found the row still running
        self._progress_at = time.monotonic()

    @property
    def request_id(self) -> str:
        return self._first.request_id

    def request(self) -> engine_pb2.GenerateRequest:
        """The request for the next attempt."""
        out = engine_pb2.GenerateRequest()
        out.CopyFrom(self._first)
        out.resume = self._resume
        out.tokens_held = self._first.tokens_held + self._received
        return out

    def received(self, tokens: int) -> None:
        self._received += tokens
        self._unavailable = self._conflicts = 0
        self._progress_at = time.monotonic()

    def after(self, code: grpc.StatusCode) -> Step:
        """What to do after an attempt ended with this status."""
        if time.monotonic() - self._progress_at > self._wait_s:
            return Step(Move.GIVE_UP)
        if code == grpc.StatusCode.UNAVAILABLE:
            self._unavailable += 1
            # Nothing received yet: a fresh start is all a resume could be.
            self._moved, self._resume = True, self._resume or self._received > 0
            # Every other address at once, then rounds over all of them, further apart.
            rounds = self._unavailable // self._addresses
            pause = _PAUSES_S[min(rounds, len(_PAUSES_S)) - 1] if rounds else 0.0
            return Step(Move.NEXT_ADDRESS, pause)
        if code == grpc.StatusCode.ALREADY_EXISTS and self._moved:
            self._conflicts += 1  # the old row ends within moments: look again soon
            return Step(Move.SAME_ADDRESS, min(0.025 * 2**self._conflicts, 1.0))
        resume_refused = code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
        if resume_refused and self._moved and self._resume and not self._first.resume:
            self._resume = False  # generate again; the engine skips the tokens held
            return Step(Move.SAME_ADDRESS)
        return Step(Move.GIVE_UP)


class AddressedStubs:
    """The Engine stubs of a client of several addresses (EngineClient, AsyncEngineClient):
    one per address, made on first use over the client's channel to it, and where calls
    start (the address the last move went to). Each stream keeps its own position, so
    threads sharing the client never close each other's calls."""

    addresses: list[str]

    def _init_stubs(self) -> None:
        self._stubs: dict[int, engine_pb2_grpc.EngineStub] = {}
        self._preferred = 0

    def _channel_to(self, address: str) -> Any:  # the client's (GrpcClient, AsyncGrpcClient)
        raise NotImplementedError

    @property
    def _stub(self) -> engine_pb2_grpc.EngineStub:
        return self._stub_at(self._preferred)

    def _stub_at(self, at: int) -> engine_pb2_grpc.EngineStub:
        stub = self._stubs.get(at)
        if stub is None:
            channel = self._channel_to(self.addresses[at])
            stub = self._stubs.setdefault(at, engine_pb2_grpc.EngineStub(channel))
        return stub

    def _moved_from(self, at: int) -> int:
        """The next address after `at`, which later calls now start from."""
        self._preferred = (at + 1) % len(self.addresses)
        return self._preferred
