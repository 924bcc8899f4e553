// Extend attention over a paged prefix: n new query tokens attend to the whole
// prefix and causally to each other. GQA, online softmax (base 2), KV in
// fp32/fp16/bf16, accumulation in fp32. Split-K over the context (flash-decoding):
// pdd_extend_attention writes one partial result per context chunk and
// pdd_attention_combine merges them.
//
// Work decomposition, grid (q_tiles, kv_heads, splits), 4 warps per block:
//   * a query "row" is (token i, head h of the KV head's group): row = i * group + (h % group);
//   * a block owns QT = 4 * ROWS_PER_WARP rows of one KV head, and the context chunk
//     [split * chunk, split * chunk + chunk); each KV element of the chunk is read once
//     per block, whatever the group size;
//   * the query tiles of one (KV head, chunk) are adjacent in launch order, so they
//     run together and share the chunk through L2 when there are several;
//   * per tile of TK = 32 context positions, lane j scores position j against the warp's
//     rows, the warp updates its online softmax, and every lane accumulates
//     ceil(HEAD_DIM / 32) output dimensions.
#include "prelude.cu"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef ROWS_PER_WARP
#define ROWS_PER_WARP 4
#endif

#define PDD_WARPS 4
#define PDD_TK 32
#define PDD_QT (PDD_WARPS * ROWS_PER_WARP)
#define PDD_DPL ((HEAD_DIM + 31) / 32)
#define PDD_VEC (16 / (int)sizeof(kv_t))

#define PDD_THREADS (PDD_WARPS * 32)
// 16-byte loads per thread per tile, for K and for V each
#define PDD_LOADS ((PDD_TK * (HEAD_DIM / PDD_VEC) + PDD_THREADS - 1) / PDD_THREADS)

