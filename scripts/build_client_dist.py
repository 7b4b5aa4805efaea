"""Builds the `tandem-client` sdist and wheel: the Python clients and the `tandem` CLI with the wire
package they speak through (generated stubs included), needing grpcio and protobuf, not the
servers' stack (mlx, LMDB...).

    python scripts/build_client_dist.py OUT_DIR

The server distribution (`tandem`, pyproject.toml at the root) holds the same packages
beside the servers; this one is staged apart because one pyproject builds one distribution.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.1.0"
PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=69", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "tandem-client"
version = "{VERSION}"
description = "Python clients (sync + asyncio) and the tandem CLI for Tandem"
requires-python = ">=3.11"
dependencies = [
  "grpcio>=1.66,<2",
  "protobuf>=5.27,<8",
  "numpy>=1.26",  # same-host shared-memory reads
  "rich>=13",  # the CLI's tables
]

[project.optional-dependencies]
fast = ["isal>=1.6"]  # CRC-32 at ~9 GB/s a core (zlib otherwise)

[project.scripts]
tandem = "tandem_client.cli:main"

[tool.setuptools]
packages = ["tandem_client", "tandem_client.cli", "tandem_wire", "tandem_wire.pb"]

[tool.setuptools.package-data]
"*" = ["py.typed", "*.pyi"]
"""


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "dist").resolve()
    pb = ROOT / "tandem_wire" / "pb" / "engine_pb2.py"
    if not pb.exists():
        sys.exit("generate the stubs first: make protos")
    with tempfile.TemporaryDirectory(prefix="tandem-client-") as tmp:
        stage = Path(tmp)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(
            ROOT / "clients" / "python" / "tandem_client", stage / "tandem_client", ignore=ignore
        )
        shutil.copytree(ROOT / "tandem_wire", stage / "tandem_wire", ignore=ignore)
        (stage / "pyproject.toml").write_text(PYPROJECT)
        (stage / "README.md").write_text("tandem-client: see docs/clients.md in the repository.\n")
        # The sdist, then the wheel built from it (python -m build's default).
        subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(stage)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    print(out / f"tandem_client-{VERSION}.tar.gz")
    print(out / f"tandem_client-{VERSION}-py3-none-any.whl")


if __name__ == "__main__":
    main()
