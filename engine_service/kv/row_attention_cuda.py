"""Deterministic mode's decode attention on MLX-CUDA: one kernel for the whole batch whose
reduction order depends on each row's own keys only (model/deterministic.py).

MLX's fused SDPA reduces a row's keys in blocks laid over the batch's columns, so a row's
left padding (how much longer the batch's longest row is) moves its keys between blocks and
changes its bits; row-by-row SDPA calls avoid that but cost a Python call per row and layer.
Here a block scores CHUNK positions counted from the row's first key (not the batch's first
column), reduces them in a fixed tree, and the chunks merge in order: a split past a row's end
contributes exact zeros. Flash-decoding's layout (a block per row, KV head and chunk, the G
query heads sharing that KV head together), as in kv/turboquant_cuda.py. Checked against MLX's
SDPA on the device (bench/determinism_bench.py); CI has no GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_service.kv.cuda_chunk_softmax import chunk_results, chunk_softmax, merge_chunks

AVAILABLE = mx.default_device() == mx.gpu and not mx.metal.is_available()

_ATTEND = (
    """
    constexpr int NT = 128;
    constexpr float NEG = -1e30f;
    __shared__ float q_s[G * D];
    __shared__ float score[G * CHUNK];
    __shared__ float red[G * NT];
    const int tid = threadIdx.x;
    const uint32_t L = sizes[0];
    const uint32_t splits = sizes[1];
    const uint32_t blk = blockIdx.x;
    const uint32_t split = blk % splits;
    const uint32_t bh = blk / splits;
    const uint32_t b = bh / HKV;
    const uint32_t h = bh % HKV;
    const int pad = pads[b];
    // The planes are read in place (a batch cache's planes are views of their capacity).
    const size_t k_row = (size_t)b * k_strides[0] + (size_t)h * k_strides[1];
    const size_t v_row = (size_t)b * v_strides[0] + (size_t)h * v_strides[1];
    const int n = (int)L - pad;  // the row's own keys
    for (int i = tid; i < G * D; i += NT) {  // this KV head's G query heads, scaled
        const size_t head = (size_t)h * G + i / D;
        const size_t at = (size_t)b * q_strides[0] + head * q_strides[1] + (i % D) * q_strides[3];
        q_s[i] = static_cast<float>(q[at]) * scale[0];
    }
    __syncthreads();
    const int r0 = (int)split * CHUNK;  // counted from the row's first key
    // A warp scores a key: its lanes take D / 32 coordinates each and sum them in a fixed xor
    // tree (every lane ends with the same bits), KEYS keys at a time so that a lane has
    // KEYS * D / 32 loads in flight, each warp's loads of a key one coalesced line.
    const int lane = tid & 31;
    const int warp = tid >> 5;
    constexpr int WARPS = NT / 32;
    constexpr int KEYS = 4;
    for (int j0 = warp; j0 < CHUNK; j0 += WARPS * KEYS) {
        float part[KEYS][G];
#pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            const int r = r0 + j0 + u * WARPS;
#pragma unroll
            for (int g = 0; g < G; ++g) part[u][g] = 0.f;
            if (r < n && j0 + u * WARPS < CHUNK) {
                const size_t key = k_row + (size_t)(pad + r) * k_strides[2];
#pragma unroll
                for (int d = lane; d < D; d += 32) {
                    const float c = static_cast<float>(k[key + (size_t)d * k_strides[3]]);
#pragma unroll
                    for (int g = 0; g < G; ++g) part[u][g] += q_s[g * D + d] * c;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < KEYS; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1)
                    part[u][g] += __shfl_xor_sync(0xffffffffu, part[u][g], offset);
            }
            const int j = j0 + u * WARPS;
            if (lane == 0 && j < CHUNK) {
#pragma unroll
                for (int g = 0; g < G; ++g) score[g * CHUNK + j] = r0 + j < n ? part[u][g] : NEG;
            }
        }
    }
