"""A full disk is RESOURCE_EXHAUSTED ("disk full: N bytes free in DIR"): the store stays up and
every record stored before is intact."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_client import Checkpoint, StoreClient
from tandem_client.errors import PutManyFailed, ResourceExhausted
from tandem_client.records import PutItem
from tests.conftest import make_checkpoint, payload_crc
from tests.servers import ROOT

DISK = 24 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A 24 MiB tmpfs (tests run as root); where mounting is refused, a file-size limit on the
    store process (writes past it fail with EFBIG, as a full device's do;
    TANDEM_TEST_NO_MOUNT=1 runs that path)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.environ.get("TANDEM_TEST_NO_MOUNT") is None and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield disk, [] if mounted else ["prlimit", f"--fsize={DISK}"]
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# Records of 1 MiB stream (Put); of 128 KiB go four a call in one PutRecords message, whose
# failure says how many of the four landed.
@pytest.mark.parametrize("inline", [False, True], ids=["streamed", "inline"])
def test_a_full_disk_is_resource_exhausted_and_loses_nothing(
    small_disk: tuple[Path, list[str]], inline: bool
) -> None:
    disk, prefix = small_disk
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-u", "-m", "store_service", "--data-dir", str(disk / "s")]
        + ["--listen", "127.0.0.1:0", "--capacity-bytes", str(1 << 30)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.strip().rsplit(" ", 1)[-1]
        stored: list[Checkpoint] = []
        with StoreClient(address) as client:
            with pytest.raises(ResourceExhausted) as full:
                if inline:
                    _fill_inline(client, stored)
                else:
                    for i in range(64):  # 64 x 1 MiB > 24 MiB
                        record = make_checkpoint(f"r{i}".encode(), {"t_int8": 1 << 20})
                        client.put(record)
                        stored.append(record)
            assert "disk full" in str(full.value) and str(disk / "s") in str(full.value)
            assert len(stored) >= 4
            assert proc.poll() is None  # still up
            for record in stored:  # every acknowledged record is intact
                got = client.get(record.key)
                assert payload_crc(got) == payload_crc(record)
            assert client.stats().records == len(stored)
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


def _fill_inline(client: StoreClient, stored: list[Checkpoint]) -> None:
    """Calls of four 128 KiB records until the disk is full; raises its ResourceExhausted."""
    for call in range(64):  # 64 x 512 KiB > 24 MiB
        records = [
            make_checkpoint(f"r{call}.{i}".encode(), {"t_int8": 128 << 10}) for i in range(4)
        ]
        try:
            client.put_many([PutItem(r) for r in records])
        except PutManyFailed as failed:
            stored.extend(records[: failed.stored])
            raise failed.cause from None
        stored.extend(records)
