"""Every header the store serves is checked: a flipped bit in the data file (written through
the raw file, not through lmdb) is DATA_LOSS and set aside, never wrong bytes with OK; the rest
of the store is served; headers written before checksums are rewritten with one."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import lmdb
import pytest

from store_service.admin import StoreAdmin
from store_service.errors import Corrupt
from store_service.records import Lease
from tandem_client import EngineClient, StoreClient
from tandem_client.errors import DataLoss, TandemError
from tests.conftest import make_checkpoint
from tests.servers import ServiceProcess, free_port, start_engine, start_store_on
from tests.test_store_domain import open_store, payload, put


def flip_in_file(data_file: Path, marker: bytes) -> int:
    """Flips one bit of every copy of `marker` in the raw file (LMDB keeps old copies in
    freed pages); returns how many it found."""
    raw = bytearray(data_file.read_bytes())
    found, at = 0, raw.find(marker)
    while at >= 0:
        raw[at + len(marker) // 2] ^= 0x01
        found += 1
        at = raw.find(marker, at + 1)
    with open(data_file, "r+b") as f:  # in place: an open store's map sees it too
        f.write(raw)
    return found


def test_a_flipped_header_bit_is_data_loss_at_start_up_and_the_rest_is_served(
    tmp_path: Path,
) -> None:
    data = tmp_path / "store"
    core = open_store(data)
    victim = make_checkpoint(b"victim", {"t_int8": 5000}, metadata={"note": "MARKER-victim-0042"})
    healthy = make_checkpoint(b"healthy", {"t_int8": 5000})
    put(core, victim)
    put(core, healthy)
    core.close()
    assert flip_in_file(data / "data.mdb", b"MARKER-victim-0042") >= 1
    core = open_store(data)  # start-up recovery finds it
    try:
        with pytest.raises(Corrupt):
            core.open_record("", b"victim")
        assert payload(core, b"healthy") == bytes(healthy.tensors[0].data)
        stats = StoreAdmin(core).stats()
        assert stats.quarantined == 1 and stats.records == 1
    finally:
        core.close()
    # Set aside for good: a restart serves the same answers; the chunks were collected.
    core = open_store(data)
    try:
        with pytest.raises(Corrupt):
            core.open_record("", b"victim")
        assert StoreAdmin(core).stats().records == 1
    finally:
        core.close()


def test_a_header_damaged_while_serving_is_never_served(tmp_path: Path) -> None:
    data = tmp_path / "store"
    core = open_store(data)
    try:
        put(core, make_checkpoint(b"live", {"t_int8": 100}, metadata={"note": "MARKER-live-77"}))
        assert flip_in_file(data / "data.mdb", b"MARKER-live-77") >= 1
        with pytest.raises(Corrupt, match="damaged"):
            core.open_record("", b"live")
        with pytest.raises(Corrupt):  # set aside: it stays DATA_LOSS, it does not vanish
            core.open_record("", b"live")
        assert StoreAdmin(core).stats().quarantined == 1
    finally:
        core.close()


def test_headers_written_before_checksums_are_rewritten_with_one(tmp_path: Path) -> None:
    data = tmp_path / "store"
    core = open_store(data)
    old = make_checkpoint(b"old", {"t_int8": 3000})
    put(core, old)
    core.close()
    env = lmdb.open(str(data), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"headers")) as txn:
        ((key, value),) = list(txn.cursor())
        txn.put(key, b"\x01" + bytes(value)[1:-4])  # format 1: no trailing checksum
    env.close()
    core = open_store(data)
    try:
        assert payload(core, b"old") == bytes(old.tensors[0].data)
    finally:
        core.close()
    env = lmdb.open(str(data), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(b"headers", create=False)) as txn:
        ((_, value),) = list(txn.cursor())
        value = bytes(value)
    env.close()
    assert value[0] == 2 and zlib.crc32(value[:-4]) == int.from_bytes(value[-4:], "big")


def test_leases_carry_a_checksum_and_old_ones_still_read() -> None:
    lease = Lease("abc", b"\x00" * 8 + b"key", "engine/1", 1_800_000_000_000)
    raw = lease.encode()
    assert Lease.decode(b"abc", raw) == lease
    damaged = bytearray(raw)
    damaged[-1] ^= 0x01
    with pytest.raises(Corrupt):
        Lease.decode(b"abc", bytes(damaged))
    legacy = raw[5:]  # before checksums: no mark, no checksum
    assert Lease.decode(b"abc", legacy) == lease


def test_a_resume_from_a_damaged_checkpoint_is_data_loss_never_tokens(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    address = f"127.0.0.1:{port}"
    proc = start_engine(engine_data_dir, "--store", address, log_dir=tmp_path)
    request = dict(max_tokens=200, ignore_eos=True, checkpoint_interval=8, request_id="flipped")
    prompt = [(i * 31) % 1900 + 3 for i in range(40)]
    try:
        with EngineClient(proc.address) as client:
            stream = client.stream_request(client.request(prompt, **request))
            for i, _ in enumerate(stream):
                if i >= 24:
                    break
            stream.close()  # the client goes away: the checkpoint stays for a resume
            deadline = time.monotonic() + 30
            while client.stats().running:
                assert time.monotonic() < deadline, "the dropped row kept running"
                time.sleep(0.02)
            assert client.flush().durable
        with StoreClient(address) as admin:
            (manifest,) = admin.list_all(kind="generation")
            marker = admin.get(manifest.key).metadata["options"].encode()
        store.stop()
        assert flip_in_file(tmp_path / "store" / "data.mdb", marker) >= 1
        store = start_store_on(tmp_path / "store", port)
        with StoreClient(address) as admin:
            with pytest.raises(DataLoss):
                admin.get(manifest.key)
        with EngineClient(proc.address) as client:
            with pytest.raises(TandemError) as failure:
                client.generate(prompt, resume=True, **request)
            assert failure.value.code.name == "DATA_LOSS", failure.value
    finally:
        proc.stop()
        store.stop()
