"""Limits both sides of the wire check alike: the store, the engine and the clients."""

from __future__ import annotations

MAX_NAMESPACE_CHARS = 128
MAX_KEY_BYTES = 64
MAX_REQUEST_ID_CHARS = 128
# A record's metadata strings (its own and its attachments'), keys and values together.
MAX_METADATA_BYTES = 1 << 20
MAX_PAGE_TOKEN_CHARS = 256
# Short free-text fields of store requests: a lease's holder and id, a model id, a layout
# entry, a tensor name, an attachment schema. Each is kept beside the record or held in
# memory per lease, so none may be a megabyte.
MAX_LABEL_CHARS = 256
# Entries of a layout signature (one a layer).
MAX_LAYOUT_ENTRIES = 4096
# Get answers in pieces of at least this size (0 = the stored chunks): smaller ones would turn
# one read into millions of messages.
MIN_GET_CHUNK_BYTES = 64 << 10
# Element types a tensor may have, with their widths (the store checks nbytes against them).
DTYPE_BYTES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
}


def namespace_problem(namespace: str) -> str | None:
    """Why a namespace is refused, or None."""
    if len(namespace) > MAX_NAMESPACE_CHARS or not namespace.isprintable():
        return f"namespace must be up to {MAX_NAMESPACE_CHARS} printable characters"
    return None


def label_problem(field: str, value: str) -> str | None:
    """Why a short free-text field (MAX_LABEL_CHARS) is refused, or None."""
    if len(value) > MAX_LABEL_CHARS:
        return f"{field} is {len(value)} characters; the limit is {MAX_LABEL_CHARS}"
    return None


def layout_problem(field: str, layout: list[str]) -> str | None:
    """Why a layout signature is refused, or None."""
    if len(layout) > MAX_LAYOUT_ENTRIES:
        return f"{field} has {len(layout)} entries; the limit is {MAX_LAYOUT_ENTRIES}"
    for entry in layout:
        problem = label_problem(f"an entry of {field}", entry)
        if problem:
            return problem
    return None
