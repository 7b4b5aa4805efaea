"""`tandem-store verify` and `salvage`: what an operator runs after a disk fault."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from store_service.errors import NotFound
from tests.conftest import flip_stored_byte, make_checkpoint
from tests.servers import InProcessStore, run_module
from tests.test_store_domain import open_store, payload, put
from tests.test_store_integrity import flip_in_file


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("store_service", *args)


def test_verify_finds_the_damage_and_salvage_copies_what_verifies(tmp_path: Path) -> None:
    data = tmp_path / "store"
    core = open_store(data)
    healthy = make_checkpoint(b"healthy", {"a_int8": 9000, "b_bf16": 4000})
    put(core, healthy)
    put(core, make_checkpoint(b"bad-header", {"t_int8": 3000}, metadata={"m": "MARKER-h-9"}))
    put(core, make_checkpoint(b"bad-chunk", {"t_int8": 3000}))
    core.close()
    clean = _tool("verify", "--data-dir", str(data))
    assert clean.returncode == 0 and "3 records checked: 3 healthy, 0 damaged" in clean.stdout
    assert flip_in_file(data / "data.mdb", b"MARKER-h-9") >= 1
    # Chunks in key order: record ids 1 (healthy: 3 chunks of 4 KiB), 2, then 3 (bad-chunk).
    flip_stored_byte(data, chunk=-1, at=10)
    found = _tool("verify", "--data-dir", str(data))
    assert found.returncode == 1, found.stderr
    assert found.stdout.count("damaged headers") == 2, found.stdout
    assert "failed its checksum" in found.stdout
    assert "3 records checked: 1 healthy, 2 damaged" in found.stdout
    copied = _tool("salvage", "--data-dir", str(data), "--to", str(tmp_path / "new"))
    assert copied.returncode == 0, copied.stderr
    assert "1 copied, 2 damaged" in copied.stdout
    fresh = open_store(tmp_path / "new")
    try:
        assert payload(fresh, b"healthy") == b"".join(bytes(t.data) for t in healthy.tensors)
        for key in (b"bad-header", b"bad-chunk"):
            with pytest.raises(NotFound):
                fresh.open_record("", key)
    finally:
        fresh.close()
    again = _tool("salvage", "--data-dir", str(data), "--to", str(tmp_path / "new"))
    assert again.returncode == 2 and "already holds a store" in again.stderr


def test_verify_refuses_a_running_store(tmp_path: Path) -> None:
    running = InProcessStore(tmp_path / "live")
    try:
        busy = _tool("verify", "--data-dir", str(tmp_path / "live"))
        assert busy.returncode == 2 and "stop it first" in busy.stderr
    finally:
        running.stop()
