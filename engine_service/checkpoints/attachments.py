"""Attachments: method-owned companion state stored beside a checkpoint's caches.

An attachment is a schema name, a metadata map and tensors (the store keeps them after the
checkpoint's own tensors, with the same chunking and checksums). The engine's one today is
the draft model's cache of a speculative generation (`DRAFT_SCHEMA`). It is encoded with the
cache codec, and restored only
- under the schema that wrote it,
- at the exact token boundary it was captured at (never trimmed: a companion state is only
  meaningful beside caches of exactly that length),
- by the same codec and for the same companion model (FAILED_PRECONDITION naming both sides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine_service.checkpoints.cache_records import (
    CODEC_VERSION,
    CapturedCache,
    capture,
    restore,
    to_host,
)
from engine_service.errors import Precondition
from tandem_client.records import Attachment

DRAFT_SCHEMA = "tandem.speculative.draft.v1"


@dataclass
class CapturedAttachment:
    """An attachment whose tensors are still MLX arrays being copied (see cache_records)."""

    schema: str
    captured: CapturedCache
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return self.captured.nbytes

    def to_record(self) -> Attachment:
        """The store's form; reads evaluated memory (settle the capture first)."""
        return Attachment(
            self.schema, to_host(self.captured), {**self.captured.meta(), **self.metadata}
        )


def capture_attachment(
    schema: str, caches: list[Any], boundary: int, held: int, **metadata: str
) -> CapturedAttachment:
    """Snapshots companion caches holding `held` tokens, beside a checkpoint of `boundary`
    tokens (MLX thread; copies run with the next step)."""
    captured = capture(caches, held, wait=False, prefix=f"{schema}/")
    return CapturedAttachment(
        schema, captured, {"boundary": str(boundary), "held": str(held), **metadata}
    )


def check_attachment(
    attachment: Attachment, schema: str, boundary: int, expect: dict[str, str]
) -> None:
    """Raises Precondition unless the attachment can be restored here."""
    meta = attachment.metadata
    if attachment.schema != schema:
        raise Precondition(f"attachment schema {attachment.schema!r} is not {schema!r}")
    if meta.get("codec") != CODEC_VERSION:
        raise Precondition(
            f"attachment codec {meta.get('codec')!r} differs from the engine's {CODEC_VERSION!r}"
        )
    if meta.get("boundary") != str(boundary):
        raise Precondition(
            f"attachment {schema} was captured at {meta.get('boundary')} tokens and can only be "
            f"restored there, not at {boundary}"
        )
    for name, want in expect.items():
        if meta.get(name) != want:
            raise Precondition(f"attachment {schema} has {name} {meta.get(name)!r}, not {want!r}")


def restore_attachment(attachment: Attachment, layout: list[str]) -> list[Any]:
    """The companion caches (MLX thread); check_attachment first."""
    return restore(attachment.metadata, attachment.tensors, layout)


def find(attachments: list[Attachment], schema: str) -> Attachment | None:
    return next((a for a in attachments if a.schema == schema), None)


def draft_pending(attachment: Attachment) -> list[int]:
    """Tokens the draft model had not processed yet when its cache was captured."""
    return [int(t) for t in json.loads(attachment.metadata.get("draft_pending", "[]"))]
