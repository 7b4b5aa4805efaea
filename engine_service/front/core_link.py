"""The gRPC front's end of the engine core: starts it, talks to it, notices when it dies.

One `CoreLink` per front, on the event loop. It spawns `engine_service.core.process` with
the front's flags, sends commands and awaits answers (protocol/channel.py), and routes each
step's Delivery to the request streams it holds. When the core exits unasked, every open
stream ends with UNAVAILABLE, every waiting call fails with it, `on_serving(False)` is
called (health: NOT_SERVING), and a new core is started with backoff; `on_serving(True)`
once it is Ready. Each core gets fresh endpoints, so nothing meant for a dead one reaches
its successor.

ZeroMQ (pyzmq) carries the bytes: ipc sockets in a private 0700 directory, no network.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from engine_service.errors import Unavailable, error_named
from engine_service.front.core_spawn import CoreProcess, spawn_core
from engine_service.front.response_stream import RequestStream
from engine_service.protocol.channel import (
    Accepted,
    CancelAnswer,
    CancelRequest,
    Codec,
    Command,
    Delivery,
    Drop,
    FlushAnswer,
    FlushCall,
    Park,
    Ready,
    Refused,
    Shutdown,
    StartFailed,
    StatsAnswer,
    StatsCall,
    StopAccepting,
    Stopped,
    Submit,
    Unpark,
)
from engine_service.protocol.events import Finished
from engine_service.protocol.flush import FlushResult
from engine_service.protocol.requests import GenerationRequest

log = logging.getLogger("tandem.engine")

RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
HEALTHY_AFTER_S = 60.0  # a core that ran this long restarts without waiting


class CoreStartFailed(OSError):
    """The core could not load its model or settings."""


class _Connection:
    """One core process, its two sockets, and what became of it."""

    def __init__(self, context: zmq.asyncio.Context, core: CoreProcess) -> None:
        self.core = core
        sync: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        self.commands: zmq.Socket[bytes] = sync.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.SNDHWM, 0)  # commands are small: never block the loop
        self.commands.bind(core.commands_endpoint)
        self.events = context.socket(zmq.PULL)
        self.events.setsockopt(zmq.RCVHWM, 0)
        self.events.bind(core.events_endpoint)
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[Ready] = loop.create_future()
        self.stopped: asyncio.Future[None] = loop.create_future()  # its Stopped arrived
        self.exited: asyncio.Future[int] = loop.create_future()
        self.was_ready = False
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.commands.close(linger=0)
        self.events.close(linger=0)
        self.core.close()


def _exit_status(core: CoreProcess) -> asyncio.Future[int]:
    """The process's exit status, from a daemon thread (Popen: it may have been spawned
    before the loop ran; a daemon never holds up the front's own exit)."""
    loop = asyncio.get_running_loop()
    status: asyncio.Future[int] = loop.create_future()

    def wait() -> None:
        code = core.proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(status.set_result, code)

    threading.Thread(target=wait, name="core-exit", daemon=True).start()
    return status


