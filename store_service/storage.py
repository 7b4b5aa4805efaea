"""LMDB lives here: the environment, its tables, one writer thread, map growth, sync, compaction.

Every other module reaches LMDB through `LmdbStorage.read` (a short read
transaction on the calling thread) and `LmdbStorage.submit`/`write` (a write
transaction run on the single writer thread, in submission order). What those
transactions do to the tables is tables.py's business.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from store_service import datafile
from store_service.datafile import DamagedDataFile
from store_service.errors import DiskFull, StorageError, StoreError, Unavailable
from store_service.rwlock import SharedExclusiveLock

log = logging.getLogger(__name__)

T = TypeVar("T")

# One named sub-database per record kind (fixed-width keys, see records.py).
# `damaged`: header values that failed their checksum or did not parse, kept as they were
# (record key -> raw value) for an operator; their chunks are collected as orphans.
# `lease_owners`: record key -> the ids of its leases, so that deleting a record finds its
# leases without reading every lease (rebuilt from `leases` at every start, recovery.py).
TABLES = (
    "headers",
    "chunks",
    "access",
    "leases",
    "prefix_index",
    "quarantine",
    "damaged",
    "lease_owners",
)
DUPSORT_TABLES = frozenset({"prefix_index", "lease_owners"})
MIN_MAP_SIZE = 4 << 20
# What a full disk answers a write with (EIO too: some devices report a full disk so).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
# Queued write ops applied before one group sync (bounds ack latency under load).
MAX_GROUP = 64


@dataclass
class _WriteOp:
    fn: Callable[[Any], Any]
    on_commit: Callable[[Any], None] | None
    sync: bool
    future: Future[Any]
    in_txn: bool = True


class LmdbStorage:
    """The LMDB environment of one data directory, owned by one process."""

    def __init__(self, data_dir: Path, initial_map_size: int) -> None:
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # LMDB allows several processes; two stores on one directory would each trust an
        # in-memory index the other invalidates, so the directory is ours alone.
        # The lock file holds the owner's pid, so that a refusal names the process to stop (a
        # store left running by an earlier `tandem up`); a dead owner's flock is released by
        # the kernel, so the lock is never stale.
        self._dir_lock = open(self.data_dir / "store.lock", "a+")  # noqa: SIM115 - held open
        try:
            fcntl.flock(self._dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._dir_lock.seek(0)
            owner = self._dir_lock.read().strip()
            self._dir_lock.close()
            stop = f" (pid {owner}): stop it first, e.g. kill {owner}" if owner.isdigit() else ""
            raise StorageError(f"another store has {self.data_dir} open{stop}") from exc
        self._dir_lock.truncate(0)
        self._dir_lock.write(str(os.getpid()))
        self._dir_lock.flush()
        self._lock = SharedExclusiveLock()
        self._map_size = max(initial_map_size, MIN_MAP_SIZE)
        shutil.rmtree(self._compact_dir, ignore_errors=True)  # an interrupted compaction
        try:
            self._open()
        except StorageError:
            self._dir_lock.close()
            raise
        self.map_resizes = 0
        self._queue: queue.SimpleQueue[_WriteOp | None] = queue.SimpleQueue()
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="lmdb-writer", daemon=True)
        self._writer.start()

    # -- environment -------------------------------------------------------------------------

    @property
    def _compact_dir(self) -> Path:
        return self.data_dir / "compact.tmp"

    @property
    def data_file(self) -> Path:
        return self.data_dir / "data.mdb"

    def _open(self) -> None:
        try:
            datafile.check(self.data_file)  # before mapping: a short file is a SIGBUS later
        except DamagedDataFile as exc:
            raise StorageError(str(exc)) from exc
        existing = self.data_file.stat().st_size if self.data_file.exists() else 0
        self._map_size = max(self._map_size, _round_up(existing * 2, 1 << 20))
        try:
            # sync=False: commits don't fsync; we sync explicitly per the store's sync mode,
            # once per checkpoint rather than once per chunk transaction.
            self.env = lmdb.open(
                str(self.data_dir),
                map_size=self._map_size,
                max_dbs=len(TABLES) + 1,
                sync=False,
                metasync=False,
                readahead=False,
                max_readers=512,
            )
            self.db = {
                name: self.env.open_db(name.encode(), dupsort=name in DUPSORT_TABLES)
                for name in TABLES
            }
        except lmdb.Error as exc:
            raise StorageError(f"cannot open LMDB at {self.data_dir}: {exc}") from exc

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def file_bytes(self) -> int:
        return self.data_file.stat().st_size

    def entries(self, table: str) -> int:
        return int(self.read(lambda txn: txn.stat(self.db[table])["entries"]))

    def _grow(self) -> None:
        # Called on the writer thread, outside any transaction; readers are held off briefly.
        with self._lock.exclusive():
            self._map_size = self.map_size * 2
            self.env.set_mapsize(self._map_size)
        self.map_resizes += 1
        log.info("LMDB map grown to %d MiB", self._map_size >> 20)

    # -- reads -------------------------------------------------------------------------------

    def read(self, fn: Callable[[Any], T], buffers: bool = False) -> T:
        """Runs fn(txn) in a read transaction; keep it short (no network waits inside)."""
        with self._lock.shared():
            try:
                txn = self.env.begin(buffers=True) if buffers else self.env.begin()
                with txn:
                    return fn(txn)
            except lmdb.Error as exc:
                raise StorageError(f"LMDB read failed: {exc}") from exc

    def hold_read(self) -> tuple[Any, Callable[[], None]]:
        """A read transaction (buffers) kept open past this call, and what ends it: a direct
        read's lease (direct_reads.py). It holds the shared lock meanwhile, so growth and
        compaction wait for it: keep it short."""
        shared = self._lock.shared()
        shared.__enter__()
        try:
            txn = self.env.begin(buffers=True)
        except lmdb.Error as exc:
            shared.__exit__(None, None, None)
            raise StorageError(f"LMDB read failed: {exc}") from exc
        ended = threading.Lock()

        def release() -> None:
            if ended.acquire(blocking=False):  # once, from whichever thread ends it
                txn.abort()
                shared.__exit__(None, None, None)

        return txn, release

    # -- writes ------------------------------------------------------------------------------

    def submit(
        self,
        fn: Callable[[Any], T],
        *,
        sync: bool = False,
        on_commit: Callable[[T], None] | None = None,
    ) -> Future[T]:
        """Queues fn(txn) for the writer thread; the future resolves after commit (and sync).

        fn may run more than once (a full map is grown and the transaction retried), so it
        must only touch LMDB; in-memory effects go in on_commit, which runs on the writer
        thread right after the commit, in commit order.
        """
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(Unavailable("store is shutting down"))
            return future
        self._queue.put(_WriteOp(fn, on_commit, sync, future))
        return future

    def run_on_writer(self, fn: Callable[[], T]) -> Future[T]:
        """Calls fn() on the writer thread with no transaction open: maintenance that must
        exclude every write (compaction)."""
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(Unavailable("store is shutting down"))
        else:
            self._queue.put(_WriteOp(lambda _: fn(), None, False, future, in_txn=False))
        return future

    def write(
        self,
        fn: Callable[[Any], T],
        *,
        sync: bool = False,
        on_commit: Callable[[T], None] | None = None,
    ) -> T:
        return self.submit(fn, sync=sync, on_commit=on_commit).result()

    def sync(self) -> None:
        """Durability barrier: every write queued before this call is committed and on disk."""
        self.write(lambda txn: None, sync=True)

    def _writer_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < MAX_GROUP:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            waiting_sync: list[tuple[_WriteOp, Any]] = []
            for item in batch:
                try:
                    result = self._apply(item)
                except BaseException as exc:  # travels to the caller as a value
                    item.future.set_exception(exc)
                    continue
                if item.sync:
                    waiting_sync.append((item, result))
                else:
                    item.future.set_result(result)
            if waiting_sync:
                self._group_sync(waiting_sync)

    def _apply(self, op: _WriteOp) -> Any:
        if not op.in_txn:
            return op.fn(None)
        for _ in range(32):
            try:
                with self._lock.shared(), self.env.begin(write=True) as txn:
                    result = op.fn(txn)
            except lmdb.MapFullError:
                self._grow()
                continue
            except lmdb.Error as exc:
                raise self._failure("write", exc) from exc
            if op.on_commit is not None:
                op.on_commit(result)
            return result
        raise self._disk_full("the LMDB map could not grow enough")

    def _failure(self, what: str, exc: lmdb.Error) -> StoreError:
        """A disk that is full (or failing the way a full one does) is the caller's
        RESOURCE_EXHAUSTED; anything else from LMDB is ours."""
        text = str(exc)
        if any(os.strerror(code) in text for code in _DISK_FULL_ERRNOS):
            return self._disk_full(f"LMDB {what}: {text}")
        return StorageError(f"LMDB {what} failed: {exc}")

    def _disk_full(self, detail: str) -> DiskFull:
        try:
            free = shutil.disk_usage(self.data_dir).free
        except OSError:
            free = 0
        return DiskFull(f"disk full: {free} bytes free in {self.data_dir} ({detail})")

    def _group_sync(self, ops: list[tuple[_WriteOp, Any]]) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            for op, _ in ops:
                op.future.set_exception(self._failure("sync", exc))
            return
        for op, result in ops:
            op.future.set_result(result)

    # -- maintenance -------------------------------------------------------------------------

    def compact(self) -> tuple[int, int]:
        """Copies the live pages into a fresh file and swaps it in; returns sizes before/after.

        Runs on the writer thread, so no write can slip in between the copy and the swap.
        """
        return self.run_on_writer(self._compact_on_writer).result()

    def _compact_on_writer(self) -> tuple[int, int]:
        before = self.file_bytes()
        tmp = self._compact_dir
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            self.env.copy(str(tmp), compact=True)
            with open(tmp / "data.mdb", "rb") as copied:
                os.fsync(copied.fileno())
            with self._lock.exclusive():
                self.env.close()
                # os.replace is atomic: a crash leaves either the old file or the new one.
                os.replace(tmp / "data.mdb", self.data_file)
                self._open()
        except lmdb.Error as exc:
            raise StorageError(f"compaction failed: {exc}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return before, self.file_bytes()

    def close(self) -> None:
        """Finishes queued writes, syncs and closes the environment."""
        if self._closed:
            return
        self.sync()
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        with self._lock.exclusive():
            self.env.sync(True)
            self.env.close()
        self._dir_lock.close()


@contextlib.contextmanager
def read_only(data_dir: Path) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The environment of a store that is not running, opened read-only (verify, salvage):
    the data file checked first, the store's directory lock held meanwhile."""
    data_file = data_dir / "data.mdb"
    if not data_file.exists():
        raise StorageError(f"{data_file} does not exist")
    try:
        datafile.check(data_file)
    except DamagedDataFile as exc:
        raise StorageError(str(exc)) from exc
    with open(data_dir / "store.lock", "a") as dir_lock:
        try:
            fcntl.flock(dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise StorageError(f"a store has {data_dir} open; stop it first") from exc
        try:
            env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=len(TABLES) + 1)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open LMDB at {data_dir}: {exc}") from exc
        try:
            with env.begin() as txn:
                names = {bytes(k) for k, _ in txn.cursor()}
            wanted = ("headers", "chunks", "quarantine", "damaged")  # not the dupsort index
            db = {n: env.open_db(n.encode(), create=False) for n in wanted if n.encode() in names}
            yield env, db
        finally:
            env.close()


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


def now_ms() -> int:
    return int(time.time() * 1000)
