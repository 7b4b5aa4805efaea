"""The engine's own credentials are enough for its own work, and the store's answers to
oversized labels, bad region names and lost chunks (issue 32, items 4 and 5).

- A store with `--auth-file` giving the engine only the `store` role, StoreAdmin on its own
  port (`--admin-listen`): the engine's generations complete, their checkpoints are deleted
  through the data plane (`Store.Delete`), nothing of them is left pinned, and the spill
  queue counts no failure.
- `Store.Delete`, `Store.DeleteMany`, `Store.PutRecords`, `Store.GetHeaders` and
  `Store.GetRecords` stay within the caller's namespaces and need the `store` role;
  DeleteMany removes all it names or, a record being pinned, nothing.
- Free-text fields of Put, Pin, Unpin, Lookup and List are bounded (INVALID_ARGUMENT), a
  region name with a NUL byte is INVALID_ARGUMENT, a record whose chunk was lost is
  DATA_LOSS (not ABORTED, which invites a retry).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from store_service.records import StoredRecord, chunk_key, record_key
from tandem_client import EngineClient, StoreClient
from tandem_client.errors import TandemError
from tandem_client.records import PutItem
from tandem_client.regions import SharedRegion
from tandem_wire.auth import token_sha256
from tandem_wire.limits import MAX_LABEL_CHARS
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.conftest import make_checkpoint
from tests.servers import InProcessStore, free_port, serve_store, start_engine, start_store

TOKENS = {name: secrets.token_urlsafe(24) for name in ("engine", "ops", "acme", "gen")}
PRINCIPALS: dict[str, dict[str, Any]] = {
    "engine": {"namespaces": ["*"], "roles": ["store"]},  # the documented engine role
    "ops": {"namespaces": ["*"], "roles": ["admin"]},
    "acme": {"namespaces": ["acme"], "roles": ["store"]},
    "gen": {"namespaces": ["acme"], "roles": ["generate"]},
}
PROMPT = [(i * 131) % 1500 + 7 for i in range(48)]
MiB = 1 << 20


def _auth_file(path: Path) -> Path:
    principals = [
        {"name": n, "token_sha256": token_sha256(TOKENS[n]), **p} for n, p in PRINCIPALS.items()
    ]
    path.write_text(json.dumps({"principals": principals}))
    return path


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except TandemError as exc:
        assert exc.code is not None
        return exc.code
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_the_store_role_alone_completes_and_deletes_the_engines_generations(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    auth = _auth_file(tmp_path / "auth.json")
    admin_port = free_port()
    store = start_store(
        tmp_path / "store", "--auth-file", str(auth), "--admin-listen", f"127.0.0.1:{admin_port}"
    )
    admin_address = f"127.0.0.1:{admin_port}"
    try:
        # Store.Delete: the caller's own namespaces, the store role.
        with (
            StoreClient(store.address, token=TOKENS["acme"]) as acme,
            StoreClient(store.address, token=TOKENS["gen"]) as gen,
            StoreClient(store.address, token=TOKENS["engine"]) as writer,
        ):
            acme.put(make_checkpoint(b"mine", {"a_int8": 4096}, kind="object"))
            writer.put(make_checkpoint(b"theirs", {"a_int8": 4096}, kind="object", namespace="b"))
            assert _code(lambda: acme.delete(b"theirs", "b")) == grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: gen.delete(b"mine")) == grpc.StatusCode.PERMISSION_DENIED
            pinned = acme.pin(b"mine", ttl_s=600, holder="acme")
            assert _code(lambda: acme.delete(b"mine")) == grpc.StatusCode.FAILED_PRECONDITION
            assert acme.delete(b"mine", force=True) == 4096
            assert _code(lambda: acme.delete(b"mine")) == grpc.StatusCode.NOT_FOUND
            assert _code(lambda: acme.unpin(b"mine", pinned.lease_id)) == (
                grpc.StatusCode.NOT_FOUND
            )
            # Store.DeleteMany: the same rules, all or nothing; absent keys are skipped.
            for key in (b"m1", b"m2"):
                acme.put(make_checkpoint(key, {"a_int8": 1024}, kind="object"))
            assert _code(lambda: acme.delete_many([b"theirs"], "b")) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
            assert _code(lambda: gen.delete_many([b"m1"])) == grpc.StatusCode.PERMISSION_DENIED
            acme.pin(b"m2", ttl_s=600, holder="acme")
            assert _code(lambda: acme.delete_many([b"m1", b"m2"])) == (
                grpc.StatusCode.FAILED_PRECONDITION
            )
            assert acme.get(b"m1").key == b"m1"  # the refused call removed nothing
            too_many = [b"k%d" % i for i in range(4097)]
            assert _code(lambda: acme.delete_many(too_many)) == grpc.StatusCode.INVALID_ARGUMENT
            assert acme.delete_many([b"m1", b"gone", b"m2", b"m1"], force=True) == 2048
            assert _code(lambda: acme.get(b"m2")) == grpc.StatusCode.NOT_FOUND
            # Store.PutRecords (small records in one message): the same rules.
            other = PutItem(make_checkpoint(b"p1", {"a_int8": 512}, kind="object", namespace="b"))
            assert _code(lambda: acme.put_many([other])) == grpc.StatusCode.PERMISSION_DENIED
            own = PutItem(make_checkpoint(b"p2", {"a_int8": 512}, kind="object"))
            assert _code(lambda: gen.put_many([own])) == grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: writer.get(b"p1", "b")) == grpc.StatusCode.NOT_FOUND
            assert acme.put_many([own])[0].key == b"p2"
            # Store.GetHeaders: within the caller's namespaces, with the store role.
            found = acme.get_headers([b"p2", b"gone"])
            assert [h.checkpoint is not None for h in found] == [True, False]
            denied = grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: acme.get_headers([b"p1"], "b")) == denied
            assert _code(lambda: gen.get_headers([b"p2"])) == denied
            # Store.GetRecords: the same (the namespace and role are checked before the
            # region is looked up).
            read = store_pb2.RegionRead(key=b"p1", region_offset=4096, region_bytes=4096)
            theirs = store_pb2.GetRecordsRequest(namespace="b", region="r", reads=[read])
            assert _code(lambda: acme._store.GetRecords(theirs)) == denied
            ours = store_pb2.GetRecordsRequest(region="r", reads=[read])
            assert _code(lambda: gen._store.GetRecords(ours)) == denied
            assert acme.delete(b"p2") == 512
            # The operators' call stays on StoreAdmin (its own port here).
            with StoreClient(admin_address, token=TOKENS["ops"]) as ops:
                assert ops.admin_delete(b"theirs", "b") == 4096

        token_file = tmp_path / "engine.token"
        token_file.write_text(TOKENS["engine"])
        engine = start_engine(
            engine_data_dir, "--store", store.address, "--store-token-file", str(token_file),
            log_dir=tmp_path,
        )  # fmt: skip
        try:
            with EngineClient(engine.address) as client:
                for i in range(4):
                    got = client.generate(
                        [*PROMPT, i + 3],
                        max_tokens=24,
                        ignore_eos=True,
                        checkpoint_interval=4,
                        request_id=f"gen-{i}",
                    )
                    assert len(got.token_ids) == 24
                flushed = client.flush()
                assert flushed.durable and flushed.failed == 0 and flushed.missing == 0
                counters = client.stats().checkpoints
                assert counters.saved > 0 and counters.store_up
                assert counters.failed == 0 and counters.dropped == 0
        finally:
            engine.stop()

        with StoreClient(admin_address, token=TOKENS["ops"]) as ops:
            records = ops.list_all()
            # Finished: no manifest, no segment; what is left is a tombstone per generation
            # (and the prompts' prefixes).
            assert not [r for r in records if r.kind == "generation"]
            assert not [r for r in records if r.kind == "object" and r.payload_bytes > 0]
            # A tombstone keeps the generation's lease until it lapses; no segment does.
            tombstones = [r for r in records if r.kind == "object"]
            assert len(tombstones) == 4
            assert [r for r in records if r.pinned] == [r for r in tombstones if r.pinned]
    finally:
        store.stop()


@pytest.fixture
def served(tmp_path: Path) -> Any:
    with serve_store(tmp_path / "store") as store:
        yield store


def test_oversized_labels_are_invalid_argument(served: InProcessStore) -> None:
    huge = "h" * MiB
    just_over = "x" * (MAX_LABEL_CHARS + 1)
    with StoreClient(served.address) as client:
        client.put(make_checkpoint(b"k", {"a_int8": 1024}))
        lease = client.pin(b"k", holder="x" * MAX_LABEL_CHARS)  # at the limit: fine
        calls: dict[str, Callable[[], object]] = {
            "Put pin_holder": lambda: client.put(
                make_checkpoint(b"p", {"a_int8": 16}), pin_ttl_s=60, pin_holder=huge
            ),
            "Put model_id": lambda: client.put(
                make_checkpoint(b"p", {"a_int8": 16}, model_id=just_over)
            ),
            "Put layout": lambda: client.put(
                make_checkpoint(b"p", {"a_int8": 16}, layout=[just_over])
            ),
            "Put tensor name": lambda: client.put(make_checkpoint(b"p", {just_over: 16})),
            "Pin holder": lambda: client.pin(b"k", holder=huge),
            "Pin lease_id": lambda: client.pin(b"k", lease_id=huge),
            "Unpin lease_id": lambda: client.unpin(b"k", huge),
            "List model_id": lambda: client.list(model_id=huge),
            "Lookup model_id": lambda: client.lookup(
                namespace="",
                model_id=huge,
                layout=["kv:plain"],
                block_size=16,
                block_hashes=[b"\0" * 32],
                token_count=16,
            ),
        }
        for name, call in calls.items():
            assert _code(call) == grpc.StatusCode.INVALID_ARGUMENT, name
        # Nothing landed, and the lease at the limit is there as it was.
        assert [r.key for r in client.list_all()] == [b"k"]
        assert [x.lease_id for x in client.inspect(b"k").leases] == [lease.lease_id]


def test_a_region_name_with_a_nul_byte_is_invalid_argument(served: InProcessStore) -> None:
    with grpc.insecure_channel(served.address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        for name in ("tandem\0region", "tandem-\x7f", "x" * 201):
            request = store_pb2.RegisterRegionRequest(name=name, size_bytes=4096, proof=b"p" * 32)
            assert _code(lambda r=request: stub.RegisterRegion(r)) == (  # type: ignore[misc]
                grpc.StatusCode.INVALID_ARGUMENT
            ), name
        get = store_pb2.GetRequest(key=b"k", region="a\0b")
        assert _code(lambda: list(stub.Get(get))) == grpc.StatusCode.INVALID_ARGUMENT


def _lose_a_chunk(store: InProcessStore, key: bytes, index: int) -> None:
    """Deletes one stored chunk of a record, its header left as it is (a lost page)."""
    storage = store.store.state.storage
    ikey = record_key("default", key)
    raw = storage.read(lambda txn: bytes(txn.get(ikey, db=storage.db["headers"])))
    record_id = StoredRecord.decode(raw).record_id
    chunks = storage.db["chunks"]
    assert storage.write(lambda txn: txn.delete(chunk_key(record_id, index), db=chunks), sync=True)


def test_a_record_whose_chunk_was_lost_is_data_loss(tmp_path: Path) -> None:
    with serve_store(tmp_path / "store", chunk_bytes=64 << 10) as store:
        with StoreClient(store.address) as client, SharedRegion(4 * MiB) as region:
            client.put(make_checkpoint(b"streamed", {"a_int8": 512 << 10}))
            client.put(make_checkpoint(b"placed", {"a_int8": 512 << 10}))
            _lose_a_chunk(store, b"streamed", 3)
            _lose_a_chunk(store, b"placed", 5)
            assert _code(lambda: client.get(b"streamed")) == grpc.StatusCode.DATA_LOSS
            client.register_region(region)
            assert _code(lambda: client.get_into(b"placed", region)) == (grpc.StatusCode.DATA_LOSS)
            # Quarantined: never served again, and shown as such.
            for key in (b"streamed", b"placed"):
                assert _code(lambda k=key: client.get(k)) == grpc.StatusCode.DATA_LOSS  # type: ignore[misc]
                assert client.inspect(key).summary.quarantined
            assert client.stats().quarantined == 2
