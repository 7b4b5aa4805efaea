"""What a model's caches can do in this engine (found by core/capability_probe.py).

Pure data: it crosses from the core to the front inside ModelFacts, where requests are
checked against it. A quantized scheme is probed at start-up when it is the engine's
default, else by the core when a request first asks for it (on MLX-CUDA a probe compiles
kernels: 5-75 s a model on the H200, for schemes most engines never serve); until then it
is None, and the core decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.protocol.kv_codec import KVCodec, Scheme, request_layout


@dataclass(frozen=True)
class Capabilities:
    """What the model does in this engine; each reason is "" when it does, else one line
    saying why not, and None while that scheme was not probed."""

    affine_kv: str | None = None  # affine-quantized KV rows (kv_bits 4/8)
    turboquant_kv: str | None = None  # TurboQuant KV rows
    kv_widths: tuple[int, ...] = ()  # the key and value widths of its KV layers

    def probed(self, scheme: Scheme) -> bool:
        return self._reason(scheme) is not None

    def _reason(self, scheme: Scheme) -> str | None:
        return self.turboquant_kv if scheme is Scheme.TURBOQUANT else self.affine_kv

    def refusal(self, codec: KVCodec) -> str:
        """Why a request's KV codec cannot run on this model ("" when it can, or when its
        scheme was not probed yet)."""
        if not codec.quantized:
            return ""
        reason = self._reason(codec.scheme)
        if reason or codec.scheme is Scheme.TURBOQUANT:
            return reason or ""
        bad = [w for w in self.kv_widths if w % codec.group_size]
        if bad:
            return f"kv_group_size {codec.group_size} does not divide the model's KV width {bad[0]}"
        return ""


def from_layout(layout: list[str], widths: tuple[int, ...]) -> Capabilities:
    """What the layout alone says (before a probe ran, or when none runs)."""
    why = layout_refusal(layout) or None
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
