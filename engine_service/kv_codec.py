"""How a request's full-attention KV rows are stored (plain, or quantized to 4/8 bits from
some length on), and what that does to the request's cache layout signature (DESIGN.md).

Pure data and rules, no MLX: the wire layer validates requests against it, the batch cache
(quantized_kv.py) stores rows by it, checkpoints key and check layouts with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLAIN = "plain"
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVCodec:
    """How a request's full-attention KV rows are stored: plain, or quantized to `bits` once
    the row holds `start` tokens."""

    bits: int = 0  # 0: plain (the model's dtype)
    group_size: int = 64
    start: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def storage(self) -> Any:
        return (self.bits, self.group_size) if self.bits else PLAIN

    def signature(self) -> str:
        """The layout codec id of a plain KV layer under this codec (DESIGN.md)."""
        if not self.bits:
            return "kv:plain"
        base = f"kv:quant:{self.bits}:{self.group_size}"
        return f"{base}:from{self.start}" if self.start else base

    def accepts(self, stored: str) -> bool:
        """Whether a layer captured as `stored` belongs to a row of this codec: a quantized
        row is plain until it converts."""
        if not self.bits:
            return stored == "kv:plain"
        return stored in ("kv:plain", f"kv:quant:{self.bits}:{self.group_size}")


PLAIN_KV = KVCodec()


def request_layout(layout: list[str], codec: KVCodec) -> list[str]:
    """A model's layout signature under a codec: its plain KV layers take the codec's id."""
    return [codec.signature() if c == "kv:plain" else c for c in layout]


def layout_accepts(expected: list[str], stored: list[str]) -> bool:
    """Whether caches captured with per-layer codecs `stored` fit a request layout."""
    if len(expected) != len(stored):
        return False
    for want, got in zip(expected, stored, strict=True):
        if want.startswith("kv:quant:"):
            bits, group = (int(x) for x in want.split(":")[2:4])
            if not KVCodec(bits, group).accepts(got):
                return False
        elif want != got:
            return False
    return True
