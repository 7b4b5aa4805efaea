"""CUDA source blocks two flash-decoding attention kernels share (kv/turboquant_cuda.py and
kv/row_attention_cuda.py), each written once.

`chunk_softmax`: a chunk's scores turned into softmax numerators, with their max and sum, in a
fixed order. Expects, in the kernel: `NT` threads, `G` query heads, `CHUNK` positions, `NEG`
as the masked score, `tid`, and shared `score[G * CHUNK]` and `red[G * NT]`. Leaves `top[g]`
(the chunk's max score) and `red[g * NT]` (its sum of exp(score - top)); a masked score
gives 0.

`chunk_results`: closes the value loop over `d` and writes a chunk's `partial`, `tops` and
`sums`. `merge_chunks`: the combine kernel's merge of a (row, head)'s chunks in order, each
weighted by exp(its max - the overall max), leaving `acc` and `total`.
"""

from __future__ import annotations


def chunk_softmax(exp: str) -> str:
    """The block, with `exp` the exponential it calls (`__expf` or the exact `expf`)."""
    return _BLOCK.replace("EXP(", exp + "(")


def chunk_results(width: str) -> str:
    """The attend kernel's end, `width` the values' width (the template name)."""
    return _RESULTS.replace("WIDTH", width)


def merge_chunks(width: str) -> str:
    """The combine kernel's merge, `width` the values' width (the template name)."""
    return _MERGE.replace("WIDTH", width)


_RESULTS = """        for (int g = 0; g < G; ++g)
            partial[(((size_t)bh * G + g) * splits + split) * WIDTH + d] = acc[g];
    }
    if (tid < G) {
        tops[((size_t)bh * G + tid) * splits + split] = top[tid];
        sums[((size_t)bh * G + tid) * splits + split] = red[tid * NT];
    }
"""

_MERGE = """    const uint32_t bh = blockIdx.x;
    const uint32_t d = threadIdx.x;
    const uint32_t splits = sizes[1];
    float top = -1e30f;
    for (uint32_t s = 0; s < splits; ++s) top = fmaxf(top, tops[bh * splits + s]);
    float total = 0.f, acc = 0.f;
    for (uint32_t s = 0; s < splits; ++s) {
        const float w = expf(tops[bh * splits + s] - top);
        total += w * sums[bh * splits + s];
        acc += w * partial[((size_t)bh * splits + s) * WIDTH + d];
    }
"""


_BLOCK = """    __syncthreads();
    for (int g = 0; g < G; ++g) {
        float m = NEG;
        for (int j = tid; j < CHUNK; j += NT) m = fmaxf(m, score[g * CHUNK + j]);
        red[g * NT + tid] = m;
    }
    __syncthreads();
    for (int stride = NT / 2; stride > 0; stride >>= 1) {
        if (tid < stride)
            for (int g = 0; g < G; ++g)
                red[g * NT + tid] = fmaxf(red[g * NT + tid], red[g * NT + tid + stride]);
        __syncthreads();
    }
    float top[G];
    for (int g = 0; g < G; ++g) top[g] = red[g * NT];
    __syncthreads();
    for (int g = 0; g < G; ++g) {
        float sum = 0.f;
        for (int j = tid; j < CHUNK; j += NT) {
            const float x = score[g * CHUNK + j];
            const float p = x <= 0.5f * NEG ? 0.f : EXP(x - top[g]);
            score[g * CHUNK + j] = p;
            sum += p;
        }
        red[g * NT + tid] = sum;
    }
    __syncthreads();
    for (int stride = NT / 2; stride > 0; stride >>= 1) {
        if (tid < stride)
            for (int g = 0; g < G; ++g) red[g * NT + tid] += red[g * NT + tid + stride];
        __syncthreads();
    }
"""
