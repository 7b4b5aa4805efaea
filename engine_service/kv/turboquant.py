"""The TurboQuant KV codec (Zandieh et al., 2025, "TurboQuant: online vector quantization with
near-optimal distortion rate"), in MLX ops, and the attention a batch of TurboQuant rows runs
(kv/batch_cache.py stores the rows; kv/attention_routing.py sends their attention here).

A key or value vector x of one head is stored as its norm and the indices of a scalar
codebook, one a coordinate, of the unit vector after a fixed random rotation:

    y = (x / |x|) @ R        R: a d x d random orthogonal matrix (a seed's, fixed per codec)
    idx_j = the nearest of 2^b centroids to y_j * sqrt(d)
    x_hat = |x| * (c[idx] / sqrt(d)) @ R^T

After the rotation each coordinate of a unit vector follows (nearly) N(0, 1/d), whatever x
was, so one codebook serves every vector: the Lloyd-Max quantizer of N(0, 1) at b bits,
computed here once by Lloyd's iteration. The paper bounds the mean squared error of a unit
vector by (sqrt(3) * pi / 2) * 4^-b and gives ~0.117, 0.03 and 0.009 at 2, 3 and 4 bits.

Attention never needs x_hat itself. Scores are rotation-invariant (q . k = (q @ R) . (k @ R)),
so the query is rotated once and meets the rotated keys; values are attended in the rotated
domain and the output un-rotated once (the seeds' "rotated value attention"):
sum_i p_i v_i = (sum_i p_i (v_i @ R)) @ R^T.

Indices are packed into uint32 words, 32 // b to a word (16 at 2 bits, 10 at 3, 8 at 4);
norms are float32. No library offers this codec for MLX: mlx-lm has affine quantization only.

The graphs here are the reference and what the CPU and Metal run; on MLX-CUDA the encode,
decode and decode-step attention go through kv/turboquant_cuda.py's kernels.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.device_memory import is_out_of_memory
from engine_service.kv import turboquant_cuda
from engine_service.kv.turboquant_codebooks import gaussian_codebook

BITS = (2, 3, 4)
log = logging.getLogger(__name__)


def distortion_bound(bits: int) -> float:
    """The paper's bound on a unit vector's mean squared error at b bits (Theorem 1)."""
    return math.sqrt(3) * math.pi / 2 * 4.0**-bits


@functools.lru_cache(maxsize=16)
def _rotation(head_dim: int, seed: int) -> np.ndarray:
    """A random orthogonal matrix (QR of a Gaussian, signs fixed so it is Haar-distributed);
    numpy's PCG64 makes it the same on every machine."""
    rng = np.random.Generator(np.random.PCG64(seed))
    q, r = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


@dataclass(frozen=True)
class TurboQuantPlanes:
    """One encoded tensor: [..., words] packed indices and [..., 1] norms, with the codec that
    decodes them (what a batch cache hands attention: kv/attention_routing.py routes on it)."""

    codes: mx.array  # uint32
    norms: mx.array  # float32
    codec: TurboQuantCodec


SEED = 0  # the rotation of every TurboQuant row: part of the codec (kv:turboquant:<k>:<v>)


@functools.lru_cache(maxsize=32)
def codec_for(head_dim: int, bits: int) -> TurboQuantCodec:
    """The engine's codec of a head width and bit count: built once (its rotation is a d x d
    matrix), shared by every row and layer."""
    return TurboQuantCodec(head_dim, bits, SEED)


