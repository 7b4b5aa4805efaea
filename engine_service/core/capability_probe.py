"""What a model's caches can do in this engine, found by running them.

mlx-lm architectures differ in what their attention takes: most run on quantized KV, some
(attention sinks, multi-head latent attention, ...) raise deep inside a batch step, and a
row that fails there takes the step of every row batched with it. A list per architecture
would go stale with every mlx-lm release, so the core runs a few made-up rows of each kind
through the request path on its MLX thread and keeps what failed and why: plain rows and
the engine's default KV scheme before it serves (`prepare_to_serve`), another quantized
scheme when a request first asks for it (`kv_refusal`). A request of a kind that failed is
refused with INVALID_ARGUMENT before it joins a batch (by the front when the start-up probe
knew, else by the core); an engine whose own default cannot run does not start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as cache_lib

from engine_service.device_memory import is_out_of_memory
from engine_service.loop.warmup import ProbeRow, generate_rows
from engine_service.protocol.capabilities import Capabilities, layout_refusal
from engine_service.protocol.kv_codec import GROUP_SIZES, KVCodec, Scheme

log = logging.getLogger(__name__)

PROBE_TOKENS = 3  # decode steps a probe row runs (the first one after prefill included)


class ProbeFailed(RuntimeError):
    """The model cannot generate plain batched rows, or not under the engine's default KV
    codec: the engine does not serve."""


def prepare_to_serve(
    loaded: Any, default_kv: KVCodec, new_batch: Callable[[], BatchGenerator]
) -> None:
    """Probes plain rows and the engine's default KV scheme (into loaded.capabilities) and
    checks the default codec runs; ProbeFailed otherwise."""
    loaded.capabilities = probe(loaded, new_batch)
    try:
        refusal = kv_refusal(loaded, default_kv, new_batch)
    except Exception as exc:  # the device out of memory at start-up: nothing can serve
        raise ProbeFailed(f"probing the engine's default KV codec failed: {_line(exc)}") from exc
    if refusal:
        raise ProbeFailed(f"the engine's default KV codec cannot run on this model: {refusal}")


def probe(loaded: Any, new_batch: Callable[[], BatchGenerator]) -> Capabilities:
    """Runs plain rows of two lengths in one batch (MLX thread; ProbeFailed when they fail)
    and measures the KV widths; the quantized schemes stay to be probed (kv_refusal)."""
    try:
        generate_rows(new_batch(), loaded, [ProbeRow(11), ProbeRow(6)], PROBE_TOKENS)
    except Exception as exc:
        raise ProbeFailed(f"the model cannot generate batched rows: {_line(exc)}") from exc
    why = layout_refusal(loaded.layout) or None
    return Capabilities(affine_kv=why, turboquant_kv=why, kv_widths=kv_widths(loaded.model))


def kv_refusal(loaded: Any, codec: KVCodec, new_batch: Callable[[], BatchGenerator]) -> str:
    """Why rows of this codec cannot run ("" when they can); its scheme is probed first if
    it was not yet (MLX thread: the probe's rows run in batches of their own). A probe that
    runs the device out of memory raises, its scheme left unprobed: a later request probes
    it again, where a refusal would last the engine's life."""
    caps: Capabilities = loaded.capabilities
    if codec.quantized and not caps.probed(codec.scheme):
        start = time.perf_counter()
        if codec.scheme is Scheme.TURBOQUANT:
            tq = [KVCodec.turboquant(4, 4), KVCodec.turboquant(3, 2)]
            caps = replace(caps, turboquant_kv=_quantized_rows(loaded, new_batch, tq))
        else:
            caps = replace(caps, affine_kv=_affine(loaded, new_batch, caps.kv_widths))
        loaded.capabilities = caps
        log.info(
            "probed %s KV in %.2f s: %s (KV widths %s)",
            codec.scheme.value,
            time.perf_counter() - start,
            caps.refusal(codec) or "it runs",
            list(caps.kv_widths),
        )
    return caps.refusal(codec)


def _affine(loaded: Any, new_batch: Callable[[], BatchGenerator], widths: tuple[int, ...]) -> str:
    group = next((g for g in GROUP_SIZES if all(w % g == 0 for w in widths)), 0)
    if not group:
        return f"the model's KV widths {list(widths)} are not multiples of any group size"
    return _quantized_rows(loaded, new_batch, [KVCodec(8, group), KVCodec(4, group)])


def _quantized_rows(
    loaded: Any, new_batch: Callable[[], BatchGenerator], codecs: list[KVCodec]
) -> str:
    """Why rows of these codecs (beside a plain row) cannot run, or ""."""
    why = layout_refusal(loaded.layout)
    if why:
        return why
    # A batch of one storage attends over its packed planes; a mixed batch over rows
    # decoded for the step: each path once.
    batches = [[ProbeRow(11, codec), ProbeRow(6, codec)] for codec in codecs]
    batches.append([ProbeRow(11), *(ProbeRow(6 + i, codec) for i, codec in enumerate(codecs))])
    try:
        for rows in batches:
            generate_rows(new_batch(), loaded, rows, PROBE_TOKENS)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises is the reason
        if is_out_of_memory(exc):  # the device's state now, not the model's: not recorded
            raise
        model_type = loaded.config.get("model_type", "this model")
        kind = "TurboQuant" if codecs[0].scheme is Scheme.TURBOQUANT else "affine-quantized"
        return f"{model_type} attention does not run on {kind} KV: {_line(exc)}"
    return ""


def kv_widths(model: Any) -> tuple[int, ...]:
    """The key and value widths the model's KV layers hold, read from a short solo call
    (configs name them many ways: head_dim, v_head_dim, MLA's ranks and rope widths...)."""
    cache = cache_lib.make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    widths: set[int] = set()
    for layer in _flat(cache):
        if isinstance(layer, (cache_lib.KVCache, cache_lib.RotatingKVCache)):
            keys, values = layer.keys, layer.values
            if keys is not None and values is not None:
                widths |= {int(keys.shape[-1]), int(values.shape[-1])}
    return tuple(sorted(widths))


def _flat(caches: list[Any]) -> Iterator[Any]:
    for cache in caches:
        if isinstance(cache, cache_lib.CacheList):
            yield from _flat(list(cache.caches))
        else:
            yield cache


def _line(exc: BaseException) -> str:
    """An exception's message on one line (a few of mlx's run over several)."""
    text = " ".join(str(exc).split())
    return (text or type(exc).__name__)[:200]
