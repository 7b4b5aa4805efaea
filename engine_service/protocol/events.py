"""What the engine loop tells a request's handler: Started, Token per generated token, and
exactly one Finished. Shared by the batch loop (loop/scheduler.py) and the speculative lane.

msgspec structs: the engine core sends them to the gRPC front as they are (protocol/channel.py),
one message per engine step, encoded in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

# "stop": a stop token (stop strings are found by the handler); "deadline": the client's
# deadline passed; "idle": the client read nothing for the park timeout (loop/preemption.py);
# "unavailable": the engine core exited under the request (the front says so).
FinishReason = Literal["length", "stop", "cancelled", "deadline", "idle", "error", "unavailable"]

# Why a prompt reused no cached prefix (docs/checkpoints.md); "" when it reused one, or was
# not looked up for reuse (a resume). "not restorable": a record failed its checks (damaged,
# another layout) or could not be rebuilt; "cheaper to prefill": checkpoints/restore_cost.py's
# choice;
# "prefix reuse off": an engine loop without a checkpoint manager.
PrefixMissReason = Literal[
    "",
    "shorter than a block",
    "no stored prefix",
    "cheaper to prefill",
    "not restorable",
    "store unavailable",
    "prefix reuse off",
]


# Where a reused prefix came from (Usage.prefix_source): the local tier, or the store and
# how its bytes came (tandem_client.same_host.ReadRoute); "" when none was reused.
PrefixSource = Literal[
    "",
    "local",
    "store: region",
    "store: direct",
    "store: no region",
    "store: larger than the region",
    "store: region busy",
    "store: larger than the span",
]


class Started(msgspec.Struct, frozen=True, tag=True):
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_miss_reason: PrefixMissReason = ""
    prefix_source: PrefixSource = ""


class Token(msgspec.Struct, frozen=True, tag=True):
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class Finished(msgspec.Struct, frozen=True, tag=True):
    reason: FinishReason
    error: str = ""
    stop_token: int | None = None
    drafted: int = 0  # speculative decoding: draft tokens proposed and kept
    accepted: int = 0
    constraint_incomplete: bool = False  # a constrained row cut short by max_tokens
    # reason "error": the engine error class (errors.py) the stream ends with, so the caller
    # gets that status instead of OK; "" is ModelFailed (INTERNAL).
    failure: str = ""


Event = Started | Token | Finished
Sink = Callable[[list[Event]], None]
# One engine step's events for every stream, handed over together (the core sends them as
# one Delivery message).
Deliver = Callable[[list[tuple[Sink, list[Event]]]], None]
