"""Writes the support matrix of docs/models.md from a run of the model zoo's checks.

    .venv/bin/python scripts/model_matrix.py [ARCH ...]

Each architecture of tests/model_zoo.py is built tiny, served by the engine's core and
checked (tests/zoo_checks.py); the table between the markers in docs/models.md is replaced
with what this run measured. tests/test_model_zoo*.py check the committed table against the
same run, so the page cannot drift from what the engine does.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine_service  # noqa: E402, F401  (the BLAS set-up, before mlx loads)
from store_service.config import StoreConfig  # noqa: E402
from store_service.server import create_server  # noqa: E402
from store_service.store import CheckpointStore  # noqa: E402
from tests.model_zoo import ZOO  # noqa: E402
from tests.zoo_checks import (  # noqa: E402
    MATRIX_END,
    MATRIX_START,
    ZooRow,
    check_architecture,
    committed_rows,
    matrix_lines,
)

DOC = ROOT / "docs" / "models.md"


def main(archs: list[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="tandem-zoo-"))
    store = CheckpointStore(StoreConfig(data_dir=work / "store"))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    measured: dict[str, ZooRow] = {}
    try:
        for arch in archs or sorted(ZOO):
            print(f"checking {arch}...", flush=True)
            measured[arch] = check_architecture(
                arch, work / "models", work / "data", f"127.0.0.1:{port}"
            )
    finally:
        server.stop(None).wait()
        store.close()
    kept = committed_rows(DOC)  # architectures not run this time keep their row
    rows = [measured.get(a) or ZooRow(*kept[a]) for a in sorted(set(kept) | set(measured))]
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(MATRIX_START, 1)
    tail = rest.split(MATRIX_END, 1)[1]
    table = "\n".join(matrix_lines(rows))
    DOC.write_text(f"{head}{MATRIX_START}\n{table}\n{MATRIX_END}{tail}", encoding="utf-8")
    print(f"wrote {len(rows)} rows to {DOC}")


if __name__ == "__main__":
    main(sys.argv[1:])