"""
    + chunk_softmax("expf")
    + """    // A thread a value coordinate, the chunk's keys in order; VALUES keys' loads issued
    // before their sums (the order of the sums is the keys' order either way).
    constexpr int VALUES = 8;
    const int count = min(CHUNK, n - r0);  // the chunk's keys; none past the row's end
    for (int d = tid; d < DV; d += NT) {
        float acc[G];
        for (int g = 0; g < G; ++g) acc[g] = 0.f;
        for (int j0 = 0; j0 < count; j0 += VALUES) {
            float c[VALUES];
#pragma unroll
            for (int u = 0; u < VALUES; ++u) {
                const size_t at =
                    v_row + (size_t)(pad + r0 + j0 + u) * v_strides[2] + (size_t)d * v_strides[3];
                c[u] = j0 + u < count ? static_cast<float>(v[at]) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < VALUES; ++u) {
                if (j0 + u < count)
                    for (int g = 0; g < G; ++g) acc[g] += score[g * CHUNK + j0 + u] * c[u];
            }
        }
"""
    + chunk_results("DV")
)

# The chunks merged in order, each weighted by exp(its max - the overall max): a chunk past
# the row's end has weight 0 and adds exact zeros. A block per (row, head), a thread per
# output coordinate.
_COMBINE = (
    "\n"
    + merge_chunks("DV")
    + """    out[(size_t)bh * DV + d] = static_cast<T>(acc / total);
"""
)

# Key positions a block scores: a block's work is a chain over them, and a row of a few
# hundred keys would keep only a few blocks busy (measured on an H200: 49 us a layer at one
# row of 160 keys with 256, against 9 us for MLX's SDPA).
CHUNK = 64
THREADS = 128
SUPPORTED = (mx.bfloat16, mx.float16, mx.float32)

_kernels: dict[str, Any] = {}


def _kernel(
    name: str, inputs: list[str], outputs: list[str], source: str, contiguous: bool = True
) -> Any:
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=name,
            input_names=inputs,
            output_names=outputs,
            source=source,
            ensure_row_contiguous=contiguous,
        )
    return _kernels[name]


_constants: dict[tuple[tuple[int, ...], Any], mx.array] = {}
_scales: dict[float, mx.array] = {}


def _constant(values: tuple[int, ...], dtype: Any) -> mx.array:
    """A small argument array, made once per value rather than once per layer: a step's
    layers share the batch's padding and width."""
    key = (values, dtype)
    if key not in _constants:
        if len(_constants) > 4096:  # paddings come and go with rows: keep the recent ones
            _constants.clear()
        _constants[key] = mx.array(values, dtype=dtype)
    return _constants[key]


def _scale(scale: float) -> mx.array:
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    return _scales[scale]


def row_attention(
    queries: mx.array,  # (B, Hq, 1, D)
    keys: mx.array,  # (B, Hkv, L, D), row b's keys from column pads[b]
    values: mx.array,  # (B, Hkv, L, Dv)
    scale: float,
    pads: list[int] | mx.array,
    written: mx.array | None = None,
) -> mx.array:
    """One decode step's attention, each row over its own keys (module docstring). Inside a
    compiled step the paddings are an array and `written` (the columns holding keys, of
    wider planes) too; the chunks past it weigh exactly 0, so the bits are the eager step's."""
    rows, heads, _, dim = queries.shape
    kv_heads, positions, value_dim = keys.shape[1], keys.shape[2], values.shape[3]
    group = heads // kv_heads
    splits = -(-positions // CHUNK)
    if written is None:
        sizes = _constant((positions, splits), mx.uint32)
    else:
        sizes = mx.concatenate(
            [written.reshape(1).astype(mx.uint32), _constant((splits,), mx.uint32)]
        )
    row_pads = _constant(tuple(pads), mx.int32) if isinstance(pads, list) else pads.astype(mx.int32)
    template: list[tuple[str, Any]] = [
        ("T", keys.dtype),
        ("G", group),
        ("D", dim),
        ("DV", value_dim),
        ("HKV", kv_heads),
        ("CHUNK", CHUNK),
    ]
    partial, tops, sums = _kernel(
        "tandem_row_attend",
        ["q", "k", "v", "pads", "sizes", "scale"],
        ["partial", "tops", "sums"],
        _ATTEND,
        contiguous=False,  # q, keys and values by their strides (views of the batch's planes)
    )(
        inputs=[queries, keys, values, row_pads, sizes, _scale(scale)],
        template=template,
        grid=(rows * kv_heads * splits * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[
            (rows, heads, splits, value_dim),
            (rows, heads, splits),
            (rows, heads, splits),
        ],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = _kernel("tandem_row_combine", ["partial", "tops", "sums", "sizes"], ["out"], _COMBINE)(
        inputs=[partial, tops, sums, sizes],
        template=[("T", queries.dtype), ("DV", value_dim)],
        grid=(rows * heads * value_dim, 1, 1),
        threadgroup=(value_dim, 1, 1),
        output_shapes=[(rows, heads, value_dim)],
        output_dtypes=[queries.dtype],
    )
    return out.reshape(rows, heads, 1, value_dim)  # type: ignore[no-any-return]
