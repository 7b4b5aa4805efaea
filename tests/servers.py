"""Real services for tests, on port 0: the store in this process where no crash is
simulated (`InProcessStore`), and service processes found through their first line where
a crash or a signal is the point (`ServiceProcess`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from store_service.config import StoreConfig, SyncMode
from store_service.server import create_server
from store_service.store import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent


class InProcessStore:
    """A store served from this process on a free loopback port.

    Args:
        data_dir: its LMDB directory.
        settings: StoreConfig fields (capacity_bytes, chunk_bytes, sync_mode, ...).
    """

    def __init__(self, data_dir: Path, **settings: Any) -> None:
        settings.setdefault("sync_mode", SyncMode.COMMIT)
        settings.setdefault("listen", "127.0.0.1:0")
        self.config = StoreConfig(data_dir=data_dir, **settings)
        self.store = CheckpointStore(self.config)
        try:
            self.server, port, _ = create_server(
                self.store, self.config.listen, max_workers=self.config.max_workers
            )
            self.server.start()
        except BaseException:
            self.store.close()
            raise
        self.address = f"{self.config.listen.rsplit(':', 1)[0]}:{port}"

    def stop(self) -> None:
        """Stops serving (in-flight calls get a moment), then closes the store cleanly."""
        self.server.stop(grace=5).wait()
        self.store.close()


@contextmanager
def serve_store(data_dir: Path, **settings: Any) -> Iterator[InProcessStore]:
    """An InProcessStore for the duration of a with block."""
    served = InProcessStore(data_dir, **settings)
    try:
        yield served
    finally:
        served.stop()


class ServiceProcess:
    """A service run as `python -m MODULE ARGS`, listening on a free loopback port."""

    def __init__(self, module: str, args: list[str], banner: str, log_path: Path) -> None:
        self.module = module
        self.args = args
        self.banner = banner
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}  # over this process's environment
        self.address = ""
        # Root certificate to check a TLS server's health with (None: plaintext), and the
        # client certificate and key an mTLS server wants.
        self.tls_root: bytes | None = None
        self.tls_client: tuple[bytes, bytes] | None = None

    def start(self, timeout: float = 60.0, listen: str = "127.0.0.1:0") -> ServiceProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", self.module, "--listen", listen, *self.args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env=env,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        # Only the banner is read from stdout; the rest goes to the log file.
        self.proc.stdout.close()
        if self.banner not in line:
            self.proc.kill()
            self.proc.wait(10)  # reaped now, not flagged later as still running
            raise RuntimeError(
                f"{self.module} did not start: {line!r}; log: {self.log_path.read_text()[-2000:]}"
            )
        self.address = line.strip().rsplit(" ", 1)[-1]
        self._wait_serving(timeout)
        return self

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        key, cert = self.tls_client or (None, None)
        channel = (
            grpc.secure_channel(
                self.address, grpc.ssl_channel_credentials(self.tls_root, key, cert)
            )
            if self.tls_root
            else grpc.insecure_channel(self.address)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.module} not serving after {timeout}s")
                time.sleep(0.05)

    def start_on(self, port: int, timeout: float = 60.0) -> ServiceProcess:
        return self.start(timeout, listen=f"127.0.0.1:{port}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no chance to clean up."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and wait until every thread of the process is stopped (/proc): from then
        on it reads, writes and answers nothing until `thaw`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(state in "Tt" for state in thread_states(self.pid)):
            assert time.monotonic() < deadline, f"{self.module} not stopped after {timeout}s"
            time.sleep(0.005)

    def thaw(self) -> None:
        """SIGCONT: a frozen process goes on where it stopped."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_store(data_dir: Path, *extra: str, log_dir: Path | None = None) -> ServiceProcess:
    log_dir = log_dir or data_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"store-{data_dir.name}.log"
    return ServiceProcess(
        "store_service",
        ["--data-dir", str(data_dir), *extra],
        "tandem-store listening on",
        log_path,
    ).start()


