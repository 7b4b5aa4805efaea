"""The `tandem` command line.

tandem up [--model M]          start a store and an engine, stream a demo, serve until Ctrl-C
tandem generate "prompt"       stream a generation from a running engine
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem_client.engine_client import EngineClient
from tandem_client.errors import TandemError

DEMO_PROMPT = [{"role": "user", "content": "Tell me about Tandem."}]


class _Service:
    """A service subprocess whose first stdout line names its address."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        self.module = module
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
        line = self.proc.stdout.readline().strip()
        self.proc.stdout.close()
        if " listening on " not in line:
            self.stop()
            # Its last words say why (e.g. "cannot listen on ...: the address is in use").
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            reason = lines[-1] if lines else "no output"
            raise TandemError(f"{module} did not start: {reason} (log: {log})")
        self.address = line.rsplit(" ", 1)[-1]

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
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    host = args.host
    store = _Service(
        "store_service",
        ["--data-dir", str(data_dir / "store"), "--listen", f"{host}:{args.store_port}"],
        data_dir / "store.log",
    )
    engine_args = [
        "--data-dir",
        str(data_dir),
        "--listen",
        f"{host}:{args.engine_port}",
        "--store",
        store.address,
    ]
    if args.model:
        engine_args += ["--model", args.model]
    try:
        engine = _Service("engine_service", engine_args, data_dir / "engine.log")
    except TandemError:
        store.stop()
        raise
    print(f"store  listening on {store.address}   (log: {data_dir / 'store.log'})")
    print(f"engine listening on {engine.address}   (log: {data_dir / 'engine.log'})")
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        with EngineClient(engine.address) as client:
            _wait_ready(client)
            info = client.model_info()
            print(f"model  {info.model_id}  ({info.model_type}, {info.dtype}, BLAS {info.blas})")
            print(f"demo   {DEMO_PROMPT[0]['content']}\n       ", end="", flush=True)
            final = None
            for chunk in client.stream(
                DEMO_PROMPT, max_tokens=args.demo_tokens, temperature=0.7, seed=1
            ):
                print(chunk.text, end="", flush=True)
                final = chunk
            if final is not None and final.usage is not None:
                u = final.usage
                print(
                    f"\n       [{final.finish_reason}: {u.generated_tokens} tokens, "
                    f"ttft {u.ttft_seconds * 1e3:.0f} ms, {u.decode_tokens_per_second:.0f} tok/s]"
                )
        if args.exit_after_demo:
            return 0
        print("serving; Ctrl-C stops both", flush=True)
        while not stop["now"]:
            if store.proc.poll() is not None or engine.proc.poll() is not None:
                print("a service exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        codes = engine.stop(), store.stop()
        print(f"stopped (engine exit {codes[0]}, store exit {codes[1]})")


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
    up.add_argument("--engine-port", type=int, default=50051)
    up.add_argument("--demo-tokens", type=int, default=48)
    up.add_argument("--exit-after-demo", action="store_true")
    up.set_defaults(func=cmd_up)
