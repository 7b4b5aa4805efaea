"""`tandem ckpt ...`: list, inspect, remove, purge, export and import checkpoints."""

from __future__ import annotations

import argparse
import struct
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from tandem_client.cli.connection import add_connection_args, connection
from tandem_client.cli.output import (
    console,
    human_age,
    human_bytes,
    print_json,
    store_address,
    table,
)
from tandem_client.errors import InvalidArgument, NotFound
from tandem_client.store_client import Checkpoint, RecordSummary, StoreClient
from tandem_wire.pb import tensors_pb2

# Export file: magic, header length, CheckpointHeader bytes, then the payload (tensors in order).
MAGIC = b"TANDEMCKPT1\n"
_LEN = struct.Struct(">Q")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ck = sub.add_parser("ckpt", help="manage checkpoints in the store")
    ck.add_argument("--store", help="store address (env TANDEM_STORE)")
    cmds = ck.add_subparsers(dest="ckpt_command", required=True)

    def command(name: str, helptext: str, func: Any, json_flag: bool = True) -> Any:
        p = cmds.add_parser(name, help=helptext)
        p.add_argument("--store", help="store address (env TANDEM_STORE)")
        add_connection_args(p)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument("--namespace", default="")
        p.add_argument("--model", default="", help="model id")
        p.add_argument(
            "--kind", choices=["prefix", "generation", "object"], help="(default: every kind)"
        )
        p.add_argument("--older-than", type=int, default=0, metavar="SECONDS")
        p.add_argument("--idle-for", type=int, default=0, metavar="SECONDS")

    ls = command("ls", "list checkpoints", cmd_ls)
    filters(ls)
    show = command("show", "one checkpoint: header, tensors, leases", cmd_show)
    show.add_argument("key", help="hex key")
    show.add_argument("--namespace", default="")
    rm = command("rm", "remove a checkpoint", cmd_rm)
    rm.add_argument("key", help="hex key")
    rm.add_argument("--namespace", default="")
    rm.add_argument("--force", action="store_true", help="even if pinned")
    purge = command("purge", "remove every checkpoint matching the filters", cmd_purge)
    filters(purge)
    purge.add_argument("--include-pinned", action="store_true")
    purge.add_argument("--dry-run", action="store_true")
    command("stats", "store counters and sizes", cmd_stats)
    command("flush", "durability barrier", cmd_flush)
    command("compact", "rewrite the LMDB file without free pages", cmd_compact)
    export = command("export", "write a checkpoint to a file", cmd_export, json_flag=False)
    export.add_argument("key", help="hex key")
    export.add_argument("file", type=Path)
    export.add_argument("--namespace", default="")
    imp = command("import", "put a checkpoint from an exported file", cmd_import)
    imp.add_argument("file", type=Path)
    imp.add_argument("--namespace", help="put it in this namespace instead")


def _client(args: argparse.Namespace) -> StoreClient:
    return StoreClient(store_address(args.store), timeout=600, **connection(args))


SHOWN_KEY_CHARS = 16  # what `ckpt ls` shows of a key; show, rm and export take any unique prefix


def _key(store: StoreClient, text: str, namespace: str) -> bytes:
    """A whole key, or the one key in the namespace that starts with these hex digits."""
    text = text.lower()
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise InvalidArgument(f"key must be hex digits, got {text!r}")
    if len(text) >= 64 and len(text) % 2 == 0:
        return bytes.fromhex(text)  # a whole key: no listing needed
    keys = [r.key for r in store.list_all(namespace=namespace) if r.key.hex().startswith(text)]
    exact = [k for k in keys if k.hex() == text]
    if exact:
        return exact[0]
    if len(keys) == 1:
        return keys[0]
    if not keys:
        raise NotFound(f"NOT_FOUND: no record's key starts with {text}")
    raise InvalidArgument(f"{len(keys)} records' keys start with {text}: give more digits")


def _summary_json(r: RecordSummary) -> dict[str, Any]:
    return {**r.__dict__, "key": r.key.hex()}


def _rows(records: list[RecordSummary]) -> list[list[str]]:
    now = int(time.time() * 1000)
    return [
        [
            r.key.hex()[:SHOWN_KEY_CHARS],
            r.namespace,
            r.kind,
            r.model_id,
            str(r.token_count),
            human_bytes(r.payload_bytes),
            human_age(r.created_at_unix_ms, now),
            human_age(r.last_access_unix_ms, now),
            ("pinned " if r.pinned else "") + ("QUARANTINED" if r.quarantined else ""),
        ]
        for r in records
    ]


