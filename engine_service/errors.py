"""The engine's error hierarchy; servicer.py maps it to gRPC status codes."""

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


class Unavailable(EngineError):
    code = grpc.StatusCode.UNAVAILABLE
