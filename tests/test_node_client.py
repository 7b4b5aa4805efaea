"""The Node.js client (clients/node) against real services: any gRPC language can use Tandem."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ROOT, ServiceProcess, store_and_engine

NODE_DIR = ROOT / "clients" / "node"


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path, engine: ServiceProcess
) -> Iterator[dict[str, str]]:
    yield from store_and_engine(tmp_path_factory.mktemp("node"), engine_data_dir)


def test_node_client_suite_passes(services: dict[str, str]) -> None:
    node = shutil.which("node")
    assert node, "Node.js is required (make test installs the client's packages with npm ci)"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists(), "run `make test`"
    result = subprocess.run(
        [node, "--test", "test/"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **services},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "# pass 4" in result.stdout and "# fail 0" in result.stdout


def test_node_demo_streams_and_lists(services: dict[str, str]) -> None:
    result = subprocess.run(
        [shutil.which("node") or "node", "demo.js", "Hi"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **services},
    )
    assert result.returncode == 0, result.stderr
    assert "[FINISH_REASON_LENGTH: 24 tokens]" in result.stdout
    assert result.stdout.rstrip().endswith("checkpoints")
