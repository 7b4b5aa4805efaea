"""The store's error hierarchy and the one place that maps it to gRPC status codes."""

from __future__ import annotations

import grpc


class StoreError(Exception):
    """Base class; `code` is the gRPC status the caller sees."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(StoreError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StoreError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(StoreError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(StoreError):
    """No room: the payload exceeds the budget, or everything else is pinned."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Corrupt(StoreError):
    """Stored bytes failed their checksum."""

    code = grpc.StatusCode.DATA_LOSS


class Precondition(StoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(StoreError):
    """A concurrent change (replace, delete, eviction) overtook a read in progress."""

    code = grpc.StatusCode.ABORTED


class Unavailable(StoreError):
    code = grpc.StatusCode.UNAVAILABLE
