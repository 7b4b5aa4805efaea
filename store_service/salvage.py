"""What an operator runs after a disk fault, with the store stopped.

    tandem-store verify  --data-dir DIR               every record checked; exit 1 if any is damaged
    tandem-store salvage --data-dir DIR --to NEWDIR   every record that verifies, copied

`verify` reads the store read-only: each header's checksum and key, then every payload chunk
against its CRC (a tensor's running CRC, as Get checks it). `salvage` copies each live record
that verifies whole into a fresh store at NEWDIR through the store's own Put (so the copy is
checked again on the way in); damaged and quarantined records are left behind and listed.
Leases and access times are not copied: the new store starts with every record unpinned.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store_service.config import StoreConfig
from store_service.errors import Corrupt, InvalidRequest, StoreError
from store_service.put_spec import PutSpec
from store_service.records import StoredRecord, chunk_key
from store_service.storage import read_only
from store_service.store import CheckpointStore
from tandem_wire.checksum import crc32


@dataclass(frozen=True)
class Finding:
    key: str  # the record's LMDB key, hex
    table: str
    problem: str


@dataclass
class Report:
    checked: int = 0
    healthy: list[StoredRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def _chunks(txn: Any, db: dict[str, Any], record: StoredRecord) -> Iterator[tuple[int, bytes]]:
    """The payload as (offset, bytes) stored chunks, each checked; raises Corrupt."""
    crc = 0
    for slot, expected in zip(record.slots, record.chunk_crcs, strict=True):
        buf = txn.get(chunk_key(record.record_id, slot.index), db=db["chunks"])
        if buf is None:
            raise Corrupt(f"chunk {slot.index} is missing")
        prev = 0 if slot.starts_tensor else crc
        if len(buf) != slot.length or crc32(buf, prev) != expected:
            raise Corrupt(f"chunk {slot.index} failed its checksum")
        crc = expected
        yield slot.offset, bytes(buf)


def _walk(txn: Any, db: dict[str, Any], report: Report) -> None:
    for table in ("headers", "quarantine"):
        for key, raw in txn.cursor(db=db[table]) if table in db else ():
            report.checked += 1
            ikey = bytes(key)
            try:
                record = StoredRecord.decode(raw)
                if record.ikey != ikey:
                    raise Corrupt("the header names another key than it is stored under")
                if table == "quarantine":
                    raise Corrupt("quarantined earlier: a chunk failed its checksum")
                for _ in _chunks(txn, db, record):
                    pass
            except (Corrupt, InvalidRequest) as exc:
                report.findings.append(Finding(ikey.hex(), table, str(exc)))
                continue
            report.healthy.append(record)
    for key, _ in txn.cursor(db=db["damaged"]) if "damaged" in db else ():
        report.checked += 1
        report.findings.append(Finding(bytes(key).hex(), "damaged", "set aside earlier"))


def verify(data_dir: Path) -> Report:
    report = Report()
    with read_only(data_dir) as (env, db), env.begin(buffers=True) as txn:
        _walk(txn, db, report)
    return report


def salvage(data_dir: Path, to: Path, capacity_bytes: int = 0) -> Report:
    """Copies every record that verifies into a fresh store at `to`."""
    if (to / "data.mdb").exists():
        raise StoreError(f"{to} already holds a store; salvage writes into an empty directory")
    report = Report()
    with read_only(data_dir) as (env, db), env.begin(buffers=True) as txn:
        _walk(txn, db, report)
        size = sum(r.payload_bytes for r in report.healthy)
        config = StoreConfig(data_dir=to, capacity_bytes=max(capacity_bytes, size, 1 << 20))
        target = CheckpointStore(config)
        try:
            for record in report.healthy:
                target.put(PutSpec.validated(record.header), _chunks(txn, db, record))
        finally:
            target.close()
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem-store", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="check every record of a stopped store")
    check.add_argument("--data-dir", required=True)
    copy = commands.add_parser("salvage", help="copy every record that verifies")
    copy.add_argument("--data-dir", required=True)
    copy.add_argument("--to", required=True, help="an empty directory for the new store")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            report = verify(Path(args.data_dir))
        else:
            report = salvage(Path(args.data_dir), Path(args.to))
    except StoreError as exc:
        print(f"tandem-store: {exc}", file=sys.stderr)
        return 2
    for finding in report.findings:
        print(f"damaged {finding.table} {finding.key}: {finding.problem}")
    verb = "copied" if args.command == "salvage" else "healthy"
    print(
        f"{report.checked} records checked: {len(report.healthy)} {verb}, "
        f"{len(report.findings)} damaged"
    )
    return 1 if report.findings and args.command == "verify" else 0
