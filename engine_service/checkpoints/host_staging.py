"""Captured caches -> host bytes for the store, the cheapest way the backend allows.

On MLX-CUDA a host view of a device array migrates it through managed memory, ~3 GB/s on the
MLX thread (an 8k-token prefix of a 0.6B model: ~300 ms before the next step). With a pinned
region (checkpoints/device_landing.py) the device pushes the arrays into a span of it instead (~40
GB/s);
the span travels with the Put and is given back when the Put item is done. Elsewhere, or when
no span is free, the tensors view the arrays' own memory (cache_records.to_host, no copy).
"""

from __future__ import annotations

from engine_service.checkpoints.cache_records import CapturedCache, to_host
from engine_service.checkpoints.device_landing import Landing, push_bytes
from tandem_client.records import Tensor
from tandem_client.regions import RegionHold
from tandem_client.store_client import StoreClient


class HostStaging:
    def __init__(self, landing: Landing, store: StoreClient | None) -> None:
        self.landing = landing
        self.store = store
        self.pushed = 0  # captures the device pushed into the region

    def tensors(self, captured: CapturedCache) -> tuple[list[Tensor], RegionHold | None]:
        """The capture's tensors as host bytes (MLX thread, capture settled), and the span
        holding them when pushed (keep it until they are sent)."""
        if self.landing.kind == "pinned" and self.store is not None:
            arrays = list(captured.arrays.values())
            hold = self.store.reserve_span(push_bytes(arrays))
            if hold is not None:
                start = hold.span.offset
                views = self.landing.push(arrays, hold.region.buf[start : start + hold.span.size])
                if views is not None:
                    self.pushed += 1
                    names = list(captured.arrays)
                    return [
                        Tensor(name, captured.dtypes[name], tuple(a.shape), view)
                        for name, a, view in zip(names, arrays, views, strict=True)
                    ], hold
                hold.release()
        return to_host(captured), None
