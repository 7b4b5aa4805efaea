"""The clients as a user elsewhere installs them: the `tandem-client` wheel into a fresh
virtualenv (no servers, no mlx), then `tandem generate` against a running engine."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import venv
import zipfile
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
    sdist, wheel = map(Path, built.stdout.strip().splitlines()[-2:])
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert "tandem_client-0.1.0/tandem_wire/pb/engine_pb2.py" in names
    assert not any("engine_service" in n or "store_service" in n for n in names)
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


def test_the_server_sdist_carries_what_builds_its_stubs(tmp_path: Path) -> None:
    """setup.py generates the gRPC stubs at build time: the protos and the script must travel
    in the sdist, and a wheel built from that sdist holds the stubs."""
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    with tarfile.open(tmp_path / "tandem-0.1.0.tar.gz") as archive:
        names = set(archive.getnames())
    for wanted in ("protos/tandem/v1/engine.proto", "scripts/gen_protos.py", "setup.py"):
        assert f"tandem-0.1.0/{wanted}" in names
    assert (
        "tandem-0.1.0/engine_service/model/default_model/trained/tandem-tiny.safetensors" in names
    )
    with zipfile.ZipFile(tmp_path / "tandem-0.1.0-py3-none-any.whl") as wheel:
        inside = set(wheel.namelist())
    assert {"tandem_wire/pb/engine_pb2.py", "tandem_wire/pb/store_pb2_grpc.py"} <= inside
    assert "engine_service/model/default_model/trained/tandem-tiny.safetensors" in inside
    assert "engine_service/model/default_model/trained/SHA256SUMS" in inside
