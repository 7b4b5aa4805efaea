"""The spill queue: checkpoints leave the engine for the store on a thread of their own.

The MLX thread queues typed work (spill_items.py) and never waits on the network. The queue
is bounded in bytes: a Put that does not fit is dropped and counted. A store that is down
costs counted failures and a backoff (items fail fast while it lasts), never a stalled
generation. `flush()` is the durability barrier: it waits for everything queued before it,
then the store's own Flush, and says what reached the store since the last barrier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_service.checkpoints.generation_meta import BaseLease
from engine_service.checkpoints.spill_items import CheckpointSink, Delete, Pin, Put, Unpin
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.flush import FlushResult
from tandem_client.errors import AlreadyExists, PutManyFailed, TandemError
from tandem_client.errors import NotFound as StoreNotFound
from tandem_client.records import PutItem

log = logging.getLogger(__name__)


@dataclass
class _Barrier:
    done: threading.Event


# Puts queued back to back leave in one PutMany call of at most this many records / bytes: a
# step's segments and manifests cost one call's overhead, not one each.
BATCH_RECORDS = 32
BATCH_BYTES = 64 << 20
# Deletes queued back to back (a finished generation's segments) leave in one DeleteMany of
# at most this many keys (the store takes 4096).
DELETE_BATCH = 256


class BatchFailed(TandemError):
    """A PutMany that stopped; every one of its items is already accounted for."""

    def __init__(self, cause: TandemError) -> None:
        super().__init__(str(cause), cause.code)
        self.cause = cause


class StoreDown(TandemError):
    """Raised inside the spill loop while it backs off from an unreachable store."""


_Item = Put | Delete | Pin | Unpin | _Barrier


class SpillQueue:
    def __init__(
        self,
        sink: CheckpointSink,
        capacity_bytes: int,
        counters: CheckpointCounters,
        lease_s: int = 600,
        batch_records: int = BATCH_RECORDS,
    ) -> None:
        self.sink = sink
        self.batch_records = max(1, batch_records)  # 1: one Put a record
        self.capacity_bytes = capacity_bytes
        self.counters = counters
        self.lease_s = lease_s
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._since_flush = FlushResult(durable=False)
        self._thread = threading.Thread(target=self._run, name="checkpoint-spill", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._queued_bytes

    def put(self, item: Put) -> bool:
        """Queues a record; False when it does not fit (counted as dropped)."""
        with self._lock:
            if item.nbytes and self._queued_bytes + item.nbytes > self.capacity_bytes:
                self._since_flush.missing += 1
                dropped = True
            else:
                self._queued_bytes += item.nbytes
                dropped = False
        if dropped:
            self.counters.add(dropped=1)
            return False
        self.counters.add(queued_bytes=item.nbytes)
        self._queue.put(item)
        return True

    def delete(
        self, key: bytes, namespace: str, still_wanted: Callable[[], bool] | None = None
    ) -> None:
        self._queue.put(Delete(key, namespace, still_wanted))

    def pin(self, item: Pin) -> None:
        self._queue.put(item)

    def unpin(self, lease: BaseLease) -> None:
        self._queue.put(Unpin(lease))

    def wait_sent(self, timeout: float = 60.0) -> bool:
        """Waits until everything queued so far was sent (landed or failed)."""
        done = threading.Event()
        self._queue.put(_Barrier(done))
        return done.wait(timeout)

    def flush(self, timeout: float = 60.0) -> FlushResult:
        """Waits for everything queued so far, then the store's Flush."""
        done = threading.Event()
        self._queue.put(_Barrier(done))
        reached = done.wait(timeout)
        try:
            synced = reached and self.sink.flush()
        except TandemError:
            synced = False
        with self._lock:
            counts, self._since_flush = self._since_flush, FlushResult(durable=False)
        counts.durable = bool(synced) and counts.missing == 0 and counts.failed == 0
        return counts

    # -- the spill thread --------------------------------------------------------------------

    def _run(self) -> None:
        backoff, retry_at = 0.0, 0.0
        carry: _Item | None = None  # read past the end of a batch
        while True:
            item = carry if carry is not None else self._queue.get()
            carry = None
            if isinstance(item, _Barrier):
                item.done.set()
                continue
            if isinstance(item, Pin | Unpin):
                self._lease(item, retry_at)
                continue
            batch: list[Put | Delete] = [item]
            carry = self._more_puts(batch) if isinstance(item, Put) else self._more_deletes(batch)
            sent = 0
            try:
                if time.monotonic() < retry_at:
                    # The store was down moments ago: fail fast instead of waiting per item;
                    # newer checkpoints supersede these.
                    raise StoreDown("store unreachable; backing off")
                sent = self._send_batch(batch)
                backoff = 0.0
                self.counters.set_store_up(True)
            except TandemError as exc:
                if isinstance(exc, BatchFailed):  # its items are accounted for
                    exc = exc.cause
                else:
                    for failed in batch[sent:]:
                        if isinstance(failed, Put):
                            self._failed(failed)
                if not isinstance(exc, StoreDown):
                    backoff = min(max(backoff * 2, 0.25), 5.0)
                    retry_at = time.monotonic() + backoff
                    log.warning("checkpoint spill failed (%s); retrying in %.2fs", exc, backoff)
                self.counters.set_store_up(False)
            finally:
                for done in batch:
                    if isinstance(done, Put) and done.nbytes:
                        with self._lock:
                            self._queued_bytes -= done.nbytes
                        self.counters.add(queued_bytes=-done.nbytes)

    def _lease(self, item: Pin | Unpin, retry_at: float) -> None:
        """Takes, renews or gives back a lease (a failed Pin calls its on_failed: what rests
        on the record is not built on; a failed Unpin leaves a lease that lapses)."""
        lease = item.lease
        try:
            if isinstance(item, Unpin):
                if lease.lease_id:
                    self.sink.unpin(lease.key, lease.lease_id, lease.namespace)
                return
            if item.still_wanted is not None and not item.still_wanted():
                return
            if time.monotonic() < retry_at:
                raise StoreDown("store unreachable; backing off")
            granted = self.sink.pin(
                lease.key,
                lease.namespace,
                ttl_s=self.lease_s,
                holder=item.holder,
                lease_id=lease.lease_id,
            )
            lease.lease_id = granted.lease_id
        except TandemError as exc:
            if isinstance(item, Pin):
                log.warning("a chain's base record could not be pinned (%s)", exc)
                if item.on_failed is not None:
                    item.on_failed()

    def _more_puts(self, batch: list[Put | Delete]) -> _Item | None:
        """Adds the Puts queued right behind the first, within the batch bounds; returns
        the first item that does not belong (a Delete or a barrier keeps its place)."""
        nbytes = sum(p.nbytes for p in batch if isinstance(p, Put))
        while len(batch) < self.batch_records and nbytes < BATCH_BYTES:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return None
            if not isinstance(item, Put):
                return item
            batch.append(item)
            nbytes += item.nbytes
        return None

    def _more_deletes(self, batch: list[Put | Delete]) -> _Item | None:
        """Adds the Deletes of the same namespace queued right behind the first (a finished
        generation's segments: one DeleteMany); returns the first item that does not belong."""
        first = batch[0]
        assert isinstance(first, Delete)
        while len(batch) < DELETE_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return None
            if not isinstance(item, Delete) or item.namespace != first.namespace:
                return item
            batch.append(item)
        return None

    def _send_batch(self, batch: list[Put | Delete]) -> int:
        """Sends a batch (several Puts: one PutMany call; several Deletes: one DeleteMany);
        returns how many items it accounted for. Raises BatchFailed, every item accounted
        for, when the store refused or could not be reached (the caller backs off)."""
        if len(batch) == 1:
            self._send(batch[0])
            return 1
        if isinstance(batch[0], Delete):
            keys = [d.key for d in batch if isinstance(d, Delete) and _wanted(d)]
            if keys:
                self.sink.delete_many(keys, batch[0].namespace, force=True)
            return len(batch)
        wanted = []
        for put in batch:
            assert isinstance(put, Put), "batches hold Puts only"
            if put.still_wanted is not None and not put.still_wanted():
                self._failed(put)  # skipped, as a single Put would be
            else:
                wanted.append(put)
        start = time.perf_counter()
        try:
            self.sink.put_many([self._item(p) for p in wanted])
        except PutManyFailed as exc:
            self._landed(wanted[: exc.stored])
            rest = wanted[exc.stored + 1 :]
            if isinstance(exc.cause, AlreadyExists):  # if_absent: an equal record is there
                self._landed(wanted[exc.stored : exc.stored + 1])
                _exists(wanted[exc.stored])
                for put in rest:
                    self._send_or_fail(put)
                return len(batch)
            for put in wanted[exc.stored :]:
                self._failed(put)
            raise BatchFailed(exc.cause) from None
        self._landed(wanted)
        seconds = time.perf_counter() - start
        self.counters.observe_checkpoint(sum(p.nbytes for p in wanted), seconds)
        return len(batch)

    def _send_or_fail(self, put: Put) -> None:
        try:
            self._send(put)
        except TandemError:
            self._failed(put)

    def _item(self, put: Put) -> PutItem:
        if put.pinned:
            holder = f"engine/{put.record.key.hex()[:12]}"
            return PutItem(put.record, put.if_absent, self.lease_s, holder)
        return PutItem(put.record, put.if_absent)

    def _landed(self, puts: list[Put]) -> None:
        with self._lock:
            self._since_flush.flushed += len(puts)
        self.counters.add(saved=len(puts), saved_bytes=sum(p.nbytes for p in puts))

    def _send(self, item: Put | Delete) -> None:
        if isinstance(item, Delete):
            if not _wanted(item):
                return
            try:
                self.sink.delete(item.key, item.namespace, force=True)
            except StoreNotFound:
                pass
            return
        if item.still_wanted is not None and not item.still_wanted():
            raise StoreDown("skipped: what this record builds on did not reach the store")
        start = time.perf_counter()
        try:
            if item.pinned:
                self.sink.put(
                    item.record,
                    if_absent=item.if_absent,
                    pin_ttl_s=self.lease_s,
                    pin_holder=f"engine/{item.record.key.hex()[:12]}",
                )
            else:
                self.sink.put(item.record, if_absent=item.if_absent)
        except AlreadyExists:
            _exists(item)  # if_absent: an equal record is there already
        with self._lock:
            self._since_flush.flushed += 1
        self.counters.add(saved=1, saved_bytes=item.nbytes)
        self.counters.observe_checkpoint(item.nbytes, time.perf_counter() - start)

    def _failed(self, item: Put) -> None:
        with self._lock:
            self._since_flush.failed += 1
        self.counters.add(failed=1)
        if item.on_failed is not None:
            item.on_failed()


def _exists(put: Put) -> None:
    if put.on_exists is not None:
        put.on_exists()


def _wanted(item: Delete) -> bool:
    return item.still_wanted is None or item.still_wanted()
