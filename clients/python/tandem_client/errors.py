"""Errors raised by the clients: one class per status a caller acts on; each keeps its code."""

from __future__ import annotations

import grpc


class TandemError(Exception):
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(TandemError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TandemError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TandemError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(TandemError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(TandemError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(TandemError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(TandemError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(TandemError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TandemError):
    code = grpc.StatusCode.PERMISSION_DENIED


class PutManyFailed(TandemError):
    """A put_many call stopped at a record: the first `stored` records are in the store."""

    def __init__(self, cause: TandemError, stored: int) -> None:
        super().__init__(f"{cause} (after {stored} stored)", cause.code)
        self.cause = cause
        self.stored = stored


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        DataLoss,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
    )
}


def from_rpc_error(exc: grpc.RpcError) -> TandemError:
    """The client-side exception for a failed call."""
    # Sync calls raise a grpc.Call; grpc.aio raises AioRpcError, which is not one but has
    # the same code() and details().
    has_status = callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None))
    code = exc.code() if has_status else grpc.StatusCode.UNKNOWN
    details = exc.details() if has_status else str(exc)
    cls = _BY_CODE.get(code, TandemError)
    return cls(f"{code.name}: {details}", code)
