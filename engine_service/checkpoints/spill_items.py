"""What the MLX thread hands the spill queue (checkpoints/spill.py): typed work items, and the
store calls they become (`CheckpointSink`: the store client, a fake one in tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_service.checkpoints.generation_meta import BaseLease
from tandem_client.records import Checkpoint, Lease, PutItem


class CheckpointSink(Protocol):
    """Where spilled checkpoints go: the store client (a fake one in tests)."""

    def put(
        self,
        checkpoint: Checkpoint,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
    ) -> object: ...

    def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int: ...

    def delete_many(
        self, keys: list[bytes], namespace: str = "", *, force: bool = False
    ) -> int: ...

    def put_many(self, items: Sequence[PutItem]) -> object: ...

    def flush(self) -> bool: ...

    def pin(
        self,
        key: bytes,
        namespace: str = "",
        *,
        ttl_s: int = 0,
        holder: str = "",
        lease_id: str = "",
    ) -> Lease: ...

    def unpin(self, key: bytes, lease_id: str, namespace: str = "") -> None: ...


@dataclass
class Put:
    """A record to store; its tensors view settled MLX arrays (no copy until the wire)."""

    record: Checkpoint
    nbytes: int
    if_absent: bool = False  # prefixes: a record already there is as good
    pinned: bool = True  # generations: leased while they run
    # Checked just before sending: False skips the put (e.g. its chain broke meanwhile).
    still_wanted: Callable[[], bool] | None = None
    on_failed: Callable[[], None] | None = None  # after a put that did not land
    # if_absent: another record was there already (the one kept: not these bytes).
    on_exists: Callable[[], None] | None = None
    # What the tensors' bytes live in (a region span, checkpoints/host_staging.py): dropped with
    # the item.
    keep: object = None


@dataclass
class Delete:
    key: bytes
    namespace: str
    # Checked just before sending: False skips it (e.g. the manifest that made the record
    # dead did not land).
    still_wanted: Callable[[], bool] | None = None


@dataclass
class Pin:
    """A lease on a record this engine builds on but does not own (a chain's base): taken,
    or renewed once granted, for the queue's lease_s; its id lands in `lease`."""

    lease: BaseLease
    holder: str
    still_wanted: Callable[[], bool] | None = None
    on_failed: Callable[[], None] | None = None  # the record is gone, or the store is down


@dataclass
class Unpin:
    """Gives back a lease a Pin took (none taken: nothing to do)."""

    lease: BaseLease