// Issue the loads of the KV tile starting at position t0 into registers
// (zeros past c_end, so the tile's tail is harmless).
__device__ __forceinline__ void load_tile(
    const kv_t* __restrict__ k_cache, const kv_t* __restrict__ v_cache,
    const int* __restrict__ block_table, uint4* kr, uint4* vr, int t0, int c_end, int kvh,
    int kv_heads, int block_size, long long block_stride)
{
#pragma unroll
    for (int u = 0; u < PDD_LOADS; ++u) {
        const int e = threadIdx.x + u * PDD_THREADS;
        const int j = e / (HEAD_DIM / PDD_VEC);
        const int c = (e - j * (HEAD_DIM / PDD_VEC)) * PDD_VEC;
        const int pos = t0 + j;
        if (e < PDD_TK * (HEAD_DIM / PDD_VEC) && pos < c_end) {
            const long long off =
                (long long)block_table[pos / block_size] * block_stride
                + ((long long)(pos % block_size) * kv_heads + kvh) * HEAD_DIM + c;
            kr[u] = __ldg(reinterpret_cast<const uint4*>(k_cache + off));
            vr[u] = __ldg(reinterpret_cast<const uint4*>(v_cache + off));
        } else {
            kr[u] = make_uint4(0u, 0u, 0u, 0u);
            vr[u] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// q:          [n, heads, HEAD_DIM] float32 (RoPE applied)
// k_cache, v_cache: slot (b, s, h, c) at b * block_stride + (s * kv_heads + h) * HEAD_DIM + c
// part_acc:   [splits, n, heads, HEAD_DIM] float32, unnormalised sums of p * v
// part_ml:    [splits, n, heads, 2] float32, (running max in log2 units, sum of p)
// scale_log2: softmax scale * log2(e)
extern "C" __global__ void __launch_bounds__(PDD_THREADS) pdd_extend_attention(
    const float* __restrict__ q,
    const kv_t* __restrict__ k_cache, const kv_t* __restrict__ v_cache,
    const int* __restrict__ block_table,
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    int n, int start, int heads, int kv_heads, int block_size, long long block_stride,
    int chunk, float scale_log2)
{
    __shared__ float qs[PDD_QT][HEAD_DIM];
    __shared__ float ks[PDD_TK][HEAD_DIM + 1];  // +1: lane j reads row j without bank conflicts
    __shared__ float vs[PDD_TK][HEAD_DIM];

    const int tile = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int group = heads / kv_heads;
    const int rows = n * group;
    const int row0 = tile * PDD_QT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int last_row = min(rows, row0 + PDD_QT) - 1;
    const int c0 = split * chunk;
    // the last position any row of this tile may see, +1; never past start + n
    const int c_end = min(c0 + chunk, start + last_row / group + 1);

    for (int e = threadIdx.x; e < PDD_QT * HEAD_DIM; e += blockDim.x) {
        const int r = e / HEAD_DIM, c = e - r * HEAD_DIM;
        const int row = row0 + r;
        float val = 0.f;
        if (row < rows) {
            const int i = row / group, h = kvh * group + (row - i * group);
            val = q[((long long)i * heads + h) * HEAD_DIM + c] * scale_log2;
        }
        qs[r][c] = val;
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][PDD_DPL];
    int limit[ROWS_PER_WARP];
    bool warp_active = false;
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = row0 + warp * ROWS_PER_WARP + rr;
        limit[rr] = row < rows ? start + row / group : -1;  // -1: a padding row sees nothing
        warp_active |= row < rows;
        m[rr] = PDD_NEG_INF;
        l[rr] = 0.f;
#pragma unroll
        for (int k = 0; k < PDD_DPL; ++k) acc[rr][k] = 0.f;
    }
    __syncthreads();

    // KV tiles go global -> registers -> (fp32) shared memory. The next tile's
    // loads are issued before the current tile is computed on, so their latency
    // hides behind the arithmetic (register double buffering).
    uint4 kr[PDD_LOADS], vr[PDD_LOADS];
    load_tile(k_cache, v_cache, block_table, kr, vr, c0, c_end, kvh, kv_heads, block_size,
              block_stride);
    for (int t0 = c0; t0 < c_end; t0 += PDD_TK) {
#pragma unroll
        for (int u = 0; u < PDD_LOADS; ++u) {
            const int e = threadIdx.x + u * PDD_THREADS;
            if (e < PDD_TK * (HEAD_DIM / PDD_VEC)) {
                const int j = e / (HEAD_DIM / PDD_VEC);
                const int c = (e - j * (HEAD_DIM / PDD_VEC)) * PDD_VEC;
                const kv_t* kp = reinterpret_cast<const kv_t*>(&kr[u]);
                const kv_t* vp = reinterpret_cast<const kv_t*>(&vr[u]);
#pragma unroll
                for (int w = 0; w < PDD_VEC; ++w) {
                    ks[j][c + w] = kv_to_float(kp[w]);
                    vs[j][c + w] = kv_to_float(vp[w]);
                }
            }
        }
        __syncthreads();
        if (t0 + PDD_TK < c_end)
            load_tile(k_cache, v_cache, block_table, kr, vr, t0 + PDD_TK, c_end, kvh, kv_heads,
                      block_size, block_stride);

        if (warp_active) {
            const int pos = t0 + lane;
            float s[ROWS_PER_WARP];
#pragma unroll
            for (int rr = 0; rr < ROWS_PER_WARP; ++rr) s[rr] = 0.f;
#pragma unroll 8
            for (int c = 0; c < HEAD_DIM; ++c) {
                const float kc = ks[lane][c];
#pragma unroll
                for (int rr = 0; rr < ROWS_PER_WARP; ++rr)
                    s[rr] += qs[warp * ROWS_PER_WARP + rr][c] * kc;
            }
            float p[ROWS_PER_WARP];
#pragma unroll
            for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
                const bool ok = pos < c_end && pos <= limit[rr];
                const float sv = ok ? s[rr] : PDD_NEG_INF;
                const float m_new = fmaxf(m[rr], warp_max(sv));
                float alpha = 1.f;
                p[rr] = 0.f;
                if (m_new != PDD_NEG_INF) {
                    alpha = exp2f(m[rr] - m_new);  // exp2f(-inf) = 0 on the first visible tile
                    p[rr] = ok ? exp2f(sv - m_new) : 0.f;
                }
                l[rr] = l[rr] * alpha + warp_sum(p[rr]);
                m[rr] = m_new;
#pragma unroll
                for (int k = 0; k < PDD_DPL; ++k) acc[rr][k] *= alpha;
            }
#pragma unroll 4
            for (int j = 0; j < PDD_TK; ++j) {
                float vj[PDD_DPL];
#pragma unroll
                for (int k = 0; k < PDD_DPL; ++k) {
                    const int c = lane + 32 * k;
                    vj[k] = c < HEAD_DIM ? vs[j][c] : 0.f;
                }
#pragma unroll
                for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
                    const float pj = __shfl_sync(PDD_FULL_MASK, p[rr], j);
#pragma unroll
                    for (int k = 0; k < PDD_DPL; ++k) acc[rr][k] += pj * vj[k];
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = row0 + warp * ROWS_PER_WARP + rr;
        if (row >= rows) continue;
        const int i = row / group, h = kvh * group + (row - i * group);
        const long long idx = ((long long)split * n + i) * heads + h;
#pragma unroll
        for (int k = 0; k < PDD_DPL; ++k) {
            const int c = lane + 32 * k;
            if (c < HEAD_DIM) part_acc[idx * HEAD_DIM + c] = acc[rr][k];
        }
        if (lane == 0) {
            part_ml[idx * 2] = m[rr];
            part_ml[idx * 2 + 1] = l[rr];
        }
    }
}

// Merge the per-chunk partials of each (token, head) row: one block per row.
// out: [n, heads, HEAD_DIM] float32; rows = n * heads.
extern "C" __global__ void pdd_attention_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    float* __restrict__ out, int rows, int splits)
{
    const int row = blockIdx.x;
    float mx = PDD_NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[((long long)s * rows + row) * 2]);
    float denom = 0.f;
    for (int s = 0; s < splits; ++s) {
        const long long idx = (long long)s * rows + row;
        const float ms = part_ml[idx * 2];
        if (ms != PDD_NEG_INF) denom += part_ml[idx * 2 + 1] * exp2f(ms - mx);
    }
    const float inv = 1.f / denom;
    for (int c = threadIdx.x; c < HEAD_DIM; c += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; ++s) {
            const long long idx = (long long)s * rows + row;
            const float ms = part_ml[idx * 2];
            if (ms != PDD_NEG_INF) o += exp2f(ms - mx) * part_acc[idx * HEAD_DIM + c];
        }
        out[(long long)row * HEAD_DIM + c] = o * inv;
    }
}
