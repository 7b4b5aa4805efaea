"""The engine's error hierarchy; front/servicer.py maps it to gRPC status codes in one place.

    EngineError                 INTERNAL (never raised as such: a bug)
    ├── InvalidRequest          INVALID_ARGUMENT   the caller sent something malformed
    ├── NotFound                NOT_FOUND          no such request / checkpoint
    ├── AlreadyExists           ALREADY_EXISTS     request id already running
    ├── Overloaded              RESOURCE_EXHAUSTED admission limits
    ├── Precondition            FAILED_PRECONDITION wrong model, layout, setup
    │   └── GenerationEnded                        a resume of an ended generation
    ├── Unavailable             UNAVAILABLE        shutting down
    ├── Corrupt                 DATA_LOSS          a stored checkpoint that cannot be read
    ├── DeadlineExceeded        DEADLINE_EXCEEDED  the client's deadline passed
    ├── Abandoned               CANCELLED          the client read nothing for the idle timeout
    └── ModelFailed             INTERNAL           the model failed on this request's row

Anything else reaching an RPC boundary is logged with its traceback and becomes INTERNAL.
"""

from __future__ import annotations

import grpc


class EngineError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidRequest(EngineError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(EngineError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(EngineError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(EngineError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Precondition(EngineError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class GenerationEnded(Precondition):
    """A resume of a generation that ended (its tombstone): nothing to resume. finished: it
    ended normally; tokens: every token it emitted, where the tombstone holds them (a
    finished generation's tail is replayed from them: core/planner.py)."""

    def __init__(
        self,
        message: str,
        generated: int | None = None,
        finished: bool = False,
        tokens: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.generated = generated  # what it emitted in all, where the tombstone says
        self.finished = finished
        self.tokens = tokens


class Unavailable(EngineError):
    code = grpc.StatusCode.UNAVAILABLE


class Corrupt(EngineError):
    """A stored checkpoint that cannot be read as one (malformed metadata)."""

    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(EngineError):
    """The engine dropped the request because the client's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Abandoned(EngineError):
    """The engine stopped a generation whose client read nothing for the park idle timeout
    (its checkpoint, if any, is kept for a resume)."""

    code = grpc.StatusCode.CANCELLED


class ModelFailed(EngineError):
    """The model's forward pass failed on a row (an engine defect, never the caller's): the
    row ends with this and its checkpoint is kept; the rows batched with it go on."""

    code = grpc.StatusCode.INTERNAL


def error_named(name: str, message: str) -> EngineError:
    """The engine error a core process refused a call with (protocol/channel.Refused): the same
    class, so the front answers with the same status; an unknown name is INTERNAL."""
    kinds = {kind.__name__: kind for kind in _subclasses(EngineError)}
    return kinds.get(name, EngineError)(message)


def _subclasses(kind: type[EngineError]) -> list[type[EngineError]]:
    found = []
    for sub in kind.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
