"""The store's errors, and the one place that maps them to gRPC status codes.

The tree, with the status each class answers (`status_of` walks an error's classes from
the most specific, so a subclass added later inherits its parent's status)::

    StoreError                  INTERNAL             (base class; not raised itself)
    ├── InvalidRequest          INVALID_ARGUMENT     malformed key, header, chunk or query
    ├── NotFound                NOT_FOUND            no such record, or no such lease
    ├── AlreadyExists           ALREADY_EXISTS       Put with if_absent, and the key is taken
    ├── Overloaded              RESOURCE_EXHAUSTED   no room under the byte budget
    │   └── DiskFull            RESOURCE_EXHAUSTED   the disk or the map has no room left
    ├── Corrupt                 DATA_LOSS            stored bytes failed their checksum
    ├── Precondition            FAILED_PRECONDITION  e.g. Delete of a pinned record
    ├── Aborted                 ABORTED              a concurrent change overtook a read
    ├── Unavailable             UNAVAILABLE          the store is shutting down
    ├── IdleStream              DEADLINE_EXCEEDED    a Put stream sent nothing for too long
    └── StorageError            INTERNAL             LMDB failed; not the caller's doing

Anything that is not a StoreError is a bug: `status_on_error` logs it with its traceback
and answers INTERNAL (so does a StorageError, with its own message).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from tandem_wire.auth import AuthError

log = logging.getLogger(__name__)


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidRequest(StoreError):
    """The request itself is wrong; retrying it unchanged fails again."""


class NotFound(StoreError):
    """No record with that key in that namespace, or no lease with that id."""


class AlreadyExists(StoreError):
    """A Put with if_absent found the key taken."""


class Overloaded(StoreError):
    """No room: the payload exceeds the budget, or everything else is pinned."""


class Corrupt(StoreError):
    """Stored bytes failed their checksum (the record is quarantined)."""


class Precondition(StoreError):
    """The record's state forbids the operation (pinned, without force)."""


class Aborted(StoreError):
    """A concurrent change (replace, delete, eviction) overtook a read in progress."""


class Unavailable(StoreError):
    """The store is shutting down."""


class IdleStream(StoreError):
    """A Put or PutMany stream sent nothing for --put-idle-timeout-s: the store ended it
    (its unfinished record is discarded); resend it with the data ready."""


class StorageError(StoreError):
    """An LMDB failure that is not the caller's doing."""


class DiskFull(Overloaded):
    """The data directory's disk (or the LMDB map) has no room for a write: the store stays
    up, earlier records stay intact, the write is refused."""


STATUS: dict[type[StoreError], grpc.StatusCode] = {
    StoreError: grpc.StatusCode.INTERNAL,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DiskFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Corrupt: grpc.StatusCode.DATA_LOSS,
    Precondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    IdleStream: grpc.StatusCode.DEADLINE_EXCEEDED,
    StorageError: grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status of the most specific mapped class of exc; None for an unknown error."""
    if isinstance(exc, AuthError):  # a caller without the right credentials
        return grpc.StatusCode[exc.status]
    for cls in type(exc).__mro__:
        code = STATUS.get(cls)
        if code is not None:
            return code
    return None


@contextmanager
def status_on_error(context: grpc.ServicerContext, method: str) -> Iterator[None]:
    """Aborts the RPC with the status of any error raised inside.

    Args:
        context: the RPC's context (its abort raises, ending the call).
        method: the RPC's name, for the log and for INTERNAL's message.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every error becomes a status here
        code = status_of(exc)
        if code is None or code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
        if code is None:
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc}")
        context.abort(code, str(exc))
