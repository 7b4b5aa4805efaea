"""The engine core: the process that owns MLX — model, batch, caches, sampling, checkpoints.

Started by the gRPC front (front/core_link.py) as `python -m engine_service.core.process`, with
the front's own engine flags after `--`. It loads the model, warms the batch shapes, says
Ready, then serves commands until the front says Shutdown or goes away (its end of the
`--parent-fd` pipe closes). Its MLX thread shares the GIL only with the command reader,
the planner pool and the spill thread, not with gRPC.

SIGINT and SIGTERM are ignored here: the front decides when the core drains (a Ctrl-C in a
terminal reaches both processes). A front killed outright takes the core with it at once
(Linux: the parent-death signal), as one process would have died; elsewhere the core notices
the closed pipe and stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from engine_service import blas
from engine_service.checkpoints.manager import CheckpointManager
from engine_service.config import EngineConfig, parse_args
from engine_service.core.capability_probe import ProbeFailed
from engine_service.core.planner import Planner
from engine_service.core.plans import Plan, PrefixPlan, ResumePlan
from engine_service.core.setup import checkpoint_manager, scheduler_limits
from engine_service.errors import EngineError
from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.loop.scheduler import Scheduler
from engine_service.loop.warmup import WarmUpFailed
from engine_service.model.determinism_probe import NotRowInvariant, check_row_invariant
from engine_service.model.deterministic import arithmetic, rows_alone_by_default
from engine_service.model.invariant_matmul_cuda import AVAILABLE as KERNEL_AVAILABLE
from engine_service.model.loading import IncompatibleDraft, load_draft, load_model
from engine_service.protocol.channel import (
    Accepted,
    CancelAnswer,
    CancelRequest,
    Codec,
    Command,
    CoreMessage,
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
from engine_service.protocol.events import Event, Finished, Sink
from engine_service.protocol.flush import FlushResult
from engine_service.protocol.requests import DraftSupport
from engine_service.sampling.constraint_compiler import CompileBudget
from engine_service.sampling.constraints import Grammars
from tandem_wire.lifetime import die_with_parent
from tandem_wire.logs import configure_logging

log = logging.getLogger("tandem.engine.core")


# How often the command loop looks at the engine thread, and the core's status when it died.
LOOP_CHECK_MS = 1000
LOOP_DIED_STATUS = 70  # EX_SOFTWARE


@dataclass(frozen=True)
class StreamSink:
    """A job's sink in the core: its events leave with the step's Delivery (never called)."""

    stream: int

    def __call__(self, events: list[Event]) -> None:
        raise AssertionError("core sinks are delivered by Outbox.deliver")


class Outbox:
    """The core's end of the events pipe; every thread sends through it."""

    def __init__(self, socket: zmq.Socket[bytes], codec: Codec) -> None:
        self._socket = socket
        self._codec = codec
        self._lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        self.on_finished: Callable[[int], None] = lambda stream: None  # its Finished left

    def send(self, message: CoreMessage) -> None:
        data = self._codec.encode(message)
        with self._lock:
            self._socket.send(data)  # copied: small messages, cheaper than zero-copy

    def deliver(self, outbox: list[tuple[Sink, list[Event]]]) -> None:
        """The scheduler's Deliver: one message per engine step, on the MLX thread."""
        items: list[tuple[int, list[Event]]] = []
        for sink, events in outbox:
            assert isinstance(sink, StreamSink)
            items.append((sink.stream, events))
            if isinstance(events[-1], Finished):
                self.on_finished(sink.stream)
        self.send(Delivery(items))


