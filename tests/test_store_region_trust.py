"""The region plane acts with the caller's rights, never the store's (issue 32, item 1;
store_service/regions.py, docs/security.md "Same-host regions"), against real store
processes: a file the caller cannot open cannot become its region, a caller that truncates
its region leaves the store serving, a ticket is its principal's alone, regions are counted
per principal."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_client.errors import TandemError
from tandem_client.regions import SharedRegion, hand_over
from tandem_wire.auth import token_sha256
from tandem_wire.pb import store_pb2
from tests.servers import ROOT, ServiceProcess, start_store

NOBODY = 65534
MiB = 1 << 20


def _auth_file(tmp_path: Path, names: list[str]) -> tuple[Path, dict[str, str]]:
    tokens = {n: secrets.token_urlsafe(24) for n in names}
    principals = [
        {"name": n, "token_sha256": token_sha256(t), "namespaces": ["*"], "roles": ["store"]}
        for n, t in tokens.items()
    ]
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"principals": principals}))
    return path, tokens


def _record(key: bytes, nbytes: int) -> Checkpoint:
    data = secrets.token_bytes(64 << 10) * (nbytes // (64 << 10))
    return Checkpoint(key=key, kind="object", tensors=[Tensor("t", "uint8", (len(data),), data)])


# Runs as `nobody` (everything imported first: the interpreter may live where nobody reads).
_FOREIGN_CALLER = """
import json, os, sys
sys.path[:0] = sys.argv[4:]
import grpc
from tandem_client import StoreClient
from tandem_client.bulk import RegionPut, put_messages
from tandem_client.records import Checkpoint, Tensor
from tandem_wire.pb import store_pb2
address, token, path = sys.argv[1], sys.argv[2], sys.argv[3]
# grpc imports its channel modules on first use: load them while the checkout (perhaps 0700)
# is still readable.
grpc.insecure_channel(address).close()
os.setgid(65534)
os.setuid(65534)
name, size = os.path.basename(path), os.stat(path).st_size
seen = {}
try:
    os.close(os.open(path, os.O_RDWR))
    seen["open"] = "opened"
except PermissionError:
    seen["open"] = "denied"

def code(call):
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name

with StoreClient(address, token=token) as client:
    stub = client._store
    by_name = store_pb2.RegisterRegionRequest(name=name, size_bytes=size, proof=bytes(32))
    seen["by_name"] = code(lambda: stub.RegisterRegion(by_name))
    plain = store_pb2.RegisterRegionRequest(name=name, size_bytes=size)
    seen["ticket"] = bool(stub.RegisterRegion(plain).ticket)
    get = store_pb2.GetRequest(key=b"known", region=name)
    seen["get"] = code(lambda: list(stub.Get(get)))
    data = b"x" * 4096
    mine = Checkpoint(key=b"mine", kind="object", tensors=[Tensor("t", "uint8", (4096,), data)])
    put = put_messages(mine, False, 0, "", 1 << 20, RegionPut(name, [0]))
    seen["put"] = code(lambda: client._put(iter(list(put))))
