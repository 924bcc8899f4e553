// Paged KV write: scatter the K and V rows of n new tokens into their block slots.
#include "prelude.cu"

// k, v:      [n, kv_heads, head_dim] float32, contiguous
// k_cache:   slot (b, s, h, c) at b * block_stride + (s * kv_heads + h) * head_dim + c
// v_cache:   same strides as k_cache
// block_table[t / block_size] is the block of absolute position t
// Writes exactly the slots of positions start .. start+n-1.
extern "C" __global__ void pdd_kv_write(
    const float* __restrict__ k, const float* __restrict__ v,
    kv_t* __restrict__ k_cache, kv_t* __restrict__ v_cache,
    const int* __restrict__ block_table,
    int n, int start, int kv_heads, int head_dim, int block_size, long long block_stride)
{
    const int per_token = kv_heads * head_dim;
    const long long total = (long long)n * per_token;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const int t = (int)(e / per_token);
        const int rem = (int)(e - (long long)t * per_token);
        const int pos = start + t;
        const long long dst = (long long)block_table[pos / block_size] * block_stride
                              + (long long)(pos % block_size) * per_token + rem;
        k_cache[dst] = float_to_kv(k[e]);
        v_cache[dst] = float_to_kv(v[e]);
    }
}
