"""Keeping a prompt's caches as a prefix record (MLX thread): in the in-memory tier
(checkpoints/prefix_cache.py) and, through the spill queue, in the store, once a key
(deduplicated here, and `if_absent` there). Trimmable caches are kept after the prompt's
first token (`save`); caches that cannot be trimmed as exact records taken during prefill
(`save_exact`, checkpoints/prefix_snapshots.py). A generation's checkpoint chain may rest on
the record its prompt is saved as (`sent_as`, checkpoints/chain_policy.py)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine_service.checkpoints.cache_records import capture
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.checkpoints.record_codec import compress
from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Put
from engine_service.protocol.requests import EXACT_RECORD, RecordFormat
from tandem_client.identity import block_hashes, prefix_key
from tandem_client.records import Checkpoint

# Prefix keys already spilled, remembered up to this many (a miss only costs a Put the store
# answers with ALREADY_EXISTS).
SAVED_KEYS = 100_000


@dataclass(frozen=True)
class Destination:
    """Where a kept prefix goes: its key and scope, and whose records it joins."""

    key: bytes
    scope: bytes
    namespace: str
    layout: list[str]
    record: RecordFormat  # how the store's copy is kept (record_codec.py)


class PrefixSaves:
    def __init__(
        self,
        model_id: str,
        local: PrefixCache,
        scope: Callable[[str, list[str], RecordFormat], bytes],
        spill: SpillQueue | None,
        staging: HostStaging,
        min_prefix_tokens: int = BLOCK_SIZE,
    ) -> None:
        self.model_id = model_id
        self.local = local
        self.scope = scope  # PrefixReuse.scope: whose records a key joins
        self.spill = spill
        self.staging = staging
        self.min_prefix_tokens = min_prefix_tokens
        self._saved_keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def sent_as(
        self,
        prompt: list[int],
        namespace: str,
        layout: list[str],
        record: RecordFormat = EXACT_RECORD,
    ) -> bytes | None:
        """The key `save` will send a prompt's caches to the store under, holding exactly
        those bytes: None when it keeps nothing (too short, kept already) or the store's
        copy would be compressed."""
        if self.spill is None or record.tag or len(prompt) < self.min_prefix_tokens:
            return None
        key = prefix_key(self.scope(namespace, layout, record), prompt)
        return None if self._kept(key) else key

    def save(
        self,
        row_caches: list[Any],
        prompt: list[int],
        namespace: str,
        layout: list[str],
        record: RecordFormat = EXACT_RECORD,
        on_exists: Callable[[], None] | None = None,
    ) -> None:
        """Keeps a prompt's caches (MLX thread; row_caches hold prompt + 1 token).
        on_exists: the store kept another record of the prompt (not these bytes)."""
        if len(prompt) < self.min_prefix_tokens or not can_trim_prompt_cache(row_caches):
            return  # untrimmable: an exact snapshot was kept during prefill (prefix_snapshots)
        scope = self.scope(namespace, layout, record)
        key = prefix_key(scope, prompt)
        if self._kept(key):
            return
        trim_prompt_cache(row_caches, 1)
        where = Destination(key, scope, namespace, layout, record)
        self._keep(where, row_caches, prompt, trimmable=True, on_exists=on_exists)

    def save_exact(
        self,
        caches: list[Any],
        tokens: list[int],
        namespace: str,
        layout: list[str],
        record: RecordFormat = EXACT_RECORD,
    ) -> None:
        """Keeps caches holding exactly `tokens` that cannot be trimmed (MLX thread): they
        serve a prompt that starts with those tokens, at that length only."""
        if len(tokens) < self.min_prefix_tokens:
            return
        scope = self.scope(namespace, layout, record)
        key = prefix_key(scope, tokens)
        if not self._kept(key):
            where = Destination(key, scope, namespace, layout, record)
            self._keep(where, caches, tokens, trimmable=False)

    def _kept(self, key: bytes) -> bool:
        """Whether a prefix is kept already: sent to the store (or on its way), or, with no
        store, in the local tier. One whose Put failed (the store was down) is kept again by
        the next prompt that computes it, though the local tier still holds it."""
        return key in self._saved_keys if self.spill is not None else key in self.local

    def _keep(
        self,
        where: Destination,
        caches: list[Any],
        prompt: list[int],
        trimmable: bool,
        on_exists: Callable[[], None] | None = None,
    ) -> None:
        """Captures caches holding exactly `prompt` into the local tier and the spill queue
        (the store's copy compressed when the request asked: record_codec.py)."""
        key, namespace, layout = where.key, where.namespace, where.layout
        captured = capture(caches, len(prompt))
        chain = block_hashes(prompt, BLOCK_SIZE, where.scope)
        self.local.add(key, captured, chain, len(prompt), exact=not trimmable)
        if self.spill is None:
            return
        self._saved_keys[key] = None
        if len(self._saved_keys) > SAVED_KEYS:
            self._saved_keys.popitem(last=False)
        stored = compress(captured, where.record)
        tensors, keep = self.staging.tensors(stored)
        record = Checkpoint(
            key=key,
            kind="prefix",
            namespace=namespace,
            model_id=self.model_id,
            layout=layout,
            token_ids=list(prompt),
            trimmable=trimmable,
            block_size=BLOCK_SIZE,
            block_hashes=chain,
            metadata={**stored.meta(), "tokens": str(len(prompt))},
            tensors=tensors,
        )
        queued = self.spill.put(
            Put(
                record,
                stored.nbytes,
                if_absent=True,
                pinned=False,
                # Not in the store after all: let a later prompt send it again.
                on_failed=lambda: self._saved_keys.pop(key, None),
                on_exists=on_exists,
                keep=keep,
            )
        )
        if not queued:  # dropped (the queue was full): never sent, so not kept either
            self._saved_keys.pop(key, None)
