"""The messages between the gRPC front and the engine core process, and their encoding.

Two ZeroMQ PUSH/PULL pipes over private ipc endpoints (a 0700 directory): commands go
front -> core, events and replies core -> front. Each message is one msgspec struct, msgpack
encoded: an engine step's tokens for every stream leave as one `Delivery`.

Calls that want an answer carry a `call` number; the reply echoes it. Fire-and-forget
commands (drop, cancel from a stop string, park) carry none.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from engine_service.protocol.checkpoint_stats import CheckpointStats
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.events import Event, Token
from engine_service.protocol.flush import FlushResult
from engine_service.protocol.model_facts import ModelFacts
from engine_service.protocol.requests import GenerationRequest

# -- front -> core -------------------------------------------------------------------------


class Submit(msgspec.Struct, tag=True):
    """A request to plan and admit; its events go to `stream`."""

    call: int
    stream: int
    request: GenerationRequest


class Drop(msgspec.Struct, tag=True):
    """The stream's handler went away (client gone, deadline): free the row, keep its
    checkpoint for a resume. Also stops a request still being planned."""

    stream: int


class CancelRequest(msgspec.Struct, tag=True):
    request_id: str
    keep_checkpoint: bool = False
    stopped: bool = False  # a stop string ended the text
    call: int = 0  # 0: no answer wanted


class Park(msgspec.Struct, tag=True):
    request_id: str


class Unpark(msgspec.Struct, tag=True):
    request_id: str


class StatsCall(msgspec.Struct, tag=True):
    call: int


class FlushCall(msgspec.Struct, tag=True):
    call: int


class StopAccepting(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    """Cancel what is left, flush checkpoints within grace_s, exit."""

    grace_s: float


Command = (
    Submit | Drop | CancelRequest | Park | Unpark | StatsCall | FlushCall | StopAccepting | Shutdown
)

# -- core -> front -------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    facts: ModelFacts
    has_store: bool
    draft_model_id: str
    pid: int


class StartFailed(msgspec.Struct, tag=True):
    """The core could not load its model or settings (the front exits with this)."""

    message: str


class Stopped(msgspec.Struct, tag=True):
    """The core's last message: everything before it was delivered."""


class Delivery(msgspec.Struct, tag=True):
    """One engine step's events: (stream, events) pairs."""

    items: list[tuple[int, list[Event]]]


class Accepted(msgspec.Struct, tag=True):
    call: int
    replay: list[int]  # a resumed generation's tokens already emitted (the client's too)
    submitted: bool  # False: the replay already ends it, nothing runs
    # With logprobs asked: the events of the replay's last tokens, those the client does not
    # hold, with the log-probabilities they were emitted with (checkpoints/logprob_pages.py).
    replay_tokens: list[Token] = []


class Refused(msgspec.Struct, tag=True):
    """A call that failed: the EngineError subclass's name and message (errors.py)."""

    call: int
    error: str
    message: str


class CancelAnswer(msgspec.Struct, tag=True):
    call: int
    known: bool


class StatsAnswer(msgspec.Struct, tag=True):
    call: int
    engine: EngineStats
    checkpoints: CheckpointStats | None


class FlushAnswer(msgspec.Struct, tag=True):
    call: int
    result: FlushResult


Answer = Accepted | Refused | CancelAnswer | StatsAnswer | FlushAnswer
CoreMessage = Ready | StartFailed | Stopped | Delivery | Answer


def _encode_extra(obj: Any) -> Any:
    if isinstance(obj, collections.deque):  # EngineStats.recent
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _decode_extra(kind: Any, obj: Any) -> Any:
    if getattr(kind, "__origin__", kind) is collections.deque:
        return collections.deque(tuple(item) for item in obj)  # EngineStats.recent
    raise NotImplementedError(f"cannot decode {kind}")


class Codec:
    """Encoder and decoders, made once per process (msgspec compiles them per type)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
        self._commands = msgspec.msgpack.Decoder(Command, dec_hook=_decode_extra)
        self._core = msgspec.msgpack.Decoder(CoreMessage, dec_hook=_decode_extra)

    def encode(self, message: Command | CoreMessage) -> bytes:
        return self._encoder.encode(message)

    def command(self, data: bytes) -> Command:
        result: Command = self._commands.decode(data)
        return result

    def core_message(self, data: bytes) -> CoreMessage:
        result: CoreMessage = self._core.decode(data)
        return result
