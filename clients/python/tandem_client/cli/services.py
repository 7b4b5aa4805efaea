"""`tandem up`'s servers as a small supervisor: each started and named by its banner line, a
server that dies started again on its own address (with backoff, said on the console) while
the others keep serving, and all stopped on Ctrl-C, SIGTERM or SIGHUP whatever became of
the terminal or the pipe the output went to.

Why by hand: the servers must stop with `tandem up` and come back on the addresses already
printed, and `tandem up` must run with nothing but this package installed (no supervisord,
no systemd on a laptop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tandem_client.errors import TandemError

# The servers' variable for `tandem up`'s pid (tandem_wire/lifetime.py): they stop when it
# is gone, however it ended (a SIGKILL too). Named here too: this package has no tandem_wire.
SUPERVISOR_ENV = "TANDEM_SUPERVISOR_PID"
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # up this long, a server's next exit starts the backoff over


class Console:
    """stdout that a dead reader cannot break (a `| tee` killed by the same Ctrl-C, a closed
    terminal): once a write fails, output goes nowhere and the supervisor carries on."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.dead = False

    def say(self, text: str = "", end: str = "\n") -> None:
        if self.dead:
            return
        try:
            self.stream.write(text + end)
            self.stream.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.dead = True
            # Python flushes stdout once more at exit: point it at /dev/null so that last
            # flush does not fail either.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)


@dataclass
class Service:
    """One server: `python -m module args`, ready once it printed `banners` lines ending in
    its addresses. The listen flags (in banner order) are pinned to the bound addresses after
    the first start, so a restart comes back where clients already connect."""

    name: str
    module: str
    args: list[str]
    log: Path
    listen_flags: tuple[str, ...] = ("--listen",)
    proc: subprocess.Popen[str] | None = None
    addresses: list[str] = field(default_factory=list)
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float = 0.0  # when a dead one starts again (0: it is not waiting)

    @property
    def address(self) -> str:
        return self.addresses[0]

    def start(self) -> None:
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        with open(self.log, "a") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", self.module, *self.args],
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env=env,
                # Its own session: a terminal's Ctrl-C reaches `tandem up` only, which then
                # stops the servers in order with SIGTERM.
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        lines = [self.proc.stdout.readline().strip() for _ in self.listen_flags]
        self.proc.stdout.close()
        if not all(" listening on " in line for line in lines):
            self.stop()
            # Its last words say why (e.g. "cannot listen on ...: the address is in use").
            logged = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
            reason = logged[-1] if logged else "no output"
            raise TandemError(f"{self.module} did not start: {reason} (log: {self.log})")
        self.addresses = [line.rsplit(" ", 1)[-1].removeprefix("http://") for line in lines]
        for flag, address in zip(self.listen_flags, self.addresses, strict=True):
            self.args[self.args.index(flag) + 1] = address
        self.started_at = time.monotonic()
        self.restart_at = 0.0

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (it drains), SIGKILL after `timeout`; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class Supervisor:
    """The servers in start order; `tend()` restarts the dead, `stop_all()` ends them in
    reverse order (gateway, engines, stores)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.services: list[Service] = []
        self.restarts = 0

    def start(self, service: Service) -> Service:
        service.start()
        self.services.append(service)
        return service

    def tend(self) -> None:
        """One look at every server: a dead one is given a restart time (its backoff doubles,
        back to one second after a stable run); one whose time came starts again."""
        now = time.monotonic()
        for service in self.services:
            code = service.exit_code()
            if code is None or service.proc is None:
                continue
            if not service.restart_at:
                if now - service.started_at >= STABLE_S:
                    service.backoff_s = FIRST_BACKOFF_S
                service.restart_at = now + service.backoff_s
                self.console.say(
                    f"{service.name} on {service.address} exited (status {code}); "
                    f"restarting in {service.backoff_s:g} s (log: {service.log})"
                )
                service.backoff_s = min(service.backoff_s * 2, MAX_BACKOFF_S)
            elif now >= service.restart_at:
                try:
                    service.start()
                except TandemError as exc:
                    service.restart_at = 0.0  # the next look schedules it again
                    self.console.say(f"{service.name} did not come back: {exc}")
                    continue
                self.restarts += 1
                self.console.say(f"{service.name} back on {service.address}")

    def stop_all(self) -> list[tuple[Service, int]]:
        return [(s, s.stop()) for s in reversed(self.services) if s.proc is not None]

    def kill_all(self) -> None:
        for service in self.services:
            service.kill()
