"""Attachments in the store: byte-exact round trips beside a checkpoint's tensors, and
standalone objects (companion state keyed by an input digest) under the same eviction,
pinning and admin as checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_client import StoreClient
from tandem_client.errors import NotFound
from tandem_client.store_client import Attachment, Checkpoint, Tensor
from tests.conftest import make_checkpoint
from tests.servers import ROOT, start_store

MiB = 1 << 20


def _attachment(schema: str, sizes: dict[str, int], **metadata: str) -> Attachment:
    tensors = [Tensor(n, "uint8", (size,), os.urandom(size)) for n, size in sizes.items()]
    return Attachment(schema, tensors, dict(metadata))


def test_attachments_round_trip_byte_exact_and_are_listed(client: StoreClient) -> None:
    ckpt = make_checkpoint(b"with-attachments", {"keys": 3 * MiB + 5, "values": 1 * MiB})
    ckpt.attachments = [
        _attachment("draft.v1", {"d.keys": 2 * MiB + 1, "d.values": 7}, boundary="300"),
        _attachment("encoder.v1", {"features": 5 * MiB}, digest="abc"),
    ]
    client.put(ckpt)
    back = client.get(ckpt.key)
    assert [a.schema for a in back.attachments] == ["draft.v1", "encoder.v1"]
    for sent, got in zip(ckpt.attachments, back.attachments, strict=True):
        assert got.metadata == sent.metadata
        for a, b in zip(sent.tensors, got.tensors, strict=True):
            assert (a.name, a.dtype, tuple(a.shape)) == (b.name, b.dtype, tuple(b.shape))
            assert bytes(memoryview(a.data)) == bytes(memoryview(b.data))
    for a, b in zip(ckpt.tensors, back.tensors, strict=True):
        assert bytes(memoryview(a.data)) == bytes(memoryview(b.data))
    seen = client.inspect(ckpt.key)
    assert seen.summary.attachment_count == 2
    assert [sum(t.nbytes for t in a.tensors) for a in seen.checkpoint.attachments] == [
        2 * MiB + 8,
        5 * MiB,
    ]
    # The operator's view: `tandem ckpt show` lists each attachment with its size.
    shown = subprocess.run(
        [sys.executable, "-m", "tandem_client.cli", "ckpt", "show", ckpt.key.hex(), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TANDEM_STORE": client.address},
        check=True,
    )
    listed = json.loads(shown.stdout)["attachments"]
    assert [(a["schema"], a["nbytes"]) for a in listed] == [
        ("draft.v1", 2 * MiB + 8),
        ("encoder.v1", 5 * MiB),
    ]
    text = subprocess.run(
        [sys.executable, "-m", "tandem_client.cli", "ckpt", "show", ckpt.key.hex()],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TANDEM_STORE": client.address, "COLUMNS": "200"},
        check=True,
    ).stdout
    flat = " ".join(text.split())  # rich may wrap a table title
    assert "attachment draft.v1 (2 tensors, 2.0 MiB)" in flat
    assert "encoder.v1" in flat and "5.0 MiB" in flat


def _features(digest: bytes, size: int) -> Checkpoint:
    """Encoder features stored standalone, keyed by a digest of the input they encode."""
    return Checkpoint(
        key=digest,
        kind="object",
        namespace="encoders",
        model_id="encoder@0",
        token_count=0,
        attachments=[_attachment("encoder.v1", {"features": size}, input="image")],
    )


def test_standalone_objects_put_take_evict_and_pin(tmp_path: Path) -> None:
    proc = start_store(tmp_path / "store", "--capacity-bytes", str(10 * MiB))
    try:
        with StoreClient(proc.address) as store:
            digests = [hashlib.sha256(f"input-{i}".encode()).digest() for i in range(6)]
            first = _features(digests[0], 3 * MiB)
            store.put(first, pin_ttl_s=600, pin_holder="encoder-cache")
            sent = bytes(memoryview(first.attachments[0].tensors[0].data))
            got = store.get(digests[0], "encoders")
            assert got.kind == "object"
            assert bytes(memoryview(got.attachments[0].tensors[0].data)) == sent
            for digest in digests[1:]:
                store.put(_features(digest, 3 * MiB))
            listed = store.list_all(kind="object", namespace="encoders")
            assert sum(r.payload_bytes for r in listed) <= 10 * MiB
            kept = {r.key for r in listed}
            assert digests[0] in kept  # pinned: never evicted
            assert digests[-1] in kept  # the newest
            assert digests[1] not in kept  # the oldest unpinned went first
            with pytest.raises(NotFound):
                store.get(digests[1], "encoders")
            assert store.stats().evictions >= 1
            # Same admin as checkpoints: inspect, delete (force past the pin), purge.
            assert store.inspect(digests[0], "encoders").summary.attachment_count == 1
            store.delete(digests[0], "encoders", force=True)
            purged = store.purge(namespace="encoders")
            assert len(purged) >= 1
            assert store.list_all(kind="object", namespace="encoders") == []
    finally:
        proc.stop()
