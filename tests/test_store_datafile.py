"""A data file cut short never kills the store with a signal: it refuses to start with one
line naming the file and what to do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from store_service.datafile import check
from tests.conftest import make_checkpoint
from tests.servers import run_module
from tests.test_store_domain import open_store, put


def _start(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return run_module("store_service", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0")


def test_a_truncated_data_file_is_refused_with_a_clear_line(tmp_path: Path) -> None:
    data = tmp_path / "store"
    core = open_store(data)
    for i in range(6):
        put(core, make_checkpoint(f"r{i}".encode(), {"t_int8": 40_000}))
    core.close()
    size = (data / "data.mdb").stat().st_size
    meta = check(data / "data.mdb")
    assert meta is not None and meta.needed_bytes <= size
    for cut in (100, 4096 + 50, 8192, size // 2, size - 4096, size - 1):
        damaged = tmp_path / f"cut-{cut}"
        shutil.copytree(data, damaged)
        with open(damaged / "data.mdb", "r+b") as f:
            f.truncate(cut)
        result = _start(damaged)
        assert result.returncode == 1, (cut, result.returncode, result.stderr[-500:])
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("tandem-store: ") and "data.mdb" in last, last
        assert "truncated" in last or "not an LMDB data file" in last, last
