"""Caches to tensor records and back, through mlx-lm's own cache contract.

Every mlx-lm cache exposes `state` (arrays and scalars, possibly nested with None and class
names, as CacheList does) and `from_state`; mlx-lm 0.32 folds what older releases kept in
`meta_state` into `state` (a `meta_state`, where a cache has one, is kept too). A layer is
encoded as its class name and a JSON skeleton of its state in which each array is replaced
by the name of a tensor record. Tensors keep their dtype name; bfloat16 travels as its raw 2-byte
words (viewed as uint16), never through float32.

Capture runs on the MLX thread and returns evaluated arrays (a device copy, so the live batch
may keep changing); `to_host` turns them into the store's `Tensor`s (views, no copy) any
thread can send. `restore` rebuilds caches from a record's bytes, `restore_captured` from a
capture still in memory (the local prefix tier) without a trip through host bytes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.device_landing import WORD_VIEWS, host_array
from engine_service.errors import Corrupt, Precondition
from engine_service.kv.batch_cache import PackedRow, PlainRow, TurboQuantRow
from engine_service.kv.ring_cache import PackedRingRow, PlainRingRow
from engine_service.kv.turboquant import BITS as TURBOQUANT_BITS
from engine_service.kv.turboquant import TurboQuantPlanes, codec_for
from engine_service.model.loading import layout_codec
from engine_service.protocol.kv_codec import layout_accepts
from tandem_client.records import Tensor

CODEC_VERSION = "tandem.cache.v1"
# Records whose skeleton names planes of a stacked tensor ({"s": [name, index]}: a checkpoint
# round's segments, checkpoints/segment_capture.py). A codec of their own: an engine that
# knows only v1 refuses them by name instead of misreading a stacked tensor as one plane.
STACKED_CODEC_VERSION = "tandem.cache.v2"
CODECS = frozenset({CODEC_VERSION, STACKED_CODEC_VERSION})
# What a compressed array (checkpoints/record_codec.py) may have been before compression.
COMPRESSIBLE_DTYPES = frozenset({"float32", "float16", "bfloat16"})
MAX_HEAD_DIM = 1024  # a TurboQuant record's head width: its codec is a d x d rotation

# Cache classes of our own a checkpoint may name, beside mlx-lm's (looked up by name there).
OWN_CLASSES: dict[str, Any] = {"TurboQuantRow": TurboQuantRow, "PackedRingRow": PackedRingRow}


def cache_class(name: str) -> Any:
    """The class a checkpoint's layer names (None: unknown)."""
    return OWN_CLASSES.get(name) or getattr(cache_lib, name, None)


@dataclass
class Packed:
    """Where a capture's arrays lie in one buffer shared with other captures (a checkpoint
    round's segments, checkpoints/segment_capture.py): moved to host memory once for all."""

    buffer: mx.array
    offsets: dict[str, int]  # array name -> its byte offset in buffer


@dataclass
class CapturedCache:
    """A snapshot of one sequence's caches: evaluated MLX arrays plus how to rebuild them."""

    arrays: dict[str, mx.array]  # name -> array as stored (bf16 viewed as uint16)
    dtypes: dict[str, str]  # name -> original dtype name
    skeleton: list[dict[str, Any]]  # per layer: class, meta_state, state skeleton
    layout: list[str]
    tokens: int  # sequence positions the caches hold
    packed: Packed | None = None  # its arrays are views of a shared buffer
    encoded: dict[str, str] | None = None  # meta(), when it is shared (segment_capture.py)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def meta(self) -> dict[str, str]:
        if self.encoded is not None:
            return dict(self.encoded)
        return {
            "codec": CODEC_VERSION,
            "cache": json.dumps(self.skeleton),
            "dtypes": json.dumps(self.dtypes),
            "layout": "|".join(self.layout),
        }


def dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def stored_view(array: mx.array, dtype: str) -> mx.array:
    """The array as a record stores it (bf16 viewed as uint16: WORD_VIEWS; no copy)."""
    view = WORD_VIEWS.get(dtype)
    return array.view(view[0]) if view else array


