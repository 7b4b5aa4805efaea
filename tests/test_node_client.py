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
    assert "# pass 5" in result.stdout and "# fail 0" in result.stdout


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


def test_the_packed_tarball_installs_elsewhere_and_streams(
    services: dict[str, str], tmp_path: Path
) -> None:
    npm = shutil.which("npm")
    assert npm, "npm is required (make test runs npm ci)"
    packed = subprocess.run(
        [npm, "pack", "--pack-destination", str(tmp_path), "--loglevel=error"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert packed.returncode == 0, packed.stderr
    tarball = tmp_path / packed.stdout.strip().splitlines()[-1]
    listing = subprocess.run(["tar", "tzf", str(tarball)], capture_output=True, text=True)
    assert "package/protos/tandem/v1/engine.proto" in listing.stdout.split()
    assert not (NODE_DIR / "protos").exists()  # the copy went away after packing
    project = tmp_path / "elsewhere"
    project.mkdir()
    (project / "package.json").write_text('{"name": "elsewhere", "version": "1.0.0"}')
    installed = subprocess.run(
        [
            npm,
            "install",
            str(tarball),
            "--no-audit",
            "--no-fund",
            "--prefer-offline",
            "--loglevel=error",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    script = (
        'const { connect, generate } = require("tandem-client");'
        "const { engine } = connect({ engine: process.env.TANDEM_ENGINE });"
        'generate(engine, { text: "Hi", max_tokens: 6, sampling: { ignore_eos: true } })'
        ".then((r) => { console.log(r.finishReason, r.tokenIds.length); engine.close(); });"
    )
    ran = subprocess.run(
        [shutil.which("node") or "node", "-e", script],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **services},
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["FINISH_REASON_LENGTH", "6"]
