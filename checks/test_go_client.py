"""The Go client (clients/go), built from the protos with Debian's Go toolchain and packaged
gRPC modules, streams a Generate from a real engine. `make go-check` installs the packages
(apt) and runs this; it stays out of `make test`, which must not need them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.servers import ROOT, ServiceProcess


def test_the_go_client_streams_from_the_engine(tmp_path: Path, engine: ServiceProcess) -> None:
    binary = tmp_path / "tandem-go"
    built = subprocess.run(
        [str(ROOT / "clients" / "go" / "build.sh"), str(binary)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    ran = subprocess.run(
        [str(binary), "-engine", engine.address, "-prompt", "Hello", "-max-tokens", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "FINISH_REASON_LENGTH 7"
