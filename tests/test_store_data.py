"""Store data plane: byte-exact round trips, concurrency, prefix lookup, namespaces."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem_client import NotFound, StoreClient
from tandem_client.bulk import INLINE_PAYLOAD_BYTES
from tandem_client.errors import PutManyFailed
from tandem_client.identity import block_hashes, scope_digest
from tandem_client.records import PutItem
from tandem_client.store_client import LookupResult
from tests.conftest import make_checkpoint
from tests.servers import InProcessStore

MiB = 1 << 20


def test_64mib_checkpoint_round_trips_byte_exact(client: StoreClient) -> None:
    sizes = {
        "k_bf16": 24 * MiB,
        "v_bf16": 24 * MiB,
        "q_int8": 12 * MiB,
        "scales_bf16": 4 * MiB,
        "odd_int8": 12345,
        "empty_int8": 0,
    }
    ckpt = make_checkpoint(
        b"\x01" * 32,
        sizes,
        token_ids=list(range(3000)),
        metadata={"codec": "kv:plain"},
        kind="generation",
    )
    result = client.put(ckpt)
    total = sum(sizes.values())
    assert (result.payload_bytes, result.replaced) == (total, False)

    got = client.get(ckpt.key)
    assert [t.name for t in got.tensors] == list(sizes)
    for sent, received in zip(ckpt.tensors, got.tensors, strict=True):
        assert bytes(received.data) == bytes(sent.data)
        assert (received.dtype, received.shape) == (sent.dtype, sent.shape)
    assert got.token_ids == list(range(3000)) and got.metadata == {"codec": "kv:plain"}

    inspected = client.inspect(ckpt.key)
    assert inspected.summary.payload_bytes == total
    assert inspected.summary.tensor_count == len(sizes)
    assert inspected.summary.token_count == 3000
    assert inspected.summary.kind == "generation"
    stats = client.stats()
    assert inspected.chunk_count == sum(math.ceil(n / stats.chunk_bytes) for n in sizes.values())
    listed = client.list_all()
    assert [(r.key, r.payload_bytes) for r in listed] == [(ckpt.key, total)]
    assert (stats.records, stats.payload_bytes, stats.puts, stats.gets) == (1, total, 1, 1)
    assert stats.chunk_entries == inspected.chunk_count


def test_replacing_a_key_is_atomic_and_reported(client: StoreClient) -> None:
    first = make_checkpoint(b"same", {"a_int8": 3 * MiB})
    second = make_checkpoint(b"same", {"b_bf16": 2 * MiB})
    client.put(first)
    assert client.put(second).replaced
    got = client.get(b"same")
    assert [t.name for t in got.tensors] == ["b_bf16"]
    assert bytes(got.tensors[0].data) == bytes(second.tensors[0].data)
    client.flush()
    assert client.stats().chunk_entries == 2  # the old record's chunks are gone


def test_eight_concurrent_clients_put_and_get_byte_exact(
    client: StoreClient, store: InProcessStore
) -> None:
    def worker(i: int) -> bool:
        with StoreClient(store.address) as own:
            ckpt = make_checkpoint(
                bytes([i]) * 16, {"k_bf16": (3 + i) * MiB + 2 * i, "v_int8": 2 * MiB - i}
            )
            own.put(ckpt)
            for _ in range(2):
                got = own.get(ckpt.key)
                if [bytes(t.data) for t in got.tensors] != [bytes(t.data) for t in ckpt.tensors]:
                    return False
            return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(worker, range(8)))
    assert client.stats().records == 8


def _put_prefix(
    client: StoreClient,
    tokens: list[int],
    *,
    trimmable: bool = True,
    namespace: str = "",
    model: str = "m@1",
    block: int = 16,
) -> bytes:
    scope = scope_digest(model, ["kv:plain"], namespace)
    key = bytes([len(tokens) % 251, int(trimmable)]) + scope[:14]
    ckpt = make_checkpoint(
        key,
        {"kv_bf16": 4 * len(tokens)},
        token_ids=tokens,
        model_id=model,
        namespace=namespace,
        trimmable=trimmable,
        block_size=block,
        block_hashes=block_hashes(tokens, block, scope),
    )
    client.put(ckpt)
    return key


def _lookup(
    client: StoreClient,
    tokens: list[int],
    *,
    namespace: str = "",
    model: str = "m@1",
    block: int = 16,
) -> LookupResult:
    scope = scope_digest(model, ["kv:plain"], namespace)
    return client.lookup(
        namespace=namespace,
        model_id=model,
        layout=["kv:plain"],
        block_size=block,
        block_hashes=block_hashes(tokens, block, scope),
        token_count=len(tokens),
    )


def test_lookup_returns_the_longest_stored_prefix(client: StoreClient) -> None:
    prompt = list(range(1000, 1200))  # 200 tokens
    short = _put_prefix(client, prompt[:48])
    long = _put_prefix(client, prompt[:130])
    hit = _lookup(client, prompt)
    # The 130-token record serves up to its last full block boundary inside the query.
    assert (hit.found, hit.key, hit.matched_tokens, hit.record_tokens) == (True, long, 128, 130)
    # An exact match of a partial final block is served at its exact length.
    exact = _lookup(client, prompt[:130])
    assert (exact.key, exact.matched_tokens) == (long, 130)

    client.delete(long)
    fallback = _lookup(client, prompt)
    assert (fallback.found, fallback.key, fallback.matched_tokens) == (True, short, 48)

    assert not _lookup(client, [7] * 40).found
    assert not _lookup(client, prompt, model="other@2").found
    assert not _lookup(client, prompt, namespace="tenant-b").found
    stats = client.stats()
    assert stats.hits >= 3 and stats.misses >= 3


def test_non_trimmable_record_serves_only_its_exact_length(client: StoreClient) -> None:
    prompt = list(range(500, 600))
    key = _put_prefix(client, prompt[:64], trimmable=False)
    assert not _lookup(client, prompt[:40]).found  # would need trimming to 32
    hit = _lookup(client, prompt)  # exact boundary 64 inside the query
    assert (hit.found, hit.key, hit.matched_tokens, hit.trimmable) == (True, key, 64, False)
    odd = _put_prefix(client, prompt[:70], trimmable=False)
    assert _lookup(client, prompt[:70]).key == odd
    assert _lookup(client, prompt).key == key  # 70 is not a block boundary of the query


def test_namespaces_isolate_records_with_the_same_key(client: StoreClient) -> None:
    a = make_checkpoint(b"shared-key", {"x_int8": 1000}, namespace="tenant-a")
    b = make_checkpoint(b"shared-key", {"x_int8": 2000}, namespace="tenant-b")
    client.put(a)
    client.put(b)
    assert bytes(client.get(b"shared-key", "tenant-a").tensors[0].data) == bytes(a.tensors[0].data)
    assert bytes(client.get(b"shared-key", "tenant-b").tensors[0].data) == bytes(b.tensors[0].data)
    with pytest.raises(NotFound):
        client.get(b"shared-key", "tenant-c")
    assert {r.namespace for r in client.list_all()} == {"tenant-a", "tenant-b"}
    assert [r.namespace for r in client.list_all(namespace="tenant-b")] == ["tenant-b"]


# Small records travel in one PutRecords message, larger ones stream through PutMany: both
# keep the same order and the same count on a failure.
@pytest.mark.parametrize("size", [3000, INLINE_PAYLOAD_BYTES + 1], ids=["inline", "streamed"])
def test_put_many_stores_records_in_order_and_says_how_many_on_a_failure(
    client: StoreClient, size: int
) -> None:
    records = [make_checkpoint(b"batch-%d" % i, {"kv_int8": size + i}) for i in range(3)]
    results = client.put_many([PutItem(r) for r in records])
    assert [r.key for r in results] == [b"batch-0", b"batch-1", b"batch-2"]
    for record in records:
        got = client.get(record.key)
        assert bytes(got.tensors[0].data) == bytes(record.tensors[0].data)
    # The second record may not replace its key: the first is stored, the third is not.
    again = [make_checkpoint(b"batch-new", {"kv_int8": 10}), records[1], records[2]]
    again[2] = make_checkpoint(b"batch-never", {"kv_int8": 10})
    items = [PutItem(again[0]), PutItem(again[1], if_absent=True), PutItem(again[2])]
    with pytest.raises(PutManyFailed) as failed:
        client.put_many(items)
    assert failed.value.stored == 1 and failed.value.code.name == "ALREADY_EXISTS"
    assert client.get(b"batch-new").key == b"batch-new"
    with pytest.raises(NotFound):
        client.get(b"batch-never")