class CoreLink:
    def __init__(
        self, engine_args: list[str], on_serving: Callable[[bool], Awaitable[None]]
    ) -> None:
        self.engine_args = engine_args
        self.on_serving = on_serving
        self.ready: Ready | None = None  # the running core's; None while there is none
        self._context = zmq.asyncio.Context()
        self._codec = Codec()
        self._conn: _Connection | None = None
        self._streams: dict[int, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._accepting = True
        self._restarts = 0

    # -- life ------------------------------------------------------------------------------

    async def start(self, spawned: CoreProcess | None = None) -> Ready:
        """Starts a core (or takes one spawned early) and waits for it to be Ready;
        CoreStartFailed if it cannot load."""
        conn = _Connection(self._context, spawned or spawn_core(self.engine_args))
        loop = asyncio.get_running_loop()
        conn.tasks = [loop.create_task(self._receive(conn)), loop.create_task(self._watch(conn))]
        try:
            message = await conn.ready
        except CoreStartFailed:
            conn.close()
            raise
        conn.was_ready = True
        self._conn, self.ready = conn, message
        if not self._accepting:
            self._send(StopAccepting())
        log.info("engine core ready (pid %d)", message.pid)
        return message

    async def _watch(self, conn: _Connection) -> None:
        status = await _exit_status(conn.core)
        conn.exited.set_result(status)
        if not conn.was_ready:  # died while starting: start() says so
            if not conn.ready.done():
                conn.ready.set_exception(
                    CoreStartFailed(f"the engine core exited with status {status}")
                )
            return
        if self._stopping:
            return  # shutdown() waits for it
        self._conn, self.ready = None, None
        conn.close()
        why = f"the engine core exited (status {status})"
        self._fail_open(why)
        log.error("%s: open streams ended with UNAVAILABLE; starting a new core", why)
        await self.on_serving(False)
        healthy = time.monotonic() - conn.core.started_at > HEALTHY_AFTER_S
        self._restarts = 0 if healthy else self._restarts + 1
        while not self._stopping:
            delay = RESTART_DELAYS_S[min(self._restarts, len(RESTART_DELAYS_S)) - 1]
            await asyncio.sleep(delay if self._restarts else 0)
            try:
                await self.start()
            except CoreStartFailed as exc:
                log.error("restarting the engine core failed: %s", exc)
                self._restarts += 1
                continue
            await self.on_serving(True)
            return

    async def _receive(self, conn: _Connection) -> None:
        while True:
            try:
                data = await conn.events.recv()
            except zmq.ZMQError:
                return  # closed with its connection
            message = self._codec.core_message(data)
            if isinstance(message, Delivery):
                for stream, events in message.items:
                    target = self._streams.get(stream)
                    if target is not None:
                        target.push(events)
            elif isinstance(message, Ready):
                if not conn.ready.done():
                    conn.ready.set_result(message)
            elif isinstance(message, StartFailed):
                if not conn.ready.done():
                    conn.ready.set_exception(CoreStartFailed(message.message))
            elif isinstance(message, Stopped):
                if not conn.stopped.done():
                    conn.stopped.set_result(None)
            else:
                waiter = self._calls.pop(message.call, None)
                if waiter is None or waiter.done():
                    continue
                if isinstance(message, Refused):
                    waiter.set_exception(error_named(message.error, message.message))
                else:
                    waiter.set_result(message)

    def _fail_open(self, why: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push([Finished("unavailable", error=why)])
        calls, self._calls = self._calls, {}
        for waiter in calls.values():
            if not waiter.done():
                waiter.set_exception(Unavailable(why))

    def stop_accepting(self) -> None:
        self._accepting = False
        self._send(StopAccepting())

    async def shutdown(self, grace_s: float) -> None:
        """The core cancels what is left and flushes checkpoints within grace_s, then exits;
        what it delivered before that reaches the streams first."""
        self._stopping = True
        conn = self._conn
        if conn is not None:
            self._send(Shutdown(grace_s))
            try:
                await asyncio.wait_for(asyncio.shield(conn.stopped), grace_s + 15.0)
                await asyncio.wait_for(asyncio.shield(conn.exited), 10.0)
            except TimeoutError:
                log.error("the engine core did not stop: killed")
                conn.core.proc.kill()
                await conn.exited
            conn.close()
        self._conn, self.ready = None, None
        self._fail_open("the engine stopped")
        self._context.destroy(linger=0)  # a core still starting may hold sockets open

    # -- streams and calls -----------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Open generation streams."""
        return len(self._streams)

    def open_stream(self, stream: RequestStream) -> int:
        key = next(self._ids)
        self._streams[key] = stream
        return key

    def close_stream(self, key: int, drop: bool) -> None:
        """The handler is done with it; drop: it ended early (the row is freed, its
        checkpoint kept for a resume)."""
        self._streams.pop(key, None)
        if drop:
            self._send(Drop(key))

    async def submit(self, key: int, request: GenerationRequest) -> Accepted:
        if not self._accepting:
            raise Unavailable("the engine is shutting down")
        call = next(self._ids)
        answer: Accepted = await self._call(call, Submit(call, key, request))
        return answer

    def cancel(self, request_id: str, keep_checkpoint: bool = False, stopped: bool = False) -> None:
        self._send(CancelRequest(request_id, keep_checkpoint, stopped))

    async def cancel_known(self, request_id: str) -> bool:
        """Cancels a request by id; False if the core does not know it."""
        call = next(self._ids)
        answer: CancelAnswer = await self._call(call, CancelRequest(request_id, call=call))
        return answer.known

    def park(self, request_id: str) -> None:
        self._send(Park(request_id))

    def unpark(self, request_id: str) -> None:
        self._send(Unpark(request_id))

    async def stats(self) -> StatsAnswer:
        call = next(self._ids)
        answer: StatsAnswer = await self._call(call, StatsCall(call))
        return answer

    async def flush(self) -> FlushResult:
        call = next(self._ids)
        answer: FlushAnswer = await self._call(call, FlushCall(call))
        return answer.result

    async def _call(self, call: int, command: Command) -> Any:
        waiter = asyncio.get_running_loop().create_future()
        self._calls[call] = waiter
        if not self._send(command):
            self._calls.pop(call, None)
            raise Unavailable("the engine core is restarting")
        try:
            return await waiter
        finally:
            self._calls.pop(call, None)

    def _send(self, command: Command) -> bool:
        """Sends without blocking; False when no core is running."""
        conn = self._conn
        if conn is None or self.ready is None:
            return False
        conn.commands.send(self._codec.encode(command), copy=False)
        return True
