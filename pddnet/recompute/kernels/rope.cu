// Rotate-half RoPE, in place, angles in double precision (matches the NumPy reference).
#include "prelude.cu"

// x: [n, heads, head_dim] float32, contiguous; token t is at position start + t.
extern "C" __global__ void pdd_rope(
    float* __restrict__ x, int n, int heads, int head_dim, int start, double theta)
{
    const int half = head_dim / 2;
    const long long total = (long long)n * heads * half;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const int j = (int)(e % half);
        const long long th = e / half;  // t * heads + h
        const int t = (int)(th / heads);
        const double inv = pow(theta, -2.0 * (double)j / (double)head_dim);
        double s, c;
        sincos((double)(start + t) * inv, &s, &c);
        float* p = x + th * head_dim;
        const double x1 = p[j];
        const double x2 = p[j + half];
        p[j] = (float)(x1 * c - x2 * s);
        p[j + half] = (float)(x2 * c + x1 * s);
    }
}
