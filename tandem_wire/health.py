"""`HealthServicer`: grpcio-health-checking's asyncio servicer, whose Watch streams end
cleanly when the server shuts down.

The library's Watch waits for the next status change forever, so `server.stop()` cancels it,
and grpc's aio server logs that CancelledError as an ERROR with a traceback for every Watch
left open (a Kubernetes probe, a gateway). Here `shut_down()` sets every service
NOT_SERVING, lets each open Watch send that (a moment at most), then ends them with OK.
Only the library's public surface is used: each Watch runs the library's own in a task,
through a context that notes the last status written.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from grpc_health.v1 import health, health_pb2

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SENDING_WAIT_S = 1.0  # how long shut_down waits for the open Watches to send NOT_SERVING


class _NotingContext:
    """The RPC's context, noting what the library's Watch wrote."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.last_status: int | None = None

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        await self._context.write(message)
        self.last_status = message.status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # untyped library
    def __init__(self) -> None:
        super().__init__()
        self._watches: dict[asyncio.Task[None], _NotingContext] = {}
        self._ending = False

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802 - the gRPC method's name
        noting = _NotingContext(context)
        watch = asyncio.ensure_future(super().Watch(request, noting))
        self._watches[watch] = noting
        try:
            await watch
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                raise  # the caller left, or the server cancels this call: not ours to end
            # shut_down() ended it: the call returns, OK.
        finally:
            self._watches.pop(watch, None)

    async def shut_down(self) -> None:
        """NOT_SERVING for every service, sent to every open Watch, which then ends (OK)."""
        await self.enter_graceful_shutdown()
        self._ending = True
        deadline = time.monotonic() + SENDING_WAIT_S
        while time.monotonic() < deadline and any(
            noting.last_status != NOT_SERVING for noting in self._watches.values()
        ):
            await asyncio.sleep(0.01)
        for watch in list(self._watches):
            watch.cancel()
