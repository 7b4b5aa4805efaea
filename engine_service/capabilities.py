"""What a model's caches can do in this engine (found by capability_probe.py at start-up).

Pure data: it crosses from the core to the front inside ModelFacts, where requests are
checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.kv_codec import KVCodec, Scheme, request_layout


@dataclass(frozen=True)
class Capabilities:
    """What the model does in this engine; each reason is "" when it does, else one line
    saying why not."""

    affine_kv: str = ""  # affine-quantized KV rows (kv_bits 4/8)
    turboquant_kv: str = ""  # TurboQuant KV rows
    kv_widths: tuple[int, ...] = ()  # the key and value widths of its KV layers

    def refusal(self, codec: KVCodec) -> str:
        """Why a request's KV codec cannot run on this model ("" when it can)."""
        if not codec.quantized:
            return ""
        if codec.scheme is Scheme.TURBOQUANT:
            return self.turboquant_kv
        if self.affine_kv:
            return self.affine_kv
        bad = [w for w in self.kv_widths if w % codec.group_size]
        if bad:
            return f"kv_group_size {codec.group_size} does not divide the model's KV width {bad[0]}"
        return ""


def from_layout(layout: list[str], widths: tuple[int, ...]) -> Capabilities:
    """What the layout alone says (before a probe ran, or when none runs)."""
    why = layout_refusal(layout)
    return Capabilities(affine_kv=why, turboquant_kv=why, kv_widths=widths)


def layout_refusal(layout: list[str]) -> str:
    """Why a layout has nothing quantized KV applies to, or ""."""
    if request_layout(layout, KVCodec(8)) != layout:
        return ""
    nested = sorted({c for c in layout if c.startswith("list(") and "kv:" in c})
    if nested:
        return (
            f"its attention KV shares a layer cache with other state ({nested[0]}): "
            "quantized KV covers top-level KV layers only"
        )
    return f"the model has no KV layers to quantize (layout {sorted(set(layout))})"
