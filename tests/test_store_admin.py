"""Admin RPCs, health, reflection and sync modes."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem_client import StoreClient
from tests.conftest import make_checkpoint
from tests.servers import InProcessStore, serve_store, start_store


def test_list_filters_and_pages(client: StoreClient) -> None:
    for i in range(25):
        client.put(
            make_checkpoint(
                b"p%02d" % i,
                {"kv_int8": 1000 + i},
                kind="prefix" if i % 2 else "generation",
                namespace="a" if i < 20 else "b",
                model_id="m1" if i < 10 else "m2",
            )
        )
    first, token = client.list(page_size=10)
    assert len(first) == 10 and token
    everything = client.list_all(page_size=7)
    assert len(everything) == 25 and len({r.key for r in everything}) == 25
    assert len(client.list_all(namespace="b")) == 5
    assert len(client.list_all(model_id="m1")) == 10
    assert len(client.list_all(kind="prefix")) == 12
    assert len(client.list_all(namespace="a", kind="generation", model_id="m2")) == 5
    assert client.list_all(older_than_s=3600) == []


def test_purge_reports_what_went_and_spares_pinned(client: StoreClient) -> None:
    for i in range(6):
        client.put(make_checkpoint(b"g%d" % i, {"kv_int8": 100}, kind="generation"))
    client.put(make_checkpoint(b"keep", {"kv_int8": 100}, kind="prefix"))
    client.pin(b"g0", ttl_s=60)
    dry = client.purge(kind="generation", dry_run=True)
    assert len(dry) == 5 and len(client.list_all()) == 7
    gone = client.purge(kind="generation")
    assert sorted(r.key for r in gone) == [b"g%d" % i for i in range(1, 6)]
    assert sorted(r.key for r in client.list_all()) == [b"g0", b"keep"]
    assert [r.key for r in client.purge(kind="generation", include_pinned=True)] == [b"g0"]


def test_inspect_shows_leases_and_header(client: StoreClient) -> None:
    ckpt = make_checkpoint(
        b"i", {"k_bf16": 64, "v_int8": 9}, token_ids=[5, 6, 7], metadata={"seed": "42"}
    )
    client.put(ckpt, pin_ttl_s=30, pin_holder="engine-a")
    seen = client.inspect(b"i")
    assert [lease.holder for lease in seen.leases] == ["engine-a"]
    assert seen.checkpoint.metadata == {"seed": "42"}
    assert [t.name for t in seen.checkpoint.tensors] == ["k_bf16", "v_int8"]
    assert seen.summary.pinned and seen.summary.token_count == 3
    renewed = client.pin(b"i", lease_id=seen.leases[0].lease_id, ttl_s=120)
    assert renewed.expires_at_unix_ms > seen.leases[0].expires_at_unix_ms


def test_health_and_reflection(shared_store: InProcessStore) -> None:
    with grpc.insecure_channel(shared_store.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.Store", "tandem.v1.StoreAdmin"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="tandem.v1.Store"
                    ),
                ]
            )
        )
        listed, described = list(replies)
        names = {s.name for s in listed.list_services_response.service}
        assert {"tandem.v1.Store", "tandem.v1.StoreAdmin", "grpc.health.v1.Health"} <= names
        assert described.file_descriptor_response.file_descriptor_proto


def test_periodic_sync_mode_survives_restart_after_flush(tmp_path: Path) -> None:
    proc = start_store(tmp_path / "periodic", "--sync-mode", "periodic", "--sync-interval", "0.2")
    ckpt = make_checkpoint(b"periodic", {"kv_int8": 300_000})
    with StoreClient(proc.address) as client:
        client.put(ckpt)
        assert client.flush()
        assert client.stats().sync_mode == "periodic"
    proc.kill()  # no graceful close: only what was synced counts
    with serve_store(tmp_path / "periodic") as restarted, StoreClient(restarted.address) as client:
        assert bytes(client.get(b"periodic").tensors[0].data) == bytes(ckpt.tensors[0].data)


def test_a_second_store_on_the_same_directory_is_refused(
    store: InProcessStore, store_dir: Path
) -> None:
    try:
        start_store(store_dir)
    except RuntimeError as exc:
        assert "open" in str(exc)
    else:
        raise AssertionError("a second store started on the same data directory")
