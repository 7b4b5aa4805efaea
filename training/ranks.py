"""Data-parallel training over this machine's cores: N rank processes joined by MLX's ring
backend over loopback.

Why: MLX's CPU backend runs element-wise work (the exps of softmax, SiLU and the loss are
most of a step) on one thread, and only BLAS uses more. Two ranks on 2 cores each take half
of every batch on a core of their own, and average their gradients each step.

Why not `mlx.launch`: its launcher process polls its children's pipes and keeps a core busy
(measured here: 100% of one of the two), which costs more than the second rank gains. The
ring backend needs only a host file and two environment variables, written here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RANK_VARIABLE = "MLX_RANK"


def default_ranks(device: str) -> int:
    """Two ranks on a CPU with two or more cores (the element-wise work is single-threaded);
    one elsewhere (a GPU runs a whole batch at once)."""
    if device == "gpu" or (device == "default" and sys.platform == "darwin"):
        return 1
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def joined_group() -> Any:
    """This process's ring group when a launcher started it as a rank; None otherwise."""
    if RANK_VARIABLE not in os.environ:
        return None
    import mlx.core as mx

    return mx.distributed.init(backend="ring", strict=True)


def is_leader() -> bool:
    return os.environ.get(RANK_VARIABLE, "0") == "0"


def _free_loopback_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(ranks: int, argv: list[str]) -> int:
    """Runs `python -m training argv` as `ranks` processes; the exit status is the first
    failing rank's, or 0. A failing rank stops the others (a ring with a missing peer would
    wait forever)."""
    with tempfile.TemporaryDirectory(prefix="tandem-ranks-") as scratch:
        hostfile = Path(scratch) / "hosts.json"
        ports = _free_loopback_ports(ranks)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
        children = []
        for rank in range(ranks):
            env = {
                **os.environ,
                RANK_VARIABLE: str(rank),
                "MLX_HOSTFILE": str(hostfile),
                # One core each: BLAS threads would compete with the other rank.
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable, "-m", "training", *argv]
            children.append(subprocess.Popen(command, env=env))
        try:
            return _wait_all(children)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()


def _wait_all(children: list[subprocess.Popen[bytes]]) -> int:
    pending = list(children)
    while pending:
        for child in list(pending):
            try:
                code = child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            pending.remove(child)
            if code != 0:
                for other in pending:
                    other.send_signal(signal.SIGTERM)
                return code
    return 0
