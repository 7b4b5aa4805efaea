"""Starting an engine core process (standard library only).

The front calls this before it imports mlx-lm and the tokenizer stack (seconds): the core
loads its model meanwhile. ZeroMQ lets the core connect to the ipc endpoints before the
front binds them (front/core_link.py); it retries until they exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field


@dataclass
class CoreProcess:
    folder: str  # a fresh 0700 directory holding the two ipc endpoints
    commands_endpoint: str
    events_endpoint: str
    parent_write: int  # the front's end of the pipe the core watches (closes: front gone)
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        try:
            os.close(self.parent_write)
        except OSError:
            pass  # closed already
        shutil.rmtree(self.folder, ignore_errors=True)


def spawn_core(engine_args: list[str]) -> CoreProcess:
    """`python -m engine_service.core.process` with the front's own engine flags."""
    folder = tempfile.mkdtemp(prefix="tandem-core-")  # mkdtemp: mode 0700
    commands, events = f"ipc://{folder}/commands", f"ipc://{folder}/events"
    parent_read, parent_write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_service.core.process"]
        + ["--commands", commands, "--events", events]
        + ["--parent-fd", str(parent_read), "--parent-pid", str(os.getpid())]
        + ["--", *engine_args],
        pass_fds=(parent_read,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # logs go to stderr, shared with the front
    )
    os.close(parent_read)
    return CoreProcess(folder, commands, events, parent_write, proc)
