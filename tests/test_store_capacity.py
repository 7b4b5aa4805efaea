"""Capacity: LRU eviction under a byte budget, leases that protect records from it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_client import FailedPrecondition, NotFound, ResourceExhausted, StoreClient
from tests.conftest import make_checkpoint
from tests.servers import serve_store

MiB = 1 << 20


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[StoreClient]:
    with (
        serve_store(tmp_path / "small", capacity_bytes=10 * MiB, chunk_bytes=256 << 10) as served,
        StoreClient(served.address) as c,
    ):
        yield c


def _keys(client: StoreClient) -> set[bytes]:
    return {r.key for r in client.list_all()}


def test_eviction_keeps_bytes_under_budget_least_recently_used_first(
    small_store: StoreClient,
) -> None:
    client = small_store
    for i in range(8):  # 8 x 1 MiB
        client.put(make_checkpoint(b"r%d" % i, {"kv_int8": MiB}))
    client.get(b"r0")  # r0 becomes the most recently used; r1 is now the oldest
    client.get(b"r2")
    for i in range(8, 11):  # 3 more MiB: 11 > 10, so one must go... then more
        client.put(make_checkpoint(b"r%d" % i, {"kv_int8": MiB}))
    stats = client.stats()
    assert stats.payload_bytes <= stats.capacity_bytes
    assert stats.evictions == 1
    assert _keys(client) == {b"r%d" % i for i in (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)}
    client.put(make_checkpoint(b"big", {"kv_int8": 3 * MiB}))
    # The three least recently used (r3, r4, r5) made room; r0 and r2 were read recently.
    assert _keys(client) == {b"r%d" % i for i in (0, 2, 6, 7, 8, 9, 10)} | {b"big"}
    stats = client.stats()
    assert stats.evictions == 4 and stats.payload_bytes <= stats.capacity_bytes


def test_pinned_records_are_never_evicted(small_store: StoreClient) -> None:
    client = small_store
    client.put(
        make_checkpoint(b"pinned-by-put", {"kv_int8": 3 * MiB}),
        pin_ttl_s=60,
        pin_holder="engine-1/req-7",
    )
    client.put(make_checkpoint(b"pinned-later", {"kv_int8": 3 * MiB}))
    lease = client.pin(b"pinned-later", ttl_s=60, holder="engine-1/req-8")
    for i in range(6):
        client.put(make_checkpoint(b"f%d" % i, {"kv_int8": MiB}))
    assert {b"pinned-by-put", b"pinned-later"} <= _keys(client)
    assert client.stats().pinned_records == 2
    # 6 MiB pinned: a 5 MiB checkpoint cannot fit whatever is evicted.
    with pytest.raises(ResourceExhausted, match="pinned"):
        client.put(make_checkpoint(b"too-big-now", {"kv_int8": 5 * MiB}))
    assert {b"pinned-by-put", b"pinned-later"} <= _keys(client)

    with pytest.raises(FailedPrecondition):
        client.delete(b"pinned-later")
    client.unpin(b"pinned-later", lease.lease_id)
    with pytest.raises(NotFound):
        client.unpin(b"pinned-later", lease.lease_id)
    client.put(make_checkpoint(b"fits-now", {"kv_int8": 5 * MiB}))
    assert b"pinned-later" not in _keys(client)  # unpinned and least recently used
    assert b"pinned-by-put" in _keys(client)


def test_leases_expire_on_their_own(small_store: StoreClient) -> None:
    client = small_store
    client.put(make_checkpoint(b"short-lease", {"kv_int8": 4 * MiB}), pin_ttl_s=1)
    assert client.inspect(b"short-lease").summary.pinned
    # Nothing unpins it: the lease's 1 s runs out (polled, not slept for).
    deadline = time.monotonic() + 30
    while client.inspect(b"short-lease").summary.pinned:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    assert not client.inspect(b"short-lease").summary.pinned
    client.put(make_checkpoint(b"pusher", {"kv_int8": 7 * MiB}))
    assert _keys(client) == {b"pusher"}


def test_put_larger_than_the_budget_is_resource_exhausted(small_store: StoreClient) -> None:
    client = small_store
    client.put(make_checkpoint(b"keep", {"kv_int8": MiB}))
    with pytest.raises(ResourceExhausted, match="capacity"):
        client.put(make_checkpoint(b"huge", {"kv_int8": 11 * MiB}))
    assert _keys(client) == {b"keep"}


def test_repinning_puts_renew_one_lease_per_holder(small_store: StoreClient) -> None:
    client = small_store
    for _ in range(5):  # an engine re-checkpointing one generation
        client.put(
            make_checkpoint(b"gen", {"kv_int8": 1000}), pin_ttl_s=60, pin_holder="engine/abc"
        )
    client.put(make_checkpoint(b"gen", {"kv_int8": 1000}), pin_ttl_s=60, pin_holder="other")
    leases = client.inspect(b"gen").leases
    assert sorted(lease.holder for lease in leases) == ["engine/abc", "other"]
