"""Generate the Python gRPC stubs from protos/ into tandem_wire/pb.

Generated code is built, never committed: `make protos` and the package
build (setup.py) both run this. Imports are rewritten to be package-relative
so the stubs live inside tandem_wire instead of a top-level `tandem` package.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "tandem_wire" / "pb"


def _fix_imports(text: str) -> str:
    # Runtime modules: "from tandem.v1 import x_pb2 as ..." -> relative.
    text = re.sub(r"^from tandem\.v1 import ", "from . import ", text, flags=re.M)
    # Type stubs: "import tandem.v1.x_pb2" and its qualified uses.
    text = re.sub(r"^import tandem\.v1\.(\w+)$", r"from . import \1", text, flags=re.M)
    return re.sub(r"\btandem\.v1\.(\w+_pb2)\.", r"\1.", text)


def generate() -> None:
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    # mypy-protobuf's plugins sit beside this interpreter, which need not be on PATH.
    bindir = Path(sys.executable).parent
    plugins = [
        f"--plugin=protoc-gen-{name}={bindir / f'protoc-gen-{name}'}"
        for name in ("mypy", "mypy_grpc")
        if (bindir / f"protoc-gen-{name}").exists()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            *plugins,
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        OUT.mkdir(parents=True, exist_ok=True)
        for old in OUT.glob("*_pb2*"):
            old.unlink()
        for path in sorted((Path(tmp) / "tandem" / "v1").iterdir()):
            (OUT / path.name).write_text(_fix_imports(path.read_text()))
    (OUT / "__init__.py").write_text('"""Generated gRPC stubs (see scripts/gen_protos.py)."""\n')
    (OUT / "py.typed").touch()
    shutil.rmtree(OUT / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    generate()