print(json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "auth"])
def test_a_foreign_0600_file_registered_as_a_region_is_refused(tmp_path: Path, auth: bool) -> None:
    """A caller running as nobody names a root-owned 0600 file in /dev/shm whose first 32
    bytes are zeros (the old proof): it cannot open it, so it has no fd to hand over; the
    store opens nothing by name, reads nothing out of it and writes nothing into it."""
    token, args = "", []
    if auth:
        auth_path, tokens = _auth_file(tmp_path, ["intruder"])
        token, args = tokens["intruder"], ["--auth-file", str(auth_path)]
    secret = bytes(32) + secrets.token_bytes(4 * MiB - 32)
    foreign = Path("/dev/shm") / f"tandem-foreign-{secrets.token_hex(6)}"
    foreign.write_bytes(secret)
    os.chmod(foreign, 0o600)
    store = start_store(tmp_path / "store", *args)
    try:
        with StoreClient(store.address, token=token) as owner:
            owner.put(_record(b"known", MiB))
        child = subprocess.run(
            [sys.executable, "-c", _FOREIGN_CALLER, store.address, token, str(foreign)]
            + [str(ROOT), str(ROOT / "clients" / "python")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        seen = json.loads(child.stdout)
        assert seen["open"] == "denied"
        assert seen["by_name"] == "FAILED_PRECONDITION"  # the store opens no region by name
        assert seen["ticket"]  # ...a name alone is a ticket for a fd it cannot hand over
        assert seen["get"] == "NOT_FOUND" and seen["put"] == "NOT_FOUND"
        assert foreign.read_bytes() == secret
        _serving(store)
    finally:
        store.stop()
        foreign.unlink(missing_ok=True)


def _serving(store: ServiceProcess) -> None:
    assert store.proc is not None and store.proc.poll() is None, "the store died"
    with grpc.insecure_channel(store.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _unsealed(size: int) -> int:
    """A memfd without seals: its owner can truncate it at will."""
    fd = os.memfd_create("tandem-unsealed", os.MFD_CLOEXEC)
    os.posix_fallocate(fd, 0, size)
    return fd


def test_a_truncating_caller_leaves_the_store_serving(tmp_path: Path) -> None:
    """A sealed region cannot be truncated at all; an unsealed one the store only ever
    reads and writes with pread/pwrite, so a caller that truncates it mid-Get or mid-Put
    gets FAILED_PRECONDITION (or, mid-copy, its bytes) and the store goes on serving."""
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client:
            record = _record(b"big", 24 * MiB)
            client.put(record)
            with SharedRegion(MiB) as sealed:
                with pytest.raises(PermissionError):
                    os.ftruncate(sealed.fd, 0)

            size = 32 * MiB
            region = SharedRegion(size, fd=_unsealed(size))
            try:
                client.register_region(region)
                # Truncated before the Get: the store's writes cannot fault, and it notices.
                os.ftruncate(region.fd, 0)
                with pytest.raises(TandemError) as get:
                    client.get_into(b"big", region)
                assert get.value.code == grpc.StatusCode.FAILED_PRECONDITION
                _serving(store)
                # Truncated before a Put out of it: a short read, nothing stored.
                os.ftruncate(region.fd, 0)
                with pytest.raises(grpc.RpcError) as put:
                    small = _record(b"from-region", MiB)
                    client._put(iter(_region_put(small, region.name)))
                assert put.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                _serving(store)
                # Truncated while a progressive Get copies into it: whichever the race.
                os.ftruncate(region.fd, size)
                client.attach_region(region, slots=1)
                got, hold = client.get_held(b"big", size_hint=24 * MiB, progressive=True)
                os.ftruncate(region.fd, 0)
                assert hold is not None and hold.arrival is not None
                try:
                    hold.arrival.wait(hold.arrival.total, timeout=60)
                except TandemError as exc:
                    assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
                del got
                hold.release()
                client.detach_region()
            finally:
                region.close()
            _serving(store)
            assert bytes(client.get(b"big").tensors[0].data) == bytes(record.tensors[0].data)
    finally:
        store.stop()


def _region_put(record: Checkpoint, region: str) -> list[object]:
    from tandem_client.bulk import RegionPut, put_messages

    return list(put_messages(record, False, 0, "", MiB, RegionPut(region, [0])))


def test_a_region_ticket_is_its_principals_alone(tmp_path: Path) -> None:
    auth_path, tokens = _auth_file(tmp_path, ["a", "b"])
    store = start_store(tmp_path / "store", "--auth-file", str(auth_path))
    try:
        with (
            StoreClient(store.address, token=tokens["a"]) as a,
            StoreClient(store.address, token=tokens["b"]) as b,
            SharedRegion(MiB) as region,
        ):
            request = store_pb2.RegisterRegionRequest(name=region.name, size_bytes=region.size)
            issued = a._store.RegisterRegion(request)
            claim = store_pb2.RegisterRegionRequest(
                name=region.name, size_bytes=region.size, ticket=issued.ticket
            )
            with pytest.raises(grpc.RpcError) as early:  # no fd handed over yet
                a._store.RegisterRegion(claim)
            assert early.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            hand_over(issued.region_socket, issued.ticket, region.fd)
            with pytest.raises(TandemError) as again:  # a ticket takes one fd
                hand_over(issued.region_socket, issued.ticket, region.fd)
            assert again.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as stolen:
                b._store.RegisterRegion(claim)
            assert stolen.value.code() == grpc.StatusCode.PERMISSION_DENIED
            lease = a._store.RegisterRegion(claim)
            assert lease.registration and lease.expires_at_unix_ms
            with pytest.raises(grpc.RpcError) as used:  # redeemed: gone
                a._store.RegisterRegion(claim)
            assert used.value.code() == grpc.StatusCode.NOT_FOUND
            a.put(_record(b"k", MiB))
            assert a.get_into(b"k", region).payload_bytes == MiB
            with pytest.raises(TandemError) as foreign:  # b's regions are b's alone
                b.get_into(b"k", region)
            assert foreign.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        store.stop()


def test_regions_are_counted_per_principal_and_in_all(tmp_path: Path) -> None:
    auth_path, tokens = _auth_file(tmp_path, ["a", "b"])
    store = start_store(
        tmp_path / "store",
        "--auth-file",
        str(auth_path),
        "--max-regions-per-principal",
        "2",
        "--max-regions",
        "3",
    )
    regions = [SharedRegion(64 << 10) for _ in range(4)]
    try:
        with (
            StoreClient(store.address, token=tokens["a"]) as a,
            StoreClient(store.address, token=tokens["b"]) as b,
        ):
            a.register_region(regions[0])
            a.register_region(regions[1])
            regions[1].registration = 0
            a.register_region(regions[1])  # the same name again replaces, counts once
            with pytest.raises(TandemError) as mine:
                a.register_region(regions[2])
            assert mine.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-regions-per-principal" in str(mine.value)
            b.register_region(regions[2])
            with pytest.raises(TandemError) as everyone:
                b.register_region(regions[3])
            assert everyone.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-regions" in str(everyone.value)
            a.unregister_region(regions[0])
            b.register_region(regions[3])  # room again
    finally:
        for region in regions:
            region.close()
        store.stop()
