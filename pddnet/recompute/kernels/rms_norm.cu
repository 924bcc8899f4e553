// RMSNorm: out = x * rsqrt(mean(x^2) + eps) * weight, one thread block per row.
#include "prelude.cu"

// x, out: [rows, hidden] float32; weight: [hidden] float32. blockDim.x: a multiple of 32, <= 1024.
extern "C" __global__ void pdd_rms_norm(
    const float* __restrict__ x, const float* __restrict__ weight, float* __restrict__ out,
    int hidden, float eps)
{
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * hidden;
    float* outr = out + (long long)blockIdx.x * hidden;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float ss = 0.f;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        const float v = xr[c];
        ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        ss = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        ss = warp_sum(ss);
        if (lane == 0) partial[0] = ss;
    }
    __syncthreads();
    const float r = rsqrtf(partial[0] / (float)hidden + eps);
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) outr[c] = xr[c] * r * weight[c];
}