class CoreService:
    """What the core does with each command (on the reader thread; planning on a pool)."""

    def __init__(
        self,
        scheduler: Scheduler,
        planner: Planner,
        checkpoints: CheckpointManager | None,
        outbox: Outbox,
    ) -> None:
        self.scheduler = scheduler
        self.planner = planner
        self.checkpoints = checkpoints
        self.outbox = outbox
        # Plans may read the store: off the reader thread, as many at once as gRPC used to.
        self._pool = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4), "plan")
        self._lock = threading.Lock()  # stream states below, and admission against Drop
        self._planning: set[int] = set()
        self._dropped: set[int] = set()  # dropped while planning
        self._running: dict[int, str] = {}  # stream -> request id
        outbox.on_finished = self._finished

    def handle(self, command: Command) -> bool:
        """Applies one command; False when it was Shutdown."""
        if isinstance(command, Submit):
            self._submit(command)
        elif isinstance(command, Drop):
            self._drop(command.stream)
        elif isinstance(command, CancelRequest):
            known = self.scheduler.cancel(
                command.request_id, command.keep_checkpoint, command.stopped
            )
            if command.call:
                self.outbox.send(CancelAnswer(command.call, known))
        elif isinstance(command, Park):
            self.scheduler.park(command.request_id)
        elif isinstance(command, Unpark):
            self.scheduler.unpark(command.request_id)
        elif isinstance(command, StatsCall):
            snapshot = self.checkpoints.snapshot() if self.checkpoints is not None else None
            self.outbox.send(StatsAnswer(command.call, self.scheduler.stats(), snapshot))
        elif isinstance(command, FlushCall):
            self._pool.submit(self._flush, command.call)
        elif isinstance(command, StopAccepting):
            self.scheduler.stop_accepting()
        else:
            return False
        return True

    def _finished(self, stream: int) -> None:
        with self._lock:
            self._running.pop(stream, None)

    def _submit(self, command: Submit) -> None:
        arrived = time.monotonic()
        constrained = command.request.sampling.constraint is not None
        if not constrained and not self.planner.needed(command.request):
            self._admit(command, None, arrived)
            return
        with self._lock:
            self._planning.add(command.stream)
        if constrained or (self.checkpoints is not None and self.checkpoints.has_store):
            # The store may be waited on; a grammar is compiled here, never on the loop.
            self._pool.submit(self._plan_and_admit, command, arrived)
        else:
            self._plan_and_admit(command, arrived)  # the local tier only: microseconds, no hop

    def _plan_and_admit(self, command: Submit, arrived: float) -> None:
        req = command.request
        try:
            if req.sampling.constraint is not None:
                # Compiled once, here, within --constraint-compile-timeout: a grammar that does
                # not compile, or nothing satisfies, is refused before it takes a slot.
                self.scheduler.grammars.compile(req.sampling.constraint)
                self.scheduler.grammars.prepare(req.sampling.constraint)
            plan = self.planner.plan(req) if self.planner.needed(req) else None
        except Exception as exc:  # noqa: BLE001 - refused (EngineError) or a bug (logged)
            with self._lock:
                self._planning.discard(command.stream)
                self._dropped.discard(command.stream)
            self._refuse(command.call, exc)
            return
        self._admit(command, plan, arrived)

    def _admit(self, command: Submit, plan: Plan, arrived: float) -> None:
        req = command.request
        replay = plan.replay if isinstance(plan, ResumePlan) else []
        replay_tokens = plan.replay_logprobs if isinstance(plan, ResumePlan) else []
        with self._lock:
            self._planning.discard(command.stream)
            if command.stream in self._dropped:  # its handler went away while it was planned
                self._dropped.discard(command.stream)
                _release(plan)
                return
            if req.finished_by(replay):
                _release(plan)
                self.outbox.send(Accepted(command.call, replay, False, replay_tokens))
                return
            try:
                self.scheduler.submit(req, StreamSink(command.stream), plan, arrived)
            except Exception as exc:  # noqa: BLE001 - refused (EngineError) or a bug (logged)
                _release(plan)
                self._refuse(command.call, exc)
                return
            self._running[command.stream] = req.request_id
        self.outbox.send(Accepted(command.call, replay, True, replay_tokens))

    def _drop(self, stream: int) -> None:
        with self._lock:
            if stream in self._planning:
                self._dropped.add(stream)
                return
            request_id = self._running.pop(stream, None)
        if request_id is not None:
            self.scheduler.cancel(request_id, keep_checkpoint=True)

    def _refuse(self, call: int, exc: Exception) -> None:
        if not isinstance(exc, EngineError):
            log.error("submitting failed", exc_info=exc)
        message = str(exc) if isinstance(exc, EngineError) else f"internal error: {exc}"
        self.outbox.send(Refused(call, type(exc).__name__, message))

    def _flush(self, call: int) -> None:
        result = FlushResult(durable=False)
        # Prefixes are saved just after their first token leaves: those come first.
        if self.checkpoints is not None and self.scheduler.queued_saves():
            result = self.checkpoints.flush()
        self.outbox.send(FlushAnswer(call, result))

    def shutdown(self, grace_s: float) -> None:
        """Cancels what is left; checkpoints already queued still reach the store."""
        self.scheduler.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.checkpoints is not None:
            self.checkpoints.flush(max(1.0, grace_s))
            self.checkpoints.close()


def _release(plan: Plan) -> None:
    """Gives back the region spans of a plan that will not be materialized."""
    if isinstance(plan, PrefixPlan) and plan.hold is not None:
        plan.hold.release()
    elif isinstance(plan, ResumePlan):
        plan.release()