def capture(caches: list[Any], tokens: int, wait: bool = True, prefix: str = "") -> CapturedCache:
    """Snapshot caches on the MLX thread.

    wait=False schedules the copies (mx.async_eval) and returns at once: they are computed
    alongside the next decode step instead of stalling it; call `settle` before reading.
    prefix: prepended to tensor names (attachments share a record with the caches).
    """
    arrays: dict[str, mx.array] = {}
    dtypes: dict[str, str] = {}

    def encode(value: Any, prefix: str) -> Any:
        if isinstance(value, mx.array):
            name = prefix
            dtype = dtype_name(value)
            stored = stored_view(value, dtype)
            # MLX arrays are immutable: holding this reference keeps the snapshot's bytes even
            # as the batch writes on (an update then copies instead of reusing the buffer).
            arrays[name] = mx.contiguous(stored)
            dtypes[name] = dtype
            return {"t": name}
        if value is None or isinstance(value, (str, int, float, bool)):
            return {"v": value}
        if isinstance(value, (list, tuple)):
            return {"l": [encode(v, f"{prefix}.{i}") for i, v in enumerate(value)]}
        raise TypeError(f"cannot encode cache state of type {type(value).__name__}")

    skeleton = []
    for i, cache in enumerate(caches):
        skeleton.append(
            {
                "class": _class_name(cache),
                "meta": list(getattr(cache, "meta_state", ()) or ()),
                "state": encode(_live_state(cache), f"{prefix}l{i}"),
            }
        )
    if wait:
        mx.eval(list(arrays.values()))
    else:
        mx.async_eval(list(arrays.values()))
    return CapturedCache(arrays, dtypes, skeleton, [layout_codec(c) for c in caches], tokens)


def _class_name(cache: Any) -> str:
    """The mlx-lm class a layer restores as (a batch row restores as its solo cache)."""
    if isinstance(cache, PlainRow):
        return "KVCache"
    if isinstance(cache, PackedRow):
        return "QuantizedKVCache"
    if isinstance(cache, PlainRingRow):
        return "RotatingKVCache"
    return type(cache).__name__


def settle(captured: CapturedCache) -> None:
    """Waits for a capture's copies (MLX thread)."""
    mx.eval(list(captured.arrays.values()))


def settle_all(captures: list[CapturedCache]) -> None:
    """Waits for several captures' copies at once (MLX thread). A packed capture's copy is
    its shared buffer: that is waited on once, not its views (a round of 8 rows of a 28-layer
    model has 448; a view is evaluated where its own bytes are read: to_host)."""
    arrays: dict[int, mx.array] = {}
    for captured in captures:
        if captured.packed is not None:
            arrays[id(captured.packed.buffer)] = captured.packed.buffer
        else:
            arrays.update((id(a), a) for a in captured.arrays.values())
    mx.eval(list(arrays.values()))


def _live_state(cache: Any) -> Any:
    """The cache's state, without the unused tail of step-grown KV buffers."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if keys is None or values is None:
        return cache.state
    n = getattr(cache, "offset", 0)
    if isinstance(cache, cache_lib.KVCache):
        return keys[..., :n, :], values[..., :n, :], n
    if isinstance(cache, cache_lib.QuantizedKVCache):
        live = [tuple(p[..., :n, :] for p in planes) for planes in (keys, values)]
        return live[0], live[1], n, cache.group_size, cache.bits
    return cache.state


def host_view(array: mx.array) -> memoryview:
    """The bytes of an evaluated array, without a copy (MLX arrays export a buffer)."""
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def to_host(captured: CapturedCache) -> list[Tensor]:
    """The capture as the store's tensors, viewing evaluated memory (no copy): safe to send
    from any thread once the capture is settled."""
    if captured.packed is not None:
        settle(captured)  # its views (settle_all waited for their buffer only)
    return [
        Tensor(name, captured.dtypes[name], tuple(array.shape), host_view(array))
        for name, array in captured.arrays.items()
    ]


def restore(
    meta: dict[str, str],
    tensors: Iterable[Tensor],
    expected_layout: list[str],
    to_array: Callable[[Tensor], mx.array] = host_array,
) -> list[Any]:
    """Rebuilds caches from a checkpoint's metadata and tensors (bytes from the store);
    to_array: how bytes become an MLX array (checkpoints/device_landing.py: a host copy, or a GPU
    pull
    from the pinned region).

    Raises Precondition naming what differs when the codec or layout does not match.
    """
    by_name = {t.name: t for t in tensors}
    return _rebuild(meta, lambda name: to_array(by_name[name]), expected_layout)


def plain_kv_only(meta: dict[str, str]) -> bool:
    """Whether every layer of the record is mlx-lm's plain KVCache of two uncompressed tensors
    (its keys and values): what `restore_with_room` rebuilds."""
    try:
        return all(_plain_kv_names(layer) is not None for layer in json.loads(meta["cache"]))
    except (KeyError, TypeError, ValueError):
        return False


def restore_with_room(
    meta: dict[str, str],
    tensors: Iterable[Tensor],
    expected_layout: list[str],
    to_plane: Callable[[Tensor, int, int], mx.array],
    keep: int,
    columns: int,
) -> list[Any]:
    """A plain-KV record's caches (`plain_kv_only`) holding its first `keep` positions, each
    plane landed with room for `columns` (device_landing.host_plane), so a batch takes a lone
    row as it is instead of copying it into planes with room.

    Raises Precondition naming what differs when the codec or layout does not match."""
    _check_header(meta, expected_layout)
    by_name = {t.name: t for t in tensors}
    caches = []
    for layer in json.loads(meta["cache"]):
        names = _plain_kv_names(layer)
        if names is None:
            raise Corrupt("a layer is not a plain KV cache")
        cache = cache_lib.KVCache()
        cache.keys, cache.values = (to_plane(by_name[n], keep, columns) for n in names)
        cache.offset = keep
        caches.append(cache)
    return caches


def _plain_kv_names(layer: Any) -> tuple[str, str] | None:
    """The keys' and values' tensor names of a plain KVCache layer's skeleton, else None."""
    if not isinstance(layer, dict) or layer.get("class") != "KVCache" or layer.get("meta"):
        return None
    children = layer.get("state", {}).get("l")  # keys, values (and the offset: `_live_state`)
    if not isinstance(children, list) or len(children) not in (2, 3):
        return None
    if not all(isinstance(c, dict) and set(c) == {"t"} for c in children[:2]):
        return None
    return str(children[0]["t"]), str(children[1]["t"])


