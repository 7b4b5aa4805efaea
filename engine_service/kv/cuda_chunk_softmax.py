"""A CUDA source block two attention kernels share (kv/turboquant_cuda.py and
kv/row_attention_cuda.py): a chunk's scores turned into softmax numerators, with their max and
sum, in a fixed order.

Expects, in the kernel: `NT` threads, `G` query heads, `CHUNK` positions, `NEG` as the masked
score, `tid`, and shared `score[G * CHUNK]` and `red[G * NT]`. Leaves `top[g]` (the chunk's
max score) and `red[g * NT]` (its sum of exp(score - top)); a masked score gives 0.
"""

from __future__ import annotations


def chunk_softmax(exp: str) -> str:
    """The block, with `exp` the exponential it calls (`__expf` or the exact `expf`)."""
    return _BLOCK.replace("EXP(", exp + "(")


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