def words_for(head_dim: int, bits: int) -> int:
    """uint32 words of one vector's packed indices."""
    return -(-head_dim // (32 // bits))


class TurboQuantCodec:
    """Encodes and decodes [..., head_dim] vectors at b bits a coordinate."""

    def __init__(self, head_dim: int, bits: int, seed: int = 0) -> None:
        if bits not in BITS:
            raise ValueError(f"TurboQuant takes {BITS} bits, not {bits}")
        self.head_dim, self.bits, self.seed = head_dim, bits, seed
        self.per_word = 32 // bits
        self.words = words_for(head_dim, bits)
        centroids, bounds = gaussian_codebook(bits)
        scale = 1 / math.sqrt(head_dim)
        self.centroids = mx.array(centroids, dtype=mx.float32) * scale
        self.bounds = mx.array(bounds, dtype=mx.float32) * scale
        self.rotation = mx.array(_rotation(head_dim, seed))
        self._shifts = mx.arange(self.per_word, dtype=mx.uint32) * bits
        # Evaluated now: a codec is shared (codec_for), and a lazy array recorded on one
        # thread's stream cannot be evaluated on another MLX thread.
        mx.eval(self.centroids, self.bounds, self.rotation, self._shifts)
        self._levels = [float(c) * scale for c in centroids]
        # One fused kernel each where the backend compiles elementwise graphs (shapes are
        # traced once per distinct shape: a batch's planes grow 256 columns at a time).
        self._quantize = mx.compile(self._quantize_graph)
        self._decoders: dict[str, Any] = {}  # by output dtype (compile takes arrays only)
        self._scaled: dict[float, mx.array] = {}  # rotate_scaled's matrices, by scale
        self._cuda = (
            turboquant_cuda.CudaKernels(head_dim, bits, self.words, self.centroids, self.bounds)
            if turboquant_cuda.AVAILABLE
            else None
        )

    def bytes_per_vector(self) -> int:
        return self.words * 4 + 4

    def rotate(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.rotation

    def rotate_scaled(self, x: mx.array, scale: float) -> mx.array:
        """x @ (R * scale): a query rotated and scaled in one matmul (the scaled rotation made
        once per scale)."""
        scaled = self._scaled.get(scale)
        if scaled is None:
            scaled = self._scaled[scale] = self.rotation * scale
            mx.eval(scaled)  # shared across threads, as the codec is
        return x.astype(mx.float32) @ scaled

    def unrotate(self, y: mx.array) -> mx.array:
        return y @ self.rotation.T

    def encode(self, x: mx.array) -> TurboQuantPlanes:
        if self._cuda is not None and turboquant_cuda.ENABLED:
            xf = x.astype(mx.float32)  # once, for the norm and the rotation
            norms = mx.linalg.norm(xf, axis=-1, keepdims=True)
            return TurboQuantPlanes(self._cuda.quantize(xf @ self.rotation, norms), norms, self)
        codes, norms = self._quantize(x)
        return TurboQuantPlanes(codes, norms, self)

    def decode_rotated(self, planes: TurboQuantPlanes, dtype: mx.Dtype = mx.float32) -> mx.array:
        """x_hat @ R in `dtype`: what attention reads (keys against a rotated query, values
        before the output's un-rotation)."""
        if self._cuda is not None and turboquant_cuda.ENABLED:
            return self._cuda.decode(planes.codes, planes.norms, dtype)
        decoder = self._decoders.get(str(dtype))
        if decoder is None:

            def decode(codes: mx.array, norms: mx.array) -> mx.array:
                return self._decode_graph(codes, norms, dtype)

            decoder = self._decoders[str(dtype)] = mx.compile(decode)
        return decoder(planes.codes, planes.norms)  # type: ignore[no-any-return]

    def decode(self, planes: TurboQuantPlanes) -> mx.array:
        return self.unrotate(self.decode_rotated(planes))

    def _quantize_graph(self, x: mx.array) -> tuple[mx.array, mx.array]:
        norms = mx.linalg.norm(x.astype(mx.float32), axis=-1, keepdims=True)
        y = self.rotate(x) / mx.maximum(norms, 1e-30)
        idx = (y[..., None] > self.bounds).sum(axis=-1).astype(mx.uint32)
        return self._pack(idx), norms

    def _decode_graph(self, codes: mx.array, norms: mx.array, dtype: mx.Dtype) -> mx.array:
        return (self._centroid(self._unpack(codes)) * norms).astype(dtype)

    def _centroid(self, idx: mx.array) -> mx.array:
        """The codebook's value of each index, as a tree of selects on the index's bits: all
        elementwise, so it fuses with the unpacking (a gather from the 2^b-entry table does
        not fuse, and MLX's CPU gather cost ~5x the whole fused decode)."""
        layer = [mx.array(v, dtype=mx.float32) for v in self._levels]
        bit = 0
        while len(layer) > 1:
            set_ = ((idx >> bit) & 1).astype(mx.bool_)
            layer = [mx.where(set_, layer[i + 1], layer[i]) for i in range(0, len(layer), 2)]
            bit += 1
        return layer[0]

    def _pack(self, idx: mx.array) -> mx.array:
        pad = self.words * self.per_word - self.head_dim
        if pad:
            idx = mx.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, pad)])
        grouped = idx.reshape(*idx.shape[:-1], self.words, self.per_word)
        return (grouped << self._shifts).sum(axis=-1).astype(mx.uint32)

    def _unpack(self, codes: mx.array) -> mx.array:
        mask = (1 << self.bits) - 1
        idx = (codes[..., None] >> self._shifts) & mask
        return idx.reshape(*codes.shape[:-1], self.words * self.per_word)[..., : self.head_dim]