_COLUMNS = ["key", "namespace", "kind", "model", "tokens", "size", "age", "idle", "flags"]


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        namespace=args.namespace,
        model_id=args.model,
        kind=args.kind,
        older_than_s=args.older_than,
        idle_for_s=args.idle_for,
    )


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as store:
        records = store.list_all(**_filters(args))
    if args.json:
        print_json([_summary_json(r) for r in records])
    else:
        table(
            f"{len(records)} checkpoints ({human_bytes(sum(r.payload_bytes for r in records))})",
            _COLUMNS,
            _rows(records),
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as store:
        seen = store.inspect(_key(store, args.key, args.namespace), args.namespace)
    c = seen.checkpoint
    if args.json:
        print_json(
            {
                "summary": _summary_json(seen.summary),
                "layout": c.layout,
                "metadata": c.metadata,
                "chunk_count": seen.chunk_count,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in c.tensors
                ],
                "attachments": [
                    {
                        "schema": a.schema,
                        "metadata": a.metadata,
                        "tensors": [t.name for t in a.tensors],
                        "nbytes": sum(t.nbytes for t in a.tensors),
                    }
                    for a in c.attachments
                ],
                "leases": [lease.__dict__ for lease in seen.leases],
            }
        )
        return 0
    table("checkpoint", _COLUMNS, _rows([seen.summary]))
    console.print(
        f"key {seen.summary.key.hex()}\nlayout {', '.join(c.layout) or '-'}\n"
        f"stored in {seen.chunk_count} chunks of up to "
        f"{human_bytes(seen.chunk_bytes)}"
    )
    table(
        "tensors",
        ["name", "dtype", "shape"],
        [[t.name, t.dtype, "x".join(map(str, t.shape))] for t in c.tensors],
    )
    for a in c.attachments:
        size = human_bytes(sum(t.nbytes for t in a.tensors))
        table(
            f"attachment {a.schema} ({len(a.tensors)} tensors, {size})",
            ["name", "dtype", "shape", "size"],
            [
                [t.name, t.dtype, "x".join(map(str, t.shape)), human_bytes(t.nbytes)]
                for t in a.tensors
            ],
        )
    if c.metadata:
        table(
            "metadata",
            ["key", "value"],
            [[k, v if len(v) < 120 else v[:117] + "..."] for k, v in sorted(c.metadata.items())],
        )
    for lease in seen.leases:
        console.print(f"lease {lease.lease_id} held by {lease.holder or '-'}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as store:
        freed = store.admin_delete(
            _key(store, args.key, args.namespace), args.namespace, force=args.force
        )
    if args.json:
        print_json({"deleted": args.key, "freed_bytes": freed})
    else:
        console.print(f"removed {args.key} ({human_bytes(freed)})")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    with _client(args) as store:
        gone = store.purge(
            include_pinned=args.include_pinned, dry_run=args.dry_run, **_filters(args)
        )
    if args.json:
        print_json(
            {
                "dry_run": args.dry_run,
                "records": len(gone),
                "freed_bytes": sum(r.payload_bytes for r in gone),
                "removed": [_summary_json(r) for r in gone],
            }
        )
    else:
        verb = "would remove" if args.dry_run else "removed"
        table(
            f"{verb} {len(gone)} checkpoints ({human_bytes(sum(r.payload_bytes for r in gone))})",
            _COLUMNS,
            _rows(gone),
        )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as store:
        s = store.stats()
    fields = {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}
    if args.json:
        print_json(fields)
        return 0
    sizes = {
        "payload_bytes",
        "capacity_bytes",
        "map_size_bytes",
        "file_bytes",
        "pending_bytes",
        "evicted_bytes",
        "chunk_bytes",
    }
    table(
        "store",
        ["", "value"],
        [[k, human_bytes(v) if k in sizes else str(v)] for k, v in fields.items()],
    )
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    with _client(args) as store:
        durable = store.flush()
    if args.json:
        print_json({"durable": durable})
    else:
        console.print("durable" if durable else "NOT durable")
    return 0 if durable else 1


def cmd_compact(args: argparse.Namespace) -> int:
    with console.status("compacting..."), _client(args) as store:
        before, after = store.compact()
    if args.json:
        print_json({"file_bytes_before": before, "file_bytes_after": after})
    else:
        console.print(f"compacted {human_bytes(before)} -> {human_bytes(after)}")
    return 0


def _progress() -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,
    )


def cmd_export(args: argparse.Namespace) -> int:
    with _client(args) as store:
        key = _key(store, args.key, args.namespace)
        header = store.get_header(key, args.namespace)
        with _progress() as progress:
            task = progress.add_task("export", total=None)
            ckpt = store.get(key, args.namespace)
            tensors = ckpt.all_tensors()
            total = sum(memoryview(t.data).nbytes for t in tensors)
            progress.update(task, total=total)
            pb = ckpt.header_pb().SerializeToString()
            tmp = args.file.with_suffix(args.file.suffix + ".part")
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(pb)) + pb)
                for t in tensors:
                    f.write(t.data)
                    progress.advance(task, memoryview(t.data).nbytes)
            tmp.replace(args.file)
    console.print(f"exported {args.key} ({header.kind}, {human_bytes(total)}) to {args.file}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    data = args.file.read_bytes()
    if not data.startswith(MAGIC):
        raise InvalidArgument(f"{args.file} is not a tandem checkpoint export")
    (length,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    header = tensors_pb2.CheckpointHeader.FromString(data[start : start + length])
    ckpt = Checkpoint.from_header(header)
    if args.namespace is not None:
        ckpt.namespace = args.namespace
    view, offset = memoryview(data), start + length
    for tensor, spec in zip(
        ckpt.all_tensors(),
        [*header.tensors, *(s for a in header.attachments for s in a.tensors)],
        strict=True,
    ):
        tensor.data = view[offset : offset + spec.nbytes]
        offset += spec.nbytes
    if offset != len(data):
        raise InvalidArgument(f"{args.file} is truncated or has trailing bytes")
    with console.status(f"importing {human_bytes(len(data))}..."), _client(args) as store:
        result = store.put(ckpt)
    if args.json:
        print_json(
            {
                "key": result.key.hex(),
                "payload_bytes": result.payload_bytes,
                "replaced": result.replaced,
                "namespace": ckpt.namespace,
            }
        )
    else:
        console.print(
            f"imported {result.key.hex()} into namespace "
            f"{ckpt.namespace or 'default'} ({human_bytes(result.payload_bytes)})"
        )
    return 0
