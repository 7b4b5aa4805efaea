"""`tandem up` (what `make run` runs): both services start, a demo streams, both stop cleanly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.servers import ROOT, ServiceProcess, child_pids


def _up(tmp_path: Path, engine_data_dir: Path) -> list[str]:
    """`tandem up` on free ports in a data directory of this test's own, reusing the models
    the session's engine built (so the test doesn't rebuild them)."""
    data_dir = tmp_path / "up"
    data_dir.mkdir()
    (data_dir / "models").symlink_to(engine_data_dir / "models", target_is_directory=True)
    return [
        sys.executable,
        "-u",
        "-m",
        "tandem_client.cli",
        "up",
        "--data-dir",
        str(data_dir),
        "--store-port",
        "0",
        "--engine-port",
        "0",
    ]


def test_tandem_up_streams_a_demo_and_stops_cleanly(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    result = subprocess.run(
        [
            *_up(tmp_path, engine_data_dir),
            "--exit-after-demo",
            "--demo-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("starting the store and the engine")
    assert lines[1].startswith("store  listening on 127.0.0.1:")
    assert lines[2].startswith("engine listening on 127.0.0.1:")
    assert lines[3].startswith("model  tandem-tiny@sha256:")
    assert "trained here" in lines[4] and "--model mlx-community/" in lines[5]
    assert lines[6].startswith("demo   def read_lines(path):")
    assert "[length: 12 tokens" in result.stdout
    assert lines[-1] == "stopped (engine exit 0, store exit 0)"


def _up_fronted(
    tmp_path: Path, engine_data_dir: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    """`tandem up` with a gateway in front (free ports), through its 8-token demo."""
    result = subprocess.run(
        [*_up(tmp_path, engine_data_dir), *flags]
        + ["--gateway-grpc-port", "0", "--gateway-http-port", "0"]
        + ["--exit-after-demo", "--demo-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_tandem_up_with_engines_starts_the_gateway_in_front(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    result = _up_fronted(tmp_path, engine_data_dir, "--engines", "2")
    lines = result.stdout.splitlines()
    assert lines[1].startswith("store  listening on 127.0.0.1:")
    assert lines[2].startswith("engine listening on 127.0.0.1:")
    assert lines[3].startswith("engine listening on 127.0.0.1:")
    assert lines[4].startswith("gateway grpc listening on 127.0.0.1:")
    assert lines[5].startswith("gateway http listening on http://127.0.0.1:")
    assert "[length: 8 tokens" in result.stdout
    assert lines[-1] == ("stopped (gateway exit 0, engine exit 0, engine exit 0, store exit 0)")


def test_tandem_up_with_nodes_shares_a_valkey_cluster(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    """Two nodes (a store and an engine each) on a local Valkey cluster, a gateway in front;
    the stores log where their tier is, never its password."""
    result = _up_fronted(tmp_path, engine_data_dir, "--nodes", "2")
    lines = result.stdout.splitlines()
    assert lines[2].startswith("valkey cluster 127.0.0.1:")
    assert [line.split(" listening")[0] for line in lines[3:9]] == [
        "store ",
        "store ",
        "engine",
        "engine",
        "gateway grpc",
        "gateway http",
    ]
    assert "[length: 8 tokens" in result.stdout
    assert lines[-1] == (
        "stopped (gateway exit 0, engine exit 0, engine exit 0, store exit 0, store exit 0)"
    )
    password = (tmp_path / "up" / "valkey" / "password").read_text()
    for node in ("node-1", "node-2"):
        log = (tmp_path / "up" / node / "store.log").read_text()
        assert "shared tier: valkey://tandem@127.0.0.1:" in log
        assert password not in log


def _state(pid: int) -> str:
    """A process's state letter (Linux /proc); '' once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_for(what: str, done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        time.sleep(0.01)


def test_ctrl_c_shows_the_drain_and_a_second_stops_at_once(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    proc = subprocess.Popen(
        [
            *_up(tmp_path, engine_data_dir),
            "--demo-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving;"):
            break
    services = child_pids(proc.pid)
    (engine_pid,) = [pid for pid in services if "engine_service" in _cmdline(pid)]
    (store_pid,) = [pid for pid in services if "store_service" in _cmdline(pid)]
    every_process = [engine_pid, store_pid, *child_pids(engine_pid)]  # the engine's core too
    proc.send_signal(signal.SIGINT)
    drain = proc.stdout.readline()
    assert drain.startswith("draining (0 running, 0 queued;"), lines + [drain]
    assert "Ctrl-C again stops at once" in drain
    # `tandem up` sends the engine its SIGTERM only once a second Ctrl-C kills: the engine's
    # log saying it drains shows the second Ctrl-C is now that one.
    engine_log = tmp_path / "up" / "engine.log"
    _wait_for("the engine draining", lambda: "draining:" in engine_log.read_text())
    # Held mid-drain, the engine can end only by being killed: without the second Ctrl-C
    # `tandem up` would wait its 30 s for it, kill it alone, then stop the store with SIGTERM.
    with contextlib.suppress(ProcessLookupError):
        os.kill(engine_pid, signal.SIGSTOP)
    _wait_for("the engine held or gone", lambda: _state(engine_pid) in ("T", "t", "Z", ""))
    held = _state(engine_pid) in ("T", "t")
    proc.send_signal(signal.SIGINT)  # the second: no waiting for graces
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("stopped (engine exit")
    if held:  # both killed at once: the engine it waited for, the store it had not stopped
        assert last == "stopped (engine exit -9, store exit -9)"
    else:  # the engine had ended its drain before it could be held (seldom)
        assert re.fullmatch(r"stopped \(engine exit 0, store exit (0|-9)\)", last), last
    # Nothing left running (a zombie is an exit not yet reaped).
    _wait_for("every process gone", lambda: all(_state(p) in ("Z", "") for p in every_process))