def _start(config: EngineConfig, outbox: Outbox) -> CoreService:
    sys.setswitchinterval(config.switch_interval_s)
    log.info("BLAS: %s", blas.in_use())
    loaded = load_model(config.model, config.data_dir, config.dtype)
    draft = (
        load_draft(config.draft_model, config.data_dir, loaded, config.dtype)
        if config.draft_model
        else None
    )
    compiled_max_batch = config.compiled_decode_max_batch if config.compiled_decode else 0
    matmul = config.deterministic_matmul
    kernel = matmul == "kernel" or (matmul == "auto" and KERNEL_AVAILABLE)
    alone = config.deterministic_rows_alone
    if config.deterministic:
        compiled = CompiledDecode if compiled_max_batch else None
        if matmul == "kernel" and not KERNEL_AVAILABLE:
            log.warning("--deterministic-matmul kernel runs on MLX-CUDA only: row blocks here")
        if compiled_max_batch and (rows_alone_by_default() if alone is None else alone):
            log.info("deterministic mode: each row's decode attention runs alone; steps eager")
            compiled, compiled_max_batch = None, 0
        rows = config.deterministic_rows
        if not check_row_invariant(loaded.model, rows, compiled, kernel, alone):
            if compiled_max_batch:
                log.warning(
                    "deterministic mode: the compiled decode step does not give the eager "
                    "step's bits on this device; decoding eagerly"
                )
            compiled_max_batch = 0
        log.info(
            "deterministic mode: a row's logits do not depend on its batch (probe passed); "
            "decode steps of up to %d rows compiled",
            compiled_max_batch,
        )
    mode = arithmetic(config.deterministic_rows, kernel, alone) if config.deterministic else ""
    checkpoints = checkpoint_manager(config, loaded, mode)
    problem = checkpoints.check_store()
    if problem:
        log.error("%s: checkpoints will not reach it until that is fixed", problem)
    scheduler = Scheduler(
        loaded,
        scheduler_limits(config),
        outbox.deliver,
        checkpoints,
        draft,
        compiled_decode_max_batch=compiled_max_batch,
        grammars=Grammars.for_model(loaded, CompileBudget(config.constraint_compile_timeout_s)),
        deterministic_rows=config.deterministic_rows if config.deterministic else None,
        deterministic_kernel=kernel,
        deterministic_rows_alone=alone,
    )
    scheduler.start(warm=config.warmup)
    drafts = DraftSupport(draft.model_id if draft else "", config.num_draft_tokens)
    planner = Planner(checkpoints, drafts, scheduler.queued_saves)
    service = CoreService(scheduler, planner, checkpoints, outbox)
    outbox.send(Ready(loaded.facts(), checkpoints.has_store, drafts.model_id, os.getpid()))
    return service


def _serve(
    service: CoreService, commands: zmq.Socket[bytes], parent_fd: int, codec: Codec
) -> float | None:
    """Commands until Shutdown (its grace) or the front's exit (the configured grace); None
    when the engine loop died: its requests would wait forever, so the core exits and the
    front ends their streams with UNAVAILABLE (resumable) and starts a new core."""
    poller = zmq.Poller()
    poller.register(commands, zmq.POLLIN)
    poller.register(parent_fd, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(LOOP_CHECK_MS))
        if not service.scheduler.running():
            log.critical("the engine loop died (its error is logged above): the core exits")
            return None
        if commands in ready:
            command = codec.command(commands.recv())
            if isinstance(command, Shutdown):
                return command.grace_s
            service.handle(command)
        elif parent_fd in ready and not os.read(parent_fd, 1):
            log.warning("the engine front exited: the core stops")
            return -1.0


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when the front dies (elsewhere the parent
    pipe's EOF stops the core: no polling thread)."""
    die_with_parent(parent_pid, signal.SIGKILL, poll=False)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="engine_service.core.process")
    p.add_argument("--commands", required=True, help="ZeroMQ endpoint the front sends on")
    p.add_argument("--events", required=True, help="ZeroMQ endpoint the core sends on")
    p.add_argument("--parent-fd", type=int, required=True, help="closes when the front exits")
    p.add_argument("engine_args", nargs=argparse.REMAINDER)
    p.add_argument("--parent-pid", type=int, required=True)
    a = p.parse_args(argv)
    _die_with_parent(a.parent_pid)
    config = parse_args([arg for arg in a.engine_args if arg != "--"])
    configure_logging(config.log_level, config.log_format)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(a.commands)
    events = context.socket(zmq.PUSH)
    events.connect(a.events)
    codec = Codec()
    outbox = Outbox(events, codec)
    try:
        service = _start(config, outbox)
    except (OSError, IncompatibleDraft, NotRowInvariant, ProbeFailed, WarmUpFailed) as exc:
        log.error("the engine cannot serve: %s", exc)
        outbox.send(StartFailed(str(exc)))
        events.close(linger=2000)
        commands.close(linger=0)
        context.term()  # returns once StartFailed left (or the linger ran out)
        logging.shutdown()
        os._exit(1)  # as at the end of main: no teardown of native threads (MLX, tokenizer)
    grace = _serve(service, commands, a.parent_fd, codec)
    if grace is None:  # no loop to cancel its requests: what is queued for the store goes
        if service.checkpoints is not None:
            service.checkpoints.flush(config.grace_s)
        logging.shutdown()
        os._exit(LOOP_DIED_STATUS)
    service.shutdown(config.grace_s if grace < 0 else grace)
    outbox.send(Stopped())
    events.close(linger=2000)  # the last Delivery (cancellations) still leaves
    commands.close(linger=0)
    context.term()
    log.info("engine core stopped")
    logging.shutdown()
    # Everything is sent and flushed: leave without the interpreter's teardown, where native
    # threads' destructors (MLX, the tokenizer) aborted about one exit in four with
    # "terminate called without an active exception".
    os._exit(0)


if __name__ == "__main__":
    main()
