"""The engine loop's limits (core/setup.py fills them from the flags; loop/scheduler.py obeys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.loop.preemption import ParkSettings
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec


@dataclass
class Limits:
    max_running: int = 32
    max_queued: int = 256
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    # How long the loop lingers for more arrivals before admitting new requests.
    admission_window_s: float = 0.002
    # Rows whose clients stopped reading leave their slots (loop/preemption.py).
    park: ParkSettings = field(default_factory=ParkSettings)
    # The engine's default KV codec: the warm-up's rows run under it (its kernels compile then).
    default_kv: KVCodec = PLAIN_KV
