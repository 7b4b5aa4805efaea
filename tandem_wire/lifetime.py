"""A child process that ends with its parent: the engine's core with its front, and every
server that `tandem up` starts with `tandem up`.

On Linux the kernel signals the child when its parent dies (prctl PR_SET_PDEATHSIG), however
the parent died: a SIGKILL, a crash, a closed terminal. Elsewhere a daemon thread polls the
parent's pid once a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
# Set by `tandem up` (tandem_client/cli/services.py) in each server's environment: its pid.
SUPERVISOR_ENV = "TANDEM_SUPERVISOR_PID"


def die_with_parent(parent_pid: int, signum: int, poll: bool = True) -> None:
    """`signum` to this process once `parent_pid` is no longer its parent. Without the
    kernel's help (not Linux), a thread polls for it when `poll`."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    elif poll:
        threading.Thread(
            target=_poll_parent, args=(parent_pid, signum), name="parent-watch", daemon=True
        ).start()
    if os.getppid() != parent_pid:  # it died before the lines above
        os.kill(os.getpid(), signum)


def follow_supervisor() -> None:
    """A server started by `tandem up` stops (SIGTERM: it drains as on any stop) when
    `tandem up` is gone. The variable is removed so that the server's own children (the
    engine's core) do not take it for theirs."""
    pid = os.environ.pop(SUPERVISOR_ENV, "")
    if pid.isdigit():
        die_with_parent(int(pid), signal.SIGTERM)


def _poll_parent(parent_pid: int, signum: int) -> None:
    while os.getppid() == parent_pid:
        threading.Event().wait(1.0)
    os.kill(os.getpid(), signum)
