"""Every Python code block in README.md and docs/ runs as written, against a real store, an
engine and a gateway (their addresses put in place of the documented defaults)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ROOT, GatewayProcess, InProcessStore, ServiceProcess, start_engine

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCKS = [
    pytest.param(block, id=f"{path.name}:{n}")
    for path in DOCS
    for n, block in enumerate(BLOCK.findall(path.read_text()), 1)
]


@pytest.fixture(scope="module")
def addresses(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("docs")
    store = InProcessStore(root / "store")
    engine: ServiceProcess | None = None
    gateway: GatewayProcess | None = None
    try:
        engine = start_engine(engine_data_dir, "--store", store.address, log_dir=root)
        gateway = GatewayProcess([engine.address], root / "gateway.log")
        gateway.wait_engines(1)
        yield {
            "127.0.0.1:50051": engine.address,
            "127.0.0.1:50052": engine.address,
            "127.0.0.1:50061": store.address,
            "http://127.0.0.1:8000": gateway.http,
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