def start_engine(
    data_dir: Path,
    *extra: str,
    log_dir: Path | None = None,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    log_dir = log_dir or data_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = ServiceProcess(
        "engine_service",
        ["--data-dir", str(data_dir), *extra],
        "tandem-engine listening on",
        log_dir / "engine.log",
    )
    proc.env = env or {}
    return proc.start(timeout)


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is pid (Linux /proc): an engine's core."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def wait_until(check: Any, timeout: float = 60.0, what: str = "the condition") -> Any:
    """Calls `check` until it returns something true, which it returns; fails after
    `timeout` seconds. Polls briefly (5 ms to 100 ms, doubling): waits on observable state,
    never on the passing of time."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} after {timeout}s (last: {got!r})"
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of pid (Linux /proc: R, S, D, T stopped...)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def free_port() -> int:
    """A loopback port nothing listens on now (for a service that must come back on it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_store_on(data_dir: Path, port: int, *extra: str) -> ServiceProcess:
    log_dir = data_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = ServiceProcess(
        "store_service",
        ["--data-dir", str(data_dir), *extra],
        "tandem-store listening on",
        log_dir / f"store-{data_dir.name}.log",
    )
    proc.args = ["--data-dir", str(data_dir), *extra]
    return proc.start_on(port)


def store_and_engine(root: Path, engine_data_dir: Path) -> Iterator[dict[str, str]]:
    """A store and an engine using it; yields their addresses as TANDEM_* variables."""
    store = start_store(root / "store")
    engine = start_engine(engine_data_dir, "--store", store.address, log_dir=root)
    try:
        yield {"TANDEM_STORE": store.address, "TANDEM_ENGINE": engine.address}
    finally:
        engine.stop()
        store.stop()


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs `python -m module args` to completion (a command that is not a server, or one
    expected to refuse to start) and returns its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


class GatewayProcess:
    """`python -m gateway_service` on free loopback ports: its gRPC and HTTP fronts."""

    def __init__(self, engines: list[str], log_path: Path, *extra: str) -> None:
        args = [a for e in engines for a in ("--engine", e)]
        args += ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", *extra]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "gateway_service", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
            )
        assert self.proc.stdout is not None
        lines = [self.proc.stdout.readline(), self.proc.stdout.readline()]
        self.proc.stdout.close()
        if not all(" listening on " in line for line in lines):
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError(f"the gateway did not start: {lines}; {log_path.read_text()}")
        self.grpc = lines[0].strip().rsplit(" ", 1)[-1]
        self.http = "http://" + lines[1].strip().rsplit(" ", 1)[-1]

    def wait_engines(self, count: int, timeout: float = 60.0) -> None:
        """Until the gateway reports `count` engines serving (its /health)."""
        import json
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.http + "/health", timeout=2) as reply:
                    if json.load(reply)["engines"]["serving"] >= count:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not see {count} engines serving")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def generation_progress(store: Any, namespace: str | None = None) -> dict[bytes, int]:
    """Tokens each generation checkpoint in the store holds, by generation key: its record's,
    or where its chain's newest segment ends (a chain's later segments have no manifest of
    their own and carry the tokens of their own positions only, docs/checkpoints.md)."""
    from engine_service.checkpoints.chain_tokens import TOKENS_BEFORE
    from engine_service.checkpoints.generation_meta import segment_key

    where = {"namespace": namespace} if namespace is not None else {}
    segments = {r.key: r.namespace for r in store.list_all(kind="object", **where)}
    progress = {}
    for record in store.list_all(kind="generation", **where):
        keys = [k for k in (segment_key(record.key, i) for i in range(256)) if k in segments]
        ends = [record.token_count]
        for at in range(0, len(keys), 64):
            for read in store.get_headers(keys[at : at + 64], record.namespace):
                segment = read.checkpoint
                if segment is None:  # gone meanwhile
                    continue
                start = int(segment.metadata["start"]) if TOKENS_BEFORE in segment.metadata else 0
                ends.append(start + len(segment.token_ids))
        progress[record.key] = max(ends)
    return progress


def kill_after_checkpoint(
    engine_proc: ServiceProcess,
    store: Any,
    prompt: list[int],
    request: dict[str, Any],
    received_at_least: int,
    checkpoint_tokens: int,
) -> tuple[list[int], Any]:
    """Streams `request` until the client holds `received_at_least` tokens, waits until its
    generation checkpoint holds the prompt and `checkpoint_tokens` more, then SIGKILLs the
    engine. Returns the tokens received and the checkpoint as the store holds it (a
    StoreClient's `get`)."""
    from tandem_client import EngineClient

    received: list[int] = []
    engine = EngineClient(engine_proc.address)
    for chunk in engine.stream_request(engine.request(prompt, **request)):
        received.extend(chunk.token_ids)
        if len(received) >= received_at_least:
            break

    def checkpointed() -> bool:
        held = list(generation_progress(store).values())
        return bool(held) and held[0] >= len(prompt) + checkpoint_tokens

    deadline = time.monotonic() + 30
    while not checkpointed():
        assert time.monotonic() < deadline, "no generation checkpoint in 30 s"
        time.sleep(0.05)
    engine_proc.kill()
    engine.close()
    import grpc

    from tandem_client.errors import TandemError

    # A Put the engine had in flight may still commit after the kill and replace the record
    # mid-read (ABORTED, the store's answer to that): read again until one read is whole.
    deadline = time.monotonic() + 30
    while True:
        (record,) = store.list_all(kind="generation")
        try:
            return received, store.get(record.key, record.namespace)
        except TandemError as exc:
            if exc.code != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise


def resume_equals_uninterrupted(
    address: str,
    prompt: list[int],
    request: dict[str, Any],
    received: list[int],
    other_codec: dict[str, Any] | None = None,
) -> None:
    """On a fresh engine at `address`: a resume of `request` (with `other_codec` first, which
    must be NOT_FOUND: another codec is another checkpoint key) restores the whole prompt, and
    what the client received before plus the resumed tokens equal an uninterrupted run."""
    from tandem_client import EngineClient
    from tandem_client.errors import TandemError

    with EngineClient(address) as engine:
        if other_codec is not None:
            try:
                engine.generate(prompt, resume=True, **{**request, **other_codec})
            except TandemError as err:
                assert err.code == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError("a resume under another codec found a checkpoint")
        resumed = engine.generate(prompt, resume=True, tokens_held=len(received), **request)
        assert resumed.usage is not None
        assert resumed.usage.cached_prompt_tokens == len(prompt)
        full = engine.generate(prompt, **{**request, "request_id": request["request_id"] + "-ref"})
    assert len(full.token_ids) == request["max_tokens"]
    assert received + resumed.token_ids == full.token_ids