def check_restorable(
    meta: dict[str, str], tensors: Iterable[Tensor], expected_layout: list[str]
) -> None:
    """What `restore` would refuse, found without building anything (any thread): a codec or
    layout mismatch is Precondition; a skeleton that names a missing tensor, an unknown cache
    class or bytes that do not fit a tensor's shape is Corrupt."""
    _check_header(meta, expected_layout)
    by_name = {t.name: t for t in tensors}

    def fits(name: Any) -> tuple[int, ...]:
        """The shape of the tensor `name`, held and with bytes that fit it."""
        t = by_name.get(name)
        if t is None:
            raise Corrupt(f"checkpoint names tensor {name!r} but does not hold it")
        view = WORD_VIEWS.get(t.dtype)
        try:
            width = np.dtype(view[1] if view else t.dtype).itemsize
        except TypeError as exc:
            raise Corrupt(f"tensor {t.name!r} has unknown dtype {t.dtype!r}") from exc
        if math.prod(t.shape) * width != t.nbytes:  # stored_nbytes for a direct read
            raise Corrupt(f"tensor {t.name!r} holds bytes that do not fit {list(t.shape)}")
        return tuple(t.shape)

    def visit(node: Any) -> None:
        if not isinstance(node, dict):
            raise Corrupt("checkpoint cache skeleton is malformed")
        if "q" in node or "tq" in node:  # a compressed array (record_codec.py): its parts
            try:
                parts = _compressed_parts(node)
            except (KeyError, TypeError, ValueError) as exc:
                raise Corrupt("checkpoint names a malformed compressed tensor") from exc
            for part in parts:
                visit({"t": part})
        elif "t" in node:
            fits(node["t"])
        elif "s" in node:
            if meta.get("codec") != STACKED_CODEC_VERSION:
                raise Corrupt(f"a {meta.get('codec')!r} checkpoint names a stacked plane")
            try:
                name, index = _stacked_plane(node)
            except (TypeError, ValueError) as exc:
                raise Corrupt("checkpoint names a malformed stacked plane") from exc
            shape = fits(name)
            if not shape or not 0 <= index < shape[0]:
                raise Corrupt(f"checkpoint names plane {index} of tensor {name!r} {list(shape)}")
        elif "l" in node:
            for child in node["l"]:
                visit(child)
        elif "v" not in node:
            raise Corrupt("checkpoint cache skeleton is malformed")

    try:
        layers = json.loads(meta["cache"])
    except (KeyError, ValueError) as exc:
        raise Corrupt("checkpoint has no readable cache skeleton") from exc
    for layer in layers:
        if not isinstance(layer, dict) or cache_class(str(layer.get("class"))) is None:
            raise Corrupt(f"checkpoint names an unknown cache class {layer!r:.80}")
        visit(layer.get("state"))


