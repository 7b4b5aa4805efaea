"""Prefix reuse: a prompt's longest cached prefix, restored so only the rest is prefilled.

A prompt's block-hash chain is looked up in the in-memory tier (checkpoints/prefix_cache.py) first,
then in
the store; the longest hit wins. A local hit is rebuilt from the captured device arrays
themselves (no trip through host bytes); a store hit from the record's bytes. Either is trimmed
to the matched length. After prefill the prompt's caches are kept locally and spilled to the
store once (deduplicated, `if_absent`). Caches that cannot be trimmed are kept as exact records
instead, taken during prefill (checkpoints/prefix_snapshots.py): they serve their own length only. A
prompt that finds nothing gets a `PrefixMiss` saying why.

`find` runs on the core's planning pool (it may call the store); `materialize` on the MLX
thread, as do the saves (checkpoints/prefix_saves.py).

A hit read directly out of the store's data file may be used before the store's verdict
(`confirm_later`): its gather is only queued, the row's first forward pass runs over it (the
two overlap on MLX-CUDA), and the scheduler `confirm`s the read after that step, before any
token of the row leaves: the check passed and the lease held, or the row starts again by
recompute. No token ever comes from bytes the store did not vouch for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine_service.checkpoints.cache_records import (
    check_restorable,
    restore_captured,
)
from engine_service.checkpoints.device_landing import Landing
from engine_service.checkpoints.hit_caches import hit_caches
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.checkpoints.prefix_saves import PrefixSaves
from engine_service.checkpoints.restore_cost import RestoreCost
from engine_service.checkpoints.spill import SpillQueue
from engine_service.core.plans import PrefixMiss, PrefixPlan
from engine_service.errors import Corrupt, Precondition
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.requests import EXACT_RECORD, RecordFormat
from tandem_client.direct import DirectHold
from tandem_client.errors import DataLoss, TandemError
from tandem_client.identity import block_hashes, scope_digest
from tandem_client.records import LookupResult
from tandem_client.store_client import StoreClient

log = logging.getLogger(__name__)

# How long the MLX thread waits for a part of a progressive Get (the store copies GB/s).
ARRIVAL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class UnconfirmedRead:
    """A direct store hit whose arrays are in use before the store's verdict on them."""

    plan: PrefixPlan
    hold: DirectHold
    spent_s: float  # the read's time so far: its Get and making its caches, not the step's
    made_at: float = 0.0  # time.perf_counter() when its caches were made


