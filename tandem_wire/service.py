"""What both server processes share: logging, server options, and requests that cannot be
parsed answered INVALID_ARGUMENT on every RPC.

grpc turns a deserializer that raises into INTERNAL ("Exception deserializing request!") on
the sync server and UNKNOWN on the asyncio one: a caller's malformed bytes would read as our
bug. `guarded(server)` stands in for the server while the generated `add_*_to_server`
functions (and health, reflection, our own generic handlers) register, and wraps every
handler once: its deserializer never raises (a failure becomes a `MalformedRequest`), and a
unary request that is one is refused with INVALID_ARGUMENT before the method runs. For
request streams the method sees the `MalformedRequest` among its messages and refuses it
itself (the store's Put does).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from tandem_wire.auth import (
    Authenticator,
    AuthError,
    Principal,
    Role,
    reset_current,
    set_current,
    tls_identities,
)

# One server per port: gRPC binds with SO_REUSEPORT by default on Linux, so a second server on
# a busy port would start and share its traffic with the first.
SERVER_OPTIONS: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]


@dataclass(frozen=True)
class Access:
    """Who may call what: the authenticator, and the role each method needs ("/svc/Method",
    or "/svc/*" for a whole service). Methods it does not name (health, reflection) are
    open."""

    authenticator: Authenticator
    roles: Mapping[str, Role]

    def role_of(self, method: str) -> Role | None:
        found = self.roles.get(method)
        if found is None:
            found = self.roles.get(method.rsplit("/", 1)[0] + "/*")
        return found

    def check(self, method: str, context: Any) -> Principal | None:
        """The caller's principal, holding the method's role. Raises AuthError."""
        role = self.role_of(method)
        if role is None:
            return None
        principal = self.authenticator.authenticate(
            context.invocation_metadata(),
            lambda: tls_identities(context.auth_context()),  # only without a token: costly
            context.peer(),
        )
        principal.require(role)
        return principal


def auth_status(exc: AuthError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.status]


class MalformedRequest:
    """What a request message that could not be parsed deserializes to."""

    def __init__(self, error: str) -> None:
        self.error = error

    def message(self, method: str) -> str:
        return f"{method}: the request could not be parsed ({self.error})"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - the caller's bytes, answered as such
            return MalformedRequest(f"{type(exc).__name__}: {exc}")

    return parse


def _guard_sync(
    behavior: Callable[..., Any], method: str, access: Access | None, streaming_out: bool
) -> Callable[..., Any]:
    def admit(request: Any, context: grpc.ServicerContext) -> Principal | None:
        if isinstance(request, MalformedRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
        if access is None:
            return None
        try:
            return access.check(method, context)
        except AuthError as exc:
            context.abort(auth_status(exc), str(exc))
            raise  # not reached: abort raises

    if streaming_out:
        # The response generator runs after this returns: the principal is set inside it.
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            principal = admit(request, context)
            token = set_current(principal)
            try:
                yield from behavior(request, context)
            finally:
                reset_current(token)

        return stream

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        principal = admit(request, context)
        token = set_current(principal)
        try:
            return behavior(request, context)
        finally:
            reset_current(token)

    return call


def _guard_async(
    behavior: Callable[..., Any], method: str, access: Access | None
) -> Callable[..., Any]:
    async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
        if access is not None:
            try:
                set_current(access.check(method, context))
            except AuthError as exc:
                await context.abort(auth_status(exc), str(exc))

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(request, context)
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await admit(request, context)
        return await behavior(request, context)

    return unary


def _guard(handler: Any, method: str, asynchronous: bool, access: Access | None) -> Any:
    """The handler with a deserializer that never raises and, with `access`, the caller
    authenticated first (grpc's RpcMethodHandler is a namedtuple: `_replace` is its public
    copy-with). Each asyncio call runs in a task of its own, so the principal it sets is
    the call's alone."""
    guarded = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
    kind = next(
        k
        for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        if getattr(handler, k) is not None
    )
    behavior = getattr(handler, kind)
    if asynchronous:
        wrapped = _guard_async(behavior, method, access)
    else:
        wrapped = _guard_sync(behavior, method, access, kind.endswith("_stream"))
    return guarded._replace(**{kind: wrapped})


class _GuardedGeneric(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    def __init__(
        self, inner: grpc.GenericRpcHandler, asynchronous: bool, access: Access | None
    ) -> None:
        self.inner = inner
        self.asynchronous = asynchronous
        self.access = access

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        return _guard(handler, handler_call_details.method, self.asynchronous, self.access)


class guarded:  # noqa: N801 - used like a function: guarded(server)
    """Registers handlers on `server` with malformed requests refused (see the module doc)."""

    def __init__(self, server: Any, access: Access | None = None) -> None:
        self.server = server
        self.asynchronous = isinstance(server, grpc.aio.Server)
        self.access = access

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(
            [_GuardedGeneric(h, self.asynchronous, self.access) for h in handlers]
        )

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        self.server.add_registered_method_handlers(
            service,
            {
                name: _guard(h, f"/{service}/{name}", self.asynchronous, self.access)
                for name, h in handlers.items()
            },
        )
