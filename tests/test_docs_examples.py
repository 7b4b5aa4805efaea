"""Every Python and shell code block in README.md and docs/ runs as written, against a real
store, an engine and a gateway (their addresses put in place of the documented defaults).

Shell blocks (```sh) run command by command. A server command (tandem-engine, tandem-store,
tandem-gateway) is started on free ports, must print its listening line, and must stop with
exit 0 on SIGTERM; any other command must exit 0. A block preceded by `<!-- not run: why -->`
is one this suite cannot run (the set-up commands themselves, benchmarks, apt): the why says
what runs it instead. Blocks of prose-like synopses are ```text, not code.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_service.model.default_model import ensure_model
from engine_service.transformers_import import cache_dir
from tests.servers import ROOT, GatewayProcess, InProcessStore, ServiceProcess, start_engine

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCKS = [
    pytest.param(block, id=f"{path.name}:{n}")
    for path in DOCS
    for n, block in enumerate(BLOCK.findall(path.read_text()), 1)
]
SHELL_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")


def _shell_blocks() -> tuple[list[Any], list[str]]:
    run: list[Any] = []
    not_run: list[str] = []
    for path in DOCS:
        text = path.read_text()
        # Each block with the line before it: a `<!-- not run: ... -->`, or anything else.
        for n, match in enumerate(re.finditer(r"^(.*)\n```sh\n", text, re.M), 1):
            body = text[match.end(0) : text.index("\n```", match.end(0))] + "\n"
            reason = SHELL_NOT_RUN.match(match.group(1))
            if reason:
                not_run.append(reason.group(1))
            else:
                run.append(pytest.param(body, id=f"{path.name}:sh{n}"))
    return run, not_run


SHELL_BLOCKS, SHELL_NOT_RUN_REASONS = _shell_blocks()
SERVERS = {"tandem-engine", "tandem-gateway", "tandem-store"}
BIN = Path(sys.executable).parent  # the console scripts of this install


@pytest.fixture(scope="module")
def addresses(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("docs")
    store = InProcessStore(root / "store")
    engine: ServiceProcess | None = None
    gateway: GatewayProcess | None = None
    try:
        engine = start_engine(
            engine_data_dir,
            "--store",
            store.address,
            "--draft-model",
            "tandem-tiny-draft",
            log_dir=root,
        )
        gateway = GatewayProcess([engine.address], root / "gateway.log")
        gateway.wait_engines(1)
        yield {
            "127.0.0.1:50051": engine.address,
            "127.0.0.1:50052": engine.address,
            "127.0.0.1:50061": store.address,
            "http://127.0.0.1:8000": gateway.http,
            "localhost:8000": gateway.http.removeprefix("http://"),
            "127.0.0.1:50050": gateway.grpc,
            "store data dir": str(store.config.data_dir),
        }
    finally:
        if gateway is not None:
            gateway.stop()
        if engine is not None:
            engine.stop()
        store.stop()


def test_the_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS)
def test_a_python_block_runs(block: str, addresses: dict[str, str], tmp_path: Path) -> None:
    for documented, real in addresses.items():
        block = block.replace(documented, real)
    ran = subprocess.run(
        [sys.executable, "-c", block],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'clients' / 'python'}", "PATH": "/usr/bin:/bin"},
    )
    assert ran.returncode == 0, ran.stderr[-3000:]


def test_every_shell_block_runs_or_says_why_not() -> None:
    assert len(SHELL_BLOCKS) >= 6
    assert all(len(reason) > 10 for reason in SHELL_NOT_RUN_REASONS)


@pytest.mark.parametrize("block", SHELL_BLOCKS)
def test_a_shell_block_runs(
    block: str, addresses: dict[str, str], engine_data_dir: Path, tmp_path: Path
) -> None:
    env = {
        "PATH": f"{BIN}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TANDEM_ENGINE": addresses["127.0.0.1:50051"],
        "TANDEM_STORE": addresses["127.0.0.1:50061"],
        # As every engine the suite starts (conftest.py): the documented engines skip the
        # warm-up (a second or two each on two cores; test_engine_core.py runs one with it).
        "TANDEM_ENGINE_WARMUP": "0",
        "OPENBLAS_NUM_THREADS": "1",  # as every engine the suite starts (conftest.py)
        # HOME is the test's own: transformers' table stays where the suite keeps it.
        "TANDEM_CACHE_DIR": str(cache_dir() or tmp_path / "cache"),
    }
    for command in _commands(block):
        words = shlex.split(command, comments=True)
        if words[0] in SERVERS and words[1:2] not in (["verify"], ["salvage"]):
            _start_and_stop(words, addresses, engine_data_dir, tmp_path, env)
            continue
        for documented, real in addresses.items():
            command = command.replace(documented, real)
        store_dir = tmp_path / ".tandem" / "store"
        if ".tandem/store" in command and not store_dir.exists():
            # An offline command on the documented data dir (verify, salvage): a copy of the
            # running store's files (the tools refuse a directory a store has open).
            shutil.copytree(addresses["store data dir"], store_dir)
        ran = subprocess.run(
            ["bash", "-o", "pipefail", "-ec", command],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env=env,
        )
        assert ran.returncode == 0, f"{command}\n{ran.stdout[-2000:]}\n{ran.stderr[-2000:]}"


def _commands(block: str) -> Iterator[str]:
    """The block's commands: lines joined across trailing backslashes and open quotes."""
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if not pending.strip() or pending.endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        yield pending.replace("\\\n", " ")
        pending = ""
    assert not pending.strip(), pending


def _start_and_stop(
    words: list[str], addresses: dict[str, str], data_dir: Path, cwd: Path, env: dict[str, str]
) -> None:
    args: list[str] = []
    for flag in words:
        if args and args[-1] in ("--listen", "--http-listen", "--grpc-listen"):
            args.append("127.0.0.1:0")  # free ports: the suite's servers hold the defaults
        elif args and args[-1] == "--model" and flag.startswith("./"):
            # A local mlx model directory: the embedded one, copied where the docs point.
            shutil.copytree(ensure_model("tandem-tiny", data_dir / "models"), cwd / flag)
            args.append(flag)
        else:
            args.append(addresses.get(flag, flag))
    if args[0] != "tandem-gateway" and "--listen" not in args:
        args += ["--listen", "127.0.0.1:0"]
    if args[0] == "tandem-engine" and "--data-dir" not in args:
        args += ["--data-dir", str(data_dir)]  # the embedded models, built once a session
    proc = subprocess.Popen(
        [str(BIN / args[0]), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if " listening on " in line:
                break
        assert any(" listening on " in line for line in seen), "".join(seen)[-3000:]
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(120) == 0, "".join(seen)[-2000:] + rest[-2000:]
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_json_blocks_parse() -> None:
    blocks = [
        b
        for path in DOCS
        for b in re.findall(r"^```json\n(.*?)^```", path.read_text(), re.M | re.S)
    ]
    assert blocks
    for block in blocks:
        json.loads(block)