class PrefixReuse:
    def __init__(
        self,
        model_id: str,
        local: PrefixCache,
        counters: CheckpointCounters,
        store: StoreClient | None = None,
        spill: SpillQueue | None = None,
        min_prefix_tokens: int = BLOCK_SIZE,
        staging: HostStaging | None = None,
        align: int = 1,
    ) -> None:
        self.model_id = model_id
        # Restored lengths are multiples of this (deterministic mode: the prefill chunk, so a
        # hit holds only positions a cold prefill computes in the same chunks, bit for bit).
        self.align = align
        self.local = local
        self.counters = counters
        self.store = store
        self.spill = spill
        self.cost = RestoreCost()  # store hit or prefill, decided per request
        # How captures become host bytes, and (its landing) how store bytes become arrays:
        # through the store's shared-memory region when the engine attached one.
        self.staging = staging if staging is not None else HostStaging(Landing(), None)
        self.landing = self.staging.landing
        # Keeping prompts' caches (prefix_saves.py): sent to the store through `spill`.
        self.saves = PrefixSaves(
            model_id, local, self.scope, spill, self.staging, min_prefix_tokens
        )

    def scope(
        self, namespace: str, layout: list[str], record: RecordFormat = EXACT_RECORD
    ) -> bytes:
        """Whose records a prompt's blocks may match: this model, this cache layout, this
        namespace, and compressed records (record_codec.py) only for the same format."""
        if record.tag:
            layout = [*layout, record.tag]
        return scope_digest(self.model_id, layout, namespace)

    def find(
        self,
        prompt: list[int],
        namespace: str,
        layout: list[str],
        record: RecordFormat = EXACT_RECORD,
    ) -> PrefixPlan | PrefixMiss:
        """The longest reusable prefix of the prompt, at most all but its last token (one
        token must be fed), or why there is none. The whole prompt is looked up, so a prompt
        seen before restores len - 1 positions (its record is trimmed by one) and feeds one
        token, instead of stopping at the last block boundary; an exact record serves only
        the length it holds."""
        usable = prompt
        if len(usable) <= BLOCK_SIZE:
            return PrefixMiss("shorter than a block")
        scope = self.scope(namespace, layout, record)
        chain = block_hashes(usable, BLOCK_SIZE, scope)
        most = len(prompt) - 1
        lengths = [min((i + 1) * BLOCK_SIZE, len(usable), most) for i in range(len(chain))]
        key, local_len, exact = self.local.match(chain, lengths)
        captured = self.local.get(key) if local_len else None
        if captured is not None and self.align > 1:
            local_len = self.aligned(local_len, captured.tokens)
            captured = captured if local_len else None
        best: PrefixPlan | PrefixMiss = (
            PrefixPlan(local_len, key, layout, local=captured, exact=exact)
            if captured
            else PrefixMiss("no stored prefix")
        )
        if self.store is not None:
            found: PrefixPlan | PrefixMiss
            try:
                found = self._from_store(usable, namespace, layout, chain, local_len, scope)
            except (DataLoss, Corrupt, Precondition) as exc:  # quarantined, or not restorable
                log.warning("prefix checkpoint unusable, prefilling instead: %s", exc)
                self.counters.add(restore_failures=1)
                found = PrefixMiss("not restorable")
            except TandemError as exc:
                log.warning("store lookup failed, prefilling instead: %s", exc)
                self.counters.add(restore_failures=1)
                found = PrefixMiss("store unavailable")
            # A store hit beats a local one (it is longer); a local hit beats any store miss.
            if isinstance(found, PrefixPlan) or isinstance(best, PrefixMiss):
                best = found
        if isinstance(best, PrefixMiss):
            self.counters.add(misses=1)
        return best

    def aligned(self, matched: int, record_tokens: int) -> int:
        """The longest restorable length, a multiple of `align`, whose positions were all
        computed in whole prefill chunks: a record of P tokens was prefilled P - 1 tokens in
        chunks from its start, its last token in a step of its own."""
        return min(matched, record_tokens - 1) // self.align * self.align

    def _lookup(
        self, chain: list[bytes], tokens: int, namespace: str, layout: list[str]
    ) -> LookupResult:
        assert self.store is not None
        return self.store.lookup(
            namespace=namespace,
            model_id=self.model_id,
            layout=layout,
            block_size=BLOCK_SIZE,
            block_hashes=chain,
            token_count=tokens,
        )

    def _from_store(
        self,
        usable: list[int],
        namespace: str,
        layout: list[str],
        chain: list[bytes],
        better_than: int,
        scope: bytes,
    ) -> PrefixPlan | PrefixMiss:
        assert self.store is not None
        hit = self._lookup(chain, len(usable), namespace, layout)
        if hit.found and not hit.trimmable and hit.record_tokens >= len(usable):
            # An exact record of the whole prompt leaves no token to feed: the longest one
            # short of the prompt's last token serves instead.
            shorter = block_hashes(usable[:-1], BLOCK_SIZE, scope)
            hit = self._lookup(shorter, len(usable) - 1, namespace, layout)
        matched = min(hit.matched_tokens, len(usable) - 1)  # one token is left to feed
        if self.align > 1:
            matched = self.aligned(matched, hit.record_tokens)
        exact = not hit.trimmable
        if not hit.found or matched <= better_than or (exact and matched != hit.record_tokens):
            return PrefixMiss("no stored prefix")
        if not self.cost.worth_restoring(matched - better_than):
            predicted = self.cost.predicted(matched - better_than)
            if predicted is not None:  # each request's choice, with its figures
                log.info(
                    "a stored prefix of %d tokens is prefilled: restoring it would take "
                    "%.1f ms, prefilling %.1f ms (restore_cost.py)",
                    matched - better_than,
                    predicted.restore_s * 1e3,
                    predicted.prefill_s * 1e3,
                )
            return PrefixMiss("cheaper to prefill")
        start = time.perf_counter()
        # Same-host: the bytes stay in the region until the MLX thread has made them arrays;
        # they arrive while it does (progressive: pulled as each part is verified).
        read = self.store.get_routed(
            hit.key, namespace, size_hint=hit.payload_bytes, progressive=True
        )
        record, hold = read.checkpoint, read.hold
        try:
            # What the MLX thread could not restore is refused here, as a miss.
            check_restorable(record.metadata, record.tensors, layout)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        return PrefixPlan(
            matched,
            hit.key,
            layout,
            stored=record,
            hold=hold,
            fetch_s=time.perf_counter() - start,
            exact=exact,
            route=read.route,
        )

    def materialize(
        self, plan: PrefixPlan, confirm_later: bool = False
    ) -> tuple[list[Any] | None, UnconfirmedRead | None]:
        """Caches for a plan (MLX thread), trimmed to the matched length; None: prefill.
        With confirm_later, a direct read's caches come back unconfirmed (and uncounted)
        with what `confirm` needs once they were used."""
        start = time.perf_counter()
        unconfirmed = None
        try:
            if plan.local is not None:
                caches = restore_captured(plan.local, plan.layout)
                held = plan.local.tokens
            else:
                assert plan.stored is not None
                later = confirm_later and isinstance(plan.hold, DirectHold)
                caches, held = self._restore_stored(plan, later)
                if later:
                    assert isinstance(plan.hold, DirectHold)
                    spent = plan.fetch_s + time.perf_counter() - start
                    unconfirmed = UnconfirmedRead(plan, plan.hold, spent, time.perf_counter())
            if held > plan.matched:
                if plan.exact or not can_trim_prompt_cache(caches):
                    if unconfirmed is not None:
                        self._let_go(unconfirmed.hold)
                    return None, None
                trim_prompt_cache(caches, held - plan.matched)
        except (Precondition, KeyError, ValueError, TandemError) as exc:
            log.warning("prefix checkpoint not restorable, prefilling instead: %s", exc)
            self.counters.add(restore_failures=1)
            if unconfirmed is not None:
                self._let_go(unconfirmed.hold)
            return None, None
        if unconfirmed is None:
            self._count_hit(plan, plan.fetch_s + time.perf_counter() - start)
        return caches, unconfirmed

    def confirm(self, read: UnconfirmedRead) -> bool:
        """After the step that used a direct read's caches (MLX thread): True when the store
        passed its bytes and the lease held until the gather had read them (then the hit
        counts); False: the row must start again from its tokens."""
        start = time.perf_counter()
        arrival = read.hold.arrival
        why = ""
        try:
            arrival.wait(arrival.total, ARRIVAL_TIMEOUT_S)
        except TandemError as exc:
            why = str(exc)
        verdict = time.perf_counter()
        held = self._let_go(read.hold)
        log.debug(  # where a direct hit's time went (bench/hit_floor_bench.py reads this)
            "direct hit phases (ms): get %.1f, caches %.1f, step %.1f, verdict %.1f, "
            "settle and release %.1f",
            read.plan.fetch_s * 1e3,
            (read.spent_s - read.plan.fetch_s) * 1e3,
            (start - read.made_at) * 1e3,
            (verdict - start) * 1e3,
            (time.perf_counter() - verdict) * 1e3,
        )
        if not why and not held:
            why = "its lease lapsed before the gather had read it"
        if why:
            log.warning("a direct store hit is recomputed instead: %s", why)
            self.counters.add(restore_failures=1)
            return False
        self._count_hit(read.plan, read.spent_s + time.perf_counter() - start)
        return True

    def _let_go(self, hold: DirectHold) -> bool:
        """Waits for every gather issued (the arrays own their bytes), then ends the lease;
        whether it held."""
        self.landing.settle()
        return hold.release() is not False

    def _count_hit(self, plan: PrefixPlan, seconds: float) -> None:
        if plan.local is not None:
            self.counters.add(local_hits=1, restore_seconds=seconds)
            return
        self.counters.add(store_hits=1, restored_bytes=plan.nbytes, restore_seconds=seconds)
        self.counters.observe_restore(plan.nbytes, seconds)
        self.cost.observe_restore(plan.nbytes, plan.matched, seconds)

    def _restore_stored(self, plan: PrefixPlan, confirm_later: bool) -> tuple[list[Any], int]:
        """A store read's caches and the positions they hold. A direct read's bytes count only
        once the store's check passed and its lease held until the arrays owned them
        (DataLoss otherwise); with confirm_later, its gather is only queued and `confirm`
        decides after the step."""
        stored, hold = plan.stored, plan.hold
        assert stored is not None
        if confirm_later:
            assert isinstance(hold, DirectHold)
            try:
                if hold.arrival.error is not None:  # the store's verdict came first: a miss
                    raise hold.arrival.error
                return hit_caches(self.landing, plan, ARRIVAL_TIMEOUT_S)
            except BaseException:
                self._let_go(hold)
                raise
        lease_held = True
        try:
            caches, held = hit_caches(self.landing, plan, ARRIVAL_TIMEOUT_S)
            if isinstance(hold, DirectHold):
                hold.arrival.wait(hold.arrival.total, ARRIVAL_TIMEOUT_S)
        finally:  # the arrays own their bytes before the span (or the lease) is given back
            self.landing.settle()
            if hold is not None:
                lease_held = hold.release() is not False
        if not lease_held:
            raise DataLoss("the direct read's lease lapsed before the arrays were made")
        return caches, held
