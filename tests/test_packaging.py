"""The clients as a user elsewhere installs them: the `tandem-client` wheel into a fresh
virtualenv (no servers, no mlx), then `tandem generate` against a running engine."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

from tests.servers import ROOT, ServiceProcess


def test_the_client_wheel_alone_runs_tandem_generate(
    tmp_path: Path, engine: ServiceProcess
) -> None:
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_client_dist.py"), str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    wheel = Path(built.stdout.strip().splitlines()[-1])
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=False)  # this pip installs into it (--python): no ensurepip
    python, tandem = env_dir / "bin" / "python", env_dir / "bin" / "tandem"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr
    # Only the client: no servers, no MLX.
    absent = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print([m for m in "
            "('mlx', 'mlx_lm', 'lmdb', 'engine_service', 'store_service') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,  # not the repository, whose packages would import from the cwd
    )
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr
    ran = subprocess.run(
        [
            str(tandem),
            "generate",
            "Hello",
            "--engine",
            engine.address,
            "--max-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert len(json.loads(ran.stdout)["token_ids"]) == 4
    up = subprocess.run(
        [str(tandem), "up"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert up.returncode == 1 and "install the `tandem` distribution" in up.stderr
