"""The shared tier with real processes: two stores ("nodes"), each with its own LMDB file,
sharing records through a real Valkey cluster (3 primaries, 3 replicas) on loopback."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from valkey.crc import key_slot

from store_service.tier.local_cluster import SLOTS, LocalCluster
from store_service.tier.records import TierRecords, manifest_key
from tandem_client import Checkpoint, StoreClient, TandemError
from tests.conftest import make_checkpoint
from tests.servers import free_port, wait_until
from tests.test_metrics import scrape
from tests.tier_stack import raw_client, start_cluster, start_tiered_store, two_nodes

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("valkey"))
    try:
        yield c
    finally:
        c.stop()


def _same_payload(got, want) -> bool:  # noqa: ANN001
    pairs = zip(got.all_tensors(), want.all_tensors(), strict=True)
    return all(bytes(a.data) == bytes(b.data) for a, b in pairs)


def _prefix(key: bytes, namespace: str, blocks: int = 4) -> Checkpoint:
    hashes = [bytes([i]) * 16 for i in range(1, blocks + 1)]
    return make_checkpoint(
        key,
        {"k": 700_000, "v": 700_000},
        namespace=namespace,
        token_count=64 * blocks,
        block_size=64,
        block_hashes=hashes,
    )


def test_a_record_stored_on_one_node_is_served_on_the_other(tmp_path: Path, cluster) -> None:  # noqa: ANN001
    generation = make_checkpoint(
        b"gen-1", {"k": 3 * MiB, "v": 5000}, kind="generation", namespace="team-a"
    )
    prefix = _prefix(b"prefix-1", "team-a")
    with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
        node_a.put(generation)  # written through: in the tier when answered
        node_a.put(prefix)  # written behind
        node_a.flush()  # the write-behind queue drained
        with StoreClient(b.address) as node_b:
            assert _same_payload(node_b.get(b"gen-1", "team-a"), generation)
            found = node_b.lookup(
                namespace="team-a",
                model_id="test-model@0",
                layout=["kv:plain"],
                block_size=64,
                block_hashes=prefix.block_hashes[:3] + [b"\x09" * 16],
                token_count=256,
            )
            assert found.found and found.key == b"prefix-1" and found.matched_tokens == 192
            assert _same_payload(node_b.get(b"prefix-1", "team-a"), prefix)
            # Another tenant's key is never served, from either tier.
            with pytest.raises(TandemError) as other:
                node_b.get(b"gen-1", "team-b")
            assert other.value.code == grpc.StatusCode.NOT_FOUND
            tier = node_b.stats().tier
            assert (
                tier.hits == 2
                and tier.read_bytes == generation.payload_bytes + prefix.payload_bytes
            )
        # A finished generation leaves both tiers.
        node_a.delete(b"gen-1", "team-a")
        with StoreClient(b.address) as node_b:
            node_b.delete(b"gen-1", "team-a")  # its local copy, taken on the first Get
        fresh = start_tiered_store(tmp_path / "fresh", cluster)
        try:
            with StoreClient(fresh.address) as node_c, pytest.raises(TandemError) as gone:
                node_c.get(b"gen-1", "team-a")
            assert gone.value.code == grpc.StatusCode.NOT_FOUND
        finally:
            fresh.stop()


def test_a_prefix_record_pinned_is_in_the_tier_when_the_pin_is_answered(
    tmp_path: Path,
    cluster,  # noqa: ANN001
) -> None:
    """Prefix records are written behind; one an engine pins (a generation's checkpoint
    chain rests on it, docs/checkpoints.md) is written through, as the chain's own records
    are: a node lost right after loses no generation resting on it. Here the tier lost the
    record after the write-behind copy; the Pin writes it again before it answers."""
    prefix = _prefix(b"base-1", "t")
    with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
        node_a.put(prefix)
        node_a.flush()  # copied behind
        tier = TierRecords(raw_client(cluster), ttl_s=60)
        assert tier.delete(_ikey(b"base-1"))
        lease = node_a.pin(b"base-1", "t", ttl_s=60, holder="engine/test")
        assert tier.manifest(_ikey(b"base-1")) is not None
        node_a.pin(b"base-1", "t", ttl_s=60, holder="engine/test", lease_id=lease.lease_id)
        with StoreClient(b.address) as node_b:
            assert _same_payload(node_b.get(b"base-1", "t"), prefix)


def test_damage_inside_valkey_is_a_miss_never_wrong_bytes(tmp_path: Path, cluster) -> None:  # noqa: ANN001
    records = {
        name: make_checkpoint(name, {"k": 2 * MiB}, kind="generation", namespace="t")
        for name in (b"flipped", b"deleted", b"forged")
    }
    raw = raw_client(cluster)
    with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
        for record in records.values():
            node_a.put(record)
        chunk_of = {name: f"tandem:c:{_ikey(name).hex()}:".encode() for name in records}
        keys = {name: _keys_with_prefix(cluster, prefix) for name, prefix in chunk_of.items()}
        (first,) = [k for k in keys[b"flipped"] if k.endswith(b":0")]
        (value,) = raw.get_many([first])
        assert value is not None
        damaged = bytearray(value)
        damaged[100] ^= 0xFF
        raw.set_many([(first, bytes(damaged))], ttl_s=3600)
        raw.delete_many([keys[b"deleted"][0]])
        # A manifest copied under another namespace's key names the wrong record.
        (manifest,) = raw.get_many([b"tandem:m:" + _ikey(b"forged").hex().encode()])
        assert manifest is not None
        raw.set_many([(b"tandem:m:" + _ikey(b"forged", "u").hex().encode(), manifest)], 3600)
        with StoreClient(b.address) as node_b:
            for name, namespace in ((b"flipped", "t"), (b"deleted", "t"), (b"forged", "u")):
                with pytest.raises(TandemError) as miss:
                    node_b.get(name, namespace)
                assert miss.value.code == grpc.StatusCode.NOT_FOUND, name
            tier = node_b.stats().tier
            assert tier.damaged == 3 and tier.hits == 0
            assert _same_payload(node_b.get(b"forged", "t"), records[b"forged"])
    raw.close()


def _ikey(key: bytes, namespace: str = "t") -> bytes:
    from store_service.records import record_key

    return record_key(namespace, key)


def _keys_with_prefix(cluster, prefix: bytes) -> list[bytes]:  # noqa: ANN001
    found = []
    for node in cluster.primary_nodes():
        client = cluster.client(node)
        try:
            found += list(client.scan_iter(match=prefix + b"*"))
        finally:
            client.close()
    return sorted(found)


def test_the_whole_tier_down_then_back(tmp_path: Path) -> None:
    """Down: generations' Puts are UNAVAILABLE at once, prefixes stored locally and counted,
    local reads go on. Back: a Put works again and what it missed is copied over."""
    cluster = start_cluster(tmp_path / "valkey", primaries=3, replicas=0)
    try:
        with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
            before = make_checkpoint(b"before", {"k": MiB}, kind="generation", namespace="t")
            node_a.put(before)
            for node in cluster.nodes:
                cluster.kill(node)
            down = make_checkpoint(b"down", {"k": MiB}, kind="generation", namespace="t")
            with pytest.raises(TandemError) as refused:
                node_a.put(down)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert "shared tier" in str(refused.value)
            node_a.put(_prefix(b"prefix-down", "t"))  # a prefix: local, its copy counted
            assert _same_payload(node_a.get(b"before", "t"), before)  # local reads go on
            node_a.flush()
            tier = node_a.stats().tier
            assert not tier.up and tier.errors >= 2
            for node in cluster.nodes:
                cluster.launch(node)
            cluster.wait_healthy()
            after = make_checkpoint(b"after", {"k": MiB}, kind="generation", namespace="t")
            wait_until(lambda: _put_answered(node_a, after), what="a Put with the tier back")
            node_a.flush()  # the records it missed, copied behind
            with StoreClient(b.address) as node_b:
                for name in (b"after", b"down", b"prefix-down"):
                    assert node_b.get(name, "t").key == name
    finally:
        cluster.stop()


def _key_whose_manifest_is_on_the_first_primary(cluster: LocalCluster) -> bytes:
    first_slots = range(SLOTS // cluster.primaries)  # LocalCluster's slot assignment
    for i in range(1000):
        name = b"unsafe-%d" % i
        if key_slot(manifest_key(_ikey(name))) in first_slots:
            return name
    raise AssertionError("no key found")


def _put_answered(client: StoreClient, checkpoint) -> bool:  # noqa: ANN001
    try:
        client.put(checkpoint)
        return True
    except TandemError as exc:
        assert exc.code == grpc.StatusCode.UNAVAILABLE
        return False


def test_what_each_durability_loses_when_a_primary_dies(tmp_path: Path) -> None:
    """With its replica frozen, a primary takes writes its replica never sees (a record's
    chunks spread over every primary, so some land there). `tier` acknowledges the record
    and loses it when the primary dies; `replicated` refuses it (no replica
    confirmed), so nothing it acknowledged is lost."""
    # Three primaries: a failover needs a majority of them to vote.
    cluster = start_cluster(tmp_path / "valkey", primaries=3, replicas=1)
    try:
        primary, replica = cluster.nodes[0], cluster.nodes[3]  # nodes[3] replicates nodes[0]
        tier_mode = start_tiered_store(tmp_path / "tier", cluster, "--tier-durability", "tier")
        replicated = start_tiered_store(
            tmp_path / "replicated", cluster, "--tier-durability", "replicated"
        )
        try:
            with StoreClient(tier_mode.address) as t, StoreClient(replicated.address) as r:
                safe = make_checkpoint(b"safe", {"k": MiB}, kind="generation", namespace="t")
                r.put(safe)  # acknowledged: on the replica too
                assert replica.proc is not None
                os.kill(replica.proc.pid, signal.SIGSTOP)
                # Its link cut too: what the kernel had buffered for it would still arrive.
                primary_client = cluster.client(primary)
                primary_client.client_kill_filter(_type="slave")  # valkey-py's name for replicas
                primary_client.close()
                # Its manifest in primary 0's slots (the first third): lost with it.
                name = _key_whose_manifest_is_on_the_first_primary(cluster)
                unsafe = make_checkpoint(name, {"k": MiB}, kind="generation", namespace="t")
                t.put(unsafe)  # acknowledged by the primary alone
                refused = make_checkpoint(b"refused", {"k": MiB}, kind="generation", namespace="t")
                with pytest.raises(TandemError) as no_replica:
                    r.put(refused)
                assert no_replica.value.code == grpc.StatusCode.UNAVAILABLE
                assert "replicas confirmed" in str(no_replica.value)
                cluster.kill(primary)
                os.kill(replica.proc.pid, signal.SIGCONT)
                wait_until(lambda: replica in cluster.primary_nodes(), what="the failover")
                cluster.wait_healthy()
            with two_nodes(tmp_path / "readers", cluster) as (reader, _):
                with StoreClient(reader.address) as c:
                    assert _same_payload(c.get(b"safe", "t"), safe)
                    with pytest.raises(TandemError) as lost:
                        c.get(name, "t")
                    assert lost.value.code == grpc.StatusCode.NOT_FOUND
        finally:
            tier_mode.stop()
            replicated.stop()
    finally:
        cluster.stop()


def test_acknowledged_checkpoints_survive_a_primary_killed_under_four_writers(
    tmp_path: Path,
) -> None:
    """`replicated`: 4 writers Put generation checkpoints while a primary is SIGKILLed;
    after the failover every Put that was acknowledged reads back byte-exact (from another
    node's store, whose local tier is empty). Puts refused meanwhile were never promised."""
    cluster = start_cluster(tmp_path / "valkey", primaries=3, replicas=1)
    try:
        with two_nodes(tmp_path, cluster, "--tier-durability", "replicated") as (a, b):
            acknowledged: dict[bytes, Checkpoint] = {}
            refused: list[str] = []
            lock = threading.Lock()
            stop = threading.Event()

            def writer(w: int) -> None:
                with StoreClient(a.address) as client:
                    for i in range(1000):
                        if stop.is_set():
                            return
                        name = b"w%d-%d" % (w, i)
                        ckpt = make_checkpoint(
                            name, {"k": 256 << 10}, kind="generation", namespace="t"
                        )
                        try:
                            client.put(ckpt)
                        except TandemError as exc:
                            assert exc.code == grpc.StatusCode.UNAVAILABLE, exc
                            with lock:
                                refused.append(str(exc))
                            continue
                        with lock:
                            acknowledged[name] = ckpt

            writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
            for t in writers:
                t.start()
            wait_until(lambda: len(acknowledged) >= 8, what="acknowledged Puts")
            victim = cluster.nodes[1]
            cluster.kill(victim)
            wait_until(lambda: len(cluster.primary_nodes()) == cluster.primaries, what="a failover")
            cluster.wait_healthy()
            # The shard's new primary has no replica until the lost node comes back as one:
            # until then `replicated` Puts that touch it are refused, never acknowledged.
            cluster.launch(victim)
            cluster.wait_synced()
            settled = len(acknowledged)
            wait_until(lambda: len(acknowledged) >= settled + 8, what="Puts after the failover")
            stop.set()
            for t in writers:
                t.join(60)
            with StoreClient(b.address) as reader:
                for name, ckpt in acknowledged.items():
                    assert _same_payload(reader.get(name, "t"), ckpt), name
            print(f"{len(acknowledged)} acknowledged, {len(refused)} refused during the failover")
    finally:
        cluster.stop()


def test_a_namespace_over_its_tier_quota_is_refused_there_only(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    port = free_port()
    store = start_tiered_store(
        tmp_path / "store",
        cluster,
        "--tier-namespace-quota-bytes",
        str(3 * MiB),
        "--metrics-listen",
        f"127.0.0.1:{port}",
    )
    try:
        with StoreClient(store.address) as client:
            for i in range(3):
                ckpt = make_checkpoint(b"q%d" % i, {"k": MiB}, kind="generation", namespace="q")
                client.put(ckpt)
            over = make_checkpoint(b"q3", {"k": MiB}, kind="generation", namespace="q")
            with pytest.raises(TandemError) as refused:
                client.put(over)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "quota" in str(refused.value)
            # Another namespace is not held back; a deleted record gives its bytes back.
            client.put(make_checkpoint(b"r0", {"k": MiB}, kind="generation", namespace="r"))
            client.delete(b"q0", "q")
            client.put(over)
            assert client.stats().tier.quota_refusals == 1
        samples = scrape(port)
        assert samples[("tandem:store_tier_up", ())] == 1.0
        assert samples[("tandem:store_tier_quota_refusals_total", ())] == 1.0
        assert samples[("tandem:store_tier_written_total", ())] == 5.0
        assert samples[("tandem:store_tier_deleted_total", ())] == 1.0
    finally:
        store.stop()


def test_a_record_written_again_leaves_no_chunks_behind(tmp_path: Path, cluster) -> None:  # noqa: ANN001
    with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
        for _ in range(3):
            node_a.put(make_checkpoint(b"again", {"k": 2 * MiB}, kind="generation", namespace="t"))
        last = make_checkpoint(b"again", {"k": 2 * MiB}, kind="generation", namespace="t")
        node_a.put(last)
        chunks = _keys_with_prefix(cluster, f"tandem:c:{_ikey(b'again').hex()}:".encode())
        assert len(chunks) == 2  # the last record's two 1 MiB chunks only
        with StoreClient(b.address) as node_b:
            assert _same_payload(node_b.get(b"again", "t"), last)


def test_headers_only_in_the_tier_come_over_in_one_call(tmp_path: Path, cluster) -> None:  # noqa: ANN001
    """A resume after a node's loss probes its chain with one GetHeaders on another node: the
    segments only the tier holds are brought over, each answered found, in the order asked
    (a key asked twice is brought once); a key nobody stored stays missing, and another
    tenant's key is never found."""
    segments = [
        make_checkpoint(b"seg-%d" % i, {"k": 200_000 + i}, kind="generation", namespace="team-a")
        for i in range(6)
    ]
    with two_nodes(tmp_path, cluster) as (a, b), StoreClient(a.address) as node_a:
        for segment in segments:
            node_a.put(segment)  # generations are written through
        keys = [b"seg-3", b"nobody", *[s.key for s in segments]]
        with StoreClient(b.address) as node_b:
            reads = node_b.get_headers(keys, "team-a")
            assert [r.checkpoint is not None for r in reads] == [True, False] + [True] * 6
            for key, read in zip(keys, reads, strict=True):
                assert read.checkpoint is None or read.checkpoint.key == key
            assert node_b.stats().tier.hits == 6
            assert _same_payload(node_b.get(b"seg-5", "team-a"), segments[5])
            assert node_b.stats().tier.hits == 6  # now local
            assert all(r.checkpoint is None for r in node_b.get_headers(keys, "team-b"))
