"""Captured caches -> host bytes for the store, the cheapest way the backend allows.

On MLX-CUDA a host view of a device array migrates it through managed memory, ~3 GB/s on the
MLX thread (an 8k-token prefix of a 0.6B model: ~300 ms before the next step). With a pinned
region (checkpoints/device_landing.py) the device pushes the arrays into a span of it instead
(~40 GB/s), a checkpoint round's captures together with one wait; the span travels with the
Put and is given back when the Put item is done. Elsewhere, or when no span is free, the
tensors view the arrays' own memory (cache_records.to_host, no copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engine_service.checkpoints.cache_records import CapturedCache, to_host
from engine_service.checkpoints.device_landing import Landing, push_bytes
from tandem_client.records import Tensor
from tandem_client.regions import RegionHold
from tandem_client.store_client import StoreClient


@dataclass
class Staged:
    """A round's captures as host bytes: per capture its tensors and the span holding them
    (None: they view the arrays' own memory); the device's pushes into those spans are
    complete once `wait` returned."""

    tensors: list[tuple[list[Tensor], RegionHold | None]]
    pushes: list[mx.array] = field(default_factory=list)

    def wait(self) -> None:
        if self.pushes:
            mx.eval(self.pushes)
            self.pushes = []

    def release(self) -> None:
        """Gives the spans back unsent (the round was lost before its Puts were queued)."""
        holds = {id(hold): hold for _, hold in self.tensors if hold is not None}
        for hold in holds.values():
            hold.release()


class HostStaging:
    def __init__(self, landing: Landing, store: StoreClient | None) -> None:
        self.landing = landing
        self.store = store
        self.pushed = 0  # captures the device pushed into the region

    def tensors(self, captured: CapturedCache) -> tuple[list[Tensor], RegionHold | None]:
        """The capture's tensors as host bytes (MLX thread, capture settled), and the span
        holding them when pushed (keep it until they are sent)."""
        staged = self.tensors_many([captured])
        staged.wait()
        return staged.tensors[0]

    def tensors_many(self, captures: list[CapturedCache]) -> Staged:
        """`tensors` for a checkpoint round's captures, pushed together and not waited on
        (Staged.wait before reading them). Captures packed into one buffer (a round's
        segments) are pushed as that buffer, once, into one span they all hold."""
        units: dict[int, list[int]] = {}  # one push each: a packed buffer, or a capture
        for i, captured in enumerate(captures):
            shared = captured.packed
            units.setdefault(id(shared.buffer) if shared is not None else -1 - i, []).append(i)
        members = list(units.values())
        sources = [_source(captures[unit[0]]) for unit in members]
        holds: list[RegionHold | None] = [None] * len(members)
        if self.landing.kind == "pinned" and self.store is not None:
            holds = [self.store.reserve_span(push_bytes(arrays)) for arrays in sources]
        wanted = [u for u, hold in enumerate(holds) if hold is not None]
        pushes = []
        for u in wanted:
            hold = holds[u]
            assert hold is not None
            start = hold.span.offset
            pushes.append((sources[u], hold.region.buf[start : start + hold.span.size]))
        views_of, done = self.landing.push_many(pushes)
        if done:
            # Launched now, behind the captures' copies: the wait a step later then finds
            # them written, rather than launching them and waiting on them itself.
            mx.async_eval(done)
        pushed = dict(zip(wanted, views_of, strict=True))
        tensors: list[tuple[list[Tensor], RegionHold | None]] = [([], None)] * len(captures)
        for u, unit in enumerate(members):
            views, hold = pushed.get(u), holds[u]
            for i in unit:
                captured = captures[i]
                if views is None:
                    # Not pushed: the arrays' own memory (on MLX-CUDA a host view migrates
                    # them, which is why this is only the fallback).
                    tensors[i] = (to_host(captured), None)
                    continue
                tensors[i] = (_in_span(captured, views), hold)
                self.pushed += 1
            if views is None and hold is not None:
                hold.release()
        return Staged(tensors, done)


def _source(captured: CapturedCache) -> list[mx.array]:
    """What a push moves for this capture: its shared buffer, or its own arrays."""
    return (
        [captured.packed.buffer] if captured.packed is not None else list(captured.arrays.values())
    )


def _in_span(captured: CapturedCache, views: list[memoryview]) -> list[Tensor]:
    """The capture's tensors viewing the span its push wrote (its arrays', or its shared
    buffer's, at their offsets)."""
    arrays = captured.arrays.items()
    if captured.packed is None:
        return [
            Tensor(name, captured.dtypes[name], tuple(a.shape), view)
            for (name, a), view in zip(arrays, views, strict=True)
        ]
    (buffer,) = views
    offsets = captured.packed.offsets
    return [
        Tensor(
            name,
            captured.dtypes[name],
            tuple(a.shape),
            buffer[offsets[name] : offsets[name] + a.nbytes],
        )
        for name, a in arrays
    ]
