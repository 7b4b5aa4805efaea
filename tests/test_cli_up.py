"""`tandem up` (what `make run` runs): the servers start with the gateway in front, a demo
streams, a server that dies comes back, and everything stops on Ctrl-C whatever became of
the output."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from tandem_client import EngineClient
from tests.servers import ROOT, ServiceProcess, child_pids
from tests.test_gateway_failover import (
    SEED,
    STREAMS,
    TOKENS,
    start_streams,
    stream_problems,
    uninterrupted_runs,
)


def _up(tmp_path: Path, engine_data_dir: Path) -> list[str]:
    """`tandem up` on free ports in a data directory of this test's own, reusing the models
    the session's engine built (so the test doesn't rebuild them)."""
    data_dir = tmp_path / "up"
    if not data_dir.exists():
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
        *("--store-port", "0", "--engine-port", "0"),
        *("--gateway-grpc-port", "0", "--gateway-http-port", "0"),
    ]


class Up:
    """A running `tandem up`: its output lines as they come (a reader thread), its servers."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.lines: queue.Queue[str | None] = queue.Queue()  # None: its output ended
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def rest(self, timeout: float = 60.0) -> list[str]:
        """The lines left once its output ended."""
        lines = []
        while (line := self.lines.get(timeout=timeout)) is not None:
            lines.append(line)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return [line for line in lines if line.strip()]

    def until(self, prefix: str, timeout: float = 180.0) -> str:
        """Reads lines until one starts with prefix; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, ("tandem up ended", self.seen)
            self.seen.append(line)
            if line.startswith(prefix):
                return line


def _servers(up_pid: int) -> dict[int, str]:
    """pid -> module of every server `tandem up` started, and the engines' cores."""
    found = {}
    for pid in child_pids(up_pid):
        found[pid] = _cmdline(pid).split(" -m ")[-1].split()[0]
        for core in child_pids(pid):
            found[core] = "engine core"
    return found


def test_a_dead_reader_then_ctrl_c_stops_everything_and_up_starts_again(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    """`make run | tee run.log`, then Ctrl-C: tee dies first. `tandem up` must still stop
    every process it started; the next `tandem up` on the same data directory starts, with
    the gateway in front by default, and streams its demo."""
    proc = subprocess.Popen(
        [*_up(tmp_path, engine_data_dir), "--demo-tokens", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:  # read here, not on a thread: closing it below must not wait
        if line.startswith("serving;"):
            break
    started = _servers(proc.pid)
    assert sorted(started.values()) == [
        "engine core",
        "engine_service",
        "gateway_service",
        "store_service",
    ]
    proc.stdout.close()  # the reader dies: every later line meets a broken pipe
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0, proc.stderr.read()
    proc.stderr.close()
    _wait_for("every process gone", lambda: all(_state(p) in ("Z", "") for p in started))

    again = subprocess.run(
        [*_up(tmp_path, engine_data_dir), "--exit-after-demo", "--demo-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[0].startswith("starting the store and the engine")
    assert lines[1].startswith("store  listening on 127.0.0.1:")
    assert lines[2].startswith("engine listening on 127.0.0.1:")
    assert lines[3].startswith("gateway grpc listening on 127.0.0.1:")
    assert lines[4].startswith("gateway http listening on http://127.0.0.1:")
    assert lines[5].startswith("model  tandem-tiny@sha256:")
    assert "trained here" in lines[6] and "--model mlx-community/" in lines[7]
    assert lines[8].startswith("demo   def read_lines(path):")
    assert "[length: 12 tokens" in again.stdout
    assert lines[-1] == "stopped (gateway exit 0, engine exit 0, store exit 0)"


def test_an_engine_killed_under_streams_comes_back_and_nothing_else_stops(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    """`tandem up --engines 2`: SIGKILL the busier engine while 8 streams run through the
    gateway. Every stream completes exactly; `tandem up` says so and starts the engine again
    on its address; no other process was stopped."""
    up = Up([*_up(tmp_path, engine_data_dir), "--engines", "2", "--demo-tokens", "4"])
    store_line = up.until("store  listening on ")
    engines = [up.until("engine listening on ").split()[3] for _ in range(2)]
    grpc_front = up.until("gateway grpc listening on ").split()[4]
    http_front = up.until("gateway http listening on ").split()[4]
    assert up.until("openai ").startswith(f"openai {http_front}/v1 ")
    assert "/v1/completions" in up.until("       curl -s ")
    up.until("serving;")
    assert store_line and len(set(engines)) == 2
    before = _servers(up.proc.pid)
    expected = uninterrupted_runs(grpc_front)
    at = random.Random(SEED).randint(STREAMS * 20, STREAMS * TOKENS * 7 // 10)
    streams, threads = start_streams(SimpleNamespace(grpc=grpc_front, http=http_front), at)
    running = []
    for address in engines:
        with EngineClient(address) as c:
            running.append(c.stats().running)
    victim = engines[max(range(2), key=lambda i: running[i])]
    victim_pid, victim_core = _engines_by_address(tmp_path / "up", 2)[victim]
    os.kill(victim_pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    problems = stream_problems(streams, expected)
    assert not problems, problems
    said = up.until("engine")
    assert f"on {victim} exited (status -9); restarting in 1 s" in said
    assert up.until("engine").endswith(f"back on {victim}")
    with EngineClient(victim) as back:
        assert back.model_info().name == "tandem-tiny"
    # Nothing else was stopped: every other server and core is the same process as before.
    others = [pid for pid in before if pid not in (victim_pid, victim_core)]
    assert len(others) == len(before) - 2
    assert all(_state(pid) not in ("Z", "") for pid in others)
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(120) == 0
    assert up.rest()[-1] == (  # gateway, two engines, store
        "stopped (gateway exit 0, engine exit 0, engine exit 0, store exit 0)"
    )


def _up_fronted(
    tmp_path: Path, engine_data_dir: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    """`tandem up` with `flags` through its 8-token demo."""
    result = subprocess.run(
        [*_up(tmp_path, engine_data_dir), *flags, "--exit-after-demo", "--demo-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result


def _engines_by_address(data_dir: Path, count: int) -> dict[str, tuple[int, int]]:
    """address -> (front pid, core pid) of `tandem up --engines N`'s engines, from the line
    each logs once serving (their command lines say port 0: the port was picked on start)."""
    found = {}
    for i in range(1, count + 1):
        text = (data_dir / f"engine-{i}.log").read_text()
        address, core = re.findall(r"serving \S+ on (\S+) \(core pid (\d+)\)", text)[-1]
        ppid = int(Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()[1])
        found[address] = (ppid, int(core))
    return found


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
        [*_up(tmp_path, engine_data_dir), "--no-gateway", "--demo-tokens", "4"],
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