def rotated_attention(
    queries: mx.array,
    keys: TurboQuantPlanes,
    values: TurboQuantPlanes,
    key_codec: TurboQuantCodec,
    value_codec: TurboQuantCodec,
    scale: float,
    mask: mx.array | None = None,
) -> mx.array:
    """Attention over TurboQuant keys and values without un-rotating either: the query is
    rotated into the keys' domain, the output out of the values'. queries: [B, H, L, D];
    keys/values: [B, H_kv, S, ...] planes (grouped-query heads repeat)."""
    q = key_codec.rotate(queries) * scale
    k = key_codec.decode_rotated(keys)
    v = value_codec.decode_rotated(values)
    heads, kv_heads = queries.shape[1], k.shape[1]
    if heads != kv_heads:
        k = mx.repeat(k, heads // kv_heads, axis=1)
        v = mx.repeat(v, heads // kv_heads, axis=1)
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    out = mx.softmax(scores, axis=-1) @ v
    return value_codec.unrotate(out).astype(queries.dtype)


def turboquant_attention(
    queries: mx.array,
    keys: TurboQuantPlanes,
    values: TurboQuantPlanes,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """What a batch of TurboQuant rows attends with: `rotated_attention`'s algebra on mlx's
    fused SDPA (grouped-query heads, masks and sinks as the plain path has them). The codes are
    decoded to rotated vectors in the queries' dtype for this step; the query is rotated in,
    the output out. queries: [B, H, L, D]; keys/values: [B, H_kv, S, ...] planes.

    The whole of it is one compiled function per codec pair, scale, dtype and mask kind:
    graph building is the decode step's bound on a GPU, and this is ~10 operations a layer."""
    kc, vc = keys.codec, values.codec
    if turboquant_cuda.ENABLED:
        return _cuda_attention(queries, keys, values, scale, mask, sinks)
    fn = _attention_graph(
        kc.head_dim,
        kc.bits,
        vc.head_dim,
        vc.bits,
        scale,
        str(queries.dtype),
        mask if isinstance(mask, str) else ("array" if mask is not None else None),
        sinks is not None,
    )
    arrays = [queries, keys.codes, keys.norms, values.codes, values.norms]
    if isinstance(mask, mx.array):
        arrays.append(mask)
    if sinks is not None:
        arrays.append(sinks)
    return fn(*arrays)  # type: ignore[no-any-return]


def _cuda_attention(
    queries: mx.array,
    keys: TurboQuantPlanes,
    values: TurboQuantPlanes,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None,
) -> mx.array:
    """MLX-CUDA: a decode step straight from the codes (turboquant_cuda.fused_attention) once
    it matched the decode + SDPA path on this device's first call; that path otherwise."""
    kc, vc = keys.codec, values.codec
    assert kc._cuda is not None and vc._cuda is not None
    dtype = queries.dtype
    out: mx.array | None = None
    if turboquant_cuda.FUSED is not False and sinks is None:
        try:
            out = turboquant_cuda.fused_attention(
                kc.rotate_scaled(queries, scale),
                (keys.codes, keys.norms, kc._cuda), (values.codes, values.norms, vc._cuda),
                mask, vc.rotation, dtype,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (a kernel this device cannot build)
            if is_out_of_memory(exc):  # the device's state now, not the kernel: the step fails
                raise
            log.warning("TurboQuant fused decode attention off: %s", exc)
            turboquant_cuda.FUSED, out = False, None
    if out is None or turboquant_cuda.FUSED is None:
        reference = mx.fast.scaled_dot_product_attention(
            kc.rotate(queries).astype(dtype),
            kc.decode_rotated(keys, dtype),
            vc.decode_rotated(values, dtype),
            scale=scale,
            mask=mask,
            sinks=sinks,
        ).astype(mx.float32)
        reference = vc.unrotate(reference).astype(dtype)
        if out is not None:  # the first fused call: checked once against the reference
            turboquant_cuda.FUSED = _fused_matches(
                out.astype(mx.float32), reference.astype(mx.float32)
            )
        out = out if turboquant_cuda.FUSED and out is not None else reference
    return out


def _fused_matches(fused: mx.array, reference: mx.array) -> bool:
    try:
        error, size = float(mx.abs(fused - reference).max()), float(mx.abs(reference).max())
    except Exception as exc:  # noqa: BLE001  (a kernel this device cannot build or run)
        if is_out_of_memory(exc):
            raise
        log.warning("TurboQuant fused decode attention off: %s", exc)
        return False
    ok = error <= 0.02 * size + 1e-3
    log.log(
        logging.INFO if ok else logging.WARNING,
        "TurboQuant fused decode attention %s: max difference %.3g (outputs up to %.3g)",
        "in use" if ok else "off, differs from the reference",
        error,
        size,
    )
    return ok


@functools.lru_cache(maxsize=64)
def _attention_graph(
    kdim: int,
    kbits: int,
    vdim: int,
    vbits: int,
    scale: float,
    dtype_name: str,
    mask_kind: str | None,
    has_sinks: bool,
) -> Any:
    kc, vc = codec_for(kdim, kbits), codec_for(vdim, vbits)

    def attend(
        q: mx.array,
        kcodes: mx.array,
        knorms: mx.array,
        vcodes: mx.array,
        vnorms: mx.array,
        *rest: mx.array,
    ) -> mx.array:
        dtype = q.dtype
        mask: mx.array | str | None = mask_kind
        if mask_kind == "array":
            mask, rest = rest[0], rest[1:]
        sinks = rest[0] if has_sinks else None
        k = kc._decode_graph(kcodes, knorms, dtype)
        v = vc._decode_graph(vcodes, vnorms, dtype)
        out = mx.fast.scaled_dot_product_attention(
            kc.rotate(q).astype(dtype), k, v, scale=scale, mask=mask, sinks=sinks
        )
        return vc.unrotate(out.astype(mx.float32)).astype(dtype)

    return mx.compile(attend)
