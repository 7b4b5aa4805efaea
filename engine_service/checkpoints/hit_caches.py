"""A store hit's caches from its record's bytes (checkpoints/prefix_reuse.py, MLX thread)."""

from __future__ import annotations

from typing import Any

from engine_service.checkpoints.cache_records import plain_kv_only, restore, restore_with_room
from engine_service.checkpoints.device_landing import (
    Landing,
    as_they_arrive,
    planes_as_they_arrive,
)
from engine_service.core.plans import PrefixPlan
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from tandem_client.direct import DirectHold


def hit_caches(landing: Landing, plan: PrefixPlan, timeout_s: float) -> tuple[list[Any], int]:
    """The record's caches and the positions they hold. A trimmable plain-KV record landed on
    the host, or read directly on MLX-CUDA, keeps only the matched positions, in planes with
    a batch step of room (device_landing.host_plane, direct_planes.py): one copy where
    landing, trimming and the batch's merge made two. Anything else lands as it was stored,
    and holds the record's tokens."""
    stored, hold = plan.stored, plan.hold
    assert stored is not None
    with_room = not plan.exact and plain_kv_only(stored.metadata)
    columns = plan.matched + BatchQuantizedKVCache.step
    host = landing.kind == "host"
    # A direct read lands all at once, while the store checks it; on MLX-CUDA only a direct
    # read is gathered into planes (a region's would be host copies).
    if with_room and isinstance(hold, DirectHold) and (host or landing.gathers_planes):
        kv = [t for t in stored.tensors if len(t.shape) == 4]
        planes = landing.direct_planes(kv, hold, plan.matched, columns)
        to_plane = lambda tensor, keep, columns: planes[id(tensor)]  # noqa: E731
    elif with_room and host and not isinstance(hold, DirectHold):
        to_plane = planes_as_they_arrive(stored, hold, timeout_s)
    else:
        arrays = as_they_arrive(landing, stored, hold, timeout_s)
        caches = restore(stored.metadata, stored.tensors, plan.layout, arrays)
        return caches, int(stored.metadata.get("tokens", plan.matched))
    caches = restore_with_room(
        stored.metadata, stored.tensors, plan.layout, to_plane, plan.matched, columns
    )
    return caches, plan.matched