def restore_captured(captured: CapturedCache, expected_layout: list[str]) -> list[Any]:
    """Rebuilds caches from a capture still in memory, reusing its arrays: no host round trip.

    The capture keeps its own references, so a cache that writes on gets a fresh buffer
    (MLX arrays are immutable) and the capture stays as it was.
    """

    def array(name: str) -> mx.array:
        stored = captured.arrays[name]
        dtype = captured.dtypes[name]
        return stored.view(getattr(mx, dtype)) if dtype in WORD_VIEWS else stored

    return _rebuild(captured.meta(), array, expected_layout)


def _check_header(meta: dict[str, str], expected_layout: list[str]) -> None:
    if meta.get("codec") not in CODECS:
        raise Precondition(f"checkpoint codec {meta.get('codec')!r} is not one of {sorted(CODECS)}")
    layout = meta.get("layout", "").split("|")
    if not layout_accepts(list(expected_layout), layout):
        raise Precondition(
            f"checkpoint cache layout {layout} differs from the request's {list(expected_layout)}"
        )


def _rebuild(
    meta: dict[str, str], array: Callable[[str], mx.array], expected_layout: list[str]
) -> list[Any]:
    _check_header(meta, expected_layout)
    array = functools.cache(array)  # a stacked tensor is named by each of its planes

    def decode(node: dict[str, Any]) -> Any:
        if "q" in node:
            return _expanded(node["q"], array)
        if "tq" in node:
            return _expanded_turboquant(node["tq"], array)
        if "t" in node:
            return array(node["t"])
        if "s" in node:
            name, index = _stacked_plane(node)
            return array(name)[index : index + 1]
        if "v" in node:
            return node["v"]
        return [decode(child) for child in node["l"]]

    caches = []
    for layer in json.loads(meta["cache"]):
        cls = cache_class(layer["class"])
        cache = cls.from_state(_tuples(decode(layer["state"]), layer["class"]))
        if layer["meta"]:
            cache.meta_state = tuple(layer["meta"])
        caches.append(cache)
    return caches


def stacked_plane(name: str, index: int) -> dict[str, Any]:
    """A skeleton leaf naming plane `index` (along the first axis) of the stacked tensor
    `name`, restored as an array of one plane: [1, ...] (STACKED_CODEC_VERSION)."""
    return {"s": [name, index]}


def _stacked_plane(node: dict[str, Any]) -> tuple[str, int]:
    name, index = node["s"]
    if not isinstance(name, str) or not isinstance(index, int):
        raise ValueError("a stacked plane is [tensor name, index]")
    return name, index


def _compressed_parts(node: dict[str, Any]) -> list[str]:
    if "tq" in node:
        tq = node["tq"]
        if int(tq["bits"]) not in TURBOQUANT_BITS or not 0 < int(tq["dim"]) <= MAX_HEAD_DIM:
            raise ValueError("unsupported compression")
        if str(tq["dtype"]) not in COMPRESSIBLE_DTYPES:
            raise ValueError("unsupported dtype")
        return [str(tq["codes"]), str(tq["norms"])]
    q = node["q"]
    if int(q["bits"]) not in (4, 8) or int(q["group"]) not in (32, 64):
        raise ValueError("unsupported compression")
    if str(q["dtype"]) not in COMPRESSIBLE_DTYPES:
        raise ValueError("unsupported dtype")
    return [str(q["codes"]), str(q["scales"]), str(q["biases"])]


def _expanded(q: dict[str, Any], array: Callable[[str], mx.array]) -> mx.array:
    """A compressed array (record_codec.py) as plain values again, computed on the device
    its codes landed on."""
    value = mx.dequantize(
        array(str(q["codes"])),
        array(str(q["scales"])),
        array(str(q["biases"])),
        group_size=int(q["group"]),
        bits=int(q["bits"]),
    )
    return value.astype(getattr(mx, str(q["dtype"])))


def _expanded_turboquant(tq: dict[str, Any], array: Callable[[str], mx.array]) -> mx.array:
    """A TurboQuant-coded array (record_codec.py) as plain values again, decoded on the
    device its codes landed on (the codec is the engine's: kv/turboquant.py)."""
    codec = codec_for(int(tq["dim"]), int(tq["bits"]))
    codes, norms = array(str(tq["codes"])), array(str(tq["norms"]))
    if codes.shape[-1] != codec.words or norms.shape[-1] != 1:
        raise Corrupt("a TurboQuant record's codes do not fit its head width")
    value = codec.decode(TurboQuantPlanes(codes, norms, codec))
    return value.astype(getattr(mx, str(tq["dtype"])))


def _tuples(state: Any, cls: str) -> Any:
    # CacheList's state is a list of (state, class name) pairs.
    if cls == "CacheList":
        return [(s, c) for s, c in state]
    return state
